"""Top-level typer app: set-up, images and the runtime demo."""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from typing import Annotated, Any, TypeVar

import typer
from rich.table import Table

from cella import errors
from cella.cli._output import console, emit_json, out, progress_printer
from cella.paths import Paths

app = typer.Typer(
    help="cella: microVM sandboxes for AI coding agents.",
    no_args_is_help=True,
    rich_markup_mode="markdown",
)

T = TypeVar("T")
JsonOpt = Annotated[bool, typer.Option("--json", help="Print machine-readable JSON.")]


def _version(asked: bool) -> None:
    if asked:
        from cella import __version__

        typer.echo(f"cella {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: Annotated[
        bool,
        typer.Option("--version", callback=_version, is_eager=True, help="Print the version."),
    ] = False,
) -> None:
    """cella: microVM sandboxes for AI coding agents."""


AccelOpt = Annotated[str, typer.Option(help="Accelerator: auto, kvm or tcg.")]


@app.command()
def setup(
    json_: JsonOpt = False,
    template: Annotated[list[str] | None, typer.Option(help="Templates to build.")] = None,
    accel: AccelOpt = "auto",
    service: Annotated[
        bool,
        typer.Option(
            "--service",
            help="Also install and enable the daemon as a systemd service (cella.service).",
        ),
    ] = False,
    listen: Annotated[str, typer.Option(help="With --service: HOST:PORT it listens on.")] = (
        "127.0.0.1:8420"
    ),
    packages_only: Annotated[
        bool,
        typer.Option(
            "--packages-only", help="Only install the host packages (minutes before the rest)."
        ),
    ] = False,
    kernel_mode: Annotated[
        str,
        typer.Option(
            "--kernel",
            help="auto: start on Debian's stock kernel and compile cella's own in the "
            "background (sandboxes move to it when it is ready); tuned: compile it now and "
            "wait; stock: never compile.",
        ),
    ] = "auto",
    kernel_only: Annotated[
        bool,
        typer.Option("--kernel-only", help="Only get the kernel (what a background build runs)."),
    ] = False,
) -> None:
    """Install host packages and the egress proxy, fetch the guest kernel, build the agent,
    initramfs and templates.

    Idempotent: what is already in place is kept.
    """
    from cella.images.boot import ensure_boot
    from cella.images.host import FIRST_PACKAGES, ensure_host_packages, missing_packages
    from cella.images.templates import build_template, builtin_templates
    from cella.network.install import ensure_proxy
    from cella.runtime.qemu.accel import choose_accel

    show = progress_printer(json_)
    paths = Paths.default()
    paths.ensure()
    started = time.perf_counter()
    steps: dict[str, float] = {}  # each step's wall time, shown as it ends

    def step(name: str, work: Callable[[], T]) -> T:
        t0 = time.perf_counter()
        done = work()
        steps[name] = round(time.perf_counter() - t0, 1)
        show(f"{name}: {steps[name]} s")
        return done

    if kernel_mode not in ("auto", "tuned", "stock"):
        raise typer.BadParameter("--kernel must be auto, tuned or stock")
    if packages_only:
        installed = step("host packages", lambda: ensure_host_packages(show))
        if json_:
            emit_json({"installed_packages": installed, "steps": steps})
        return
    specs = builtin_templates()
    names = template or ["default"]
    for name in names:
        if name not in specs:
            raise typer.BadParameter(f"unknown template {name!r}; known: {', '.join(specs)}")
    if any(specs[n].kernel_modules for n in names) and kernel_mode == "auto":
        kernel_mode = "tuned"  # such a template carries the tuned kernel's module index
    if kernel_only:
        step("host packages", lambda: ensure_host_packages(show))
        kernel, building = step("guest kernel", lambda: choose_kernel(paths, kernel_mode, show))
        if json_:
            emit_json({"kernel": kernel.version, "kernel_kind": kernel.kind, "steps": steps})
        return
    # the templates (the longest step) build as soon as their tools are in, while other
    # threads install the other host packages, get the kernel, the agent and initramfs, and
    # the egress proxy's virtualenv (pip): a first start waits for the longest of them, not
    # their sum
    installed = step("first packages", lambda: ensure_host_packages(show, FIRST_PACKAGES))
    if os.geteuid() != 0 and (missing := missing_packages()):  # fail now, not after the template
        raise errors.PermissionDenied(f"installing {' '.join(missing)} needs root")
    with ThreadPoolExecutor(2, thread_name_prefix="setup") as pool:
        proxy = pool.submit(step, "egress proxy", lambda: ensure_proxy(paths, show))

        def kernel_and_boot() -> tuple[Any, int | None, Any]:
            installed.extend(step("host packages", lambda: ensure_host_packages(show)))
            kernel, building = step("guest kernel", lambda: choose_kernel(paths, kernel_mode, show))
            return kernel, building, step("agent and initramfs", lambda: ensure_boot(paths, show))

        booting = pool.submit(kernel_and_boot)
        if any(specs[n].kernel_modules for n in names):
            booting.result()  # the template installs the kernel's modules: it goes first
        images = {}
        for name in names:
            images[name] = str(
                step(f"template {name}", partial(build_template, paths, specs[name], show))
            )
        kernel, building, boot = booting.result()
        proxy.result()
    show("probing the accelerator")
    choice = step(
        "accelerator probe",
        lambda: asyncio.run(choose_accel(boot, _accel_mode(accel), paths.images)),
    )
    result: dict[str, Any] = {
        "data_dir": str(paths.root),
        "installed_packages": installed,
        "kernel": kernel.version,
        "kernel_kind": kernel.kind,
        "tuned_kernel_build": building,  # the background build's pid, if one runs
        "initramfs": str(boot.initrd),
        "templates": images,
        "accel": choice.accel,
        "accel_reason": choice.reason,
        "steps": steps,
        "seconds": round(time.perf_counter() - started, 1),
    }
    if service:
        from cella.cli.service_unit import install

        show("installing the systemd service")
        result["service"] = str(install(paths.root, listen))
    if json_:
        emit_json(result)
    else:
        console.print(
            f"[green]ready[/green] in {result['seconds']} s: kernel {kernel.version} "
            f"({kernel.kind}), accel [bold]{choice.accel}[/bold] ({choice.reason})"
        )
        if building is not None:
            from cella.images import kernel_builds

            console.print(
                f"cella's own kernel is compiling in the background (pid {building}, log "
                f"{kernel_builds.log_file(paths)}); sandboxes move to it when it is ready"
            )


