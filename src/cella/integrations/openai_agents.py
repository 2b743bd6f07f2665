"""An OpenAI Agents SDK sandbox client backed by cella microVMs.

    client = CellaSandboxClient(AsyncClient())
    session = await client.create(options=CellaSandboxClientOptions(allow=["pypi.org"]))
    async with session:
        await session.exec("pytest -q")

Commands run in the guest (root inside, its own kernel), files move through cella's files
API, and the workspace persists as a tar archive of the manifest root. A session state
names its sandbox, so `resume` reattaches to it (or starts a new one that the SDK hydrates
from its snapshot when the old one is gone).
"""

from __future__ import annotations

import contextlib
import io
from pathlib import Path
from typing import Literal

from agents.sandbox.errors import ExecTimeoutError, ExecTransportError
from agents.sandbox.manifest import Manifest
from agents.sandbox.session.base_sandbox_session import BaseSandboxSession
from agents.sandbox.session.sandbox_client import BaseSandboxClient, BaseSandboxClientOptions
from agents.sandbox.session.sandbox_session import SandboxSession
from agents.sandbox.session.sandbox_session_state import SandboxSessionState
from agents.sandbox.snapshot import SnapshotBase, SnapshotSpec, resolve_snapshot
from agents.sandbox.types import ExecResult, User

from cella import errors
from cella.sdk import AsyncClient, AsyncSandbox


class CellaSandboxClientOptions(BaseSandboxClientOptions):
    type: Literal["cella"] = "cella"
    template: str = "default"
    vcpus: int = 1
    memory_mib: int = 512
    allow: tuple[str, ...] = ()


class CellaSandboxSessionState(SandboxSessionState):
    type: Literal["cella"] = "cella"
    sandbox_id: str | None = None
    options: CellaSandboxClientOptions = CellaSandboxClientOptions()


class CellaSandboxSession(BaseSandboxSession):
    state: CellaSandboxSessionState

    def __init__(self, *, state: CellaSandboxSessionState, client: AsyncClient) -> None:
        self.state = state
        self._client = client
        self._sandbox: AsyncSandbox | None = None

    async def _ensure_backend_started(self) -> None:
        if self._sandbox is not None:
            return
        if self.state.sandbox_id is not None:
            try:
                self._sandbox = await self._client.get(self.state.sandbox_id)
                return
            except errors.NotFound:
                pass  # gone: a new one; the SDK restores the workspace from its snapshot
        o = self.state.options
        self._sandbox = await self._client.create(
            o.template, vcpus=o.vcpus, memory_mib=o.memory_mib, allow=list(o.allow) or None
        )
        self.state.sandbox_id = self._sandbox.id

    @property
    def sandbox(self) -> AsyncSandbox:
        if self._sandbox is None:
            raise errors.InvalidState("the session has not started")
        return self._sandbox

    async def _exec_internal(
        self, *command: str | Path, timeout: float | None = None
    ) -> ExecResult:
        await self._ensure_backend_started()
        argv = [str(c) for c in command]
        try:
            r = await self.sandbox.exec(argv, timeout=timeout)
        except errors.CellaError as exc:
            raise ExecTransportError(command=command, cause=exc) from exc
        if r.timed_out:
            raise ExecTimeoutError(command=command, timeout_s=timeout)
        return ExecResult(stdout=r.stdout, stderr=r.stderr, exit_code=r.exit_code or 0)

    async def read(self, path: Path, *, user: str | User | None = None) -> io.IOBase:
        return io.BytesIO(await self.sandbox.files.read(str(self.normalize_path(path))))

    async def write(self, path: Path, data: io.IOBase, *, user: str | User | None = None) -> None:
        target = str(self.normalize_path(path, for_write=True))
        await self.sandbox.files.write(target, data.read(), parents=True)

    async def running(self) -> bool:
        if self._sandbox is None:
            return False
        return (await self._sandbox.refresh()).state == "running"

    async def persist_workspace(self) -> io.IOBase:
        return io.BytesIO(await self.sandbox.files.download_archive(self.state.manifest.root))

    async def hydrate_workspace(self, data: io.IOBase) -> None:
        await self.sandbox.files.upload_archive(self.state.manifest.root, data.read())


class CellaSandboxClient(BaseSandboxClient[CellaSandboxClientOptions | None]):
    """Sandbox sessions in cella microVMs (one sandbox per session)."""

    backend_id = "cella"
    supports_default_options = True

    def __init__(self, client: AsyncClient | None = None) -> None:
        self.client = client or AsyncClient()

    async def create(
        self,
        *,
        snapshot: SnapshotSpec | SnapshotBase | None = None,
        manifest: Manifest | None = None,
        options: CellaSandboxClientOptions | None = None,
    ) -> SandboxSession:
        manifest = self._validate_manifest_for_create(manifest or Manifest())
        state = CellaSandboxSessionState(
            manifest=manifest,
            snapshot=resolve_snapshot(snapshot, "cella"),
            options=options or CellaSandboxClientOptions(),
        )
        return self._wrap_session(CellaSandboxSession(state=state, client=self.client))

    async def delete(self, session: SandboxSession) -> SandboxSession:
        inner = session._inner
        if not isinstance(inner, CellaSandboxSession):
            raise TypeError("CellaSandboxClient.delete expects a cella session")
        if inner.state.sandbox_id is not None:
            with contextlib.suppress(errors.NotFound):  # already gone
                await self.client.request("DELETE", f"/v1/sandboxes/{inner.state.sandbox_id}")
        return session

    async def resume(self, state: SandboxSessionState) -> SandboxSession:
        if not isinstance(state, CellaSandboxSessionState):
            raise TypeError("CellaSandboxClient.resume expects a CellaSandboxSessionState")
        return self._wrap_session(CellaSandboxSession(state=state, client=self.client))

    def deserialize_session_state(self, payload: dict[str, object]) -> SandboxSessionState:
        return self._deserialize_session_state_payload(payload, CellaSandboxSessionState)
