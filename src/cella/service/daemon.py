"""The daemon: one of each room of the service, wired together, started and stopped.

Each room is a module of its own (`registry`, `lifecycle`, `snapshots`, `exec`, `egress`,
`trace`, `warm`, ...; the map is in docs/architecture.md). API surfaces (the REST routes,
compatible APIs) call these rooms and nothing below them.
"""

from __future__ import annotations

import json
import logging
import os
from typing import Any

from cella import __version__, errors
from cella.config import DAEMON_FILE, DaemonSettings
from cella.models import ExecRequest, SandboxCreate
from cella.paths import Paths, owner_only
from cella.runtime.contract import Driver
from cella.runtime.select import open_driver
from cella.service import delegation
from cella.service.admission import Admission
from cella.service.background import Background
from cella.service.backups import Backups
from cella.service.buckets import Buckets
from cella.service.checkpoints import Checkpoints
from cella.service.connections import ConnectionOwners
from cella.service.desktop import Desktop
from cella.service.dockerfiles import Dockerfiles
from cella.service.downloads import Downloads
from cella.service.egress import SandboxEgress
from cella.service.evals import Evals
from cella.service.exec import Exec
from cella.service.exec_policy import ExecPolicies
from cella.service.files import Files
from cella.service.forks import Forks
from cella.service.idempotency import Idempotency
from cella.service.image_registries import ImageRegistries
from cella.service.image_snapshots import ImageSnapshots
from cella.service.kernels import Kernels
from cella.service.keys import Keys, Principal
from cella.service.lifecycle import POOLED_SHAPE, Lifecycle
from cella.service.logins import Logins
from cella.service.metrics import Metrics
from cella.service.mount_renewal import MountRenewal
from cella.service.mounts import Mounts
from cella.service.moves import Moves
from cella.service.ports import Ports
from cella.service.processes import ENTRYPOINT, Processes, ProcessLimits, ProcessSpec
from cella.service.proctrace import ProcessTrace
from cella.service.reaper import Reaper
from cella.service.recovery import Recovery
from cella.service.registry import Registry
from cella.service.replicas import Replicas
from cella.service.rewrites import Rewrites
from cella.service.sessions import Sessions
from cella.service.sharing import Sharing
from cella.service.shipping import Shipping
from cella.service.signing import Signer, SigningKey
from cella.service.snapshots import Snapshots
from cella.service.template_builds import TemplateBuilds
from cella.service.template_files import TemplateFiles
from cella.service.template_shipping import TemplateShipping
from cella.service.templates import Templates
from cella.service.trace import Trace
from cella.service.usage import Usage
from cella.service.volumes import Volumes
from cella.service.waking import Waking
from cella.service.warm import Shape, WarmPool, WarmSnapshots
from cella.service.webhook_delivery import Deliveries
from cella.service.webhooks import Webhooks
from cella.store import SandboxRecord, Store, sealing
from cella.store.sealing import KeyFile, seal_store
from cella.telemetry.events import EventLog
from cella.telemetry.prometheus import Exposition, Gauges

log = logging.getLogger("cella.daemon")