def choose_kernel(paths: Paths, mode: str, show: Callable[[str], None]) -> tuple[Any, int | None]:
    """The kernel to serve on and the pid of a background build of the tuned one, if any."""
    from cella.images import kernel_builds
    from cella.images.kernel import Kernel, ensure_kernel, tuned_is_current
    from cella.images.stock_kernel import ensure_stock_kernel

    if mode == "tuned" or (mode == "auto" and tuned_is_current(paths)):
        return ensure_kernel(paths, show), None
    ensure_stock_kernel(paths, show)
    stock = Kernel.stock(paths)
    assert stock is not None
    if mode == "stock":
        return stock, None
    show("compiling cella's own kernel in the background")
    return stock, kernel_builds.start(paths)


def _accel_mode(value: str) -> Any:
    if value not in ("auto", "kvm", "tcg"):
        raise typer.BadParameter("accel must be auto, kvm or tcg")
    return value


@app.command()
def health(json_: JsonOpt = False) -> None:
    """The daemon's health: version, accelerator, which kernel serves and whether a better
    one is coming, the warm pool."""
    from cella.sdk import Client

    with Client() as client:
        report = client.health()
    if json_:
        emit_json(report)
        return
    kernel = report.get("kernel") or {}
    upgrade = {
        "building": "cella's own kernel is compiling; sandboxes move to it when it is ready",
        "ready": "cella's own kernel is ready; new sandboxes move to it within seconds",
        "failed": "the background kernel build failed: run `cella setup --kernel tuned`",
    }.get(kernel.get("upgrade") or "", "")
    out.print(f"cella {report.get('version')}: [green]ok[/green]" if report.get("ok") else "down")
    out.print(
        f"kernel {kernel.get('version')} ({kernel.get('kind')}){'; ' + upgrade if upgrade else ''}"
    )
    out.print(f"accel {report.get('accel')} ({report.get('accel_reason')})")
    out.print(f"warm pool {report.get('pool')}, spares {report.get('spares')}")


