"""Templates: listed by anyone; built (from an image or a Dockerfile) and removed by an admin,
since every tenant's sandboxes may use them. Builds stream their progress as JSON Lines."""

from __future__ import annotations

import asyncio
import tempfile
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import IO, Annotated, Any

from fastapi import APIRouter, Query, Request, Response
from fastapi.responses import FileResponse, StreamingResponse
from pydantic import ValidationError

from cella import errors
from cella.models import BuildEvent, StartCommand, Template, TemplateBuild, TemplateList
from cella.models.fleet import TemplateExport, TemplateImport
from cella.server.deps import Auth, DaemonDep, jsonl
from cella.service.background import Background
from cella.service.dockerfiles import DockerfileBuild
from cella.service.keys import require_admin
from cella.service.transfer import NodeSource

router = APIRouter(prefix="/v1/templates", tags=["templates"])
PROGRESS: dict[int | str, dict[str, Any]] = {
    200: {
        "content": {"application/x-ndjson": {"schema": BuildEvent.model_json_schema()}},
        "description": "JSON Lines of BuildEvent: progress lines, then `done` or `error`",
    }
}


@router.get("", response_model=TemplateList)
async def list_templates(svc: DaemonDep, who: Auth) -> TemplateList:
    return TemplateList(templates=svc.templates.list(who.tenant))


@router.get("/{name}", response_model=Template)
async def get_template(name: str, svc: DaemonDep, who: Auth) -> Template:
    return svc.templates.get(name, who.tenant)


@router.post("", response_class=StreamingResponse, responses=PROGRESS)
async def build_template(body: TemplateBuild, svc: DaemonDep, who: Auth) -> StreamingResponse:
    """Builds (or rebuilds) a template from an OCI/Docker image: fetch, unpack, file system,
    warm snapshot. The same image digest again is a cache hit."""
    require_admin(who, "build templates")
    return _stream(
        svc.background, lambda progress: svc.templates.build_image(who.tenant, body, progress)
    )


@router.post("/{name}/dockerfile", response_class=StreamingResponse, responses=PROGRESS)
async def build_dockerfile(
    name: str,
    request: Request,
    svc: DaemonDep,
    who: Auth,
    dockerfile: str = "Dockerfile",
    allow: Annotated[list[str] | None, Query(description="hosts the build may reach")] = None,
    disk_mib: Annotated[int | None, Query(ge=512, le=1 << 20)] = None,
    start_cmd: Annotated[
        str | None, Query(max_length=16384, description="running in its sandboxes")
    ] = None,
    ready_cmd: Annotated[
        str | None, Query(max_length=16384, description="polled until it exits 0")
    ] = None,
) -> StreamingResponse:
    """Builds a template from a Dockerfile; the body is the build context as a tar archive.
    The build runs in a builder sandbox that reaches only `allow`. With `start_cmd`, every
    sandbox of the template has that command running (started before the warm snapshot,
    once `ready_cmd` exits 0)."""
    require_admin(who, "build templates")
    try:
        start = StartCommand(command=start_cmd, ready=ready_cmd) if start_cmd or ready_cmd else None
    except ValidationError as exc:  # query parameters: a 400 naming them, as a body's would be
        raise errors.InvalidArgument(f"start_cmd/ready_cmd: {exc.errors()[0]['msg']}") from None
    # read whole before the response starts: once it streams, Starlette's disconnect
    # listener takes the request's remaining messages
    spool = await spool_body(request, svc.files.max_upload_bytes)
    return _stream(
        svc.background,
        lambda progress: svc.dockerfiles.build(
            who.tenant,
            name,
            _chunks(spool),
            progress,
            DockerfileBuild(dockerfile, allow or [], disk_mib, start=start),
        ),
    )


@router.put("/uploads/{template_id}/{files_hash}", status_code=200)
async def upload_files(
    template_id: str, files_hash: str, token: str, request: Request, svc: DaemonDep
) -> Response:
    """Where a signed upload link (E2B's template file uploads) sends the files of one copy
    step, a tar archive: no key, the link's token names the tenant, template and hash, for
    an hour."""
    await svc.template_builds.receive(token, template_id, files_hash, request.stream())
    return Response(status_code=200)


# -- between the nodes of a fleet (admin keys: node daemons and their gateway) --------------


@router.post("/import", status_code=201, response_model=Template)
async def import_template(body: TemplateImport, svc: DaemonDep, who: Auth) -> Template:
    """Takes in another node's template built from an image: its base pulled and checked
    against its digest (a copy that does not match is deleted, 409 template_corrupt); a
    template already here with that digest is returned as it is."""
    require_admin(who, "import a template")
    source = NodeSource(body.source_url, body.source_key, body.source_ca)
    export = await source.template_export(body.name)
    if export.template.get("name") != body.name:
        raise errors.InvalidArgument(f"the source answered for another template than {body.name}")

    async def pull(dest: Path) -> None:
        await source.pull_template(body.name, dest)

    return await svc.template_shipping.take_in(export, pull, body.source_node)


@router.get("/{name}/export", response_model=TemplateExport)
async def export_template(name: str, svc: DaemonDep, who: Auth) -> TemplateExport:
    """What another node needs to take the template in: its record, its base's digest."""
    require_admin(who, "export a template")
    return await svc.template_shipping.export(name)


@router.get("/{name}/base", response_class=FileResponse)
async def template_base(name: str, svc: DaemonDep, who: Auth) -> FileResponse:
    """The template's base image (qcow2), for another node to pull."""
    require_admin(who, "read a template's base image")
    return FileResponse(svc.template_shipping.base(name))


@router.delete("/{name}", status_code=204)
async def delete_template(name: str, svc: DaemonDep, who: Auth) -> Response:
    """Removes a template built from an image (409 while sandboxes or snapshots use it)."""
    require_admin(who, "remove templates")
    await svc.templates.delete(name)
    return Response(status_code=204)


async def spool_body(request: Request, limit: int) -> IO[bytes]:
    spool = tempfile.TemporaryFile()  # noqa: SIM115 (closed by _chunks, or here on error)
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            spool.close()
            raise errors.PayloadTooLarge(f"the build context exceeds {limit >> 20} MiB")
        await asyncio.to_thread(spool.write, chunk)
    spool.seek(0)
    return spool


async def _chunks(spool: IO[bytes]) -> AsyncIterator[bytes]:
    with spool:
        while chunk := await asyncio.to_thread(spool.read, 1 << 20):
            yield chunk


def _stream(
    background: Background, build: Callable[[Callable[[str], None]], Awaitable[Template]]
) -> StreamingResponse:
    """Runs the build as a task of the daemon's own (a client that goes away does not stop
    it, the daemon's shutdown does) and streams its progress, then its outcome."""
    queue: asyncio.Queue[BuildEvent] = asyncio.Queue()

    def progress(line: str) -> None:
        queue.put_nowait(BuildEvent(type="progress", message=line))

    async def run() -> None:
        try:
            template = await build(progress)
            queue.put_nowait(BuildEvent(type="done", template=template))
        except errors.CellaError as exc:
            queue.put_nowait(BuildEvent(type="error", code=exc.code, message=exc.message))
        except Exception as exc:
            queue.put_nowait(BuildEvent(type="error", code="internal", message=repr(exc)))

    background.start(run(), name="template-build")

    async def lines() -> AsyncIterator[bytes]:
        while True:
            event = await queue.get()
            yield jsonl(event.model_dump(mode="json", exclude_none=True))
            if event.type != "progress":
                return

    return StreamingResponse(lines(), media_type="application/x-ndjson")
