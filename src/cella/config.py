"""Configuration, in one place: the daemon's settings and the client's.

Nothing else in cella reads the environment for configuration. Every variable:

| variable              | read by        | meaning                                               |
| --------------------- | -------------- | ----------------------------------------------------- |
| `CELLA_DATA_DIR`      | daemon, client | daemon state; clients find its address and key there  |
| `CELLA_IMAGE_DIR`     | daemon, setup  | kernel and template cache (shared by daemons)         |
| `CELLA_CONFIG`        | daemon         | TOML of daemon settings (else `DATA_DIR/cella.toml`)  |
| `CELLA_<SETTING>`     | daemon         | any field of `DaemonSettings`, e.g. `CELLA_LISTEN`    |
| `CELLA_DEBIAN_MIRROR` | setup          | mirror for template builds (else the host's apt one)  |
| `CELLA_EXTRA_CA_CERTIFICATES` | daemon | JSON list of PEM files host tools and guests trust |
| `CELLA_URL`           | client         | daemon URL (else `DATA_DIR/daemon.json`); gateways a,b |
| `CELLA_API_KEY`       | client         | API key (else `DATA_DIR/admin.key`, owner-readable)   |

Daemon settings come from, later ones winning: the defaults below, the TOML file, the
environment, then `cella serve` flags. This module imports only pydantic: the SDK loads it.
"""

from __future__ import annotations

import ipaddress
import json
import os
import re
from pathlib import Path
from typing import Any, Literal
from urllib.parse import unquote, urlsplit

from pydantic import Field, field_validator
from pydantic_settings import (
    BaseSettings,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    TomlConfigSettingsSource,
)

DEFAULT_DATA_DIR = Path("/var/lib/cella")
DEFAULT_LISTEN = "127.0.0.1:8420"
DAEMON_FILE = "daemon.json"  # the daemon's address, written at start
ADMIN_KEY_FILE = "admin.key"


def _host_memory_mib() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // (1 << 20)


def _default_image_dir() -> Path:
    return DEFAULT_DATA_DIR / "images"


