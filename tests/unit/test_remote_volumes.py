"""A node's record of the volumes of other nodes a fleet gateway lent it (a file of its own)."""

from __future__ import annotations

from pathlib import Path

import pytest

from cella import errors
from cella.service.remote_volumes import RemoteVolume, RemoteVolumes


def test_lent_volumes_are_found_by_id_or_name_and_kept_across_restarts(tmp_path: Path) -> None:
    path = tmp_path / "remote-volumes.json"
    lent = RemoteVolumes(path)
    lent.put(RemoteVolume("vol-1", "acme", "data", "https://127.0.0.2:9", "tok"))
    lent.put(RemoteVolume("vol-2", "globex", "data", "https://127.0.0.3:9", "tok2"))
    assert lent.find("acme", "data").id == "vol-1"  # type: ignore[union-attr]
    assert lent.find("acme", "vol-1") is not None
    assert lent.find("acme", "vol-2") is None  # another tenant's
    assert path.stat().st_mode & 0o777 == 0o600  # it holds tokens
    again = RemoteVolumes(path)
    assert again.find("globex", "data").url == "https://127.0.0.3:9"  # type: ignore[union-attr]
    again.forget("vol-2")
    assert RemoteVolumes(path).find("globex", "data") is None


def test_a_certificate_that_is_none_is_refused_when_lent(tmp_path: Path) -> None:
    lent = RemoteVolumes(tmp_path / "r.json")
    with pytest.raises(errors.InvalidArgument, match="PEM"):
        lent.put(RemoteVolume("vol-1", "acme", "data", "https://x", "t", ca_pem="nonsense"))
    assert lent.find("acme", "data") is None
