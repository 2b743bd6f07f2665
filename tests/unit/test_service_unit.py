"""The systemd unit `cella setup --service` installs, checked by systemd itself."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest

from cella.cli.service_unit import unit_text, verify

pytestmark = pytest.mark.skipif(
    shutil.which("systemd-analyze") is None, reason="needs systemd-analyze"
)


def test_the_unit_verifies_and_keeps_vms_across_restarts(tmp_path: Path) -> None:
    cella = Path(sys.executable).with_name("cella")
    unit = tmp_path / "cella.service"
    unit.write_text(unit_text(cella, Path("/var/lib/cella"), "127.0.0.1:8420"))
    assert verify(unit) == ""
    text = unit.read_text()
    assert "Restart=on-failure" in text and "KillMode=process" in text
    assert f"ExecStart={cella} serve --listen 127.0.0.1:8420" in text


def test_a_broken_unit_is_caught(tmp_path: Path) -> None:
    """The control: the same check finds a unit whose command does not exist."""
    unit = tmp_path / "cella.service"
    unit.write_text(unit_text(tmp_path / "no-such-cella", Path("/var/lib/cella"), "127.0.0.1:1"))
    assert "no-such-cella" in verify(unit)
