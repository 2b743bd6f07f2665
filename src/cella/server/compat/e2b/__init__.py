"""The E2B API, so that E2B's official SDK drives cella unchanged: the control plane (REST,
`X-API-KEY`) here; each sandbox's `envd` is served by the same daemon, told apart by the
`E2b-Sandbox-Id` header. Everything goes to cella's service rooms."""

from fastapi import FastAPI

from cella.server.compat.e2b import control, envd, observe, secrets, templates, unserved, volumes
from cella.server.compat.e2b.shapes import ERROR_SHAPE
from cella.server.error_shapes import ErrorShape, add_error_shape
from cella.server.hosts import add_own_ports
from cella.service.ports import INTERPRETER_PORT

__all__ = ["OWN_PORTS", "install"]

# the guest services E2B's SDK reaches by host name, `{port}-{sandbox_id}.{domain}`, and
# the header that names the sandbox when it reaches them at E2B_SANDBOX_URL instead
OWN_PORTS = {envd.ENVD_PORT: "e2b-sandbox-id", INTERPRETER_PORT: "e2b-sandbox-id"}


def install(app: FastAPI) -> None:
    app.include_router(secrets.router)
    app.include_router(volumes.router)
    app.include_router(templates.router)  # before unserved: what it serves of /templates
    app.include_router(unserved.router)  # before control: its static paths before control's ids
    app.include_router(observe.router)  # before control too: /sandboxes/metrics is no id
    app.include_router(control.router)
    app.include_router(envd.router)
    add_error_shape(app, ErrorShape(envd.owns, envd.error_response))  # envd's, then the API's
    add_error_shape(app, ERROR_SHAPE)
    add_own_ports(app, OWN_PORTS)
