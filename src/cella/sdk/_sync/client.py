# Generated from ../_async by `python -m cella.sdk._generate`: do not edit.
"""The async SDK. `_sync/client.py` is generated from this file: edit here only."""

from __future__ import annotations

import builtins
import contextlib
import json
import os
import uuid
from collections.abc import Callable, Iterable, Iterator
from types import TracebackType
from typing import Any

import httpx2

from cella import errors
from cella.models import (
    AwsSigning,
    BucketMount,
    BuildEvent,
    CallbackRule,
    Capacity,
    DownloadUrl,
    EgressDecision,
    Event,
    ExecDefaults,
    ExecEvent,
    ExecPolicy,
    ExecResult,
    ExposedPort,
    FileEntry,
    FileWalk,
    GcpToken,
    GitMount,
    HeaderRule,
    IdentityToken,
    KeyRotation,
    KeyUseInfo,
    LineageNode,
    LoginUrl,
    MetricSample,
    MountRefresh,
    ProcessInfo,
    ProcessList,
    ProcessSummary,
    Registry,
    RewriteRule,
    SandboxAccess,
    SandboxAccessView,
    SandboxUsage,
    Secret,
    SigningKeys,
    StartCommand,
    Template,
    TemplateList,
    UpstreamProxy,
    VolumeEntry,
    VolumeList,
    VolumeMount,
    Webhook,
    WebhookCreated,
    WebhookDelivery,
)
from cella.models import Sandbox as SandboxInfo
from cella.models import Snapshot as SnapshotInfo
from cella.models import Volume as VolumeInfo
from cella.models.checkpoints import NOW, Checkpoint, CheckpointDiff
from cella.models.evals import EvalResult, EvalRun, EvalRunCreate, EvalRunList
from cella.models.fleet import DrainReport, FleetStatus, MoveReport, Replica
from cella.models.proctree import ExecTree, exec_trees
from cella.sdk._base import (
    DEFAULT_TIMEOUT,
    IDLE_REUSE_SECONDS,
    client_timeout,
    command_wait,
    create_body,
    exec_body,
    idempotency,
    network_body,
    raise_for,
    resolve,
    split_urls,
    tar_directory,
)
from cella.sdk._sync.failover import Failover


