"""Volumes through the real app (fake runtime): the content API, the WebDAV door the egress
proxy takes a sandbox's mounts to (its token, its mounts, read-only ones), E2B's volume
API and its content API with the volume's token, quotas and deletion; the files' room on
the host keeps every path inside its volume."""

from __future__ import annotations

import os
import time
from collections.abc import AsyncIterator
from pathlib import Path

import httpx2
import pytest
from pydantic import ValidationError

from cella import errors
from cella.models import SandboxCreate, SandboxState, VolumeMount
from cella.policy.access import Principal
from cella.policy.volumes import PREFIX, TOKEN_HEADER
from cella.storage.volumes import VolumeFiles
from cella.store import SandboxRecord
from tests.unit.in_process import InProcess, serving

WHO = Principal.service("t")


async def chunks(*parts: bytes) -> AsyncIterator[bytes]:
    for part in parts:
        yield part


def http(app: InProcess) -> httpx2.AsyncClient:
    return httpx2.AsyncClient(
        transport=httpx2.ASGITransport(app=app.app), base_url="http://cella.test"
    )


def mounted(app: InProcess, *mounts: VolumeMount, tenant: str = "t") -> str:
    """A sandbox row of `tenant` with these volume mounts (no VM: the door needs none)."""
    sandbox_id = f"sb-{len(app.daemon.store.list_sandboxes(None, None)):016x}"
    row = SandboxRecord(
        id=sandbox_id,
        tenant=tenant,
        state=SandboxState.running,
        template="default",
        vcpus=1,
        memory_mib=512,
        volume_mounts=list(mounts),
    )
    app.daemon.store.insert_sandbox(row)
    return sandbox_id


# -- the files' room ------------------------------------------------------------------------


async def test_paths_stay_inside_the_volume(tmp_path: Path) -> None:
    files = VolumeFiles(tmp_path / "volumes")
    files.create("vol-a")
    files.create("vol-b")
    (tmp_path / "volumes" / "vol-a" / "link").symlink_to(tmp_path / "volumes" / "vol-b")
    await files.write("vol-b", "/secret", chunks(b"b's"), None)
    with pytest.raises(errors.InvalidArgument):
        files.stat("vol-a", "/../vol-b/secret")
    with pytest.raises(errors.PermissionDenied):  # a link found is never followed
        await files.read("vol-a", "/link/secret")
    entry, grew = await files.write("vol-a", "//y/", chunks(b"ok"), None)  # normalised
    assert (entry.path, grew) == ("/y", 2)
    assert b"".join([c async for c in await files.read("vol-a", "/y")]) == b"ok"  # control


async def test_a_write_replaces_the_file_whole_or_not_at_all(tmp_path: Path) -> None:
    files = VolumeFiles(tmp_path / "volumes")
    files.create("vol-a")
    await files.write("vol-a", "/f", chunks(b"old"), None)
    with pytest.raises(errors.VolumeQuotaExceeded):
        await files.write("vol-a", "/f", chunks(b"x" * 10, b"y" * 10), room=5)
    assert b"".join([c async for c in await files.read("vol-a", "/f")]) == b"old"
    assert list((tmp_path / "volumes" / ".tmp").iterdir()) == []  # nothing left behind
    await files.write("vol-a", "/f", chunks(b"x" * 8), room=5)  # 5 more than the 3 it held
    assert files.stat("vol-a", "/f").size == 8


def test_mount_model() -> None:
    with pytest.raises(ValidationError):
        VolumeMount(volume="v", path="relative")
    with pytest.raises(ValidationError):  # paths of all mounts are checked together
        SandboxCreate.model_validate(
            {
                "volume_mounts": [{"volume": "a", "path": "/mnt"}],
                "bucket_mounts": [
                    {"id": "b", "type": "s3", "path": "/mnt/b", "bucket": "bucket-1"}
                ],
            }
        )
    ok = SandboxCreate.model_validate({"volume_mounts": [{"volume": "a", "path": "/mnt/a/"}]})
    assert ok.volume_mounts[0].path == "/mnt/a"


# -- cella's API --------------------------------------------------------------------------


