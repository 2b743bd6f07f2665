"""The main job on the embedded defaults: a local daemon, one sandbox, driven by the SDK."""

from __future__ import annotations

import contextlib
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx2

from cella.sdk import Client
from cella.sdk._base import resolve


@contextlib.contextmanager
def local_daemon(progress: Callable[[str], None]) -> Iterator[None]:
    """Uses the daemon already running on this host, or starts one for the duration."""
    try:
        url, _ = resolve(None, None)
        if httpx2.get(f"{url}/v1/health", timeout=2).status_code == 200:
            progress(f"using the daemon at {url}")
            yield
            return
    except Exception:
        pass
    progress("starting the daemon (cella serve)")
    proc = subprocess.Popen(
        [sys.executable, "-m", "cella.cli", "serve", "--log-level", "warning"],
        stdin=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 120
        while True:
            if proc.poll() is not None:
                raise RuntimeError("the daemon exited during start-up")
            try:
                url, _ = resolve(None, None)
                if httpx2.get(f"{url}/v1/health", timeout=1).status_code == 200:
                    break
            except Exception:
                if time.monotonic() > deadline:
                    raise
            time.sleep(0.2)
        yield
    finally:
        proc.terminate()
        proc.wait(30)


def run_demo(template: str, progress: Callable[[str], None]) -> dict[str, Any]:
    steps: list[dict[str, Any]] = []

    def step(name: str, fn: Callable[[], str]) -> None:
        t = time.perf_counter()
        result = fn()
        steps.append(
            {"step": name, "ms": round((time.perf_counter() - t) * 1000, 1), "result": result}
        )
        progress(f"{name}: {result}")

    with local_daemon(progress), Client() as client:
        t = time.perf_counter()
        sb = client.create(template, labels={"demo": "yes"})
        steps.append(
            {
                "step": "create sandbox",
                "ms": round((time.perf_counter() - t) * 1000, 1),
                "result": sb.id,
            }
        )
        try:
            step("guest kernel", lambda: sb.exec("uname -r").text.strip())
            step("pid 1", lambda: sb.files.read("/proc/1/cmdline").rstrip(b"\0").decode())
            step(
                "write a program",
                lambda: (
                    str(sb.files.write("/workspace/app.py", "print(sum(range(10)))\n").size)
                    + " bytes"
                ),
            )
            step("run it", lambda: sb.exec(["python3", "/workspace/app.py"]).text.strip())
            step(
                "stream output",
                lambda: " ".join(
                    e.bytes.decode().strip()
                    for e in sb.exec_stream("for i in 1 2 3; do echo $i; sleep 0.2; done")
                    if e.type == "stdout"
                ),
            )
            step("stop (processes end, files stay)", lambda: sb.stop().state)
            step("resume", lambda: sb.resume().state)
            step("file after resume", lambda: sb.files.read_text("/workspace/app.py").strip())
            step("failing command", lambda: f"exit {sb.exec('ls /nonexistent').exit_code}")
        finally:
            accel, reason = sb.info.accel, sb.info.accel_reason
            sb.delete()
    return {"sandbox": sb.id, "accel": accel, "accel_reason": reason, "steps": steps}
