"""`cella keys ...`: API keys for tenants (needs an admin key)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Annotated

import typer
from rich.markup import escape

from cella.cli._output import Listing, console, emit_json, out
from cella.models import KeyInfo, SigningKeys
from cella.sdk import Client

app = typer.Typer(
    help="Manage API keys (admin).", no_args_is_help=True, rich_markup_mode="markdown"
)
JsonOpt = Annotated[bool, typer.Option("--json", help="Print machine-readable JSON.")]


@app.command()
def create(
    tenant: Annotated[str, typer.Option(help="tenant name")],
    read_only: Annotated[
        bool, typer.Option(help="a key that may only look (GET), never change anything")
    ] = False,
    principal: Annotated[
        str | None, typer.Option(help="the person or service holding it (default: its id)")
    ] = None,
    role: Annotated[
        list[str] | None,
        typer.Option(
            help="owner (every sandbox of the tenant; the default), member (its own, the "
            "tenant's and those shared with it) or viewer (reads only); repeatable"
        ),
    ] = None,
    e2b_format: Annotated[
        bool,
        typer.Option(
            "--e2b-format", help="an `e2b_` key of hex digits, the form E2B's SDKs accept"
        ),
    ] = False,
    json_: JsonOpt = False,
) -> None:
    """Create a key for a tenant; it is printed once and only its hash is stored."""
    with Client() as client:
        created = client.create_key(
            tenant,
            read_only=read_only,
            principal=principal,
            roles=role,
            format="e2b" if e2b_format else None,
        )
    if json_:
        emit_json(created)
    else:
        console.print(
            f"key {created['id']} for tenant {created['tenant']}, {created['principal']} "
            f"({', '.join(created['roles'])}) (shown once):",
            markup=False,
            highlight=False,
        )
        out.print(created["key"])


@app.command("ls")
def list_(json_: JsonOpt = False) -> None:
    """List keys (never the keys themselves)."""
    with Client() as client:
        keys = client.list_keys()
    if json_:
        emit_json(keys)
        return
    out.print(listing([KeyInfo.model_validate(k) for k in keys]))


def listing(keys: Sequence[KeyInfo]) -> Listing:
    """The `keys ls` table: whole key ids."""
    table = Listing(
        "id", "tenant", "principal", "roles", "admin", "created", give_way={"created": 10}
    )
    for k in keys:
        table.add_row(
            escape(k.id),
            escape(k.tenant),
            escape(k.principal or k.id),
            ", ".join(k.roles),
            str(k.admin),
            k.created_at.strftime("%Y-%m-%d %H:%M:%S"),
        )
    return table


@app.command()
def revoke(key_id: str) -> None:
    """Revoke a key."""
    with Client() as client:
        client.revoke_key(key_id)
    console.print(f"revoked {key_id}")


@app.command("uses")
def uses(
    key: Annotated[str | None, typer.Option(help="only this key id")] = None,
    tenant: Annotated[str | None, typer.Option(help="only this tenant's keys")] = None,
    limit: Annotated[int, typer.Option(help="newest entries to show")] = 50,
    json_: JsonOpt = False,
) -> None:
    """The audit log of key use: who called what, when, with which outcome (newest first)."""
    with Client() as client:
        found = client.key_uses(key, tenant, limit)
    if json_:
        emit_json([u.model_dump(mode="json") for u in found])
        return
    table = Listing("at", "key", "tenant", "method", "path", "status", give_way={"path": 20})
    for u in found:
        table.add_row(
            u.at.strftime("%Y-%m-%d %H:%M:%S"),
            u.key_id,
            escape(u.tenant),
            u.method,
            escape(u.path),
            str(u.status),
        )
    out.print(table)


def _signing_table(keys: SigningKeys) -> None:
    table = Listing("kid", "created", "signs", ids=("kid",))
    for k in keys.keys:
        table.add_row(k.kid, k.created_at.isoformat(timespec="seconds"), "yes" if k.current else "")
    out.print(table)


@app.command("signing")
def signing(json_: JsonOpt = False) -> None:
    """The daemon's signing keys (download links, login-mode user tokens): which one signs;
    the others only verify until retired."""
    with Client() as client:
        keys = client.signing_keys()
    if json_:
        emit_json(keys.model_dump(mode="json"))
    else:
        _signing_table(keys)


@app.command("signing-rotate")
def signing_rotate(json_: JsonOpt = False) -> None:
    """Make a new signing key; the old ones keep their kid and verify until retired."""
    with Client() as client:
        keys = client.rotate_signing_key()
    if json_:
        emit_json(keys.model_dump(mode="json"))
    else:
        _signing_table(keys)


@app.command("signing-retire")
def signing_retire(kid: str) -> None:
    """Retire a signing key that no longer signs: what it signed stops verifying."""
    with Client() as client:
        client.retire_signing_key(kid)
    console.print(f"retired signing key {kid}", highlight=False, markup=False)
