"""Volumes of other nodes, mounted by this node's sandboxes (a fleet's): a fleet gateway
lends this node a volume that lives on another node, its home (`PUT
/v1/volumes/{id}/remote`: the home's URL and certificate, and the volume's own token there),
and the WebDAV requests of this node's sandboxes for it are sent on to the home's
`/v1/volume-remote/{id}/...` with that token. The sandbox's own checks (that it mounts the
volume, no writes to a read-only mount) are made here first; the home checks the token and
its quota. Kept in a file of the data directory (0600), so a restarted daemon still has
them."""

from __future__ import annotations

import json
import os
import ssl
import threading
from collections.abc import AsyncIterable
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx2

from cella import errors
from cella.policy.volumes import BASE_HEADER, REMOTE_PREFIX

TIMEOUT = httpx2.Timeout(30.0, read=300.0)
# what a WebDAV request carries that the home needs, and what its answer carries back
ASKED = ("depth", "range", "destination", "overwrite", "content-type", "content-length",
         BASE_HEADER)  # fmt: skip
ANSWERED = (
    "content-type", "content-length", "content-range", "etag", "last-modified",
    "accept-ranges", "dav", "allow",
)  # fmt: skip


@dataclass(frozen=True, slots=True)
class RemoteVolume:
    id: str
    tenant: str
    name: str
    url: str  # the home node daemon's
    token: str  # the volume's token there
    ca_pem: str = ""  # the home's certificate, trusted for its https URL alone


class RemoteVolumes:
    def __init__(self, path: Path) -> None:
        self.path = path
        self._lock = threading.Lock()
        self._kept: dict[str, RemoteVolume] = {}
        if path.exists():
            for row in json.loads(path.read_text()):
                self._kept[row["id"]] = RemoteVolume(**row)

    def put(self, volume: RemoteVolume) -> None:
        if volume.ca_pem:
            _context(volume.ca_pem)  # refused now, not at the first mount
        with self._lock:
            self._kept[volume.id] = volume
            self._save()

    def find(self, tenant: str, key: str) -> RemoteVolume | None:
        """The tenant's lent volume whose id or name is `key`."""
        with self._lock:
            found = [v for v in self._kept.values() if v.tenant == tenant and key in (v.id, v.name)]
        return next((v for v in found if v.id == key), found[0] if found else None)

    def forget(self, volume_id: str) -> None:
        with self._lock:
            if self._kept.pop(volume_id, None) is not None:
                self._save()

    def _save(self) -> None:
        tmp = self.path.with_suffix(".tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as out:
            json.dump([asdict(v) for v in self._kept.values()], out)
        os.replace(tmp, self.path)

    async def send(
        self,
        volume: RemoteVolume,
        method: str,
        path: str,
        headers: dict[str, str],
        body: AsyncIterable[bytes] | None,
    ) -> tuple[httpx2.AsyncClient, httpx2.Response]:
        """A sandbox's WebDAV request, sent on to the volume's home (streamed both ways);
        the caller closes the client once the answer is read."""
        client = httpx2.AsyncClient(
            base_url=volume.url,
            timeout=TIMEOUT,
            verify=_context(volume.ca_pem) if volume.ca_pem else True,
        )
        sent = {k: v for k, v in headers.items() if k.lower() in ASKED}
        sent["authorization"] = f"Bearer {volume.token}"
        request = client.build_request(
            method, f"{REMOTE_PREFIX}/{volume.id}{path}", headers=sent, content=body
        )
        try:
            return client, await client.send(request, stream=True)
        except httpx2.TransportError as exc:
            await client.aclose()
            raise errors.NodeUnavailable(
                f"the home node of volume {volume.name} does not answer: {exc}"
            ) from None


def answered(headers: httpx2.Headers) -> dict[str, str]:
    return {k: v for k, v in headers.items() if k.lower() in ANSWERED}


def _context(ca_pem: str) -> ssl.SSLContext:
    try:
        return ssl.create_default_context(cadata=ca_pem)
    except ssl.SSLError as exc:
        raise errors.InvalidArgument(f"ca: not a PEM certificate: {exc}") from None
