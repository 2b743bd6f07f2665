"""The main job on the embedded defaults: a local daemon and the core agent workflow
(reproduce, snapshot, fork, fix in parallel, keep the winner), driven by the SDK."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from typing import Any

import httpx2

from cella.cli.trace import describe
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


PROJECT = {
    "/workspace/project/stats.py": (
        "def median(values):\n"
        "    ordered = sorted(values)\n"
        "    middle = len(ordered) // 2\n"
        "    return ordered[middle]\n"
    ),
    "/workspace/project/test_stats.py": (
        "import unittest\n"
        "from stats import median\n\n\n"
        "class MedianTest(unittest.TestCase):\n"
        "    def test_odd(self):\n"
        "        self.assertEqual(median([3, 1, 2]), 2)\n\n"
        "    def test_even(self):\n"
        "        self.assertEqual(median([4, 1, 3, 2]), 2.5)\n\n"
        "    def test_skewed(self):\n"
        "        self.assertEqual(median([1, 2, 10]), 2)\n\n"
        "    def test_one(self):\n"
        "        self.assertEqual(median([7]), 7)\n\n\n"
        "if __name__ == '__main__':\n"
        "    unittest.main()\n"
    ),
}
TESTS = "cd /workspace/project && python3 -m unittest -q test_stats 2>&1"
# three attempts a scripted agent makes, each in its own branch
FIXES = {
    "average of all": (
        "    return ordered[middle]\n",
        "    return sum(ordered) / len(ordered)\n",
    ),
    "lower middle": (
        "    return ordered[middle]\n",
        "    return ordered[middle - 1] if len(ordered) % 2 == 0 else ordered[middle]\n",
    ),
    "mean of the two middles": (
        "    return ordered[middle]\n",
        "    if len(ordered) % 2 == 0:\n"
        "        return (ordered[middle - 1] + ordered[middle]) / 2\n"
        "    return ordered[middle]\n",
    ),
}


def since_run_started() -> float | None:
    """Seconds since `scripts/run` started (it sets CELLA_RUN_STARTED), set-up included."""
    started = os.environ.get("CELLA_RUN_STARTED")
    try:
        return round(time.time() - float(started), 1) if started else None
    except ValueError:
        return None


def run_demo(template: str, progress: Callable[[str], None]) -> dict[str, Any]:
    """The core agent workflow, scripted: a buggy project, failing tests, a snapshot, three
    forks that each try a fix, their tests in parallel, and the branch that passes."""
    steps: list[dict[str, Any]] = []

    def step(name: str, fn: Callable[[], Any], show: Callable[[Any], str] = str) -> Any:
        t = time.perf_counter()
        value = fn()
        ms = round((time.perf_counter() - t) * 1000, 1)
        steps.append({"step": name, "ms": ms, "result": show(value)})
        progress(f"{name}: {show(value)} ({ms} ms)")
        return value

    with local_daemon(progress), Client() as client:
        sb = step("create a sandbox", lambda: client.create(template, labels={"demo": "yes"}),
                  lambda s: s.id)  # fmt: skip
        first_sandbox = since_run_started()
        if first_sandbox is not None:
            progress(f"the first sandbox runs {first_sandbox} s after the command started")
        try:
            for path, text in PROJECT.items():
                step(f"write {path.rsplit('/', 1)[1]}",
                     partial(sb.files.write, path, text, parents=True),
                     lambda e: f"{e.size} bytes")  # fmt: skip
            first = step("run the tests", lambda: sb.exec(TESTS),
                         lambda r: f"exit {r.exit_code} (failing, as expected)" if r.exit_code
                         else "exit 0")  # fmt: skip
            snap = step("snapshot", lambda: sb.snapshot("bug reproduced"), lambda s: s.id)
            branches = step("fork 3 branches", lambda: snap.fork(3),
                            lambda bs: ", ".join(b.id for b in bs))  # fmt: skip

            def attempt(branch: Any, fix: tuple[str, str]) -> tuple[int, float]:
                t = time.perf_counter()
                source = branch.files.read_text("/workspace/project/stats.py")
                branch.files.write("/workspace/project/stats.py", source.replace(*fix))
                result = branch.exec(TESTS)
                return result.exit_code, round((time.perf_counter() - t) * 1000, 1)

            def in_parallel() -> list[tuple[int, float]]:
                with ThreadPoolExecutor(len(branches)) as pool:
                    return list(pool.map(attempt, branches, FIXES.values()))

            outcomes = step("fix and test in all 3 branches at once", in_parallel,
                            lambda os_: ", ".join(f"exit {c}" for c, _ in os_))  # fmt: skip
            report_branches = [
                {"branch": b.id, "fix": name, "tests_exit": code, "ms": ms}
                for b, name, (code, ms) in zip(branches, FIXES, outcomes, strict=True)
            ]
            winners = [b for b, (code, _) in zip(branches, outcomes, strict=True) if code == 0]
            if not winners:
                raise RuntimeError("no branch passed its tests")
            winner = winners[0]
            for b in branches:
                if b is not winner:
                    step(f"delete losing branch {b.id}", b.delete, lambda _: "deleted")
            trace = [
                describe(e) for e in winner.events() if e.type in ("forked", "exec", "file_write")
            ]
        finally:
            accel, reason = sb.info.accel, sb.info.accel_reason
            sb.delete()
    return {
        "sandbox": sb.id,
        "first_sandbox_seconds": first_sandbox,
        "accel": accel,
        "accel_reason": reason,
        "tests_before": first.exit_code,
        "steps": steps,
        "branches": report_branches,
        "winner": winner.id,
        "winner_fix": next(r["fix"] for r in report_branches if r["branch"] == winner.id),
        "trace": trace,
        "console": f"{client.url}/ui/#/sandboxes/{winner.id}/lineage",
    }
