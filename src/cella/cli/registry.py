"""`cella registry ...`: credentials for pulling a tenant's private images (the password is
never shown again), named when a snapshot is built from an image."""

from __future__ import annotations

import sys
from typing import Annotated

import typer
from rich.markup import escape

from cella.cli._output import Listing, console, emit_json, out
from cella.sdk import Client

app = typer.Typer(
    help="Manage image registries (write-only passwords).",
    no_args_is_help=True,
    rich_markup_mode="markdown",
)
JsonOpt = Annotated[bool, typer.Option("--json", help="Print machine-readable JSON.")]


@app.command("add")
def add(
    name: str,
    url: Annotated[str, typer.Option(help="the registry's host[:port]")],
    username: Annotated[
        str | None, typer.Option(help="log in as this user; the password is read from stdin")
    ] = None,
    json_: JsonOpt = False,
) -> None:
    """Keep a registry; with --username its password is read from standard input (not from
    the command line, where other users and shell history could see it)."""
    password = None
    if username is not None:
        password = sys.stdin.read().rstrip("\n")
        if not password:
            raise typer.BadParameter("pipe the registry's password into standard input")
    with Client() as client:
        made = client.create_registry(name, url, username=username, password=password)
    if json_:
        emit_json(made.model_dump(mode="json"))
    else:
        console.print(f"added {made.name} ({made.url}) as {made.id}")


@app.command("ls")
def list_(json_: JsonOpt = False) -> None:
    """List registries: names, hosts and users, never passwords."""
    with Client() as client:
        rows = client.registries()
    if json_:
        emit_json([r.model_dump(mode="json") for r in rows])
        return
    table = Listing("id", "name", "url", "username", ids=("id", "name"))
    for r in rows:
        table.add_row(r.id, escape(r.name), escape(r.url), escape(r.username or ""))
    out.print(table)


@app.command()
def get(key: str) -> None:
    """A registry by id or name, as JSON."""
    with Client() as client:
        emit_json(client.get_registry(key).model_dump(mode="json"))


@app.command()
def rm(key: str) -> None:
    """Delete a registry (by id or name)."""
    with Client() as client:
        client.delete_registry(key)
    console.print(f"deleted {key}")
