"""A sandbox's bucket and volume mounts: rclone in the guest serves each S3 or GCS bucket
(or prefix), and each of the tenant's volumes (WebDAV to `volumes.cella`, which the egress
proxy takes to the daemon: `service/volumes.py`), as a FUSE file system at its path, for as
long as the VM runs.

rclone is driven as argv through the exec room (a fixed script takes the mount's path and
rclone's argv as its arguments: nothing of the mount is parsed by a shell), so its
requests leave like any other: through the egress proxy, under the sandbox's rules and its
mounts' (`models.buckets.with_buckets`), which sign them (S3) or add a bearer (GCS) with the
tenant's secrets. rclone holds dummy keys (S3) or none (GCS, anonymous). A mount is made at
create (one that fails fails the create), and again whenever the registry tracks the VM
anew (resume from a stop, a fork, a restore, a re-adopted VM): a VM restored with its
memory still has rclone running and its mount in place, which the script sees and keeps.
Where each mount is shows in the sandbox's `mount_states`.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from datetime import UTC, datetime

from cella import errors
from cella.models import BucketMount, BucketState, ExecRequest, VolumeMount
from cella.policy.access import Principal
from cella.policy.cloud import DUMMY_AWS_ENV
from cella.policy.volumes import DAV_HOST
from cella.service.background import Background
from cella.service.exec import Exec
from cella.service.registry import Registry
from cella.store import SandboxRecord

log = logging.getLogger("cella.buckets")
MOUNT_TIMEOUT = 120.0  # rclone's own wait for its mount (--daemon-wait) is within it
CACHE_DIR = "/var/cache/cella-mounts"
LOG_DIR = "/var/log/cella-mounts"
# $1: the mount's path, $2 its remote; the rest: rclone's argv (its backend's options are
# in the environment). A live mount is kept (a VM restored with its memory); a dead one
# (rclone gone) is let go of first. The listing first: a wrong bucket or key fails the
# mount here (a FUSE mount of a bucket it cannot list is an empty directory). --daemon
# returns once mounted.
SCRIPT = """p=$1; r=$2; shift 2
if mountpoint -q -- "$p"; then echo kept; exit 0; fi
fusermount3 -uzq -- "$p" 2>/dev/null
mkdir -p -- "$p" "${LOG%/*}" || exit 1
if ! rclone lsf --max-depth 1 -- "$r" >/dev/null 2>"$LOG.check"; then
  tail -n 1 "$LOG.check" >&2; exit 1
fi
"$@" || { echo "rclone mount failed" >&2; tail -n 2 "$LOG" >&2; exit 1; }
mountpoint -q -- "$p" || { echo "$p is not mounted" >&2; exit 1; }
echo mounted"""


@dataclass(frozen=True)
class Plan:
    """One rclone mount: its id (the key of its state), path, remote, argv and environment."""

    id: str
    path: str
    remote: str
    argv: list[str]
    env: dict[str, str]
    what: str  # in messages
    kind: str  # "bucket" or "volume": its events' names


def bucket_plan(mount: BucketMount) -> Plan:
    what = f"{mount.type} bucket {mount.bucket}"
    return Plan(mount.id, mount.path, remote(mount), rclone_argv(mount), rclone_env(mount),
                what, "bucket")  # fmt: skip


def volume_plan(mount: VolumeMount) -> Plan:
    """A volume over WebDAV, for close-to-open consistency between sandboxes: a file is
    written to the local cache and uploaded a second after it is closed (`--vfs-write-back
    1s`: a write-then-rename, as tools save files, is renamed in the cache before its upload
    starts, which rclone would lose), replaced whole on the host; a file opened for reading
    is read from the daemon, never from a cache; listings and attributes are kept 1 s."""
    argv = [
        "rclone", "mount", f":webdav:{mount.volume}", mount.path, "--daemon",
        "--daemon-wait", "60s", "--allow-other", "--umask", "0000",
        "--cache-dir", f"{CACHE_DIR}/{mount.id}", "--vfs-cache-mode", "writes",
        "--vfs-write-back", "1s", "--dir-cache-time", "1s", "--attr-timeout", "1s",
        "--poll-interval", "0", "--log-file", f"{LOG_DIR}/{mount.id}.log",
        "--log-level", "NOTICE",
    ]  # fmt: skip
    if mount.read_only:
        argv.append("--read-only")
    env = {
        "LOG": f"{LOG_DIR}/{mount.id}.log",
        "RCLONE_CONFIG": "/dev/null",
        "RCLONE_WEBDAV_URL": f"http://{DAV_HOST}/",
        "RCLONE_WEBDAV_VENDOR": "other",
    }
    return Plan(mount.id, mount.path, argv[2], argv, env, f"volume {mount.volume}", "volume")


def plans(row: SandboxRecord) -> list[Plan]:
    return [*map(bucket_plan, row.bucket_mounts), *map(volume_plan, row.volume_mounts)]


def remote(mount: BucketMount) -> str:
    """rclone's on-the-fly remote: `:s3:bucket/prefix` (options come as flags)."""
    where = mount.bucket + (f"/{mount.prefix}" if mount.prefix else "")
    return f":{mount.type}:{where}"


