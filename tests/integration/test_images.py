"""OCI/Docker images as templates: built from a TLS registry on loopback, a `docker save`
archive and an OCI layout (images made offline here), then booted as microVMs."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from cella import Client, errors
from cella.models import EgressDecision
from cella.paths import Paths
from tests.daemon import Daemon, DaemonFactory
from tests.netservers import TestCA, free_loopback_block
from tests.oci_images import (
    Registry,
    busybox_image,
    hostile_nested_image,
    hostile_tmp_image,
    many_files_image,
    sparse_image,
    static_image,
)

pytestmark = [pytest.mark.vm, pytest.mark.timeout(900)]


@dataclass
class Images:
    layout: Path
    registry: Registry
    private: Registry
    ca: TestCA
    busybox: str  # the registry reference, as the host sees it
    private_busybox: str
    static_archive: Path  # a `docker save`-style archive
    host_dir: Path  # stands for the host's /etc: hostile images link to it
    host_file: Path  # and to this, standing for /etc/hosts
    hostile: dict[str, str]  # name -> registry reference


FILE_LIMIT = 1000  # the image daemon's image_max_files
UNPACKED_MIB = 64  # and its image_max_unpacked_mib


@pytest.fixture(scope="module")
def images(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Images]:
    root = tmp_path_factory.mktemp("images")
    layout = root / "layout"
    busybox_image(layout)
    static_image(layout)
    host_dir, host_file = root / "host-etc", root / "host-hosts"
    host_dir.mkdir()
    host_dir.chmod(0o755)
    host_file.write_text("the host's own\n")
    hostile_tmp_image(layout, host_dir, host_file, "hostile-tmp")
    hostile_nested_image(layout, host_dir, host_file, "hostile-nested")
    many_files_image(layout, FILE_LIMIT + 200, "many-files")
    many_files_image(layout, FILE_LIMIT - 200, "fewer-files")
    sparse_image(layout, 10 << 30, "sparse")
    prefix = free_loopback_block()
    ca = TestCA(root / "ca", ["registry.test", "private.test", f"{prefix}.1", f"{prefix}.2"])
    registry = Registry(root / "registry", f"{prefix}.1", ca)
    hashed = subprocess.run(
        ["/usr/bin/python3", "-W", "ignore", "-c",
         "import crypt; print(crypt.crypt('s3cret', crypt.mksalt(crypt.METHOD_BLOWFISH)))"],
        check=True, capture_output=True, text=True,
    ).stdout.strip()  # fmt: skip
    (root / "htpasswd").write_text(f"puller:{hashed}\n")
    private = Registry(root / "private", f"{prefix}.2", ca, htpasswd=root / "htpasswd")
    archive = root / "static.tar"
    subprocess.run(
        ["skopeo", "copy", "--quiet", f"oci:{layout}:static", f"docker-archive:{archive}:static:1"],
        check=True,
        capture_output=True,
    )
    try:
        yield Images(
            layout,
            registry,
            private,
            ca,
            busybox=registry.push(f"oci:{layout}:busybox", "busybox:1"),
            private_busybox=private.push(
                f"oci:{layout}:busybox", "team/busybox:1", creds="puller:s3cret"
            ),
            static_archive=archive,
            host_dir=host_dir,
            host_file=host_file,
            hostile={
                tag: registry.push(f"oci:{layout}:{tag}", f"{tag}:1")
                for tag in ("hostile-tmp", "hostile-nested", "many-files", "fewer-files", "sparse")
            },
        )
    finally:
        registry.close()
        private.close()


@pytest.fixture(scope="module")
def daemon(images: Images, module_daemon_factory: DaemonFactory) -> Daemon:
    hosts = {"registry.test": images.registry.addr, "private.test": images.private.addr}
    return module_daemon_factory(
        "image-daemon",
        pool_size="0",
        extra_ca_certificates=json.dumps([str(images.ca.cert)]),
        egress_hosts=json.dumps(hosts),
        image_max_files=str(FILE_LIMIT),
        image_max_unpacked_mib=str(UNPACKED_MIB),
    )


# what this module builds: templates live in the host's image directory, beside the daemon
MADE = ["bb", "bb2", "static", "bb-layout", "private", "mine", "doomed", "bb-cli",
        "from-dockerfile", "hostile-tmp", "hostile-nested", "many-files", "fewer-files",
        "sparse", "links-out"]  # fmt: skip


@pytest.fixture(scope="module")
def admin(admin: Client) -> Iterator[Client]:
    remove_templates(admin)  # an earlier run's, so every build here starts from nothing
    yield admin
    remove_templates(admin)


def remove_templates(c: Client) -> None:
    for name in MADE:
        with contextlib.suppress(errors.NotFound, errors.Conflict):
            c.delete_template(name)


@pytest.fixture(scope="module")
def busybox(admin: Client, images: Images) -> list[str]:
    """The busybox template, built once; its progress lines."""
    lines: list[str] = []
    admin.build_template("bb", images.busybox, on_progress=lines.append)
    return lines


def run(sb: object, argv: list[str] | str, **kw: object) -> tuple[int, str]:
    r = sb.exec(argv, **kw)  # type: ignore[attr-defined]
    return r.exit_code, (r.stdout + r.stderr).decode().strip()


def test_registry_image_becomes_a_template(admin: Client, busybox: list[str]) -> None:
    text = "\n".join(busybox)
    for step in ("fetching", "unpacking", "ext4 file system", "warm snapshot", "is ready"):
        assert step in text, text
    made = admin.get_template("bb")
    assert made.kind == "image" and made.built and made.digest and made.digest.startswith("sha256:")
    assert made.config.user == "app" and made.config.working_dir == "/app"
    assert {"fetch", "unpack", "filesystem", "snapshot"} <= set(made.seconds)
    assert "bb" in [t.name for t in admin.templates()]


def test_image_config_is_the_default_of_every_command(admin: Client, busybox: list[str]) -> None:
    with admin.create("bb") as sb:
        assert sb.info.exec_defaults.user == "app" and sb.info.exec_defaults.cwd == "/app"
        assert run(sb, ["id", "-u"]) == (0, "1000")
        assert run(sb, ["pwd"]) == (0, "/app")
        assert run(sb, "echo $FOO") == (0, "bar")
        # the command's own choices win
        assert run(sb, ["id", "-u"], user="root") == (0, "0")
        assert run(sb, ["pwd"], cwd="/tmp") == (0, "/tmp")
        assert run(sb, "echo $FOO", env={"FOO": "mine"}) == (0, "mine")


def test_layers_unpack_faithfully(admin: Client, busybox: list[str]) -> None:
    with admin.create("bb") as sb:
        assert run(sb, ["test", "-e", "/etc/doomed"])[0] == 1  # deleted by the upper layer
        assert run(sb, ["cat", "/app/hello.txt"]) == (0, "from the upper layer")
        code, out = run(sb, ["stat", "-c", "%i %h", "/data/a", "/data/b"], user="root")
        first, second = out.splitlines()
        assert code == 0 and first == second and first.endswith(" 2")  # one inode, two names
        assert run(sb, ["stat", "-c", "%a %u:%g", "/data/secret"]) == (0, "600 1000:1000")
        assert run(sb, ["cat", "/data/secret"], user="root")[0] == 0
        # the guest's root file system is its own: writes land in the sandbox's overlay
        assert run(sb, "echo x > /app/new && cat /app/new") == (0, "x")


def test_rebuild_of_the_same_digest_is_a_cache_hit(
    admin: Client, images: Images, busybox: list[str]
) -> None:
    before = admin.get_template("bb")
    lines: list[str] = []
    again = admin.build_template("bb", images.busybox, on_progress=lines.append)
    assert any("cache hit" in line for line in lines), lines
    assert not any("unpacking" in line for line in lines)
    assert again.digest == before.digest and again.built_at == before.built_at
    # the same image under another name shares the base too
    lines.clear()
    other = admin.build_template("bb2", images.busybox, on_progress=lines.append)
    assert any("cache hit" in line for line in lines) and other.digest == before.digest
    admin.delete_template("bb2")
    assert admin.get_template("bb").built  # the shared base stays for the other name


def test_image_without_shell_or_passwd_from_a_docker_archive(admin: Client, images: Images) -> None:
    made = admin.build_template("static", str(images.static_archive))
    assert made.config.user == "1234" and made.source == str(images.static_archive)
    with admin.create("static") as sb:
        assert run(sb, ["/hello"]) == (0, "uid=1234 cwd=/srv FOO=static")
        # a shell command has no shell to run in: a clear failure, not a hang
        with pytest.raises(errors.NotFound, match="cannot run /bin/sh"):
            sb.exec("echo hi")


def test_oci_layout_and_run_entrypoint(admin: Client, images: Images, busybox: list[str]) -> None:
    made = admin.build_template("bb-layout", f"oci:{images.layout}:busybox")
    assert made.digest == admin.get_template("bb").digest  # same image, however it came
    with admin.create("bb-layout", run_entrypoint=True) as sb:
        deadline = time.monotonic() + 60
        proc = sb.process("entrypoint")
        while "entrypoint as" not in proc.stdout and time.monotonic() < deadline:
            time.sleep(0.2)
            proc = sb.process("entrypoint")
        assert proc.running and proc.stdout.strip() == "entrypoint as 1000 in /app"
        assert [p.id for p in sb.processes()] == ["entrypoint"]
    with pytest.raises(errors.InvalidArgument, match="no image Entrypoint"):
        admin.create("default", run_entrypoint=True)


def test_private_registry_credentials_come_from_a_secret(admin: Client, images: Images) -> None:
    with pytest.raises(errors.BuildFailed, match="fetching"):
        admin.build_template("private", images.private_busybox)  # no credentials: refused
    assert "private" not in [t.name for t in admin.templates()]  # nothing half-made
    admin.put_secret("elsewhere", "puller:s3cret", ["registry.example"])
    with pytest.raises(errors.InvalidArgument, match="not bound to"):
        admin.build_template("private", images.private_busybox, registry_secret="elsewhere")
    admin.put_secret("registry-login", "puller:s3cret", [images.private.addr])
    made = admin.build_template("private", images.private_busybox, registry_secret="registry-login")
    assert made.built and made.config.user == "app"


def test_bad_builds_are_refused_and_leave_nothing(
    admin: Client, daemon: Daemon, busybox: list[str]
) -> None:
    with pytest.raises(errors.BuildFailed, match="fetching"):
        admin.build_template("nope", "127.0.0.1:9/missing/image:1")
    with pytest.raises(errors.InvalidArgument, match="built-in"):
        admin.build_template("default", "127.0.0.1:9/missing/image:1")
    with pytest.raises(errors.InvalidArgument):
        admin.build_template("Bad Name", "x/y:1")
    with pytest.raises(errors.InvalidArgument, match="not an image reference"):
        admin.build_template("nope", "justaword")
    assert "nope" not in [t.name for t in admin.templates()]
    assert not list((daemon.data_dir / "images" / "tmp").glob("image-*"))
    tenant = admin.create_key("someone")
    with daemon.client(tenant["key"]) as user:
        assert "bb" in [t.name for t in user.templates()]  # anyone lists, and uses
        with pytest.raises(errors.PermissionDenied):
            user.build_template("mine", "x/y:1")
        with pytest.raises(errors.PermissionDenied):
            user.delete_template("bb")


def test_template_in_use_is_not_removed(admin: Client, images: Images) -> None:
    admin.build_template("doomed", images.busybox)
    sb = admin.create("doomed")
    with pytest.raises(errors.Conflict, match="in use"):
        admin.delete_template("doomed")
    assert run(sb, ["cat", "/app/hello.txt"])[0] == 0
    sb.delete()
    admin.delete_template("doomed")
    assert "doomed" not in [t.name for t in admin.templates()]
    with pytest.raises(errors.InvalidArgument, match="unknown template"):
        admin.create("doomed")
    with pytest.raises(errors.NotFound):
        admin.delete_template("doomed")


def host_unchanged(images: Images) -> None:
    assert images.host_dir.stat().st_mode & 0o7777 == 0o755
    assert list(images.host_dir.iterdir()) == []
    assert images.host_file.read_text() == "the host's own\n"


@pytest.mark.hardening
def test_an_image_linking_to_the_host_changes_nothing_there(
    admin: Client, images: Images, busybox: list[str]
) -> None:
    """`tmp` links to a host directory, `etc/hosts` and `etc/resolv.conf` to a host file:
    the import prepares the image without following them, the guest keeps them as links."""
    admin.build_template("hostile-tmp", images.hostile["hostile-tmp"])
    host_unchanged(images)
    with admin.create("hostile-tmp") as sb:
        assert run(sb, ["busybox", "readlink", "/tmp"]) == (0, str(images.host_dir))
    with admin.create("bb") as sb:  # control: a real /tmp is opened to every user
        assert run(sb, ["stat", "-c", "%a", "/tmp"]) == (0, "1777")


@pytest.mark.hardening
def test_links_and_names_that_climb_out_stay_in_the_image(
    admin: Client, images: Images, busybox: list[str]
) -> None:
    admin.build_template("hostile-nested", images.hostile["hostile-nested"])
    host_unchanged(images)
    with admin.create("hostile-nested") as sb:  # where they landed: inside the guest's root

        def cat(path: str) -> tuple[int, str]:
            return run(sb, ["cat", path], user="root")  # (umoci made the parents 0700)

        assert cat(f"{images.host_dir}/planted") == (0, "written through the link")
        assert cat("/escaped") == (0, "a name that climbs")
        assert cat("/etc/hosts") == (0, "the image's own hosts")


@pytest.mark.hardening
def test_a_layer_bomb_is_refused_naming_the_limit(admin: Client, images: Images) -> None:
    with pytest.raises(errors.PayloadTooLarge, match=rf"image_max_files \({FILE_LIMIT}\)"):
        admin.build_template("many-files", images.hostile["many-files"])
    sparse = rf"image_max_unpacked_mib \({UNPACKED_MIB} MiB\)"  # 10 GiB in a few KiB of tar
    with pytest.raises(errors.PayloadTooLarge, match=sparse):
        admin.build_template("sparse", images.hostile["sparse"])
    names = [t.name for t in admin.templates()]
    assert "many-files" not in names and "sparse" not in names
    stages = [p.name for p in Paths.default().build_tmp.iterdir()]
    assert not [n for n in stages if n.startswith(("image-many-files-", "image-sparse-"))]
    made = admin.build_template("fewer-files", images.hostile["fewer-files"])  # control
    with admin.create("fewer-files") as sb:
        code, out = run(sb, ["ls", "/many"], user="root")
        assert code == 0 and len(out.split()) == FILE_LIMIT - 200
    assert made.built


def test_guests_trust_the_operators_extra_ca(admin: Client, images: Images) -> None:
    """The registry's certificate is signed by the extra CA only: a guest verifies it with
    curl, Python and git's variables; the same request with the stock roots fails."""
    with admin.create(allow=["registry.test"]) as sb:
        assert run(sb, "curl -sSf -o /dev/null -w '%{http_code}' https://registry.test/v2/")[1] == (
            "200"
        )
        py = "import urllib.request as u; print(u.urlopen('https://registry.test/v2/').status)"
        assert run(sb, ["python3", "-c", py]) == (0, "200")
        assert run(sb, "echo $REQUESTS_CA_BUNDLE $NODE_EXTRA_CA_CERTS $GIT_SSL_CAINFO")[1] == (
            " ".join(["/etc/ssl/certs/ca-certificates.crt"] * 3)
        )
        stock = "/usr/share/ca-certificates/mozilla/ISRG_Root_X1.crt"
        code, out = run(sb, f"curl -sS --cacert {stock} https://registry.test/v2/")
        assert code != 0 and "certificate" in out


