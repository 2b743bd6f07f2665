"""`cella files ...`: a sandbox's directory trees walked, files moved and given to users,
links that download one file without a key,
through the sync SDK (copies are `cella sandbox cp`)."""

from __future__ import annotations

from typing import Annotated

import typer
from rich.markup import escape

from cella.cli._output import Listing, console, emit_json, out
from cella.sdk import Client

app = typer.Typer(
    help="Walk, move and chown files in a sandbox; links that download one.",
    no_args_is_help=True,
    rich_markup_mode="markdown",
)
JsonOpt = Annotated[bool, typer.Option("--json", help="Print machine-readable JSON.")]


@app.command()
def walk(
    sandbox_id: str,
    path: str,
    depth: Annotated[
        int | None, typer.Option(help="levels below PATH (default: the bound)")
    ] = None,
    limit: Annotated[int | None, typer.Option(help="entries at most (default: the bound)")] = None,
    json_: JsonOpt = False,
) -> None:
    """List the entries under a directory, breadth first, within the daemon's bounds."""
    with Client() as client:
        tree = client.get(sandbox_id).files.walk(path, depth=depth, limit=limit)
    if json_:
        emit_json(tree.model_dump(mode="json"))
        return
    table = Listing("path", "kind", "mode", "size", ids=("path",))
    for e in tree.entries:
        shown = f"{e.path} -> {e.target}" if e.target else e.path
        table.add_row(escape(shown), e.kind, f"{e.mode & 0o7777:04o}", str(e.size))
    out.print(table)
    if tree.truncated:
        console.print("[yellow]truncated[/yellow]: a bound ended the walk; ask for less")


@app.command()
def mv(sandbox_id: str, source: str, destination: str, json_: JsonOpt = False) -> None:
    """Rename a file or directory (a file at DESTINATION is replaced)."""
    with Client() as client:
        entry = client.get(sandbox_id).files.move(source, destination)
    if json_:
        emit_json(entry.model_dump(mode="json"))
    else:
        console.print(f"moved {source} to {destination}", highlight=False, markup=False)


@app.command()
def chown(
    sandbox_id: str,
    path: str,
    owner: Annotated[str, typer.Argument(help="USER or USER:GROUP (names or numeric ids)")],
    recursive: Annotated[bool, typer.Option("--recursive", "-R", help="and all below")] = False,
) -> None:
    """Give a path to a user and group (without a group, the user's login group)."""
    user, _, group = owner.partition(":")
    with Client() as client:
        client.get(sandbox_id).files.chown(path, user, group or None, recursive=recursive)
    console.print(f"{path} now belongs to {owner}", highlight=False, markup=False)


@app.command()
def url(
    sandbox_id: str,
    path: str,
    expires: Annotated[
        int, typer.Option(help="seconds the link lasts; 0: it never expires")
    ] = 3600,
    inline: Annotated[bool, typer.Option(help="served inline, not as an attachment")] = False,
    json_: JsonOpt = False,
) -> None:
    """Print a link that downloads one file without a key (pinned to PATH), until it expires."""
    with Client() as client:
        link = client.get(sandbox_id).files.download_url(
            path,
            expires_in_seconds=expires or None,
            content_disposition="inline" if inline else "attachment",
        )
    if json_:
        emit_json(link.model_dump(mode="json"))
    else:
        out.print(link.url, highlight=False, markup=False, soft_wrap=True)
