"""`cella serve`: the daemon."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from pathlib import Path
from typing import Annotated, Any

import typer


def serve(
    listen: Annotated[str | None, typer.Option(help="HOST:PORT to listen on.")] = None,
    data_dir: Annotated[Path | None, typer.Option(help="State, images and VMs.")] = None,
    accel: Annotated[str | None, typer.Option(help="auto, kvm or tcg.")] = None,
    log_level: Annotated[str | None, typer.Option(help="debug, info, warning...")] = None,
    log_format: Annotated[
        str | None, typer.Option(help="text, or json: one JSON object per line.")
    ] = None,
    ray: Annotated[
        str | None,
        typer.Option(
            help="Serve a fleet: the gateway of the Ray cluster at this address (or `auto`), "
            "running a node daemon on every node with the `cella_node` resource."
        ),
    ] = None,
    node_root: Annotated[
        Path | None,
        typer.Option(help="With --ray: where node daemons keep their data, on each node."),
    ] = None,
    ray_allow_unauthenticated: Annotated[
        bool,
        typer.Option(
            help="With --ray: join a Ray cluster that answers without a token (anyone who "
            "reaches it runs code on every node)."
        ),
    ] = False,
    tls_cert: Annotated[Path | None, typer.Option(help="Serve HTTPS: certificate (PEM).")] = None,
    tls_key: Annotated[Path | None, typer.Option(help="Serve HTTPS: its key (PEM).")] = None,
    allow_insecure_listen: Annotated[
        bool,
        typer.Option(help="Listen beyond loopback without TLS (behind a TLS proxy only)."),
    ] = False,
) -> None:
    """Run the cella daemon (REST API under /v1), or with --ray the gateway of a fleet.
    Settings: see cella/config.py."""
    import uvicorn

    from cella.config import ADMIN_KEY_FILE
    from cella.config import DaemonSettings as Settings

    given = {
        "listen": listen,
        "data_dir": data_dir,
        "accel": accel,
        "log_level": log_level,
        "log_format": log_format,
        "tls_cert": tls_cert,
        "tls_key": tls_key,
        "allow_insecure_listen": allow_insecure_listen or None,
        "ray_allow_unauthenticated": ray_allow_unauthenticated or None,
    }
    flags = {k: v for k, v in given.items() if v is not None}
    settings = Settings(**flags)  # type: ignore[arg-type]
    try:
        settings.check_listen()
    except ValueError as exc:
        typer.echo(f"cella serve: {exc}", err=True)
        raise typer.Exit(2) from None
    if settings.database_url is not None and (
        ray is None or not settings.database_url.startswith(("postgresql://", "postgres://"))
    ):
        typer.echo(
            "cella serve: database_url is the shared state of fleet gateways (with --ray), "
            "a postgresql:// URL; a single daemon keeps its own SQLite",
            err=True,
        )
        raise typer.Exit(2)
    if settings.tls_cert is not None and not settings.proxy_api_port and ray is None:
        settings = settings.model_copy(update={"proxy_api_port": _free_loopback_port()})
    host, port = settings.host_port
    typer.echo(
        f"cella serve: the API at {settings.url}/v1, the web console at {settings.url}/ui "
        f"(the admin key is in {settings.data_dir / ADMIN_KEY_FILE})",
        err=True,
    )
    if ray is not None:
        from cella.fleet.app import create_gateway_app

        app = create_gateway_app(settings, ray, node_root)
    else:
        from cella.server.app import create_app
        from cella.server.compat import ADAPTERS

        app = create_app(settings, ADAPTERS)
    main = uvicorn.Server(
        uvicorn.Config(
            app,
            host=host,
            port=port,
            log_level=settings.log_level,
            log_config=_log_config(settings),
            timeout_graceful_shutdown=5,
            ssl_certfile=settings.tls_cert,
            ssl_keyfile=settings.tls_key,
        )
    )
    asyncio.run(_serve(main, app, settings))


async def _serve(main: Any, app: Any, settings: Any) -> None:
    """The API; with TLS, also in clear on a loopback port for the egress proxy alone (it
    carries delegated calls and rewrites there), stopped with the API."""
    import uvicorn

    if settings.tls_cert is None or not settings.proxy_api_port:
        await main.serve()
        return

    class Quiet(uvicorn.Server):
        @contextlib.contextmanager
        def capture_signals(self) -> Any:  # the API's server takes the signals
            yield

    clear = Quiet(
        uvicorn.Config(
            app,
            host="127.0.0.1",
            port=settings.proxy_api_port,
            log_level=settings.log_level,
            log_config=_log_config(settings),
            lifespan="off",  # the daemon is started and stopped by the API's server
        )
    )
    task = asyncio.create_task(clear.serve())
    try:
        await main.serve()
    finally:
        clear.should_exit = True
        await task


def _log_config(settings: Any) -> Any:
    """uvicorn's own logging set-up (text), or JSON lines for every logger."""
    import uvicorn.config

    if settings.log_format == "json":
        from cella.telemetry.logs import json_log_config

        return json_log_config(settings.log_level)
    return uvicorn.config.LOGGING_CONFIG


def _free_loopback_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
