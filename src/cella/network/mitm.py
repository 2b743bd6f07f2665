"""The egress proxy's mitmproxy addon (loaded by `addon.py`): per-sandbox policy, secret
substitution, cloud credentials (`cloud_auth.py`), the decision log.

Runs inside `mitmdump` (its own interpreter and virtualenv), so it imports only mitmproxy,
the stdlib, `cella.policy` and `cloud_auth` (botocore, google-auth). The daemon drives it
over a socket pair (fd in CELLA_EGRESS_FD), one JSON object a line:

  daemon -> proxy  {"op": "set", "addr", "sandbox", "allow", "deny", "secrets": [...],
                    "headers": [...], "aws": [...], "gcp": [...], "callbacks": [...],
                    "api": {...}, "rewrites": {"upstream", "token", "rules": [...]}}
                   {"op": "drop", "addr"}      {"op": "reset"}
                   {"op": "boundary", "protected", "tenant_networks", "names"}
                   {"op": "sync", "seq"}
  proxy -> daemon  {"op": "ready"}             {"op": "decision", ...}
                   {"op": "synced", "seq"}     (every message before that sync is applied)

A connection's sandbox is the loopback address it comes from: QEMU's forward for that VM
binds it, and the guest cannot choose it. TLS is intercepted only toward hosts a secret of
the sandbox is bound to; everything else passes through untouched (and is still decided by
policy, by SNI or CONNECT host). Every upstream connection goes through `server_connect`,
which resolves the name on the host, decides, and pins the address it decided on; the
operator's `Boundary` (restricted addresses, tenant networks) is checked there again for
every connection, whatever rules a sandbox carries.
"""

from __future__ import annotations

import asyncio
import base64
import ipaddress
import json
import logging
import os
import socket
import time
from dataclasses import dataclass, field
from typing import Any

from mitmproxy import ctx, http, tcp, tls
from mitmproxy.net.tls import starts_like_tls_record
from mitmproxy.proxy import layer, layers, server_hooks
from mitmproxy.proxy.layers.tls import parse_client_hello

from cella.network.callbacks import CallbackRule, Callbacks, Signing, full_request
from cella.network.cloud_auth import CloudAuth, CloudRules, Refused, Tokens
from cella.network.delegation import REASON, ApiAccess, access_from, authorize, is_api
from cella.network.rewrites import ROUTE_HOST, Rewrite, Rewrites, rewrites_from, route
from cella.network.upstream import Splicer, Upstream, UpstreamError, dial
from cella.network.volumes import VolumeAccess, is_volumes, volumes_from
from cella.network.volumes import route as route_volume
from cella.policy.egress import (
    Boundary,
    Decision,
    IPAddress,
    Policy,
    Rule,
    host_matches,
    parse_rule,
)
from cella.policy.rewrites import HOST_HEADER, TOKEN_HEADER, guard
from cella.policy.secrets import Redactor, secret_forms
from cella.policy.volumes import REASON as VOLUMES_REASON

log = logging.getLogger("cella.egress")
RESOLVE_TTL = 30.0
DENIED_STATUS = 403


@dataclass(frozen=True)
class Binding:
    """A secret as the proxy uses it: its placeholder, real value and where it may go.

    `inject`: "anywhere" swaps the placeholder in URL, headers and body; "header" only sets
    the Authorization header (for hosts that store what they are sent)."""

    name: str
    placeholder: str
    value: str
    hosts: tuple[Rule, ...]
    header: tuple[str, str] | None = None  # added when the request does not carry it
    inject: str = "anywhere"
    user: str = "x-access-token"

    def needles(self) -> list[tuple[bytes, bytes]]:
        return secret_forms(self.value, self.placeholder, self.user)


@dataclass(frozen=True)
class HeaderRule:
    """A header set on requests to `hosts`; `secrets` are (name, value) of what it holds."""

    hosts: tuple[Rule, ...]
    name: str
    value: str
    secrets: tuple[tuple[str, str], ...] = ()
    identities: tuple[tuple[str, str, int], ...] = ()  # (name, audience, seconds) to mint