class DaemonSettings(BaseSettings):
    """Every knob of `cella serve` (and of `cella setup`'s image builds)."""

    model_config = SettingsConfigDict(env_prefix="CELLA_", extra="ignore")

    data_dir: Path = Field(default=DEFAULT_DATA_DIR, description="state and VMs")
    image_dir: Path = Field(
        default_factory=_default_image_dir, description="kernel and template cache (shared)"
    )
    template_dir: Path | None = Field(  # read through `own_template_dir()`
        default=None,
        description="templates built from images, kept apart from the shared cache (a "
        "fleet's node on a host whose cache other nodes share; relative: under the data "
        "directory; default: the cache's)",
    )
    debian_mirror: str | None = Field(
        default=None, description="Debian mirror for template builds (default: the host's)"
    )
    image_max_layers: int = Field(default=128, ge=1, description="most layers of an image import")
    image_max_download_mib: int = Field(
        default=16384, ge=1, description="most compressed layer bytes one image import fetches"
    )
    image_max_unpacked_mib: int = Field(
        default=65536, ge=1, description="most bytes an image's layers may unpack to"
    )
    image_max_files: int = Field(
        default=2_000_000, ge=1, description="most entries an image's layers may unpack to"
    )
    listen: str = Field(default=DEFAULT_LISTEN, description="HOST:PORT of the REST API")
    jail: bool = Field(
        default=True,
        description="run each QEMU in a jail: its own uid, no capabilities, namespaces "
        "holding only its files, seccomp (see cella/runtime/qemu/jail.py)",
    )
    jail_id_base: int = Field(
        default=3_000_000,
        ge=1000,
        description="the group of files jailed QEMUs share; VMs get the uids and gids above it",
    )
    jail_ids: int = Field(default=65_536, ge=1, description="how many jailed VMs at most")
    database_url: str | None = Field(
        default=None,
        description="a fleet gateway's state in PostgreSQL (postgresql://user@host/db), "
        "shared by every gateway given the same URL (default: SQLite files in the data "
        "directory, one gateway)",
    )
    secrets_key_file: Path | None = Field(
        default=None,
        description="the 0600 file with the key that seals secret values in the database "
        "(default: secrets.key in the data directory; made on first start)",
    )
    secrets_key_command: str | None = Field(
        default=None,
        description="a command that prints the secrets key, base64 (e.g. from a KMS); "
        "replaces the key file, and rotation is then the KMS's",
    )
    tls_cert: Path | None = Field(default=None, description="serve HTTPS with this certificate")
    tls_key: Path | None = Field(default=None, description="the private key of tls_cert")
    proxy_api_port: int = Field(
        default=0,
        ge=0,
        le=65535,
        description="with TLS: the loopback port where the API also answers in clear, for "
        "the egress proxy alone to reach (access delegation, rewrite rules); `cella serve` "
        "picks one when 0",
    )
    allow_insecure_listen: bool = Field(
        default=False,
        description="listen on an address other than loopback without TLS (only behind a "
        "proxy that terminates TLS)",
    )
    # a fleet's Ray cluster (cella.fleet.rayauth)
    ray_allow_unauthenticated: bool = Field(
        default=False,
        description="let the fleet gateway (`cella serve --ray`), a node daemon (its "
        "`cella/ray_allow_unauthenticated` label) or `cella eval run --ray` join a Ray "
        "cluster that answers without a token; anyone who reaches such a cluster runs code "
        "as root on every node. By default they refuse it: start every node with "
        "RAY_AUTH_MODE=token and the cluster's token (docs/kuberay.md)",
    )
    # a fleet that grows and shrinks with Ray's autoscaler (cella.fleet.growth)
    fleet_autoscale: bool = Field(
        default=False,
        description="the fleet gateway: a create no node has room for asks Ray's autoscaler "
        "for another `cella_node` node and waits for it (up to fleet_scale_up_wait_s), and "
        "every node with sandboxes holds a claim on it so the autoscaler never takes it; "
        "off: such a create is refused at once",
    )
    fleet_scale_up_wait_s: float = Field(
        default=300.0,
        gt=0,
        le=3600,
        description="with fleet_autoscale: how long a create waits for a node to join",
    )
    fleet_scale_down_grace_s: float = Field(
        default=300.0,
        ge=0,
        description="with fleet_autoscale: how long a node stays held after its last sandbox "
        "is gone (then Ray's autoscaler may remove it once its own idle timeout passes)",
    )
    audit_keep: int = Field(
        default=1_000_000, ge=1000, description="entries kept in the audit log of key use"
    )
    sandbox_domain: str | None = Field(
        default=None,
        description="the domain whose names `{port}-{sandbox_id}.DOMAIN` reach servers in "
        "sandboxes through this daemon (a wildcard DNS name for it; default: localhost and the "
        "listen port, which browsers and curl resolve to loopback)",
    )
    runtime: Literal["qemu"] = Field(
        default="qemu", description="the backend that runs VMs (cella/runtime/select.py)"
    )
    accel: Literal["auto", "kvm", "tcg"] = Field(default="auto", description="accelerator")
    max_vcpus: int = Field(default=16, ge=1, description="most vCPUs one sandbox may have")
    max_memory_mib: int = Field(default=16384, ge=128, description="most RAM per sandbox")
    max_disk_mib: int = Field(default=65536, ge=512, description="largest disk per sandbox")
    max_upload_mib: int = Field(default=1024, ge=1, description="largest single upload")
    template_files_quota_mib: int = Field(
        default=4096,
        ge=1,
        description="what a tenant's uploaded template files (E2B's Template.copy) may take "
        "on the host together: an upload past it is refused (413)",
    )
    template_files_keep_hours: float = Field(
        default=24.0,
        gt=0,
        description="how long an uploaded template file no running or ready build names is "
        "kept after its upload (or a client last asked for it)",
    )
    max_exec_output_mib: int = Field(
        default=16,
        ge=1,
        le=1024,
        description="output of a non-streamed exec kept per stream (the rest is counted, not "
        "returned); streamed execs are not cut",
    )
    trace_max_processes: int = Field(
        default=2000,
        ge=1,
        le=100000,
        description="processes of one command recorded in full in its trace (more are "
        "counted only, and its summary says `truncated`)",
    )
    max_disk_mib_per_tenant: int | None = Field(
        default=None,
        ge=1,
        description="host disk a tenant's sandboxes may hold, stopped ones included (none: "
        "no limit); a create, fork or resume over it is refused",
    )
    # processes: commands that outlive their connection (LangSmith and E2B commands, the
    # image's entrypoint, terminals), kept with their output for clients to re-attach
    max_processes_per_sandbox: int = Field(
        default=64,
        ge=1,
        description="processes a sandbox keeps, running or ended: a start over it evicts the "
        "longest-ended first, and is refused when all of them run",
    )
    max_processes_per_tenant: int = Field(
        default=512, ge=1, description="the same, over all of a tenant's sandboxes"
    )
    max_process_output_mib_per_sandbox: int = Field(
        default=64,
        ge=1,
        description="output the daemon keeps of a sandbox's processes (at most 4 MiB per "
        "stream of each): over it, the oldest bytes of ended processes go first (longest-ended "
        "first), then the oldest bytes of the process writing",
    )
    max_process_output_mib_per_tenant: int = Field(
        default=256, ge=1, description="the same, over all of a tenant's sandboxes"
    )
    max_process_keep_seconds: float = Field(
        default=86400.0,
        gt=0,
        description="longest an ended process is kept for re-attaching, whatever its own TTL "
        "(e.g. LangSmith's ttl_seconds -1, 'forever')",
    )
    boot_timeout: float = Field(default=60.0, gt=0, description="seconds to agent ready")
    max_sandboxes_per_tenant: int = Field(default=100, ge=1, description="live sandboxes")
    # a fleet gateway's replicas (cella.fleet.replicas)
    replicate_tenants: list[str] = Field(
        default_factory=list,
        description="tenants every sandbox of which a fleet replicates, as if made with "
        "`replicate: true`",
    )
    replica_interval_s: float = Field(
        default=600.0,
        gt=0,
        description="how often a fleet refreshes the replica of a running replicated sandbox "
        "(it is refreshed on every stop too)",
    )
    max_volume_mib_per_tenant: int | None = Field(
        default=10240,
        ge=1,
        description="bytes (MiB) all of a tenant's volumes may hold; a write past it is refused "
        "(none: unbounded)",
    )
    volume_mount_token_seconds: int = Field(
        default=3600,
        ge=3,
        le=86400,
        description="lifetime of the token the egress proxy reaches a sandbox's volume mounts "
        "with; renewed for sandboxes with a VM a third of it before it ends",
    )
    max_host_memory_mib: int = Field(
        default_factory=lambda: _host_memory_mib() * 4 // 5,
        description="RAM all sandboxes may commit together (default 80% of the host's)",
    )
    max_host_vcpus: int = Field(
        default_factory=lambda: 200 * (os.cpu_count() or 1),
        description="vCPUs all sandboxes may commit together (idle sandboxes cost little CPU)",
    )
    admission_wait_seconds: float = Field(
        default=2.0,
        ge=0,
        le=600,
        description="how long a create, fork or resume that does not fit the host's "
        "commitment or the tenant's live sandboxes waits for room before it is refused (a "
        "burst's arrivals are queued briefly, not bounced; 0: refused at once)",
    )
    default_max_pids: int = Field(default=4096, ge=16, description="guest processes per sandbox")
    reaper_interval: float = Field(default=0.5, gt=0, description="seconds between TTL checks")
    metrics_interval: float = Field(
        default=5.0,
        ge=0,
        description="seconds between samples of each running sandbox's CPU, memory and disk "
        "(0: none are taken)",
    )
    metrics_keep: int = Field(
        default=720, ge=1, le=100_000, description="samples kept per sandbox (the oldest go)"
    )
    webhook_attempts: int = Field(
        default=6, ge=1, le=20, description="tries of a webhook delivery before it is failed"
    )
    webhook_backoff: float = Field(
        default=2.0,
        gt=0,
        description="seconds before a failed webhook delivery's first retry (doubling after "
        "each, up to 10 minutes)",
    )
    pool_size: int = Field(default=2, ge=0, le=256, description="warm VMs kept per pool shape")
    pool_spares: int = Field(
        default=1,
        ge=0,
        le=64,
        description="QEMUs started ahead per pool shape, waiting for a restore's state: a "
        "create that finds the pool empty only loads the state",
    )
    fork_spares: int = Field(
        default=16,
        ge=0,
        le=256,
        description="QEMUs started ahead, in all, for the next fork of snapshots forked "
        "before (each up to its last fork's size, gone after pool_shrink_seconds without "
        "one): a branch that gets one only loads the state",
    )
    pool_max_size: int = Field(
        default=16,
        ge=0,
        le=256,
        description="warm VMs a pool may grow to after a burst of creates of its shape at once "
        "(back to pool_size after pool_shrink_seconds without one, or when admission needs "
        "the room)",
    )
    pool_shrink_seconds: float = Field(
        default=120.0, gt=0, description="seconds without a burst before a grown pool shrinks"
    )
    pool_template: str = Field(default="default", description="template of the warm pool")
    log_level: str = Field(default="info", description="uvicorn log level")
    log_format: Literal["text", "json"] = Field(
        default="text",
        description="`json`: one JSON object per log line, with the request's id and the "
        "sandbox it names (for a log pipeline)",
    )
    otlp_endpoint: str | None = Field(
        default=None,
        description="OTLP/HTTP traces URL (e.g. http://collector:4318/v1/traces): every "
        "sandbox event is also exported there as a span",
    )
    console_max_kib: int = Field(
        default=1024,
        ge=16,
        description="guest console output kept on the host per sandbox (and as much again "
        "in console.log.1); older output is dropped",
    )
    max_connections_per_sandbox: int = Field(
        default=128,
        ge=1,
        le=65536,
        description="egress connections one sandbox may hold open at once (more are refused)",
    )
    egress_port: int = Field(
        default=0,
        ge=0,
        le=65535,
        description="loopback port of the egress proxy (0: pick one once, keep it)",
    )
    egress_hosts: dict[str, str | list[str]] = Field(
        default_factory=dict,
        description="name -> address(es) the proxy uses instead of DNS (internal registries; "
        "these may be non-public addresses)",
    )
    egress_tenant_networks: list[str] = Field(
        default_factory=list,
        description="non-public networks (CIDR) tenants' address rules may open (default: "
        "none). Everything not public (loopback, private, shared and link-local ranges with "
        "the metadata endpoints, unique- and site-local IPv6) and the host's and fleet "
        "nodes' own addresses are reached from sandboxes only through the operator: a name "
        "in egress_hosts, or an address in one of these networks (env: a JSON list)",
    )
    egress_tenant_upstreams: dict[str, str] = Field(
        default_factory=dict,
        description="tenant -> upstream proxy its sandboxes' allowed connections go through "
        "(`socks5://[user:password@]host:port` or `http://...`, HTTP CONNECT), unless a "
        "sandbox names its own; the operator's, so its address may be any (env: a JSON object)",
    )
    egress_aws_hosts: list[str] = Field(
        default_factory=list,
        description="names LangSmith's `aws` proxy rules also sign requests to, beside "
        "*.amazonaws.com: S3-compatible stores (domain or *.domain; env: a JSON list)",
    )
    egress_upstream_ca: Path | None = Field(
        default=None,
        description="PEM CA the proxy trusts for upstream TLS, besides the host's roots",
    )
    extra_ca_certificates: list[Path] = Field(
        default_factory=list,
        description="PEM files of CAs that host tools (image fetches, the egress proxy) and "
        "every guest trust besides the usual roots: TLS inspection, internal mirrors and "
        "registries (env: a JSON list)",
    )

    def own_template_dir(self) -> Path | None:
        """`template_dir`, a relative one under the data directory (a node's label cannot
        hold a path)."""
        if self.template_dir is None:
            return None
        return self.data_dir / self.template_dir

    def extra_ca_pem(self) -> bytes:
        """The extra CA certificates as one PEM bundle (empty without any)."""
        parts = []
        for path in self.extra_ca_certificates:
            pem = path.read_bytes()
            if b"-----BEGIN CERTIFICATE-----" not in pem:
                raise ValueError(f"{path}: no PEM certificate in it")
            parts.append(pem if pem.endswith(b"\n") else pem + b"\n")
        return b"".join(parts)

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        # the TOML file of the data directory in use: a flag (`cella serve --data-dir`) wins
        given = getattr(init_settings, "init_kwargs", {}).get("data_dir")
        data_dir = Path(given or os.environ.get("CELLA_DATA_DIR") or DEFAULT_DATA_DIR)
        toml = Path(os.environ.get("CELLA_CONFIG") or data_dir / "cella.toml")
        return (init_settings, env_settings, TomlConfigSettingsSource(settings_cls, toml))

    @field_validator("egress_hosts")
    @classmethod
    def _egress_hosts(cls, value: dict[str, str | list[str]]) -> dict[str, str | list[str]]:
        for name, addrs in value.items():
            for addr in [addrs] if isinstance(addrs, str) else addrs:
                try:
                    ipaddress.ip_address(addr)
                except ValueError:
                    raise ValueError(f"egress_hosts[{name!r}]: {addr!r} is not an IP") from None
        return value

    @field_validator("egress_aws_hosts")
    @classmethod
    def _egress_aws_hosts(cls, value: list[str]) -> list[str]:
        for name in value:
            if not re.fullmatch(r"(\*\.)?[A-Za-z0-9]([A-Za-z0-9.-]*[A-Za-z0-9])?", name):
                raise ValueError(f"egress_aws_hosts: {name!r} is not a domain or *.domain")
        return value

    @field_validator("egress_tenant_networks")
    @classmethod
    def _egress_tenant_networks(cls, value: list[str]) -> list[str]:
        for network in value:
            try:
                ipaddress.ip_network(network, strict=False)
            except ValueError:
                raise ValueError(f"egress_tenant_networks: {network!r} is not a CIDR") from None
        return value

    @field_validator("egress_tenant_upstreams")
    @classmethod
    def _egress_tenant_upstreams(cls, value: dict[str, str]) -> dict[str, str]:
        for tenant, url in value.items():
            upstream_parts(url, f"egress_tenant_upstreams[{tenant!r}]")
        return value

    def egress_host_table(self) -> dict[str, list[str]]:
        return {
            name.lower(): [addrs] if isinstance(addrs, str) else list(addrs)
            for name, addrs in self.egress_hosts.items()
        }

    @property
    def host_port(self) -> tuple[str, int]:
        host, _, port = self.listen.rpartition(":")
        return host or "127.0.0.1", int(port)

    @property
    def url(self) -> str:
        host, port = self.host_port
        return f"{'https' if self.tls_cert else 'http'}://{host}:{port}"

    def check_listen(self) -> None:
        """Refuses what would expose keys and secrets in clear: a non-loopback address
        without TLS (unless allowed), half a TLS setting."""
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("TLS needs both tls_cert and tls_key")
        host = self.host_port[0].strip("[]")
        try:
            loopback = host == "localhost" or ipaddress.ip_address(host).is_loopback
        except ValueError:
            loopback = False
        if not loopback and self.tls_cert is None and not self.allow_insecure_listen:
            raise ValueError(
                f"{host} is not a loopback address: API keys would cross the network in "
                "clear. Give --tls-cert and --tls-key, or --allow-insecure-listen behind a "
                "proxy that terminates TLS"
            )

    @property
    def ports_domain(self) -> str:
        return (self.sandbox_domain or f"localhost:{self.host_port[1]}").lower()

    def public(self) -> dict[str, Any]:
        return self.model_dump(mode="json")


