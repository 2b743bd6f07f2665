from cella.cli import main

main()