@dataclass
class Net:
    sandbox: str
    policy: Policy
    secrets: tuple[Binding, ...] = ()
    headers: tuple[HeaderRule, ...] = ()
    cloud: CloudRules = field(default_factory=CloudRules)
    needles: list[tuple[bytes, bytes]] = field(default_factory=list)
    api: ApiAccess | None = None  # cella's API, with access delegation
    callbacks: tuple[CallbackRule, ...] = ()
    tenant: str = ""
    rewrites: Rewrites | None = None  # hosts answered by another sandbox's port
    volumes: VolumeAccess | None = None  # its volume mounts, served by the daemon
    upstream: Upstream | None = None  # the tenant's own proxy its connections go through

    def __post_init__(self) -> None:
        found = {n: m for b in self.secrets for n, m in b.needles()}
        for rule in self.headers:
            for name, value in rule.secrets:
                found.update(secret_forms(value, f"[secret:{name}]"))
        for name, value in self.cloud.secrets():
            found.update(secret_forms(value, f"[secret:{name}]"))
        self.needles = sorted(found.items(), key=lambda p: -len(p[0]))

    def hide(self, value: str, mark: str) -> None:
        """Keeps `value` (a credential made for this sandbox) out of what comes back."""
        if any(needle == value.encode() for needle, _ in self.needles):
            return  # a cached token: hidden when it was made
        found = dict(self.needles) | dict(secret_forms(value, mark))
        self.needles = sorted(found.items(), key=lambda p: -len(p[0]))

    def bound(self, host: str) -> list[Binding]:
        return [b for b in self.secrets if host_matches(b.hosts, host)]

    def header_rules(self, host: str) -> list[HeaderRule]:
        return [r for r in self.headers if host_matches(r.hosts, host)]

    def opens(self, host: str) -> bool:
        """Whether TLS to `host` is intercepted: a secret, header, cloud, callback or
        rewrite rule needs it."""
        callbacks = any(host_matches(r.hosts, host) for r in self.callbacks)
        rewritten = self.rewrites is not None and self.rewrites.find(host) is not None
        return bool(
            self.bound(host)
            or self.header_rules(host)
            or self.cloud.covers(host)
            or callbacks
            or rewritten
        )

    def rewrite(self, host: str, port: int) -> Rewrite | None:
        """The rewrite rule for `host`, unless a deny rule covers it."""
        rule = self.rewrites.find(host) if self.rewrites is not None else None
        return rule if rule is not None and self.policy.denial(host, port) is None else None

    def added_for(self, host: str) -> list[str]:
        """Headers the sandbox's rules set on requests to `host`."""
        names = [r.name for r in self.header_rules(host)]
        return names + [b.header[0] for b in self.bound(host) if b.header is not None]

    def scrub(self, text: str) -> str:
        for needle, mark in self.needles:
            text = text.replace(needle.decode(), mark.decode())
        return text

    def leaks(self, text: str) -> bool:
        return any(needle.decode() in text for needle, _ in self.needles)


@dataclass
class Tally:
    """What one allowed exchange carried, reported when it ends."""

    net: Net
    host: str
    port: int
    protocol: str
    reason: str
    started: float = field(default_factory=time.monotonic)
    bytes_out: int = 0
    bytes_in: int = 0
    credentials: list[str] = field(default_factory=list)
    rewrite: Rewrite | None = None
    guarded: list[str] = field(default_factory=list)  # credential headers a rewrite acted on
    shown: tuple[str, str] = ("", "")  # a rewritten request's path and URL as it was sent
    client_port: int | None = None  # the daemon's end of the connection: who opened it

    @property
    def keeps_credentials(self) -> bool:
        """Whether the sandbox's credentials go with the request (not to a rewrite that
        strips or redacts them)."""
        return self.rewrite is None or self.rewrite.credentials == "keep"


def _net_from(msg: dict[str, Any]) -> Net:
    bindings = tuple(
        Binding(
            name=s["name"],
            placeholder=s["placeholder"],
            value=s["value"],
            hosts=tuple(parse_rule(h) for h in s["hosts"]),
            header=tuple(s["header"]) if s.get("header") else None,
            inject=s.get("inject") or "anywhere",
            user=s.get("username") or "x-access-token",
        )
        for s in msg.get("secrets", [])
    )
    headers = tuple(
        HeaderRule(
            hosts=tuple(parse_rule(h) for h in r["hosts"]),
            name=r["name"],
            value=r["value"],
            secrets=tuple((s["name"], s["value"]) for s in r.get("secrets", [])),
            identities=tuple(
                (i["name"], i["audience"], int(i["ttl_seconds"])) for i in r.get("identities", [])
            ),
        )
        for r in msg.get("headers", [])
    )
    policy = Policy.parse(msg.get("allow", ()), msg.get("deny", ()))
    callbacks = tuple(CallbackRule.of(r) for r in msg.get("callbacks", []))
    return Net(
        msg["sandbox"],
        policy,
        bindings,
        headers,
        CloudRules.from_json(msg),
        api=access_from(msg),
        callbacks=callbacks,
        tenant=str(msg.get("tenant") or ""),
        rewrites=rewrites_from(msg),
        volumes=volumes_from(msg),
        upstream=Upstream.of(msg.get("upstream")),
    )


