"""E2B's `Template` builder (the pinned `e2b==2.63.0`, unchanged) building cella templates
against a real daemon: a small busybox image served by a TLS registry on loopback (reached
by the builder sandbox through the egress proxy, by a name the operator maps), a `copy` of
a local file, env vars, a `run_cmd` and a start command serving what they made; a sandbox
of the template has it running. One build for the module; the control is a build whose
step fails, with the step's output in the log the SDK reads."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx2
import pytest

from tests.daemon import Daemon, DaemonFactory
from tests.netservers import TestCA, free_loopback_block
from tests.oci_images import Registry, server_image
from tests.sdk_env import run_script, sdk_python

pytestmark = [pytest.mark.vm, pytest.mark.timeout(2400)]
E2B = ["e2b==2.63.0"]
HOST = "registry.e2b.test"  # the registry, as the builder sandbox reaches it
PRIVATE = "private.e2b.test"  # one that wants a password (puller / s3cret)
BUILD_SECONDS = 1800  # a build under TCG: builder restore, buildah, import, warm snapshot


@dataclass
class Setup:
    python: Path
    daemon: Daemon
    image: str  # the busybox web server image, by the name builders reach it
    host_image: str  # the same, as the daemon's host fetches it (an admin's build)
    private_image: str  # the same on the registry that wants a password
    context: Path  # the local files the copy step uploads


@pytest.fixture(scope="module")
def setup(
    tmp_path_factory: pytest.TempPathFactory, module_daemon_factory: DaemonFactory
) -> Iterator[Setup]:
    root = tmp_path_factory.mktemp("e2b-templates")
    layout = root / "layout"
    server_image(layout)
    prefix = free_loopback_block()
    ca = TestCA(root / "ca", [HOST, PRIVATE, f"{prefix}.1", f"{prefix}.2"])
    registry = Registry(root / "registry", f"{prefix}.1", ca, name=HOST)
    hashed = subprocess.run(
        ["/usr/bin/python3", "-W", "ignore", "-c",
         "import crypt; print(crypt.crypt('s3cret', crypt.mksalt(crypt.METHOD_BLOWFISH)))"],
        check=True, capture_output=True, text=True,
    ).stdout.strip()  # fmt: skip
    (root / "htpasswd").write_text(f"puller:{hashed}\n")
    private = Registry(
        root / "private", f"{prefix}.2", ca, htpasswd=root / "htpasswd", name=PRIVATE
    )
    context = root / "context"
    (context / "site").mkdir(parents=True)
    (context / "site" / "index.html").write_text("<h1>copied from the SDK's side</h1>\n")
    try:
        image = registry.push(f"oci:{layout}:server", "web/server:1")
        private_image = private.push(f"oci:{layout}:server", "team/server:1", creds="puller:s3cret")
        daemon = module_daemon_factory(
            "e2b-templates-daemon",
            pool_size="0",
            extra_ca_certificates=json.dumps([str(ca.cert)]),
            egress_hosts=json.dumps({HOST: registry.addr, PRIVATE: private.addr}),
        )
        host_image = f"{registry.addr}/web/server:1"
        python = sdk_python("e2b-2.63.0", E2B)
        yield Setup(python, daemon, image, host_image, private_image, context)
    finally:
        registry.close()
        private.close()


def test_cellas_own_templates_have_their_start_command_running(setup: Setup) -> None:
    """The core the E2B builder's start command rests on, through cella's own SDK: a
    template whose start command serves a page has it running in a new sandbox, and again
    after a stop that kept only its disk."""
    with setup.daemon.client() as admin:
        made = admin.build_template(
            "e2b-start-srv",
            setup.host_image,
            start_cmd="mkdir -p /tmp/www && echo served > /tmp/www/i && "
            "exec httpd -f -p 8000 -h /tmp/www",
            ready_cmd="wget -Y off -q -O /dev/null http://127.0.0.1:8000/i",
        )
        try:
            assert made.start is not None and made.start.ready and "httpd" in str(made.start)
            with admin.create("e2b-start-srv") as sb:
                fetch = ["wget", "-Y", "off", "-q", "-O-", "http://127.0.0.1:8000/i"]
                got = sb.exec(fetch)
                assert (got.exit_code, got.stdout) == (0, b"served\n")
                # a filesystem-only pause: the resume boots its disk, and the start command
                # is started again (the events say it was a boot, not a thaw)
                sb.stop(memory=False)
                assert sb.info.state == "stopped"
                sb.resume()
                got = sb.exec(fetch)
                assert (got.exit_code, got.stdout) == (0, b"served\n")
                events = [(e.type, e.data) for e in sb.events()]
                assert ("resumed", {"from": "stopped"}) in events
                assert any(t == "started" and "httpd" in str(d) for t, d in events)
        finally:
            admin.delete_template("e2b-start-srv")


def test_the_cli_builds_a_dockerfile_template_with_a_start_command(
    setup: Setup, tmp_path: Path
) -> None:
    """`cella template build --dockerfile ... --start-cmd ... --ready-cmd ...`: the
    Dockerfile's image, built in a builder sandbox, with its start command running in a
    sandbox of it."""
    (tmp_path / "Dockerfile").write_text(
        f"FROM {setup.image}\nRUN mkdir -p /srv && echo from-the-dockerfile > /srv/i\n"
    )
    built = subprocess.run(
        [sys.executable, "-m", "cella.cli", "template", "build", "e2b-start-df",
         "--dockerfile", str(tmp_path), "--allow", HOST, "--json",
         "--start-cmd", "exec httpd -f -p 8000 -h /srv",
         "--ready-cmd", "wget -Y off -q -O /dev/null http://127.0.0.1:8000/i"],
        env=setup.daemon.env(None), capture_output=True, text=True, timeout=1200,
    )  # fmt: skip
    assert built.returncode == 0, built.stderr
    assert json.loads(built.stdout)["start"]["command"] == "exec httpd -f -p 8000 -h /srv"
    with setup.daemon.client() as admin:
        try:
            with admin.create("e2b-start-df") as sb:
                got = sb.exec(["wget", "-Y", "off", "-q", "-O-", "http://127.0.0.1:8000/i"])
                assert (got.exit_code, got.stdout) == (0, b"from-the-dockerfile\n")
        finally:
            admin.delete_template("e2b-start-df")


def e2b(setup: Setup, script: str) -> Any:
    env = {
        "E2B_API_URL": setup.daemon.url,
        "E2B_SANDBOX_URL": setup.daemon.url,
        "E2B_API_KEY": setup.daemon.admin_key,
        "IMAGE": setup.image,
        "PRIVATE_IMAGE": setup.private_image,
        "CONTEXT": str(setup.context),
    }
    preamble = "import json, os\nfrom e2b import *\nfrom e2b.exceptions import *\n"
    return run_script(setup.python, preamble + textwrap.dedent(script), env, BUILD_SECONDS)


@pytest.fixture(scope="module")
def built(setup: Setup) -> dict[str, Any]:
    """The module's one template: `web-app:v1`, its logs as the SDK printed them."""
    return e2b(
        setup,
        """
        logs = []
        template = (
            Template(file_context_path=os.environ["CONTEXT"])
            .from_image(os.environ["IMAGE"])
            .copy("site/index.html", "/home/user/site/")
            .set_envs({"GREETING": "hello from set_envs"})
            .run_cmd('echo "$GREETING" > env.txt && whoami > who.txt')
            .set_start_cmd("httpd -f -p 8000 -h /home/user/site",
                           "wget -q -O /dev/null http://127.0.0.1:8000/index.html")
        )
        info = Template.build(template, "web-app:v1", tags=["stable"],
                              on_build_logs=lambda e: logs.append(e.message))
        print(json.dumps({"id": info.template_id, "build": info.build_id,
                          "tags": info.tags, "logs": logs}))
        """,
    )


