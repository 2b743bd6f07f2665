"""The trace (events, stream, lineage, OpenTelemetry export, redaction) and the eval harness,
against a real daemon exporting spans to a local OTLP/HTTP receiver."""

from __future__ import annotations

import http.server
import json
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from cella import Client
from cella.eval import Task, run_eval
from tests.daemon import Daemon, free_port

pytestmark = pytest.mark.vm

BUGGY = "def add(a, b):\n    return a - b\n"
FIX = """--- a/calc.py
+++ b/calc.py
@@ -1,2 +1,2 @@
 def add(a, b):
-    return a - b
+    return a + b
"""
CHECK_ADD = "python3 -c 'from calc import add; assert add(2, 3) == 5'"


class Receiver:
    """An OTLP/HTTP endpoint on loopback that keeps every span it is sent."""

    def __init__(self) -> None:
        self.spans: list[dict[str, Any]] = []
        spans = self.spans

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["Content-Length"]))
                request = ExportTraceServiceRequest.FromString(body)
                for resource in request.resource_spans:
                    for scope in resource.scope_spans:
                        for span in scope.spans:
                            attrs = {a.key: _value(a.value) for a in span.attributes}
                            spans.append(
                                {
                                    "name": span.name,
                                    "trace_id": span.trace_id.hex(),
                                    "start": span.start_time_unix_nano,
                                    "end": span.end_time_unix_nano,
                                    "attributes": attrs,
                                }
                            )
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args: Any) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", free_port()), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1/traces"


def _value(v: Any) -> Any:
    kind = v.WhichOneof("value")
    if kind == "array_value":
        return [_value(x) for x in v.array_value.values]
    return getattr(v, kind) if kind else None


@pytest.fixture(scope="module")
def receiver() -> Iterator[Receiver]:
    r = Receiver()
    yield r
    r.server.shutdown()


@pytest.fixture(scope="module")
def daemon_settings(receiver: Receiver) -> dict[str, str]:
    return {"pool_size": "0", "otlp_endpoint": receiver.url}


@pytest.fixture(scope="module")
def prepared(admin: Client) -> Iterator[str]:
    """A project with a bug and a test, snapshotted once: every task forks it."""
    base = admin.create()
    base.files.write("/workspace/calc.py", BUGGY, parents=True)
    snap = base.snapshot("prepared")
    yield snap.id
    base.delete()


def answer_task(n: int, expected: int) -> Task:
    """Writes its answer and a marker; passes when the answer is right and it sees no
    other task's marker (the workspace is its own)."""
    return Task(
        id=f"square-{n}",
        files={f"mark-{n}": f"task {n}\n"},
        commands=[f"echo $(({n} * {n})) > answer"],
        check=f'test "$(cat answer)" = "{expected}" && test "$(ls mark-* | wc -l)" = 1',
    )


TASKS = [
    answer_task(1, 1),
    answer_task(2, 4),
    answer_task(3, 9),
    answer_task(4, 16),
    answer_task(5, 26),  # wrong on purpose: must score 0
    answer_task(6, 35),  # wrong on purpose: must score 0
    Task(id="fix-by-patch", patch=FIX, check=CHECK_ADD),
    Task(id="no-fix", commands=["cat calc.py"], check=CHECK_ADD, artifacts=["/workspace/calc.py"]),
]
KNOWN = {t.id: s for t, s in zip(TASKS, [1, 1, 1, 1, 0, 0, 1, 0], strict=True)}


