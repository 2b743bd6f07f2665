"""`cella volume ...`: a tenant's persistent volumes, shared between sandboxes (mounted with
`cella sandbox create --volume NAME:/path[:ro]`), and their files read and written without
a sandbox."""

from __future__ import annotations

import sys
from typing import Annotated

import typer
from rich.markup import escape

from cella.cli._output import Listing, console, emit_json, out
from cella.sdk import Client

app = typer.Typer(
    help="Manage volumes: persistent file trees shared between sandboxes.",
    no_args_is_help=True,
    rich_markup_mode="markdown",
)
JsonOpt = Annotated[bool, typer.Option("--json", help="Print machine-readable JSON.")]


@app.command("create")
def create(name: str, json_: JsonOpt = False) -> None:
    """Create an empty volume."""
    with Client() as client:
        made = client.create_volume(name)
    if json_:
        emit_json(made.info.model_dump(mode="json"))
    else:
        console.print(f"created volume {escape(made.name)} as {made.id}")


@app.command("ls")
def list_(json_: JsonOpt = False) -> None:
    """List the tenant's volumes, their sizes and the sandboxes mounting them."""
    with Client() as client:
        listed = client.volumes()
    if json_:
        emit_json(listed.model_dump(mode="json"))
        return
    table = Listing("id", "name", "bytes", "used by", ids=("id", "name"))
    for v in listed.volumes:
        table.add_row(v.id, escape(v.name), str(v.size_bytes), ", ".join(v.used_by))
    out.print(table)
    quota = "unbounded" if listed.quota_bytes is None else f"{listed.quota_bytes} bytes"
    console.print(f"{listed.used_bytes} bytes used of {quota}")


@app.command()
def get(key: str) -> None:
    """A volume by id or name, as JSON."""
    with Client() as client:
        emit_json(client.volume(key).info.model_dump(mode="json"))


@app.command()
def rm(
    key: str,
    force: Annotated[
        bool, typer.Option("--force", help="delete it even while sandboxes mount it")
    ] = False,
) -> None:
    """Delete a volume and its files."""
    with Client() as client:
        client.delete_volume(key, force=force)
    console.print(f"deleted volume {escape(key)}")


@app.command("files")
def files(
    key: str,
    path: Annotated[str, typer.Argument()] = "/",
    depth: Annotated[int, typer.Option(min=1, max=16)] = 1,
    json_: JsonOpt = False,
) -> None:
    """List a directory of a volume."""
    with Client() as client:
        entries = client.volume(key).list(path, depth=depth)
    if json_:
        emit_json([e.model_dump(mode="json") for e in entries])
        return
    table = Listing("path", "type", "size", ids=("path",))
    for e in entries:
        table.add_row(escape(e.path), e.type, str(e.size))
    out.print(table)


@app.command("cat")
def cat(key: str, path: str) -> None:
    """Print a file of a volume to standard output."""
    with Client() as client:
        data = client.volume(key).read(path)
    sys.stdout.buffer.write(data)
    sys.stdout.buffer.flush()


@app.command("put")
def put(
    key: str,
    path: str,
    parents: Annotated[bool, typer.Option("--parents", "-p", help="make its directories")] = False,
) -> None:
    """Write standard input to a file of a volume."""
    data = sys.stdin.buffer.read()
    with Client() as client:
        entry = client.volume(key).write(path, data, parents=parents)
    console.print(f"wrote {entry.size} bytes to {escape(entry.path)}")


@app.command("rm-file")
def rm_file(key: str, path: str) -> None:
    """Remove a file (or a directory with what it holds) from a volume."""
    with Client() as client:
        client.volume(key).remove(path)
    console.print(f"removed {escape(path)}")
