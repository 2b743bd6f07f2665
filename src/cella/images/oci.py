"""OCI and Docker images as templates: fetch (skopeo), unpack (umoci), ext4, read-only qcow2.

A reference is a registry image (`registry/repo:tag`, `...@sha256:...`, or with a
`docker://` prefix), a `docker save` archive, an OCI archive, or an OCI layout directory.
Fetched blobs land in one shared OCI layout (`IMAGES/oci`), so layers two images share are
fetched once; a template is keyed by its image's manifest digest, so building the same image
again is a cache hit. The image's config (Env, WorkingDir, User, Entrypoint, Cmd) is kept
with the template: it becomes the default of every command in its sandboxes. cella's agent
is the VM's `/init` from its own initramfs, so an image needs nothing of cella's: no shell,
any libc, any user.
"""

from __future__ import annotations

import base64
import contextlib
import errno
import fcntl
import hashlib
import json
import os
import re
import shutil
import subprocess
import tarfile
import tempfile
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, Literal

from pydantic import BaseModel, Field

from cella import errors
from cella._proc import Progress, quiet, run
from cella.config import DaemonSettings
from cella.images import beneath, layers
from cella.models import ImageConfig, StartCommand
from cella.paths import Paths

HEADROOM_MIB = 256  # free space a new sandbox's file system starts with
MIN_DISK_MIB = 512
WATCH_SECONDS = 0.25  # how often a fetch's growth is looked at
PARTIAL_BLOBS = "oci-put-blob*"  # skopeo's blobs being written, beside index.json
_DIGEST = re.compile(r"sha256:[0-9a-f]{64}")
JSON_MAX = 4 << 20  # an index, manifest or config
LAYOUT_TAG = "image"  # the one image of a layout copied out of a builder
GuestRead = Callable[[str], Awaitable[AsyncIterator[bytes]]]  # a guest path -> its bytes


@dataclass(frozen=True, slots=True)
class ImportLimits:
    """What one image import may fetch and unpack: the operator's `image_max_*` settings."""

    layers: int
    download_mib: int
    unpacked_mib: int
    files: int

    @classmethod
    def of(cls, settings: DaemonSettings) -> ImportLimits:
        return cls(
            settings.image_max_layers,
            settings.image_max_download_mib,
            settings.image_max_unpacked_mib,
            settings.image_max_files,
        )


class TemplateMeta(BaseModel):
    """What the template registry keeps about a template built from an image."""

    name: str
    kind: Literal["image", "dockerfile"] = "image"
    image: str = Field(description="the qcow2 base image's file name")
    source: str = Field(description="the reference it was built from")
    digest: str = Field(description="the image manifest's digest")
    config: ImageConfig = Field(default_factory=ImageConfig)
    disk_mib: int
    built_at: float = Field(default_factory=time.time)
    seconds: dict[str, float] = Field(default_factory=dict, description="time per step")
    tenant: str | None = Field(
        default=None, description="the one tenant that may use it (None: every tenant)"
    )
    start: StartCommand | None = Field(
        default=None, description="started before its warm snapshot (in every sandbox of it)"
    )
    sha256: str | None = Field(default=None, description="of the base image's bytes")
    shipped_from: str | None = Field(
        default=None, description="the node it was shipped from (None: built here)"
    )


def meta_path(paths: Paths, name: str) -> Path:
    return paths.image_templates / f"{name}.template.json"


def read_meta(paths: Paths, name: str) -> TemplateMeta | None:
    try:
        return TemplateMeta.model_validate_json(meta_path(paths, name).read_text())
    except (OSError, ValueError):
        return None


def owner_of(paths: Paths, name: str) -> str | None:
    """The tenant a template built for one tenant belongs to (None: every tenant's)."""
    meta = read_meta(paths, name)
    return meta.tenant if meta is not None else None


def list_meta(paths: Paths) -> list[TemplateMeta]:
    out = []
    for file in sorted(paths.image_templates.glob("*.template.json")):
        with_meta = read_meta(paths, file.name.removesuffix(".template.json"))
        if with_meta is not None:
            out.append(with_meta)
    return out


def skopeo_source(ref: str) -> str:
    """The skopeo transport for a reference: a file or directory on disk, or a registry."""
    path = Path(ref)
    if ref.startswith(("docker://", "oci:", "oci-archive:", "docker-archive:")):
        return ref
    if path.is_dir() and (path / "index.json").exists():
        return f"oci:{path}"
    if path.is_file():
        with tarfile.open(path) as tar:
            names = set(tar.getnames())
        if "manifest.json" in names or "./manifest.json" in names:
            return f"docker-archive:{path}"
        if "index.json" in names or "./index.json" in names:
            return f"oci-archive:{path}"
        raise errors.InvalidArgument(f"{ref}: not a docker save archive or an OCI archive")
    if "/" in ref or ":" in ref or "@" in ref:
        return f"docker://{ref}"
    raise errors.InvalidArgument(f"{ref!r}: not an image reference, archive or OCI layout")


