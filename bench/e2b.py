"""E2B's SDK on cella next to cella's own SDK, in one run against one daemon (warm pool of
2): create, and a round trip of `true` (E2B `commands.run` over Connect; cella `exec`), the
latter also as E2B runs it: `/bin/bash -l -c true` as `user`, a login shell. Then volume
throughput: a file (100 MiB) written and read on a volume mounted with E2B's
`volume_mounts` next to the sandbox's own disk, in the same run: the write until the file
is whole on the volume (the content API sees its size: rclone uploads it when it is
closed), the read cold, from a second sandbox that mounts the same volume.

    .venv/bin/python -m bench.e2b [--runs 30] [--mib 100] [--only sdk|volumes] [--json]

The E2B SDK (`e2b==2.63.0`) runs in its own environment (`tests/sdk_env.py`), timing itself
in its own process; cella's SDK is timed here. Each side does its creates one at a time,
waiting for the pool to refill in between, so both measure a create from the pool.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import httpx2

from bench._stats import report, summary_ms
from cella import Client
from tests.daemon import Daemon, kill_vms_of
from tests.sdk_env import run_script, sdk_python

E2B_SIDE = """
import json, time
from e2b import Sandbox
runs = {runs}
creates, execs = [], []
for _ in range(runs // 3):
    {wait}
    t = time.perf_counter(); sb = Sandbox.create(); creates.append(time.perf_counter() - t)
    sb.kill()
sb = Sandbox.create()
sb.commands.run("true")
for _ in range(runs):
    t = time.perf_counter(); sb.commands.run("true"); execs.append(time.perf_counter() - t)
sb.kill()
print(json.dumps({{"create": creates, "exec": execs}}))
"""
POOL_FULL = (
    "import httpx\n"
    "    while min(httpx.get('{url}/v1/health').json()['pool'].values() or [0]) < 2:"
    " time.sleep(0.05)"
)


VOLUME_SIDE = """
import json, time
from e2b import Sandbox, Volume
mib = {mib}
size = mib << 20
vol = Volume.create("bench")
a = Sandbox.create(volume_mounts={{"/mnt/vol": vol}}, timeout=3600)
b = Sandbox.create(volume_mounts={{"/mnt/vol": vol}}, timeout=3600)
def timed(sb, cmd):
    t = time.perf_counter()
    r = sb.commands.run(cmd, timeout=3600, user="root")
    assert r.exit_code == 0, r.stderr
    return time.perf_counter() - t
out = {{}}
a.commands.run(f"head -c {{size}} /dev/urandom > /root/src.bin", timeout=3600, user="root")
out["disk write"] = timed(a, "dd if=/root/src.bin of=/root/disk.bin bs=1M conv=fsync 2>/dev/null")
t = time.perf_counter()
timed(a, "dd if=/root/src.bin of=/mnt/vol/vol.bin bs=1M 2>/dev/null")
while True:
    try:
        if vol.get_info("/vol.bin").size == size:
            break
    except Exception:
        pass
    time.sleep(0.05)
out["volume write"] = time.perf_counter() - t
a.commands.run("sync; echo 3 > /proc/sys/vm/drop_caches", user="root")
out["disk read"] = timed(a, "dd if=/root/disk.bin of=/dev/null bs=1M 2>/dev/null")
out["volume read"] = timed(b, "dd if=/mnt/vol/vol.bin of=/dev/null bs=1M 2>/dev/null")
a.kill(); b.kill(); Volume.destroy(vol.volume_id)
print(json.dumps(out))
"""


def wait_for_pool(url: str) -> None:
    while min(httpx2.get(f"{url}/v1/health").json()["pool"].values() or [0]) < 2:
        time.sleep(0.05)


def measure(runs: int) -> dict[str, dict[str, object]]:
    python = sdk_python("e2b-2.63.0", ["e2b==2.63.0"])
    daemon = Daemon(Path(tempfile.mkdtemp(prefix="cella-bench-e2b-")), pool_size="2").start()
    try:
        with Client(daemon.url, daemon.admin_key) as client:
            creates, execs = [], []
            for _ in range(runs // 3):
                wait_for_pool(daemon.url)
                t = time.perf_counter()
                sb = client.create()
                creates.append(time.perf_counter() - t)
                sb.delete()
            sb = client.create()
            sb.exec(["true"])
            login: list[float] = []  # what E2B runs: `true` in a login shell, as `user`
            for _ in range(runs):
                t = time.perf_counter()
                sb.exec(["true"])
                execs.append(time.perf_counter() - t)
                t = time.perf_counter()
                sb.exec(["/bin/bash", "-l", "-c", "true"], user="user")
                login.append(time.perf_counter() - t)
            sb.delete()
        wait = POOL_FULL.format(url=daemon.url)
        env = {"E2B_API_URL": daemon.url, "E2B_SANDBOX_URL": daemon.url}
        env["E2B_API_KEY"] = daemon.admin_key
        theirs = run_script(python, E2B_SIDE.format(runs=runs, wait=wait), env)
    finally:
        daemon.stop()
        kill_vms_of(daemon.data_dir)
    rows: dict[str, dict[str, object]] = {}
    for what, mine in (("create", creates), ("exec true", execs), ("bash -l -c true", login)):
        other = theirs["create" if what == "create" else "exec"]
        rows[f"{what}: cella SDK"] = summary_ms(mine)
        rows[f"{what}: E2B SDK"] = {
            **summary_ms(other),
            "ratio": round(statistics.median(other) / statistics.median(mine), 2),
        }
    return rows


def volumes(mib: int) -> dict[str, dict[str, object]]:
    """A `mib` MiB file on a volume and on the sandbox's own disk, through E2B's SDK."""
    python = sdk_python("e2b-2.63.0", ["e2b==2.63.0"])
    data = Path(tempfile.mkdtemp(prefix="cella-bench-e2b-volumes-"))
    daemon = Daemon(data, pool_size="0", max_volume_mib_per_tenant=str(4 * mib)).start()
    try:
        env = {"E2B_API_URL": daemon.url, "E2B_SANDBOX_URL": daemon.url}
        env |= {"E2B_VOLUME_API_URL": daemon.url, "E2B_API_KEY": daemon.admin_key}
        timed = run_script(python, VOLUME_SIDE.format(mib=mib), env, timeout=3600)
    finally:
        daemon.stop()
        kill_vms_of(daemon.data_dir)
    return {
        what: {**summary_ms([seconds]), "MiB/s": round(mib / seconds, 1)}
        for what, seconds in timed.items()
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=30)
    parser.add_argument("--mib", type=int, default=100, help="the volume file's size")
    parser.add_argument("--only", choices=("sdk", "volumes"))
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    if args.only != "volumes":
        report("E2B SDK vs cella SDK, same daemon (ms)", measure(args.runs), args.json)
    if args.only != "sdk":
        title = f"a {args.mib} MiB file: volume (E2B volume_mounts) vs own disk (TCG guest)"
        report(title, volumes(args.mib), args.json)


if __name__ == "__main__":
    main()
