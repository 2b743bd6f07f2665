"""`cella webhook ...`: URLs told, signed, of the tenant's sandboxes' lifecycle events, and
what was delivered to them."""

from __future__ import annotations

from typing import Annotated

import typer
from rich.markup import escape

from cella.cli._output import Listing, console, emit_json, out
from cella.sdk import Client

app = typer.Typer(
    help="Manage lifecycle webhooks (signed deliveries, retried).",
    no_args_is_help=True,
    rich_markup_mode="markdown",
)
JsonOpt = Annotated[bool, typer.Option("--json", help="Print machine-readable JSON.")]
EventOpt = Annotated[
    list[str] | None,
    typer.Option(
        "--event",
        help="sandbox.created, .updated, .paused, .resumed or .killed (repeatable; all if none)",
    ),
]


@app.command("add")
def add(
    url: str,
    name: Annotated[str | None, typer.Option(help="a name to know it by")] = None,
    event: EventOpt = None,
    json_: JsonOpt = False,
) -> None:
    """Register a URL; its signing secret is printed this once."""
    with Client() as client:
        made = client.create_webhook(url, name=name, events=event or None)
    if json_:
        emit_json(made.model_dump(mode="json"))
    else:
        console.print(f"added {made.id} -> {escape(made.url)}")
        console.print(f"secret (shown once): {made.secret}")


@app.command("ls")
def list_(json_: JsonOpt = False) -> None:
    """List webhooks."""
    with Client() as client:
        rows = client.webhooks()
    if json_:
        emit_json([r.model_dump(mode="json") for r in rows])
        return
    table = Listing("id", "name", "url", "events", "enabled", ids=("id",))
    for r in rows:
        events = ",".join(e.removeprefix("sandbox.") for e in r.events)
        table.add_row(r.id, escape(r.name), escape(r.url), events, str(r.enabled).lower())
    out.print(table)


@app.command("set")
def set_(
    webhook_id: str,
    url: Annotated[str | None, typer.Option(help="a new URL")] = None,
    event: EventOpt = None,
    enable: Annotated[bool | None, typer.Option("--enable/--disable")] = None,
    json_: JsonOpt = False,
) -> None:
    """Change a webhook's URL, events or whether it is enabled."""
    fields: dict[str, object] = {}
    if url is not None:
        fields["url"] = url
    if event:
        fields["events"] = event
    if enable is not None:
        fields["enabled"] = enable
    with Client() as client:
        hook = client.update_webhook(webhook_id, **fields)
    if json_:
        emit_json(hook.model_dump(mode="json"))
    else:
        console.print(f"updated {hook.id}")


@app.command("rm")
def remove(webhook_id: str) -> None:
    """Remove a webhook (and its delivery log)."""
    with Client() as client:
        client.delete_webhook(webhook_id)
    console.print(f"removed {webhook_id}")


@app.command("deliveries")
def deliveries(
    webhook_id: str,
    limit: Annotated[int, typer.Option(min=1, max=1000)] = 100,
    json_: JsonOpt = False,
) -> None:
    """What was sent to a webhook: each event, its state and its attempts."""
    with Client() as client:
        rows = client.webhook_deliveries(webhook_id, limit=limit)
    if json_:
        emit_json([r.model_dump(mode="json") for r in rows])
        return
    table = Listing("id", "sandbox", "event", "state", "attempts", "last")
    for r in rows:
        last = r.attempts[-1] if r.attempts else None
        said = "" if last is None else (str(last.status or "") or escape(last.error or ""))
        table.add_row(str(r.id), r.sandbox_id, r.event, r.state, str(len(r.attempts)), said)
    out.print(table)