def build_from_image(
    paths: Paths,
    name: str,
    ref: str,
    progress: Progress = quiet,
    *,
    disk_mib: int | None = None,
    cert_dir: Path | None = None,
    credentials: str | None = None,
    kind: Literal["image", "dockerfile"] = "image",
    source: str | None = None,
    limits: ImportLimits | None = None,
    tenant: str | None = None,
    start: StartCommand | None = None,
    free_mib: int = HEADROOM_MIB,
) -> TemplateMeta:
    """A template `name` from the image `ref` (fetched, unpacked, made a base image). The
    same image digest already built as this name is a cache hit. `cert_dir` holds CA
    certificates (`*.crt`) registries are checked against; `credentials` is `user:password`.
    An image over `limits` (default: the settings') is refused before it is unpacked. With
    `tenant`, the template is that tenant's alone (its base may still be shared by digest:
    the image was fetched with the tenant's own access first). `start` is what its sandboxes
    have running (`StartCommand`); its file system has at least `free_mib` free."""
    limits = limits or ImportLimits.of(DaemonSettings())
    layout = paths.images / "oci"
    layout.mkdir(parents=True, exist_ok=True)
    with open(layout.parent / "oci.lock", "w") as lock:  # one build at a time edits the layout
        fcntl.flock(lock, fcntl.LOCK_EX)
        label = source or ref
        meta = _build(
            paths, name, ref, label, layout, progress, disk_mib, cert_dir, credentials, limits,
            free_mib,
        )  # fmt: skip
        if (meta.kind, meta.tenant, meta.start) != (kind, tenant, start):  # a cache hit
            meta = meta.model_copy(update={"kind": kind, "tenant": tenant, "start": start})
            write_meta(paths, meta)
        return meta


async def copy_layout(read: GuestRead, source: str, dest: Path, limits: ImportLimits) -> str:
    """Copies the one image of the OCI layout `source` in a builder sandbox (`read` reads
    its files) into the new layout `dest`, blob by blob: every name on the host is made here
    from a checked digest, every blob is hashed as it comes, and the layers are held to
    `limits`. Returns the reference skopeo reads it by."""
    index_file = dest / "index.json"
    await _copy(read, f"{source}/index.json", index_file, JSON_MAX)
    images = _field(index_file, lambda index: [m["digest"] for m in index["manifests"]])
    if len(images) != 1:
        raise errors.BuildFailed(f"the builder's layout holds {len(images)} images, not one")
    (dest / "blobs" / "sha256").mkdir(parents=True)
    manifest_file = await _copy_blob(read, source, dest, images[0], JSON_MAX)
    layer_digests = _field(manifest_file, lambda m: [la["digest"] for la in m.get("layers") or []])
    if len(layer_digests) > limits.layers:
        raise errors.PayloadTooLarge(
            f"the image has {len(layer_digests)} layers; image_max_layers is {limits.layers}"
        )
    config = _field(manifest_file, lambda m: m["config"]["digest"])
    await _copy_blob(read, source, dest, config, JSON_MAX)
    budget = limits.download_mib << 20
    for digest in layer_digests:
        try:
            budget -= (await _copy_blob(read, source, dest, digest, budget)).stat().st_size
        except errors.PayloadTooLarge:
            raise errors.PayloadTooLarge(
                f"the image's layers are more than image_max_download_mib "
                f"({limits.download_mib} MiB)"
            ) from None
    (dest / "oci-layout").write_text('{"imageLayoutVersion": "1.0.0"}')
    own = {
        "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "digest": images[0],
        "size": manifest_file.stat().st_size,
        "annotations": {"org.opencontainers.image.ref.name": LAYOUT_TAG},
    }
    index_file.write_text(json.dumps({"schemaVersion": 2, "manifests": [own]}))
    return f"oci:{dest}:{LAYOUT_TAG}"


def _field(document: Path, pick: Callable[[Any], Any]) -> Any:
    """`pick` applied to the JSON file `document` the builder made; a file that is not the
    JSON it should be fails the build."""
    try:
        return pick(json.loads(document.read_text()))
    except (ValueError, KeyError, TypeError, AttributeError):
        raise errors.BuildFailed(f"the builder's {document.name} is not OCI JSON") from None


