"""`cella sandbox ...`: lifecycle, exec and copy, through the sync SDK."""

from __future__ import annotations

import io
import sys
import tarfile
from collections.abc import Sequence
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.markup import escape

from cella import errors
from cella.cli._output import Listing, console, emit_json, out
from cella.models import (
    BucketMount,
    GitMount,
    RewriteRule,
    UpstreamProxy,
    VolumeMount,
    parse_pairs,
)
from cella.models import Sandbox as SandboxInfo
from cella.sdk import Client, Sandbox

app = typer.Typer(
    help="Create, inspect, drive and remove sandboxes.",
    no_args_is_help=True,
    rich_markup_mode="markdown",
)
JsonOpt = Annotated[bool, typer.Option("--json", help="Print machine-readable JSON.")]


def _pairs(items: list[str] | None, what: str) -> dict[str, str]:
    try:
        return parse_pairs(items, what)
    except errors.InvalidArgument as exc:
        raise typer.BadParameter(exc.message) from None


def listing(infos: Sequence[SandboxInfo]) -> Listing:
    """The `sandbox ls` table: whole ids; on a narrow terminal labels and times wrap."""
    table = Listing(
        "id",
        "state",
        "template",
        "vcpus",
        "memory",
        "accel",
        "labels",
        "created",
        give_way={"labels": 6, "created": 10},
    )
    for i in infos:
        table.add_row(
            escape(i.id),
            i.state.value,
            escape(i.template),
            str(i.vcpus),
            f"{i.memory_mib} MiB",
            escape(i.accel or ""),
            escape(", ".join(f"{k}={v}" for k, v in i.labels.items())),
            i.created_at.strftime("%Y-%m-%d %H:%M:%S"),
        )
    return table


def _show(sandboxes: list[Sandbox], json_: bool) -> None:
    if json_:
        emit_json([s.info.model_dump(mode="json") for s in sandboxes])
        return
    out.print(listing([s.info for s in sandboxes]))