@app.command()
def demo(json_: JsonOpt = False, template: str = "default") -> None:
    """Start the daemon (unless one is running), then play the core agent workflow: a buggy
    project, failing tests, a snapshot, three forks trying fixes in parallel, the winner."""
    from cella.cli.demo import run_demo

    report = run_demo(template, progress_printer(json_))
    if json_:
        emit_json(report)
        return
    table = Table("step", "ms", "result", title="steps")
    for step in report["steps"]:
        table.add_row(step["step"], str(step["ms"]), step["result"])
    out.print(table)
    branches = Table("branch", "fix tried", "tests", "ms", title="branches")
    for b in report["branches"]:
        verdict = "[green]pass[/green]" if b["tests_exit"] == 0 else f"fail ({b['tests_exit']})"
        branches.add_row(b["branch"], b["fix"], verdict, str(b["ms"]))
    out.print(branches)
    out.print(f"[bold]trace of {report['winner']}[/bold]")
    for line in report["trace"]:
        out.print(f"  {line}", markup=False)
    console.print(
        f"under [bold]{report['accel']}[/bold] ({report['accel_reason']}); "
        f"the branches share the snapshot's disk blocks and memory pages"
    )
    out.print(
        f"passing branch: [bold green]{report['winner']}[/bold green] "
        f"({report['winner_fix']}); kept running, remove it with `cella sandbox rm "
        f"{report['winner']}`"
    )
    console.print(
        f"its trace and lineage in the web console (with `cella serve` running): "
        f"{report['console']}"
    )


from cella.cli import (  # noqa: E402
    checkpoints,  # noqa: F401  (commands of `cella sandbox`)
    files,
    fleet,
    keys,
    registry,
    sandbox,
    secret,
    snapshot,
    template,
    volume,
    webhook,
)
from cella.cli import eval as eval_cli  # noqa: E402
from cella.cli.backup import backup, restore  # noqa: E402
from cella.cli.serve import serve  # noqa: E402
from cella.cli.trace import trace  # noqa: E402

app.command()(serve)
app.command()(trace)
app.command()(backup)
app.command()(restore)


@app.command()
def mcp(
    transport: Annotated[str, typer.Option(help="stdio or http (streamable HTTP)")] = "stdio",
    host: Annotated[str, typer.Option(help="listen address for http")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="listen port for http")] = 8421,
) -> None:
    """Serve sandboxes as MCP tools (create, exec, files, snapshot, fork, delete)."""
    try:
        from cella.integrations.mcp import build_server
    except ImportError:
        raise typer.BadParameter(
            "the MCP server needs the extra: pip install 'cella[mcp]'"
        ) from None
    server = build_server()
    if transport == "stdio":
        server.run("stdio")
    elif transport == "http":
        server.run("streamable-http", host=host, port=port)
    else:
        raise typer.BadParameter("transport must be stdio or http")


app.add_typer(sandbox.app, name="sandbox")
app.add_typer(files.app, name="files")
app.add_typer(keys.app, name="keys")
app.add_typer(snapshot.app, name="snapshot")
app.add_typer(secret.app, name="secret")
app.add_typer(registry.app, name="registry")
app.add_typer(volume.app, name="volume")
app.add_typer(template.app, name="template")
app.add_typer(webhook.app, name="webhook")
app.add_typer(eval_cli.app, name="eval")
app.add_typer(fleet.app, name="fleet")


def main() -> None:
    import httpx2

    try:
        app()
    except errors.CellaError as exc:
        console.print(f"[red]error[/red] {exc}", highlight=False, markup=False)
        raise SystemExit(1) from None
    except httpx2.ConnectError as exc:
        console.print(
            f"[red]error[/red] no cella daemon answers ({exc}); start one with `cella serve`",
            highlight=False,
        )
        raise SystemExit(1) from None