async def _copy_blob(read: GuestRead, source: str, dest: Path, digest: Any, most: int) -> Path:
    """The blob `digest` of the guest's layout, copied and checked against its digest."""
    target = _blob(dest, str(digest))
    await _copy(read, f"{source}/blobs/sha256/{target.name}", target, most)
    with target.open("rb") as f:
        if hashlib.file_digest(f, "sha256").hexdigest() != target.name:
            raise errors.BuildFailed(f"the builder's blob {digest[:19]} is not what it names")
    return target


async def _copy(read: GuestRead, path: str, target: Path, most: int) -> None:
    """Copies the guest file `path` to the new host file `target`, at most `most` bytes."""
    size = 0
    with target.open("xb") as out:
        async for chunk in await read(path):
            size += len(chunk)
            if size > most:
                raise errors.PayloadTooLarge(f"{path} is over {most} bytes")
            out.write(chunk)


def _build(
    paths: Paths,
    name: str,
    ref: str,
    label: str,
    layout: Path,
    progress: Progress,
    disk_mib: int | None,
    cert_dir: Path | None,
    credentials: str | None,
    limits: ImportLimits,
    free_mib: int = HEADROOM_MIB,
) -> TemplateMeta:
    tag = f"in-{os.getpid()}-{time.monotonic_ns()}"
    timings: dict[str, float] = {}
    started = time.monotonic()
    progress(f"fetching {label}")
    with _readable(paths, skopeo_source(ref), limits) as source:
        argv = ["skopeo", "copy", "--quiet", source, f"oci:{layout}:{tag}"]
        if cert_dir is not None:
            argv[2:2] = ["--src-cert-dir", str(cert_dir)]
        auth = paths.build_tmp / f"auth-{tag}.json"
        if credentials:  # a file, not an argument: arguments are visible to every host user
            registry = source.removeprefix("docker://").split("/", 1)[0]
            auth.write_text(auth_json(registry, credentials))
            argv[2:2] = ["--src-authfile", str(auth)]
        try:
            _fetch(argv, layout, limits, progress)
        except errors.BuildFailed as exc:
            raise errors.BuildFailed(f"fetching {label} failed: {exc.message}") from None
        finally:
            auth.unlink(missing_ok=True)
    timings["fetch"] = time.monotonic() - started
    try:
        digest, blobs, config = _manifest(layout, tag)
        # more room than a template starts with: a base of its own size, never a cached one
        same = _built_before(paths, name, digest, disk_mib) if free_mib <= HEADROOM_MIB else None
        if same is not None:
            progress(f"template {name}: {digest[:19]} is built already (cache hit)")
            if same.name != name:  # another template has this image: share its base
                same = same.model_copy(update={"name": name, "source": label})
                write_meta(paths, same)
            return same
        _check(blobs, limits)
        return _make(
            paths, name, label, layout, tag, digest, config, disk_mib, progress, timings,
            max(free_mib, HEADROOM_MIB),
        )  # fmt: skip
    finally:
        _untag(layout, tag)


@contextlib.contextmanager
def _readable(paths: Paths, source: str, limits: ImportLimits) -> Iterator[str]:
    """What skopeo reads for `source`: an OCI archive becomes a layout unpacked here first
    (skopeo's own extraction follows links the archive makes, out of its directory)."""
    if not source.startswith("oci-archive:"):
        yield source
        return
    archive, _, image = source.removeprefix("oci-archive:").partition(":")
    with tempfile.TemporaryDirectory(dir=paths.build_tmp, prefix="archive-") as tmp:
        unpacked = Path(tmp) / "layout"
        if not layers.unpack_archive(Path(archive), unpacked, limits.download_mib << 20):
            raise errors.PayloadTooLarge(
                f"the archive holds more than image_max_download_mib ({limits.download_mib} MiB)"
            )
        yield f"oci:{unpacked}" + (f":{image}" if image else "")


def _fetch(argv: list[str], layout: Path, limits: ImportLimits, progress: Progress) -> None:
    """Runs the fetch, stopped once the layout has grown by more than the download limit:
    a registry declares whatever sizes it likes, and skopeo does not hold it to them."""
    budget = limits.download_mib << 20
    before = _disk_bytes(layout)
    tail: deque[str] = deque(maxlen=40)
    with subprocess.Popen(
        argv,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        text=True,
        errors="replace",
    ) as proc:
        assert proc.stdout is not None
        reader = threading.Thread(target=_lines, args=(proc.stdout, tail, progress), daemon=True)
        reader.start()
        while True:
            try:
                code = proc.wait(WATCH_SECONDS)
                break
            except subprocess.TimeoutExpired:
                if _disk_bytes(layout) - before > budget:
                    proc.kill()
                    proc.wait()
                    for partial in layout.glob(PARTIAL_BLOBS):  # the build holds the layout
                        partial.unlink(missing_ok=True)
                    raise errors.PayloadTooLarge(
                        f"the image's layers are more than image_max_download_mib "
                        f"({limits.download_mib} MiB)"
                    ) from None
        reader.join()
    if code != 0:
        shown = "\n".join(tail)
        raise errors.BuildFailed(f"skopeo exited with {code}:\n{shown}")


