"""Volumes end to end: real microVMs mount a tenant's volume with rclone over WebDAV, whose
requests go through the real egress proxy to the real daemon, which serves the volume from
its own directory. Driven by the pinned E2B SDK (sync and async: `Volume`, `volume_mounts`,
the volume content API with the volume's token) and by cella's SDK (read-only mounts, a
fork mounting the same volume)."""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx2
import pytest

from cella import Client, Sandbox, errors
from cella.models import VolumeMount
from cella.policy.volumes import PREFIX, TOKEN_HEADER
from tests.daemon import Daemon
from tests.sdk_env import run_script, sdk_python

pytestmark = pytest.mark.vm
E2B = ["e2b==2.63.0"]
QUOTA_MIB = 4
TOKEN_SECONDS = 6  # the proxy's mount tokens: renewed every 2 s


@pytest.fixture(scope="module")
def python() -> Path:
    return sdk_python("e2b-2.63.0", E2B)


@pytest.fixture(scope="module")
def daemon_settings() -> dict[str, str]:
    return {
        "pool_size": "0",
        "max_volume_mib_per_tenant": str(QUOTA_MIB),
        "volume_mount_token_seconds": str(TOKEN_SECONDS),
    }


def e2b(python: Path, daemon: Daemon, script: str) -> Any:
    env = {
        "E2B_API_URL": daemon.url,
        "E2B_SANDBOX_URL": daemon.url,
        "E2B_VOLUME_API_URL": daemon.url,  # the content API is served beside the API
        "E2B_API_KEY": daemon.admin_key,
    }
    preamble = "import asyncio, json, time\nfrom e2b import *\n"
    preamble += "from e2b.exceptions import VolumeNotFoundException, VolumeException\n"
    return run_script(python, preamble + textwrap.dedent(script), env)


