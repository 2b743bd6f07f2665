"""A move's pre-copy, driven by the gateway (`cella.service.precopy` on the nodes): before a
running sandbox freezes, its node splits its disk and offers what it wrote so far and the
RAM file under its memory, and the destination pulls them while the guest runs on. The
freeze that follows ships only the RAM layer, the device state and the disk written since.
A move that fails after it has the source merge the disk back (the export's `abort`) and
the destination drop what it took (`undo`)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass

from cella import errors
from cella.fleet.node_client import Node

log = logging.getLogger("cella.gateway.moves")


@dataclass(frozen=True, slots=True)
class Ahead:
    """What a pre-copy sent: its time (the guest running) and the bytes that travelled."""

    ms: float
    bytes: int


async def ahead(sandbox_id: str, source: Node, dest: Node) -> Ahead | None:
    """The pre-copy of a running sandbox from `source` to `dest`; None when the source has
    nothing to offer (a sandbox that is not running). On failure both sides are undone and
    the error raised (the sandbox runs on where it was)."""
    loop = asyncio.get_running_loop()
    started = loop.time()
    try:
        offer = await source.json("POST", f"/v1/sandboxes/{sandbox_id}/precopy")
        if not offer.get("snapshot_id") and not offer.get("ram_sha256"):
            return None
        taken = await dest.json(
            "POST", "/v1/sandboxes/precopy", json={**source.as_source(), "offer": offer}
        )
    except BaseException as exc:
        reason = exc.message if isinstance(exc, errors.CellaError) else repr(exc)
        with contextlib.suppress(errors.CellaError):
            await source.json(
                "POST", f"/v1/sandboxes/{sandbox_id}/export/abort", params={"reason": reason}
            )
        await undo(sandbox_id, dest)
        if isinstance(exc, errors.CellaError):
            message = f"moving {sandbox_id} to {dest.name} failed in its pre-copy: {reason}"
            raise type(exc)(message) from None
        raise
    return Ahead(ms=round((loop.time() - started) * 1000, 1), bytes=int(taken["bytes"]))


async def undo(sandbox_id: str, dest: Node) -> None:
    """The destination drops what it took in ahead of a move that did not happen."""
    try:
        await dest.json("DELETE", f"/v1/sandboxes/{sandbox_id}/precopy/staged")
    except errors.CellaError as exc:  # left for its node: a later move of it starts over
        log.error("sandbox %s: node %s kept its pre-copy: %s", sandbox_id, dest.name, exc.message)