def test_eval_runs_isolated_tasks_with_known_scores(
    daemon: Daemon, admin: Client, prepared: str, tmp_path: Path
) -> None:
    done: list[str] = []
    results = run_eval(
        TASKS,
        prepared,
        parallel=4,
        out_dir=tmp_path,
        url=daemon.url,
        api_key=daemon.admin_key,
        on_done=lambda r: done.append(r.task_id),
    )
    assert sorted(done) == sorted(KNOWN)
    assert {r.task_id: r.score for r in results} == KNOWN
    assert all(r.error is None for r in results), [r.error for r in results]
    assert len({r.sandbox_id for r in results}) == len(TASKS)  # a sandbox each
    assert len((tmp_path / "results.jsonl").read_text().splitlines()) == len(TASKS)
    no_fix = next(r for r in results if r.task_id == "no-fix")
    assert Path(no_fix.artifacts["/workspace/calc.py"]).read_text() == BUGGY  # not the patch
    # each result carries what its task changed against the snapshot it started from
    fixed = next(r for r in results if r.task_id == "fix-by-patch")
    assert fixed.diff_error is None, fixed.diff_error
    changed = {c.path: c.change for c in fixed.changes}
    assert changed["/workspace/calc.py"] == "modified"
    assert "diff --git a/calc.py b/calc.py" in Path(str(fixed.patch)).read_text()
    square = next(r for r in results if r.task_id == "square-2")
    assert {c.path: c.change for c in square.changes if c.path.startswith("/workspace/")} == {
        "/workspace/mark-2": "added",
        "/workspace/answer": "added",
    }
    # the check imported calc.py (its bytecode is a change); calc.py itself is as it was
    touched = {c.path for c in no_fix.changes if c.path.startswith("/workspace/")}
    assert "/workspace/calc.py" not in touched
    assert all(p.startswith("/workspace/__pycache__") for p in touched), touched

    for task, result in zip(TASKS, results, strict=True):
        events = [json.loads(line) for line in Path(str(result.trace)).read_text().splitlines()]
        kinds = [e["type"] for e in events]
        assert kinds[0] == "forked" and kinds[-1] == "deleted"
        assert events[0]["data"]["snapshot_id"] == prepared
        execs = [e["data"]["command"] for e in events if e["type"] == "exec"]
        expected = [*task.commands, task.check]
        if task.patch:
            expected.insert(0, next(s.command for s in result.steps if s.phase == "patch"))
        assert execs == expected  # every command, in order
        writes = [e["data"] for e in events if e["type"] == "file_write"]
        for path in task.files:
            assert any(w["path"] == f"/workspace/{path}" and w["sha256"] for w in writes)
        if task.files:  # the files were written before the commands ran
            assert kinds.index("file_write") < kinds.index("exec")
        ids = [e["id"] for e in events]
        assert ids == sorted(ids)

    # a failed task reruns from the same snapshot and fails the same way
    again = run_eval(
        [TASKS[4]], prepared, out_dir=tmp_path / "rerun", url=daemon.url, api_key=daemon.admin_key
    )
    first = next(r for r in results if r.task_id == TASKS[4].id)
    assert again[0].score == first.score == 0
    assert [s.model_dump(exclude={"duration_ms"}) for s in again[0].steps] == [
        s.model_dump(exclude={"duration_ms"}) for s in first.steps
    ]


def test_spans_carry_sandbox_command_and_exit_code(admin: Client, receiver: Receiver) -> None:
    with admin.create() as sb:
        sb.exec(["sh", "-c", "exit 3"])
        sb.exec("echo traced")
        sb_id = sb.id
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:  # spans are exported in batches
        mine = [s for s in receiver.spans if s["attributes"].get("cella.sandbox_id") == sb_id]
        if any(s["attributes"].get("cella.event.type") == "deleted" for s in mine):
            break
        time.sleep(0.2)
    execs = [s for s in mine if s["attributes"]["cella.event.type"] == "exec"]
    by_command = {s["attributes"]["cella.command"]: s for s in execs}
    failed = by_command[json.dumps(["sh", "-c", "exit 3"])]
    assert failed["attributes"]["cella.exit_code"] == 3
    assert failed["attributes"]["process.exit.code"] == 3
    assert by_command["echo traced"]["attributes"]["cella.exit_code"] == 0
    assert all(s["end"] >= s["start"] for s in execs)
    assert len({s["trace_id"] for s in mine}) == 1  # one trace per sandbox
    kinds = {s["attributes"]["cella.event.type"] for s in mine}
    assert {"created", "exec", "deleted"} <= kinds


