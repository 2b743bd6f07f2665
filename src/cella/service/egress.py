"""Egress for sandboxes: each VM's policy and secrets in the proxy, the guest's side of it
(proxy variables, the deployment CA, placeholders) and the tenant's secret store."""

from __future__ import annotations

import base64
import contextlib
import logging
import secrets as tokens
from typing import Any

from cella import errors
from cella.network.proxy import EgressProxy
from cella.paths import Paths
from cella.runtime.qemu.args import EGRESS_ADDR, PROXY_PORT, Egress
from cella.runtime.qemu.vm import QemuVM
from cella.server.settings import Settings
from cella.store import Store
from cella.telemetry.events import EventLog

log = logging.getLogger("cella.egress")
GUEST_CA = "/usr/local/share/ca-certificates/cella-egress.crt"
GUEST_BUNDLE = "/etc/ssl/certs/ca-certificates.crt"


def proxy_env() -> dict[str, str]:
    """What every exec sees: the explicit proxy (tools that ignore it are caught by the
    DNS stub and the transparent ports)."""
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


# With secrets, TLS to their hosts is intercepted: tools with bundles of their own are
# pointed at the system bundle, which then includes the deployment's CA.
CA_ENV = {
    "SSL_CERT_FILE": GUEST_BUNDLE,
    "REQUESTS_CA_BUNDLE": GUEST_BUNDLE,
    "NODE_EXTRA_CA_CERTS": GUEST_CA,
}


class SandboxEgress:
    def __init__(self, settings: Settings, store: Store, paths: Paths, events: EventLog) -> None:
        self.store = store
        self.events = events
        self.proxy = EgressProxy(
            paths,
            port=settings.egress_port,
            hosts=settings.egress_host_table(),
            upstream_ca=settings.egress_upstream_ca,
            on_decision=self._record,
        )
        self._ca: bytes | None = None

    async def start(self) -> None:
        await self.proxy.start()

    async def close(self) -> None:
        await self.proxy.close()

    def _record(self, decision: dict[str, Any]) -> None:
        sandbox_id = decision.pop("sandbox", None)
        if sandbox_id:
            self.events.emit(sandbox_id, "egress", decision)
        else:
            log.info("egress from no sandbox: %s", decision)

    # -- VMs ----------------------------------------------------------------------------

    def new_egress(self) -> Egress:
        """Forwards for a VM about to start; its address reaches nothing until `attach`."""
        return self.proxy.egress_for()

    def release_on_exit(self, vm: QemuVM) -> QemuVM:
        if vm.config.egress is not None:
            addr = vm.config.egress.source_addr
            self.proxy.addresses.claim(addr)
            vm.exit_hooks.append(lambda: self.proxy.drop(addr))
        return vm

    def attach(self, vm: QemuVM, row: dict[str, Any]) -> None:
        """Gives the VM's address the sandbox's policy and secrets (again, after changes)."""
        if vm.config.egress is None:
            return
        if vm.config.egress.proxy_port != self.proxy.port:
            log.warning(
                "%s forwards to port %d, the proxy is on %d: it has no network",
                row["id"],
                vm.config.egress.proxy_port,
                self.proxy.port,
            )
        self.proxy.set(
            vm.config.egress.source_addr,
            row["id"],
            list(row["network"]["allow"]),
            list(row["network"]["deny"]),
            self._bindings(row),
        )

    def _bindings(self, row: dict[str, Any]) -> list[dict[str, Any]]:
        out = []
        for ref in row["secrets"].values():
            secret = self.store.get_secret(row["tenant"], ref["secret"])
            if secret is None:
                continue  # deleted since: the placeholder stays a placeholder
            out.append(
                {
                    "name": ref["secret"],
                    "placeholder": ref["placeholder"],
                    "value": secret["value"],
                    "hosts": secret["hosts"],
                    "header": _auth_header(secret),
                }
            )
        return out

    def guest_env(self, row: dict[str, Any]) -> dict[str, str]:
        env = proxy_env()
        if row["secrets"]:
            env |= CA_ENV
        for name, ref in row["secrets"].items():
            env[name] = ref["placeholder"]
        return env

    async def trust_ca(self, vm: QemuVM) -> None:
        """Makes the guest trust the deployment's CA. Only sandboxes with secrets need it
        (nothing else is intercepted), and it costs a create ~0.2 s under TCG."""
        if self._ca is None:
            self._ca = self.proxy.ca_cert.read_bytes()
        agent = vm.agent
        await agent.write_file(GUEST_CA, self._ca, parents=True)
        bundle = b""
        with contextlib.suppress(errors.CellaError):
            bundle = await agent.read_file(GUEST_BUNDLE)
        if self._ca not in bundle:
            if bundle and not bundle.endswith(b"\n"):
                bundle += b"\n"
            await agent.write_file(GUEST_BUNDLE, bundle + self._ca, parents=True)

    # -- secrets ------------------------------------------------------------------------

    def bind_secrets(self, tenant: str, wanted: dict[str, str]) -> dict[str, dict[str, str]]:
        """env -> {secret, placeholder} for a new sandbox; every secret must exist."""
        refs = {}
        for env, name in wanted.items():
            if self.store.get_secret(tenant, name) is None:
                raise errors.InvalidArgument(f"no secret {name!r} (for {env})")
            refs[env] = {"secret": name, "placeholder": f"cella-secret-{tokens.token_hex(16)}"}
        return refs

    def get_secret(self, tenant: str, name: str) -> dict[str, Any]:
        row = self.store.get_secret(tenant, name)
        if row is None:
            raise errors.NotFound(f"no secret {name!r}")
        return _public(row)

    def list_secrets(self, tenant: str) -> list[dict[str, Any]]:
        return [_public(r) for r in self.store.list_secrets(tenant)]

    def put_secret(self, tenant: str, name: str, fields: dict[str, Any]) -> dict[str, Any]:
        self.store.put_secret(tenant, name, fields)
        self.events.secrets_changed(tenant)
        return self.get_secret(tenant, name)

    def delete_secret(self, tenant: str, name: str) -> None:
        if not self.store.delete_secret(tenant, name):
            raise errors.NotFound(f"no secret {name!r}")
        self.events.secrets_changed(tenant)


def _public(row: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in row.items() if k not in ("value", "tenant")}


def _auth_header(secret: dict[str, Any]) -> list[str] | None:
    if secret.get("auth") == "bearer":
        return ["Authorization", f"Bearer {secret['value']}"]
    if secret.get("auth") == "basic":
        pair = f"{secret.get('username') or 'x-access-token'}:{secret['value']}"
        return ["Authorization", "Basic " + base64.b64encode(pair.encode()).decode()]
    return None