class Daemon:
    def __init__(self, settings: DaemonSettings, store: Store, driver: Driver) -> None:
        self.settings = settings
        self.store = store
        self.driver = driver
        self.secrets_key: KeyFile | None = None  # None: the key comes from a command
        self.background = Background()
        self.keys = Keys(store)
        self.sessions = Sessions(self.keys, driver.paths.root / "session.key")
        self.events = EventLog(store)
        self.prometheus = Exposition()  # /metrics, fed by the events and the API
        self.events.sinks.append(self.prometheus.observe)
        self._spans: Any = None
        if settings.otlp_endpoint:
            from cella.telemetry.otel import SpanSink, otlp_http

            self._spans = SpanSink(otlp_http(settings.otlp_endpoint))
            self.events.sinks.append(self._spans)
        self.registry = Registry(store, driver, self.events, settings.console_max_kib << 10)
        self.ports = Ports(self.registry, driver.paths.root / "service.key")
        self.ports.mount_token_seconds = settings.volume_mount_token_seconds
        clear = settings.tls_cert is None or settings.proxy_api_port != 0
        self.rewrites = Rewrites(
            self.registry,
            self.ports,
            self.keys,
            tls=not clear,
            link_file=settings.data_dir / "fleet-link.json",
        )
        self.volumes = Volumes(settings, self.registry, self.ports, clear=clear)
        self.procs = ProcessTrace(self.registry.events, settings.trace_max_processes)
        self.registry.forget_hooks.append(self.procs.forget)
        owners = ConnectionOwners(self.procs)
        self.egress = SandboxEgress(settings, self.registry, self.rewrites, owners)
        self.warm = WarmSnapshots(driver, settings.boot_timeout)
        self.pool = WarmPool.of(driver, self.warm, settings)
        self.kernels = Kernels(driver, self.warm)
        self.admission = Admission(settings, self.registry, self.pool)
        self.exec_policies = ExecPolicies(self.registry)
        self.lifecycle = Lifecycle(
            settings, self.registry, self.admission, self.egress, self.warm, self.pool,
            self.exec_policies,
        )  # fmt: skip
        self.snapshots = Snapshots(self.registry)
        self.forks = Forks(self.registry, self.admission, self.lifecycle, self.snapshots)
        self.shipping = Shipping(self.registry, self.snapshots)
        self.moves = Moves(self.registry, self.lifecycle, self.snapshots, self.shipping)
        self.moves.volumes_here = self.volumes.reachable
        self.replicas = Replicas(self.registry, self.snapshots, self.shipping, self.moves)
        self.checkpoints = Checkpoints(
            self.registry, self.lifecycle, self.snapshots, self.background
        )
        self.registry.forget_hooks.append(self.checkpoints.forget)
        self.exec = Exec(self.registry, self.egress, self.procs, settings.max_exec_output_mib << 20)
        self.exec.after_command = self.checkpoints.after_exec
        self.processes = Processes(self.exec, ProcessLimits.of(settings))
        self.registry.forget_hooks.append(self.processes.forget)
        self.files = Files(self.registry, self.exec, settings.max_upload_mib << 20)
        self.mounts = Mounts(self.registry, self.exec, self.background)
        self.buckets = Buckets(self.registry, self.exec, self.background)
        self.desktop = Desktop(self.exec)
        self.signer = Signer(driver.paths.root / "signing")
        self.signer.on_rotate.append(self._sign_callbacks)
        self._sign_callbacks(self.signer.current)
        self.downloads = Downloads(self.registry, self.files, self.lifecycle, self.signer)
        self.logins = Logins(self.registry, self.signer)
        self.evals = Evals(store, self._tenant_of)
        self.image_registries = ImageRegistries(store)
        self.trace = Trace(self.registry)
        self.usage = Usage(self.registry)
        self.metrics = Metrics(settings, self.registry)
        self.webhooks = Webhooks(
            self.registry, Deliveries(settings, store, lambda: self.egress.boundary)
        )
        self.events.sinks.append(self.webhooks.sink())
        self.sharing = Sharing(self.registry)
        self.reaper = Reaper(self.registry, self.lifecycle, settings.reaper_interval)
        self.idempotency = Idempotency(store)
        self.mount_renewal = MountRenewal(
            self.registry, self.egress, settings.volume_mount_token_seconds
        )
        self.waking = Waking(self.registry, self.lifecycle)
        self.recovery = Recovery(self.registry, self.lifecycle, self.egress)
        self.backups = Backups(self.registry, lambda: self.secrets_key)
        self.templates = Templates(
            settings,
            self.registry,
            self.egress,
            self.warm,
            self.pool,
            self.lifecycle,
            self.exec,
            self.files,
        )
        self.dockerfiles = Dockerfiles(self.templates)
        self.template_shipping = TemplateShipping(driver.paths, self.templates)
        self.template_files = TemplateFiles(
            store,
            driver.paths.root / "template-files",
            max_upload_bytes=settings.max_upload_mib << 20,
            quota_bytes=settings.template_files_quota_mib << 20,
            keep_seconds=settings.template_files_keep_hours * 3600,
        )
        self.template_builds = TemplateBuilds(
            store, self.templates, self.dockerfiles, self.background, self.signer,
            self.template_files,
        )  # fmt: skip
        self.images = ImageSnapshots(
            self.templates, self.lifecycle, self.snapshots, self.image_registries, self.background
        )

        self.prometheus.gauges(self._gauges)

    def _gauges(self) -> Gauges:
        capacity = self.admission.capacity()
        return {
            "cella_sandboxes": (
                "Sandboxes by state (deleted ones not counted).",
                "state",
                {k: v for k, v in self.store.count_sandboxes_by_state().items() if k != "deleted"},
            ),
            "cella_pool_ready": ("Warm VMs ready, by shape.", "shape", self.pool.status()),
            "cella_pool_spares": ("Spare QEMUs started, by shape.", "shape", self.pool.spares()),
            "cella_pool_work": ("The warm pool's work since start.", "kind", dict(self.pool.work)),
            "cella_host_vcpus": (
                "The host's vCPU commitment: its limit, committed, free.",
                "kind",
                {
                    "limit": capacity.vcpus,
                    "committed": capacity.vcpus_committed,
                    "free": capacity.vcpus_free,
                },
            ),
            "cella_host_memory_mib": (
                "The host's memory commitment (MiB): its limit, committed, free.",
                "kind",
                {
                    "limit": capacity.memory_mib,
                    "committed": capacity.memory_mib_committed,
                    "free": capacity.memory_mib_free,
                },
            ),
        }

    @classmethod
    def open(cls, settings: DaemonSettings) -> Daemon:
        """The daemon of a data directory: its store, its local admin key and the driver of
        the configured runtime, whose VMs outlive the daemon (a restart, or a crash,
        re-adopts them)."""
        os.umask(0o077)  # everything the daemon (and QEMU, the proxy) makes is its own
        paths = Paths(settings.data_dir, settings.image_dir, settings.own_template_dir())
        paths.ensure()
        vm_group = settings.jail_id_base if settings.jail else None
        for tree in {paths.root, paths.images}:  # made before, by setup or an older daemon
            if fixed := owner_only(tree, vm_group, skip={paths.build_tmp}):
                log.info("%s: took group/other access off %d entries", tree, fixed)
        store = Store(paths.root / "cella.db")
        key_file = seal_store(
            store,
            settings.secrets_key_file or paths.root / "secrets.key",
            settings.secrets_key_command,
        )
        daemon = cls(settings, store, open_driver(settings, paths))
        daemon.secrets_key = key_file
        daemon.keys.ensure_admin_key(paths.root)
        return daemon

    def _sign_callbacks(self, key: SigningKey) -> None:
        """The egress proxy signs its callbacks with the current key."""
        self.egress.proxy.sign_with(key.kid, key.pem(), "cella")

    def _tenant_of(self, sandbox_id: str) -> str | None:
        row = self.store.get_sandbox(sandbox_id)
        return row.tenant if row else None

    async def metrics_text(self) -> str:
        return self.prometheus.text()

    async def snapshot_id(self, who: Principal, ref: str) -> str:
        """The id of the caller's snapshot `ref` (an id, name or name:tag)."""
        return self.snapshots.resolve(who.tenant, ref).id

    def rotate_secrets_key(self) -> int:
        """Seals every secret value under a new key; returns how many were resealed."""
        resealed = sealing.rotate(self.secrets_key, self.store)
        log.info("secrets key rotated; %d values resealed", resealed)
        return resealed

    async def start(self) -> None:
        """Recovers what the last daemon left, starts the egress proxy, makes sure the
        default warm snapshot exists, fills the pool and starts the reaper."""
        await self.driver.prepare()
        await self.recovery.recover()
        self.template_builds.recover()
        self.snapshots.flatten_left()
        await self.egress.start()
        shape = Shape(self.settings.pool_template, *POOLED_SHAPE)
        await self.warm.ensure(shape)
        self.pool.watch(shape)
        self.reaper.start()
        self.kernels.start()
        self.template_files.start()
        self.mount_renewal.start()
        self.processes.start_sweeper()
        self.metrics.start()
        self.webhooks.deliveries.start()
        (self.driver.paths.root / DAEMON_FILE).write_text(json.dumps({"url": self.settings.url}))

    async def shutdown(self) -> None:
        """Sandbox VMs keep running and are adopted by the next daemon; pooled VMs (nobody's
        yet) are destroyed; work started in the background is cancelled."""
        await self.background.close()
        await self.reaper.close()
        await self.kernels.close()
        await self.template_files.close()
        await self.mount_renewal.close()
        await self.metrics.close()
        await self.webhooks.deliveries.close()
        await self.processes.close()
        await self.forks.spares.close()
        await self.pool.close()
        await self.snapshots.close()
        await self.registry.detach_all()
        await self.egress.close()
        if self._spans is not None:
            self._spans.close()  # flushes what is batched
        self.store.close()

    async def create(
        self, who: Principal, spec: SandboxCreate, fleet_grant: str | None = None
    ) -> SandboxRecord:
        """A new sandbox of `who` (its creator: `cella.policy.access`): from its template
        (its image's config under the sandbox's own exec defaults), or booted from
        `spec.snapshot`; with `run_entrypoint`, the image's Entrypoint and Cmd are started
        as process `entrypoint`. `access_delegation` lets the sandbox act as `who`;
        `fleet_grant`: the grant a fleet gateway made for it instead (its API, its
        creator's key)."""
        tenant = who.tenant
        spec = self.volumes.settle(who, spec)
        granted: delegation.Json | None
        if fleet_grant is not None:
            granted = delegation.given(spec.access_delegation, fleet_grant)
        else:
            granted = self._grant(who, spec)
        if spec.snapshot is not None:
            if spec.run_entrypoint:
                raise errors.InvalidArgument("run_entrypoint applies to templates, not snapshots")
            defaults = self.images.defaults(tenant, spec.snapshot, spec.exec_defaults)
            booted = await self.forks.boot(
                who, spec.model_copy(update={"exec_defaults": defaults}), delegation=granted
            )
            return await self._with_mounts(who, booted)
        command: list[str] = []
        if spec.run_entrypoint:
            config = self.templates.image_config(spec.template)
            command = config.command if config is not None else []
            if not command:
                raise errors.InvalidArgument(
                    f"template {spec.template!r} has no image Entrypoint or Cmd to run"
                )
        defaults = self.templates.defaults(spec.template, spec.exec_defaults)
        row = await self.lifecycle.create(
            who, spec.model_copy(update={"exec_defaults": defaults}), delegation=granted
        )
        row = await self._with_mounts(who, row)
        if command:
            await self.processes.start(
                who,
                row.id,
                ENTRYPOINT,
                ProcessSpec(request=ExecRequest(command=command), ttl=None),
            )
        return row

    def _grant(self, who: Principal, spec: SandboxCreate) -> delegation.Json | None:
        tls = self.settings.tls_cert is not None
        if spec.access_delegation is not None and tls and not self.settings.proxy_api_port:
            raise errors.InvalidArgument(
                "access_delegation: not supported by a daemon serving TLS without a "
                "proxy_api_port (the egress proxy reaches the API in clear on loopback)"
            )
        if spec.access_delegation is not None:
            own = self.keys.by_id(who.key_id) if who.key_id else None
            if own is None or own.tenant != who.tenant:  # an admin acting for it
                raise errors.InvalidArgument(
                    "access_delegation needs the tenant's own API key, not one acting for it"
                )
        return delegation.grant(spec.access_delegation, who)

    async def _with_mounts(self, who: Principal, row: SandboxRecord) -> SandboxRecord:
        """Clones a new sandbox's git mounts and mounts its buckets and volumes; one that
        fails fails the create as any other failure does: the VM and its files are gone, the
        row says why."""
        if not row.mounts and not row.bucket_mounts and not row.volume_mounts:
            return row
        try:
            await self.mounts.clone_all(who, row.id)
            await self.buckets.mount_all(who, row.id)
        except BaseException as exc:
            async with self.registry.lock(row.id):
                await self.lifecycle.teardown(row.id)
                self.registry.fail(row.id, exc, event="create_failed")
            raise
        return self.registry.get(who, row.id)

    def health(self) -> dict[str, Any]:
        return {
            "ok": True,
            "version": __version__,
            "accel": self.driver.accel.accel,
            "accel_reason": self.driver.accel.reason,
            "kernel": self.kernels.status(),
            "pool": self.pool.status(),
            "pool_size": self.pool.size,
            "pool_target": self.pool.targets(),
            "spares": self.pool.spares(),
            # how many in all: the endpoint takes no key, so no tenant's snapshot ids
            "fork_spares": sum(self.forks.spares.held().values()),
            "proxy": {"running": self.egress.proxy.pid is not None, "port": self.egress.proxy.port},
        }
