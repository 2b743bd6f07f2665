"""E2B's template build API through the real app (fake runtime, no builds run): a build
requested by name, files uploaded by hash through the signed link it hands out (refused with
another link's token), steps translated into a Dockerfile, and what cella cannot build
refused by name in E2B's shape before anything starts."""

from __future__ import annotations

import hashlib
import io
import json
import tarfile
from pathlib import Path
from typing import Any

import httpx2
import pytest

from cella import errors
from cella.images import steps
from cella.models import BuildStep
from tests.unit.in_process import serving

HASH = "a" * 64


def step(type_: str, *args: str, files_hash: str | None = None) -> BuildStep:
    return BuildStep(type=type_, args=list(args), files_hash=files_hash)  # type: ignore[arg-type]


def test_steps_become_a_dockerfile_with_their_origins() -> None:
    done = steps.dockerfile(
        "registry.test/app:1",
        [
            step("copy", "site/index.html", "/srv/", "", "0644", files_hash=HASH),
            step("env", "A", 'x "$HOME"', "B", "2"),
            step("run", "echo $A\necho two", "root"),
            step("workdir", "/srv"),
            step("user", "root"),
            step("copy", "conf", "/etc/app", "app:app", files_hash=HASH),
        ],
    )
    lines = done.dockerfile.splitlines()
    assert lines[0] == "FROM registry.test/app:1"
    assert lines[3:5] == ["USER user", "WORKDIR /home/user"]  # E2B's default user and home
    assert f'COPY --chown=user:user --chmod=0644 ["files/{HASH}/site/index.html", "/srv/"]' in lines
    assert 'ENV A="x \\"\\$HOME\\"" B="2"' in lines  # literal: no expansion, quotes kept
    # a command in the exec form (newlines and all), as its user, then back
    run = lines.index('RUN ["/bin/sh", "-c", "echo $A\\necho two"]')
    assert lines[run - 1] == "USER root" and lines[run + 1] == "USER user"
    assert f'COPY --chown=app:app ["files/{HASH}/conf", "/etc/app"]' in lines
    assert done.hashes == [HASH]  # each upload once
    assert len(done.origins) == len(lines)
    assert done.origins[:5] == ["base"] * 5 and done.origins[run] == "2"
    assert done.origins[-1] == "5"


@pytest.mark.parametrize(
    ("bad", "named"),
    [
        (step("copy", "../etc/passwd", "/x", files_hash=HASH), "inside the context"),
        (step("copy", "a", "/x"), "hash of its uploaded files"),
        (step("copy", "a", "/x", "", "9999", files_hash=HASH), "not octal"),
        (step("env", "A"), "alternating"),
        (step("env", "1A", "x"), "not a variable name"),
        (step("workdir", "/a\nRUN evil"), "line break"),
        (step("user", "root; rm"), "not a user name"),
        (step("run"), "RUN takes"),
    ],
)
def test_steps_that_cannot_be_written_are_refused(bad: BuildStep, named: str) -> None:
    with pytest.raises(errors.InvalidArgument, match=named):
        steps.dockerfile("img:1", [bad])
    assert steps.dockerfile("img:1", [step("run", "true")]).hashes == []  # the control


def test_registry_references_are_made_explicit() -> None:
    assert steps.reference("alpine:3", "docker.io") == "docker.io/library/alpine:3"
    assert steps.reference("org/app", "docker.io") == "docker.io/org/app"
    assert steps.reference("registry.test/app:1", "registry.test") == "registry.test/app:1"


def archive() -> bytes:
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w:gz") as tar:
        info = tarfile.TarInfo("index.html")
        info.size = 5
        tar.addfile(info, io.BytesIO(b"hello"))
    return out.getvalue()


