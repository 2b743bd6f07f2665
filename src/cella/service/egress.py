"""Egress for sandboxes: owns the egress proxy, each VM's policy and secrets in it, the
guest's side of it (proxy variables, the deployment CA, placeholders), network policy
changes, the egress decision log and the tenant's secret store."""

from __future__ import annotations

import asyncio
import functools
import ipaddress
import json
import logging
import secrets as tokens
import time
from typing import Any, Protocol

from cella import errors
from cella.config import DaemonSettings
from cella.guest.client import GuestStream
from cella.guest.protocol import EGRESS_ADDR, PROXY_PORT
from cella.guest.trust import CA_ENV, trust
from cella.models import BucketMount, NetworkPolicy, SecretPut
from cella.models.buckets import with_buckets
from cella.network.interfaces import host_addresses
from cella.network.proxy import EgressProxy
from cella.policy.access import Permission, Principal
from cella.policy.cloud import DUMMY_AWS_ENV, service_account_problem
from cella.policy.delegation import API_HOST
from cella.policy.egress import Boundary, IPAddress, parse_rule
from cella.runtime.contract import VM
from cella.service import proxy_credentials as credentials
from cella.service.connections import ConnectionOwners
from cella.service.delegation import api_address, pinned_of, proxy_access, upstream_of
from cella.service.registry import Registry
from cella.service.rewrites import Rewrites, setter_of
from cella.store import SandboxRecord, SecretRecord, SecretRef

log = logging.getLogger("cella.egress")
REFUSAL_EVENT_SECONDS = 10.0
BOUNDARY_REFRESH_SECONDS = 30.0  # the host's interface addresses can change (DHCP, hotplug)


class Networked(Protocol):
    network: NetworkPolicy
    bucket_mounts: list[BucketMount]


def rules_of(row: Networked) -> NetworkPolicy:
    """What the proxy holds a sandbox (or a create) to: its egress rules with its bucket
    mounts' (their hosts allowed, their credentials added)."""
    return with_buckets(row.network, row.bucket_mounts)


def proxy_env() -> dict[str, str]:
    """What every exec sees: the explicit proxy (tools that ignore it are caught by the
    DNS stub and the transparent ports, which lead to the same proxy)."""
    url = f"http://{EGRESS_ADDR}:{PROXY_PORT}"
    no_proxy = "localhost,127.0.0.1,::1"
    return {
        "HTTP_PROXY": url,
        "HTTPS_PROXY": url,
        "http_proxy": url,
        "https_proxy": url,
        "NO_PROXY": no_proxy,
        "no_proxy": no_proxy,
    }


