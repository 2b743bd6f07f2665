"""LangChain tools over one cella sandbox (the agent runs outside, the sandbox is its tool).

tools = sandbox_tools(Sandbox.create(allow=["pypi.org"]))
agent = create_agent(model, tools)
"""

from __future__ import annotations

from langchain_core.tools import BaseTool, StructuredTool

from cella import errors
from cella.sdk import Sandbox

MAX_OUTPUT = 64 << 10  # what a model reads back per call


def _tail(data: bytes) -> str:
    text = data[-MAX_OUTPUT:].decode(errors="replace")
    return ("[...]\n" + text) if len(data) > MAX_OUTPUT else text


def sandbox_tools(sandbox: Sandbox, *, timeout: float = 300) -> list[BaseTool]:
    """`run_command`, `write_file`, `read_file` and `list_files` bound to `sandbox`."""

    def run_command(command: str, cwd: str | None = None) -> str:
        """Run a shell command in the sandbox; returns its exit code and output."""
        r = sandbox.exec(command, cwd=cwd, timeout=timeout)
        status = "timed out" if r.timed_out else f"exit code {r.exit_code}"
        return f"{status}\n--- stdout\n{_tail(r.stdout)}--- stderr\n{_tail(r.stderr)}"

    def write_file(path: str, content: str) -> str:
        """Write a text file (absolute path) in the sandbox, creating parent directories."""
        entry = sandbox.files.write(path, content, parents=True)
        return f"wrote {entry.size} bytes to {path}"

    def read_file(path: str) -> str:
        """Read a text file (absolute path) from the sandbox."""
        try:
            return _tail(sandbox.files.read(path))
        except errors.CellaError as exc:
            return f"error: {exc.message}"

    def list_files(path: str = "/workspace") -> str:
        """List a directory in the sandbox: one `kind size name` line per entry."""
        try:
            return "\n".join(f"{e.kind} {e.size} {e.name}" for e in sandbox.files.list(path))
        except errors.CellaError as exc:
            return f"error: {exc.message}"

    return [
        StructuredTool.from_function(fn) for fn in (run_command, write_file, read_file, list_files)
    ]