def rclone_argv(mount: BucketMount) -> list[str]:
    """`rclone mount` for the mount, every field of it honoured (with `rclone_env`)."""
    argv = [
        "rclone", "mount", remote(mount), mount.path, "--daemon", "--daemon-wait", "60s",
        "--allow-other", "--umask", "0000", "--cache-dir", f"{CACHE_DIR}/{mount.id}",
        "--vfs-cache-mode", "full", "--dir-cache-time", "10s",
        "--log-file", f"{LOG_DIR}/{mount.id}.log", "--log-level", "NOTICE",
    ]  # fmt: skip
    if mount.read_only:
        argv.append("--read-only")
    if mount.cache.max_size_bytes is not None:
        argv += ["--vfs-cache-max-size", f"{mount.cache.max_size_bytes}B"]
    if mount.cache.writeback_seconds is not None:
        argv += ["--vfs-write-back", f"{mount.cache.writeback_seconds}s"]
    return argv


def rclone_env(mount: BucketMount) -> dict[str, str]:
    """The backend's options, for the listing and the mount alike: dummy keys to sign with
    (the proxy signs again with the real ones), or anonymous GCS (the proxy adds the
    bearer); no CA bundle variable of the AWS SDK's, which rclone's transport refuses."""
    env = {"LOG": f"{LOG_DIR}/{mount.id}.log", "AWS_CA_BUNDLE": "", "RCLONE_CONFIG": "/dev/null"}
    if mount.type == "gcs":
        return env | {"RCLONE_GCS_ANONYMOUS": "true", "RCLONE_GCS_BUCKET_POLICY_ONLY": "true"}
    env |= {
        "RCLONE_S3_PROVIDER": "Other",
        "RCLONE_S3_ENV_AUTH": "false",
        "RCLONE_S3_NO_CHECK_BUCKET": "true",
        "RCLONE_S3_ENDPOINT": mount.endpoint,
        "RCLONE_S3_REGION": mount.region or "us-east-1",
        "RCLONE_S3_FORCE_PATH_STYLE": "true" if mount.path_style else "false",
        "RCLONE_S3_ACCESS_KEY_ID": DUMMY_AWS_ENV["AWS_ACCESS_KEY_ID"],
        "RCLONE_S3_SECRET_ACCESS_KEY": DUMMY_AWS_ENV["AWS_SECRET_ACCESS_KEY"],
    }
    if mount.kms_key is not None:
        env["RCLONE_S3_SERVER_SIDE_ENCRYPTION"] = "aws:kms"
        env["RCLONE_S3_SSE_KMS_KEY_ID"] = mount.kms_key
    return env


