"""Errors as each caller's SDK reads them. cella's own API answers
`{"error": {"code", "message"}}`; a foreign API's adapter registers the shape its SDK
expects (`add_error_shape`, in its `install`), and the app's handlers ask the registered
shapes in order: the first that owns the request renders the error."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from cella import errors

log = logging.getLogger("cella.server")
HTTP_CODES = {404: "not_found", 405: "method_not_allowed", 401: "unauthenticated"}


@dataclass(frozen=True, slots=True)
class ErrorShape:
    """A foreign API's errors: the requests it answers (`owns`), a cella error as its SDK
    reads it (`render`), and, when that API shapes them too, the framework's own errors (a
    route that does not exist, a method it does not take) as `http` renders them."""

    owns: Callable[[Request], bool]
    render: Callable[[Request, errors.CellaError], Response]
    http: Callable[[StarletteHTTPException], Response] | None = None


def describe(problems: Sequence[Any]) -> str:
    """Validation errors (pydantic's) as one line: `field: what is wrong; ...`."""
    parts = []
    for err in list(problems)[:10]:
        where = ".".join(str(p) for p in err.get("loc", ()) if p != "body")
        parts.append(f"{where}: {err.get('msg')}" if where else str(err.get("msg")))
    return "; ".join(parts) or "invalid request"


def error_body(code: str, message: str) -> dict[str, Any]:
    return {"error": {"code": code, "message": message}}


def add_error_shape(app: FastAPI, shape: ErrorShape) -> None:
    shapes(app).append(shape)


def shapes(app: FastAPI) -> list[ErrorShape]:
    found: list[ErrorShape] | None = getattr(app.state, "error_shapes", None)
    if found is None:
        found = app.state.error_shapes = []
    return found


def shape_of(request: Request) -> ErrorShape | None:
    return next((s for s in shapes(request.app) if s.owns(request)), None)


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(errors.CellaError)
    async def cella_error(request: Request, exc: errors.CellaError) -> Response:
        request.scope["cella.error_code"] = exc.code  # counted by the request metrics
        if shape := shape_of(request):
            return shape.render(request, exc)
        return JSONResponse(error_body(exc.code, exc.message), status_code=exc.status)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError) -> Response:
        return await cella_error(request, errors.InvalidArgument(describe(exc.errors())))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> Response:
        if (shape := shape_of(request)) and shape.http:
            return shape.http(exc)
        code = HTTP_CODES.get(exc.status_code, "http_error")
        request.scope["cella.error_code"] = code
        return JSONResponse(error_body(code, str(exc.detail)), status_code=exc.status_code)

    @app.exception_handler(Exception)
    async def unexpected(_: Request, exc: Exception) -> Response:
        log.exception("unhandled error")
        return JSONResponse(error_body("internal", f"{type(exc).__name__}"), status_code=500)
