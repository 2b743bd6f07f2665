"""OCI images made offline for tests (umoci, busybox-static, musl-gcc), and a TLS registry on
loopback (Debian's docker-registry) to push them to."""

from __future__ import annotations

import contextlib
import io
import os
import shutil
import ssl
import subprocess
import tarfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx2

from tests.netservers import TestCA

BUSYBOX = Path("/bin/busybox")
APPLETS = ["sh", "echo", "cat", "ls", "id", "pwd", "env", "sleep", "stat", "test", "rm",
           "mkdir", "touch", "wget", "true", "false", "head", "grep"]  # fmt: skip
HELLO_C = r"""
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>
int main(void) {
    char cwd[256];
    printf("uid=%d cwd=%s FOO=%s\n", (int)getuid(), getcwd(cwd, sizeof cwd), getenv("FOO"));
    return 0;
}
"""


def run(*argv: str | Path) -> None:
    subprocess.run([str(a) for a in argv], check=True, capture_output=True)


def new_image(layout: Path, tag: str) -> str:
    """An empty image `tag` in `layout` (made if missing); returns its umoci reference."""
    image = f"{layout}:{tag}"
    if not layout.exists():
        run("umoci", "init", "--layout", layout)
    run("umoci", "new", "--image", image)
    return image


@contextlib.contextmanager
def layer(image: str, scratch: Path) -> Iterator[Path]:
    """Unpacks `image` into `scratch`; what the block changes in the yielded root becomes
    one new layer on top."""
    bundle = scratch / "bundle"
    run("umoci", "unpack", "--image", image, bundle)
    try:
        yield bundle / "rootfs"
        run("umoci", "repack", "--image", image, bundle)
    finally:
        shutil.rmtree(bundle, ignore_errors=True)


def busybox_image(layout: Path, tag: str = "busybox") -> None:
    """Two layers: a busybox root with users, a hard link, modes and owners, and a file
    the second layer deletes (a whiteout). Env/WorkingDir/User and an entrypoint set."""
    image = new_image(layout, tag)
    with layer(image, layout.parent) as root:
        _busybox_root(root)
    with layer(image, layout.parent) as root:  # the second layer
        (root / "etc/doomed").unlink()
        (root / "app/hello.txt").write_text("from the upper layer\n")
    run("umoci", "config", "--image", image,
        "--config.env", "FOO=bar", "--config.env", "PATH=/bin",
        "--config.workingdir", "/app", "--config.user", "app",
        "--config.entrypoint", "/bin/sh", "--config.entrypoint", "-c",
        "--config.cmd", "echo entrypoint as $(id -u) in $(pwd); exec sleep 3600")  # fmt: skip


def _busybox_root(root: Path) -> None:
    for d in ("bin", "etc", "app", "home/app", "data", "tmp"):
        (root / d).mkdir(parents=True, exist_ok=True)
    shutil.copy2(BUSYBOX, root / "bin/busybox")
    for applet in APPLETS:
        (root / "bin" / applet).symlink_to("busybox")
    (root / "etc/passwd").write_text(
        "root:x:0:0:root:/root:/bin/sh\napp:x:1000:1000:app:/home/app:/bin/sh\n"
    )
    (root / "etc/group").write_text("root:x:0:\napp:x:1000:\n")
    (root / "etc/doomed").write_text("deleted in the upper layer\n")
    (root / "data/a").write_text("linked\n")
    os.link(root / "data/a", root / "data/b")
    (root / "data/secret").write_text("mode 0600, owned by app\n")
    (root / "data/secret").chmod(0o600)
    for path in (root / "data/secret", root / "app", root / "home/app"):
        os.chown(path, 1000, 1000)


