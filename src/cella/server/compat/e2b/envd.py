"""Each sandbox's `envd` as E2B's SDK reaches it at `E2B_SANDBOX_URL`: the sandbox is named
by the `E2b-Sandbox-Id` header and proved by `X-Access-Token`. `process.Process` runs
commands as processes that outlive their connection (cella's `processes` room), by guest
pid; `filesystem.Filesystem` and `/files` use the `files` room. Commands run as the user the
SDK names (`Authorization: Basic`, or `username=`), `user` by default, in that user's home."""

from __future__ import annotations

import base64
import binascii
import posixpath
import secrets
import stat as stat_mod
import zlib
from collections.abc import AsyncIterator
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse, StreamingResponse

from cella import errors
from cella.guest.protocol import Entry
from cella.models import ExecRequest, SandboxState
from cella.server.compat.e2b import connect
from cella.server.compat.e2b.watch import Watcher, Watchers
from cella.server.deps import daemon
from cella.server.routes.ports import ACCESS_HEADER, TRAFFIC_HEADER, guest_reply
from cella.service.daemon import Daemon
from cella.service.ports import INTERPRETER_PORT, guest_path
from cella.service.processes import Process, ProcessSpec

DEFAULT_USER = "user"
PROCESS_KEEPALIVE: dict[str, Any] = {"event": {"keepalive": {}}}
SIGNALS = {"SIGNAL_SIGKILL": 9, "SIGNAL_SIGTERM": 15, 9: 9, 15: 15}
KINDS = {"file": "FILE_TYPE_FILE", "dir": "FILE_TYPE_DIRECTORY", "symlink": "FILE_TYPE_SYMLINK"}
TYPE_BITS = {"file": stat_mod.S_IFREG, "dir": stat_mod.S_IFDIR, "symlink": stat_mod.S_IFLNK}
OWNERS = {0: "root", 1000: DEFAULT_USER}
PREFIXES = ("/process.Process/", "/filesystem.Filesystem/")
FORWARDED = {"content-type", "content-length", "accept"}


ENVD_PORT = 49983


def owns(request: Request) -> bool:
    path = request.url.path
    return path.startswith(PREFIXES) or (
        "e2b-sandbox-id" in request.headers
        and (path in ("/files", "/health", "/execute") or path.startswith("/contexts"))
    )


def error_response(request: Request, exc: errors.CellaError) -> Response:
    """A Connect error on the RPC paths, `{message}` on the plain ones; a sandbox that is
    gone or broken is a 502 whose text the SDK reads as "not running"."""
    if isinstance(exc, errors.SandboxError) or not request.url.path.startswith(PREFIXES):
        return JSONResponse({"message": exc.message}, status_code=exc.status)
    status, body = connect.connect_error(exc)
    return JSONResponse(body, status_code=status)


@dataclass(frozen=True, slots=True)
class Target:
    svc: Daemon
    tenant: str
    sandbox_id: str
    user: str

    @property
    def home(self) -> str:
        return "/root" if self.user == "root" else f"/home/{self.user}"

    def path(self, given: Any) -> str:
        if not isinstance(given, str) or not given:
            raise errors.InvalidArgument("path is required")
        return posixpath.normpath(posixpath.join(self.home, given))


def target(request: Request, username: str | None = None) -> Target:
    svc: Daemon = daemon(request)
    sandbox_id = request.headers.get("e2b-sandbox-id", "")
    row = svc.store.get_sandbox(sandbox_id) if sandbox_id else None
    if row is None or row.state != SandboxState.running:
        raise errors.AgentUnavailable(f"The sandbox {sandbox_id} was not found")
    svc.ports.check_access(row.id, request.headers.get("x-access-token", ""))
    return Target(svc, row.tenant, row.id, username or basic_user(request) or DEFAULT_USER)


