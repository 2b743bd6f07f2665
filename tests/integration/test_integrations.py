"""Agent-framework integrations against real sandboxes: the MCP server over stdio (driven
by the `mcp` client library), LangChain tools, the deepagents backend and the OpenAI Agents
SDK sandbox client, each through the framework's own interface."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from typing import Any

import pytest

from cella import Client, Sandbox
from tests.daemon import Daemon

pytestmark = pytest.mark.vm


@pytest.fixture(scope="module")
def sandbox(admin: Client) -> Iterator[Sandbox]:
    sb = admin.create()
    yield sb
    sb.delete()


async def test_mcp_server_over_stdio(daemon: Daemon, admin: Client) -> None:
    from mcp import Client as McpClient
    from mcp import StdioServerParameters

    params = StdioServerParameters(
        command=sys.executable,
        args=["-m", "cella.cli", "mcp"],
        env={
            "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
            "CELLA_URL": daemon.url,
            "CELLA_API_KEY": daemon.admin_key,
        },
    )
    async with McpClient(params, read_timeout_seconds=120) as mcp:
        tools = {t.name: t for t in (await mcp.list_tools()).tools}
        assert {
            "create_sandbox",
            "exec_command",
            "write_file",
            "read_file",
            "list_files",
            "snapshot_sandbox",
            "fork_sandbox",
            "delete_sandbox",
        } <= set(tools)
        create = tools["create_sandbox"]
        assert "egress" in create.input_schema["properties"]["allow"]["description"]
        assert create.output_schema is not None  # typed results

        async def call(tool: str, /, **args: Any) -> dict[str, Any]:
            result = await mcp.call_tool(tool, args)
            assert not result.is_error, result.content
            assert result.structured_content is not None
            return result.structured_content

        made = await call("create_sandbox")
        sandbox_id = made["id"]
        assert made["state"] == "running" and admin.get(sandbox_id).id == sandbox_id
        ran = await call("exec_command", sandbox_id=sandbox_id, command="uname -s; exit 3")
        assert ran["stdout"] == "Linux\n" and ran["exit_code"] == 3
        wrote = await call(
            "write_file", sandbox_id=sandbox_id, path="/workspace/m/hello.txt", content="hi mcp"
        )
        assert wrote["size"] == 6
        read = await call("read_file", sandbox_id=sandbox_id, path="/workspace/m/hello.txt")
        assert (read["content"], read["encoding"]) == ("hi mcp", "utf-8")
        listed = await call("list_files", sandbox_id=sandbox_id, path="/workspace/m")
        assert [e["name"] for e in listed["result"]] == ["hello.txt"]
        snap = await call("snapshot_sandbox", sandbox_id=sandbox_id, name="mcp")
        forks = await call("fork_sandbox", source_id=snap["id"], count=1)
        fork_id = forks["sandboxes"][0]["id"]
        again = await call("read_file", sandbox_id=fork_id, path="/workspace/m/hello.txt")
        assert again["content"] == "hi mcp"
        for sid in (fork_id, sandbox_id):
            assert (await call("delete_sandbox", sandbox_id=sid))["deleted"] is True
        missing = await mcp.call_tool("exec_command", {"sandbox_id": sandbox_id, "command": "true"})
        assert missing.is_error and "not_found" in str(missing.content)
    admin.get_snapshot(snap["id"]).delete()


def test_langchain_tools_drive_a_sandbox(sandbox: Sandbox) -> None:
    from langchain_core.tools import BaseTool

    from cella.integrations.langchain import sandbox_tools

    tools: dict[str, BaseTool] = {t.name: t for t in sandbox_tools(sandbox)}
    assert set(tools) == {"run_command", "write_file", "read_file", "list_files"}
    assert "command" in tools["run_command"].args  # the schema a model sees
    wrote = tools["write_file"].invoke({"path": "/workspace/lc/a.py", "content": "print(6*7)\n"})
    assert "wrote 11 bytes" in wrote
    ran = tools["run_command"].invoke({"command": "python3 a.py; exit 4", "cwd": "/workspace/lc"})
    assert ran.startswith("exit code 4") and "42" in ran
    assert tools["read_file"].invoke({"path": "/workspace/lc/a.py"}) == "print(6*7)\n"
    assert "file 11 a.py" in tools["list_files"].invoke({"path": "/workspace/lc"})
    assert tools["read_file"].invoke({"path": "/workspace/lc/missing"}).startswith("error:")


def test_deepagents_backend_runs_in_the_sandbox(sandbox: Sandbox) -> None:
    from deepagents.backends.protocol import SandboxBackendProtocol

    from cella.integrations.deepagents import CellaBackend

    backend = CellaBackend(sandbox)
    assert isinstance(backend, SandboxBackendProtocol)
    assert backend.id == sandbox.id
    ran = backend.execute("echo from-deepagents; exit 2")
    assert ran.output == "from-deepagents\n" and ran.exit_code == 2
    assert backend.write("/workspace/da/notes.md", "alpha\nbeta\n").error is None
    read = backend.read("/workspace/da/notes.md")
    assert read.error is None and read.file_data is not None
    assert "beta" in str(read.file_data)
    edited = backend.edit("/workspace/da/notes.md", "beta", "gamma")
    assert edited.error is None
    assert sandbox.files.read_text("/workspace/da/notes.md") == "alpha\ngamma\n"
    assert [m["path"] for m in backend.grep("gamma", path="/workspace/da").matches or []] == [
        "/workspace/da/notes.md"
    ]
    missing = backend.download_files(["/workspace/da/nope"])[0]
    assert missing.content is None and missing.error == "file_not_found"


def test_the_main_job_demo_ends_with_the_passing_branch(daemon: Daemon, admin: Client) -> None:
    import json
    import subprocess

    run = subprocess.run(
        [sys.executable, "-m", "cella.cli", "demo", "--json"],
        env=daemon.env(None),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    report = json.loads(run.stdout)
    assert report["tests_before"] != 0  # the bug reproduced
    passing = [b for b in report["branches"] if b["tests_exit"] == 0]
    assert [b["branch"] for b in passing] == [report["winner"]]
    assert report["winner_fix"] == "mean of the two middles"
    assert {s["step"] for s in report["steps"]} >= {"snapshot", "fork 3 branches"}
    assert any("unittest" in line and "exit 0" in line for line in report["trace"])
    assert report["console"] == f"{daemon.url}/ui/#/sandboxes/{report['winner']}/lineage"
    live = {s.id for s in admin.list()}
    assert report["winner"] in live  # kept
    assert not live & {b["branch"] for b in report["branches"] if b["tests_exit"] != 0}
    admin.get(report["winner"]).delete()


async def test_openai_agents_sandbox_client(daemon: Daemon) -> None:
    import io
    from pathlib import Path

    from cella import AsyncClient
    from cella.integrations.openai_agents import CellaSandboxClient, CellaSandboxClientOptions

    async with AsyncClient(daemon.url, daemon.admin_key) as cella:
        client = CellaSandboxClient(cella)
        session = await client.create(options=CellaSandboxClientOptions(memory_mib=512))
        async with session:
            sandbox_id = session._inner.state.sandbox_id  # type: ignore[attr-defined]
            assert sandbox_id and (await cella.get(sandbox_id)).state == "running"
            ran = await session.exec("uname -s && echo $((6*7)) && exit 5")
            assert ran.stdout == b"Linux\n42\n" and ran.exit_code == 5
            await session.write(Path("notes/a.txt"), io.BytesIO(b"from the agents sdk"))
            assert (await session.read(Path("notes/a.txt"))).read() == b"from the agents sdk"
            listed = await session.exec("cat /workspace/notes/a.txt")
            assert listed.stdout == b"from the agents sdk"
            archive = await session._inner.persist_workspace()  # type: ignore[attr-defined]
            assert len(archive.read()) > 0
            state = client.serialize_session_state(session.state)
        resumed = await client.resume(client.deserialize_session_state(state))
        async with resumed:  # the same sandbox again
            assert (await resumed.read(Path("notes/a.txt"))).read() == b"from the agents sdk"
        await client.delete(resumed)
        from cella import errors

        with pytest.raises(errors.NotFound):
            await cella.get(sandbox_id)
