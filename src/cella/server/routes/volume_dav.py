"""The egress proxy's door for volume mounts (`cella.service.volumes`): rclone in a sandbox
speaks WebDAV to `volumes.cella`, and the proxy sends each request here with its token for
that sandbox. Not part of the public API: no key opens it. The volume is the first part of
the path the guest asked for (`/{volume_id}/...`), and hrefs are answered in that space.
The WebDAV that rclone uses: OPTIONS, PROPFIND (depth 0 and 1), GET and HEAD (one byte
range), PUT, DELETE, MKCOL and MOVE within a volume."""

from __future__ import annotations

from email.utils import formatdate
from urllib.parse import quote, unquote, urlsplit
from xml.sax.saxutils import escape

from fastapi import APIRouter, Request
from fastapi.responses import Response, StreamingResponse
from starlette.background import BackgroundTask

from cella import errors
from cella.policy.volumes import BASE_HEADER, PREFIX, REMOTE_PREFIX, TOKEN_HEADER
from cella.server.deps import DaemonDep
from cella.service.daemon import Daemon
from cella.service.remote_volumes import answered
from cella.service.volumes import Entry, RemoteVolume, VolumeRecord

router = APIRouter(tags=["volumes"])
METHODS = ["OPTIONS", "PROPFIND", "GET", "HEAD", "PUT", "DELETE", "MKCOL", "MOVE", "PROPPATCH"]
MAX_PROPFIND_BODY = 64 << 10


@router.api_route(
    PREFIX + "/{sandbox_id}/{volume_id}/{path:path}", methods=METHODS, include_in_schema=False
)
@router.api_route(PREFIX + "/{sandbox_id}/{volume_id}", methods=METHODS, include_in_schema=False)
async def dav(
    sandbox_id: str, volume_id: str, request: Request, svc: DaemonDep, path: str = ""
) -> Response:
    method = request.method.upper()
    token = request.headers.get(TOKEN_HEADER, "")
    record = svc.volumes.mount_of(sandbox_id, token, volume_id, method)
    if isinstance(record, RemoteVolume):  # another node's: sent on to it
        return await _remote(svc, record, "/" + path, request)
    # where the caller's URLs start: `/` through the proxy, else this route's own prefix
    base = request.headers.get(BASE_HEADER) or f"{PREFIX}/{sandbox_id}/"
    return await _serve(svc, record, "/" + path, request, base.rstrip("/") + f"/{volume_id}")


@router.api_route(
    REMOTE_PREFIX + "/{volume_id}/{path:path}", methods=METHODS, include_in_schema=False
)
@router.api_route(REMOTE_PREFIX + "/{volume_id}", methods=METHODS, include_in_schema=False)
async def remote_dav(volume_id: str, request: Request, svc: DaemonDep, path: str = "") -> Response:
    """A volume of this node mounted by a sandbox of another node of the fleet: that node's
    requests, with the volume's own token (that node checked the sandbox's mount)."""
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        raise errors.Unauthenticated("the volume's token is required (Authorization: Bearer)")
    _, record = svc.volumes.by_token(volume_id, token.strip())
    base = request.headers.get(BASE_HEADER) or f"{REMOTE_PREFIX}/"
    return await _serve(svc, record, "/" + path, request, base.rstrip("/") + f"/{volume_id}")


async def _remote(svc: Daemon, volume: RemoteVolume, path: str, request: Request) -> Response:
    body = request.stream() if request.method.upper() in ("PUT", "PROPFIND") else None
    headers = dict(request.headers.items())
    client, answer = await svc.volumes.remote.send(volume, request.method, path, headers, body)

    async def close() -> None:
        await answer.aclose()
        await client.aclose()

    return StreamingResponse(
        answer.aiter_raw(),
        status_code=answer.status_code,
        headers=answered(answer.headers),
        background=BackgroundTask(close),
    )