@app.command()
def create(
    template: str = "default",
    vcpus: Annotated[int | None, typer.Option(help="virtual CPUs")] = None,
    memory: Annotated[int | None, typer.Option(help="RAM in MiB")] = None,
    disk: Annotated[int | None, typer.Option(help="disk in MiB")] = None,
    ttl: Annotated[int | None, typer.Option(help="wall-clock limit, seconds")] = None,
    ttl_clock: Annotated[
        str | None,
        typer.Option(help="wall (default) or running: --ttl leaves out time paused or stopped"),
    ] = None,
    auto_resume: Annotated[
        bool, typer.Option(help="traffic to its ports (service URLs, host names) wakes it")
    ] = False,
    idle_timeout: Annotated[int | None, typer.Option(help="idle limit, seconds")] = None,
    label: Annotated[list[str] | None, typer.Option(help="KEY=VALUE, repeatable")] = None,
    allow: Annotated[list[str] | None, typer.Option(help="egress rule, repeatable")] = None,
    upstream_proxy: Annotated[
        str | None,
        typer.Option(help="socks5://host:port or http://host:port: your proxy its traffic uses"),
    ] = None,
    port_host: Annotated[
        str | None, typer.Option(help="the Host its port servers see (${PORT} is the port)")
    ] = None,
    deny: Annotated[list[str] | None, typer.Option(help="egress rule, repeatable")] = None,
    secret: Annotated[
        list[str] | None, typer.Option(help="ENV=SECRET_NAME: a placeholder in ENV, repeatable")
    ] = None,
    rewrite: Annotated[
        list[str] | None,
        typer.Option(
            help="HOST=SANDBOX:PORT[:strip|redact|keep]: requests to HOST go to PORT of another "
            "of your sandboxes (id or name), credentials stripped by default; repeatable"
        ),
    ] = None,
    run_entrypoint: Annotated[
        bool, typer.Option(help="start the template image's Entrypoint/Cmd (see `logs`)")
    ] = False,
    mount: Annotated[
        list[str] | None,
        typer.Option(
            help='a git mount as JSON, repeatable: {"id", "path", "url", "ref": {"type": '
            '"branch"|"tag", "name"}, "refresh_interval_seconds"}'
        ),
    ] = None,
    bucket_mount: Annotated[
        list[str] | None,
        typer.Option(
            help='an S3 or GCS bucket mounted in the guest, as JSON, repeatable: {"id", '
            '"type": "s3"|"gcs", "path", "bucket", "prefix", "read_only", "cache", '
            '"endpoint_url", "region", "path_style", "kms_key", "auth": {"access_key_id", '
            '"secret_access_key"} or {"service_account"} (secret names)}'
        ),
    ] = None,
    volume: Annotated[
        list[str] | None,
        typer.Option(
            help="a volume mounted in the guest, repeatable: NAME:/path, or NAME:/path:ro "
            "(read-only)"
        ),
    ] = None,
    visibility: Annotated[
        str | None,
        typer.Option(
            help="private (its creator, the tenant's owners, whom it is shared with) or "
            "tenant (every key of the tenant may exec in it); default: by the key's role"
        ),
    ] = None,
    replicate: Annotated[
        bool,
        typer.Option(
            help="on a fleet: keep a replica of its disk on a second node, from which it "
            "comes back `recovered` if its node is lost"
        ),
    ] = False,
    replicate_memory: Annotated[
        bool,
        typer.Option(
            help="on a fleet: the replica keeps its memory while it runs too (a live "
            "snapshot each period), so that it comes back paused, its processes going on"
        ),
    ] = False,
    json_: JsonOpt = False,
) -> None:
    """Create a sandbox and wait until it is running. It reaches no network unless
    `--allow` rules (pypi.org, *.github.com, 10.0.0.0/8, host:port) let it (a bucket
    mount's hosts are allowed with it)."""
    mounts = [_git_mount(m) for m in mount or []]  # checked before anything is asked
    rewrites = [_rewrite(r) for r in rewrite or []]
    buckets = [_bucket_mount(m) for m in bucket_mount or []]
    volumes = [_volume_mount(v) for v in volume or []]
    with Client() as client:
        sb = client.create(
            template,
            vcpus=vcpus,
            memory_mib=memory,
            disk_mib=disk,
            ttl_seconds=ttl,
            ttl_clock=ttl_clock,
            auto_resume=auto_resume or None,
            idle_timeout_seconds=idle_timeout,
            labels=_pairs(label, "label") or None,
            allow=allow,
            upstream_proxy=_upstream(upstream_proxy) if upstream_proxy else None,
            port_host=port_host,
            deny=deny,
            secrets=_pairs(secret, "secret") or None,
            rewrites=rewrites or None,
            run_entrypoint=run_entrypoint,
            mounts=mounts or None,
            bucket_mounts=buckets or None,
            volume_mounts=volumes or None,
            visibility=visibility,
            replicate=replicate or None,
            replicate_memory=replicate_memory or None,
        )
    if json_:
        emit_json(sb.info.model_dump(mode="json"))
    else:
        console.print(f"[green]created[/green] {sb.id}")
        out.print(sb.id)


@app.command()
def logs(sandbox_id: str, process: str = "entrypoint", json_: JsonOpt = False) -> None:
    """Show the output of a process that outlives its connection (default: the image's
    entrypoint started by `create --run-entrypoint`)."""
    with Client() as client:
        info = client.get(sandbox_id).process(process)
    if json_:
        emit_json(info.model_dump(mode="json"))
        return
    sys.stdout.write(info.stdout)
    sys.stderr.write(info.stderr)
    state = "running" if info.running else f"exited {info.exit_code}"
    console.print(f"[dim]{process}: {state}[/dim]")


@app.command("ls")
def list_(
    state: Annotated[str | None, typer.Option(help="only this state")] = None,
    label: Annotated[list[str] | None, typer.Option(help="KEY=VALUE, repeatable")] = None,
    json_: JsonOpt = False,
) -> None:
    """List sandboxes."""
    with Client() as client:
        _show(client.list(state, _pairs(label, "label")), json_)


@app.command()
def get(sandbox_id: str, json_: JsonOpt = False) -> None:
    """Show one sandbox."""
    with Client() as client:
        sb = client.get(sandbox_id)
    if json_:
        emit_json(sb.info.model_dump(mode="json"))
    else:
        _show([sb], json_)


