"""Volume mounts' door between the egress proxy and the daemon (pure: the proxy imports it):
the name the guest reaches volumes by, the daemon's path for the sandbox's WebDAV requests
and the proxy's header on them."""

from __future__ import annotations

DAV_HOST = "volumes.cella"  # plain HTTP, to the proxy; a sandbox without mounts: a name
PREFIX = "/v1/volume-dav"  # + /{sandbox_id}/{volume_id}/{path}
TOKEN_HEADER = "x-cella-volume-token"  # the daemon's proof it is the proxy asking
REASON = "the sandbox's volume mounts"
BASE_HEADER = "x-cella-volume-base"  # the path the guest's URLs start with (hrefs in it)
REMOTE_PREFIX = "/v1/volume-remote"  # + /{volume_id}/{path}: a fleet node's, with its token