class ClientSettings(BaseSettings):
    """Where the SDK and CLI find a daemon and the key to use."""

    model_config = SettingsConfigDict(env_prefix="CELLA_", extra="ignore")

    url: str | None = Field(default=None, description="daemon URL")
    api_key: str | None = Field(default=None, description="API key")
    data_dir: Path = Field(default=DEFAULT_DATA_DIR, description="a local daemon's data directory")

    def daemon_url(self) -> str:
        """`url`, else the address the local daemon wrote, else the default listen address."""
        if self.url:
            return self.url.rstrip("/")
        try:
            return str(json.loads((self.data_dir / DAEMON_FILE).read_text())["url"]).rstrip("/")
        except (OSError, ValueError, KeyError, TypeError):
            return f"http://{DEFAULT_LISTEN}"

    def key(self) -> str | None:
        """`api_key`, else the local daemon's admin key (readable by its owner only)."""
        if self.api_key:
            return self.api_key
        try:
            return (self.data_dir / ADMIN_KEY_FILE).read_text().strip() or None
        except OSError:
            return None


def upstream_parts(url: str, where: str = "upstream proxy") -> dict[str, Any]:
    """`socks5://[user:password@]host:port` (or `http://`) as the egress proxy takes it."""
    parts = urlsplit(url)
    try:
        port = parts.port
    except ValueError:
        port = None
    if parts.scheme not in ("socks5", "http") or not parts.hostname or port is None:
        raise ValueError(f"{where}: {url!r} is not socks5://host:port or http://host:port")
    return {
        "scheme": parts.scheme,
        "host": parts.hostname,
        "port": port,
        "username": unquote(parts.username) if parts.username is not None else None,
        "password": unquote(parts.password) if parts.password is not None else None,
    }