@app.command(context_settings={"allow_extra_args": True})
def exec(
    sandbox_id: str,
    command: Annotated[list[str], typer.Argument(help="the command (after --)")],
    cwd: Annotated[str | None, typer.Option(help="working directory")] = None,
    env: Annotated[list[str] | None, typer.Option(help="KEY=VALUE, repeatable")] = None,
    user: Annotated[str | None, typer.Option(help="run as this user")] = None,
    timeout: Annotated[float | None, typer.Option(help="seconds; kills the process tree")] = None,
    json_: JsonOpt = False,
) -> None:
    """Run a command; output streams as produced and the exit code is the command's."""
    argv: list[str] | str = command[0] if len(command) == 1 and " " in command[0] else command
    with Client() as client:
        sb = client.get(sandbox_id)
        if json_:
            r = sb.exec(argv, cwd=cwd, env=_pairs(env, "env"), user=user, timeout=timeout)
            emit_json(
                {
                    "exit_code": r.exit_code,
                    "signal": r.signal,
                    "timed_out": r.timed_out,
                    "duration_ms": r.duration_ms,
                    "stdout": r.stdout.decode(errors="replace"),
                    "stderr": r.stderr.decode(errors="replace"),
                }
            )
            raise typer.Exit(r.exit_code)
        code = 1
        for event in sb.exec_stream(
            argv, cwd=cwd, env=_pairs(env, "env"), user=user, timeout=timeout
        ):
            if event.type == "stdout":
                sys.stdout.buffer.write(event.bytes)
                sys.stdout.flush()
            elif event.type == "stderr":
                sys.stderr.buffer.write(event.bytes)
                sys.stderr.flush()
            elif event.type == "exit":
                code = event.exit_code if event.exit_code is not None else 1
                if event.timed_out:
                    console.print("[red]timed out[/red]")
    raise typer.Exit(code)


def _remote(spec: str) -> tuple[str, str] | None:
    sandbox_id, sep, path = spec.partition(":")
    if sep and sandbox_id.startswith("sb-") and path.startswith("/"):
        return sandbox_id, path
    return None


@app.command()
def cp(src: str, dst: str) -> None:
    """Copy files or directories: `cp LOCAL SB:/path` or `cp SB:/path LOCAL`."""
    up, down = _remote(dst), _remote(src)
    if (up is None) == (down is None):
        raise typer.BadParameter("exactly one side must be SANDBOX_ID:/absolute/path")
    with Client() as client:
        if up is not None:
            sb = client.get(up[0])
            local = Path(src)
            if local.is_dir():
                buf = io.BytesIO()
                with tarfile.open(fileobj=buf, mode="w") as tar:
                    tar.add(local, arcname=".")
                sb.files.upload_archive(up[1], buf.getvalue())
            else:
                with local.open("rb") as f:
                    sb.files.write(
                        up[1], iter(lambda: f.read(1 << 20), b""), mode=local.stat().st_mode & 0o777
                    )
        else:
            assert down is not None
            sb = client.get(down[0])
            if sb.files.stat(down[1]).kind == "dir":
                archive = sb.files.download_archive(down[1])
                try:
                    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
                        tar.extractall(dst, filter="data")
                except tarfile.TarError as exc:  # what the guest sent is its to decide
                    typer.echo(f"cella: refused the archive of {src}: {exc}", err=True)
                    raise typer.Exit(1) from None
            else:
                with open(dst, "wb") as f:
                    for chunk in sb.files.read_stream(down[1]):
                        f.write(chunk)


def _lifecycle(action: str, sandbox_id: str, json_: bool) -> None:
    with Client() as client:
        sb = client.get(sandbox_id)
        result: Any = getattr(sb, action)()
        if json_:
            emit_json(
                result.info.model_dump(mode="json")
                if result
                else {"id": sandbox_id, "deleted": True}
            )
        else:
            console.print(f"{sandbox_id}: {result.state if result else 'deleted'}")


def _upstream(url: str) -> UpstreamProxy:
    try:
        return UpstreamProxy(url=url)
    except ValueError as exc:
        raise typer.BadParameter(f"--upstream-proxy {url!r}: {exc}") from None


def _rewrite(text: str) -> RewriteRule:
    """`HOST=SANDBOX:PORT[:CREDENTIALS]` as a rewrite rule."""
    host, _, target = text.partition("=")
    sandbox, _, rest = target.partition(":")
    port, _, credentials = rest.partition(":")
    fields = {"host": host, "to": {"sandbox": sandbox, "port": port or None}}
    try:
        return RewriteRule.model_validate(
            fields | ({"credentials": credentials} if credentials else {})
        )
    except ValueError as exc:
        raise typer.BadParameter(
            f"--rewrite {text!r}: expected HOST=SANDBOX:PORT[:strip|redact|keep]; {exc}"
        ) from None


