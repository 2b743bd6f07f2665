"""A wheel built from the tree is complete: every file the package reads at run time (the
agent's C source, the kernel configuration and patches, templates, the console) is in it,
and installed in a fresh virtualenv (what pipx does) it reports its version and finds them."""

from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import cella

ROOT = Path(__file__).resolve().parents[2]


def _tracked_data() -> set[str]:
    """The package's files that are not Python, as git knows them."""
    listed = subprocess.run(
        ["git", "ls-files", "src/cella"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.split()
    return {p.removeprefix("src/") for p in listed if not p.endswith(".py")}


def test_the_wheel_holds_the_package_data_and_installs(tmp_path: Path) -> None:
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", tmp_path / "dist", ROOT],
        check=True,
        capture_output=True,
    )
    (wheel,) = (tmp_path / "dist").glob("cella-*.whl")
    assert wheel.name.startswith(f"cella-{cella.__version__}-")
    names = set(zipfile.ZipFile(wheel).namelist())
    data = _tracked_data()
    assert {"cella/guest/agent/agent.c", "cella/images/microvm.config"} <= data
    assert data - names == set(), "package data missing from the wheel"

    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    clean = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # no tree's cella
    subprocess.run(
        [venv / "bin/pip", "install", "-q", "--no-deps", wheel],
        env=clean,
        check=True,
        capture_output=True,
    )
    # its dependencies from this interpreter's site-packages (the wheel's own cella first)
    env = {**clean, "PYTHONPATH": sysconfig.get_paths()["purelib"]}
    version = subprocess.run(
        [venv / "bin/cella", "--version"], env=env, capture_output=True, text=True, check=True
    )
    assert version.stdout.strip() == f"cella {cella.__version__}"
    probe = (
        "import cella, pathlib;"
        "from cella.images import kernel, templates, boot;"
        "assert kernel.config_fragment() and kernel.patches();"
        "assert b'main' in boot._agent_source();"
        "specs = templates.builtin_templates();"
        "assert {'default', 'docker', 'code-interpreter'} <= set(specs), specs;"
        "print(pathlib.Path(cella.__file__).parent)"
    )
    where = subprocess.run(
        [venv / "bin/python", "-c", probe], env=env, capture_output=True, text=True, check=True
    )
    assert Path(where.stdout.strip()).is_relative_to(venv), "ran the tree's cella, not the wheel's"
