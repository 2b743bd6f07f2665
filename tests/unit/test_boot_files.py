"""The guest's boot files are the same bytes on every host that builds them from the same
source: a memory snapshot names its initramfs, which holds the agent, so a node of another
host finds the snapshot's initramfs only if its own agent came out byte for byte the same."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from cella.images.boot import _agent_source, compile_static
from cella.paths import Paths


@pytest.mark.skipif(shutil.which("gcc") is None, reason="gcc builds the agent")
def test_two_hosts_compile_the_same_agent(tmp_path: Path) -> None:
    one = compile_static(Paths(tmp_path / "a"), "agent", _agent_source())
    other = compile_static(Paths(tmp_path / "b"), "agent", _agent_source())
    assert one.name == other.name
    assert one.read_bytes() == other.read_bytes()
    assert not list((tmp_path / "a" / "images" / "tmp").iterdir())  # nothing left behind
    # the control: another source is another program, under another name
    changed = compile_static(Paths(tmp_path / "a"), "agent", _agent_source() + b"\n/* */\n")
    assert changed.name != one.name