class Client:
    """A connection to a cella daemon. Without arguments: `CELLA_URL` and `CELLA_API_KEY`,
    else (on the daemon's own host) the address file and admin key in `CELLA_DATA_DIR`."""

    def __init__(
        self,
        url: str | builtins.list[str] | None = None,
        api_key: str | None = None,
        timeout: float = DEFAULT_TIMEOUT,
        headers: dict[str, str] | None = None,
        transport: httpx2.BaseTransport | None = None,
    ) -> None:
        """`timeout`: seconds a request may take, except one that runs a command, which
        waits as long as the command may run (`exec(timeout=...)`). `headers` go with every
        request (e.g. `X-Cella-Node`, a fleet placement hint). `transport`, if given,
        carries the requests instead of the network (an httpx2 transport, e.g. one that
        calls the daemon's app in this process). `url` may name several gateways of one
        fleet (a list, or comma-separated as in `CELLA_URL`): a request goes on to the next
        when one does not answer, if it never reached it or is safe to repeat; creates,
        forks and snapshots then send an Idempotency-Key of their own when given none, so
        a create retried on another gateway makes one sandbox."""
        given, self.api_key = resolve(url, api_key)
        self.urls = split_urls(given)
        self.url = self.urls[0]
        self.timeout = timeout
        if len(self.urls) > 1:  # gateways of one fleet: the next when one does not answer
            transport = Failover(self.urls, transport)
        self._failover = len(self.urls) > 1
        self._http = httpx2.Client(
            base_url=self.url,
            headers={**(headers or {}), "Authorization": f"Bearer {self.api_key}"},
            timeout=client_timeout(timeout),
            transport=transport,
            limits=httpx2.Limits(keepalive_expiry=IDLE_REUSE_SECONDS),
        )

    def keyed(self, key: str | None) -> dict[str, str]:
        """The Idempotency-Key header: the caller's, else with several gateways one made
        here (a retry on another gateway must not make it twice)."""
        return idempotency(key or (str(uuid.uuid4()) if self._failover else None))

    def __enter__(self) -> Client:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def close(self) -> None:
        self._http.close()

    def request(self, method: str, path: str, **kwargs: Any) -> httpx2.Response:
        response = self._http.request(method, path, **kwargs)
        raise_for(response.status_code, response.content)
        return response

    @contextlib.contextmanager
    def stream(self, method: str, path: str, **kwargs: Any) -> Iterator[httpx2.Response]:
        """A streamed response (an error response raises its typed error first)."""
        with self._http.stream(method, path, **kwargs) as response:
            if response.status_code >= 400:
                raise_for(response.status_code, response.read())
            yield response

    # -- sandboxes -----------------------------------------------------------------------

    def create(
        self,
        template: str = "default",
        *,
        vcpus: int | None = None,
        memory_mib: int | None = None,
        disk_mib: int | None = None,
        ttl_seconds: int | None = None,
        idle_timeout_seconds: int | None = None,
        ttl_action: str | None = None,
        ttl_clock: str | None = None,
        auto_resume: bool | None = None,
        idle_action: str | None = None,
        max_pids: int | None = None,
        labels: dict[str, str] | None = None,
        allow: builtins.list[str] | None = None,
        deny: builtins.list[str] | None = None,
        secrets: dict[str, str] | None = None,
        headers: builtins.list[HeaderRule] | None = None,
        aws: builtins.list[AwsSigning] | None = None,
        gcp: builtins.list[GcpToken] | None = None,
        egress_env: dict[str, str] | None = None,
        rewrites: builtins.list[RewriteRule] | None = None,
        identity_tokens: dict[str, IdentityToken] | None = None,
        upstream_proxy: UpstreamProxy | None = None,
        port_host: str | None = None,
        name: str | None = None,
        snapshot: str | None = None,
        exec_defaults: ExecDefaults | None = None,
        delete_after_stop_seconds: int | None = None,
        run_entrypoint: bool = False,
        stop_keeps_memory: bool | None = None,
        restore_memory: str | None = None,
        access_delegation: dict[str, Any] | None = None,
        mounts: builtins.list[GitMount] | None = None,
        bucket_mounts: builtins.list[BucketMount] | None = None,
        volume_mounts: builtins.list[VolumeMount] | None = None,
        visibility: str | None = None,
        checkpoint_each_exec: bool | None = None,
        idempotency_key: str | None = None,
        exec_policy: ExecPolicy | dict[str, Any] | None = None,
        replicate: bool | None = None,
        replicate_memory: bool | None = None,
    ) -> Sandbox:
        """A new running sandbox. `ttl_action` / `idle_action`: stop, pause or delete.

        Egress is denied unless `allow` rules (`pypi.org`, `*.github.com`, `10.0.0.0/8`,
        `host:port`, `*`) permit it; `deny` rules win. `secrets` maps environment variables to
        stored secrets: the sandbox sees placeholders the egress proxy replaces; `headers`
        are set by the proxy on requests to their hosts (`{secret:NAME}` in a value is the
        secret's value, which never enters the sandbox); `aws` rules have the proxy sign
        requests to AWS with keys from stored secrets (commands see dummy keys), `gcp` rules
        have it add OAuth tokens it mints from a stored service account's key;
        `egress_env` is set for every command while these rules hold; `rewrites` answer a
        host name with a port of another of the tenant's sandboxes. `snapshot` (an id,
        `name:tag` or a name) starts it from a snapshot instead of the template;
        `exec_defaults` are the user, cwd and env every command runs with unless it says
        otherwise (a template built from an image adds its Env, WorkingDir and User under
        them); `run_entrypoint` starts the image's Entrypoint and Cmd as process `entrypoint`.
        `stop_keeps_memory` makes every stop of it (asked for or on idling) a pause that keeps
        processes and memory; `restore_memory` (with `snapshot`): `if_present`, `always` or
        `never`. `access_delegation` (`{"mode": "inherit"}`, or `"explicit"` with
        `permissions`) lets code in the sandbox call this API at `http://cella.api` as this
        client's key. `mounts` are git repositories cloned in before it is returned (through
        its egress rules: a private one needs a header rule for its host) and refreshed every
        `refresh_interval_seconds` while it runs. `bucket_mounts` are S3 and GCS buckets
        mounted in the guest (rclone) before it is returned, their requests authenticated by
        the egress proxy with the stored secrets their `auth` names (their hosts are allowed);
        each one's state is in `info.mount_states`. `volume_mounts` mount the tenant's volumes
        (`create_volume`) at their paths, shared with every other sandbox mounting them
        (read-only ones refuse writes). `visibility`: `private` (its creator, the
        tenant's owners and whom it is shared with: `share`) or `tenant` (every key of the
        tenant may exec in it too); by default `tenant` for an owner's key, `private` for a
        member's. `ttl_clock="running"` leaves the time it is paused or stopped out of
        `ttl_seconds`; `auto_resume` lets traffic to its ports wake it. `identity_tokens`
        are workload identity JWTs that header rules put into requests (`{identity:NAME}`),
        minted by the egress proxy; `upstream_proxy` sends its allowed traffic through a
        proxy of yours; `port_host` is the Host header its port servers see.
        `checkpoint_each_exec` takes a checkpoint after every command (`checkpoints()`).
        `idempotency_key` (e.g. a UUID you keep): a retry of this create with the same key
        and arguments, also one sent while the first still runs, gets the same sandbox
        (keys are kept a day).
        `exec_policy` (`{"default": "allow"|"deny", "rules": [{"path_glob"|"sha256": ...,
        "action": "allow"|"deny"}]}`) says which executables its guest's kernel lets run.
        `replicate` (a fleet's gateway only) keeps a copy of its disk on a second node, from
        which it comes back `recovered` if its node is lost (`replica()` says how fresh); a
        paused sandbox's copy keeps its memory too, and `replicate_memory` has a running
        one's keep it (a live snapshot each period: the guest pauses for the copy), so that
        it comes back paused and its processes go on when it is resumed.
        """
        rules = (allow, deny, headers, aws, gcp, egress_env)
        wanted = any(rules) or rewrites or identity_tokens or upstream_proxy or port_host
        network = (
            network_body(
                *rules,
                rewrites=rewrites,
                identity_tokens=identity_tokens,
                upstream_proxy=upstream_proxy,
                port_host=port_host,
            )
            if wanted
            else None
        )
        body = create_body(
            name=name,
            snapshot=snapshot,
            exec_defaults=exec_defaults.model_dump() if exec_defaults else None,
            delete_after_stop_seconds=delete_after_stop_seconds,
            run_entrypoint=run_entrypoint or None,
            stop_keeps_memory=stop_keeps_memory,
            checkpoint_each_exec=checkpoint_each_exec,
            replicate=replicate,
            replicate_memory=replicate_memory,
            restore_memory=restore_memory,
            access_delegation=access_delegation,
            visibility=visibility,
            exec_policy=ExecPolicy.model_validate(exec_policy).model_dump(exclude_none=True)
            if exec_policy is not None
            else None,
            template=template,
            vcpus=vcpus,
            memory_mib=memory_mib,
            disk_mib=disk_mib,
            ttl_seconds=ttl_seconds,
            idle_timeout_seconds=idle_timeout_seconds,
            ttl_action=ttl_action,
            ttl_clock=ttl_clock,
            auto_resume=auto_resume,
            idle_action=idle_action,
            max_pids=max_pids,
            labels=labels,
            network=network,
            secrets=secrets,
            mounts=[m.model_dump(exclude_none=True) for m in mounts] if mounts else None,
            bucket_mounts=[m.model_dump(exclude_none=True) for m in bucket_mounts]
            if bucket_mounts
            else None,
            volume_mounts=[m.model_dump() for m in volume_mounts] if volume_mounts else None,
        )
        response = self.request(
            "POST", "/v1/sandboxes", json=body, headers=self.keyed(idempotency_key)
        )
        return Sandbox(self, SandboxInfo.model_validate(response.json()))

    def get(self, sandbox_id: str) -> Sandbox:
        response = self.request("GET", f"/v1/sandboxes/{sandbox_id}")
        return Sandbox(self, SandboxInfo.model_validate(response.json()))

    def list(
        self, state: str | None = None, labels: dict[str, str] | None = None
    ) -> builtins.list[Sandbox]:
        params: builtins.list[tuple[str, str]] = [
            ("label", f"{k}={v}") for k, v in (labels or {}).items()
        ]
        if state is not None:
            params.append(("state", state))
        response = self.request("GET", "/v1/sandboxes", params=params)
        return [Sandbox(self, SandboxInfo.model_validate(s)) for s in response.json()["sandboxes"]]

    # -- traces --------------------------------------------------------------------------

    def events(
        self,
        sandbox_id: str,
        after: int = 0,
        types: builtins.list[str] | None = None,
        exec_id: int | None = None,
    ) -> builtins.list[Event]:
        """A sandbox's trace, in order (also of a deleted sandbox: the trace outlives it).
        `exec_id`: only that exec's event and its processes' (`process`, `process_summary`)."""
        out: builtins.list[Event] = []
        while True:
            params: builtins.list[tuple[str, str | int]] = [("after", after), ("limit", 10000)]
            params += [("type", t) for t in types or []]
            if exec_id is not None:
                params.append(("exec", exec_id))
            response = self.request("GET", f"/v1/sandboxes/{sandbox_id}/events", params=params)
            batch = [Event.model_validate(e) for e in response.json()["events"]]
            out += batch
            if len(batch) < 10000:
                return out
            after = batch[-1].id

    def follow(
        self,
        sandbox_id: str,
        after: int = 0,
        types: builtins.list[str] | None = None,
        exec_id: int | None = None,
    ) -> Iterator[Event]:
        """Events as they happen, until the sandbox is deleted."""
        params: builtins.list[tuple[str, str | int | float | bool | None]] = [
            ("after", after),
            ("follow", "true"),
        ]
        params += [("type", t) for t in types or []]
        if exec_id is not None:
            params.append(("exec", exec_id))
        with self.stream(
            "GET",
            f"/v1/sandboxes/{sandbox_id}/events/stream",
            params=params,
            timeout=httpx2.Timeout(None, connect=10.0),
        ) as response:
            for line in response.iter_lines():
                if line.strip():
                    yield Event.model_validate(json.loads(line))

    def lineage(self, sandbox_id: str) -> LineageNode:
        """The family tree this sandbox belongs to (snapshots and forks)."""
        response = self.request("GET", f"/v1/sandboxes/{sandbox_id}/lineage")
        return LineageNode.model_validate(response.json())

    # -- snapshots -----------------------------------------------------------------------

    def snapshots(self) -> builtins.list[Snapshot]:
        response = self.request("GET", "/v1/snapshots")
        return [
            Snapshot(self, SnapshotInfo.model_validate(s)) for s in response.json()["snapshots"]
        ]

    def get_snapshot(self, snapshot_id: str) -> Snapshot:
        response = self.request("GET", f"/v1/snapshots/{snapshot_id}")
        return Snapshot(self, SnapshotInfo.model_validate(response.json()))

    def _sandboxes(self, response: httpx2.Response) -> builtins.list[Sandbox]:
        return [Sandbox(self, SandboxInfo.model_validate(s)) for s in response.json()["sandboxes"]]

    # -- secrets -------------------------------------------------------------------------

    def put_secret(
        self,
        name: str,
        value: str,
        hosts: builtins.list[str],
        *,
        auth: str | None = None,
        username: str | None = None,
        inject: str | None = None,
    ) -> Secret:
        """Stores a secret bound to `hosts` (write-only: it is never returned). `auth`
        ("bearer" or "basic") also adds it as an Authorization header toward those hosts.
        `inject="header"`: only that header carries it; the placeholder is never swapped
        into URLs or bodies (for hosts that store what they are sent)."""
        body = create_body(value=value, hosts=hosts, auth=auth, username=username, inject=inject)
        response = self.request("PUT", f"/v1/secrets/{name}", json=body)
        return Secret.model_validate(response.json())

    def secrets(self) -> builtins.list[Secret]:
        response = self.request("GET", "/v1/secrets")
        return [Secret.model_validate(s) for s in response.json()["secrets"]]

    def delete_secret(self, name: str) -> None:
        self.request("DELETE", f"/v1/secrets/{name}")

    def rotate_secrets_key(self) -> int:
        """Seals every secret value under a new key (admin); returns how many."""
        response = self.request("POST", "/v1/secrets-key/rotate")
        return int(KeyRotation.model_validate(response.json()).resealed)

    # -- image registries ----------------------------------------------------------------

    def create_volume(self, name: str) -> Volume:
        """A new, empty volume of the tenant (names are unique in it)."""
        response = self.request("POST", "/v1/volumes", json={"name": name})
        return Volume(self, VolumeInfo.model_validate(response.json()))

    def volumes(self) -> VolumeList:
        """The tenant's volumes, with its quota and the bytes they hold."""
        response = self.request("GET", "/v1/volumes")
        return VolumeList.model_validate(response.json())

    def volume(self, key: str) -> Volume:
        """A volume by id or name."""
        response = self.request("GET", f"/v1/volumes/{key}")
        return Volume(self, VolumeInfo.model_validate(response.json()))

    def delete_volume(self, key: str, *, force: bool = False) -> None:
        """Deletes a volume and its files; one a sandbox mounts only with `force`."""
        self.request("DELETE", f"/v1/volumes/{key}", params={"force": force})

    def create_registry(
        self, name: str, url: str, *, username: str | None = None, password: str | None = None
    ) -> Registry:
        """Keeps a registry's credentials for pulling images (the password is write-only),
        to name in `snapshot_from_image(registry=...)`."""
        body = create_body(name=name, url=url, username=username, password=password)
        response = self.request("POST", "/v1/registries", json=body)
        return Registry.model_validate(response.json())

    def registries(self) -> builtins.list[Registry]:
        response = self.request("GET", "/v1/registries")
        return [Registry.model_validate(r) for r in response.json()["registries"]]

    def get_registry(self, key: str) -> Registry:
        """A registry by id or name."""
        response = self.request("GET", f"/v1/registries/{key}")
        return Registry.model_validate(response.json())

    def delete_registry(self, key: str) -> None:
        self.request("DELETE", f"/v1/registries/{key}")

    def create_webhook(
        self,
        url: str,
        *,
        name: str | None = None,
        events: builtins.list[str] | None = None,
        secret: str | None = None,
        enabled: bool | None = None,
    ) -> WebhookCreated:
        """Registers a URL told of the tenant's sandboxes' lifecycle events (all of them
        unless `events` says which), each delivery signed with `secret` (made when not
        given, and returned this once): see `cella.policy.webhooks.verify`."""
        body = create_body(url=url, name=name, events=events, secret=secret, enabled=enabled)
        response = self.request("POST", "/v1/webhooks", json=body)
        return WebhookCreated.model_validate(response.json())

    def webhooks(self) -> builtins.list[Webhook]:
        response = self.request("GET", "/v1/webhooks")
        return [Webhook.model_validate(w) for w in response.json()["webhooks"]]

    def get_webhook(self, webhook_id: str) -> Webhook:
        response = self.request("GET", f"/v1/webhooks/{webhook_id}")
        return Webhook.model_validate(response.json())

    def update_webhook(self, webhook_id: str, **fields: Any) -> Webhook:
        """Replaces the fields given: `url`, `name`, `events`, `enabled`, `secret`."""
        response = self.request("PATCH", f"/v1/webhooks/{webhook_id}", json=fields)
        return Webhook.model_validate(response.json())

    def delete_webhook(self, webhook_id: str) -> None:
        self.request("DELETE", f"/v1/webhooks/{webhook_id}")

    def webhook_deliveries(
        self, webhook_id: str, after: int = 0, limit: int = 100
    ) -> builtins.list[WebhookDelivery]:
        """The webhook's deliveries, oldest first, each with its attempts."""
        params = {"after": after, "limit": limit}
        response = self.request("GET", f"/v1/webhooks/{webhook_id}/deliveries", params=params)
        return [WebhookDelivery.model_validate(d) for d in response.json()["deliveries"]]

    def snapshot_from_image(
        self,
        name: str,
        image: str,
        *,
        tag: str | None = None,
        disk_mib: int | None = None,
        registry: str | None = None,
    ) -> Snapshot:
        """Starts building a snapshot from a registry image (pulled with `registry`'s
        credentials); it is `creating` until the build ends: poll `get_snapshot`."""
        body = create_body(name=name, image=image, tag=tag, disk_mib=disk_mib, registry=registry)
        response = self.request("POST", "/v1/snapshots", json=body)
        return Snapshot(self, SnapshotInfo.model_validate(response.json()))

    def signing_keys(self) -> SigningKeys:
        """The daemon's signing keys (admin): which one signs, which only verify."""
        response = self.request("GET", "/v1/signing-keys")
        return SigningKeys.model_validate(response.json())

    def rotate_signing_key(self) -> SigningKeys:
        """A new signing key signs from now on; the old ones keep verifying (admin)."""
        response = self.request("POST", "/v1/signing-keys/rotate")
        return SigningKeys.model_validate(response.json())

    def retire_signing_key(self, kid: str) -> None:
        """Retires a key that no longer signs: what it signed stops verifying (admin)."""
        self.request("DELETE", f"/v1/signing-keys/{kid}")

    def capacity(self) -> Capacity:
        """The host's RAM/vCPU limits, committed and free (admin keys)."""
        response = self.request("GET", "/v1/capacity")
        return Capacity.model_validate(response.json())

    def health(self) -> dict[str, Any]:
        """The daemon's health: version, accelerator, the kernel new sandboxes boot and
        whether a better one is coming (`kernel.upgrade`), the warm pool, the egress proxy."""
        response = self.request("GET", "/v1/health")
        return dict(response.json())

    def backup(
        self,
        dest: str,
        *,
        with_secrets_key: bool = False,
        on_progress: Callable[[str, int, int], None] | None = None,
    ) -> dict[str, Any]:
        """A consistent backup of the daemon's data directory into `dest`, a new or empty
        directory on the daemon's host (admin). `with_secrets_key`: the sealed secrets' key
        goes in too (else `cella restore` needs it given). `on_progress(step, done,
        total)` follows it. Returns the backup's report."""
        body = {"dest": dest, "with_secrets_key": with_secrets_key}
        timeout = httpx2.Timeout(None, connect=10.0)
        with self.stream("POST", "/v1/backups", json=body, timeout=timeout) as response:
            for line in response.iter_lines():
                if not line.strip():
                    continue
                item = json.loads(line)
                if "backup" in item:
                    report: dict[str, Any] = item["backup"]
                    return report
                if "error" in item:
                    raise_for(500, line.encode())  # raises the error its code names
                if on_progress is not None:
                    on_progress(item["step"], item["done"], item["total"])
        raise errors.CellaError("the backup's stream ended without its report")

    def fleet(self) -> FleetStatus:
        """A fleet gateway's nodes: health, capacity, sandboxes, cached snapshots (admin)."""
        response = self.request("GET", "/v1/fleet")
        return FleetStatus.model_validate(response.json())

    def drain(self, node: str) -> DrainReport:
        """Cordons a fleet node and moves every sandbox on it to other nodes (admin): a
        report of each move (from, to, the guest's pause, bytes shipped, or why it failed)."""
        response = self.request("POST", f"/v1/fleet/nodes/{node}/drain")
        return DrainReport.model_validate(response.json())

    def cordon(self, node: str) -> None:
        """Nothing new is placed on the fleet node; what runs there stays (admin)."""
        self.request("POST", f"/v1/fleet/nodes/{node}/cordon")

    def uncordon(self, node: str) -> None:
        """New sandboxes may be placed on the fleet node again (admin)."""
        self.request("POST", f"/v1/fleet/nodes/{node}/uncordon")

    # -- eval runs -----------------------------------------------------------------------

    def create_eval_run(self, snapshot_id: str, tasks: int, *, name: str | None = None) -> EvalRun:
        """Starts recording an eval run (what `run_eval` does; the web console shows it)."""
        body = EvalRunCreate(snapshot_id=snapshot_id, tasks=tasks, name=name)
        response = self.request("POST", "/v1/evals", json=body.model_dump(mode="json"))
        return EvalRun.model_validate(response.json())

    def record_eval_result(self, run_id: str, result: EvalResult) -> None:
        self.request(
            "PUT",
            f"/v1/evals/{run_id}/results/{result.task_id}",
            json=result.model_dump(mode="json"),
        )

    def finish_eval_run(self, run_id: str) -> EvalRun:
        response = self.request("POST", f"/v1/evals/{run_id}/finish")
        return EvalRun.model_validate(response.json())

    def eval_runs(self) -> builtins.list[EvalRun]:
        response = self.request("GET", "/v1/evals")
        return EvalRunList.model_validate(response.json()).runs

    def eval_run(self, run_id: str) -> EvalRun:
        """A run with every recorded result."""
        response = self.request("GET", f"/v1/evals/{run_id}")
        return EvalRun.model_validate(response.json())

    # -- templates -----------------------------------------------------------------------

    def templates(self) -> builtins.list[Template]:
        response = self.request("GET", "/v1/templates")
        return TemplateList.model_validate(response.json()).templates

    def get_template(self, name: str) -> Template:
        response = self.request("GET", f"/v1/templates/{name}")
        return Template.model_validate(response.json())

    def build_template(
        self,
        name: str,
        image: str,
        *,
        disk_mib: int | None = None,
        registry_secret: str | None = None,
        start_cmd: str | None = None,
        ready_cmd: str | None = None,
        on_progress: Callable[[str], None] | None = None,
    ) -> Template:
        """A template from an OCI/Docker image (`registry/repo:tag`, `...@sha256:...`, or a
        `docker save` / OCI archive or layout on the daemon's host); admin only. Progress
        lines go to `on_progress`; a rebuild of the same digest is a cache hit. With
        `start_cmd`, every sandbox of it has that command running (started before the
        template's warm snapshot, once `ready_cmd` exits 0)."""
        start = None
        if start_cmd or ready_cmd:
            start = StartCommand(command=start_cmd, ready=ready_cmd).model_dump()
        body = create_body(
            name=name,
            image=image,
            disk_mib=disk_mib,
            registry_secret=registry_secret,
            start=start,
        )
        return self._build("/v1/templates", on_progress, json=body)

    def build_template_from_dockerfile(
        self,
        name: str,
        context: str | os.PathLike[str],
        *,
        dockerfile: str = "Dockerfile",
        allow: builtins.list[str] | None = None,
        disk_mib: int | None = None,
        start_cmd: str | None = None,
        ready_cmd: str | None = None,
        on_progress: Callable[[str], None] | None = None,
    ) -> Template:
        """A template from a Dockerfile in the `context` directory, built by buildah inside
        a builder sandbox that may reach only `allow` (e.g. the registry of its FROM); its
        sandboxes have `start_cmd` running, as `build_template`'s."""
        params: builtins.list[tuple[str, str | int | float | bool | None]] = [
            ("dockerfile", dockerfile)
        ]
        params += [("allow", a) for a in allow or []]
        params += [(k, v) for k, v in (("start_cmd", start_cmd), ("ready_cmd", ready_cmd)) if v]
        if disk_mib is not None:
            params.append(("disk_mib", disk_mib))
        return self._build(
            f"/v1/templates/{name}/dockerfile",
            on_progress,
            params=params,
            content=tar_directory(context),
            headers={"content-type": "application/x-tar"},
        )

    def _build(
        self, path: str, on_progress: Callable[[str], None] | None, **kwargs: Any
    ) -> Template:
        timeout = httpx2.Timeout(None, connect=10.0)
        with self.stream("POST", path, timeout=timeout, **kwargs) as response:
            for line in response.iter_lines():
                if not line.strip():
                    continue
                event = BuildEvent.model_validate(json.loads(line))
                if event.type == "progress" and on_progress is not None:
                    on_progress(event.message or "")
                elif event.type == "error":
                    error = {"error": {"code": event.code, "message": event.message}}
                    raise_for(500, json.dumps(error).encode())
                elif event.type == "done" and event.template is not None:
                    return event.template
        raise_for(502, b'{"error": {"code": "internal", "message": "the build stream ended"}}')
        raise AssertionError("unreachable")

    def delete_template(self, name: str) -> None:
        self.request("DELETE", f"/v1/templates/{name}")

    # -- keys (admin) ----------------------------------------------------------------------

    def create_key(
        self,
        tenant: str,
        *,
        read_only: bool = False,
        principal: str | None = None,
        roles: builtins.list[str] | None = None,
        format: str | None = None,
    ) -> dict[str, Any]:
        """A new key for `tenant` (admin); `read_only` keys may only look (GET, HEAD).
        `principal`: the person or service holding it (default: the key's id); `roles`:
        `owner` (every sandbox of the tenant; the default), `member` (its own, the
        tenant's and those shared with it), `viewer` (reads only); `format` `e2b`: the key
        is `e2b_` and hex (what E2B's SDKs accept), else `ck_...`."""
        body = create_body(
            tenant=tenant, read_only=read_only, principal=principal, roles=roles, format=format
        )
        response = self.request("POST", "/v1/keys", json=body)
        created: dict[str, Any] = response.json()
        return created

    def key_uses(
        self, key_id: str | None = None, tenant: str | None = None, limit: int = 100
    ) -> builtins.list[KeyUseInfo]:
        """The audit log of key use, newest first (admin)."""
        params: dict[str, Any] = {"limit": limit}
        if key_id is not None:
            params["key_id"] = key_id
        if tenant is not None:
            params["tenant"] = tenant
        response = self.request("GET", "/v1/keys/uses", params=params)
        return [KeyUseInfo.model_validate(u) for u in response.json()]

    def list_keys(self) -> builtins.list[dict[str, Any]]:
        keys: builtins.list[dict[str, Any]] = (self.request("GET", "/v1/keys")).json()
        return keys

    def revoke_key(self, key_id: str) -> None:
        self.request("DELETE", f"/v1/keys/{key_id}")


