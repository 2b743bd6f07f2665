"""Snapshots from images through the pinned LangSmith SDK, against a real daemon: registries
(credentials kept per tenant, never returned), `create_snapshot` from a TLS registry on
loopback with and without credentials (an htpasswd-protected one for the registry), an
image built in a sandbox's own Docker taken out by `capture_snapshot(docker_image=...)`,
and `create_snapshot_from_dockerfile` told plainly what it lacks; a snapshot built from an image
boots on a node of another host, which has never seen the image."""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import json
import re
import shutil
import socket
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import pytest
from langsmith.sandbox import (
    AsyncSandboxClient,
    ResourceCreationError,
    ResourceNotFoundError,
    SandboxClient,
    SandboxClientError,
)
from langsmith.sandbox._client import _make_dockerfile_build_command

from cella import Client
from cella.images.templates import builtin_templates, template_image
from cella.paths import Paths
from cella.storage.overlay import backing_file
from tests.daemon import Daemon, DaemonFactory
from tests.netservers import TestCA, free_loopback_block
from tests.oci_images import Registry, busybox_image

pytestmark = [pytest.mark.vm, pytest.mark.timeout(1500)]
WAIT = 900  # seconds the SDK polls a build for (TCG boots are slow)
# sandboxes (the builders that pull) reach the registries on loopback only by these names,
# which the operator maps (`egress_hosts`): a tenant's pull stays inside the boundary
PUBLIC, PRIVATE = "public.registry.test", "private.registry.test"


@dataclass
class Registries:
    public: Registry
    private: Registry
    busybox: str  # on the public registry
    private_busybox: str  # on the htpasswd-protected one (puller / s3cret)


@pytest.fixture(scope="module")
def registries(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Registries]:
    root = tmp_path_factory.mktemp("ls-images")
    layout = root / "layout"
    busybox_image(layout)
    prefix = free_loopback_block()
    ca = TestCA(root / "ca", [PUBLIC, PRIVATE, f"{prefix}.1", f"{prefix}.2"])
    public = Registry(root / "public", f"{prefix}.1", ca, name=PUBLIC)
    hashed = subprocess.run(
        ["/usr/bin/python3", "-W", "ignore", "-c",
         "import crypt; print(crypt.crypt('s3cret', crypt.mksalt(crypt.METHOD_BLOWFISH)))"],
        check=True, capture_output=True, text=True,
    ).stdout.strip()  # fmt: skip
    (root / "htpasswd").write_text(f"puller:{hashed}\n")
    private = Registry(
        root / "private", f"{prefix}.2", ca, htpasswd=root / "htpasswd", name=PRIVATE
    )
    try:
        yield Registries(
            public,
            private,
            busybox=public.push(f"oci:{layout}:busybox", "busybox:1"),
            private_busybox=private.push(
                f"oci:{layout}:busybox", "team/busybox:1", creds="puller:s3cret"
            ),
        )
    finally:
        public.close()
        private.close()


@pytest.fixture(scope="module")
def daemon(registries: Registries, module_daemon_factory: DaemonFactory) -> Daemon:
    return module_daemon_factory(
        "ls-images-daemon",
        pool_size="0",
        extra_ca_certificates=json.dumps([str(registries.public.ca.cert)]),
        egress_hosts=json.dumps({PUBLIC: registries.public.addr, PRIVATE: registries.private.addr}),
    )


def sdk(daemon: Daemon, key: str) -> SandboxClient:
    return SandboxClient(api_endpoint=f"{daemon.url}/api/v2/sandboxes", api_key=key)


@pytest.fixture(scope="module")
def client(daemon: Daemon) -> Iterator[SandboxClient]:
    with sdk(daemon, daemon.admin_key) as c:
        yield c


@pytest.fixture(scope="module")
def other(daemon: Daemon, admin: Client) -> Iterator[SandboxClient]:
    """Another tenant's client."""
    with sdk(daemon, admin.create_key("ls-images-other")["key"]) as c:
        yield c