def _volume_mount(text: str) -> VolumeMount:
    name, _, rest = text.partition(":")
    path, _, flag = rest.partition(":")
    if flag not in ("", "ro", "rw"):
        raise typer.BadParameter(f"--volume {text!r}: expected NAME:/path[:ro]")
    try:
        return VolumeMount(volume=name, path=path, read_only=flag == "ro")
    except ValueError as exc:
        raise typer.BadParameter(f"--volume {text!r}: {exc}") from None


def _bucket_mount(text: str) -> BucketMount:
    try:
        return BucketMount.model_validate_json(text)
    except ValueError as exc:
        raise typer.BadParameter(f"--bucket-mount: {exc}") from None


def _git_mount(text: str) -> GitMount:
    try:
        return GitMount.model_validate_json(text)
    except ValueError as exc:
        raise typer.BadParameter(f"--mount: {exc}") from None


@app.command()
def metrics(
    sandbox_id: str,
    since: Annotated[
        float | None, typer.Option(help="only samples of the last SECONDS", metavar="SECONDS")
    ] = None,
    json_: JsonOpt = False,
) -> None:
    """CPU, memory and disk of a sandbox over time (sampled while it runs)."""
    import time

    start = time.time() - since if since is not None else None
    with Client() as client:
        rows = client.get(sandbox_id).metrics(start=start)
    if json_:
        emit_json([m.model_dump(mode="json") for m in rows])
        return
    table = Listing("time", "cpu %", "mem MiB", "cache MiB", "disk MiB")
    for m in rows:
        table.add_row(
            time.strftime("%H:%M:%S", time.localtime(m.at)),
            f"{m.cpu_used_pct:.1f} of {m.cpu_count}",
            f"{m.mem_used >> 20}/{m.mem_total >> 20}",
            str(m.mem_cache >> 20),
            f"{m.disk_used >> 20}/{m.disk_total >> 20}",
        )
    out.print(table)


@app.command()
def screenshot(
    sandbox_id: str,
    output: Annotated[
        str | None,
        typer.Option("--output", "-o", help="where the PNG goes (`-`: stdout; default ID.png)"),
    ] = None,
) -> None:
    """Save a PNG of a desktop sandbox's screen (the `desktop` template)."""
    with Client() as client:
        png = client.get(sandbox_id).screenshot()
    if output == "-":
        sys.stdout.buffer.write(png)
        sys.stdout.buffer.flush()
        return
    where = Path(output or f"{sandbox_id}.png")
    where.write_bytes(png)
    console.print(f"{where} ({len(png)} bytes)")


@app.command("refresh-mounts")
def refresh_mounts(
    sandbox_id: str,
    mount: Annotated[str | None, typer.Option(help="only this mount (its id)")] = None,
    json_: JsonOpt = False,
) -> None:
    """Fetch a sandbox's git mounts now and reset each to its ref."""
    with Client() as client:
        done = client.get(sandbox_id).refresh_mounts(mount)
    if json_:
        emit_json([d.model_dump(mode="json") for d in done])
    else:
        for d in done:
            out.print(f"{d.id} {d.commit}")


@app.command()
def stop(sandbox_id: str, json_: JsonOpt = False) -> None:
    """Stop: processes end, the file system is kept."""
    _lifecycle("stop", sandbox_id, json_)


@app.command()
def resume(sandbox_id: str, json_: JsonOpt = False) -> None:
    """Boot a stopped sandbox again on the same disk."""
    _lifecycle("resume", sandbox_id, json_)


@app.command()
def pause(sandbox_id: str, json_: JsonOpt = False) -> None:
    """Freeze a sandbox; `resume` lets its processes run on."""
    _lifecycle("pause", sandbox_id, json_)


@app.command()
def snapshot(sandbox_id: str, name: str = "snapshot", json_: JsonOpt = False) -> None:
    """Save a running sandbox's disk and memory; it keeps running."""
    with Client() as client:
        snap = client.get(sandbox_id).snapshot(name)
    if json_:
        emit_json(snap.info.model_dump(mode="json"))
    else:
        console.print(
            f"snapshot {snap.id} ({snap.info.name}), source paused {snap.info.paused_ms} ms"
        )
        out.print(snap.id)