def _lines(stream: IO[str], tail: deque[str], progress: Progress) -> None:
    for line in stream:
        line = line.rstrip("\n")
        tail.append(line)
        if line:
            progress(f"  {line}")


def _disk_bytes(root: Path) -> int:
    """The disk space the files under `root` take (temporary ones being written too)."""
    total = 0
    for top, _, files in os.walk(root):
        for f in files:
            with contextlib.suppress(OSError):  # renamed or removed meanwhile
                total += os.lstat(os.path.join(top, f)).st_blocks * 512
    return total


def _check(blobs: list[Path], limits: ImportLimits) -> None:
    """Refuses an image over the operator's limits before anything of it is unpacked."""
    if len(blobs) > limits.layers:
        raise errors.PayloadTooLarge(
            f"the image has {len(blobs)} layers; image_max_layers is {limits.layers}"
        )
    fetched = sum(blob.stat().st_size for blob in blobs)
    if fetched > limits.download_mib << 20:
        raise errors.PayloadTooLarge(
            f"the image's layers are {fetched >> 20} MiB; "
            f"image_max_download_mib is {limits.download_mib}"
        )
    unpacked = layers.measure(blobs, limits.files, limits.unpacked_mib << 20)
    if unpacked.over == "files":
        raise errors.PayloadTooLarge(
            f"the image unpacks to more than image_max_files ({limits.files}) entries"
        )
    if unpacked.over == "bytes":
        raise errors.PayloadTooLarge(
            f"the image unpacks to more than image_max_unpacked_mib ({limits.unpacked_mib} MiB)"
        )


def _built_before(
    paths: Paths, name: str, digest: str, disk_mib: int | None
) -> TemplateMeta | None:
    """A template with this image digest and size whose base is in place (this name's
    first): bases are keyed by content, so a rebuild or another name reuses one."""
    metas = sorted(list_meta(paths), key=lambda m: m.name != name)
    for meta in metas:
        if (
            meta.digest == digest
            and disk_mib in (None, meta.disk_mib)
            and (paths.image_templates / meta.image).exists()
        ):
            return meta
    return None


def _make(
    paths: Paths,
    name: str,
    ref: str,
    layout: Path,
    tag: str,
    digest: str,
    config: ImageConfig,
    disk_mib: int | None,
    progress: Progress,
    timings: dict[str, float],
    free_mib: int = HEADROOM_MIB,
) -> TemplateMeta:
    stage = paths.build_tmp / f"image-{name}-{os.getpid()}-{time.monotonic_ns()}"
    stage.mkdir(parents=True)
    try:
        started = time.monotonic()
        progress("unpacking the layers")
        rootfs = stage / "rootfs"
        run(["umoci", "raw", "unpack", "--image", f"{layout}:{tag}", rootfs])
        timings["unpack"] = time.monotonic() - started
        _prepare(rootfs)
        started = time.monotonic()
        used = _size_mib(rootfs)
        size = max(disk_mib or 0, used + free_mib, MIN_DISK_MIB)
        progress(f"making a {size} MiB ext4 file system ({used} MiB of files)")
        raw = stage / "root.ext4"
        run(["mkfs.ext4", "-F", "-q", "-L", "cella-root", "-E", "root_owner=0:0",
             "-d", rootfs, raw, f"{size}M"])  # fmt: skip
        image = f"oci-{digest.removeprefix('sha256:')[:16]}-{size}m.qcow2"
        qcow = stage / "base.qcow2"
        run(["qemu-img", "convert", "-O", "qcow2", raw, qcow])
        qcow.chmod(0o400)
        sha256 = file_sha256(qcow)  # what a fleet ships it by, and checks on arrival
        timings["filesystem"] = time.monotonic() - started
        meta = TemplateMeta(
            name=name,
            image=image,
            source=ref,
            digest=digest,
            config=config,
            disk_mib=size,
            seconds={k: round(v, 2) for k, v in timings.items()},
            sha256=sha256,
        )
        place(qcow, paths.image_templates / image)
        write_meta(paths, meta)  # the template exists from here on
        progress(f"template {name} built from {ref} ({digest[:19]})")
        return meta
    finally:
        shutil.rmtree(stage, ignore_errors=True)


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 20):
            digest.update(block)
    return digest.hexdigest()