def test_no_secret_value_or_placeholder_in_any_event(admin: Client, daemon: Daemon) -> None:
    value = "tr4ce-SECRET-6e1d"
    admin.put_secret("tracekey", value, ["example.test"])
    with admin.create(secrets={"TRACE_KEY": "tracekey"}) as sb:
        placeholder = sb.exec('printf %s "$TRACE_KEY"').text
        assert placeholder.startswith("cella-secret-")
        sb.exec(f"echo {value}; echo $TRACE_KEY; echo {placeholder} >&2")  # in argv and output
        sb.files.write(f"/tmp/{value}.txt", f"{value}\n{placeholder}\n")  # in a path
        sb.exec(["false", value])
    events = [e.model_dump(mode="json") for e in admin.events(sb.id)]  # kept after delete
    assert events[-1]["type"] == "deleted"
    text = json.dumps(events)
    assert value not in text and placeholder not in text
    assert "[secret:tracekey]" in text
    stream = subprocess.run(
        [sys.executable, "-m", "cella.cli", "trace", sb.id, "--json"],
        env=daemon.env(None),
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert value not in stream and placeholder not in stream and stream.count("\n") == len(events)


def test_follow_lineage_and_the_cli(admin: Client, daemon: Daemon, tmp_path: Path) -> None:
    parent = admin.create()
    seen: list[str] = []

    def follow() -> None:
        for event in admin.follow(parent.id):
            seen.append(event.type)

    reader = threading.Thread(target=follow, daemon=True)
    reader.start()
    parent.exec("echo one")
    snap = parent.snapshot("s1")
    branch = snap.fork(1)[0]
    grandchild = branch.fork(1)[0]
    tree = admin.lineage(grandchild.id)
    assert tree.id == parent.id and tree.kind == "sandbox"
    assert [c.id for c in tree.children] == [snap.id]
    assert [c.id for c in tree.children[0].children] == [branch.id]
    assert tree.children[0].children[0].children[0].children[0].id == grandchild.id

    def cli(*args: str) -> str:
        return subprocess.run(
            [sys.executable, "-m", "cella.cli", *args],
            env=daemon.env(None),
            capture_output=True,
            text=True,
            check=True,
        ).stdout

    timeline = cli("trace", parent.id)
    assert "$ echo one" in timeline and "exit 0" in timeline
    assert grandchild.id in cli("trace", parent.id, "--lineage")
    assert json.loads(cli("trace", grandchild.id, "--lineage", "--json"))["id"] == parent.id
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text(
        json.dumps({"id": "ok", "commands": ["echo hi > x"], "check": "test -s x"})
        + "\n"
        + "# a comment\n"
        + json.dumps({"id": "bad", "check": "false"})
        + "\n"
    )
    report = json.loads(
        cli(
            "eval",
            "run",
            str(tasks),
            "--snapshot",
            snap.id,
            "--parallel",
            "2",
            "--out",
            str(tmp_path / "out"),
            "--json",
        )
    )
    assert report["summary"]["passed"] == 1 and report["summary"]["tasks"] == 2
    table = subprocess.run(
        [
            sys.executable,
            "-m",
            "cella.cli",
            "eval",
            "run",
            str(tasks),
            "--snapshot",
            snap.id,
            "--only",
            "bad",
            "--out",
            str(tmp_path / "out2"),
        ],
        env=daemon.env(None),
        capture_output=True,
        text=True,
    )
    assert "0/1 passed" in table.stdout + table.stderr

    grandchild.delete()
    branch.delete()
    parent.delete()
    reader.join(timeout=15)
    assert not reader.is_alive()  # the stream ends once the sandbox is deleted
    assert seen[0] == "created" and "exec" in seen and "snapshot" in seen
    assert seen[-1] == "deleted"
