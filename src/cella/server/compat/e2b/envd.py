"""Each sandbox's `envd` as E2B's SDK reaches it at `E2B_SANDBOX_URL`: the sandbox is named
by the `E2b-Sandbox-Id` header and proved by `X-Access-Token` (`target`). Its rooms:
`process.Process` (`processes`), `filesystem.Filesystem` (`filesystem`), `/files`
(`files`) and the code interpreter's API (`interpreter`), each through cella's service
rooms."""

from __future__ import annotations

from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse

from cella import errors
from cella.server.compat.e2b import connect, files, filesystem, interpreter, processes
from cella.server.compat.e2b.target import target

PREFIXES = ("/process.Process/", "/filesystem.Filesystem/")


ENVD_PORT = 49983


def owns(request: Request) -> bool:
    path = request.url.path
    return path.startswith(PREFIXES) or (
        "e2b-sandbox-id" in request.headers
        and (path in ("/files", "/health", "/execute") or path.startswith("/contexts"))
    )


def error_response(request: Request, exc: errors.CellaError) -> Response:
    """A Connect error on the RPC paths, `{message}` on the plain ones; a sandbox that is
    gone or broken is a 502 whose text the SDK reads as "not running"."""
    if isinstance(exc, errors.SandboxError) or not request.url.path.startswith(PREFIXES):
        return JSONResponse({"message": exc.message}, status_code=exc.status)
    status, body = connect.connect_error(exc)
    return JSONResponse(body, status_code=status)


router = APIRouter(include_in_schema=False)
router.include_router(interpreter.router)


@router.get("/health", status_code=204)
async def health(request: Request) -> Response:
    await target(request)
    return Response(status_code=204)


router.include_router(processes.router)
router.include_router(filesystem.router)
router.include_router(files.router)