def until(what: Callable[[], Any], timeout: float = 30) -> Any:
    """`what()` once it answers without an error (a file another sandbox wrote shows up
    once its upload, started when it was closed, is done)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return what()
        except errors.CellaError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


def test_e2b_two_sandboxes_share_a_volume_that_outlives_them(python: Path, daemon: Daemon) -> None:
    got = e2b(
        python,
        daemon,
        """
        def until(read):
            for _ in range(150):
                try:
                    return read()
                except Exception:
                    time.sleep(0.2)
            return read()

        vol = Volume.create("shared-sync")
        a = Sandbox.create(volume_mounts={"/mnt/shared": vol})
        b = Sandbox.create(volume_mounts={"/mnt/shared": "shared-sync"})
        mounts = [(m["name"], m["path"]) for m in b.get_info().volume_mounts]
        a.files.write("/mnt/shared/from-a.txt", "written in a")
        seen_in_b = until(lambda: b.files.read("/mnt/shared/from-a.txt"))
        b.commands.run("mkdir -p /mnt/shared/d && echo written in b > /mnt/shared/d/from-b.txt")
        seen_in_a = until(lambda: a.files.read("/mnt/shared/d/from-b.txt"))
        a.kill()
        b.kill()
        # no sandbox left: the content API still has every file
        kept = vol.read_file("/from-a.txt")
        listing = sorted(e.path for e in vol.list("/", depth=2))
        info = Volume.get_info(vol.volume_id)
        try:
            Volume.get_info("vol-0000000000000000")
            unknown = "found"
        except VolumeNotFoundException as exc:
            unknown = type(exc).__name__
        print(json.dumps({"mounts": mounts, "in_b": seen_in_b, "in_a": seen_in_a, "kept": kept,
                          "listing": listing, "name": info.name, "unknown": unknown,
                          "listed": [v.name for v in Volume.list()]}))
        """,
    )
    assert got["mounts"] == [["shared-sync", "/mnt/shared"]]
    assert got["in_b"] == "written in a"
    assert got["in_a"] == "written in b\n"
    assert got["kept"] == "written in a"
    assert got["listing"] == ["/d", "/d/from-b.txt", "/from-a.txt"]
    assert got["name"] == "shared-sync" and "shared-sync" in got["listed"]
    assert got["unknown"] == "VolumeNotFoundException"


def test_e2b_async_content_api_and_quota(python: Path, daemon: Daemon) -> None:
    got = e2b(
        python,
        daemon,
        f"""
        async def main():
            vol = await AsyncVolume.create("shared-async")
            await vol.write_file("/in/seed.txt", "from the content API", force=True)
            sb = await AsyncSandbox.create(volume_mounts={{"/data": vol}})
            read = await sb.commands.run("cat /data/in/seed.txt")
            await sb.commands.run("echo from the sandbox > /data/out.txt")
            for _ in range(150):
                try:
                    out = await vol.read_file("/out.txt")
                    break
                except Exception:
                    await asyncio.sleep(0.2)
            await sb.kill()
            small = await vol.write_file("/fits.bin", b"x" * (1 << 20), force=True)
            try:
                await vol.write_file("/big.bin", b"x" * ({QUOTA_MIB} << 20), force=True)
                refused = None
            except VolumeException as exc:
                refused = str(exc)
            exists = await vol.exists("/big.bin")
            await AsyncVolume.destroy(vol.volume_id)
            gone = await AsyncVolume.destroy(vol.volume_id)
            print(json.dumps({{"read": read.stdout, "out": out, "small": small.size,
                              "refused": refused, "exists": exists, "gone": gone}}))

        asyncio.run(main())
        """,
    )
    assert got["read"] == "from the content API"
    assert got["out"] == "from the sandbox\n"
    assert got["small"] == 1 << 20  # the control: under the quota
    assert got["refused"] and "quota" in got["refused"]
    assert got["exists"] is False  # nothing of the refused write was kept
    assert got["gone"] is False  # destroyed once: the second is E2B's 404


def test_read_only_mount_refuses_writes_and_a_fork_shares_the_volume(admin: Client) -> None:
    vol = admin.create_volume("cella-shared")
    vol.write("/readme.txt", "shared state\n")
    sb: Sandbox | None = None
    fork: Sandbox | None = None
    try:
        sb = admin.create(
            volume_mounts=[
                VolumeMount(volume="cella-shared", path="/rw"),
                VolumeMount(volume=vol.id, path="/ro", read_only=True),
            ]
        )
        assert sb.info.mount_states[f"volume-{vol.id}"].state == "mounted"
        assert sb.exec("cat /ro/readme.txt").stdout == b"shared state\n"  # control: reads
        refused = sb.exec("echo no > /ro/new.txt")
        assert refused.exit_code != 0 and b"Read-only" in refused.stderr
        with pytest.raises(errors.NotFound):
            vol.stat("/new.txt")
        assert sb.exec("echo yes > /rw/new.txt").exit_code == 0  # the same volume, read-write
        assert until(lambda: vol.read("/new.txt")) == b"yes\n"

        fork = sb.fork()[0]
        assert fork.exec("echo from the fork > /rw/fork.txt").exit_code == 0
        assert until(lambda: vol.read("/fork.txt")) == b"from the fork\n"
        seen = until(lambda: _read(sb, "/rw/fork.txt"))
        assert seen == b"from the fork\n"  # the fork wrote to the volume, not to a copy

        with pytest.raises(errors.InUse):
            admin.delete_volume("cella-shared")
    finally:
        for box in (fork, sb):
            if box is not None:
                box.delete()
    assert admin.volume("cella-shared").info.used_by == []
    admin.delete_volume("cella-shared")  # no sandbox mounts it now: no force needed
    with pytest.raises(errors.NotFound):
        admin.volume(vol.id)


def mount_token(daemon: Daemon, sandbox_id: str, expires: int) -> dict[str, str]:
    """A mount token as the daemon signs them (with its key, read from its directory)."""
    key = (daemon.data_dir / "service.key").read_bytes()
    mac = hmac.new(key, f"volume-mounts:{sandbox_id}:{expires}".encode(), hashlib.sha256)
    signature = base64.urlsafe_b64encode(mac.digest()).rstrip(b"=").decode()
    return {TOKEN_HEADER: f"{expires}.{signature}"}


def test_mount_tokens_expire_are_renewed_and_die_with_the_sandbox(
    admin: Client, daemon: Daemon
) -> None:
    vol = admin.create_volume("renewed")
    sb = admin.create(volume_mounts=[VolumeMount(volume="renewed", path="/v")])
    try:
        assert sb.exec("echo first > /v/a.txt").exit_code == 0
        assert until(lambda: vol.read("/a.txt")) == b"first\n"
        time.sleep(TOKEN_SECONDS * 2)  # the token the mount started with has expired
        assert sb.exec("echo later > /v/b.txt").exit_code == 0  # through a renewed one
        assert until(lambda: vol.read("/b.txt")) == b"later\n"

        url = f"{daemon.url}{PREFIX}/{sb.id}/{vol.id}/"
        now = int(time.time())
        expired = httpx2.request("PROPFIND", url, headers=mount_token(daemon, sb.id, now - 1))
        assert expired.status_code == 403 and "expired" in expired.text
        fresh = mount_token(daemon, sb.id, now + TOKEN_SECONDS)
        assert httpx2.request("PROPFIND", url, headers=fresh).status_code == 207  # control
    finally:
        sb.delete()
    revoked = httpx2.request("PROPFIND", url, headers=fresh)  # unexpired, but its sandbox is gone
    assert revoked.status_code == 403 and "deleted" in revoked.text
    admin.delete_volume("renewed")


def _read(sb: Sandbox, path: str) -> bytes:
    done = sb.exec(["cat", path])
    if done.exit_code != 0:
        raise errors.NotFound(done.stderr.decode())
    return done.stdout


def test_volumes_through_the_cli(daemon: Daemon) -> None:
    def cella(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "cella.cli", "volume", *args],
            env=daemon.env(),
            input=stdin,
            capture_output=True,
            text=True,
            timeout=300,
        )

    made = cella("create", "cli-vol", "--json")
    assert made.returncode == 0, made.stderr
    volume_id = json.loads(made.stdout)["id"]
    put = cella("put", "cli-vol", "/notes/a.txt", "--parents", stdin="from the cli\n")
    assert put.returncode == 0, put.stderr
    assert cella("cat", volume_id, "/notes/a.txt").stdout == "from the cli\n"
    files = json.loads(cella("files", "cli-vol", "/", "--depth", "2", "--json").stdout)
    assert [f["path"] for f in files] == ["/notes", "/notes/a.txt"]
    listed = json.loads(cella("ls", "--json").stdout)
    assert any(v["name"] == "cli-vol" and v["size_bytes"] == 13 for v in listed["volumes"])
    missing = cella("cat", "cli-vol", "/nope.txt")
    assert missing.returncode != 0 and "nope.txt" in missing.stderr
    assert cella("rm", "cli-vol").returncode == 0
    assert cella("get", volume_id).returncode != 0  # gone, with its files