def server_image(layout: Path, tag: str = "server") -> None:
    """Busybox with a web server (`httpd`) and what E2B's template builds use (`chown`,
    `chmod`, a `/bin/bash` that is busybox's shell), root its only user: the template
    build adds `user`. No Env, WorkingDir, User or entrypoint."""
    image = new_image(layout, tag)
    with layer(image, layout.parent) as root:
        for d in ("bin", "etc", "tmp", "home", "root"):
            (root / d).mkdir(parents=True, exist_ok=True)
        (root / "tmp").chmod(0o1777)
        shutil.copy2(BUSYBOX, root / "bin/busybox")
        for applet in [*APPLETS, "httpd", "chown", "chmod", "whoami", "tail", "id"]:
            if not (root / "bin" / applet).exists():
                (root / "bin" / applet).symlink_to("busybox")
        (root / "bin/bash").write_text('#!/bin/sh\nexec /bin/sh "$@"\n')
        (root / "bin/bash").chmod(0o755)
        (root / "etc/passwd").write_text("root:x:0:0:root:/root:/bin/sh\n")
        (root / "etc/group").write_text("root:x:0:\n")
    run("umoci", "config", "--image", image, "--config.env", "PATH=/bin")


def static_image(layout: Path, tag: str = "static") -> None:
    """One static musl binary and nothing else: no shell, no libc, no /etc/passwd."""
    image = new_image(layout, tag)
    source = layout.parent / "hello.c"
    source.write_text(HELLO_C)
    with layer(image, layout.parent) as root:
        (root / "srv").mkdir()
        run("musl-gcc", "-static", "-O2", "-o", root / "hello", source)
    run("umoci", "config", "--image", image, "--config.env", "FOO=static",
        "--config.workingdir", "/srv", "--config.user", "1234",
        "--config.cmd", "/hello")  # fmt: skip


@dataclass(frozen=True)
class Entry:
    """One member of a hand-made layer: a file, a directory, or a symbolic or hard link."""

    name: str
    type: bytes = tarfile.REGTYPE
    data: bytes = b""
    link: str = ""


def write_tar(archive: Path, entries: list[Entry]) -> None:
    with tarfile.open(archive, "w", format=tarfile.PAX_FORMAT) as tar:
        for e in entries:
            info = tarfile.TarInfo(e.name)
            info.type = e.type
            info.linkname = e.link
            info.mode = 0o755 if e.type in (tarfile.DIRTYPE, tarfile.SYMTYPE) else 0o644
            info.size = len(e.data) if e.type == tarfile.REGTYPE else 0
            tar.addfile(info, io.BytesIO(e.data) if info.size else None)


def add_layer(image: str, entries: list[Entry], scratch: Path) -> None:
    """Appends a layer whose tar archive holds exactly `entries`, as written (names and
    link targets included: nothing is cleaned up on the way)."""
    archive = scratch / "layer.tar"
    write_tar(archive, entries)
    try:
        run("umoci", "raw", "add-layer", "--image", image, archive)
    finally:
        archive.unlink()


def on_busybox(layout: Path, tag: str) -> str:
    """A new image `tag` that starts as the busybox image (made first by busybox_image)."""
    run("umoci", "tag", "--image", f"{layout}:busybox", tag)
    return f"{layout}:{tag}"


def hostile_tmp_image(layout: Path, host_dir: Path, host_file: Path, tag: str) -> None:
    """Busybox whose `tmp` is a link to a host directory and whose `etc/hosts` and
    `etc/resolv.conf` are links to a host file: what the import prepares or writes there
    must stay in the image."""
    image = on_busybox(layout, tag)
    add_layer(image, [
        Entry("tmp", tarfile.SYMTYPE, link=str(host_dir)),
        Entry("etc/hosts", tarfile.SYMTYPE, link=str(host_file)),
        Entry("etc/resolv.conf", tarfile.SYMTYPE, link=str(host_file)),
    ], layout.parent)  # fmt: skip


def hostile_nested_image(layout: Path, host_dir: Path, host_file: Path, tag: str) -> None:
    """Busybox with a link that climbs out by `a/../..` to a host directory, and a second
    layer that writes through it, replaces a link to a host file and names a path that
    climbs out by itself."""
    image = on_busybox(layout, tag)
    climb = "a/../../../../../../.." + str(host_dir)
    add_layer(image, [
        Entry("a", tarfile.DIRTYPE),
        Entry("up", tarfile.SYMTYPE, link=climb),
        Entry("etc/hosts", tarfile.SYMTYPE, link=str(host_file)),
    ], layout.parent)  # fmt: skip
    add_layer(image, [
        Entry("up/planted", data=b"written through the link\n"),
        Entry("etc/hosts", data=b"the image's own hosts\n"),
        Entry("a/../../escaped", data=b"a name that climbs\n"),
    ], layout.parent)  # fmt: skip