async def _serve(
    svc: Daemon, record: VolumeRecord, path: str, request: Request, base: str
) -> Response:
    """One WebDAV request on a volume of this node (`base`: where the caller's URLs of it
    start)."""
    method = request.method.upper()
    if method == "OPTIONS":
        return Response(headers={"DAV": "1", "Allow": ", ".join(METHODS)})
    if method == "PROPFIND":
        if len(await request.body()) > MAX_PROPFIND_BODY:
            raise errors.PayloadTooLarge("PROPFIND body too large")
        depth = request.headers.get("depth", "1")
        return _propfind(svc, record, path, 0 if depth == "0" else 1, base)
    if method in ("GET", "HEAD"):
        return await _get(svc, record, path, request)
    if method == "PUT":
        existed = _exists(svc, record, path)
        await svc.volumes.write(record, path, request.stream())
        return Response(status_code=204 if existed else 201)
    if method == "DELETE":
        svc.volumes.remove(record, path)
        return Response(status_code=204)
    if method == "MKCOL":
        try:
            svc.volumes.mkdir(record, path)
        except errors.AlreadyExists:
            return Response(status_code=405)
        return Response(status_code=201)
    if method == "MOVE":
        target = _destination(request.headers.get("destination", ""), base)
        overwrite = request.headers.get("overwrite", "T").upper() != "F"
        try:
            existed = svc.volumes.move(record, path, target, overwrite)
        except errors.AlreadyExists:
            return Response(status_code=412)
        return Response(status_code=204 if existed else 201)
    raise errors.PermissionDenied(f"{method}: properties of a volume's files are not kept")


def _exists(svc: Daemon, record: VolumeRecord, path: str) -> bool:
    try:
        svc.volumes.stat(record, path)
    except errors.NotFound:
        return False
    return True


def _destination(header: str, prefix: str) -> str:
    where = unquote(urlsplit(header).path)
    if not header or not (where == prefix or where.startswith(prefix + "/")):
        raise errors.InvalidArgument("MOVE: Destination must be in the same volume")
    return where[len(prefix) :] or "/"


def _propfind(svc: Daemon, record: VolumeRecord, path: str, depth: int, base: str) -> Response:
    here = svc.volumes.stat(record, path)
    entries = [here]
    if here.is_dir and depth > 0:
        entries += svc.volumes.listing(record, path, 1)
    parts = ['<?xml version="1.0" encoding="utf-8"?>\n<D:multistatus xmlns:D="DAV:">']
    parts += [_response(base, e) for e in entries]
    parts.append("</D:multistatus>\n")
    return Response(
        "".join(parts).encode(),
        status_code=207,
        media_type='application/xml; charset="utf-8"',
    )


def _response(base: str, entry: Entry) -> str:
    href = quote(f"{base}{entry.path.rstrip('/')}") + ("/" if entry.is_dir else "")
    kind = "<D:collection/>" if entry.is_dir else ""
    size = "" if entry.is_dir else f"<D:getcontentlength>{entry.size}</D:getcontentlength>"
    return (
        f"<D:response><D:href>{escape(href)}</D:href><D:propstat><D:prop>"
        f"<D:displayname>{escape(entry.name)}</D:displayname>"
        f"<D:resourcetype>{kind}</D:resourcetype>{size}"
        f"<D:getlastmodified>{formatdate(entry.mtime, usegmt=True)}</D:getlastmodified>"
        f'<D:getetag>"{_etag(entry)}"</D:getetag>'
        "</D:prop><D:status>HTTP/1.1 200 OK</D:status></D:propstat></D:response>"
    )


def _etag(entry: Entry) -> str:
    return f"{int(entry.mtime * 1e6):x}-{entry.size:x}"


async def _get(svc: Daemon, record: VolumeRecord, path: str, request: Request) -> Response:
    entry = svc.volumes.stat(record, path)
    if entry.is_dir:
        raise errors.IsADirectory(f"{entry.path}: a directory")
    start, end = 0, entry.size
    status = 200
    wanted = request.headers.get("range", "")
    if wanted.startswith("bytes=") and "," not in wanted:
        first, _, last = wanted[6:].partition("-")
        try:
            if first:
                start = int(first)
                end = min(int(last) + 1, entry.size) if last else entry.size
            elif last:
                start = max(entry.size - int(last), 0)
        except ValueError:
            raise errors.InvalidArgument(f"bad Range {wanted!r}") from None
        if (start >= entry.size and entry.size > 0) or start > end:
            raise errors.RangeNotSatisfiable(f"bytes */{entry.size}")
        status = 206
    headers = {
        "Content-Length": str(end - start),
        "Last-Modified": formatdate(entry.mtime, usegmt=True),
        "ETag": f'"{_etag(entry)}"',
        "Accept-Ranges": "bytes",
    }
    if status == 206:
        headers["Content-Range"] = f"bytes {start}-{max(end - 1, start)}/{entry.size}"
    if request.method.upper() == "HEAD":
        return Response(status_code=status, headers=headers)
    body = await svc.volumes.read(record, path, start, end)
    return StreamingResponse(
        body, status_code=status, headers=headers, media_type="application/octet-stream"
    )