class Egress:
    def __init__(self) -> None:
        self.nets: dict[str, Net] = {}
        hosts = json.loads(os.environ.get("CELLA_EGRESS_HOSTS") or "{}")
        self.overrides = {
            name.lower(): [ipaddress.ip_address(a) for a in addrs] for name, addrs in hosts.items()
        }
        self.boundary = Boundary(names=frozenset(self.overrides))  # until the daemon's arrives
        self._resolved: dict[str, tuple[float, list[IPAddress]]] = {}
        self._writer: asyncio.StreamWriter | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._verdicts: dict[str, str] = {}  # server connection id -> why it was allowed
        self._tunnels: set[str] = set()  # server connections of passed-through streams
        self._pins: dict[str, str] = {}  # server connection id -> the certificate it must show
        self.cloud = CloudAuth(Tokens(lambda: ctx.options.ssl_verify_upstream_trusted_ca))
        self.callbacks = Callbacks(self._callback_address)
        self.splicer = Splicer()

    # -- control channel ----------------------------------------------------------------

    async def running(self) -> None:
        fd = os.environ.get("CELLA_EGRESS_FD")
        if not fd:
            return
        reader, self._writer = await asyncio.open_unix_connection(
            sock=socket.socket(fileno=int(fd))
        )
        task = asyncio.create_task(self._control(reader))
        self._tasks.add(task)
        self._send({"op": "ready"})

    async def _control(self, reader: asyncio.StreamReader) -> None:
        while line := await reader.readline():
            msg = json.loads(line)
            try:
                if msg["op"] == "set":
                    self.nets[msg["addr"]] = _net_from(msg)
                elif msg["op"] == "drop":
                    self.nets.pop(msg["addr"], None)
                elif msg["op"] == "reset":
                    self.nets.clear()
                elif msg["op"] == "boundary":
                    self.boundary = Boundary.from_json(msg)
                elif msg["op"] == "signing":
                    self.callbacks.signing = Signing.of(msg)
                elif msg["op"] == "sync":  # all before it is applied: say so
                    self._send({"op": "synced", "seq": msg["seq"]})
            except (KeyError, ValueError) as exc:
                log.error("bad control message %s: %s", msg.get("op"), exc)
        os._exit(0)  # the daemon is gone: so is its proxy

    def _send(self, msg: dict[str, Any]) -> None:
        if self._writer is not None and not self._writer.is_closing():
            self._writer.write(json.dumps(msg).encode() + b"\n")

    def _report(
        self, net: Net | None, host: str, port: int, decision: Decision, **extra: Any
    ) -> None:
        self._send(
            {
                "op": "decision",
                "sandbox": net.sandbox if net else None,
                "host": host,
                "port": port,
                "allowed": decision.allowed,
                "reason": decision.reason,
                **extra,
            }
        )

    def _finish(self, tally: Tally, **extra: Any) -> None:
        self._report(
            tally.net,
            tally.host,
            tally.port,
            Decision(True, tally.reason),
            protocol=tally.protocol,
            client_port=tally.client_port,
            bytes_out=tally.bytes_out,
            bytes_in=tally.bytes_in,
            duration_ms=round((time.monotonic() - tally.started) * 1000, 1),
            **({"credentials": tally.credentials} if tally.credentials else {}),
            **({"rewrite": _rewritten(tally)} if tally.rewrite is not None else {}),
            **extra,
        )

    # -- deciding -----------------------------------------------------------------------

    def _net(self, client: Any) -> Net | None:
        peer = getattr(client, "peername", None)
        return self.nets.get(peer[0]) if peer else None

    async def _resolve(self, host: str) -> list[IPAddress]:
        name = host.lower().rstrip(".")
        if name in self.overrides:
            return self.overrides[name]
        cached = self._resolved.get(name)
        if cached and cached[0] > time.monotonic():
            return cached[1]
        try:
            infos = await asyncio.get_running_loop().getaddrinfo(
                name, None, type=socket.SOCK_STREAM
            )
            found = list(dict.fromkeys(ipaddress.ip_address(i[4][0]) for i in infos))
        except (OSError, ValueError):
            found = []
        self._resolved[name] = (time.monotonic() + RESOLVE_TTL, found)
        return found

    async def _decide(
        self, net: Net | None, host: str, port: int
    ) -> tuple[Decision, list[IPAddress]]:
        if net is None:
            return Decision(False, "the connection belongs to no sandbox"), []
        if host.lower().rstrip(".") == ROUTE_HOST:  # the proxy's own name, never a guest's
            return Decision(False, "no rule allows it"), []
        addresses: list[IPAddress] = []
        trusted = host.lower().rstrip(".") in self.overrides  # from the table: no lookup
        if trusted or net.policy.needs_addresses(host, port):
            addresses = await self._resolve(host)
        decision = net.policy.decide(host, port, addresses, trusted=trusted, boundary=self.boundary)
        return decision, addresses

    async def _reach(self, host: str, port: int) -> IPAddress:
        """The address for the proxy's own request to `host` (a token endpoint named in a
        tenant's key): the operator's boundary holds for it as for any sandbox."""
        addresses = await self._resolve(host)
        trusted = host.lower().rstrip(".") in self.overrides
        decision = Policy.parse([host], []).decide(
            host, port, addresses, trusted=trusted, boundary=self.boundary
        )
        if not decision.allowed or not addresses:
            raise ValueError(decision.reason if not decision.allowed else "does not resolve")
        return addresses[0]

    async def _upstream_address(self, up: Upstream) -> IPAddress:
        """Where an upstream proxy is: a tenant's held to the boundary (`_reach`), the
        operator's wherever the operator put it."""
        if not up.operator:
            return await self._reach(up.host, up.port)
        try:
            return ipaddress.ip_address(up.host)
        except ValueError:
            found = await self._resolve(up.host)
        if not found:
            raise ValueError("does not resolve")
        return found[0]

    # -- HTTP (explicit proxy, transparent port 80, intercepted TLS) ---------------------

    async def http_connect(self, flow: http.HTTPFlow) -> None:
        net = self._net(flow.client_conn)
        host, port = flow.request.host, flow.request.port
        if net is not None and net.rewrite(host, port) is not None:
            return  # opened: its requests are rewritten
        decision, _ = await self._decide(net, host, port)
        if not decision.allowed:
            flow.response = _denied(host, port, decision)
            self._report(net, host, port, decision, protocol="connect", client_port=_port(flow))

    async def requestheaders(self, flow: http.HTTPFlow) -> None:
        net = self._net(flow.client_conn)
        req = flow.request
        if net is not None and net.api is not None and is_api(net.api, req.host):
            authorize(req.headers, net.api)
            if net.api.pinned:  # a gateway serving TLS: `tls_start_server` pins its certificate
                req.scheme = "https"
            flow.metadata["cella"] = Tally(
                net, req.host, req.port, req.scheme, REASON, client_port=_port(flow)
            )
            if net.needles:  # checked for secrets as they stream, like every response
                req.headers["accept-encoding"] = "identity"
            return
        if net is not None and net.volumes is not None and is_volumes(net.volumes, req.host):
            decision = Decision(True, VOLUMES_REASON)
            self._report(
                net,
                req.host,
                req.port,
                decision,
                protocol="http",
                method=req.method,
                client_port=_port(flow),
            )
            route_volume(req, net.sandbox, net.volumes, ROUTE_HOST)
            return
        rule = net.rewrite(req.host, req.port) if net is not None else None
        if net is not None and rule is not None:
            await self._rewrite(flow, net, rule)
            return
        decision, _ = await self._decide(net, req.host, req.port)
        if net is None or not decision.allowed:
            flow.response = _denied(req.host, req.port, decision)
            self._report(
                net,
                req.host,
                req.port,
                decision,
                protocol=req.scheme,
                method=req.method,
                client_port=_port(flow),
            )
            return
        reason = decision.reason
        if net.upstream is not None:  # its connection goes through it (`server_connect`)
            reason = f"{reason} (via {net.upstream.address})"
        tally = Tally(net, req.host, req.port, req.scheme, reason, client_port=_port(flow))
        flow.metadata["cella"] = tally
        await self._credentials(flow, net, tally)

    async def _rewrite(self, flow: http.HTTPFlow, net: Net, rule: Rewrite) -> None:
        """A request to a rewrite's host: its credentials as the rule says, then on its way
        to the daemon, which hands it to the other sandbox's port."""
        req = flow.request
        tally = Tally(
            net, req.host, req.port, req.scheme, rule.reason, rewrite=rule, client_port=_port(flow)
        )
        flow.metadata["cella"] = tally
        if tally.keeps_credentials:
            await self._credentials(flow, net, tally)
            if flow.response is not None:
                return
        else:
            if rule.credentials == "redact":  # present as the rules set them, then redacted
                for header in net.header_rules(req.host):
                    req.headers[header.name] = header.value
                for b in net.bound(req.host):
                    if b.header is not None:
                        req.headers[b.header[0]] = b.header[1]
            tally.guarded = guard(req.headers, rule.credentials, net.added_for(req.host))
            if net.needles:
                req.headers["accept-encoding"] = "identity"
        tally.shown = (req.path, req.pretty_url)
        assert net.rewrites is not None
        route(req, net.sandbox, net.rewrites, rule)

    async def _credentials(self, flow: http.HTTPFlow, net: Net, tally: Tally) -> None:
        """Secrets, header rules and cloud credentials for the request's host."""
        req = flow.request
        for b in net.bound(req.host):
            if _substitute_head(req, b):
                tally.credentials.append(b.name)
        for rule in net.header_rules(req.host):
            value = rule.value
            for name, audience, seconds in rule.identities:  # minted for this request
                if self.callbacks.signing is None:
                    flow.response = _refusal(503, "cella egress: no signing key yet")
                    return
                token = self.callbacks.signing.workload(audience, net.tenant, net.sandbox, seconds)
                value = value.replace(f"{{identity:{name}}}", token)
                tally.credentials.append(f"identity:{name}")
            req.headers[rule.name] = value  # whatever the sandbox sent in its place
            tally.credentials.extend(name for name, _ in rule.secrets)
        if net.cloud.covers(req.host):
            try:
                names, made = await self.cloud.head(req, net.cloud, flow.metadata, self._reach)
            except Refused as exc:
                flow.response = _refusal(exc.status, net.scrub(str(exc)))
                return
            tally.credentials.extend(names)
            for value in made:
                net.hide(value, "[cloud-token]")
        if net.needles:
            # responses are searched for secrets as they stream: they must come uncompressed
            req.headers["accept-encoding"] = "identity"

    async def request(self, flow: http.HTTPFlow) -> None:
        tally: Tally | None = flow.metadata.get("cella")
        if tally is None:
            return
        added = await self._asked(flow, tally)
        if added is None:
            return
        body = flow.request.raw_content or b""
        tally.bytes_out = len(body)
        if not tally.keeps_credentials:
            assert tally.rewrite is not None
            tally.guarded += [
                n
                for n in guard(flow.request.headers, tally.rewrite.credentials, added)
                if n not in tally.guarded
            ]
            return
        for b in tally.net.bound(tally.host):
            if b.inject == "anywhere" and b.placeholder.encode() in body:
                body = body.replace(b.placeholder.encode(), b.value.encode())
                flow.request.raw_content = body
                if "content-length" in flow.request.headers:  # raw_content leaves it as it was
                    flow.request.headers["content-length"] = str(len(body))
                if b.name not in tally.credentials:
                    tally.credentials.append(b.name)
        self.cloud.body(flow.request, flow.metadata)
        tally.bytes_out = len(body)
        headers = flow.request.headers
        if body and "content-length" not in headers and "transfer-encoding" not in headers:
            # an HTTP/2 request's body has no length of its own: held whole, it is given one,
            # or an HTTP/1 server reads none of it
            headers["content-length"] = str(len(body))

    async def _asked(self, flow: http.HTTPFlow, tally: Tally) -> list[str] | None:
        """The sandbox's callbacks for this host say it may go (and set their headers: the
        names it set); else it is answered 403 here (None). `network.callbacks` asks.
        A rewritten request is shown as the sandbox sent it, without the proxy's headers."""
        req, net, host, port = flow.request, tally.net, tally.host, tally.port
        identity = {"tenant_id": net.tenant, "sandbox_id": net.sandbox}
        added: list[str] = []
        for rule in self.callbacks.rules(net.callbacks, host):
            sent = None
            if rule.full_request:  # as the sandbox sent it: no secret goes to a callback
                shown_path, shown_url = tally.shown if tally.rewrite else (req.path, req.pretty_url)
                path, _, query = net.scrub(shown_path).partition("?")
                headers = [
                    (k, net.scrub(v))
                    for k, v in req.headers.items(True)
                    if k.lower() not in (TOKEN_HEADER, HOST_HEADER)
                ]
                url, body = net.scrub(shown_url), req.raw_content or b""
                sent = full_request(
                    req.method, url, tally.protocol, host, path, query, headers, body
                )
            verdict = await self.callbacks.ask(rule, identity, host, port, sent)
            if not verdict.allowed:
                decision = Decision(False, verdict.reason)
                flow.response = _denied(host, port, decision)
                flow.metadata.pop("cella", None)
                self._report(
                    net,
                    host,
                    port,
                    decision,
                    protocol=tally.protocol,
                    client_port=tally.client_port,
                )
                return None
            for name, value in verdict.headers:
                req.headers[name] = value
                added.append(name)
        return added

    async def _callback_address(self, host: str) -> IPAddress | None:
        """Where a callback URL's host is, if the operator's boundary lets the proxy go there
        (a name of the operator's table goes anywhere; else only public addresses or the
        tenant networks)."""
        trusted = host.lower().rstrip(".") in self.overrides
        for address in await self._resolve(host):
            if trusted or self.boundary.closed(address) is None or self.boundary.opened(address):
                return address
        return None

    def responseheaders(self, flow: http.HTTPFlow) -> None:
        """Every response streams through (big downloads stay off the heap). For a sandbox
        with secrets, every form of their values is taken out of it first: status line,
        headers and body, whatever its size or framing."""
        tally: Tally | None = flow.metadata.get("cella")
        resp = flow.response
        if tally is None or resp is None:
            return

        def count(chunk: bytes) -> bytes:
            tally.bytes_in += len(chunk)
            return chunk

        net = tally.net
        if not net.needles:
            resp.stream = count
            return
        resp.reason = net.scrub(resp.reason)
        for name, value in list(resp.headers.items(multi=True)):
            if net.leaks(value):
                resp.headers.set_all(name, [net.scrub(v) for v in resp.headers.get_all(name)])
        encoding = resp.headers.get("content-encoding", "identity").lower()
        if encoding not in ("", "identity"):
            _refuse(resp, f"a {encoding}-encoded response cannot be checked for secrets")
            return
        # the redacted body may differ in length: it goes out chunked (HTTP/2 frames itself);
        # a response that has no body keeps its length (a HEAD's is the object's size)
        bodiless = flow.request.method == "HEAD" or resp.status_code in (204, 304)
        if bodiless:
            resp.stream = count
            return
        if resp.http_version.startswith("HTTP/1") and "content-length" in resp.headers:
            del resp.headers["content-length"]
            resp.headers["transfer-encoding"] = "chunked"
        resp.stream = Redactor(net.needles, count)

    def response(self, flow: http.HTTPFlow) -> None:
        tally: Tally | None = flow.metadata.pop("cella", None)
        if tally is None or flow.response is None:
            return
        self._finish(tally, method=flow.request.method, status=flow.response.status_code)

    def error(self, flow: http.HTTPFlow) -> None:
        tally: Tally | None = flow.metadata.pop("cella", None)
        message = str(flow.error)
        net = tally.net if tally is not None else self._net(flow.client_conn)
        if net is not None and net.leaks(message):
            # mitmproxy's error page would quote it (a request line, a reflected reason):
            # drop the connection instead of answering
            flow.kill()
            message = net.scrub(message)
        if tally is not None:
            self._finish(tally, method=flow.request.method, error=message)

    # -- TLS: pass through unless a secret needs it opened --------------------------------

    def next_layer(self, nextlayer: layer.NextLayer) -> None:
        ctx = nextlayer.context
        data = nextlayer.data_client()
        if ctx.client.transport_protocol != "tcp" or ctx.client.tls:
            return
        if not starts_like_tls_record(data):
            return
        try:
            hello = parse_client_hello(data)
        except ValueError:
            return
        if hello is None:
            nextlayer.layer = None  # wait for the rest of the ClientHello
            return
        if ctx.server.address is not None:
            host, port = ctx.server.address[0], ctx.server.address[1]
        else:  # straight to the transparent TLS port: SNI is all there is
            host, port = hello.sni or "", 443
        net = self._net(ctx.client)
        if host and net is not None and net.opens(host):
            return  # keep mitmproxy's TLS layers: requests get credentials
        ctx.server.address = (host, port)  # no SNI: "" is refused by server_connect
        ctx.server.sni = host or None
        nextlayer.layer = layers.TCPLayer(ctx)

    async def server_connect(self, data: server_hooks.ServerConnectionHookData) -> None:
        """The last gate of every upstream connection: decide, then pin the address."""
        if data.server.address is None:
            return
        net = self._net(data.client)
        host, port = str(data.server.address[0]), int(data.server.address[1])
        if net is not None and net.api is not None and is_api(net.api, host):
            if bool(data.server.tls) != bool(net.api.pinned):  # never but as `requestheaders`
                data.server.error = "cella egress: cella.api is reached by plain HTTP requests"
                return  # (TLS to a pinned gateway, in clear to a daemon on this host)
            data.server.address = net.api.upstream  # the daemon, whatever port was asked
            self._verdicts[data.server.id] = REASON
            if net.api.pinned:
                self._pins[data.server.id] = net.api.pinned
            return
        routed = host == ROUTE_HOST and not data.server.tls and data.server.sni is None
        door = None if net is None else (net.rewrites or net.volumes)
        if routed and door is not None:
            data.server.address = door.upstream  # a request `_rewrite` or a volume routed
            return  # (its flow reports it; a guest naming ROUTE_HOST is refused below)
        decision, addresses = await self._decide(net, host, port)
        if not decision.allowed:
            data.server.error = f"cella egress: {host}:{port} {decision.reason}"
            self._report(net, host, port, decision, protocol="tcp", client_port=_port(data))
            return
        try:
            literal = ipaddress.ip_address(host)
        except ValueError:
            literal = None
        pinned = literal or (addresses[0] if addresses else None)
        if pinned is None:  # allowed without addresses cannot happen for a name; be safe
            data.server.error = f"cella egress: {host} does not resolve"
            return
        data.server.address = (str(pinned), port)
        if net is not None and net.upstream is not None:
            try:  # through the sandbox's own proxy, to the address decided on
                proxy_ip = await self._upstream_address(net.upstream)
                tunnel = await dial(net.upstream, str(proxy_ip), str(pinned), port)
                data.server.address = await self.splicer.hand_over(tunnel)
            except (UpstreamError, ValueError) as exc:
                why = f"upstream proxy {net.upstream.address}: {exc}"
                data.server.error = f"cella egress: {host}:{port} {why}"
                self._report(
                    net, host, port, Decision(False, why), protocol="tcp", client_port=_port(data)
                )
                return
            self._verdicts[data.server.id] = f"{decision.reason} (via {net.upstream.address})"
            return
        self._verdicts[data.server.id] = decision.reason

    def tls_start_server(self, data: tls.TlsData) -> None:
        """TLS to a fleet gateway's API trusts the gateway's certificate and nothing else
        (every other upstream TLS is mitmproxy's, with the host's roots)."""
        pem = self._pins.get(data.conn.id)
        if pem is not None:
            data.ssl_conn = pinned_connection(pem)

    def server_disconnected(self, data: server_hooks.ServerConnectionHookData) -> None:
        self._pins.pop(data.server.id, None)
        if data.server.id not in self._tunnels:  # a tunnel's verdict is read when it ends
            self._verdicts.pop(data.server.id, None)

    def tcp_start(self, flow: tcp.TCPFlow) -> None:
        net = self._net(flow.client_conn)
        if net is not None and flow.server_conn.address:
            host = flow.server_conn.sni or str(flow.server_conn.address[0])
            port = int(flow.server_conn.address[1])
            flow.metadata["cella"] = Tally(
                net, host, port, "tls-passthrough", "", client_port=_port(flow)
            )
            self._tunnels.add(flow.server_conn.id)

    def tcp_message(self, flow: tcp.TCPFlow) -> None:
        tally: Tally | None = flow.metadata.get("cella")
        if tally is not None and flow.messages:
            msg = flow.messages[-1]
            if msg.from_client:
                tally.bytes_out += len(msg.content)
            else:
                tally.bytes_in += len(msg.content)
            flow.messages.clear()  # counted; not kept

    def tcp_end(self, flow: tcp.TCPFlow) -> None:
        self._tcp_done(flow)

    def tcp_error(self, flow: tcp.TCPFlow) -> None:
        self._tcp_done(flow, error=str(flow.error))

    def _tcp_done(self, flow: tcp.TCPFlow, **extra: Any) -> None:
        tally: Tally | None = flow.metadata.pop("cella", None)
        self._tunnels.discard(flow.server_conn.id)
        reason = self._verdicts.pop(flow.server_conn.id, None)
        if tally is not None and reason is not None:  # denials were reported when made
            tally.reason = reason
            self._finish(tally, address=_peer(flow.server_conn), **extra)


