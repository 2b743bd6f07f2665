"""Generates the sync SDK (`_sync/`) from the async one (`_async/`) with unasync.

python -m cella.sdk._generate          # rewrite _sync/
python -m cella.sdk._generate --check  # exit 1 if _sync/ is stale
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
from pathlib import Path

import unasync

HERE = Path(__file__).parent
REPLACEMENTS = {
    "AsyncClient": "Client",
    "AsyncSandbox": "Sandbox",
    "AsyncFiles": "Files",
    "AsyncSnapshot": "Snapshot",
    "AsyncVolume": "Volume",
    "AsyncBaseTransport": "BaseTransport",
    "AsyncHTTPTransport": "HTTPTransport",
    "AsyncFailover": "Failover",
    "handle_async_request": "handle_request",
    "aclose": "close",
    "aiter_bytes": "iter_bytes",
    "aiter_lines": "iter_lines",
    "aread": "read",
    "asynccontextmanager": "contextmanager",
    "_async": "_sync",
}
HEADER = "# Generated from ../_async by `python -m cella.sdk._generate`: do not edit.\n"


def generate(out_dir: Path) -> list[Path]:
    sources = sorted((HERE / "_async").glob("*.py"))
    with tempfile.TemporaryDirectory() as tmp:
        stage_in = Path(tmp) / "_async"
        stage_out = Path(tmp) / "_sync"
        stage_in.mkdir()
        for src in sources:
            (stage_in / src.name).write_text(src.read_text())
        rule = unasync.Rule(
            fromdir=str(stage_in) + "/",
            todir=str(stage_out) + "/",
            additional_replacements=REPLACEMENTS,
        )
        unasync.unasync_files([str(stage_in / s.name) for s in sources], rules=[rule])
        written = []
        out_dir.mkdir(parents=True, exist_ok=True)
        for src in sources:
            text = (stage_out / src.name).read_text()
            if src.name != "__init__.py":
                text = HEADER + text
            target = out_dir / src.name
            target.write_text(text)
            written.append(target)
    subprocess.run([sys.executable, "-m", "ruff", "format", "-q", *map(str, written)], check=True)
    subprocess.run(
        [
            sys.executable,
            "-m",
            "ruff",
            "check",
            "-q",
            "--fix",
            "--select",
            "I,F401",
            *map(str, written),
        ],
        check=False,
    )
    return written


def main() -> int:
    if "--check" in sys.argv:
        with tempfile.TemporaryDirectory() as tmp:
            fresh = generate(Path(tmp))
            stale = [
                f.name for f in fresh if f.read_text() != (HERE / "_sync" / f.name).read_text()
            ]
        if stale:
            print(f"sync SDK is stale: {', '.join(stale)}; run python -m cella.sdk._generate")
            return 1
        return 0
    generate(HERE / "_sync")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
