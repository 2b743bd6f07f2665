"""The parts of E2B's API that cella does not serve, answered by name.

The pinned SDK (`e2b==2.63.0`, `e2b/api/client/api/*`) can call each of these paths. Without
a route the framework would answer a bare 404 that the SDK reads as "not found", or, outside
the paths E2B's error shape owns, a body the SDK cannot read at all. Each answers instead a
400 in E2B's `{code, message}` that names what is missing. Registered before the served
routes (`/sandboxes/metrics` would otherwise be read as a sandbox's id), so none of these
paths may be one cella serves: `DELETE /templates/{id}` (a snapshot's or a template's
deletion) is not here, nor the template build API `Template.build` uses (`templates.py`,
registered before these).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from fastapi import APIRouter, Request

from cella import errors

ALL = ("GET", "POST", "PUT", "PATCH", "DELETE")

# (path, what it is in E2B's API, methods); `{rest:path}` covers the calls below a collection
TEMPLATES = "this part of E2B's template API (templates are built with Template.build)"
UNSERVED: tuple[tuple[str, str, tuple[str, ...]], ...] = (
    ("/templates", f"{TEMPLATES}: v1 builds", ("POST",)),
    ("/templates/{template_id}", f"{TEMPLATES}: v1 rebuilds", ("POST",)),
    ("/templates/{template_id}/builds/{build_id}", f"{TEMPLATES}: v1 builds", ("POST",)),
    ("/templates/{template_id}", f"{TEMPLATES}: public templates", ("PATCH",)),
    ("/v2/templates", f"{TEMPLATES}: v2 build requests", ("POST",)),
    ("/v2/templates/{template_id}", f"{TEMPLATES}: public templates", ("PATCH",)),
    ("/templates/{template_id}/tags/{rest:path}", f"{TEMPLATES}: tag counts and groups", ("GET",)),
    ("/default-templates", "E2B's default templates", ALL),
)

router = APIRouter(include_in_schema=False)


def _refuse(what: str) -> Callable[[Request], Awaitable[None]]:
    async def refuse(request: Request) -> None:
        raise errors.InvalidArgument(
            f"not supported by cella: {what} ({request.method} {request.url.path})"
        )

    return refuse


for _path, _what, _methods in UNSERVED:
    router.add_api_route(_path, _refuse(_what), methods=list(_methods))