class Sandbox:
    """One sandbox. As a context manager it is deleted on exit."""

    def __init__(self, client: Client, info: SandboxInfo, owns_client: bool = False) -> None:
        self.client = client
        self.info = info
        self.files = Files(self)
        self._owns_client = owns_client

    @classmethod
    def create(
        cls, template: str = "default", *, client: Client | None = None, **kwargs: Any
    ) -> Sandbox:
        """Creates a sandbox; without a client, one is made from the environment."""
        own = client is None
        client = client or Client()
        try:
            sandbox = client.create(template, **kwargs)
        except BaseException:
            if own:
                client.close()
            raise
        sandbox._owns_client = own
        return sandbox

    @classmethod
    def connect(cls, sandbox_id: str, *, client: Client | None = None) -> Sandbox:
        """Attaches to an existing sandbox; without a client, one is made from the environment.
        As with `create`, leaving the `with` block deletes the sandbox (and closes that client)."""
        own = client is None
        client = client or Client()
        try:
            sandbox = client.get(sandbox_id)
        except BaseException:
            if own:
                client.close()
            raise
        sandbox._owns_client = own
        return sandbox

    @property
    def id(self) -> str:
        return self.info.id

    @property
    def state(self) -> str:
        return self.info.state.value

    @property
    def _path(self) -> str:
        return f"/v1/sandboxes/{self.id}"

    def __enter__(self) -> Sandbox:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        try:
            self.delete()
        finally:
            if self._owns_client:
                self.client.close()

    def __repr__(self) -> str:
        return f"<Sandbox {self.id} {self.state}>"

    def refresh(self) -> Sandbox:
        response = self.client.request("GET", self._path)
        self.info = SandboxInfo.model_validate(response.json())
        return self

    def exec(
        self,
        command: list[str] | str,
        *,
        cwd: str | None = None,
        env: dict[str, str] | None = None,
        user: str | None = None,
        stdin: str | bytes | None = None,
        timeout: float | None = None,
        check: bool = False,
    ) -> ExecResult:
        """Runs a command to completion. A string runs under /bin/sh -c. The request waits
        as long as the command may run (`timeout`; without one, for as long as it runs)."""
        body = exec_body(command, cwd, env, user, stdin, timeout)
        wait = command_wait(self.client.timeout, timeout)
        response = self.client.request("POST", f"{self._path}/exec", json=body, timeout=wait)
        result = ExecResult.model_validate(response.json())
        return result.check(command) if check else result

    def exec_stream(
        self,
        command: list[str] | str,
        *,
        cwd: str | None = None,
        env: dict[str, str] | None = None,
        user: str | None = None,
        stdin: str | bytes | None = None,
        timeout: float | None = None,
    ) -> Iterator[ExecEvent]:
        """Yields started, stdout, stderr and exit events as the command produces them
        (waiting between them as long as the command may run, like `exec`)."""
        body = exec_body(command, cwd, env, user, stdin, timeout)
        wait = command_wait(self.client.timeout, timeout)
        path = f"{self._path}/exec/stream"
        with self.client.stream("POST", path, json=body, timeout=wait) as response:
            for line in response.iter_lines():
                if line.strip():
                    event = ExecEvent.model_validate(json.loads(line))
                    if event.type == "error":
                        raise_for(
                            500,
                            json.dumps(
                                {"error": {"code": event.code, "message": event.message}}
                            ).encode(),
                        )
                    yield event

    def pause(self) -> Sandbox:
        """Freezes the sandbox; its processes go on after `resume()`."""
        response = self.client.request("POST", f"{self._path}/pause")
        self.info = SandboxInfo.model_validate(response.json())
        return self

    def snapshot(
        self, name: str = "snapshot", *, memory: bool = True, idempotency_key: str | None = None
    ) -> Snapshot:
        """Disk and memory at this instant (`memory=False`: the disk alone, which sandboxes
        made from it boot from); the sandbox keeps running. A retry with the same
        `idempotency_key` gets the same snapshot."""
        body = {"name": name, "memory": memory}
        response = self.client.request(
            "POST", f"{self._path}/snapshots", json=body, headers=self.client.keyed(idempotency_key)
        )
        return Snapshot(self.client, SnapshotInfo.model_validate(response.json()))

    def checkpoint(self, name: str | None = None) -> Checkpoint:
        """Disk and memory at this instant, kept with the sandbox as `name` (default
        `cp-<n>`) for `diff` and `rewind`; the sandbox keeps running."""
        body = {"name": name} if name else {}
        response = self.client.request("POST", f"{self._path}/checkpoints", json=body)
        return Checkpoint.model_validate(response.json())

    def checkpoints(self) -> builtins.list[Checkpoint]:
        """The sandbox's checkpoints, oldest first."""
        response = self.client.request("GET", f"{self._path}/checkpoints")
        return [Checkpoint.model_validate(c) for c in response.json()["checkpoints"]]

    def diff(self, a: str | Checkpoint, b: str | Checkpoint = NOW) -> CheckpointDiff:
        """Paths added, removed and modified from checkpoint `a` to checkpoint `b` (by
        default `now`: the sandbox as it is), with unified diffs of text files;
        `.patch(path)` is a patch of those under `path` that `git apply` takes."""
        params = {"a": _ref(a), "b": _ref(b)}
        response = self.client.request(
            "GET", f"{self._path}/diff", params=params, timeout=max(self.client.timeout, 300)
        )
        return CheckpointDiff.model_validate(response.json())

    def rewind(self, checkpoint: str | Checkpoint) -> Sandbox:
        """Back to the checkpoint in place: same sandbox, its files and memory (a running
        process's state) as they were; every checkpoint is kept."""
        body = {"checkpoint": _ref(checkpoint)}
        response = self.client.request("POST", f"{self._path}/rewind", json=body)
        self.info = SandboxInfo.model_validate(response.json())
        return self

    def fork(self, count: int = 1, *, idempotency_key: str | None = None) -> builtins.list[Sandbox]:
        """`count` isolated copies of this sandbox as it is now (files, memory, processes);
        a retry with the same `idempotency_key` gets the same copies."""
        response = self.client.request(
            "POST",
            f"{self._path}/fork",
            json={"count": count},
            headers=self.client.keyed(idempotency_key),
        )
        return self.client._sandboxes(response)

    def stop(self, *, memory: bool | None = None) -> Sandbox:
        """Ends all processes; files and installed packages stay for `resume()`. With
        `memory=True` (or the sandbox's `stop_keeps_memory`) it pauses instead: processes
        and memory are kept."""
        body = None if memory is None else {"memory": memory}
        response = self.client.request("POST", f"{self._path}/stop", json=body)
        self.info = SandboxInfo.model_validate(response.json())
        return self

    def replica(self) -> Replica:
        """Where a fleet keeps the copy of this sandbox's disk (`replicate`), how old it is
        and whether it holds its memory."""
        response = self.client.request("GET", f"{self._path}/replica")
        return Replica.model_validate(response.json())

    def resume(self) -> Sandbox:
        response = self.client.request("POST", f"{self._path}/resume")
        self.info = SandboxInfo.model_validate(response.json())
        return self

    def move(self, node: str | None = None) -> MoveReport:
        """Moves the sandbox to another node of a fleet (`node`, else one the gateway
        picks): same id, files, memory and state; a running one's processes go on after a
        pause. A failed move raises, the sandbox left where it was."""
        body = {"node": node} if node is not None else None
        response = self.client.request("POST", f"{self._path}/move", json=body)
        self.refresh()
        return MoveReport.model_validate(response.json())

    def delete(self) -> None:
        self.client.request("DELETE", self._path)

    def expose(self, port: int, *, expires_in_seconds: int = 600) -> ExposedPort:
        """A URL for a server listening on `port` inside the sandbox, with a token that
        expires; `browser_url` logs a browser in (a cookie) on first visit."""
        response = self.client.request(
            "POST",
            f"{self._path}/ports/{port}/expose",
            json={"expires_in_seconds": expires_in_seconds},
        )
        return ExposedPort.model_validate(response.json())

    def login_url(self, port: int) -> LoginUrl:
        """A login-mode URL for a server on `port`: opened with a key or console session of
        this tenant (no token, no expiry); the server gets `X-Langsmith-User-Token`, a JWT
        the daemon signs (verify it against `jwks_url`)."""
        response = self.client.request("POST", f"{self._path}/ports/{port}/login-url")
        return LoginUrl.model_validate(response.json())

    def usage(self) -> SandboxUsage:
        """Limits and live usage (CPU time, memory, disk, processes)."""
        response = self.client.request("GET", f"{self._path}/usage")
        return SandboxUsage.model_validate(response.json())

    def screenshot(self) -> bytes:
        """A PNG of the screen of a desktop sandbox (the `desktop` template); InvalidState
        (409) for a sandbox without a desktop."""
        response = self.client.request("GET", f"{self._path}/screenshot")
        return response.content

    def metrics(
        self, start: float | None = None, end: float | None = None
    ) -> builtins.list[MetricSample]:
        """CPU, memory and disk over time (samples taken while it runs), oldest first;
        `start` and `end` in unix seconds."""
        params = create_body(start=start, end=end)
        response = self.client.request("GET", f"{self._path}/metrics", params=params)
        return [MetricSample.model_validate(m) for m in response.json()["metrics"]]

    def refresh_mounts(self, mount: str | None = None) -> builtins.list[MountRefresh]:
        """Fetches the git mounts (or the one with id `mount`) now and resets each to its
        ref; the commit each is at."""
        params = {"mount": mount} if mount else None
        response = self.client.request("POST", f"{self._path}/mounts/refresh", params=params)
        return [MountRefresh.model_validate(m) for m in response.json()["mounts"]]

    def set_network(
        self,
        allow: builtins.list[str] | None = None,
        deny: builtins.list[str] | None = None,
        headers: builtins.list[HeaderRule] | None = None,
        aws: builtins.list[AwsSigning] | None = None,
        gcp: builtins.list[GcpToken] | None = None,
        egress_env: dict[str, str] | None = None,
        callbacks: builtins.list[CallbackRule] | None = None,
        rewrites: builtins.list[RewriteRule] | None = None,
        identity_tokens: dict[str, IdentityToken] | None = None,
        upstream_proxy: UpstreamProxy | None = None,
        port_host: str | None = None,
    ) -> Sandbox:
        """Replaces the egress rules (those of `create`); a running sandbox's next connection
        follows them, and its next command the new `egress_env`. `callbacks` ask an outside
        URL about requests to their hosts (`CallbackRule`); `rewrites` send requests to a
        host name to a port of another of the tenant's sandboxes (`RewriteRule`)."""
        body = network_body(
            allow,
            deny,
            headers,
            aws,
            gcp,
            egress_env,
            callbacks,
            rewrites,
            identity_tokens=identity_tokens,
            upstream_proxy=upstream_proxy,
            port_host=port_host,
        )
        response = self.client.request("PUT", f"{self._path}/network", json=body)
        self.info = SandboxInfo.model_validate(response.json())
        return self

    def egress(self, after: int = 0) -> builtins.list[EgressDecision]:
        """The egress decision log: every connection tried, allowed or denied and why."""
        response = self.client.request("GET", f"{self._path}/egress", params={"after": after})
        return [EgressDecision.model_validate(d) for d in response.json()["decisions"]]

    def events(
        self,
        after: int = 0,
        types: builtins.list[str] | None = None,
        exec_id: int | None = None,
    ) -> builtins.list[Event]:
        """The trace: every event so far, in order (`exec_id`: one exec's and its
        processes')."""
        return self.client.events(self.id, after, types, exec_id)

    def follow(
        self,
        after: int = 0,
        types: builtins.list[str] | None = None,
        exec_id: int | None = None,
    ) -> Iterator[Event]:
        """Events as they happen, until the sandbox is deleted."""
        for event in self.client.follow(self.id, after, types, exec_id):
            yield event

    def process_trees(self, exec_id: int | None = None) -> builtins.list[ExecTree]:
        """Each traced command (or the one `exec_id`) with the tree of processes it
        started and the connections they opened."""
        types = ["exec", "process", "process_summary", "egress"]
        return exec_trees(self.events(types=types, exec_id=exec_id))

    def processes(self) -> builtins.list[ProcessSummary]:
        """Commands that outlive their connection, e.g. the image's `entrypoint` (their
        output: `process(id)`)."""
        response = self.client.request("GET", f"{self._path}/processes")
        return ProcessList.model_validate(response.json()).processes

    def process(self, process_id: str) -> ProcessInfo:
        response = self.client.request("GET", f"{self._path}/processes/{process_id}")
        return ProcessInfo.model_validate(response.json())

    def lineage(self) -> LineageNode:
        """The family tree this sandbox belongs to (snapshots and forks)."""
        return self.client.lineage(self.id)

    def exec_policy(self) -> ExecPolicy:
        """Which executables its guest lets run (none set: every one)."""
        response = self.client.request("GET", f"{self._path}/exec-policy")
        return ExecPolicy.model_validate(response.json())

    def set_exec_policy(self, policy: ExecPolicy | dict[str, Any]) -> ExecPolicy:
        """Replaces its exec policy (a key that manages it); a running guest holds it from
        the next execve on. `{"default": "allow", "rules": []}` lifts it."""
        body = ExecPolicy.model_validate(policy).model_dump(exclude_none=True)
        response = self.client.request("PUT", f"{self._path}/exec-policy", json=body)
        return ExecPolicy.model_validate(response.json())

    def access(self) -> SandboxAccessView:
        """Who made it, who may use it, and what this client's key may do with it."""
        response = self.client.request("GET", f"{self._path}/access")
        return SandboxAccessView.model_validate(response.json())

    def share(
        self,
        shares: dict[str, str] | None = None,
        *,
        visibility: str | None = None,
    ) -> SandboxAccessView:
        """Sets who may use it (a key that manages it): `shares` maps principals to `view`,
        `exec` or `manage` and replaces those it had; `visibility` is `private` or
        `tenant` (left out: as it is)."""
        now = self.access()
        body = SandboxAccess.model_validate(  # checked here as the daemon checks it
            {
                "visibility": visibility or now.visibility,
                "shares": now.shares if shares is None else shares,
            }
        )
        response = self.client.request("PUT", f"{self._path}/access", json=body.model_dump())
        return SandboxAccessView.model_validate(response.json())