@app.command()
def fork(
    sandbox_id: str,
    count: Annotated[int, typer.Option("-n", "--count", help="how many branches")] = 1,
    json_: JsonOpt = False,
) -> None:
    """Fork a running sandbox into N isolated branches."""
    with Client() as client:
        branches = client.get(sandbox_id).fork(count)
    _show(branches, json_)


@app.command()
def network(
    sandbox_id: str,
    allow: Annotated[list[str] | None, typer.Option(help="egress rule, repeatable")] = None,
    deny: Annotated[list[str] | None, typer.Option(help="egress rule, repeatable")] = None,
    rewrite: Annotated[
        list[str] | None,
        typer.Option(
            help="HOST=SANDBOX:PORT[:strip|redact|keep]: requests to HOST go to PORT of another "
            "of your sandboxes (id or name), credentials stripped by default; repeatable"
        ),
    ] = None,
    show: Annotated[bool, typer.Option(help="print the rules, change nothing")] = False,
    json_: JsonOpt = False,
) -> None:
    """Replace a sandbox's egress rules (a running sandbox follows them at once)."""
    rewrites = [_rewrite(r) for r in rewrite or []]
    with Client() as client:
        sb = client.get(sandbox_id)
        if not show:
            sb.set_network(allow=allow, deny=deny, rewrites=rewrites)
    policy = sb.info.network
    if json_:
        emit_json(policy.model_dump(mode="json"))
    else:
        console.print(f"allow: {', '.join(policy.allow) or '(nothing)'}")
        console.print(f"deny:  {', '.join(policy.deny) or '(nothing)'}")
        for r in policy.rewrites:
            console.print(f"rewrite: {r.host} -> {r.to.sandbox}:{r.to.port} ({r.credentials})")


@app.command()
def share(
    sandbox_id: str,
    with_: Annotated[
        list[str] | None,
        typer.Option("--with", help="PRINCIPAL=view|exec|manage: share with it, repeatable"),
    ] = None,
    unshare: Annotated[
        list[str] | None, typer.Option(help="PRINCIPAL: take its share away, repeatable")
    ] = None,
    visibility: Annotated[str | None, typer.Option(help="private or tenant")] = None,
    json_: JsonOpt = False,
) -> None:
    """Show or change who may use a sandbox (a key that manages it changes it): its
    creator, visibility and shares, and what your key may do with it."""
    added = _pairs(with_, "share")
    with Client() as client:
        sb = client.get(sandbox_id)
        now = sb.access()
        if added or unshare or visibility:
            shares = {p: v for p, v in {**now.shares, **added}.items() if p not in (unshare or [])}
            now = sb.share(shares, visibility=visibility)
    if json_:
        emit_json(now.model_dump(mode="json"))
        return
    console.print(f"creator:    {now.creator or '(made before keys had principals)'}")
    console.print(f"visibility: {now.visibility}")
    for principal, level in sorted(now.shares.items()):
        console.print(f"shared:     {principal} ({level})", markup=False, highlight=False)
    console.print(f"your key:   {now.permission or 'nothing any more'}")


@app.command("exec-policy")
def exec_policy(
    sandbox_id: str,
    default: Annotated[str | None, typer.Option(help="allow or deny: what no rule matches")] = None,
    deny: Annotated[
        list[str] | None, typer.Option(help="a path glob to refuse (real paths), repeatable")
    ] = None,
    allow: Annotated[
        list[str] | None, typer.Option(help="a path glob to let run, repeatable")
    ] = None,
    deny_sha256: Annotated[
        list[str] | None, typer.Option(help="a file digest to refuse, repeatable")
    ] = None,
    allow_sha256: Annotated[
        list[str] | None, typer.Option(help="a file digest to let run, repeatable")
    ] = None,
    lift: Annotated[bool, typer.Option(help="remove every rule: anything runs")] = False,
    json_: JsonOpt = False,
) -> None:
    """Show or set which executables a sandbox's guest lets run (its kernel refuses the
    rest with EPERM; refusals are `exec_denied` events). Setting replaces the policy: the
    first matching rule decides, digests before globs, denials before allowances."""
    rules: list[dict[str, str]] = [
        *({"sha256": d, "action": "deny"} for d in deny_sha256 or []),
        *({"sha256": d, "action": "allow"} for d in allow_sha256 or []),
        *({"path_glob": g, "action": "deny"} for g in deny or []),
        *({"path_glob": g, "action": "allow"} for g in allow or []),
    ]
    with Client() as client:
        sb = client.get(sandbox_id)
        if lift:
            policy = sb.set_exec_policy({"default": "allow", "rules": []})
        elif rules or default:
            policy = sb.set_exec_policy({"default": default or "allow", "rules": rules})
        else:
            policy = sb.exec_policy()
    if json_:
        emit_json(policy.model_dump(mode="json", exclude_none=True))
        return
    console.print(f"default: {policy.default}", markup=False, highlight=False)
    for rule in policy.rules:
        what = f"sha256 {rule.sha256}" if rule.sha256 else rule.path_glob
        console.print(f"{rule.action:5}  {what}", markup=False, highlight=False)


