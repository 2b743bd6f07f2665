"""Download links and the keys that sign them.

- `POST /v1/sandboxes/{id}/files/download-url` makes a link to one file.
- `GET|HEAD /v1/downloads/{id}/{path}?token=…` serves it to whoever holds the link (no
  key): the path in the URL must be the one the token names.
- `GET /.well-known/jwks.json` publishes the daemon's signing keys (public halves, no key
  needed), for whoever verifies what the daemon signs.
- `GET /v1/signing-keys`, `POST /v1/signing-keys/rotate`, `DELETE /v1/signing-keys/{kid}`
  (admin): the keys; a new one that signs from then on (the old ones stay published); an
  old one retired.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Annotated, Any
from urllib.parse import quote

from fastapi import APIRouter, Query, Request, Response
from fastapi.responses import StreamingResponse

from cella import errors
from cella.models import DownloadUrl, DownloadUrlRequest, SigningKeyInfo, SigningKeys
from cella.server.deps import Auth, DaemonDep
from cella.server.routes.ports import SANDBOXED
from cella.service.daemon import Daemon
from cella.service.downloads import DownloadLink
from cella.service.keys import require_admin

router = APIRouter()
DOWNLOADS = "/v1/downloads"


def link_url(request: Request, link: DownloadLink) -> str:
    path = quote(link.path.lstrip("/"), safe="/")
    base = str(request.base_url).rstrip("/")
    return f"{base}{DOWNLOADS}/{link.sandbox_id}/{path}?token={link.token}"


def shown(request: Request, link: DownloadLink) -> DownloadUrl:
    expires = None if link.expires_at is None else datetime.fromtimestamp(link.expires_at, UTC)
    return DownloadUrl(
        url=link_url(request, link), token=link.token, path=link.path, expires_at=expires
    )


@router.post(
    "/v1/sandboxes/{sandbox_id}/files/download-url", response_model=DownloadUrl, tags=["files"]
)
async def download_url(
    sandbox_id: str, body: DownloadUrlRequest, request: Request, svc: DaemonDep, who: Auth
) -> DownloadUrl:
    """A link that downloads one file without a key, until it expires: pinned to this
    sandbox and this path."""
    link = svc.downloads.mint(
        who,
        sandbox_id,
        body.path,
        body.expires_in_seconds,
        content_type=body.content_type,
        disposition=body.content_disposition,
    )
    return shown(request, link)


@router.get(DOWNLOADS + "/{sandbox_id}/{path:path}", tags=["files"])
@router.head(DOWNLOADS + "/{sandbox_id}/{path:path}", include_in_schema=False)
async def download(
    sandbox_id: str,
    path: str,
    request: Request,
    svc: DaemonDep,
    token: Annotated[str, Query(description="the link's signed token")] = "",
) -> Response:
    """The file a download link names (its token authenticates it; a `Range` of one span
    is served as 206)."""
    link = svc.downloads.check(token, sandbox_id, "/" + path)
    head = request.method == "HEAD"
    try:
        found = await svc.downloads.open(link, request.headers.get("range"), head=head)
    except errors.RangeNotSatisfiable as exc:  # RFC 9110: say how long the file is
        return Response(status_code=416, headers={"content-range": exc.message})
    headers = {
        "content-disposition": found.disposition,
        "accept-ranges": "bytes",
        "content-length": str(found.last - found.first + 1),
        "cache-control": "private, no-store",
        "x-content-type-options": "nosniff",
        # a guest's file on the daemon's origin: an inline HTML one must not run as the console
        "content-security-policy": SANDBOXED,
    }
    if found.partial:
        headers["content-range"] = f"bytes {found.first}-{found.last}/{found.size}"
    status = 206 if found.partial else 200
    if head:
        return Response(status_code=status, headers=headers, media_type=found.content_type)
    return StreamingResponse(
        found.body, status_code=status, headers=headers, media_type=found.content_type
    )


@router.get("/.well-known/jwks.json", tags=["meta"])
async def jwks(svc: DaemonDep) -> dict[str, Any]:
    """The public keys this daemon signs with (download links, login-mode user tokens)."""
    return svc.signer.jwks()


def signing_keys(svc: Daemon) -> SigningKeys:
    current = svc.signer.current.kid
    return SigningKeys(
        keys=[
            SigningKeyInfo(
                kid=k.kid,
                created_at=datetime.fromtimestamp(k.created / 1e9, UTC),
                current=k.kid == current,
            )
            for k in svc.signer.keys
        ]
    )


@router.get("/v1/signing-keys", response_model=SigningKeys, tags=["keys"])
async def list_signing_keys(svc: DaemonDep, who: Auth) -> SigningKeys:
    """The daemon's signing keys, oldest first (admin)."""
    require_admin(who, "list the signing keys")
    return signing_keys(svc)


@router.post("/v1/signing-keys/rotate", response_model=SigningKeys, tags=["keys"])
async def rotate(svc: DaemonDep, who: Auth) -> SigningKeys:
    """A new signing key signs from now on; the others stay published until retired."""
    require_admin(who, "rotate the signing key")
    svc.signer.rotate()
    return signing_keys(svc)


@router.delete("/v1/signing-keys/{kid}", status_code=204, tags=["keys"])
async def retire(kid: str, svc: DaemonDep, who: Auth) -> Response:
    """Retires a key that no longer signs: what it signed stops verifying (admin)."""
    require_admin(who, "retire a signing key")
    if kid not in {k.kid for k in svc.signer.keys}:
        raise errors.NotFound(f"no signing key {kid!r}")
    svc.signer.retire(kid)
    return Response(status_code=204)