def test_registries_keep_credentials_per_tenant(
    client: SandboxClient, other: SandboxClient, registries: Registries, daemon: Daemon
) -> None:
    made = client.registries.create(
        name="team", url=registries.private.host, username="puller", password="s3cret"
    )
    assert made.id and made.name == "team" and made.url == registries.private.host
    assert made.auth_type == "DOCKER_CONFIG"
    try:
        got = client.registries.retrieve("team")
        assert got.id == made.id
        listed = client.registries.list()
        assert [r.name for r in listed.items or []] == ["team"]
        # the password is in no answer: not the SDK's, not cella's own API
        raw = httpx.get(
            f"{daemon.url}/api/v2/sandboxes/registries",
            headers={"X-Api-Key": daemon.admin_key},
        ).text
        own = httpx.get(
            f"{daemon.url}/v1/registries", headers={"Authorization": f"Bearer {daemon.admin_key}"}
        )
        assert own.status_code == 200 and own.json()["registries"][0]["name"] == "team"
        assert "s3cret" not in raw and "s3cret" not in own.text and "password" not in own.text
        # another tenant does not see it, by name or in a list; the owner does (above)
        with pytest.raises(Exception, match=r"404|not found"):
            other.registries.retrieve("team")
        assert (other.registries.list().items or []) == []
        with pytest.raises(Exception, match=r"404|not found"):
            other.registries.delete("team")

        # async, the same registry
        async def listed_async() -> list[str]:
            async with AsyncSandboxClient(
                api_endpoint=f"{daemon.url}/api/v2/sandboxes", api_key=daemon.admin_key
            ) as a:
                page = await a.registries.list(name_contains="tea")
                return [r.name or "" for r in page.items or []]

        assert asyncio.run(listed_async()) == ["team"]
        # what cella cannot do is said: an AWS role; a half pair of credentials is refused
        with pytest.raises(Exception, match=r"AWS_ROLE"):
            client.registries.create(name="ecr", url="ecr.example", auth_type="AWS_ROLE")
        with pytest.raises(Exception, match=r"together"):
            client.registries.create(name="half", url="half.example", username="only")
        assert [r.name for r in client.registries.list().items or []] == ["team"]
    finally:
        client.registries.delete("team")
    with pytest.raises(Exception, match=r"404|not found"):
        client.registries.retrieve("team")


def test_private_image_needs_the_registrys_credentials(
    client: SandboxClient,
    other: SandboxClient,
    registries: Registries,
    admin: Client,
    daemon: Daemon,
) -> None:
    good = client.registries.create(
        name="private", url=registries.private.host, username="puller", password="s3cret"
    )
    wrong = client.registries.create(
        name="wrong", url=registries.private.host, username="puller", password="nope"
    )
    theirs = other.registries.create(
        name="theirs", url=registries.private.host, username="puller", password="s3cret"
    )
    elsewhere = client.registries.create(name="elsewhere", url=registries.public.host)
    image = registries.private_busybox
    try:
        # without credentials, and with wrong ones, the registry refuses the pull
        with pytest.raises(ResourceCreationError, match=r"(?i)unauthorized|authentication"):
            client.create_snapshot("no-login", image, 1 << 30, timeout=WAIT)
        with pytest.raises(ResourceCreationError, match=r"(?i)unauthorized|authentication"):
            client.create_snapshot("bad-login", image, 1 << 30, registry_id=wrong.id, timeout=WAIT)
        # another tenant's registry is not found; a registry of another host is refused
        with pytest.raises(SandboxClientError, match=r"(?i)not found"):
            client.create_snapshot("theirs", image, 1 << 30, registry_id=theirs.id, timeout=WAIT)
        with pytest.raises(SandboxClientError, match=r"is not on the registry"):
            client.create_snapshot("mixed", image, 1 << 30, registry_id=elsewhere.id)
        # the control: the right credentials build it
        snap = client.create_snapshot(
            "private-bb", image, 1 << 30, registry_id=good.id, timeout=WAIT
        )
        assert snap.status == "ready" and snap.name == "private-bb"
        assert client.get_snapshot("private-bb:1").id == snap.id  # the image's own tag
        with client.sandbox(snapshot="private-bb:1", timeout=120) as sb:
            # the image's USER, WORKDIR and ENV; its upper layer's file
            r = sb.run("echo $(id -u) $(pwd) $FOO; cat hello.txt", shell="/bin/sh")
            assert r.exit_code == 0, r.stderr
            assert r.stdout.split("\n")[0] == "1000 /app bar"
            assert "from the upper layer" in r.stdout
        # another tenant: not its snapshot, nor its template by name
        with pytest.raises(ResourceNotFoundError):
            other.get_snapshot(snap.id)
        assert snap.id not in [s.id for s in other.list_snapshots()]
        with pytest.raises(SandboxClientError, match=r"(?i)not found|no snapshot"):
            other.create_sandbox(snapshot=snap.id, timeout=60)
        template = admin.get_snapshot(snap.id).info.template
        assert template.startswith("img-")
        assert template in [t.name for t in admin.templates()]
        with daemon.client(other._api_key) as cella_other:
            assert template not in [t.name for t in cella_other.templates()]
            with pytest.raises(Exception, match=r"unknown template"):
                cella_other.create(template=template)
        client.delete_snapshot(snap.id)
        assert template not in [t.name for t in admin.templates()]  # its template went too
    finally:
        for name in ("private", "wrong", "elsewhere"):
            client.registries.delete(name)
        other.registries.delete("theirs")