def check_interpreter(svc: Daemon, sandbox_id: str, path: str, request: Request) -> None:
    """Running code takes the sandbox's access token, as envd does. E2B's code interpreter
    SDK sends its `/contexts` calls (making, listing, restarting, removing kernels) with
    the traffic token only, which its control plane hands out with every sandbox."""
    contexts = path == "/contexts" or path.startswith("/contexts/")
    if contexts and ACCESS_HEADER not in request.headers:
        svc.ports.check_traffic(sandbox_id, request.headers.get(TRAFFIC_HEADER, ""))
    else:
        svc.ports.check_access(sandbox_id, request.headers.get(ACCESS_HEADER, ""))


def basic_user(request: Request) -> str | None:
    scheme, _, value = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "basic":
        return None
    try:
        return base64.b64decode(value).decode().partition(":")[0] or None
    except (binascii.Error, UnicodeDecodeError):
        raise errors.InvalidArgument("a Basic authorization that is not base64") from None


def router() -> APIRouter:
    api = APIRouter(include_in_schema=False)

    @api.api_route("/execute", methods=["POST"])
    @api.api_route("/contexts", methods=["GET", "POST"])
    @api.api_route("/contexts/{rest:path}", methods=["POST", "DELETE"])
    async def interpreter(request: Request) -> Response:
        """The code interpreter's API, forwarded to its server in the guest (the path it
        is sent is the one checked here), its answer served as a guest's on the daemon's
        host is."""
        svc: Daemon = daemon(request)
        sandbox_id = request.headers.get("e2b-sandbox-id", "")
        row = svc.store.get_sandbox(sandbox_id) if sandbox_id else None
        if row is None or row.state != SandboxState.running:
            raise errors.AgentUnavailable(f"The sandbox {sandbox_id} was not found")
        path = guest_path(request.url.path)
        check_interpreter(svc, row.id, path, request)
        target = path + (f"?{request.url.query}" if request.url.query else "")
        headers = [(k, v) for k, v in request.headers.items() if k.lower() in FORWARDED]
        reply = await svc.ports.http(
            row.tenant,
            row.id,
            INTERPRETER_PORT,
            request.method,
            target,
            headers,
            request.stream(),
        )
        return guest_reply(reply, lambda _: None, sandboxed=True)

    @api.get("/health", status_code=204)
    async def health(request: Request) -> Response:
        target(request)
        return Response(status_code=204)

    @api.post("/process.Process/{method}")
    async def process(method: str, request: Request) -> Response:
        where = target(request)
        handler = PROCESS.get(method)
        if handler is None:
            raise errors.InvalidArgument(f"not supported by cella: process.Process/{method}")
        return await handler(where, request)

    @api.post("/filesystem.Filesystem/WatchDir")
    async def watch_dir(request: Request) -> Response:
        """The async SDK's watch: a stream of events."""
        where = target(request)
        body = await connect.read_first(request)
        watcher = await new_watcher(where, body)
        every = connect.keepalive_interval(request)
        return connect.stream(WATCHERS.stream(watcher), {"keepalive": {}}, every)

    @api.post("/filesystem.Filesystem/{method}")
    async def filesystem(method: str, request: Request) -> Response:
        where = target(request)
        handler = FILESYSTEM.get(method)
        if handler is None:
            raise errors.InvalidArgument(f"not supported by cella: filesystem.Filesystem/{method}")
        body = await connect.read_unary(request)
        return connect.unary(await handler(where, body))

    @api.get("/files")
    async def read_file(request: Request, path: str, username: str | None = None) -> Response:
        where = target(request, username)
        chunks = await where.svc.files.read(where.tenant, where.sandbox_id, where.path(path))
        return StreamingResponse(chunks, media_type="application/octet-stream")

    @api.post("/files")
    async def write_files(
        request: Request, path: str | None = None, username: str | None = None
    ) -> list[dict[str, str]]:
        where = target(request, username)
        kind = request.headers.get("content-type", "")
        written = []
        if kind.startswith("multipart/form-data"):
            form = await request.form()
            for item in form.getlist("file"):
                if isinstance(item, str):
                    raise errors.InvalidArgument("a `file` part without a file")
                dest = where.path(path or item.filename)
                written.append(await _write(where, dest, _upload(item)))
        else:
            dest = where.path(path)
            body: AsyncIterator[bytes] = request.stream()
            if request.headers.get("content-encoding", "").lower() == "gzip":
                body = _gunzip(body)
            written.append(await _write(where, dest, body))
        if not written:
            raise errors.InvalidArgument("no file in the request")
        return written

    return api


