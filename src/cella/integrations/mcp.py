"""`cella mcp`: sandboxes as Model Context Protocol tools (stdio or streamable HTTP).

The server is a client of the cella daemon (CELLA_URL / CELLA_API_KEY, or the local
daemon's files), so an agent host that speaks MCP can create, drive, snapshot, fork and
delete sandboxes. Every tool returns a typed result; failures come back as tool errors
with the daemon's message.
"""

from __future__ import annotations

import base64
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Annotated, Any, Literal, TypeVar

from mcp.server.mcpserver import MCPServer
from mcp.server.mcpserver.exceptions import ToolError
from pydantic import BaseModel, Field

from cella import errors
from cella.sdk import AsyncClient

T = TypeVar("T")
MAX_READ = 1 << 20  # a tool result is read by a model: keep it bounded


class SandboxInfo(BaseModel):
    id: str
    state: str
    template: str
    vcpus: int
    memory_mib: int
    allow: list[str] = Field(description="egress rules")


class ExecOutput(BaseModel):
    exit_code: int | None
    timed_out: bool
    duration_ms: float
    stdout: str
    stderr: str


class FileContent(BaseModel):
    path: str
    encoding: Literal["utf-8", "base64"]
    content: str
    truncated: bool


class FileWritten(BaseModel):
    path: str
    size: int


class Entry(BaseModel):
    name: str
    kind: str
    size: int


class SnapshotInfo(BaseModel):
    id: str
    name: str
    sandbox_id: str


class Forks(BaseModel):
    sandboxes: list[SandboxInfo]


class Deleted(BaseModel):
    id: str
    deleted: bool


def _info(sb: Any) -> SandboxInfo:
    i = sb.info
    return SandboxInfo(
        id=i.id,
        state=i.state.value,
        template=i.template,
        vcpus=i.vcpus,
        memory_mib=i.memory_mib,
        allow=list(i.network.allow),
    )


