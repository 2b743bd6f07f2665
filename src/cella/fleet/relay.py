"""How the fleet gateway relays a call to a node daemon: the HTTP request streamed there and
its answer streamed back, or a WebSocket joined to the node's, message by message. The
caller's credentials stay at the gateway; the node sees its own admin key acting for the
caller's tenant (or, for a service URL, the request's own token)."""

from __future__ import annotations

import asyncio
import contextlib

import httpx2
from fastapi import Request, Response, WebSocket
from fastapi.responses import StreamingResponse
from starlette.background import BackgroundTask

from cella import errors
from cella.fleet.node_client import Node
from cella.policy.rewrites import CARRIED, FLEET_REWRITE
from cella.service.delegation import FLEET_GRANT
from cella.service.keys import PRINCIPAL_HEADER, READ_ONLY_HEADER, ROLES_HEADER, Principal
from cella.service.logins import FLEET_USER

HOP_BY_HOP = {
    "connection",
    "keep-alive",
    "proxy-authenticate",
    "proxy-authorization",
    "te",
    "trailers",
    "transfer-encoding",
    "upgrade",
}
NOT_FORWARDED = HOP_BY_HOP | {
    "authorization",
    "x-api-key",
    "x-cella-tenant",
    READ_ONLY_HEADER,
    PRINCIPAL_HEADER,
    ROLES_HEADER,
    "x-forwarded-proto",
    FLEET_USER,  # the gateway says who its caller is, no one else
    FLEET_GRANT,  # and which grants it made
    FLEET_REWRITE,  # and that it delivers a rewritten request
}
CREDENTIALS = ("authorization", "proxy-authorization", "x-api-key")
NODE_HINT = "x-cella-node"  # the node a create or fork should go to, if it has room
METHODS = ["GET", "POST", "PUT", "PATCH", "DELETE", "HEAD", "OPTIONS"]


async def forward(
    request: Request,
    node: Node,
    who: Principal | None,
    langsmith: bool = False,
    *,
    node_key: bool = True,
    extra: dict[str, str] | None = None,
    target: str | None = None,
) -> Response:
    """The request, streamed to `node` as `who` (with the node's key, unless `node_key` is
    false: the request carries its own credential), and its answer streamed back. With
    `target` (a path and query), to that path of the node instead, the request's own
    credential headers carried under `CARRIED` names (a rewritten request's, for the
    sandbox's server)."""
    path = request.url.path if target is None else target.partition("?")[0]
    if any(part in (".", "..") for part in path.split("/")):
        # the HTTP client resolves them: the node would be asked for another route
        raise errors.InvalidArgument("a path with `.` or `..` segments is not relayed")
    headers = [(k, v) for k, v in request.headers.items() if k.lower() not in NOT_FORWARDED]
    if target is not None:
        headers += [(CARRIED + k.lower(), v) for k, v in request.headers.items()
                    if k.lower() in CREDENTIALS]  # fmt: skip
    if node_key:
        headers += list(node.headers(who, langsmith).items())
    headers.append(("x-forwarded-proto", request.url.scheme))  # URLs the node hands out
    headers += list((extra or {}).items())
    upstream = node.client.build_request(
        request.method,
        request.url.path if target is None else target,
        params=request.url.query if target is None else None,
        headers=headers,
        content=request.stream(),
    )
    try:
        answer = await node.client.send(upstream, stream=True)
    except httpx2.TransportError as exc:
        node.stale = True
        raise errors.NodeUnavailable(f"node {node.name} does not answer: {exc}") from None
    kept = [(k, v) for k, v in answer.headers.multi_items() if k.lower() not in HOP_BY_HOP]
    response = StreamingResponse(
        answer.aiter_raw(), status_code=answer.status_code, background=BackgroundTask(answer.aclose)
    )
    response.raw_headers = [(k.lower().encode(), v.encode()) for k, v in kept]
    return response


async def relay_websocket(
    ws: WebSocket,
    node: Node,
    who: Principal | None,
    langsmith: bool = False,
    *,
    node_key: bool = True,
) -> None:
    """The client's WebSocket joined to the same path on the node, message by message
    (with the node's key acting for `who`, unless `node_key` is false)."""
    from websockets.asyncio.client import connect
    from websockets.exceptions import ConnectionClosed, InvalidStatus

    url = node.url.replace("http", "ws", 1) + ws.url.path
    if ws.url.query:
        url += f"?{ws.url.query}"
    headers = {
        k: v
        for k, v in ws.headers.items()
        if k.lower() not in NOT_FORWARDED
        and not k.lower().startswith("sec-websocket")
        and k.lower() not in ("host", "content-length")
    }
    if node_key:
        headers.update(node.headers(who, langsmith))
    headers["x-forwarded-proto"] = "https" if ws.url.scheme == "wss" else "http"
    try:
        upstream = await connect(url, additional_headers=headers, max_size=16 << 20, ssl=node.ssl)
    except (InvalidStatus, OSError) as exc:
        await ws.close(code=1011, reason=f"node {node.name}: {exc}"[:120])
        return
    await ws.accept()

    async def up() -> None:
        while True:
            message = await ws.receive()
            if message["type"] == "websocket.disconnect":
                await upstream.close()
                return
            if message.get("bytes") is not None:
                await upstream.send(message["bytes"])
            elif message.get("text") is not None:
                await upstream.send(message["text"])

    async def down() -> None:
        with contextlib.suppress(ConnectionClosed):
            async for message in upstream:
                if isinstance(message, bytes):
                    await ws.send_bytes(message)
                else:
                    await ws.send_text(message)
        with contextlib.suppress(RuntimeError):
            await ws.close()

    tasks = [asyncio.create_task(up()), asyncio.create_task(down())]
    _, pending = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    for task in pending:
        task.cancel()
    await upstream.close()
