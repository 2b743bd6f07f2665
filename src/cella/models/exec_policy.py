"""A sandbox's exec policy: which executables its guest kernel lets run."""

from __future__ import annotations

import re
from typing import Literal

from pydantic import BaseModel, Field, model_validator

MAX_EXEC_RULES = 256
SHA256 = r"^[0-9a-f]{64}$"


class ExecRule(BaseModel):
    """One rule: an executable's real path (symlinks resolved; `*` and `?` match any
    characters, `/` too, `[...]` a set) or the sha256 of its contents, and what to do."""

    model_config = {"extra": "forbid"}

    path_glob: str | None = Field(default=None, min_length=1, max_length=1024)
    sha256: str | None = Field(default=None, description="hex digest of the file's contents")
    action: Literal["allow", "deny"]

    @model_validator(mode="after")
    def _one_match(self) -> ExecRule:
        if (self.path_glob is None) == (self.sha256 is None):
            raise ValueError("a rule names exactly one of `path_glob` and `sha256`")
        if self.sha256 is not None:
            self.sha256 = self.sha256.lower()
            if not re.match(SHA256, self.sha256):
                raise ValueError("`sha256` is 64 hex digits")
        if self.path_glob is not None and "\0" in self.path_glob:
            raise ValueError("`path_glob` holds a NUL byte")
        return self


class ExecPolicy(BaseModel):
    """Rules in order: the first that matches an executable decides; none matching, the
    default does. Enforced by the guest's kernel for every execve (a script's interpreter
    and a binary written at run time too); a refusal fails with EPERM in the guest and is
    an `exec_denied` event in the trace."""

    model_config = {"extra": "forbid"}

    default: Literal["allow", "deny"] = "allow"
    rules: list[ExecRule] = Field(default_factory=list, max_length=MAX_EXEC_RULES)

    @property
    def inert(self) -> bool:
        """Allows everything: the guest checks nothing."""
        return self.default == "allow" and not self.rules