@app.command()
def egress(
    sandbox_id: str,
    after: Annotated[int, typer.Option(help="only decisions after this id")] = 0,
    json_: JsonOpt = False,
) -> None:
    """The egress decision log: each connection, allowed or denied and why, bytes."""
    with Client() as client:
        log = client.get(sandbox_id).egress(after)
    if json_:
        emit_json([d.model_dump(mode="json") for d in log])
        return
    table = Listing(
        "id",
        "time",
        "host",
        "port",
        "decision",
        "why",
        "request",
        "out",
        "in",
        give_way={"why": 10, "request": 8, "host": 12},
    )
    for d in log:
        request = " ".join(str(x) for x in (d.protocol, d.method, d.status) if x)
        table.add_row(
            str(d.id),
            d.at.strftime("%H:%M:%S"),
            escape(d.host),
            str(d.port),
            "[green]allow[/green]" if d.allowed else "[red]deny[/red]",
            escape(d.reason),
            escape(request + (f" +{','.join(d.credentials)}" if d.credentials else "")),
            "" if d.bytes_out is None else str(d.bytes_out),
            "" if d.bytes_in is None else str(d.bytes_in),
        )
    out.print(table)


@app.command()
def rm(sandbox_id: str, json_: JsonOpt = False) -> None:
    """Delete a sandbox and free its disk."""
    _lifecycle("delete", sandbox_id, json_)


__all__ = ["app", "errors"]


@app.command()
def expose(
    sandbox_id: str,
    port: int,
    expires_in: Annotated[int, typer.Option(help="seconds the URL stays valid")] = 600,
    login: Annotated[
        bool, typer.Option(help="no token: a key or session of the tenant opens it")
    ] = False,
    json_: JsonOpt = False,
) -> None:
    """Give a server listening on PORT inside the sandbox a URL (with a token that expires).
    Open `browser_url` in a browser; programs send the token as X-Cella-Service-Token.
    With --login, the URL is opened with an API key or console session of the tenant, and
    the server gets a signed X-Langsmith-User-Token naming the caller."""
    if login:
        with Client() as client:
            found = client.get(sandbox_id).login_url(port)
        if json_:
            emit_json(found.model_dump(mode="json"))
        else:
            out.print(f"url       {found.url}", markup=False)
            out.print(f"jwks_url  {found.jwks_url}", markup=False)
        return
    with Client() as client:
        exposed = client.get(sandbox_id).expose(port, expires_in_seconds=expires_in)
    if json_:
        emit_json(exposed.model_dump(mode="json"))
        return
    out.print(f"url          {exposed.url}", markup=False)
    out.print(f"browser_url  {exposed.browser_url}", markup=False)
    out.print(f"token        {exposed.token}", markup=False)
    out.print(f"expires_at   {exposed.expires_at.isoformat()}", markup=False)


@app.command("port-forward")
def port_forward(
    sandbox_id: str,
    ports: Annotated[str, typer.Argument(help="LOCAL:REMOTE, or PORT for the same on both")],
    address: Annotated[str, typer.Option(help="local address to listen on")] = "127.0.0.1",
) -> None:
    """Forward a local port to a port inside the sandbox until interrupted (Ctrl-C). Each
    local connection is carried to the guest port through the daemon."""
    import asyncio
    import contextlib

    from cella.cli.forward import forward

    local, _, remote = ports.partition(":")
    try:
        local_port, remote_port = int(local), int(remote or local)
    except ValueError:
        raise typer.BadParameter("ports are LOCAL:REMOTE or PORT") from None
    with Client() as client:
        client.get(sandbox_id)  # an unknown sandbox fails here, not per connection
        url, key = client.url, client.api_key
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(forward(url, key, sandbox_id, address, local_port, remote_port))
