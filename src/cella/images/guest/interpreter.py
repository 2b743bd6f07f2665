"""The code interpreter in a `code-interpreter` sandbox: Jupyter kernels behind the HTTP
API E2B's `e2b-code-interpreter` SDK speaks, on 127.0.0.1:49999 in the guest (the daemon
forwards to it). `POST /execute` streams newline-delimited JSON (stdout, stderr, results
with their rich formats, an error, the execution count); `/contexts` makes, lists, restarts
and removes kernels. Standard library and Debian's jupyter_client only."""

from __future__ import annotations

import json
import os
import queue
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from jupyter_client.manager import KernelManager

PORT = 49999
HOME = "/home/user"
FORMATS = {
    "text/plain": "text",
    "text/html": "html",
    "text/markdown": "markdown",
    "image/svg+xml": "svg",
    "image/png": "png",
    "image/jpeg": "jpeg",
    "application/pdf": "pdf",
    "text/latex": "latex",
    "application/json": "json",
    "application/javascript": "javascript",
}


# figures shown inline (as PNG results); the default context also loads the data stack, so
# a sandbox restored from the warm snapshot has it in memory (and matplotlib's font cache
# is built then, not in a user's first plot)
INLINE = "%matplotlib inline"
PRELOAD = "import numpy, pandas\nimport matplotlib.pyplot\n" + INLINE


class Context:
    def __init__(self, cwd: str, setup: str = INLINE) -> None:
        self.id = uuid.uuid4().hex[:12]
        self.cwd = cwd
        self.lock = threading.Lock()
        self.manager = KernelManager(kernel_name="python3")
        self.manager.start_kernel(cwd=cwd)
        self.client = self.manager.blocking_client()
        self.client.start_channels()
        self.client.wait_for_ready(timeout=600)
        for _ in self.run(setup, {}, quiet=True):
            pass

    def shown(self) -> dict[str, str]:
        return {"id": self.id, "language": "python", "cwd": self.cwd}

    def run(self, code: str, env: dict[str, str], quiet: bool = False) -> Any:
        """The execution's output as E2B's lines, as they come."""
        with self.lock:
            if env:
                setup = f"import os as _o; _o.environ.update({env!r}); del _o"
                self.client.execute(setup, silent=True, store_history=False)
            msg_id = self.client.execute(code, silent=quiet, store_history=not quiet)
            while True:
                try:
                    msg = self.client.get_iopub_msg(timeout=3600)
                except queue.Empty:
                    yield {"type": "unexpected_end_of_execution"}
                    return
                if msg["parent_header"].get("msg_id") != msg_id:
                    continue
                kind, content = msg["msg_type"], msg["content"]
                if kind == "stream":
                    yield {
                        "type": content["name"],
                        "text": content["text"],
                        "timestamp": time.time_ns(),
                    }
                elif kind in ("execute_result", "display_data"):
                    result = {FORMATS[k]: v for k, v in content["data"].items() if k in FORMATS}
                    result["is_main_result"] = kind == "execute_result"
                    yield {"type": "result", **result}
                elif kind == "error":
                    yield {
                        "type": "error",
                        "name": content["ename"],
                        "value": content["evalue"],
                        "traceback": "\n".join(content["traceback"]),
                    }
                elif kind == "execute_input":
                    yield {
                        "type": "number_of_executions",
                        "execution_count": content["execution_count"],
                    }
                elif kind == "status" and content["execution_state"] == "idle":
                    yield {"type": "end_of_execution"}
                    return

    def close(self) -> None:
        self.client.stop_channels()
        self.manager.shutdown_kernel(now=True)


CONTEXTS: dict[str, Context] = {}
DEFAULT: list[Context] = []
GUARD = threading.Lock()


def default_context() -> Context:
    with GUARD:
        if not DEFAULT:
            DEFAULT.append(Context(HOME, PRELOAD))
        return DEFAULT[0]


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.0"  # the stream ends when the connection does

    def log_message(self, *args: Any) -> None:
        return

    def body(self) -> dict[str, Any]:
        size = int(self.headers.get("content-length") or 0)
        return json.loads(self.rfile.read(size) or b"{}") if size else {}

    def answer(self, status: int, value: Any) -> None:
        data = json.dumps(value).encode()
        self.send_response(status)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:
        if self.path == "/health":
            self.answer(200, {"status": "ok"})
        elif self.path == "/contexts":
            self.answer(200, [c.shown() for c in CONTEXTS.values()])
        else:
            self.answer(404, {"message": f"no {self.path}"})

    def do_DELETE(self) -> None:
        found = CONTEXTS.pop(self.path.removeprefix("/contexts/"), None)
        if found is None:
            self.answer(404, {"message": "no such context"})
            return
        found.close()
        self.answer(200, {})

    def do_POST(self) -> None:
        try:
            request = self.body()
        except ValueError:
            self.answer(400, {"message": "the body is not JSON"})
            return
        if self.path == "/execute":
            self.execute(request)
        elif self.path == "/contexts":
            if (request.get("language") or "python") != "python":
                self.answer(400, {"message": "only python contexts are supported"})
                return
            context = Context(request.get("cwd") or HOME)
            CONTEXTS[context.id] = context
            self.answer(200, context.shown())
        elif self.path.startswith("/contexts/") and self.path.endswith("/restart"):
            found = CONTEXTS.get(self.path.split("/")[2])
            if found is None:
                self.answer(404, {"message": "no such context"})
                return
            found.manager.restart_kernel(now=True)
            found.client.wait_for_ready(timeout=120)
            self.answer(200, {})
        else:
            self.answer(404, {"message": f"no {self.path}"})

    def execute(self, request: dict[str, Any]) -> None:
        if (request.get("language") or "python") != "python":
            self.answer(400, {"message": "only python is supported"})
            return
        context_id = request.get("context_id")
        context = CONTEXTS.get(context_id) if context_id else default_context()
        if context is None:
            self.answer(404, {"message": f"no context {context_id}"})
            return
        self.send_response(200)
        self.send_header("content-type", "application/x-ndjson")
        self.end_headers()
        for line in context.run(str(request.get("code") or ""), request.get("env_vars") or {}):
            self.wfile.write(json.dumps(line).encode() + b"\n")
            self.wfile.flush()


def emulated_cpu() -> bool:
    """QEMU's software CPU (TCG), whose CPUID claims features it does not emulate."""
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            return any(line.startswith("model name") and "QEMU" in line for line in cpuinfo)
    except OSError:
        return False


def main() -> None:
    if emulated_cpu():
        # OpenBLAS reads the emulated AMD CPU as an Opteron, whose kernels stop on an
        # instruction TCG does not emulate (SIGILL in numpy's first matrix product, which
        # the first plot makes); its Nehalem kernels run.
        os.environ.setdefault("OPENBLAS_CORETYPE", "Nehalem")
    os.environ.setdefault("MPLBACKEND", "module://matplotlib_inline.backend_inline")
    os.environ.setdefault("MPLCONFIGDIR", f"{HOME}/.config/matplotlib")
    default_context()  # the kernel is up before the warm snapshot is taken
    ThreadingHTTPServer(("127.0.0.1", PORT), Handler).serve_forever()


if __name__ == "__main__":
    main()