def test_template_cli(daemon: Daemon, images: Images, busybox: list[str]) -> None:
    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "cella.cli", *args],
            env=daemon.env(None),
            capture_output=True,
            text=True,
            timeout=600,
        )

    built = cli("template", "build", "bb-cli", "--from-image", images.busybox, "--json")
    assert built.returncode == 0, built.stderr
    assert json.loads(built.stdout)["config"]["user"] == "app"
    assert "cache hit" in built.stderr  # progress goes to stderr, JSON alone to stdout
    listed = json.loads(cli("template", "ls", "--json").stdout)
    assert {"default", "bb", "bb-cli"} <= {t["name"] for t in listed}
    made = cli("sandbox", "create", "--template", "bb-cli", "--run-entrypoint", "--json")
    assert made.returncode == 0, made.stderr
    sandbox_id = json.loads(made.stdout)["id"]
    try:
        deadline = time.monotonic() + 60
        while "entrypoint as" not in (logs := cli("sandbox", "logs", sandbox_id)).stdout:
            assert time.monotonic() < deadline, logs.stderr
            time.sleep(0.3)
        assert logs.stdout.strip() == "entrypoint as 1000 in /app"
    finally:
        cli("sandbox", "rm", sandbox_id)
    bad = cli("template", "build", "x")
    assert bad.returncode != 0 and "--from-image" in bad.stderr
    assert cli("template", "rm", "bb-cli").returncode == 0


