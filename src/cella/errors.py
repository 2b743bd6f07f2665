"""One error hierarchy for the whole project, with stable snake_case codes.

The server answers `{"error": {"code", "message"}}` with these codes and the SDK raises the
matching class, so callers can catch by type on either side of the wire:

    CellaError (internal, 500)
    ├── RequestError: the caller's request (4xx)
    │   ├── InvalidArgument (400) ── UnknownUser (400)
    │   ├── Unauthenticated (401), PermissionDenied (403): DestinationForbidden,
    │   ├── NotFound (404)
    │   ├── PayloadTooLarge (413), RangeNotSatisfiable (416), CommandFailed (422),
    │   │   QuotaExceeded (429)
    │   ├── SandboxLost (410): its fleet node died or left
    │   └── Conflict (409): AlreadyExists, IsADirectory, NotADirectory,
    │       DirectoryNotEmpty, InvalidState, SnapshotCorrupt (TemplateCorrupt), InUse,
    │       CapacityExceeded
    ├── SandboxError: the guest or its VM (5xx)
    │   ├── GuestError (500): PortClosed (502)
    │   └── Timeout (504), SandboxCrashed (502), AgentUnavailable (502),
    │       SandboxUnavailable (503): a rewrite rule's sandbox is not running
    └── HostError: this host (5xx)
        ├── NoSpace (507), AccelUnavailable (503), ImageMissing (503), BuildFailed (500)
        └── NodeUnavailable (503): a fleet node does not answer
"""

from __future__ import annotations

import errno as _errno
from typing import ClassVar

__all__ = [
    "ALL_ERRORS",
    "AccelUnavailable",
    "AgentUnavailable",
    "AlreadyExists",
    "BuildFailed",
    "CapacityExceeded",
    "CellaError",
    "CommandFailed",
    "Conflict",
    "DestinationForbidden",
    "DirectoryNotEmpty",
    "Forbidden",
    "GuestError",
    "HostError",
    "ImageMissing",
    "InUse",
    "InvalidArgument",
    "InvalidState",
    "IsADirectory",
    "MountFailed",
    "NoSpace",
    "NodeUnavailable",
    "NotADirectory",
    "NotFound",
    "PayloadTooLarge",
    "PermissionDenied",
    "PortClosed",
    "QuotaExceeded",
    "RangeNotSatisfiable",
    "RequestError",
    "SandboxCrashed",
    "SandboxError",
    "SandboxLost",
    "SandboxUnavailable",
    "SnapshotCorrupt",
    "TemplateCorrupt",
    "Timeout",
    "Unauthenticated",
    "UnknownUser",
    "VolumeQuotaExceeded",
    "from_errno",
]


class CellaError(Exception):
    """Base of every cella error; `code` and `status` travel on the wire."""

    code: ClassVar[str] = "internal"
    status: ClassVar[int] = 500

    def __init__(self, message: str = "") -> None:
        super().__init__(message or self.code.replace("_", " "))
        self.message = message or self.code.replace("_", " ")

    def __str__(self) -> str:
        return f"{self.code}: {self.message}"


# -- the caller's request (4xx) -------------------------------------------------------------


class RequestError(CellaError):
    """The request cannot be done as asked; retrying it unchanged will not help."""

    code = "bad_request"
    status = 400


class InvalidArgument(RequestError):
    code = "invalid_argument"
    status = 400


class UnknownUser(InvalidArgument):
    code = "unknown_user"
    status = 400


class Unauthenticated(RequestError):
    code = "unauthenticated"
    status = 401


class MountFailed(InvalidArgument):
    """A sandbox's mount could not be cloned or refreshed (its repository, ref or the
    sandbox's egress rules): the caller's to fix."""

    code = "mount_failed"


class PermissionDenied(RequestError):
    """403: a key without the right (admin), or a guest path the guest refuses."""

    code = "permission_denied"
    status = 403


class DestinationForbidden(PermissionDenied):
    """An egress rule naming addresses only the operator may open (the host's, its
    networks', the fleet's)."""

    code = "destination_forbidden"


Forbidden = PermissionDenied  # the name earlier SDKs caught


class NotFound(RequestError):
    code = "not_found"
    status = 404


class PayloadTooLarge(RequestError):
    code = "payload_too_large"
    status = 413


class RangeNotSatisfiable(RequestError):
    """416: a `Range` outside the file (the message is the `Content-Range` to send)."""

    code = "range_not_satisfiable"
    status = 416


class CommandFailed(RequestError):
    """Raised by the SDK for a non-zero exit when the caller asked for `check=True`."""

    code = "command_failed"
    status = 422


class QuotaExceeded(RequestError):
    """The tenant already has as many sandboxes as it may."""

    code = "quota_exceeded"
    status = 429


