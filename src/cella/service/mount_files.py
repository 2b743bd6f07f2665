"""Files under a sandbox's network mounts (volumes, buckets), reached through commands.

The guest agent serves file calls itself, in its one loop; a file system that rclone serves
over the guest's egress, which the same agent carries, would wait on the agent while the
agent waits on it. So `Files` hands calls on paths under a volume or bucket mount here, and
they run as commands (the agent's children: its loop keeps carrying rclone's requests),
argv only, every path after `--`.
"""

from __future__ import annotations

import posixpath
from collections.abc import AsyncIterable, AsyncIterator

from cella import errors
from cella.guest.client import Output
from cella.guest.protocol import Entry, ExitStatus
from cella.models import ExecRequest
from cella.policy.access import Permission, Principal
from cella.service.exec import Exec
from cella.service.registry import Registry

# mode (octal), type, size, mtime, uid, gid, name, link target: one entry a line
FORMAT = "%m\\t%y\\t%s\\t%T@\\t%U\\t%G\\t%f\\t%l\\n"
KINDS = {"f": "file", "d": "dir", "l": "symlink"}
# $1 the path, $2 its mode (octal), $3 1 to make its directory; the body on stdin. Written
# in place, not renamed into place: rclone uploads a closed file whole (the daemon replaces
# it whole for every other sandbox), and a rename while that upload runs would be lost
WRITE = """p=$1; d=${p%/*}; [ -n "$d" ] || d=/
if [ "$3" = 1 ]; then mkdir -p -- "$d" || exit 1; fi
[ -d "$p" ] && { echo "$p: Is a directory" >&2; exit 1; }
cat > "$p" && chmod -- "$2" "$p"
"""


def under(path: str, roots: list[str]) -> bool:
    clean = posixpath.normpath(path)
    return any(clean == r or clean.startswith(r.rstrip("/") + "/") for r in roots)


class MountFiles:
    def __init__(self, registry: Registry, exec_room: Exec) -> None:
        self.registry = registry
        self.exec = exec_room

    def covers(self, sandbox_id: str, path: str) -> bool:
        """Whether `path` is under one of the sandbox's volume or bucket mounts."""
        row = self.registry.store.get_sandbox(sandbox_id)
        if row is None or not (row.volume_mounts or row.bucket_mounts):
            return False
        roots = [m.path for m in row.volume_mounts] + [m.path for m in row.bucket_mounts]
        return under(path, roots)

    async def _run(
        self,
        who: Principal,
        sandbox_id: str,
        argv: list[str],
        need: Permission = Permission.exec,
        stdin: AsyncIterable[bytes] | None = None,
    ) -> AsyncIterator[tuple[str, bytes]]:
        req = ExecRequest(command=argv, user="root", cwd="/")
        events = self.exec.stream(who, sandbox_id, req, stdin=stdin, need=need, exempt=True)
        async for event in events:
            if isinstance(event, Output):
                yield event.stream, event.data
            elif isinstance(event, ExitStatus) and event.exit_code != 0:
                yield "exit", str(event.exit_code).encode()

    async def _call(
        self,
        who: Principal,
        sandbox_id: str,
        argv: list[str],
        need: Permission = Permission.exec,
        stdin: AsyncIterable[bytes] | None = None,
    ) -> bytes:
        out, err = bytearray(), bytearray()
        failed = False
        async for stream, data in self._run(who, sandbox_id, argv, need, stdin):
            if stream == "stdout":
                out += data
            elif stream == "stderr":
                err += data
            else:
                failed = True
        if failed:
            raise _error(err.decode(errors="replace"))
        return bytes(out)

    async def read(self, who: Principal, sandbox_id: str, path: str) -> AsyncIterator[bytes]:
        """The file's content, streamed (`cat`); an error before any byte is raised here."""
        stream = self._run(who, sandbox_id, ["cat", "--", path], Permission.view)
        err = bytearray()
        first = b""
        async for kind, data in stream:
            if kind == "stdout":
                first = data
                break
            if kind == "stderr":
                err += data
            else:
                raise _error(err.decode(errors="replace"))

        async def rest() -> AsyncIterator[bytes]:
            if first:
                yield first
            async for kind, data in stream:
                if kind == "stdout":
                    yield data
                elif kind == "exit":
                    raise errors.GuestError(f"reading {path} failed")

        return rest()

    async def write(
        self,
        who: Principal,
        sandbox_id: str,
        path: str,
        body: AsyncIterable[bytes],
        mode: int,
        parents: bool,
    ) -> Entry:
        argv = ["/bin/sh", "-c", WRITE, "cella-write", path, f"{mode:o}", "1" if parents else "0"]
        await self._call(who, sandbox_id, argv, stdin=body)
        return await self.stat(who, sandbox_id, path)

    async def stat(self, who: Principal, sandbox_id: str, path: str) -> Entry:
        argv = ["find", path, "-maxdepth", "0", "-printf", FORMAT]
        found = _entries(await self._call(who, sandbox_id, argv, Permission.view))
        if not found:
            raise errors.NotFound(f"{path}: No such file or directory")
        return found[0]

    async def list(self, who: Principal, sandbox_id: str, path: str) -> list[Entry]:
        if (await self.stat(who, sandbox_id, path)).kind != "dir":
            raise errors.NotADirectory(f"{path}: Not a directory")
        argv = ["find", path, "-mindepth", "1", "-maxdepth", "1", "-printf", FORMAT]
        return sorted(
            _entries(await self._call(who, sandbox_id, argv, Permission.view)),
            key=lambda e: e.name,
        )

    async def mkdir(
        self, who: Principal, sandbox_id: str, path: str, mode: int, parents: bool
    ) -> None:
        argv = ["mkdir", *(["-p"] if parents else []), "-m", f"{mode:o}", "--", path]
        await self._call(who, sandbox_id, argv)

    async def chmod(self, who: Principal, sandbox_id: str, path: str, mode: int) -> None:
        await self._call(who, sandbox_id, ["chmod", f"{mode:o}", "--", path])

    async def remove(self, who: Principal, sandbox_id: str, path: str, recursive: bool) -> None:
        await self.stat(who, sandbox_id, path)
        argv = ["rm", "-r" if recursive else "-d", "-f", "--", path]
        await self._call(who, sandbox_id, argv)


def _entries(out: bytes) -> list[Entry]:
    found = []
    for line in out.decode("utf-8", "surrogateescape").splitlines():
        parts = line.split("\t")
        if len(parts) != 8:
            continue
        mode, kind, size, mtime, uid, gid, name, target = parts
        found.append(
            Entry(
                name=name,
                kind=KINDS.get(kind, "other"),
                mode=int(mode, 8),
                size=int(size),
                mtime_ns=int(float(mtime) * 1e9),
                uid=int(uid),
                gid=int(gid),
                target=target or None,
            )
        )
    return found


def _error(stderr: str) -> errors.CellaError:
    why = stderr.strip().splitlines()[-1] if stderr.strip() else "the command failed"
    if "No such file" in why:
        return errors.NotFound(why)
    if "Is a directory" in why:
        return errors.IsADirectory(why)
    if "Not a directory" in why:
        return errors.NotADirectory(why)
    if "File exists" in why:
        return errors.AlreadyExists(why)
    if "Read-only" in why or "Permission denied" in why:
        return errors.PermissionDenied(why)
    if "not empty" in why:
        return errors.DirectoryNotEmpty(why)
    return errors.InvalidArgument(why)