def _rewritten(tally: Tally) -> dict[str, Any]:
    rule = tally.rewrite
    assert rule is not None
    return {
        "sandbox": rule.sandbox,
        "port": rule.port,
        "credentials": rule.credentials,
        "headers": tally.guarded,
    }


def _port(flow: Any) -> int | None:
    """The client's port of a flow (or hook data): the daemon's end of the guest's
    connection, which the daemon maps back to the guest process that opened it."""
    client = getattr(flow, "client_conn", None) or getattr(flow, "client", None)
    peer = getattr(client, "peername", None)
    return int(peer[1]) if peer else None


def _peer(server: Any) -> str | None:
    return str(server.peername[0]) if getattr(server, "peername", None) else None


def pinned_connection(pem: str) -> Any:
    """A client TLS connection that accepts exactly the certificate `pem` (as its own trust
    anchor, whatever issued it; no other CA, no name check: the pin is the identity)."""
    from OpenSSL import SSL, crypto

    pinned = crypto.load_certificate(crypto.FILETYPE_PEM, pem.encode())
    want = pinned.digest("sha256")
    context = SSL.Context(SSL.TLS_CLIENT_METHOD)
    context.set_min_proto_version(SSL.TLS1_2_VERSION)
    store = context.get_cert_store()
    assert store is not None
    store.add_cert(pinned)
    store.set_flags(crypto.X509StoreFlags.PARTIAL_CHAIN)

    def verify(_conn: Any, cert: Any, _errno: int, depth: int, ok: int) -> bool:
        return bool(ok) and (depth > 0 or cert.digest("sha256") == want)

    context.set_verify(SSL.VERIFY_PEER, verify)
    connection = SSL.Connection(context)
    connection.set_connect_state()
    return connection


