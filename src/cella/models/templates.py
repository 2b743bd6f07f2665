"""Templates on the wire: what a template is, how one is built from an image, build progress."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field

from cella.models.network import SECRET_NAME

TEMPLATE_NAME = r"^[a-z0-9][a-z0-9_-]{0,62}$"


class ImageConfig(BaseModel):
    """The parts of an OCI image's config a sandbox honours: `env`, `working_dir` and `user`
    are the defaults of every command; `entrypoint` + `cmd` run at create on request."""

    env: dict[str, str] = Field(default_factory=dict)
    working_dir: str | None = None
    user: str | None = None
    entrypoint: list[str] = Field(default_factory=list)
    cmd: list[str] = Field(default_factory=list)

    @property
    def command(self) -> list[str]:
        return [*self.entrypoint, *self.cmd]


class StartCommand(BaseModel):
    """What a template's sandboxes have running from their first moment: `command` is
    started (as the image's user, in its working directory, with its env) before the
    template's warm snapshot is taken, once `ready` (a shell command) exits 0, so every
    sandbox restored from it has the command running. A sandbox booted afresh from its
    disk (a resume after a stop, a fork without memory) has it started again."""

    model_config = {"extra": "forbid"}

    command: str | None = Field(
        default=None, min_length=1, max_length=16384, description="a shell command"
    )
    ready: str | None = Field(
        default=None,
        min_length=1,
        max_length=16384,
        description="a shell command polled until it exits 0 (none: started is ready)",
    )
    ready_timeout_seconds: int = Field(default=600, ge=1, le=3600)


class Template(BaseModel):
    name: str
    kind: Literal["builtin", "image", "dockerfile"]
    source: str | None = Field(default=None, description="image reference or build context")
    digest: str | None = Field(default=None, description="the image manifest's digest")
    built: bool = Field(description="its base image exists (builtins: `cella setup` made it)")
    disk_mib: int | None = None
    config: ImageConfig = Field(default_factory=ImageConfig)
    start: StartCommand | None = Field(
        default=None, description="running in every sandbox of it (from its warm snapshot)"
    )
    tenant: str | None = Field(default=None, description="the one tenant that may use it")
    built_at: str | None = None
    seconds: dict[str, float] = Field(
        default_factory=dict, description="time per build step (fetch, unpack, filesystem, ...)"
    )
    sha256: str | None = Field(
        default=None, description="of its base image's bytes (what a fleet ships it by)"
    )
    shipped_from: str | None = Field(
        default=None, description="the node of a fleet it was shipped from (None: built here)"
    )


class TemplateList(BaseModel):
    templates: list[Template]


class TemplateBuild(BaseModel):
    """A template from an OCI/Docker image: a registry reference (`host/repo:tag`,
    `...@sha256:...`), or an archive or OCI layout on the daemon's host."""

    model_config = {"extra": "forbid"}

    name: str = Field(pattern=TEMPLATE_NAME)
    image: str = Field(min_length=1, max_length=1024)
    disk_mib: int | None = Field(
        default=None, ge=512, le=1 << 20, description="file system size (default: fits + 256)"
    )
    registry_secret: str | None = Field(
        default=None,
        pattern=SECRET_NAME,
        description="a secret holding `user:password` for the registry (used on the host only)",
    )
    start: StartCommand | None = None


class BuildEvent(BaseModel):
    """One line of a build's progress stream; the last is `done` or `error`."""

    type: Literal["progress", "done", "error"]
    message: str | None = None
    template: Template | None = None
    code: str | None = None


class BuildStep(BaseModel):
    """One step of a template built from steps: `run` (a shell command, and the user to run
    it as), `copy` (files uploaded by their hash: source, destination, owner, mode), `env`
    (names and values, alternating), `workdir` or `user`."""

    model_config = {"extra": "forbid"}

    type: Literal["run", "copy", "env", "workdir", "user"]
    args: list[str] = Field(default_factory=list, max_length=1024)
    files_hash: str | None = Field(default=None, pattern=r"^[0-9a-f]{64}$")


class StepBuild(BaseModel):
    """A template from a base and steps: the base is a registry image (`from_image`) or
    another template built from steps (`from_template`, whose base and steps come first);
    `start` is what its sandboxes have running."""

    model_config = {"extra": "forbid"}

    from_image: str | None = Field(default=None, min_length=1, max_length=1024)
    from_template: str | None = Field(default=None, min_length=1, max_length=256)
    steps: list[BuildStep] = Field(default_factory=list, max_length=1024)
    start: StartCommand | None = None
