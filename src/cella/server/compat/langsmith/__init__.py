"""The LangSmith Sandboxes API (`langsmith.sandbox`, pinned 0.14.17), served on cella: set
`LANGSMITH_ENDPOINT` to the daemon's URL and `LANGSMITH_API_KEY` to a cella key."""

from __future__ import annotations

from fastapi import FastAPI

from cella.server.compat.langsmith import control, dataplane, registries
from cella.server.compat.langsmith.shapes import ERROR_SHAPE, PREFIXES
from cella.server.error_shapes import add_error_shape

__all__ = ["ERROR_SHAPE", "PREFIXES", "install"]


def install(app: FastAPI) -> None:
    for prefix in PREFIXES:
        app.include_router(control.router(prefix))
        app.include_router(registries.router(prefix))
    app.include_router(dataplane.router)
    add_error_shape(app, ERROR_SHAPE)