# -- Dockerfiles and Docker (the docker template) ----------------------------------------


def test_dockerfile_builds_in_a_builder_sandbox(
    admin: Client, images: Images, tmp_path: Path, busybox: list[str]
) -> None:
    context = tmp_path / "context"
    context.mkdir()
    (context / "message.txt").write_text("copied in\n")
    (context / "Dockerfile").write_text(
        "FROM registry.test/busybox:1\n"
        "USER root\n"
        "ENV GREETING=hello\n"
        "WORKDIR /work\n"
        "COPY message.txt /work/message.txt\n"
        'RUN echo "built by $(id -u)" > /work/built.txt && rm /app/hello.txt\n'
    )
    lines: list[str] = []
    made = admin.build_template_from_dockerfile(
        "from-dockerfile", context, allow=["registry.test"], on_progress=lines.append
    )
    text = "\n".join(lines)
    assert "builder sandbox" in text and "buildah" in text and "warm snapshot" in text
    assert made.kind == "dockerfile" and made.source and "context sha256:" in made.source
    assert made.config.env["GREETING"] == "hello" and made.config.working_dir == "/work"
    with admin.create("from-dockerfile") as sb:
        assert run(sb, ["cat", "message.txt"]) == (0, "copied in")
        assert run(sb, ["cat", "/work/built.txt"]) == (0, "built by 0")
        assert run(sb, ["test", "-e", "/app/hello.txt"])[0] == 1
        assert run(sb, "echo $GREETING from $(pwd)") == (0, "hello from /work")
    builders = [s for s in admin.list() if s.info.labels.get("cella.role") == "template-builder"]
    assert builders == []  # the builder sandbox is gone