async def test_content_api_quota_and_deletion(tmp_path: Path) -> None:
    async with serving(tmp_path, max_volume_mib_per_tenant=1) as app, app.client() as client:
        vol = await client.create_volume("data")
        with pytest.raises(errors.AlreadyExists):
            await client.create_volume("data")
        await vol.write("/a/b.txt", "hello", parents=True)
        assert await vol.read_text("/a/b.txt") == "hello"
        assert [e.path for e in await vol.list("/", depth=2)] == ["/a", "/a/b.txt"]
        with pytest.raises(errors.VolumeQuotaExceeded):
            await vol.write("/big", b"x" * (2 << 20))
        await vol.write("/fits", b"x" * (512 << 10))  # the control: under the quota
        listed = await client.volumes()
        assert listed.quota_bytes == 1 << 20 and listed.used_bytes == 5 + (512 << 10)
        with pytest.raises(errors.NotFound):
            await vol.read("/big")

        record = app.daemon.store.volume_by_id(vol.id)
        assert record is not None
        user = mounted(app, VolumeMount(volume=vol.id, path="/mnt/v"), tenant=record.tenant)
        with pytest.raises(errors.InUse, match=user):
            await client.delete_volume("data")
        assert (await vol.refresh()).info.used_by == [user]
        await client.delete_volume("data", force=True)
        assert not (tmp_path / "volumes" / vol.id).exists()  # its files are gone
        with pytest.raises(errors.NotFound):
            await client.volume("data")


async def test_another_tenants_volume_is_not_found(tmp_path: Path) -> None:
    async with serving(tmp_path) as app:
        _, other = app.daemon.keys.create("other")
        async with app.client() as mine, app.client(other) as theirs:
            vol = await mine.create_volume("data")
            with pytest.raises(errors.NotFound):
                await theirs.volume(vol.id)
            with pytest.raises(errors.InvalidArgument, match="no volume"):
                app.daemon.volumes.settle(
                    Principal.service("other"),
                    SandboxCreate(volume_mounts=[VolumeMount(volume=vol.id, path="/v")]),
                )
            assert (await mine.volume(vol.id)).name == "data"  # the control


# -- the egress proxy's door ----------------------------------------------------------------


async def test_dav_door_needs_the_token_and_a_mount(tmp_path: Path) -> None:
    async with serving(tmp_path) as app:
        vols = app.daemon.volumes
        rw, ro, unmounted = (vols.create(WHO, n) for n in ("rw", "ro", "other"))
        sandbox = mounted(
            app,
            VolumeMount(volume=rw.id, path="/rw"),
            VolumeMount(volume=ro.id, path="/ro", read_only=True),
        )
        token = {TOKEN_HEADER: app.daemon.ports.mount_token(sandbox)}
        base = f"{PREFIX}/{sandbox}"
        async with http(app) as c:
            put = await c.put(f"{base}/{rw.id}/f.txt", content=b"data", headers=token)
            assert put.status_code == 201
            listing = await c.request("PROPFIND", f"{base}/{rw.id}/", headers=token)
            assert listing.status_code == 207 and f"{base}/{rw.id}/f.txt" in listing.text
            got = await c.get(f"{base}/{rw.id}/f.txt", headers=token | {"Range": "bytes=1-2"})
            assert (got.status_code, got.content) == (206, b"at")
            moved = await c.request(
                "MOVE",
                f"{base}/{rw.id}/f.txt",
                headers=token | {"Destination": f"http://volumes.cella{base}/{rw.id}/g.txt"},
            )
            assert moved.status_code == 201

            no_token = await c.get(f"{base}/{rw.id}/g.txt")
            assert no_token.status_code == 403
            wrong = {TOKEN_HEADER: app.daemon.ports.mount_token("sb-else")}
            assert (await c.get(f"{base}/{rw.id}/g.txt", headers=wrong)).status_code == 403
            not_mounted = await c.get(f"{base}/{unmounted.id}/", headers=token)
            assert not_mounted.status_code == 404

            await vols.write(vols.record(WHO, "ro"), "/r.txt", chunks(b"read me"))
            refused = await c.put(f"{base}/{ro.id}/w.txt", content=b"no", headers=token)
            assert refused.status_code == 403 and "read-only" in refused.text
            deleted = await c.delete(f"{base}/{ro.id}/r.txt", headers=token)
            assert deleted.status_code == 403
            read = await c.get(f"{base}/{ro.id}/r.txt", headers=token)  # the control
            assert (read.status_code, read.content) == (200, b"read me")