class Snapshot:
    """A saved sandbox (disk and memory) that new sandboxes can be forked from."""

    def __init__(self, client: Client, info: SnapshotInfo) -> None:
        self.client = client
        self.info = info

    @property
    def id(self) -> str:
        return self.info.id

    def __repr__(self) -> str:
        return f"<Snapshot {self.id} {self.info.name!r}>"

    def fork(self, count: int = 1) -> builtins.list[Sandbox]:
        """`count` new sandboxes restored from this snapshot."""
        response = self.client.request(
            "POST", f"/v1/snapshots/{self.id}/fork", json={"count": count}
        )
        return self.client._sandboxes(response)

    def refresh(self) -> Snapshot:
        response = self.client.request("GET", f"/v1/snapshots/{self.id}")
        self.info = SnapshotInfo.model_validate(response.json())
        return self

    def delete(self) -> None:
        """Refused with `InUse` while a sandbox or snapshot is built on it."""
        self.client.request("DELETE", f"/v1/snapshots/{self.id}")


class Files:
    """Files in a sandbox (`sandbox.files`)."""

    def __init__(self, sandbox: Sandbox) -> None:
        self._sandbox = sandbox

    @property
    def _path(self) -> str:
        return f"/v1/sandboxes/{self._sandbox.id}/files"

    def _request(self, method: str, path: str, **kwargs: Any) -> httpx2.Response:
        return self._sandbox.client.request(method, self._path + path, **kwargs)

    def write(
        self,
        path: str,
        data: bytes | str | Iterable[bytes],
        *,
        mode: int = 0o644,
        parents: bool = False,
    ) -> FileEntry:
        """Writes a file atomically; `data` may be an iterator of chunks (streamed)."""
        content = data.encode() if isinstance(data, str) else data
        params = {"path": path, "mode": mode, "parents": parents}
        response = self._request("PUT", "/content", params=params, content=content)
        return FileEntry.model_validate(response.json())

    def read(self, path: str) -> bytes:
        response = self._request("GET", "/content", params={"path": path})
        return response.content

    def read_text(self, path: str) -> str:
        return (self.read(path)).decode()

    def read_stream(self, path: str) -> Iterator[bytes]:
        with self._sandbox.client.stream(
            "GET", f"{self._path}/content", params={"path": path}
        ) as response:
            for chunk in response.iter_bytes():
                yield chunk

    def download_url(
        self,
        path: str,
        *,
        expires_in_seconds: int | None = 3600,
        content_type: str | None = None,
        content_disposition: str = "attachment",
    ) -> DownloadUrl:
        """A link that downloads the file `path` without a key, until it expires (None:
        never): pinned to this sandbox and this path."""
        body: dict[str, Any] = {
            "path": path,
            "expires_in_seconds": expires_in_seconds,
            "content_disposition": content_disposition,
        }
        if content_type is not None:
            body["content_type"] = content_type
        response = self._request("POST", "/download-url", json=body)
        return DownloadUrl.model_validate(response.json())

    def list(self, path: str) -> builtins.list[FileEntry]:
        response = self._request("GET", "/list", params={"path": path})
        return [FileEntry.model_validate(e) for e in response.json()]

    def stat(self, path: str) -> FileEntry:
        response = self._request("GET", "/stat", params={"path": path})
        return FileEntry.model_validate(response.json())

    def exists(self, path: str) -> bool:
        from cella import errors

        try:
            self.stat(path)
        except errors.NotFound:
            return False
        return True

    def walk(self, path: str, *, depth: int | None = None, limit: int | None = None) -> FileWalk:
        """The entries under the directory `path`, breadth first (each with its `path`):
        `depth` levels down and at most `limit` of them, as deep and as many as the
        daemon's bounds allow when not given; `truncated` says a bound ended the walk."""
        params: dict[str, Any] = {"path": path}
        if depth is not None:
            params["depth"] = depth
        if limit is not None:
            params["limit"] = limit
        response = self._request("GET", "/walk", params=params)
        return FileWalk.model_validate(response.json())

    def move(self, source: str, destination: str) -> FileEntry:
        """Renames a file or directory (a file at `destination` is replaced)."""
        body = {"source": source, "destination": destination}
        response = self._request("POST", "/move", json=body)
        return FileEntry.model_validate(response.json())

    def chown(
        self, path: str, user: str, group: str | None = None, *, recursive: bool = False
    ) -> None:
        """Gives `path` (`recursive`: and all below it) to `user` and `group` (without one,
        the user's login group)."""
        body = {"path": path, "user": user, "group": group, "recursive": recursive}
        self._request("POST", "/chown", json=body)

    def mkdir(self, path: str, *, parents: bool = False, mode: int = 0o755) -> None:
        self._request("POST", "/mkdir", json={"path": path, "parents": parents, "mode": mode})

    def chmod(self, path: str, mode: int) -> None:
        self._request("POST", "/chmod", json={"path": path, "mode": mode})

    def remove(self, path: str, *, recursive: bool = False) -> None:
        self._request("DELETE", "", params={"path": path, "recursive": recursive})

    def upload_archive(self, path: str, archive: bytes | Iterable[bytes]) -> None:
        """Unpacks a tar archive into the directory `path`."""
        self._request("PUT", "/archive", params={"path": path}, content=archive)

    def download_archive(self, path: str) -> bytes:
        """The directory `path` as an uncompressed tar archive."""
        response = self._request("GET", "/archive", params={"path": path})
        return response.content