def registry_decisions(admin: Client, template: str) -> list[EgressDecision]:
    """What the egress proxy decided for registry.test in the (deleted) builder of
    `template`."""
    labels = {"cella.role": "template-builder", "cella.template": template}
    (builder,) = admin.list(state="deleted", labels=labels)
    return [d for d in builder.egress() if d.host == "registry.test"]


def test_dockerfile_build_reaches_only_what_it_is_allowed(
    admin: Client, tmp_path: Path, busybox: list[str]
) -> None:
    """The same Dockerfile without the registry allowed fails at its FROM, and the
    builder's egress log shows why: the proxy refused the registry. With it allowed, the
    registry is reached and the build fails only at its own failing step."""
    (tmp_path / "Dockerfile").write_text("FROM registry.test/busybox:1\nRUN true\n")
    with pytest.raises(errors.BuildFailed, match="bud step failed"):
        admin.build_template_from_dockerfile("unreachable", tmp_path)
    tried = registry_decisions(admin, "unreachable")
    assert tried and not any(d.allowed for d in tried), tried
    (tmp_path / "Dockerfile").write_text("FROM registry.test/busybox:1\nRUN exit 3\n")
    with pytest.raises(errors.BuildFailed, match="bud step failed"):
        admin.build_template_from_dockerfile("failing", tmp_path, allow=["registry.test"])
    tried = registry_decisions(admin, "failing")  # control: the same way, allowed
    assert tried and all(d.allowed for d in tried), tried
    names = [t.name for t in admin.templates()]
    assert "unreachable" not in names and "failing" not in names
    with pytest.raises(errors.InvalidArgument, match="inside the context"):
        admin.build_template_from_dockerfile("x", tmp_path, dockerfile="../Dockerfile")


