"""Wire-compatible front ends for third-party sandbox SDKs: each an adapter whose `install`
puts its routes, error shapes and host-name ports on a daemon's app."""

from __future__ import annotations

from cella.server.app import Door
from cella.server.compat import e2b, langsmith

# E2B's first: its /v2/sandboxes and /v2/sandboxes/{id}/connect lie under LangSmith's
# prefix, and the first adapter that owns a request renders its errors
ADAPTERS: tuple[Door, ...] = (e2b.install, langsmith.install)