def place(staged: Path, dest: Path) -> None:
    """`staged` moved to `dest` whole (a copy first when they are on different file
    systems: a daemon's own template directory need not be on the cache's)."""
    try:
        staged.rename(dest)
    except OSError as exc:
        if exc.errno != errno.EXDEV:
            raise
        partial = dest.with_name(f".{dest.name}.{os.getpid()}")
        shutil.copy2(staged, partial)
        partial.rename(dest)
        staged.unlink()


def write_meta(paths: Paths, meta: TemplateMeta) -> None:
    """The template exists from here on (written whole)."""
    tmp = meta_path(paths, meta.name).with_suffix(".tmp")
    tmp.write_text(meta.model_dump_json(indent=2))
    tmp.rename(meta_path(paths, meta.name))


def record_seconds(paths: Paths, meta: TemplateMeta, **seconds: float) -> None:
    """Adds timings of later steps (the warm snapshot) to the template's record."""
    write_meta(paths, meta.model_copy(update={"seconds": {**meta.seconds, **seconds}}))


def auth_json(registry: str, credentials: str) -> str:
    """A containers-auth.json with `user:password` for `registry` (`host[:port]`)."""
    token = base64.b64encode(credentials.encode()).decode()
    return json.dumps({"auths": {registry: {"auth": token}}})


def _manifest(layout: Path, tag: str) -> tuple[str, list[Path], ImageConfig]:
    """The manifest digest the tag names, its layers' blobs and the image config."""
    index = json.loads((layout / "index.json").read_text())
    for desc in index.get("manifests", []):
        if desc.get("annotations", {}).get("org.opencontainers.image.ref.name") == tag:
            digest = desc["digest"]
            break
    else:
        raise errors.BuildFailed(f"the image was fetched but {tag} is not in the layout")
    manifest = json.loads(_blob(layout, digest).read_text())
    config = json.loads(_blob(layout, manifest["config"]["digest"]).read_text())
    blobs = [_blob(layout, layer["digest"]) for layer in manifest.get("layers") or []]
    return digest, blobs, _config(config.get("config") or {})


def _blob(layout: Path, digest: str) -> Path:
    if not _DIGEST.fullmatch(digest):
        raise errors.BuildFailed(f"the image names a blob {digest[:80]!r}, not a sha256 digest")
    return layout / "blobs" / "sha256" / digest.removeprefix("sha256:")


def _config(c: dict[str, Any]) -> ImageConfig:
    env = {}
    for item in c.get("Env") or []:
        key, _, value = str(item).partition("=")
        if key:
            env[key] = value
    return ImageConfig(
        env=env,
        working_dir=c.get("WorkingDir") or None,
        user=c.get("User") or None,
        entrypoint=list(c.get("Entrypoint") or []),
        cmd=list(c.get("Cmd") or []),
    )


def _prepare(rootfs: Path) -> None:
    """Directories the agent mounts over or writes to, present in any image. Made inside
    the tree without following its links: `tmp -> /etc` must not make the host's /etc
    world-writable. What is a link stays one (the guest follows it, in the guest)."""
    with beneath.tree(rootfs) as root:
        for d in ("proc", "sys", "dev", "run", "tmp", "etc", "root"):
            beneath.make_dir(root, d)
        try:
            tmp = beneath.open_beneath(root, "tmp", os.O_RDONLY | os.O_DIRECTORY)
        except OSError as exc:
            if exc.errno not in beneath.LINK_ERRORS:
                raise
            return
        try:
            os.fchmod(tmp, 0o1777)
        finally:
            os.close(tmp)


def _size_mib(root: Path) -> int:
    total = 0
    for top, _, files in os.walk(root):
        for f in files:
            try:
                total += os.lstat(os.path.join(top, f)).st_blocks * 512
            except OSError:
                continue
    return total >> 20


def _untag(layout: Path, tag: str) -> None:
    """Drops the temporary tag (the blobs stay: other images share them)."""
    index_file = layout / "index.json"
    try:
        index = json.loads(index_file.read_text())
    except (OSError, ValueError):
        return
    index["manifests"] = [
        d
        for d in index.get("manifests", [])
        if d.get("annotations", {}).get("org.opencontainers.image.ref.name") != tag
    ]
    tmp = index_file.with_suffix(".tmp")
    tmp.write_text(json.dumps(index))
    tmp.rename(index_file)