async def test_an_expired_or_revoked_mount_token_is_refused(tmp_path: Path) -> None:
    async with serving(tmp_path) as app, http(app) as c:
        vol = app.daemon.volumes.create(WHO, "data")
        sandbox = mounted(app, VolumeMount(volume=vol.id, path="/v"))
        ports = app.daemon.ports
        url = f"{PREFIX}/{sandbox}/{vol.id}/"
        expired = {TOKEN_HEADER: ports.mount_token(sandbox, int(time.time()) - 1)}
        refused = await c.request("PROPFIND", url, headers=expired)
        assert refused.status_code == 403 and "expired" in refused.text
        forged = {TOKEN_HEADER: f"{int(time.time()) + 9999}." + expired[TOKEN_HEADER][11:]}
        assert (await c.request("PROPFIND", url, headers=forged)).status_code == 403
        renewed = {TOKEN_HEADER: ports.mount_token(sandbox)}  # the control: a fresh one
        assert (await c.request("PROPFIND", url, headers=renewed)).status_code == 207
        app.daemon.registry.update(sandbox, state=SandboxState.deleted)
        gone = await c.request("PROPFIND", url, headers=renewed)
        assert gone.status_code == 403 and "deleted" in gone.text  # revoked with the sandbox


# -- E2B's API ------------------------------------------------------------------------------


async def test_e2b_volumes_and_content_with_the_volume_token(tmp_path: Path) -> None:
    async with serving(tmp_path) as app, http(app) as c:
        key = {"X-API-KEY": app.admin_key}
        made = await c.post("/volumes", json={"name": "shared"}, headers=key)
        assert made.status_code == 201
        vol = made.json()
        assert set(vol) == {"volumeID", "name", "token"}
        bearer = {"Authorization": f"Bearer {vol['token']}"}
        content = f"/volumecontent/{vol['volumeID']}"

        bad = await c.post("/volumes", json={"name": "no spaces"}, headers=key)
        assert bad.status_code == 400 and bad.json()["code"] == 400
        missing = await c.get("/volumes/vol-0000000000000000", headers=key)
        assert missing.status_code == 404 and missing.json()["code"] == 404

        wrote = await c.put(
            f"{content}/file", params={"path": "/d/f.txt", "force": "true"}, content=b"hi",
            headers=bearer,
        )  # fmt: skip
        assert wrote.status_code == 201 and wrote.json()["size"] == 2
        again = await c.put(f"{content}/file", params={"path": "/d/f.txt"}, content=b"x",
                            headers=bearer)  # fmt: skip
        assert again.status_code == 409  # without force, E2B's orchestrator does not replace
        read = await c.get(f"{content}/file", params={"path": "/d/f.txt"}, headers=bearer)
        assert read.content == b"hi"
        listing = await c.get(f"{content}/dir", params={"path": "/", "depth": 2}, headers=bearer)
        assert [(e["path"], e["type"]) for e in listing.json()] == [
            ("/d", "directory"),
            ("/d/f.txt", "file"),
        ]
        owners = await c.post(f"{content}/dir", params={"path": "/e", "uid": 5}, headers=bearer)
        assert owners.status_code == 400 and "uid" in owners.json()["message"]

        other = (await c.post("/volumes", json={"name": "other"}, headers=key)).json()
        wrong = {"Authorization": f"Bearer {other['token']}"}
        refused = await c.get(f"{content}/file", params={"path": "/d/f.txt"}, headers=wrong)
        assert refused.status_code == 401 and refused.json()["code"] == 401

        gone = await c.delete(f"{content}/path", params={"path": "/d"}, headers=bearer)
        assert gone.status_code == 204
        stat = await c.get(f"{content}/path", params={"path": "/d"}, headers=bearer)
        assert stat.status_code == 404 and stat.json()["code"] == 404
        assert (await c.delete(f"/volumes/{vol['volumeID']}", headers=key)).status_code == 204
        assert not os.path.exists(tmp_path / "volumes" / vol["volumeID"])
