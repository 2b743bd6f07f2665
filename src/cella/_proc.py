"""Running host tools (apt, mmdebstrap, mkfs, qemu-img) with their output kept for errors."""

from __future__ import annotations

import subprocess
from collections import deque
from collections.abc import Callable, Sequence
from pathlib import Path

from cella import errors

Progress = Callable[[str], None]


def quiet(_: str) -> None:
    """A progress sink that drops everything."""


def run(
    cmd: Sequence[str | Path],
    *,
    progress: Progress | None = None,
    env: dict[str, str] | None = None,
    cwd: Path | None = None,
) -> str:
    """Runs a command, streaming its lines to `progress`; raises BuildFailed with its tail."""
    tail: deque[str] = deque(maxlen=40)
    lines: list[str] = []
    with subprocess.Popen(
        [str(c) for c in cmd],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        text=True,
        errors="replace",
        env=env,
        cwd=cwd,
    ) as proc:
        assert proc.stdout is not None
        for line in proc.stdout:
            line = line.rstrip("\n")
            tail.append(line)
            lines.append(line)
            if progress is not None and line:
                progress(line)
        rc = proc.wait()
    if rc != 0:
        shown = "\n".join(tail)
        raise errors.BuildFailed(f"{Path(str(cmd[0])).name} exited with {rc}:\n{shown}")
    return "\n".join(lines)
