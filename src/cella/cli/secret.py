"""`cella secret ...`: credentials the egress proxy adds for sandboxes (never shown again)."""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Annotated

import typer
from rich.markup import escape

from cella.cli._output import Listing, console, emit_json, out
from cella.models import Secret
from cella.sdk import Client

app = typer.Typer(
    help="Manage secrets (write-only values).", no_args_is_help=True, rich_markup_mode="markdown"
)
JsonOpt = Annotated[bool, typer.Option("--json", help="Print machine-readable JSON.")]


@app.command("set")
def set_(
    name: str,
    host: Annotated[list[str], typer.Option(help="host it may be sent to, repeatable")],
    auth: Annotated[
        str | None, typer.Option(help="also send it as an Authorization header: bearer or basic")
    ] = None,
    username: Annotated[str | None, typer.Option(help="user name for basic auth")] = None,
    inject: Annotated[
        str | None,
        typer.Option(help="anywhere (URL, headers, body) or header (only the auth header)"),
    ] = None,
    json_: JsonOpt = False,
) -> None:
    """Store a secret; its value is read from standard input (not from the command line,
    where other users and shell history could see it)."""
    value = sys.stdin.read().rstrip("\n")
    if not value:
        raise typer.BadParameter("pipe the secret's value into standard input")
    with Client() as client:
        secret = client.put_secret(name, value, host, auth=auth, username=username, inject=inject)
    if json_:
        emit_json(secret.model_dump(mode="json"))
    else:
        console.print(f"stored {secret.name} for {', '.join(secret.hosts)}")


@app.command("ls")
def list_(json_: JsonOpt = False) -> None:
    """List secrets: names and hosts, never values."""
    with Client() as client:
        secrets = client.secrets()
    if json_:
        emit_json([s.model_dump(mode="json") for s in secrets])
        return
    out.print(listing(secrets))


def listing(secrets: Sequence[Secret]) -> Listing:
    """The `secret ls` table: whole names (they are what sandboxes refer to)."""
    table = Listing(
        "name", "hosts", "auth", "updated", ids=("name",), give_way={"hosts": 12, "updated": 10}
    )
    for s in secrets:
        table.add_row(
            escape(s.name),
            escape(", ".join(s.hosts)),
            s.auth or "",
            s.updated_at.strftime("%Y-%m-%d %H:%M:%S"),
        )
    return table


@app.command()
def rm(name: str) -> None:
    """Delete a secret."""
    with Client() as client:
        client.delete_secret(name)
    console.print(f"deleted {name}")


@app.command("rotate-key")
def rotate_key(json_: JsonOpt = False) -> None:
    """Seal every secret value under a new key (admin): the database never holds values in
    clear, and the old key opens nothing once this returns."""
    with Client() as client:
        resealed = client.rotate_secrets_key()
    if json_:
        emit_json({"resealed": resealed})
    else:
        console.print(f"secrets key rotated: {resealed} values resealed")
