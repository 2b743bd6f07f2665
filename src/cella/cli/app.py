"""Top-level typer app: set-up, images and the runtime demo."""

from __future__ import annotations

import asyncio
import time
from typing import Annotated, Any

import typer
from rich.table import Table

from cella import errors
from cella.cli._output import console, emit_json, out, progress_printer
from cella.paths import Paths

app = typer.Typer(help="cella: microVM sandboxes for AI coding agents.", no_args_is_help=True)

JsonOpt = Annotated[bool, typer.Option("--json", help="Print machine-readable JSON.")]
AccelOpt = Annotated[str, typer.Option(help="Accelerator: auto, kvm or tcg.")]


@app.command()
def setup(
    json_: JsonOpt = False,
    template: Annotated[list[str] | None, typer.Option(help="Templates to build.")] = None,
    accel: AccelOpt = "auto",
) -> None:
    """Install host packages, fetch the guest kernel, build the agent, initramfs and templates.

    Idempotent: what is already in place is kept.
    """
    from cella.images.boot import ensure_boot
    from cella.images.host import ensure_host_packages
    from cella.images.kernel import ensure_kernel
    from cella.images.templates import build_template, builtin_templates
    from cella.runtime.qemu.accel import choose_accel

    show = progress_printer(json_)
    paths = Paths.default()
    paths.ensure()
    started = time.perf_counter()
    installed = ensure_host_packages(show)
    kernel = ensure_kernel(paths, show)
    boot = ensure_boot(paths, show)
    specs = builtin_templates()
    images = {}
    for name in template or ["default"]:
        if name not in specs:
            raise typer.BadParameter(f"unknown template {name!r}; known: {', '.join(specs)}")
        images[name] = str(build_template(paths, specs[name], show))
    show("probing the accelerator")
    choice = asyncio.run(choose_accel(boot, _accel_mode(accel), paths.images))
    result = {
        "data_dir": str(paths.root),
        "installed_packages": installed,
        "kernel": kernel.version,
        "initramfs": str(boot.initrd),
        "templates": images,
        "accel": choice.accel,
        "accel_reason": choice.reason,
        "seconds": round(time.perf_counter() - started, 1),
    }
    if json_:
        emit_json(result)
    else:
        console.print(
            f"[green]ready[/green] in {result['seconds']} s: kernel {kernel.version}, "
            f"accel [bold]{choice.accel}[/bold] ({choice.reason})"
        )


def _accel_mode(value: str) -> Any:
    if value not in ("auto", "kvm", "tcg"):
        raise typer.BadParameter("accel must be auto, kvm or tcg")
    return value


@app.command()
def demo(
    json_: JsonOpt = False,
    template: str = "default",
    accel: AccelOpt = "auto",
) -> None:
    """Boot a sandbox from a template, run a few commands in it and show what happened."""
    from cella.runtime.qemu.driver import QemuDriver

    commands = [
        "uname -r",
        "cat /proc/1/cmdline | tr '\\0' ' '",
        "python3 -c 'import sys; print(sys.version.split()[0])'",
        "echo 'print(6 * 7)' > /workspace/app.py && python3 /workspace/app.py",
        "ls /nonexistent",
    ]

    async def run() -> dict[str, Any]:
        driver = QemuDriver(Paths.default(), _accel_mode(accel))
        choice = await driver.prepare()
        vm = await driver.boot(template)
        steps = []
        try:
            for cmd in commands:
                result = await vm.agent.exec(cmd)
                steps.append(
                    {
                        "command": cmd,
                        "exit_code": result.exit_code,
                        "stdout": result.stdout.decode(errors="replace").strip(),
                        "stderr": result.stderr.decode(errors="replace").strip(),
                        "ms": round(result.duration * 1000, 1),
                    }
                )
            await vm.agent.write_file("/workspace/hello.txt", b"hello from the host\n")
            back = await vm.agent.read_file("/workspace/hello.txt")
        finally:
            await vm.stop()
            await driver.destroy(vm)
        return {
            "template": template,
            "accel": choice.accel,
            "accel_reason": choice.reason,
            "boot_seconds": round(vm.boot_seconds or 0, 2),
            "steps": steps,
            "file_roundtrip": back.decode(),
        }

    report = asyncio.run(run())
    if json_:
        emit_json(report)
        return
    console.print(
        f"booted [bold]{template}[/bold] in {report['boot_seconds']} s "
        f"under [bold]{report['accel']}[/bold] ({report['accel_reason']})"
    )
    table = Table("command", "exit", "ms", "output")
    for s in report["steps"]:
        table.add_row(
            s["command"],
            str(s["exit_code"]),
            str(s["ms"]),
            s["stdout"] or f"[red]{s['stderr']}[/red]",
        )
    out.print(table)
    console.print(f"file written and read back: {report['file_roundtrip'].strip()!r}")


from cella.cli import keys, sandbox  # noqa: E402
from cella.cli.serve import serve  # noqa: E402

app.command()(serve)
app.add_typer(sandbox.app, name="sandbox")
app.add_typer(keys.app, name="keys")


def main() -> None:
    try:
        app()
    except errors.CellaError as exc:
        console.print(f"[red]error[/red] {exc}", highlight=False, markup=False)
        raise SystemExit(1) from None