def test_public_image_without_credentials_async(daemon: Daemon, registries: Registries) -> None:
    async def build() -> tuple[str, str]:
        async with AsyncSandboxClient(
            api_endpoint=f"{daemon.url}/api/v2/sandboxes", api_key=daemon.admin_key
        ) as a:
            snap = await a.create_snapshot(
                "public-bb", registries.busybox, 1 << 30, tag="v1",
                run_config={"user": "0", "env_vars": {"EXTRA": "yes"}}, timeout=WAIT,
            )  # fmt: skip
            async with await a.sandbox(snapshot="public-bb:v1", timeout=120) as sb:
                r = await sb.run("echo $(id -u) $FOO $EXTRA", shell="/bin/sh")
            await a.delete_snapshot(snap.id)
            return snap.status, r.stdout.strip()

    status, out = asyncio.run(build())
    assert status == "ready" and out == "0 bar yes"


def test_a_tenants_pull_stays_inside_the_boundary(
    client: SandboxClient, registries: Registries, daemon: Daemon
) -> None:
    """The host never connects where a tenant says: the pull runs in a builder sandbox
    behind the egress proxy. A registry at an address outside the boundary (the same
    registry by its loopback address, the daemon's own port, a metadata service) is refused
    at once; a name that resolves inside it is refused when the builder connects. The
    control is the same registry by the name the operator maps, which builds (the tests
    around this one)."""
    by_address = registries.busybox.replace(PUBLIC, registries.public.addr)
    port = urlsplit(daemon.url).port
    for image in (by_address, f"127.0.0.1:{port}/v1/x:1", "169.254.169.254/latest:1"):
        with pytest.raises(SandboxClientError, match=r"outside the egress boundary") as no:
            client.create_snapshot("outside", image, 1 << 30, timeout=WAIT)
        assert "ResourceCreation" not in type(no.value).__name__  # refused, never started
    # a name of this host that resolves to its loopback (from /etc/hosts): only the proxy,
    # resolving it when the builder connects, can tell
    name = _loopback_name()
    with pytest.raises(ResourceCreationError) as failed:
        client.create_snapshot("by-name", f"{name}:{port}/v1/x:1", 1 << 30, timeout=WAIT)
    said = str(failed.value)
    assert re.search(r"(?i)egress|forbidden|not public|refused", said), said
    assert "detail" not in said  # nothing of the daemon's own answer comes back
    assert not [s for s in client.list_snapshots() if s.name in ("outside", "by-name")
                and s.status == "ready"]  # fmt: skip