class Volume:
    """A volume's files, read and written without a sandbox."""

    def __init__(self, client: Client, info: VolumeInfo) -> None:
        self.client = client
        self.info = info

    @property
    def id(self) -> str:
        return self.info.id

    @property
    def name(self) -> str:
        return self.info.name

    def __repr__(self) -> str:
        return f"<Volume {self.info.id} {self.info.name}>"

    def _request(self, method: str, op: str, **kwargs: Any) -> httpx2.Response:
        return self.client.request(method, f"/v1/volumes/{self.info.id}/{op}", **kwargs)

    def refresh(self) -> Volume:
        response = self.client.request("GET", f"/v1/volumes/{self.info.id}")
        self.info = VolumeInfo.model_validate(response.json())
        return self

    def write(
        self,
        path: str,
        data: bytes | str | Iterable[bytes],
        *,
        parents: bool = False,
        mode: int | None = None,
    ) -> VolumeEntry:
        """Writes a file whole (replaced at once for every reader), within the tenant's
        volume quota; `data` may be an iterator of chunks (streamed)."""
        content = data.encode() if isinstance(data, str) else data
        params: dict[str, Any] = {"path": path, "parents": parents}
        if mode is not None:
            params["mode"] = mode
        response = self._request("PUT", "content", params=params, content=content)
        return VolumeEntry.model_validate(response.json())

    def read(self, path: str) -> bytes:
        response = self._request("GET", "content", params={"path": path})
        return response.content

    def read_text(self, path: str) -> str:
        return (self.read(path)).decode()

    def list(self, path: str = "/", *, depth: int = 1) -> builtins.list[VolumeEntry]:
        response = self._request("GET", "list", params={"path": path, "depth": depth})
        return [VolumeEntry.model_validate(e) for e in response.json()["entries"]]

    def stat(self, path: str) -> VolumeEntry:
        response = self._request("GET", "stat", params={"path": path})
        return VolumeEntry.model_validate(response.json())

    def mkdir(self, path: str, *, parents: bool = False) -> VolumeEntry:
        params = {"path": path, "parents": parents}
        response = self._request("POST", "mkdir", params=params)
        return VolumeEntry.model_validate(response.json())

    def remove(self, path: str) -> None:
        """Removes a file, or a directory with what it holds."""
        self._request("DELETE", "content", params={"path": path})

    def delete(self, *, force: bool = False) -> None:
        self.client.delete_volume(self.info.id, force=force)


def _ref(checkpoint: str | Checkpoint) -> str:
    return checkpoint.name if isinstance(checkpoint, Checkpoint) else checkpoint