async def test_build_requests_uploads_and_refusals(tmp_path: Path) -> None:
    async with serving(tmp_path) as app:
        transport = httpx2.ASGITransport(app=app.app)
        async with httpx2.AsyncClient(transport=transport, base_url="http://cella.test") as c:
            head = {"X-API-KEY": app.admin_key}

            async def call(method: str, path: str, body: Any = None) -> httpx2.Response:
                return await c.request(method, path, headers=head, json=body)

            made = await call("POST", "/v3/templates", {"name": "web:v1", "tags": ["s"]})
            assert made.status_code == 202, made.text
            tid, bid = made.json()["templateID"], made.json()["buildID"]
            assert made.json()["names"] == ["web"] and made.json()["tags"] == ["v1", "s"]
            again = await call("POST", "/v3/templates", {"name": "web"})
            assert again.json()["templateID"] == tid and again.json()["buildID"] != bid

            files = hashlib.sha256(b"files").hexdigest()
            link = await call("GET", f"/templates/{tid}/files/{files}")
            assert link.status_code == 201 and link.json()["present"] is False
            url = link.json()["url"]
            assert url.startswith("http://cella.test/v1/templates/uploads/")
            other = hashlib.sha256(b"other").hexdigest()
            wrong = url.replace(files, other)  # the token names the hash
            refused = await c.put(wrong, content=archive())
            assert refused.status_code == 403, refused.text
            tampered = await c.put(url[:-3] + "abc", content=archive())
            assert tampered.status_code in (401, 403), tampered.text
            stored = await c.put(url, content=archive())  # the control: its own link
            assert stored.status_code == 200, stored.text
            link = await call("GET", f"/templates/{tid}/files/{files}")
            assert link.json()["present"] is True

            async def start(body: dict[str, Any]) -> httpx2.Response:
                return await call("POST", f"/v2/templates/{tid}/builds/{bid}", body)

            base = {"fromImage": "registry.test/app:1", "force": False}
            cases = [
                ({**base, "fromImageRegistry": {"type": "aws", "awsAccessKeyId": "x",
                                               "awsSecretAccessKey": "y", "awsRegion": "z"}},
                 "fromImageRegistry of type 'aws'"),
                ({**base, "steps": [{"type": "ADD", "args": ["x"]}]}, "of type 'ADD'"),
                ({**base, "steps": [{"type": "RUN", "args": ["x"], "cache": 1}]}, "cache"),
                ({**base, "unknown": 1}, "unknown"),
                ({"fromTemplate": "base"}, "fromTemplate 'base'"),
                ({**base, "steps": [{"type": "COPY", "args": ["a", "/a"], "filesHash": other}]},
                 "files not uploaded"),
            ]  # fmt: skip
            for body, named in cases:
                r = await start(body)
                assert r.status_code == 400, (body, r.text)
                assert r.json()["code"] == 400 and named in r.json()["message"], r.text
            status = await call("GET", f"/templates/{tid}/builds/{bid}/status")
            assert status.status_code == 200 and status.json()["status"] == "waiting"

            alias = await call("GET", "/templates/aliases/web")
            assert alias.status_code == 200 and alias.json()["templateID"] == tid
            missing = await call("GET", "/templates/aliases/nope")
            assert missing.status_code == 404 and missing.json()["code"] == 404
            listed = await call("GET", f"/templates/{tid}")
            assert listed.status_code == 200 and len(listed.json()["builds"]) == 2
            bad = await call("POST", "/v3/templates", {"name": "Web Site"})
            assert bad.status_code == 400 and "template name" in bad.json()["message"]
            big = await call("POST", "/v3/templates", {"name": "w", "minFreeDiskMb": 1 << 21})
            assert big.status_code == 400 and "free space" in big.json()["message"]
            room = await call("POST", "/v3/templates", {"name": "w", "minFreeDiskMb": 4096})
            assert room.status_code == 202  # the control: within bounds
            gone = await call("DELETE", f"/templates/{tid}")
            assert gone.status_code == 204
            assert (await call("GET", "/templates/aliases/web")).status_code == 404
            assert json.loads((await call("GET", "/templates")).text) == []


async def test_a_template_on_another_starts_from_its_base_and_steps(tmp_path: Path) -> None:
    """`fromTemplate` of a template built from steps: its image and steps come first, its
    start command unless the new build has one; kept expanded, so a later build on the new
    one never follows a name that names another build by then."""
    async with serving(tmp_path) as app:
        builds = app.daemon.template_builds
        named, base, _ = builds.request("tenant", "base-app", [])
        spec = {"from_image": "docker.io/library/alpine:3", "steps": [
            {"type": "run", "args": ["echo base"], "files_hash": None}],
            "start": {"command": "serve", "ready": None, "ready_timeout_seconds": 600}}  # fmt: skip
        app.daemon.store.update_build(base.id, state="ready", spec=json.dumps(spec), image="img-x")
        app.daemon.store.set_template_tag(named.id, "default", base.id)
        _, child, _ = builds.request("tenant", "child", [])
        body = {"fromTemplate": "base-app", "steps": [{"type": "RUN", "args": ["echo child"]}]}
        transport = httpx2.ASGITransport(app=app.app)
        async with httpx2.AsyncClient(transport=transport, base_url="http://cella.test") as c:
            _, key = app.daemon.keys.create("tenant")  # a key of that tenant
            head = {"X-API-KEY": key}
            r = await c.post(
                f"/v2/templates/{child.template_id}/builds/{child.id}", headers=head, json=body
            )
            assert r.status_code == 202, r.text
            other = await c.post("/v3/templates", headers={"X-API-KEY": app.admin_key},
                                 json={"name": "base-app"})  # fmt: skip
            assert other.json()["templateID"] != named.id  # another tenant's own name
        kept = json.loads(app.daemon.store.get_build(child.id).spec)  # type: ignore[union-attr]
        assert kept["from_image"] == "docker.io/library/alpine:3"
        assert kept["from_template"] is None
        assert [s["args"] for s in kept["steps"]] == [["echo base"], ["echo child"]]
        assert kept["start"]["command"] == "serve"


async def test_a_build_a_restart_cut_short_ends_in_error(tmp_path: Path) -> None:
    async with serving(tmp_path) as app:
        builds = app.daemon.template_builds
        _, running, _ = builds.request("tenant", "cut-short", [])
        _, waiting, _ = builds.request("tenant", "not-started", [])
        app.daemon.store.update_build(running.id, state="building")
        builds.recover()  # what a daemon does as it starts
        cut = app.daemon.store.get_build(running.id)
        assert cut is not None and cut.state == "error" and "restarted" in (cut.error or "")
        kept = app.daemon.store.get_build(waiting.id)  # the control: not started, kept
        assert kept is not None and kept.state == "waiting"
