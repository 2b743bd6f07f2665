"""The egress proxy: one supervised `mitmdump` per daemon, driven over a socket pair.

Every VM's forwarded connections arrive at one loopback port, each from a loopback source
address given to that VM alone (`Addresses`); the proxy maps the address to the sandbox's
policy and secrets. The port is kept in the data directory so VMs that outlive a daemon
restart still reach the next daemon's proxy. If mitmdump dies it is started again and
given the whole state anew.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import json
import logging
import os
import random
import signal
import socket
from collections.abc import Callable
from pathlib import Path
from typing import Any

from cella import errors
from cella.network.install import mitmdump
from cella.paths import Paths
from cella.policy.egress import Boundary

log = logging.getLogger("cella.egress")
ADDON = Path(__file__).with_name("addon.py")
PACKAGE = Path(__file__).parent.parent  # the `cella` package the addon imports
READY_TIMEOUT = 60.0
CA_CERT = "mitmproxy-ca-cert.pem"
SYSTEM_ROOTS = Path("/etc/ssl/certs/ca-certificates.crt")


class Addresses:
    """Loopback source addresses for VMs' egress, unique among this daemon's VMs."""

    def __init__(self) -> None:
        self._used: set[str] = set()

    def allocate(self) -> str:
        while True:
            a, b, c = random.randrange(64, 128), random.randrange(256), random.randrange(1, 255)
            addr = f"127.{a}.{b}.{c}"
            if addr not in self._used:
                self._used.add(addr)
                return addr

    def claim(self, addr: str) -> None:
        self._used.add(addr)

    def release(self, addr: str) -> None:
        self._used.discard(addr)


def _die_with_parent() -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def _pick_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class EgressProxy:
    def __init__(
        self,
        paths: Paths,
        *,
        port: int = 0,
        hosts: dict[str, list[str]] | None = None,
        upstream_ca: bytes = b"",
        on_decision: Callable[[dict[str, Any]], None] = lambda _: None,
    ) -> None:
        self.paths = paths
        self.dir = paths.root / "egress"
        self.hosts = hosts or {}
        self.upstream_ca = upstream_ca
        self.on_decision = on_decision
        self.addresses = Addresses()
        self.port = port or self._stored_port()
        self._state: dict[str, dict[str, Any]] = {}
        self._boundary: dict[str, Any] = {"op": "boundary", **Boundary().to_json()}
        self._signing: dict[str, Any] = {}
        self._proc: asyncio.subprocess.Process | None = None
        self._writer: asyncio.StreamWriter | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._closing = False
        self._ready = asyncio.Event()
        self._syncs: dict[int, asyncio.Future[None]] = {}  # sync messages not answered yet
        self._seq = 0

    def _stored_port(self) -> int:
        file = self.dir / "port"
        with contextlib.suppress(OSError, ValueError):
            return int(file.read_text())
        self.dir.mkdir(parents=True, exist_ok=True)
        port = _pick_port()
        file.write_text(f"{port}\n")
        return port

    @property
    def ca_cert(self) -> Path:
        """The deployment's CA (made by mitmproxy on first start); guests trust it."""
        return self.dir / CA_CERT

    # -- process ------------------------------------------------------------------------

    async def start(self) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        await self._spawn()

    async def _spawn(self) -> None:
        exe = mitmdump(self.paths)
        shim = self.dir / "pythonpath"  # `cella` alone on the path: not the daemon's packages
        shim.mkdir(exist_ok=True)
        link = shim / "cella"
        target = PACKAGE
        if not link.is_symlink() or link.readlink() != target:
            link.unlink(missing_ok=True)
            link.symlink_to(target)
        ours, theirs = socket.socketpair()
        env = {
            "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
            "HOME": str(self.dir),
            "PYTHONPATH": str(shim),
            "CELLA_EGRESS_FD": str(theirs.fileno()),
            "CELLA_EGRESS_HOSTS": json.dumps(self.hosts),
        }
        argv = [
            str(exe),
            "--mode",
            f"regular@127.0.0.1:{self.port}",
            "-s",
            str(ADDON),
            "--set",
            f"confdir={self.dir}",
            "--set",
            "connection_strategy=lazy",
            "--set",
            "flow_detail=0",
            "--set",
            "termlog_verbosity=warn",
            "--set",
            "stream_large_bodies=16m",
        ]
        if self.upstream_ca:
            argv += ["--set", f"ssl_verify_upstream_trusted_ca={self._upstream_bundle()}"]
        logfile = open(self.dir / "proxy.log", "ab")  # noqa: SIM115 - handed to the child
        try:
            self._proc = await asyncio.create_subprocess_exec(
                *argv,
                env=env,
                stdin=asyncio.subprocess.DEVNULL,
                stdout=logfile,
                stderr=logfile,
                pass_fds=(theirs.fileno(),),
                preexec_fn=_die_with_parent,
            )
        finally:
            theirs.close()
            logfile.close()
        reader, self._writer = await asyncio.open_unix_connection(sock=ours)
        self._ready.clear()
        self._spawn_task(self._read(reader))
        self._spawn_task(self._watch(self._proc))
        proc = self._proc
        try:
            async with asyncio.timeout(READY_TIMEOUT):
                done = asyncio.ensure_future(self._ready.wait())
                await asyncio.wait(
                    [done, asyncio.ensure_future(proc.wait())], return_when="FIRST_COMPLETED"
                )
                if not self._ready.is_set():
                    done.cancel()
                    raise errors.CellaError(
                        f"the egress proxy exited with {proc.returncode}; "
                        f"see {self.dir / 'proxy.log'}"
                    )
                await self._wait_listening()
        except TimeoutError:
            self._proc.kill()
            raise errors.CellaError(
                f"the egress proxy did not start; see {self.dir / 'proxy.log'}"
            ) from None
        self._send({"op": "reset"})
        self._send(self._boundary)
        if self._signing:
            self._send(self._signing)
        for msg in self._state.values():
            self._send(msg)
        log.info("egress proxy on 127.0.0.1:%d (pid %s)", self.port, self._proc.pid)

    def _upstream_bundle(self) -> Path:
        """The host's roots plus the configured CAs: mitmproxy trusts only the file it is
        given, and an internal registry's CA should not cost the public ones."""
        bundle = self.dir / "upstream-ca.pem"
        roots = SYSTEM_ROOTS.read_bytes() if SYSTEM_ROOTS.exists() else b""
        bundle.write_bytes(roots + b"\n" + self.upstream_ca)
        return bundle

    async def _wait_listening(self) -> None:
        while True:
            try:
                _, w = await asyncio.open_connection("127.0.0.1", self.port)
                w.close()
                return
            except OSError:
                await asyncio.sleep(0.05)

    def _spawn_task(self, coro: Any) -> None:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _read(self, reader: asyncio.StreamReader) -> None:
        while line := await reader.readline():
            try:
                msg = json.loads(line)
            except ValueError:
                continue
            if msg.get("op") == "ready":
                self._ready.set()
            elif msg.get("op") == "synced":
                waiter = self._syncs.pop(msg.get("seq", -1), None)
                if waiter is not None and not waiter.done():
                    waiter.set_result(None)
            elif msg.get("op") == "decision":
                msg.pop("op")
                try:
                    self.on_decision(msg)
                except Exception:
                    log.exception("recording an egress decision failed")

    async def _watch(self, proc: asyncio.subprocess.Process) -> None:
        code = await proc.wait()
        if self._closing or proc is not self._proc or not self._ready.is_set():
            return  # closing, replaced, or never started (start() reports that)
        log.error("egress proxy exited with %s; starting it again", code)
        for delay in (0.2, 1.0, 5.0, 5.0, 5.0):
            await asyncio.sleep(delay)
            try:
                await self._spawn()
                return
            except Exception:
                log.exception("egress proxy restart failed")

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc and self._proc.returncode is None else None

    async def close(self) -> None:
        self._closing = True
        if self._writer is not None:
            self._writer.close()
        if self._proc is not None and self._proc.returncode is None:
            self._proc.kill()
            await self._proc.wait()
        for task in list(self._tasks):
            task.cancel()

    # -- state --------------------------------------------------------------------------

    def _send(self, msg: dict[str, Any]) -> None:
        if self._writer is not None and not self._writer.is_closing():
            self._writer.write(json.dumps(msg).encode() + b"\n")

    async def synced(self, timeout: float = 5.0) -> None:
        """Returns once the proxy has applied every message sent before (it answers a `sync`
        in order), so a change made through the API holds for the guest's next connection.
        A proxy that does not answer in `timeout` is logged, not waited on for ever."""
        if self._writer is None or self._writer.is_closing() or not self._ready.is_set():
            return  # none runs: what it is sent on start is the whole state
        self._seq += 1
        seq = self._seq
        waiter = self._syncs[seq] = asyncio.get_running_loop().create_future()
        self._send({"op": "sync", "seq": seq})
        try:
            await asyncio.wait_for(waiter, timeout)
        except TimeoutError:
            log.warning("the egress proxy did not confirm a change within %.0f s", timeout)
        finally:
            self._syncs.pop(seq, None)

    def set(
        self,
        addr: str,
        sandbox_id: str,
        allow: list[str],
        deny: list[str],
        secrets: list[dict[str, Any]] | None = None,
        headers: list[dict[str, Any]] | None = None,
        api: dict[str, Any] | None = None,
        cloud: dict[str, list[dict[str, Any]]] | None = None,
        callbacks: list[dict[str, Any]] | None = None,
        tenant: str = "",
        rewrites: dict[str, Any] | None = None,
        volumes: dict[str, Any] | None = None,
        upstream: dict[str, Any] | None = None,
    ) -> None:
        """What the VM at `addr` may reach, with which credentials (`api`: cella's own, for
        access delegation; `cloud`: AWS signing and GCP token rules; `rewrites`: hosts
        answered by other sandboxes' ports, through the daemon; `volumes`: its volume mounts'
        WebDAV, to the daemon; `upstream`: the tenant's own proxy its allowed connections go
        through); takes effect for its next connection."""
        self.addresses.claim(addr)
        msg = {
            "op": "set",
            "addr": addr,
            "sandbox": sandbox_id,
            "allow": allow,
            "deny": deny,
            "secrets": secrets or [],
            "headers": headers or [],
            "api": api,
            **(cloud or {}),
            "callbacks": callbacks or [],
            "tenant": tenant,
            "rewrites": rewrites,
            "volumes": volumes,
            "upstream": upstream,
        }
        self._state[addr] = msg
        self._send(msg)

    def sign_with(self, kid: str, pem: str, issuer: str) -> None:
        """The key proxy callbacks are signed with (sent again after a restart)."""
        self._signing = {"op": "signing", "kid": kid, "pem": pem, "issuer": issuer}
        self._send(self._signing)

    def guard(self, boundary: Boundary) -> None:
        """The operator's line around every sandbox's rules (sent again after a restart)."""
        self._boundary = {"op": "boundary", **boundary.to_json()}
        self._send(self._boundary)

    def drop(self, addr: str) -> None:
        """The VM at `addr` is gone: its address reaches nothing and is free again."""
        self._state.pop(addr, None)
        self.addresses.release(addr)
        self._send({"op": "drop", "addr": addr})