def test_a_template_built_with_template_runs_its_start_command(
    setup: Setup, built: dict[str, Any]
) -> None:
    text = "\n".join(built["logs"])
    assert "Uploaded 'site/index.html'" in text  # the copy's files, through the signed link
    assert "builder sandbox" in text and "STEP" in text and "warm snapshot" in text
    assert sorted(built["tags"]) == ["stable", "v1"]
    head = {"X-API-KEY": setup.daemon.admin_key}
    stored = httpx2.get(
        f"{setup.daemon.url}/templates/{built['id']}/builds/{built['build']}/logs",
        params={"level": "info", "limit": "100"},
        headers=head,
        timeout=60,
    )  # the log as kept after the build: E2B's logs call
    assert stored.status_code == 200, stored.text
    assert any("STEP 1/" in e["message"] for e in stored.json()["logs"])
    got = e2b(
        setup,
        """
        import urllib.request
        sb = Sandbox.create("web-app:v1")
        req = urllib.request.Request(os.environ["E2B_API_URL"] + "/index.html",
                                     headers={"Host": sb.get_host(8000)})
        with urllib.request.urlopen(req, timeout=60) as r:
            page = [r.status, r.read().decode()]
        out = {
            "page": page,
            "env": sb.files.read("/home/user/env.txt"),
            "who": sb.files.read("/home/user/who.txt"),
            "ran": sb.commands.run("echo $GREETING; pwd; whoami").stdout,
            "exists": Template.exists("web-app"),
            "missing": Template.exists("no-such-template"),
        }
        sb.kill()
        print(json.dumps(out))
        """,
    )
    # the start command serves the file the copy step uploaded, from the first moment
    assert got["page"] == [200, "<h1>copied from the SDK's side</h1>\n"]
    assert got["env"] == "hello from set_envs\n" and got["who"] == "user\n"  # run_cmd as user
    assert got["ran"].split() == ["hello", "from", "set_envs", "/home/user", "user"]
    assert got["exists"] is True and got["missing"] is False