class VolumeQuotaExceeded(PayloadTooLarge):
    """A write that would take the tenant's volumes past the bytes its quota allows (not
    retried: it fails the same until something is removed)."""

    code = "volume_quota_exceeded"
    status = 413


# -- conflicts with the current state (409) -------------------------------------------------


class SandboxLost(RequestError):
    """The fleet node the sandbox ran on died or left the cluster: it is gone for good."""

    code = "sandbox_lost"
    status = 410


class Conflict(RequestError):
    """The request clashes with the state of what it names; it may succeed later."""

    code = "conflict"
    status = 409


class AlreadyExists(Conflict):
    code = "already_exists"


class IsADirectory(Conflict):
    code = "is_a_directory"


class NotADirectory(Conflict):
    code = "not_a_directory"


class DirectoryNotEmpty(Conflict):
    code = "directory_not_empty"


class InvalidState(Conflict):
    """The sandbox is not in a state that allows the operation (e.g. exec while stopped)."""

    code = "invalid_state"


class SnapshotCorrupt(Conflict):
    """A snapshot's files do not match their manifest: it is never restored."""

    code = "snapshot_corrupt"


class TemplateCorrupt(SnapshotCorrupt):
    """A template's copy does not match its digest: it is refused and deleted."""

    code = "template_corrupt"


class InUse(Conflict):
    """The object is still referenced (e.g. a snapshot that sandboxes are built on)."""

    code = "in_use"


class CapacityExceeded(Conflict):
    """The host would be over-committed (RAM or vCPUs) by this sandbox."""

    code = "capacity_exceeded"


# -- a sandbox that misbehaves or went away (5xx) -------------------------------------------


class SandboxError(CellaError):
    """The guest or its VM failed; the daemon is fine."""

    code = "sandbox_error"
    status = 502


class GuestError(SandboxError):
    """The guest failed an operation for a reason with no more specific code."""

    code = "guest_error"
    status = 500


class PortClosed(GuestError):
    """Nothing listens on that port in the sandbox."""

    code = "port_closed"
    status = 502


class SandboxUnavailable(SandboxError):
    """Another sandbox a request was meant for (a rewrite rule's) is not running."""

    code = "sandbox_unavailable"
    status = 503


class Timeout(SandboxError):
    code = "timeout"
    status = 504


class SandboxCrashed(SandboxError):
    """The VM went away (guest panic, QEMU killed) while an operation was under way."""

    code = "sandbox_crashed"
    status = 502


class AgentUnavailable(SandboxError):
    """The guest agent did not answer (boot failed, or the guest broke the protocol)."""

    code = "agent_unavailable"
    status = 502


# -- the host (5xx) -------------------------------------------------------------------------


class HostError(CellaError):
    """This host cannot do it now: missing images, no accelerator, a full disk."""

    code = "host_error"
    status = 503


class NoSpace(HostError):
    code = "no_space"
    status = 507


class AccelUnavailable(HostError):
    code = "accel_unavailable"
    status = 503


class ImageMissing(HostError):
    """A kernel, initramfs or template image has not been built yet (run `cella setup`)."""

    code = "image_missing"
    status = 503


class NodeUnavailable(HostError):
    """A fleet node's daemon does not answer (it is being restarted, or the node is
    leaving); the call may be retried."""

    code = "node_unavailable"
    status = 503


class BuildFailed(HostError):
    code = "build_failed"
    status = 500


_BY_ERRNO: dict[int, type[CellaError]] = {
    _errno.ENOENT: NotFound,
    _errno.EACCES: PermissionDenied,
    _errno.EPERM: PermissionDenied,
    _errno.EROFS: PermissionDenied,
    _errno.EEXIST: AlreadyExists,
    _errno.EISDIR: IsADirectory,
    _errno.ENOTDIR: NotADirectory,
    _errno.ENOTEMPTY: DirectoryNotEmpty,
    _errno.ENOSPC: NoSpace,
    _errno.EDQUOT: NoSpace,
    _errno.EINVAL: InvalidArgument,
    _errno.ENAMETOOLONG: InvalidArgument,
    _errno.ESRCH: UnknownUser,
}


def from_errno(err: int, message: str) -> CellaError:
    """Maps an errno the guest reported to the error a caller can act on."""
    return _BY_ERRNO.get(err, GuestError)(message)


def _all_errors() -> dict[str, type[CellaError]]:
    found: dict[str, type[CellaError]] = {}
    pending: list[type[CellaError]] = [CellaError]
    while pending:
        cls = pending.pop()
        found[cls.code] = cls
        pending.extend(cls.__subclasses__())
    return found


ALL_ERRORS: dict[str, type[CellaError]] = _all_errors()
