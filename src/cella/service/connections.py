"""Which guest process opened each connection the egress proxy decides on.

The guest agent names the opener of every connection it carries (pid, uid, argv and the
traced exec it belongs to, from the kernel's socket diagnostics); the daemon hands the
connection to the proxy from a port of its own, and the proxy reports that port with each
decision. The port leads back to the opener, which goes into the `egress` event as
`process` (with `exec`, there and at the top: the exec event it belongs to, filled in when
that is written if the exec was still running).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

from cella.guest.protocol import Owner
from cella.service.proctrace import ProcessTrace

# Connections remembered (a decision with bytes and duration comes when one closes).
MAX_REMEMBERED = 4096


class ConnectionOwners:
    def __init__(self, procs: ProcessTrace) -> None:
        self.procs = procs
        self._by_port: OrderedDict[int, tuple[str, Owner]] = OrderedDict()

    def opened(self, sandbox_id: str, sockname: Any, owner: Owner | None) -> None:
        """The daemon's end (`sockname`) of a connection the guest process `owner` opened."""
        if owner is None or not sockname:
            return
        port = int(sockname[1])
        self._by_port[port] = (sandbox_id, owner)
        self._by_port.move_to_end(port)
        while len(self._by_port) > MAX_REMEMBERED:
            self._by_port.popitem(last=False)

    def record(self, sandbox_id: str, decision: dict[str, Any]) -> None:
        """Writes the decision with its connection's opener, when known (the proxy's port
        of it is the daemon's business and is left out)."""
        port = decision.pop("client_port", None)
        found = self._by_port.get(port) if isinstance(port, int) else None
        owner = found[1] if found is not None and found[0] == sandbox_id else None
        if owner is not None:
            exec_id = self.procs.exec_of(sandbox_id, owner)
            decision["process"] = {
                "pid": owner.pid,
                "argv": owner.argv,
                "uid": owner.uid,
                "exec": exec_id,
            }
            if exec_id is not None:  # the trace's filter by exec finds it under its exec
                decision["exec"] = exec_id
        event_id = self.procs.events.emit(sandbox_id, "egress", decision)
        if owner is not None:  # its exec still running: linked to it when it ends
            self.procs.connection(sandbox_id, owner, event_id)
