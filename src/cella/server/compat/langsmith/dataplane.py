"""The LangSmith data plane, one per sandbox at its `dataplane_url`
(`/api/v2/sandboxes/dataplane/{sandbox id}`). Its rooms: `files` (upload, download with
ranges, glob, grep), `commands` (over a WebSocket or SSE; processes that survive a dropped
connection and are re-attached by id from byte offsets) and `tunnels` (TCP over yamux over
a WebSocket). A request to a stopped or paused sandbox resumes it (`waking`)."""

from __future__ import annotations

from fastapi import APIRouter

from cella.server.compat.langsmith import commands, files, tunnels
from cella.server.compat.langsmith.shapes import DATAPLANE

router = APIRouter(prefix=DATAPLANE + "/{sandbox_id}", include_in_schema=False)
router.include_router(files.router)
router.include_router(commands.router)
router.include_router(tunnels.router)