# -- processes ---------------------------------------------------------------------------


async def start(where: Target, request: Request) -> Response:
    body = await connect.read_first(request)
    config = body.get("process") or {}
    cmd = config.get("cmd")
    if not isinstance(cmd, str) or not cmd:
        raise errors.InvalidArgument("process.cmd is required")
    pty = body.get("pty")
    size = (pty or {}).get("size") or {}
    exec_request = ExecRequest(
        command=[cmd, *[str(a) for a in config.get("args") or []]],
        env={str(k): str(v) for k, v in (config.get("envs") or {}).items()},
        cwd=where.path(config.get("cwd") or where.home),
        user=where.user,
    )
    tag = body.get("tag")
    spec = ProcessSpec(
        request=exec_request,
        pty=(int(size.get("cols") or 80), int(size.get("rows") or 24)) if pty is not None else None,
        stdin=bool(body.get("stdin", pty is not None)),
        ttl=600.0,
    )
    proc_id = f"tag:{tag}" if tag else f"e2b-{secrets.token_hex(8)}"
    proc = await where.svc.processes.start(where.tenant, where.sandbox_id, proc_id, spec)
    return connect.stream(
        events(proc, live=False), PROCESS_KEEPALIVE, connect.keepalive_interval(request)
    )


async def attach(where: Target, request: Request) -> Response:
    body = await connect.read_first(request)
    proc = selected(where, body)
    return connect.stream(
        events(proc, live=True), PROCESS_KEEPALIVE, connect.keepalive_interval(request)
    )


async def events(proc: Process, live: bool) -> AsyncIterator[dict[str, Any]]:
    """start, then output (from now on when re-attaching), then end."""
    yield {"event": {"start": {"pid": proc.pid}}}
    offsets = {s: b.end for s, b in proc.buffers.items()} if live else None
    stream_of = "pty" if proc.spec.pty else None
    async with proc.attached():
        async for chunk in proc.follow(offsets):
            data = base64.b64encode(chunk.data).decode()
            yield {"event": {"data": {stream_of or chunk.stream: data}}}
    yield {"event": {"end": end_of(proc)}}


def end_of(proc: Process) -> dict[str, Any]:
    if proc.failure is not None:
        return {"exitCode": -1, "exited": False, "status": "error", "error": proc.failure.message}
    status = proc.status
    assert status is not None
    if status.signal:
        return {"exitCode": -1, "exited": False, "status": f"signal: {status.signal}"}
    code = status.exit_code or 0
    end: dict[str, Any] = {"exited": True, "status": f"exit status {code}"}
    if code:
        end["exitCode"] = code
    return end


def selected(where: Target, body: dict[str, Any]) -> Process:
    selector = body.get("process") or {}
    procs = where.svc.processes.list(where.tenant, where.sandbox_id)
    if "pid" in selector:
        found = [p for p in procs if p.pid == int(selector["pid"])]
    elif "tag" in selector:
        found = [p for p in procs if p.id == f"tag:{selector['tag']}"]
    else:
        raise errors.InvalidArgument("process: a pid or a tag is required")
    if not found:
        raise errors.NotFound(f"process {selector} not found")
    return found[-1]


async def list_processes(where: Target, request: Request) -> Response:
    await connect.read_unary(request)
    shown = []
    for proc in where.svc.processes.list(where.tenant, where.sandbox_id):
        if proc.done or proc.pid is None:
            continue
        command = proc.spec.request.command
        argv = command if isinstance(command, list) else ["/bin/sh", "-c", command]
        item: dict[str, Any] = {
            "config": {
                "cmd": argv[0],
                "args": argv[1:],
                "envs": proc.spec.request.env,
                "cwd": proc.spec.request.cwd,
            },
            "pid": proc.pid,
        }
        if proc.id.startswith("tag:"):
            item["tag"] = proc.id[4:]
        shown.append(item)
    return connect.unary({"processes": shown})