def test_tags_move_and_name_the_build(setup: Setup, built: dict[str, Any]) -> None:
    got = e2b(
        setup,
        """
        assigned = Template.assign_tags("web-app:v1", "production")
        tags = {t.tag: t.build_id for t in Template.get_tags("web-app")}
        Template.remove_tags("web-app", "stable")
        after = sorted(t.tag for t in Template.get_tags("web-app"))
        try:
            Template.assign_tags("web-app:nope", "x")
            missing = None
        except Exception as exc:
            missing = type(exc).__name__ + ": " + str(exc)
        import asyncio
        async def main():  # the async SDK reads the same
            return ([t.tag for t in await AsyncTemplate.get_tags("web-app")],
                    await AsyncTemplate.exists("web-app"))
        async_tags, async_exists = asyncio.run(main())
        print(json.dumps({"assigned": assigned.build_id, "tags": tags, "after": after,
                          "missing": missing, "async": [sorted(async_tags), async_exists]}))
        """,
    )
    assert got["assigned"] == built["build"]
    assert got["tags"] == {"v1": built["build"], "stable": built["build"],
                           "production": built["build"]}  # fmt: skip
    assert got["after"] == ["production", "v1"]
    assert got["missing"] and "nope" in got["missing"]
    assert got["async"] == [["production", "v1"], True]


def test_a_failing_step_fails_the_build_with_its_log(setup: Setup) -> None:
    """The control: the same image with a step that fails; the SDK raises its own
    BuildException with the step's output, and the status names the step."""
    got = e2b(
        setup,
        """
        logs = []
        template = (Template().from_image(os.environ["IMAGE"])
                    .run_cmd("echo fine")
                    .run_cmd("echo about to fail && exit 7"))
        try:
            Template.build(template, "broken", on_build_logs=lambda e: logs.append(e.message))
            error = None
        except BuildException as exc:
            error = str(exc)
        info = Template.build_in_background(Template().from_image(os.environ["IMAGE"])
                                            .run_cmd("exit 3"), "broken-too")
        import time
        while (status := Template.get_build_status(info)).status.value == "building":
            time.sleep(1)
        print(json.dumps({"error": error, "logs": logs, "status": status.status.value,
                          "step": status.reason.step if status.reason else None}))
        """,
    )
    assert got["error"] and "exit" in got["error"]
    assert any("about to fail" in line for line in got["logs"])
    assert got["status"] == "error" and got["step"] == "0"  # the first (and only) step


def test_a_private_registry_image_with_its_credentials(setup: Setup) -> None:
    """`from_image(..., username=, password=)`: the builder pulls with them (the control:
    the same image without them fails at its base, with the registry's refusal in the log)
    and they are kept nowhere. `min_free_disk_mb` sizes the template's file system."""
    got = e2b(
        setup,
        """
        image = os.environ["PRIVATE_IMAGE"]
        Template.build(Template().from_image(image, username="puller", password="s3cret")
                       .run_cmd("echo pulled > pulled.txt"), "from-private",
                       min_free_disk_mb=1024)
        sb = Sandbox.create("from-private")
        pulled = sb.files.read("/home/user/pulled.txt")
        blocks, size = sb.commands.run("stat -f -c '%a %S' /").stdout.split()
        sb.kill()
        logs = []
        try:
            Template.build(Template().from_image(image).run_cmd("true"), "no-password",
                           on_build_logs=lambda e: logs.append(e.message))
            refused = None
        except BuildException as exc:
            refused = str(exc)
        print(json.dumps({"pulled": pulled, "refused": refused, "logs": logs,
                          "free_mib": int(blocks) * int(size) >> 20}))
        """,
    )
    assert got["pulled"] == "pulled\n"
    assert got["free_mib"] >= 900  # min_free_disk_mb=1024, less the file system's own
    assert got["refused"] and any("unauthorized" in line.lower() for line in got["logs"])
    stored = [f.read_bytes() for f in setup.daemon.data_dir.glob("cella.db*")]
    assert stored and not any(b"s3cret" in data for data in stored)  # its build's alone


def test_what_cella_cannot_build_is_refused_by_name(setup: Setup) -> None:
    got = e2b(
        setup,
        """
        def refusal(template):
            try:
                Template.build(template, "refused")
            except Exception as exc:
                return type(exc).__name__ + ": " + str(exc)
        print(json.dumps({
            "aws": refusal(Template().from_aws_registry(os.environ["IMAGE"], "AKIA", "k", "r")),
            "base": refusal(Template().from_template("base").run_cmd("true")),
        }))
        """,
    )
    assert "BuildException" in got["aws"] and "fromImageRegistry of type 'aws'" in got["aws"]
    assert "BuildException" in got["base"] and "fromTemplate 'base'" in got["base"]


def test_a_template_is_deleted_once_no_sandbox_uses_it(setup: Setup, built: dict[str, Any]) -> None:
    head = {"X-API-KEY": setup.daemon.admin_key}
    gone = httpx2.delete(f"{setup.daemon.url}/templates/web-app", headers=head, timeout=60)
    assert gone.status_code == 204, gone.text
    again = httpx2.delete(f"{setup.daemon.url}/templates/web-app", headers=head, timeout=60)
    assert again.status_code == 404 and again.json()["code"] == 404
    listed = httpx2.get(f"{setup.daemon.url}/templates", headers=head, timeout=60)
    assert all(t["names"] != ["web-app"] for t in listed.json())
