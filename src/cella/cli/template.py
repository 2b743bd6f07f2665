"""`cella template ...`: build templates from images and Dockerfiles, list and remove them."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.markup import escape

from cella.cli._output import Listing, emit_json, out, progress_printer
from cella.models import Template
from cella.sdk import Client

app = typer.Typer(
    help="Templates: the root file systems sandboxes start from.",
    no_args_is_help=True,
    rich_markup_mode="markdown",
)
JsonOpt = Annotated[bool, typer.Option("--json", help="Print machine-readable JSON.")]


@app.command("build")
def build(
    name: Annotated[str, typer.Argument(help="Template name (a-z, 0-9, _ and -).")],
    from_image: Annotated[
        str | None,
        typer.Option(
            "--from-image",
            help="Registry reference (host/repo:tag, @sha256:...), or a docker save / OCI "
            "archive or OCI layout on the daemon's host.",
        ),
    ] = None,
    dockerfile: Annotated[
        Path | None,
        typer.Option("--dockerfile", help="Build context directory holding a Dockerfile."),
    ] = None,
    file: Annotated[
        str, typer.Option("--file", "-f", help="The Dockerfile's path in the context.")
    ] = "Dockerfile",
    allow: Annotated[
        list[str] | None,
        typer.Option("--allow", help="Host the Dockerfile build may reach (repeatable)."),
    ] = None,
    disk_mib: Annotated[int | None, typer.Option(help="File system size in MiB.")] = None,
    registry_secret: Annotated[
        str | None,
        typer.Option(help="Secret holding user:password for a private registry."),
    ] = None,
    start_cmd: Annotated[
        str | None,
        typer.Option(help="Shell command every sandbox of the template has running."),
    ] = None,
    ready_cmd: Annotated[
        str | None,
        typer.Option(help="Shell command polled until it exits 0 before the warm snapshot."),
    ] = None,
    json_: JsonOpt = False,
) -> None:
    """Build a template from an OCI/Docker image or a Dockerfile (progress on stderr).

    A Dockerfile is built inside a builder sandbox (buildah) that reaches only `--allow`
    hosts; an image is fetched and unpacked on the daemon's host. Either ends with the
    template's warm snapshot, so its first sandbox starts in well under a second. A start
    command is started before that snapshot (once the ready command succeeds), so every
    sandbox of the template has it running."""
    if (from_image is None) == (dockerfile is None):
        raise typer.BadParameter("give exactly one of --from-image and --dockerfile")
    show = progress_printer(json_)

    def progress(line: str) -> None:
        show(escape(line))

    with Client() as client:
        if from_image is not None:
            made = client.build_template(
                name,
                from_image,
                disk_mib=disk_mib,
                registry_secret=registry_secret,
                start_cmd=start_cmd,
                ready_cmd=ready_cmd,
                on_progress=progress,
            )
        else:
            assert dockerfile is not None
            made = client.build_template_from_dockerfile(
                name,
                dockerfile,
                dockerfile=file,
                allow=allow,
                disk_mib=disk_mib,
                start_cmd=start_cmd,
                ready_cmd=ready_cmd,
                on_progress=progress,
            )
    if json_:
        emit_json(made.model_dump(mode="json"))
    else:
        out.print(listing([made]))


@app.command("ls")
def list_(json_: JsonOpt = False) -> None:
    """List templates: built in, and built from images or Dockerfiles."""
    with Client() as client:
        templates = client.templates()
    if json_:
        emit_json([t.model_dump(mode="json") for t in templates])
        return
    out.print(listing(templates))


@app.command("rm")
def remove(name: str) -> None:
    """Remove a template built from an image (refused while sandboxes or snapshots use it)."""
    with Client() as client:
        client.delete_template(name)


def listing(templates: list[Template]) -> Listing:
    table = Listing(
        "name", "kind", "built", "disk", "source", ids=("name",), give_way={"source": 12}
    )
    for t in templates:
        table.add_row(
            escape(t.name),
            t.kind,
            "yes" if t.built else "no",
            "" if t.disk_mib is None else f"{t.disk_mib} MiB",
            escape(t.source or ""),
        )
    return table
