"""One error hierarchy for the whole project, with stable snake_case codes.

The server answers `{"error": {"code", "message"}}` with these codes and the SDK raises the
matching class, so callers can catch by type on either side of the wire.
"""

from __future__ import annotations

import errno as _errno
from typing import ClassVar


class CellaError(Exception):
    code: ClassVar[str] = "internal"
    status: ClassVar[int] = 500

    def __init__(self, message: str = "") -> None:
        super().__init__(message or self.code.replace("_", " "))
        self.message = message or self.code.replace("_", " ")

    def __str__(self) -> str:
        return f"{self.code}: {self.message}"


class InvalidArgument(CellaError):
    code = "invalid_argument"
    status = 400


class NotFound(CellaError):
    code = "not_found"
    status = 404


class PermissionDenied(CellaError):
    code = "permission_denied"
    status = 403


class AlreadyExists(CellaError):
    code = "already_exists"
    status = 409


class IsADirectory(CellaError):
    code = "is_a_directory"
    status = 409


class NotADirectory(CellaError):
    code = "not_a_directory"
    status = 409


class DirectoryNotEmpty(CellaError):
    code = "directory_not_empty"
    status = 409


class NoSpace(CellaError):
    code = "no_space"
    status = 507


class UnknownUser(CellaError):
    code = "unknown_user"
    status = 400


class InvalidState(CellaError):
    """The sandbox is not in a state that allows the operation (e.g. exec while stopped)."""

    code = "invalid_state"
    status = 409


class Unauthenticated(CellaError):
    code = "unauthenticated"
    status = 401


class Forbidden(CellaError):
    code = "forbidden"
    status = 403


class PayloadTooLarge(CellaError):
    code = "payload_too_large"
    status = 413


class CommandFailed(CellaError):
    """Raised by the SDK for a non-zero exit when the caller asked for `check=True`."""

    code = "command_failed"
    status = 422


class SnapshotCorrupt(CellaError):
    """A snapshot's files do not match their manifest: it is never restored."""

    code = "snapshot_corrupt"
    status = 409


class InUse(CellaError):
    """The object is still referenced (e.g. a snapshot that sandboxes are built on)."""

    code = "in_use"
    status = 409


class QuotaExceeded(CellaError):
    """The tenant already has as many sandboxes as it may."""

    code = "quota_exceeded"
    status = 429


class CapacityExceeded(CellaError):
    """The host would be over-committed (RAM or vCPUs) by this sandbox."""

    code = "capacity_exceeded"
    status = 409


class GuestError(CellaError):
    """The guest failed an operation for a reason with no more specific code."""

    code = "guest_error"
    status = 500


class Timeout(CellaError):
    code = "timeout"
    status = 504


class SandboxCrashed(CellaError):
    """The VM went away (guest panic, QEMU killed) while an operation was under way."""

    code = "sandbox_crashed"
    status = 502


class AgentUnavailable(CellaError):
    """The guest agent did not answer (boot failed, or the guest broke the protocol)."""

    code = "agent_unavailable"
    status = 502


class AccelUnavailable(CellaError):
    code = "accel_unavailable"
    status = 503


class ImageMissing(CellaError):
    """A kernel, initramfs or template image has not been built yet (run `cella setup`)."""

    code = "image_missing"
    status = 503


class BuildFailed(CellaError):
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