@pytest.mark.hardening
def test_a_dockerfile_image_linking_to_the_host_changes_nothing_there(
    admin: Client, images: Images, tmp_path: Path, busybox: list[str]
) -> None:
    """A Dockerfile build's image comes out of the builder and is imported the same way:
    its `tmp -> host directory` stays a link in the image."""
    (tmp_path / "Dockerfile").write_text(
        "FROM registry.test/busybox:1\nUSER root\n"
        f"RUN rm -rf /tmp && busybox ln -s {images.host_dir} /tmp\n"
    )
    admin.build_template_from_dockerfile("links-out", tmp_path, allow=["registry.test"])
    host_unchanged(images)
    with admin.create("links-out") as sb:
        assert run(sb, ["busybox", "readlink", "/tmp"]) == (0, str(images.host_dir))


def test_docker_runs_inside_a_sandbox(admin: Client, images: Images) -> None:
    """dockerd is up from the warm snapshot; `docker run` pulls through the egress proxy
    from an allowed registry; `docker build` works; a registry not allowed is refused and
    the refusal logged."""
    with admin.create("docker", allow=["registry.test"]) as sb:
        assert run(sb, ["docker", "info", "--format", "{{.ServerVersion}}"])[0] == 0
        r = sb.exec("docker run --rm registry.test/busybox:1 'echo hi from $(id -u)'", timeout=600)
        assert (r.exit_code, r.stdout) == (0, b"hi from 1000\n"), r.stderr
        build = (
            "mkdir -p /tmp/ctx && cd /tmp/ctx && "
            "printf 'FROM registry.test/busybox:1\\nRUN echo built > /home/app/b\\n' "
            "> Dockerfile && "
            "docker build -q -t two-line . >/dev/null && docker run --rm two-line 'cat /home/app/b'"
        )
        r = sb.exec(build, timeout=600)
        assert (r.exit_code, r.stdout) == (0, b"built\n"), r.stderr
        code, out = run(sb, "docker pull private.test/team/busybox:1", timeout=300)
        assert code != 0 and "private.test" in out, out
        denied = [d for d in sb.egress() if d.host.startswith("private.test") and not d.allowed]
        assert denied, [d.model_dump() for d in sb.egress()]