def many_files_image(layout: Path, files: int, tag: str) -> None:
    """Busybox with a layer of `files` empty files."""
    image = on_busybox(layout, tag)
    add_layer(image, [Entry(f"many/{i}") for i in range(files)], layout.parent)


def sparse_image(layout: Path, size: int, tag: str) -> None:
    """Busybox with a layer holding one sparse file of `size` bytes (a few KiB of tar)."""
    image = on_busybox(layout, tag)
    work = layout.parent / f"sparse-{tag}"
    work.mkdir()
    try:
        with open(work / "hole", "wb") as f:
            f.truncate(size)
        run("tar", "--sparse", "--format=posix", "-cf", work / "layer.tar", "-C", work, "hole")
        run("umoci", "raw", "add-layer", "--image", image, work / "layer.tar")
    finally:
        shutil.rmtree(work)


def escaping_archive(archive: Path, host_dir: Path, levels: int = 8) -> None:
    """An "OCI archive" whose links each stay inside on paper (`e1 -> s/..` with `s -> .`)
    but chain, on disk, `levels` directories above wherever it is unpacked; then a file
    written through the chain into `host_dir`."""
    entries = [Entry("s0", tarfile.SYMTYPE, link=".")]
    for i in range(1, levels + 1):
        entries.append(Entry(f"e{i}", tarfile.SYMTYPE, link=f"s{i - 1}/.."))
        entries.append(Entry(f"s{i}", tarfile.SYMTYPE, link=f"e{i}/."))
    entries.append(Entry(f"e{levels}{host_dir}/planted", data=b"written out of the archive\n"))
    entries.append(Entry("oci-layout", data=b'{"imageLayoutVersion": "1.0.0"}'))
    entries.append(Entry("index.json", data=b'{"schemaVersion": 2, "manifests": []}'))
    write_tar(archive, entries)


class Registry:
    """Debian's docker-registry serving TLS on `addr:443` with a certificate from `ca`;
    references name it `name` when given (a sandbox reaches it by a name the operator maps)."""

    def __init__(
        self,
        directory: Path,
        addr: str,
        ca: TestCA,
        htpasswd: Path | None = None,
        name: str | None = None,
    ) -> None:
        self.addr = addr
        self.host = name or addr
        self.ca = ca
        self.certs = directory / "certs"  # as skopeo reads them: *.crt
        self.certs.mkdir(parents=True)
        shutil.copy(ca.cert, self.certs / "ca.crt")
        config = directory / "config.yml"
        config.write_text(
            "version: 0.1\n"
            f"storage: {{filesystem: {{rootdirectory: {directory / 'data'}}}}}\n"
            f"http: {{addr: '{addr}:443', tls: {{certificate: {ca.server_cert}, "
            f"key: {ca.server_key}}}}}\n"
            "log: {level: warn}\n"
            + (f"auth: {{htpasswd: {{realm: cella-test, path: {htpasswd}}}}}\n" if htpasswd else "")
        )
        self.log = (directory / "registry.log").open("wb")
        self.proc = subprocess.Popen(
            ["docker-registry", "serve", str(config)], stdout=self.log, stderr=self.log
        )
        deadline = time.monotonic() + 30
        trust = ssl.create_default_context(cafile=ca.cert)
        while True:
            try:
                httpx2.get(f"https://{addr}/v2/", verify=trust, timeout=1)
                return
            except httpx2.HTTPError:
                if time.monotonic() > deadline or self.proc.poll() is not None:
                    raise RuntimeError("the registry did not start") from None
                time.sleep(0.1)

    def push(self, source: str, repo: str, creds: str | None = None) -> str:
        """Copies an image (`oci:LAYOUT:TAG`) in; returns its reference (by `host`)."""
        login = ["--dest-creds", creds] if creds else []
        run("skopeo", "copy", "--quiet", "--dest-cert-dir", self.certs, *login, source,
            f"docker://{self.addr}/{repo}")  # fmt: skip
        return f"{self.host}/{repo}"

    def close(self) -> None:
        self.proc.terminate()
        self.proc.wait(10)
        self.log.close()
