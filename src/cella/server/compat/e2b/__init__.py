"""The E2B API, so that E2B's official SDK drives cella unchanged: the control plane (REST,
`X-API-KEY`) here; each sandbox's `envd` is served by the same daemon, told apart by the
`E2b-Sandbox-Id` header. Everything goes to cella's service rooms."""

from fastapi import FastAPI

from cella.server.compat.e2b import control, envd
from cella.server.compat.e2b.shapes import error_response, owns

__all__ = ["error_response", "install", "owns"]


def install(app: FastAPI) -> None:
    app.include_router(control.router())
    app.include_router(envd.router())
