"""A template built from steps (E2B's `Template` builder) as a Dockerfile for buildah.

The base image comes first, then the user every such template has (`user`, home
`/home/user`, made if the image lacks it, as E2B's builds make it), which later steps run
as by default, in its home; then each step as the Dockerfile instruction that does the
same: `run` in the exec form (the command is never spliced into Dockerfile syntax), `copy`
from the files uploaded for it (unpacked in the builder into `files/<hash>/`), `env`,
`workdir` and `user`. Each instruction's origin (`base`, the step's number from 0, or
`finalize`) names the step a failed build stops at, as E2B's status does.
"""

from __future__ import annotations

import json
import posixpath
import re
from dataclasses import dataclass

from cella import errors
from cella.models import BuildStep

DEFAULT_USER = "user"
HOME = "/home/user"
FILES = "files"  # the context's directory of uploaded files, one directory per hash
ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_.-]{0,255}$")
USER_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,63}(:[A-Za-z0-9_][A-Za-z0-9_.-]{0,63})?$")
MODE = re.compile(r"^[0-7]{3,4}$")
PROVISION = (
    f"grep -q '^{DEFAULT_USER}:' /etc/passwd 2>/dev/null || "
    f"useradd -m -s /bin/sh {DEFAULT_USER} 2>/dev/null || "
    f"adduser -D {DEFAULT_USER} 2>/dev/null || "
    f"{{ echo '{DEFAULT_USER}:x:1000:1000::{HOME}:/bin/sh' >> /etc/passwd && "
    f"echo '{DEFAULT_USER}:x:1000:' >> /etc/group; }}; "
    f"mkdir -p {HOME} && chown {DEFAULT_USER}:{DEFAULT_USER} {HOME}"
)


@dataclass(frozen=True, slots=True)
class Translated:
    dockerfile: str
    origins: list[str]  # per instruction, 1-based in buildah's "STEP n/m": origins[n - 1]
    hashes: list[str]  # the uploads the copies need


def dockerfile(image: str, steps: list[BuildStep]) -> Translated:
    """The Dockerfile for `steps` on `image` (a registry reference); a step that cannot be
    written as one is refused, naming it."""
    if "\n" in image or "\r" in image or image.startswith("-") or " " in image:
        raise errors.InvalidArgument(f"{image!r} is not an image reference")
    lines = [f"FROM {image}", "USER root", f"RUN {json.dumps(['/bin/sh', '-c', PROVISION])}",
             f"USER {DEFAULT_USER}", f"WORKDIR {HOME}"]  # fmt: skip
    origins = ["base"] * len(lines)
    hashes: list[str] = []
    user = DEFAULT_USER
    for index, step in enumerate(steps):
        out, user = _step(index, step, user, hashes)
        lines += out
        origins += [str(index)] * len(out)
    return Translated("\n".join(lines) + "\n", origins, hashes)


def _step(index: int, step: BuildStep, user: str, hashes: list[str]) -> tuple[list[str], str]:
    where = f"step {index} ({step.type})"
    args = step.args
    for arg in args:
        if "\x00" in arg:
            raise errors.InvalidArgument(f"{where}: an argument holds a NUL byte")
    if step.type == "run":
        if not 1 <= len(args) <= 2 or not args[0]:
            raise errors.InvalidArgument(f"{where}: RUN takes a command and an optional user")
        run = f"RUN {json.dumps(['/bin/sh', '-c', args[0]])}"
        if len(args) == 2 and args[1] and args[1] != user:
            return [f"USER {_user(where, args[1])}", run, f"USER {user}"], user
        return [run], user
    if step.type == "copy":
        return [_copy(where, step, user, hashes)], user
    if step.type == "env":
        if not args or len(args) % 2:
            raise errors.InvalidArgument(f"{where}: ENV takes names and values, alternating")
        pairs = []
        for name, value in zip(args[::2], args[1::2], strict=True):
            if not ENV_NAME.match(name):
                raise errors.InvalidArgument(f"{where}: {name!r} is not a variable name")
            pairs.append(f"{name}={_quoted(where, value)}")
        return [f"ENV {' '.join(pairs)}"], user
    if len(args) != 1 or not args[0]:
        raise errors.InvalidArgument(f"{where}: takes exactly one argument")
    if step.type == "workdir":
        return [f"WORKDIR {_line(where, args[0])}"], user
    return [f"USER {_user(where, args[0])}"], args[0]


def _copy(where: str, step: BuildStep, user: str, hashes: list[str]) -> str:
    args = [*step.args, "", "", ""][:4]
    if len(step.args) < 2 or len(step.args) > 4:
        raise errors.InvalidArgument(f"{where}: COPY takes source, destination, owner, mode")
    src, dest, owner, mode = args
    if step.files_hash is None:
        raise errors.InvalidArgument(f"{where}: COPY needs the hash of its uploaded files")
    clean = posixpath.normpath(src)
    if not src or src.startswith("/") or clean == ".." or clean.startswith("../"):
        raise errors.InvalidArgument(f"{where}: the source must be a path inside the context")
    if not dest:
        raise errors.InvalidArgument(f"{where}: COPY needs a destination")
    flags = [f"--chown={_user(where, owner) if owner else f'{user}:{user}'}"]
    if mode:
        if not MODE.match(mode):
            raise errors.InvalidArgument(f"{where}: mode {mode!r} is not octal")
        flags.append(f"--chmod={mode}")
    if step.files_hash not in hashes:
        hashes.append(step.files_hash)
    source = posixpath.join(FILES, step.files_hash, clean)
    return f"COPY {' '.join(flags)} {json.dumps([source, _line(where, dest)])}"


def _user(where: str, user: str) -> str:
    if not USER_NAME.match(user):
        raise errors.InvalidArgument(f"{where}: {user!r} is not a user name")
    return user


def _line(where: str, value: str) -> str:
    if "\n" in value or "\r" in value:
        raise errors.InvalidArgument(f"{where}: a line break in {value!r}")
    return value


def _quoted(where: str, value: str) -> str:
    """A Dockerfile ENV value, taken literally ($ and quotes escaped)."""
    _line(where, value)
    return '"' + re.sub(r'(["\\$])', r"\\\1", value) + '"'


NAME = re.compile(r"^[a-z0-9][a-z0-9._-]{0,127}$")
TAG = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


def check_name(name: str) -> None:
    if not NAME.match(name):
        raise errors.InvalidArgument(
            f"{name!r}: a template name is 1-128 lowercase letters, digits, '.', '_' or '-'"
        )


def check_tag(tag: str) -> None:
    if not TAG.match(tag):
        raise errors.InvalidArgument(f"{tag!r}: a tag is 1-128 letters, digits, '.', '_', '-'")


def check_hash(files_hash: str) -> None:
    if not re.fullmatch(r"[0-9a-f]{64}", files_hash):
        raise errors.InvalidArgument("a files hash is 64 lowercase hex digits (SHA-256)")


def reference(image: str, host: str) -> str:
    """A registry reference buildah pulls without asking (Docker Hub's made explicit);
    `host` is the registry host the reference names."""
    ref = image.removeprefix("docker://")
    if host == "docker.io" and not ref.startswith("docker.io/"):
        ref = f"docker.io/{ref if '/' in ref else 'library/' + ref}"
    return ref