async def send_signal(where: Target, request: Request) -> Response:
    body = await connect.read_unary(request)
    signal = SIGNALS.get(body.get("signal", "SIGNAL_SIGKILL"))
    if signal is None:
        raise errors.InvalidArgument(f"signal {body.get('signal')!r} is not supported")
    proc = selected(where, body)
    if proc.done:
        raise errors.NotFound("the process has ended")
    await proc.kill(signal)
    return connect.unary({})


async def send_input(where: Target, request: Request) -> Response:
    body = await connect.read_unary(request)
    await selected(where, body).write(input_bytes(body.get("input") or {}))
    return connect.unary({})


async def stream_input(where: Target, request: Request) -> Response:
    proc: Process | None = None
    async for message in connect.read_stream(request):
        if "start" in message:
            proc = selected(where, message["start"])
        elif "data" in message:
            if proc is None:
                raise errors.InvalidArgument("input before the start message")
            await proc.write(input_bytes(message["data"].get("input") or {}))

    async def done() -> AsyncIterator[dict[str, Any]]:
        yield {}

    return connect.stream(done(), {}, 60.0)


async def close_stdin(where: Target, request: Request) -> Response:
    await selected(where, await connect.read_unary(request)).close_stdin()
    return connect.unary({})


async def update(where: Target, request: Request) -> Response:
    body = await connect.read_unary(request)
    size = ((body.get("pty") or {}).get("size")) or {}
    proc = selected(where, body)
    if size:
        await proc.resize(int(size.get("cols") or 80), int(size.get("rows") or 24))
    return connect.unary({})


def input_bytes(given: dict[str, Any]) -> bytes:
    data = given.get("stdin", given.get("pty"))
    if not isinstance(data, str):
        raise errors.InvalidArgument("input: stdin or pty bytes are required")
    try:
        return base64.b64decode(data + "=" * (-len(data) % 4))
    except binascii.Error:
        raise errors.InvalidArgument("input is not base64") from None


PROCESS = {
    "Start": start,
    "Connect": attach,
    "List": list_processes,
    "SendSignal": send_signal,
    "SendInput": send_input,
    "StreamInput": stream_input,
    "CloseStdin": close_stdin,
    "Update": update,
}


# -- files ---------------------------------------------------------------------------------


def entry_json(entry: Entry, path: str) -> dict[str, Any]:
    mtime = datetime.fromtimestamp(entry.mtime_ns / 1e9, UTC)
    shown: dict[str, Any] = {
        "name": posixpath.basename(path) or "/",
        "type": KINDS.get(entry.kind, "FILE_TYPE_UNSPECIFIED"),
        "path": path,
        "size": str(entry.size),
        "mode": entry.mode & 0o7777,
        "permissions": stat_mod.filemode(TYPE_BITS.get(entry.kind, 0) | (entry.mode & 0o7777)),
        "owner": OWNERS.get(entry.uid, str(entry.uid)),
        "group": OWNERS.get(entry.gid, str(entry.gid)),
        "modifiedTime": mtime.isoformat().replace("+00:00", "Z"),
    }
    if entry.target:
        shown["symlinkTarget"] = entry.target
    return shown


async def stat(where: Target, body: dict[str, Any]) -> dict[str, Any]:
    path = where.path(body.get("path"))
    entry = await where.svc.files.stat(where.tenant, where.sandbox_id, path)
    return {"entry": entry_json(entry, path)}


async def list_dir(where: Target, body: dict[str, Any]) -> dict[str, Any]:
    root = where.path(body.get("path"))
    depth = int(body.get("depth") or 1)
    entries: list[dict[str, Any]] = []
    level = [root]
    for _ in range(max(depth, 1)):
        below = []
        for directory in level:
            for entry in await where.svc.files.list(where.tenant, where.sandbox_id, directory):
                path = posixpath.join(directory, entry.name)
                entries.append(entry_json(entry, path))
                if entry.kind == "dir":
                    below.append(path)
        level = below
    return {"entries": entries}


