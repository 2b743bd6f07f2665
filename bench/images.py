"""Templates from images, and Docker inside a sandbox, measured through the API of a real daemon.

    .venv/bin/python -m bench.images [--json]

Images are made offline (busybox; busybox-stdlib, busybox plus a layer holding Python's
standard library, ~100 MiB of small files) and served by a TLS registry on loopback. For
each: a fresh build split into its steps (fetch, unpack, file system, warm snapshot), a
rebuild of the same digest (a cache hit) and the same image under another name (shares the
base, makes its own warm snapshot). Then, in a sandbox of the `docker` template: dockerd's
readiness at create (it runs in the warm snapshot) and its start after a stop and resume (a
fresh boot).
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench._stats import report
from cella import Client
from tests.daemon import Daemon
from tests.netservers import TestCA, free_loopback_block
from tests.oci_images import Registry, busybox_image, layer, run

STDLIB = Path(sys.base_prefix) / "lib" / f"python{sys.version_info.major}.{sys.version_info.minor}"


def with_stdlib(layout: Path, base: str, tag: str) -> None:
    """`base` plus one layer: a copy of this Python's standard library."""
    run("umoci", "tag", "--image", f"{layout}:{base}", tag)
    with layer(f"{layout}:{tag}", layout.parent) as root:
        shutil.copytree(STDLIB, root / "usr/lib/python3", symlinks=True)


def ms(seconds: float) -> float:
    return round(seconds * 1000, 1)


def measure_builds(c: Client, refs: dict[str, str]) -> dict[str, dict[str, Any]]:
    rows: dict[str, dict[str, Any]] = {}
    for label, ref in refs.items():
        name = f"bench-{label}"
        t = time.perf_counter()
        made = c.build_template(name, ref)
        total = time.perf_counter() - t
        steps = made.seconds
        rows[f"{label}: build"] = {
            "total": ms(total),
            **{
                k: ms(steps[k]) for k in ("fetch", "unpack", "filesystem", "snapshot") if k in steps
            },
            "disk MiB": made.disk_mib,
        }
        t = time.perf_counter()
        c.build_template(name, ref)
        rows[f"{label}: rebuild (cache hit)"] = {"total": ms(time.perf_counter() - t)}
        t = time.perf_counter()
        c.build_template(f"{name}-2", ref)
        rows[f"{label}: another name (shared base)"] = {"total": ms(time.perf_counter() - t)}
        t = time.perf_counter()
        with c.create(name) as sb:
            sb.exec(["true"])
        rows[f"{label}: create + exec"] = {"total": ms(time.perf_counter() - t)}
        for gone in (f"{name}-2", name):
            c.delete_template(gone)
    return rows


def measure_docker(c: Client) -> dict[str, dict[str, Any]]:
    rows: dict[str, dict[str, Any]] = {}
    c.create("docker").delete()  # the docker template's warm snapshot, made once
    t = time.perf_counter()
    with c.create("docker") as sb:
        r = sb.exec(["docker", "info", "--format", "{{.ServerVersion}}"])
        rows["docker: create + `docker info` answers"] = {"total": ms(time.perf_counter() - t)}
        assert r.exit_code == 0, r.stderr
        sb.stop()
        t = time.perf_counter()
        sb.resume()
        rows["docker: resume (fresh boot)"] = {"total": ms(time.perf_counter() - t)}
        t = time.perf_counter()
        r = sb.exec(["start-dockerd"], timeout=300)
        rows["docker: start-dockerd until it answers"] = {"total": ms(time.perf_counter() - t)}
        assert r.exit_code == 0, r.stderr
    return rows


def measure(docker: bool) -> dict[str, dict[str, Any]]:
    tmp = Path(tempfile.mkdtemp(prefix="cella-bench-images-"))
    layout = tmp / "layout"
    busybox_image(layout)
    with_stdlib(layout, "busybox", "stdlib")
    prefix = free_loopback_block()
    ca = TestCA(tmp / "ca", ["registry.test", f"{prefix}.1"])
    registry = Registry(tmp / "registry", f"{prefix}.1", ca)
    daemon = Daemon(
        tmp / "daemon",
        pool_size="0",
        extra_ca_certificates=json.dumps([str(ca.cert)]),
        egress_hosts=json.dumps({"registry.test": registry.addr}),
    ).start()
    try:
        refs = {
            "busybox": registry.push(f"oci:{layout}:busybox", "busybox:1"),
            "busybox-stdlib": registry.push(f"oci:{layout}:stdlib", "stdlib:1"),
        }
        with Client(daemon.url, daemon.admin_key) as c:
            rows = measure_builds(c, refs)
            if docker:
                rows |= measure_docker(c)
        return rows
    finally:
        daemon.stop()
        registry.close()
        subprocess.run(["rm", "-rf", str(tmp)], check=False)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--no-docker", action="store_true", help="skip the docker template")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    rows = measure(docker=not args.no_docker)
    report("templates from images, Docker in a sandbox (wall clock, ms)", rows, args.json)


if __name__ == "__main__":
    main()
