"""A deepagents sandbox backend on a cella sandbox: the agent's shell and file tools run in
the microVM (ls, read, grep, glob and edit come from deepagents' `BaseSandbox` on top of
`execute` and the file transfers)."""

from __future__ import annotations

from deepagents.backends.protocol import (
    ExecuteResponse,
    FileDownloadResponse,
    FileOperationError,
    FileUploadResponse,
)
from deepagents.backends.sandbox import BaseSandbox

from cella import errors
from cella.sdk import Sandbox

MAX_OUTPUT = 256 << 10

_ERRORS: dict[str, FileOperationError] = {
    "not_found": "file_not_found",
    "permission_denied": "permission_denied",
    "is_a_directory": "is_directory",
    "invalid_argument": "invalid_path",
}


def _error(exc: errors.CellaError) -> FileOperationError:
    return _ERRORS.get(exc.code, "invalid_path")


class CellaBackend(BaseSandbox):
    """`create_deep_agent(model, backend=CellaBackend(sandbox))`."""

    def __init__(self, sandbox: Sandbox, *, default_timeout: int = 300) -> None:
        self.sandbox = sandbox
        self.default_timeout = default_timeout

    @property
    def id(self) -> str:
        return self.sandbox.id

    def execute(self, command: str, *, timeout: int | None = None) -> ExecuteResponse:
        r = self.sandbox.exec(command, timeout=timeout or self.default_timeout)
        output = r.stdout + r.stderr
        return ExecuteResponse(
            output=output[-MAX_OUTPUT:].decode(errors="replace"),
            exit_code=r.exit_code,
            truncated=len(output) > MAX_OUTPUT,
        )

    def upload_files(self, files: list[tuple[str, bytes]]) -> list[FileUploadResponse]:
        out = []
        for path, data in files:
            try:
                self.sandbox.files.write(path, data, parents=True)
                out.append(FileUploadResponse(path=path))
            except errors.CellaError as exc:
                out.append(FileUploadResponse(path=path, error=_error(exc)))
        return out

    def download_files(self, paths: list[str]) -> list[FileDownloadResponse]:
        out = []
        for path in paths:
            try:
                out.append(FileDownloadResponse(path=path, content=self.sandbox.files.read(path)))
            except errors.CellaError as exc:
                out.append(FileDownloadResponse(path=path, error=_error(exc)))
        return out
