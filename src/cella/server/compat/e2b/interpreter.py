"""E2B's code interpreter API (`/execute`, `/contexts`) at envd's address, forwarded to
its server in the guest: the path it is sent is the one checked here, and its answer is
served as a guest's on the daemon's host is."""

from __future__ import annotations

from fastapi import APIRouter, Request, Response

from cella.policy.access import Principal
from cella.server.compat.e2b.target import running
from cella.server.deps import daemon
from cella.server.routes.ports import ACCESS_HEADER, TRAFFIC_HEADER, guest_reply
from cella.service.daemon import Daemon
from cella.service.ports import INTERPRETER_PORT, guest_path

FORWARDED = {"content-type", "content-length", "accept"}


router = APIRouter(include_in_schema=False)


@router.api_route("/execute", methods=["POST"])
@router.api_route("/contexts", methods=["GET", "POST"])
@router.api_route("/contexts/{rest:path}", methods=["POST", "DELETE"])
async def interpreter(request: Request) -> Response:
    svc: Daemon = daemon(request)
    path = guest_path(request.url.path)
    row = await running(svc, request, lambda sid: check_interpreter(svc, sid, path, request))
    check_interpreter(svc, row.id, path, request)
    target = path + (f"?{request.url.query}" if request.url.query else "")
    headers = [(k, v) for k, v in request.headers.items() if k.lower() in FORWARDED]
    reply = await svc.ports.http(
        Principal.service(row.tenant),  # the holder of its access token
        row.id,
        INTERPRETER_PORT,
        request.method,
        target,
        headers,
        request.stream(),
    )
    return guest_reply(reply, lambda _: None, sandboxed=True)


def check_interpreter(svc: Daemon, sandbox_id: str, path: str, request: Request) -> None:
    """Running code takes the sandbox's access token, as envd does. E2B's code interpreter
    SDK sends its `/contexts` calls (making, listing, restarting, removing kernels) with
    the traffic token only, which its control plane hands out with every sandbox."""
    contexts = path == "/contexts" or path.startswith("/contexts/")
    if contexts and ACCESS_HEADER not in request.headers:
        svc.ports.check_traffic(sandbox_id, request.headers.get(TRAFFIC_HEADER, ""))
    else:
        svc.ports.check_access(sandbox_id, request.headers.get(ACCESS_HEADER, ""))
