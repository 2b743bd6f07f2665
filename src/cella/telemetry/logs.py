"""Log lines as JSON objects (`cella serve --log-format json`), one per line, for a machine to
read: time, level, logger, message, and the request being served (its id, method, path and
the sandbox its path names) or the sandbox a background job names (`extra={"sandbox_id":
...}`). The request comes from `serving`, set by the API's outermost middleware to the
request's ASGI scope; the router fills in the path's parameters later, so they are read
when the line is written."""

from __future__ import annotations

import json
import logging
import time
from contextvars import ContextVar
from typing import Any

from starlette.types import Scope

serving: ContextVar[Scope | None] = ContextVar("cella_serving", default=None)
REQUEST_ID = "cella.request_id"  # the request's id, kept in its scope


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        line: dict[str, Any] = {
            "time": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        scope = serving.get()
        if scope is not None:
            line["request_id"] = scope.get(REQUEST_ID)
            line["method"] = scope.get("method", "WEBSOCKET")
            line["path"] = scope.get("path")
            params = scope.get("path_params") or {}
            if "sandbox_id" in params:
                line["sandbox_id"] = params["sandbox_id"]
        if sandbox_id := getattr(record, "sandbox_id", None):
            line["sandbox_id"] = sandbox_id
        if record.exc_info:
            line["error"] = self.formatException(record.exc_info)
        return json.dumps(line, default=str)


def json_log_config(level: str) -> dict[str, Any]:
    """A `logging.config.dictConfig` for uvicorn (`log_config`): every logger, uvicorn's
    own and its access log included, writes JSON lines to stderr."""
    handler = {"class": "logging.StreamHandler", "formatter": "json", "stream": "ext://sys.stderr"}
    return {
        "version": 1,
        "disable_existing_loggers": False,
        "formatters": {"json": {"()": JsonFormatter}},
        "handlers": {"json": handler},
        "root": {"handlers": ["json"], "level": level.upper()},
        "loggers": {
            name: {"handlers": [], "level": level.upper(), "propagate": True}
            for name in ("uvicorn", "uvicorn.error", "uvicorn.access")
        },
    }