def test_an_image_snapshot_boots_on_a_node_of_another_host(
    client: SandboxClient,
    admin: Client,
    daemon: Daemon,
    registries: Registries,
    module_daemon_factory: DaemonFactory,
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """A snapshot built from an image holds its whole disk: a node that has only the
    snapshot's files and the kernel boots it, with the image's files, USER, WORKDIR and ENV.

    Another host, on one machine: a second daemon in a mount namespace of its own, where the
    image cache every daemon of this machine shares (kernel, template bases, warm snapshots)
    is a fresh directory holding only what such a host has of its own: the same guest kernel
    (copied), the egress proxy's environment (bound in: it holds no image), the host's
    accelerator answer and the built-in default template's base (bound in read-only: such a
    host builds its own with `cella setup`), of which it makes its own warm snapshot when
    it starts. It has none of the first daemon's image templates, image bases or warm
    snapshots (checked through its own root below). The snapshot moves as a fleet ships one:
    the node pulls its files from the first over HTTP (`POST /v1/snapshots/import`), each
    checked against the manifest. Before the disk stood alone, this import answered 503
    `image_missing` (the disk sat on the image's warm snapshot in the first one's cache)."""
    snap = client.create_snapshot("anywhere", registries.busybox, 1 << 30, timeout=WAIT)
    try:
        disk = daemon.data_dir / "snapshots" / snap.id / "disk.qcow2"
        assert backing_file(disk) is None  # nothing of this node's image cache under it
        template = admin.get_snapshot(snap.id).info.template

        images = Paths.default().images
        own = tmp_path_factory.mktemp("other-host") / "images"
        shutil.copytree(images / "kernel", own / "kernel")
        (own / "egress").mkdir()
        for probe in images.glob("accel-*.json"):
            shutil.copy(probe, own / probe.name)
        default = template_image(Paths.default(), builtin_templates()["default"])
        (own / "templates").mkdir()
        (own / "templates" / default.name).touch()
        mounts = (
            f"mount --bind {images}/egress {own}/egress && "
            f"mount --bind -o ro {default} {own}/templates/{default.name} && "
            f"mount --rbind {own} {images}"
        )
        there = module_daemon_factory(
            "other-host",
            wrap=["unshare", "-m", "sh", "-c", f'{mounts} && exec "$@"', "-"],
            timeout=300,  # it compiles its own agent and jailer first
            pool_size="0",
        )
        assert there.proc is not None
        seen = Path(f"/proc/{there.proc.pid}/root") / str(images).lstrip("/")
        assert (seen / "kernel" / "vmlinux").exists()
        assert [t.name for t in (seen / "templates").iterdir()] == [default.name]  # no image's
        assert not list(seen.glob(f"snapshots/{template}-*"))
        assert list(images.glob(f"snapshots/{template}-*"))  # the first one's view: there
        with there.client() as cella_there:
            assert template not in [t.name for t in cella_there.templates()]

        moved = httpx.post(
            f"{there.url}/v1/snapshots/import",
            headers={"authorization": f"Bearer {there.admin_key}"},
            json={"source_url": daemon.url, "source_key": daemon.admin_key,
                  "snapshot_id": snap.id},
            timeout=300,
        )  # fmt: skip
        assert moved.status_code == 201, moved.text
        with sdk(there, there.admin_key) as far:
            far_snap = far.get_snapshot(snap.id)
            assert far_snap.status == "ready"
            assert far_snap.fs_capacity_bytes == snap.fs_capacity_bytes > 0  # its disk's size
            with far.sandbox(snapshot="anywhere", timeout=300) as sb:
                r = sb.run("echo $(id -u) $(pwd) $FOO; cat hello.txt", shell="/bin/sh")
                assert r.exit_code == 0, r.stderr
                assert r.stdout.split("\n")[0] == "1000 /app bar"
                assert "from the upper layer" in r.stdout  # the image's file, baked in
            far.delete_snapshot(snap.id)
    finally:
        client.delete_snapshot(snap.id)


def _loopback_name() -> str:
    for name in (socket.gethostname(), "vm", "runsc"):
        with contextlib.suppress(OSError):
            if ipaddress.ip_address(socket.gethostbyname(name)).is_loopback and name != "localhost":
                return name
    pytest.skip("no name of this host resolves to its loopback")


def test_capture_an_image_from_the_sandboxs_docker(
    client: SandboxClient, other: SandboxClient, admin: Client
) -> None:
    box = admin.create(template="docker", name="dockerbox")
    try:
        made = box.exec(
            "mkdir -p /var/tmp/r/etc && echo made in docker > /var/tmp/r/etc/marker && "
            "tar -C /var/tmp/r -c . | docker import - mine:1",
            user="root",
        )
        assert made.exit_code == 0, made.stderr
        # another tenant cannot capture this sandbox; a missing image fails the build
        with pytest.raises(ResourceNotFoundError):
            other.capture_snapshot("dockerbox", "stolen", docker_image="mine:1", timeout=WAIT)
        with pytest.raises(ResourceCreationError, match=r"docker save"):
            client.capture_snapshot("dockerbox", "nothing", docker_image="absent:1", timeout=WAIT)
        snap = client.capture_snapshot(
            "dockerbox", "from-docker", docker_image="mine:1", timeout=WAIT
        )
        assert snap.status == "ready"
        with client.sandbox(snapshot="from-docker", timeout=120) as sb:
            assert sb.read("/etc/marker") == b"made in docker\n"
        client.delete_snapshot(snap.id)
    finally:
        box.delete()


def test_dockerfile_build_names_the_missing_buildkit(client: SandboxClient, tmp_path: Path) -> None:
    (tmp_path / "Dockerfile").write_text("FROM scratch\n")
    with pytest.raises(SandboxClientError, match=r"buildkitd") as refused:
        client.create_snapshot_from_dockerfile(
            "from-dockerfile", tmp_path / "Dockerfile", context=tmp_path, timeout=300
        )
    assert "not supported by cella" in str(refused.value)
    assert "from-dockerfile" not in [s.name for s in client.list_snapshots()]
    # the control: the same script runs unchanged where the tools are (stand-ins here that
    # log how they were called), and a command that only names them is never probed
    script = _make_dockerfile_build_command(
        remote_context="/var/tmp/ctx", dockerfile_rel="Dockerfile", image_ref="probe:1",
        buildkit_root="/var/tmp/bk-root", buildkit_run="/var/tmp/bk-run",
        build_args=None, target=None,
    )  # fmt: skip
    with client.sandbox(timeout=120) as sb:
        r = sb.run("echo buildkitd --addr x; command -v buildkitd || echo none")
        assert r.exit_code == 0 and r.stdout.split() == ["buildkitd", "--addr", "x", "none"]
        with pytest.raises(SandboxClientError, match="buildkitd"):
            sb.run(script)
        stubs = (
            "cd /usr/local/bin && "
            "printf '#!/bin/sh\\nexec sleep 600\\n' > buildkitd && "
            "printf '#!/bin/sh\\necho buildctl \\\"$*\\\" >> /var/tmp/calls\\n' > buildctl && "
            "printf '#!/bin/sh\\nexit 0\\n' > buildkit-runc && "
            'printf \'#!/bin/sh\\n[ \\"$1\\" = load ] && cat >/dev/null\\n'
            "echo docker $1 >> /var/tmp/calls\\n' > docker && "
            "chmod 755 buildkitd buildctl buildkit-runc docker"
        )
        assert sb.run(stubs).exit_code == 0
        ran = sb.run(script, timeout=120)
        assert ran.exit_code == 0, ran.stdout + ran.stderr
        calls = sb.run("cat /var/tmp/calls").stdout
        assert "buildctl --addr unix:///var/tmp/bk-run/buildkitd.sock build" in calls, calls
        assert "docker load" in calls, calls


def test_cella_cli_registry_and_snapshot_from_image(daemon: Daemon, registries: Registries) -> None:
    """cella's own equivalents: `cella registry` (the password on stdin, never printed) and
    `cella snapshot from-image --registry`, which waits for the build; then a fork of it."""

    def cli(*args: str, stdin: str = "") -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "cella.cli", *args],
            env=daemon.env(None),
            input=stdin,
            capture_output=True,
            text=True,
            timeout=900,
        )

    added = cli("registry", "add", "cli-reg", "--url", registries.private.host,
                "--username", "puller", "--json", stdin="s3cret\n")  # fmt: skip
    assert added.returncode == 0, added.stderr
    try:
        listed = cli("registry", "ls", "--json")
        assert [r["name"] for r in json.loads(listed.stdout)] == ["cli-reg"]
        assert "s3cret" not in listed.stdout + added.stdout
        # without the registry the pull is refused and the command says so
        failed = cli("snapshot", "from-image", "cli-nologin", registries.private_busybox)
        assert failed.returncode == 1 and "failed" in failed.stdout + failed.stderr
        made = cli("snapshot", "from-image", "cli-bb", registries.private_busybox,
                   "--registry", "cli-reg", "--json")  # fmt: skip
        assert made.returncode == 0, made.stderr
        snap = json.loads(made.stdout)
        assert snap["state"] == "ready" and snap["template"].startswith("img-")
        forked = cli("snapshot", "fork", snap["id"], "--json")
        assert forked.returncode == 0, forked.stderr
        [box] = json.loads(forked.stdout)
        with daemon.client() as admin:
            sb = admin.get(box["id"])
            r = sb.exec("cat /app/hello.txt")
            assert r.exit_code == 0 and r.stdout == b"from the upper layer\n"
            sb.delete()
        assert cli("snapshot", "rm", snap["id"]).returncode == 0
    finally:
        assert cli("registry", "rm", "cli-reg").returncode == 0
    assert json.loads(cli("registry", "ls", "--json").stdout) == []