class Buckets:
    def __init__(self, registry: Registry, exec_: Exec, background: Background) -> None:
        self.registry = registry
        self.exec = exec_
        self.background = background
        self._locks: dict[str, asyncio.Lock] = {}  # one mount at a time per sandbox
        self._tasks: dict[str, asyncio.Task[None]] = {}
        registry.track_hooks.append(self.watch)
        registry.untrack_hooks.append(self.unwatch)
        registry.forget_hooks.append(self._forget)

    async def mount_all(self, who: Principal, sandbox_id: str) -> None:
        """A new sandbox's buckets, mounted: its VM's watch has begun mounting them (waited
        for here); the first that failed raises `MountFailed` naming it."""
        task = self._tasks.get(sandbox_id)
        if task is not None:
            await asyncio.shield(task)
        row = self.registry.get(who, sandbox_id)
        for mount in plans(row):
            state = row.mount_states.get(mount.id)
            if state is not None and state.state == "failed":
                raise errors.MountFailed(state.error or f"mount {mount.id!r} failed")
            if state is None or state.state != "mounted":
                await self.mount(row.tenant, sandbox_id, mount)

    async def mount(self, tenant: str, sandbox_id: str, mount: Plan, activity: bool = True) -> None:
        """Mounts one bucket or volume unless it is mounted already."""
        async with self._locks.setdefault(sandbox_id, asyncio.Lock()):
            self._set(sandbox_id, mount.id, "mounting")
            argv = ["/bin/sh", "-c", SCRIPT, "cella-mount", mount.path, mount.remote, *mount.argv]
            req = ExecRequest(
                command=argv, env=mount.env, user="root", cwd="/", timeout=MOUNT_TIMEOUT
            )
            try:
                result = await self.exec.run(
                    Principal.service(tenant), sandbox_id, req, 16 << 10, activity
                )
            except errors.CellaError as exc:
                self._failed(sandbox_id, mount, str(exc))
                raise
            if result.exit_code != 0 or result.timed_out:
                why = result.stderr.decode(errors="replace").strip().splitlines()
                detail = why[-1] if why else f"exit status {result.exit_code}"
                failure = errors.MountFailed(f"mount {mount.id!r} ({mount.what}): {detail}")
                self._failed(sandbox_id, mount, failure.message)
                raise failure
            kept = result.stdout.decode(errors="replace").strip() == "kept"
            self._set(sandbox_id, mount.id, "mounted")
            self.registry.events.emit(
                sandbox_id,
                f"{mount.kind}_mounted",
                {"mount": mount.id, mount.kind: mount.what.rsplit(" ", 1)[-1], "kept": kept},
            )

    def _failed(self, sandbox_id: str, mount: Plan, error: str) -> None:
        self._set(sandbox_id, mount.id, "failed", error)
        self.registry.events.emit(
            sandbox_id, f"{mount.kind}_mount_failed", {"mount": mount.id, "error": error}
        )

    # -- states -------------------------------------------------------------------------

    def _set(self, sandbox_id: str, mount_id: str, state: str, error: str | None = None) -> None:
        row = self.registry.store.get_sandbox(sandbox_id)
        if row is None:
            return
        now = datetime.now(UTC)
        states = dict(row.mount_states)
        states[mount_id] = BucketState.model_validate({"state": state, "error": error, "at": now})
        self.registry.update(sandbox_id, mount_states=states)

    # -- the VM's life ------------------------------------------------------------------

    def watch(self, sandbox_id: str) -> None:
        """The sandbox's VM runs (again): its buckets are mounted unless they still are."""
        row = self.registry.store.get_sandbox(sandbox_id)
        if row is None or not plans(row) or sandbox_id in self._tasks:
            return
        task = self.background.start(
            self._remount(row.tenant, sandbox_id), name=f"buckets-{sandbox_id}"
        )
        self._tasks[sandbox_id] = task
        task.add_done_callback(lambda t: self._tasks.pop(sandbox_id, None) if
                               self._tasks.get(sandbox_id) is t else None)  # fmt: skip

    async def _remount(self, tenant: str, sandbox_id: str) -> None:
        for _ in range(600):  # a create or resume marks the row running just after tracking
            row = self.registry.store.get_sandbox(sandbox_id)
            if row is None or row.state not in ("creating", "starting"):
                break
            await asyncio.sleep(0.1)
        if row is None or row.state != "running":
            return
        for mount in plans(row):
            try:
                await self.mount(tenant, sandbox_id, mount, activity=False)
            except errors.CellaError as exc:  # recorded in its state; the next start retries
                log.info("sandbox %s: bucket mount %s: %s", sandbox_id, mount.id, exc)

    def unwatch(self, sandbox_id: str) -> None:
        """The VM is let go of (stop, delete): rclone ended with it."""
        task = self._tasks.pop(sandbox_id, None)
        if task is not None:
            task.cancel()
        row = self.registry.store.get_sandbox(sandbox_id)
        if row is not None and row.mount_states:
            now = datetime.now(UTC)
            gone = BucketState(state="unmounted", at=now)
            self.registry.update(sandbox_id, mount_states={k: gone for k in row.mount_states})

    def _forget(self, sandbox_id: str) -> None:
        self.unwatch(sandbox_id)
        self._locks.pop(sandbox_id, None)