def _denied(host: str, port: int, decision: Decision) -> http.Response:
    return http.Response.make(
        DENIED_STATUS,
        f"cella egress: {host}:{port} denied: {decision.reason}\n",
        {"Content-Type": "text/plain", "X-Cella-Egress": "denied"},
    )


def _refusal(status: int, message: str) -> http.Response:
    return http.Response.make(
        status, message + "\n", {"Content-Type": "text/plain", "X-Cella-Egress": "refused"}
    )


def _refuse(resp: http.Response, why: str) -> None:
    """Turns a response whose head has arrived into a 502 of ours; the upstream body is
    read and dropped (replacing the flow's response would send the upstream body anyway)."""
    body = f"cella egress: {why}\n".encode()
    resp.status_code, resp.reason = 502, "Bad Gateway"
    resp.headers = http.Headers(
        content_type="text/plain",
        content_length=str(len(body)),
        x_cella_egress="refused",
    )
    resp.stream = lambda chunk: [] if chunk else [body]


def _substitute_head(req: http.Request, b: Binding) -> bool:
    """Swaps the placeholder for the value in the URL and headers (Basic auth decoded); a
    header-only secret sets its Authorization header and is never substituted."""
    if b.inject == "header":
        if b.header is None:
            return False
        req.headers[b.header[0]] = b.header[1]
        return True
    used = False
    if b.placeholder in req.url:
        req.url = req.url.replace(b.placeholder, b.value)
        used = True
    for name, value in list(req.headers.items(multi=True)):
        new = value.replace(b.placeholder, b.value)
        if name.lower() == "authorization" and value[:6].lower() == "basic ":
            try:
                decoded = base64.b64decode(value[6:], validate=True).decode()
            except (ValueError, UnicodeDecodeError):
                decoded = ""
            if b.placeholder in decoded:
                swapped = decoded.replace(b.placeholder, b.value)
                new = "Basic " + base64.b64encode(swapped.encode()).decode()
        if new != value:
            req.headers.set_all(name, [new if v == value else v for v in req.headers.get_all(name)])
            used = True
    if b.header is not None and b.header[0] not in req.headers:
        req.headers[b.header[0]] = b.header[1]
        used = True
    return used
