"""Access delegation on a fleet: the gateway makes the grant of a sandbox it places (the
creator is one of the gateway's keys) and keeps it; the node gets it with the create
(`FLEET_GRANT`) and its proxy takes the sandbox's `cella.api` to the gateway's address, with
tokens minted from the grant's key; a gateway serving TLS is reached over TLS, its
certificate (the first of its `tls_cert`) sent with the grant and pinned by the proxy. The
gateway checks those tokens against the grants kept here, so code in the sandbox calls the
whole fleet as its creator, until the creator's key is revoked or the sandbox is gone."""

from __future__ import annotations

import ipaddress
import json
from pathlib import Path

from cella import errors
from cella.config import DaemonSettings
from cella.fleet.placement_table import Placements
from cella.models import AccessDelegation
from cella.service import delegation
from cella.service.keys import Grant, Keys, Principal
from cella.store.sql import Database, database

SCHEMA = """
CREATE TABLE IF NOT EXISTS grants (
    sandbox_id TEXT PRIMARY KEY,
    tenant TEXT NOT NULL,
    "grant" TEXT NOT NULL
);
"""
GONE = ("deleting", "deleted", "error")


class Delegations:
    def __init__(
        self,
        where: Path | str | Database,
        settings: DaemonSettings,
        placements: Placements,
        keys: Keys,
    ) -> None:
        self.settings = settings
        self.placements = placements
        self.keys = keys
        self._db = database(where)
        self._db.ensure("grants", SCHEMA)

    def ask(self, who: Principal, asked: AccessDelegation | None) -> delegation.Json | None:
        """The grant for a create asking `asked` (None: no delegation), refused as a node
        refuses it: a caller acting for the tenant, a gateway on no one address."""
        if asked is None:
            return None
        own = self.keys.by_id(who.key_id) if who.key_id else None
        if own is None or own.tenant != who.tenant:
            raise errors.InvalidArgument(
                "access_delegation needs the tenant's own API key, not one acting for it"
            )
        return delegation.grant_for(asked, who, self.address(), self.certificate())

    def header(self, grant: delegation.Json) -> dict[str, str]:
        """What the node is sent with the create."""
        sent = {k: grant[k] for k in delegation.SENT if k in grant}
        return {delegation.FLEET_GRANT: json.dumps(sent)}

    def made(self, sandbox_id: str, tenant: str, grant: delegation.Json) -> None:
        self._db.execute(
            "INSERT INTO grants VALUES (?, ?, ?) ON CONFLICT (sandbox_id) DO UPDATE SET "
            'tenant = excluded.tenant, "grant" = excluded."grant"',
            (sandbox_id, tenant, json.dumps(grant)),
        )

    def grant_of(self, sandbox_id: str) -> Grant | None:
        """The grant of a sandbox the gateway placed, while it lives (`Keys.delegated`)."""
        row = self._db.execute(
            'SELECT tenant, "grant" FROM grants WHERE sandbox_id = ?', (sandbox_id,)
        ).fetchone()
        where = self.placements.get(sandbox_id)
        if row is None or where is None or where.lost or where.body.get("state") in GONE:
            return None
        return Grant(row[0], json.loads(row[1]))

    def certificate(self) -> str | None:
        """The certificate a node's proxy pins to reach this gateway (None: in clear)."""
        if self.settings.tls_cert is None:
            return None
        return leaf_certificate(self.settings.tls_cert.read_text())

    def address(self, what: str = "access_delegation") -> tuple[str, int]:
        """Where a node's proxy (or daemon) reaches this gateway's API (for `what`)."""
        host, port = self.settings.host_port
        host = host.strip("[]")
        try:
            unspecified = ipaddress.ip_address(host).is_unspecified
        except ValueError:
            unspecified = False
        if unspecified:
            raise errors.InvalidArgument(
                f"{what}: the gateway listens on {host}, not on one address the nodes can be "
                "sent to; give --listen the address they reach it at"
            )
        return host, port


def leaf_certificate(pem: str) -> str:
    """The first certificate of a PEM file (a chain starts with the server's own)."""
    begin, end = "-----BEGIN CERTIFICATE-----", "-----END CERTIFICATE-----"
    start = pem.find(begin)
    stop = pem.find(end, start)
    if start < 0 or stop < 0:
        raise errors.InvalidArgument("access_delegation: the gateway's tls_cert has no certificate")
    return pem[start : stop + len(end)].replace("\r\n", "\n") + "\n"