class SandboxEgress:
    def __init__(
        self,
        settings: DaemonSettings,
        registry: Registry,
        rewrites: Rewrites,
        owners: ConnectionOwners,
    ) -> None:
        self.registry = registry
        self.owners = owners
        self.rewrites = rewrites
        self.store = registry.store
        self.events = registry.events
        self.extra_ca = settings.extra_ca_pem()  # guests trust these (in warm snapshots)
        upstream = settings.egress_upstream_ca.read_bytes() if settings.egress_upstream_ca else b""
        self.proxy = EgressProxy(
            registry.driver.paths,
            port=settings.egress_port,
            hosts=settings.egress_host_table(),
            upstream_ca=self.extra_ca + upstream,
            on_decision=self._record,
        )
        self.tenant_networks = tuple(
            ipaddress.ip_network(n, strict=False) for n in settings.egress_tenant_networks
        )
        self.host_names = frozenset(settings.egress_host_table())
        self._fleet_file = registry.driver.paths.root / "egress" / "fleet-addresses.json"
        self.fleet_addresses = self._stored_fleet_addresses()
        self.boundary = self._boundary()
        self._refresher: asyncio.Task[None] | None = None
        self._ca: bytes | None = None
        self.max_connections = settings.max_connections_per_sandbox
        self.upstreams = settings.egress_tenant_upstreams
        self.api = api_address(settings)  # where `cella.api` leads a delegated sandbox
        self._addresses: dict[VM, str] = {}
        self._held: dict[str, int] = {}  # sandbox id -> connections open now
        self._last_refusal: dict[str, float] = {}

    async def start(self) -> None:
        await self.proxy.start()
        self.proxy.guard(self.boundary)
        self._refresher = asyncio.create_task(self._refresh_forever())

    async def close(self) -> None:
        if self._refresher is not None:
            self._refresher.cancel()
        await self.proxy.close()

    # -- the operator's boundary ----------------------------------------------------------

    def _boundary(self) -> Boundary:
        return Boundary(
            protected=host_addresses() | self.fleet_addresses,
            tenant_networks=self.tenant_networks,
            names=self.host_names,
        )

    def refresh_boundary(self) -> None:
        boundary = self._boundary()
        if boundary != self.boundary:
            self.boundary = boundary
            self.proxy.guard(boundary)

    async def _refresh_forever(self) -> None:
        while True:
            await asyncio.sleep(BOUNDARY_REFRESH_SECONDS)
            try:
                self.refresh_boundary()
            except Exception:  # psutil hiccups must not end the loop
                log.exception("reading the host's addresses failed")

    def set_fleet_addresses(self, addresses: frozenset[IPAddress]) -> None:
        """Every fleet node's address (told by the gateway): closed like the host's own,
        and kept for the next start (before the gateway tells it again)."""
        self._fleet_file.parent.mkdir(parents=True, exist_ok=True)
        temp = self._fleet_file.with_suffix(".tmp")
        temp.write_text(json.dumps(sorted(map(str, addresses))))
        temp.replace(self._fleet_file)
        self.fleet_addresses = addresses
        self.refresh_boundary()

    def _stored_fleet_addresses(self) -> frozenset[IPAddress]:
        try:
            return frozenset(map(ipaddress.ip_address, json.loads(self._fleet_file.read_text())))
        except (OSError, ValueError, TypeError):
            return frozenset()

    def check_rules(self, policy: NetworkPolicy) -> None:
        """A tenant's allow rules stay inside the operator's boundary (an admin key acting
        for a tenant is a tenant here); the proxy checks again at every connect."""
        extra = [policy.upstream_proxy.host] if policy.upstream_proxy else []
        for text in [*policy.allow, *extra]:
            why = self.boundary.refusal(parse_rule(text))
            if why is not None:
                raise errors.DestinationForbidden(why)

    def _record(self, decision: dict[str, Any]) -> None:
        sandbox_id = decision.pop("sandbox", None)
        if sandbox_id:
            self.owners.record(sandbox_id, decision)
        else:
            log.info("egress from no sandbox: %s", decision)

    # -- VMs ----------------------------------------------------------------------------

    def attach(self, vm: VM, row: SandboxRecord) -> None:
        """Gives the VM the sandbox's policy and secrets (again, after changes), and carries
        the connections its guest opens to the proxy, from a loopback address that is this
        VM's alone: that is how the proxy knows who is asking."""
        addr = self._addresses.get(vm)
        if addr is None:
            addr = self._addresses[vm] = self.proxy.addresses.allocate()
            vm.exit_hooks.append(lambda: self._release(vm))
        policy = rules_of(row)
        self.proxy.set(
            addr,
            row.id,
            list(policy.allow),
            list(policy.deny),
            credentials.bindings(self.store, row),
            credentials.header_rules(self.store, row),
            api=self._api(row),
            cloud=credentials.cloud_rules(self.store, row.tenant, policy),
            callbacks=[c.model_dump() for c in row.network.callbacks],
            tenant=row.tenant,
            rewrites=self.rewrites.for_proxy(row, self.api),
            volumes=self._volumes(row),
            upstream=credentials.upstream(self.store, row, self.upstreams.get(row.tenant)),
        )
        vm.agent.on_stream = functools.partial(self._carry, row.id, addr)

    def _api(self, row: SandboxRecord) -> dict[str, Any] | None:
        """cella's API for a sandbox with access delegation: the address the proxy takes
        `cella.api` to (with the certificate pinned there when it is a gateway serving TLS),
        and the key it mints the sandbox's tokens with."""
        key = proxy_access(row)
        if key is None:
            return None
        api = {"upstream": list(upstream_of(row) or self.api), "key": key.hex()}
        pinned = pinned_of(row)
        return api | ({"tls": pinned} if pinned else {})

    def _volumes(self, row: SandboxRecord) -> dict[str, Any] | None:
        """A sandbox with volume mounts: where the proxy takes `volumes.cella`, its token."""
        if not row.volume_mounts:
            return None
        return {"upstream": list(self.api), "token": self.rewrites.ports.mount_token(row.id)}

    def _release(self, vm: VM) -> None:
        addr = self._addresses.pop(vm, None)
        if addr is not None:
            self.proxy.drop(addr)

    async def _carry(self, sandbox_id: str, addr: str, stream: GuestStream) -> None:
        """One guest connection to the proxy and back, both ways until both ends close."""
        held = self._held.get(sandbox_id, 0)
        if held >= self.max_connections:
            self._refused(sandbox_id)
            return  # the stream is closed: the guest sees its connection reset
        self._held[sandbox_id] = held + 1
        writer: asyncio.StreamWriter | None = None
        try:
            reader, writer = await asyncio.open_connection(
                "127.0.0.1", self.proxy.port, local_addr=(addr, 0)
            )
            self.owners.opened(sandbox_id, writer.get_extra_info("sockname"), stream.owner)

            async def up() -> None:
                assert writer is not None
                while data := await stream.read():
                    writer.write(data)
                    await writer.drain()
                if writer.can_write_eof():
                    writer.write_eof()

            async def down() -> None:
                while data := await reader.read(64 << 10):
                    await stream.write(data)
                await stream.write_eof()

            await asyncio.gather(up(), down())
        except (OSError, ConnectionError):
            pass  # either end went away: the stream is closed below
        finally:
            self._held[sandbox_id] -= 1
            if writer is not None:
                writer.close()

    def _refused(self, sandbox_id: str) -> None:
        """At most one event a sandbox per REFUSAL_EVENT_SECONDS: a guest hammering the
        limit should not flood its own trace."""
        now = time.monotonic()
        if (
            now - self._last_refusal.get(sandbox_id, -REFUSAL_EVENT_SECONDS)
            >= REFUSAL_EVENT_SECONDS
        ):
            self._last_refusal[sandbox_id] = now
            self.events.emit(
                sandbox_id,
                "limit_hit",
                {"limit": "connections", "max": self.max_connections, "action": "refused"},
            )

    def check_policy(self, who: Principal, policy: NetworkPolicy) -> NetworkPolicy:
        """The rules stay inside the boundary, every secret a rule names exists, a GCP
        rule's secret is a service account's key, and every sandbox a rewrite names is one
        `who` may exec in; the policy to keep (rewrites name their sandboxes by id)."""
        tenant = who.tenant
        self.check_rules(policy)
        settled = self.rewrites.settle(who, policy)
        for name in policy.secret_names:
            if self.store.get_secret(tenant, name) is None:
                raise errors.InvalidArgument(f"no secret {name!r} (in the network rules or mounts)")
        for rule in policy.gcp:
            secret = self.store.get_secret(tenant, rule.service_account)
            assert secret is not None
            why = service_account_problem(secret.value)
            if why is not None:
                raise errors.InvalidArgument(f"secret {rule.service_account!r}: {why}")
        return settled

    def intercepts(self, row: SandboxRecord) -> bool:
        """Whether any of the sandbox's TLS is opened (it then trusts the deployment CA)."""
        net = rules_of(row)
        return bool(
            row.secrets or net.headers or net.aws or net.gcp or net.callbacks or net.rewrites
        )

    def guest_env(self, row: SandboxRecord) -> dict[str, str]:
        env = proxy_env()
        if self.intercepts(row) or self.extra_ca:
            env |= CA_ENV  # tools with bundles of their own use the one that trusts our CAs
        if row.network.aws:  # an AWS SDK signs with these; the proxy signs again for real
            env |= DUMMY_AWS_ENV
        env |= row.network.env
        for name, ref in row.secrets.items():
            env[name] = ref.placeholder
        if row.delegation:  # the LangSmith SDK in the guest finds this API (no key needed)
            env["LANGSMITH_ENDPOINT"] = f"http://{API_HOST}"
        return env

    async def trust_ca(self, vm: VM) -> None:
        """Makes the guest trust the deployment's CA. Only sandboxes with secrets need it
        (nothing else is intercepted), and it costs a create ~0.2 s under TCG."""
        if self._ca is None:
            self._ca = self.proxy.ca_cert.read_bytes()
        await trust(vm.agent, "cella-egress", self._ca)

    # -- secrets ------------------------------------------------------------------------

    def bind_secrets(self, tenant: str, wanted: dict[str, str]) -> dict[str, SecretRef]:
        """env -> its secret and a fresh placeholder, for a new sandbox; every secret must
        exist."""
        refs = {}
        for env, name in wanted.items():
            if self.store.get_secret(tenant, name) is None:
                raise errors.InvalidArgument(f"no secret {name!r} (for {env})")
            refs[env] = SecretRef(name, f"cella-secret-{tokens.token_hex(16)}")
        return refs

    def get_secret(self, tenant: str, name: str) -> SecretRecord:
        """The secret's record: callers show it without `value` (never returned)."""
        row = self.store.get_secret(tenant, name)
        if row is None:
            raise errors.NotFound(f"no secret {name!r}")
        return row

    def list_secrets(self, tenant: str) -> list[SecretRecord]:
        return self.store.list_secrets(tenant)

    def put_secret(self, tenant: str, name: str, body: SecretPut) -> SecretRecord:
        """Stores a secret; running sandboxes that use it get the new value at once."""
        self.store.put_secret(SecretRecord.put(tenant, name, body))
        self.events.secrets_changed(tenant)
        for sandbox_id, vm in self.registry.vms().items():
            row = self.store.get_sandbox(sandbox_id)
            uses = row is not None and (
                any(r.secret == name for r in row.secrets.values())
                or name in rules_of(row).secret_names
            )
            if row is not None and row.tenant == tenant and uses:
                self.attach(vm, row)
        return self.get_secret(tenant, name)

    async def put_secret_applied(self, tenant: str, name: str, body: SecretPut) -> SecretRecord:
        """`put_secret`, answered once the proxy holds the new value: a running sandbox's
        next connection after the API's answer uses it."""
        record = self.put_secret(tenant, name, body)
        await self.proxy.synced()
        return record

    def delete_secret(self, tenant: str, name: str) -> None:
        if not self.store.delete_secret(tenant, name):
            raise errors.NotFound(f"no secret {name!r}")
        self.events.secrets_changed(tenant)

    # -- policy and log -------------------------------------------------------------------

    async def set_network(
        self, who: Principal, sandbox_id: str, policy: NetworkPolicy
    ) -> SandboxRecord:
        """Changes where a sandbox may connect (its managers may); a running one gets it
        for its next connection."""
        self.registry.get(who, sandbox_id, Permission.manage)
        policy = self.check_policy(who, policy)
        self.registry.update(sandbox_id, network=policy, rewrite_setter=setter_of(who, policy))
        row = self.registry.get(who, sandbox_id)
        vm = self.registry.vm(sandbox_id)
        if vm is not None:
            if self.intercepts(row):
                await self.trust_ca(vm)
            self.attach(vm, row)
            await self.proxy.synced()  # the guest's next connection meets the new rules
        self.events.emit(sandbox_id, "network_changed", policy.model_dump())
        return row

    def log(
        self, who: Principal, sandbox_id: str, after: int = 0, limit: int = 1000
    ) -> list[dict[str, Any]]:
        """Every connection the sandbox tried, from its trace."""
        self.registry.owned(who, sandbox_id)
        rows = self.store.events(sandbox_id, after, limit, ["egress"])
        return [{"id": r.id, "at": r.at, **r.data} for r in rows]