def build_server(
    client_factory: Callable[[], AsyncClient] = AsyncClient,
) -> MCPServer[Any]:
    """The MCP server; `client_factory` makes the daemon client (once, at start)."""
    state: dict[str, AsyncClient] = {}

    @asynccontextmanager
    async def lifespan(_: MCPServer[Any]) -> AsyncIterator[None]:
        state["client"] = client_factory()
        try:
            yield
        finally:
            await state["client"].close()

    server: MCPServer[Any] = MCPServer(
        name="cella",
        instructions=(
            "cella sandboxes: isolated microVMs for running untrusted code. Create one, run "
            "commands and edit files in it, snapshot and fork it to try alternatives, and "
            "delete it when done. Network access is denied unless allowed at creation."
        ),
        lifespan=lifespan,
        log_level="WARNING",  # stdio's stderr is the host's log: requests are noise there
    )

    async def call(action: Callable[[AsyncClient], Awaitable[T]]) -> T:
        try:
            return await action(state["client"])
        except errors.CellaError as exc:
            raise ToolError(f"{exc.code}: {exc.message}") from None

    @server.tool()
    async def create_sandbox(
        template: Annotated[str, Field(description="template name")] = "default",
        vcpus: Annotated[int, Field(ge=1, le=64, description="virtual CPUs")] = 1,
        memory_mib: Annotated[int, Field(ge=128, description="RAM in MiB")] = 512,
        allow: Annotated[
            list[str] | None,
            Field(description="egress rules such as pypi.org or *.github.com; none: no network"),
        ] = None,
        ttl_seconds: Annotated[
            int | None, Field(ge=1, description="delete after this many seconds")
        ] = None,
    ) -> SandboxInfo:
        """Create a new sandbox (a microVM with its own kernel) and return it running."""
        sb = await call(
            lambda c: c.create(
                template, vcpus=vcpus, memory_mib=memory_mib, allow=allow, ttl_seconds=ttl_seconds
            )
        )
        return _info(sb)

    @server.tool()
    async def exec_command(
        sandbox_id: Annotated[str, Field(description="the sandbox")],
        command: Annotated[str, Field(description="shell command, run by /bin/sh -c")],
        cwd: Annotated[str | None, Field(description="working directory")] = None,
        timeout: Annotated[
            float | None, Field(gt=0, description="seconds; kills the whole process tree")
        ] = 300,
    ) -> ExecOutput:
        """Run a command in a sandbox to completion; returns exit code and output."""

        async def run(c: AsyncClient) -> ExecOutput:
            sb = await c.get(sandbox_id)
            r = await sb.exec(command, cwd=cwd, timeout=timeout)
            return ExecOutput(
                exit_code=r.exit_code,
                timed_out=r.timed_out,
                duration_ms=r.duration_ms,
                stdout=r.stdout[-MAX_READ:].decode(errors="replace"),
                stderr=r.stderr[-MAX_READ:].decode(errors="replace"),
            )

        return await call(run)

    @server.tool()
    async def write_file(
        sandbox_id: Annotated[str, Field(description="the sandbox")],
        path: Annotated[str, Field(description="absolute path in the sandbox")],
        content: Annotated[str, Field(description="the file's text")],
    ) -> FileWritten:
        """Write a text file in a sandbox (parent directories are created)."""

        async def run(c: AsyncClient) -> FileWritten:
            sb = await c.get(sandbox_id)
            entry = await sb.files.write(path, content, parents=True)
            return FileWritten(path=path, size=entry.size)

        return await call(run)

    @server.tool()
    async def read_file(
        sandbox_id: Annotated[str, Field(description="the sandbox")],
        path: Annotated[str, Field(description="absolute path in the sandbox")],
    ) -> FileContent:
        """Read a file from a sandbox (text as is, anything else base64; first 1 MiB)."""

        async def run(c: AsyncClient) -> FileContent:
            sb = await c.get(sandbox_id)
            data = await sb.files.read(path)
            head = data[:MAX_READ]
            try:
                text, encoding = head.decode(), "utf-8"
            except UnicodeDecodeError:
                text, encoding = base64.b64encode(head).decode(), "base64"
            return FileContent(
                path=path,
                encoding=encoding,  # type: ignore[arg-type]
                content=text,
                truncated=len(data) > MAX_READ,
            )

        return await call(run)

    @server.tool()
    async def list_files(
        sandbox_id: Annotated[str, Field(description="the sandbox")],
        path: Annotated[str, Field(description="absolute directory path")] = "/",
    ) -> list[Entry]:
        """List a directory in a sandbox."""

        async def run(c: AsyncClient) -> list[Entry]:
            sb = await c.get(sandbox_id)
            return [Entry(name=e.name, kind=e.kind, size=e.size) for e in await sb.files.list(path)]

        return await call(run)

    @server.tool()
    async def snapshot_sandbox(
        sandbox_id: Annotated[str, Field(description="the sandbox")],
        name: Annotated[str, Field(description="a label for the snapshot")] = "snapshot",
    ) -> SnapshotInfo:
        """Save a sandbox's disk and memory; it keeps running. Fork the snapshot later."""

        async def run(c: AsyncClient) -> SnapshotInfo:
            snap = await (await c.get(sandbox_id)).snapshot(name)
            return SnapshotInfo(id=snap.id, name=snap.info.name, sandbox_id=sandbox_id)

        return await call(run)

    @server.tool()
    async def fork_sandbox(
        source_id: Annotated[str, Field(description="a sandbox id (sb-...) or snapshot id")],
        count: Annotated[int, Field(ge=1, le=16, description="how many branches")] = 1,
    ) -> Forks:
        """Create isolated copies of a running sandbox (or of a snapshot): same files,
        memory and processes, each on its own from then on."""

        async def run(c: AsyncClient) -> Forks:
            if source_id.startswith("snap-"):
                branches = await (await c.get_snapshot(source_id)).fork(count)
            else:
                branches = await (await c.get(source_id)).fork(count)
            return Forks(sandboxes=[_info(b) for b in branches])

        return await call(run)

    @server.tool()
    async def delete_sandbox(
        sandbox_id: Annotated[str, Field(description="the sandbox")],
    ) -> Deleted:
        """Delete a sandbox and everything in it."""

        async def run(c: AsyncClient) -> Deleted:
            await (await c.get(sandbox_id)).delete()
            return Deleted(id=sandbox_id, deleted=True)

        return await call(run)

    return server
