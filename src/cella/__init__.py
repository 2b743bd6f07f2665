"""cella: microVM sandboxes for AI coding agents.

from cella import Sandbox
with Sandbox.create() as sb:
    print(sb.exec("uname -r").text)
"""

from cella import errors
from cella.sdk import AsyncClient, AsyncSandbox, Client, ExecResult, Sandbox

__all__ = ["AsyncClient", "AsyncSandbox", "Client", "ExecResult", "Sandbox", "errors"]
__version__ = "0.1.0"