# -- the start-up walk beside a build ------------------------------------------------------


@contextlib.contextmanager
def churning(directory: Path) -> Iterator[None]:
    """Files open to others appear in `directory` and vanish again until the block ends."""
    stop = threading.Event()

    def churn() -> None:
        n = 0
        while not stop.is_set():
            f = directory / f"f{n % 64}"
            f.write_text("x")
            f.chmod(0o644)
            f.unlink(missing_ok=True)
            n += 1

    worker = threading.Thread(target=churn)
    worker.start()
    try:
        yield
    finally:
        stop.set()
        worker.join()


@pytest.mark.hardening
def test_a_daemon_starts_beside_a_template_build(
    tmp_path: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """A build's chroot in the shared image directory has /proc mounted in it (as
    `cella setup --template docker` does); the data directory, left open by an older
    version, holds /proc and a tmpfs mounted too, and files that vanish. The daemon starts,
    enters none of them, and still closes what is its own."""
    scratch = Paths.default().images / "tmp" / f"template-beside-{os.getpid()}"
    (scratch / "rootfs" / "proc").mkdir(parents=True)
    data = tmp_path / "data"
    for d in (data / "mounted" / "proc", data / "mounted" / "tmpfs", data / "churn"):
        d.mkdir(parents=True)
    for d in (data, data / "mounted", data / "mounted" / "proc", data / "churn"):
        d.chmod(0o755)
    (data / "left-open").write_text("made with an old umask")
    (data / "left-open").chmod(0o644)
    mounts = (
        f"mount --bind /proc {scratch}/rootfs/proc && "
        f"mount --bind /proc {data}/mounted/proc && "
        f"mount -t tmpfs -o mode=0755 beside {data}/mounted/tmpfs && "
        f"echo x > {data}/mounted/tmpfs/other && chmod 644 {data}/mounted/tmpfs/other"
    )
    wrap = ["unshare", "-m", "sh", "-c", f'{mounts} && exec "$@"', "-"]
    try:
        with churning(data / "churn"), DaemonFactory(tmp_path_factory) as daemons:
            d = daemons(data_dir=data, wrap=wrap, pool_size="0")
            assert d.proc is not None
            seen = Path(f"/proc/{d.proc.pid}/root")  # the daemon's mounts, as it sees them
            assert (seen / str(scratch).lstrip("/") / "rootfs" / "proc" / "self").exists()
            other = seen / str(data).lstrip("/") / "mounted" / "tmpfs" / "other"
            assert other.stat().st_mode & 0o777 == 0o644  # another file system: not entered
        assert (data / "left-open").stat().st_mode & 0o777 == 0o600  # control: its own closed
        assert data.stat().st_mode & 0o777 == 0o700
    finally:
        shutil.rmtree(scratch)
