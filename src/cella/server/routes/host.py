"""The host itself: what it may commit and has committed (for operators and placers), and
backups of its data directory."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Coroutine
from pathlib import Path
from typing import Any, Protocol

from fastapi import APIRouter
from fastapi.responses import StreamingResponse

from cella import errors
from cella.models import BackupRequest, Capacity
from cella.server.deps import Auth, DaemonDep, jsonl
from cella.service.backups import BackupReport, Progress
from cella.service.keys import require_admin

router = APIRouter(prefix="/v1", tags=["meta"])


@router.get("/capacity", response_model=Capacity)
async def capacity(svc: DaemonDep, who: Auth) -> Capacity:
    """RAM and vCPUs: the host's limits, committed and free (admin keys)."""
    require_admin(who, "read the host's capacity")
    return svc.admission.capacity()


@router.post(
    "/backups",
    response_class=StreamingResponse,
    responses={200: {"content": {"application/x-ndjson": {}}}},
)
async def backup(body: BackupRequest, svc: DaemonDep, who: Auth) -> StreamingResponse:
    """A consistent backup of the data directory, written on the daemon's host (admin
    keys): progress as JSON Lines (`{"step", "done", "total"}`), then `{"backup": report}`,
    or `{"error": {code, message}}` if it failed on the way."""
    require_admin(who, "back up the daemon")
    return backup_stream(svc.backups, body, lambda run: svc.background.start(run, "backup"))


class BackupWriter(Protocol):
    """A node daemon's backups (`service/backups.py`) or a gateway's (`fleet/backups.py`)."""

    def check(self, dest: Path) -> Path: ...

    async def backup(
        self, dest: Path, *, with_secrets_key: bool, progress: Progress
    ) -> BackupReport: ...


def backup_stream(
    backups: BackupWriter,
    body: BackupRequest,
    start: Callable[[Coroutine[Any, Any, None]], object],
) -> StreamingResponse:
    """The backup's progress as JSON Lines; `start` runs it on its own, so it goes on if
    the caller goes away."""
    dest = backups.check(Path(body.dest))  # a bad destination fails before streaming
    queue: asyncio.Queue[dict[str, Any] | None] = asyncio.Queue()

    def progress(step: str, done: int, total: int) -> None:
        queue.put_nowait({"step": step, "done": done, "total": total})

    async def run() -> None:
        try:
            report = await backups.backup(
                dest, with_secrets_key=body.with_secrets_key, progress=progress
            )
            queue.put_nowait({"backup": report.to_json()})
        except errors.CellaError as exc:
            queue.put_nowait({"error": {"code": exc.code, "message": exc.message}})
        except Exception as exc:  # the stream has begun: the failure is its last line
            queue.put_nowait({"error": {"code": "internal", "message": repr(exc)}})
        finally:
            queue.put_nowait(None)

    async def lines() -> AsyncIterator[bytes]:
        start(run())
        while (item := await queue.get()) is not None:
            yield jsonl(item)

    return StreamingResponse(lines(), media_type="application/x-ndjson")