async def make_dir(where: Target, body: dict[str, Any]) -> dict[str, Any]:
    path = where.path(body.get("path"))
    files = where.svc.files
    try:
        await files.stat(where.tenant, where.sandbox_id, path)
    except errors.NotFound:
        top = await _first_missing(where, path)
        await files.mkdir(where.tenant, where.sandbox_id, path, mode=0o755, parents=True)
        await _own(where, top)
        return await stat(where, {"path": path})
    raise errors.AlreadyExists(f"{path} already exists")


async def move(where: Target, body: dict[str, Any]) -> dict[str, Any]:
    source, dest = where.path(body.get("source")), where.path(body.get("destination"))
    await where.svc.files.stat(where.tenant, where.sandbox_id, source)  # not found: 404
    request = ExecRequest(command=["mv", "-T", "--", source, dest], user=where.user)
    done = await where.svc.exec.run(where.tenant, where.sandbox_id, request)
    if done.exit_code != 0:
        raise errors.InvalidArgument(f"move failed: {done.stderr.decode(errors='replace')}")
    return await stat(where, {"path": dest})


async def remove(where: Target, body: dict[str, Any]) -> dict[str, Any]:
    path = where.path(body.get("path"))
    await where.svc.files.stat(where.tenant, where.sandbox_id, path)
    await where.svc.files.remove(where.tenant, where.sandbox_id, path, recursive=True)
    return {}


WATCHERS = Watchers()


async def new_watcher(where: Target, body: dict[str, Any]) -> Watcher:
    path, recursive = where.path(body.get("path")), bool(body.get("recursive"))
    return await WATCHERS.create(where.svc.files, where.tenant, where.sandbox_id, path, recursive)


async def create_watcher(where: Target, body: dict[str, Any]) -> dict[str, Any]:
    return {"watcherId": (await new_watcher(where, body)).id}


async def watcher_events(where: Target, body: dict[str, Any]) -> dict[str, Any]:
    return {"events": WATCHERS.take(where.sandbox_id, str(body.get("watcherId")))}


async def remove_watcher(where: Target, body: dict[str, Any]) -> dict[str, Any]:
    await WATCHERS.remove(where.sandbox_id, str(body.get("watcherId")))
    return {}


FILESYSTEM = {
    "Stat": stat,
    "ListDir": list_dir,
    "MakeDir": make_dir,
    "Move": move,
    "Remove": remove,
    "CreateWatcher": create_watcher,
    "GetWatcherEvents": watcher_events,
    "RemoveWatcher": remove_watcher,
}


async def _write(where: Target, path: str, body: AsyncIterator[bytes]) -> dict[str, str]:
    top = await _first_missing(where, path)
    await where.svc.files.write(where.tenant, where.sandbox_id, path, body, parents=True)
    await _own(where, top)
    return {"name": posixpath.basename(path), "type": "file", "path": path}


async def _first_missing(where: Target, path: str) -> str:
    """The topmost directory above `path` that does not exist yet (or `path` itself): what
    a write with parents will create."""
    top = path
    parent = posixpath.dirname(path)
    while parent not in ("/", ""):
        try:
            await where.svc.files.stat(where.tenant, where.sandbox_id, parent)
            break
        except errors.NotFound:
            top, parent = parent, posixpath.dirname(parent)
    return top


async def _own(where: Target, path: str) -> None:
    """What the SDK makes belongs to the user it acts as (files are written as root)."""
    if where.user == "root":
        return
    request = ExecRequest(command=["chown", "-R", f"{where.user}:", "--", path])
    done = await where.svc.exec.run(where.tenant, where.sandbox_id, request)
    if done.exit_code != 0:
        raise errors.UnknownUser(f"cannot give {path} to {where.user!r}: {done.stderr!r}")


async def _upload(item: Any) -> AsyncIterator[bytes]:
    while chunk := await item.read(256 << 10):
        yield chunk


async def _gunzip(body: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    inflate = zlib.decompressobj(16 + zlib.MAX_WBITS)
    try:
        async for chunk in body:
            if out := inflate.decompress(chunk):
                yield out
        if rest := inflate.flush():
            yield rest
    except zlib.error:
        raise errors.InvalidArgument("the body is not valid gzip") from None
