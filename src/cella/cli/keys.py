"""`cella keys ...`: API keys for tenants (needs an admin key)."""

from __future__ import annotations

from typing import Annotated

import typer
from rich.table import Table

from cella.cli._output import console, emit_json, out
from cella.sdk import Client

app = typer.Typer(help="Manage API keys (admin).", no_args_is_help=True)
JsonOpt = Annotated[bool, typer.Option("--json", help="Print machine-readable JSON.")]


@app.command()
def create(
    tenant: Annotated[str, typer.Option(help="tenant name")], json_: JsonOpt = False
) -> None:
    """Create a key for a tenant; it is printed once and only its hash is stored."""
    with Client() as client:
        created = client.create_key(tenant)
    if json_:
        emit_json(created)
    else:
        console.print(f"key {created['id']} for tenant {created['tenant']} (shown once):")
        out.print(created["key"])


@app.command("ls")
def list_(json_: JsonOpt = False) -> None:
    """List keys (never the keys themselves)."""
    with Client() as client:
        keys = client.list_keys()
    if json_:
        emit_json(keys)
        return
    table = Table("id", "tenant", "admin", "created")
    for k in keys:
        table.add_row(k["id"], k["tenant"], str(k["admin"]), str(k["created_at"]))
    out.print(table)


@app.command()
def revoke(key_id: str) -> None:
    """Revoke a key."""
    with Client() as client:
        client.revoke_key(key_id)
    console.print(f"revoked {key_id}")
