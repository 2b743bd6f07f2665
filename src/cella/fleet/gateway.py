"""The fleet gateway: the rooms it is made of, each with one job, put together.

`Membership` knows which node daemons exist (from Ray) and loses the sandboxes of nodes that
go; `Locator` knows where each sandbox lives (`placement_table`, rebuilt from the nodes when
one joins); `Quotas` holds tenants' limits across the fleet (from the placement records,
with what every gateway is making: `holds`); `Planner` decides where new sandboxes go
(`placement_policy`; nodes that do not answer left out for a while: `answering`);
`FleetSnapshots` finds snapshots on the nodes and ships them; `Launcher` runs one pipeline
for every create and fork; `SharedSecrets` keeps the tenants' secrets here and on every
node, `SharedWebhooks` their webhooks; their image registries are kept here alone
(`fleet/registries.py` lends a node one for a pull); `Replicas` keeps copies of replicated
sandboxes' disks on second nodes and brings those sandboxes back from them when their node
is lost; `FleetVolumes` and `NamedTemplates` know the node each volume and named template
lives on (`homes`); `FleetTemplates` builds templates on every node; `Growth` asks Ray's
autoscaler for nodes when none has room and holds the nodes that have sandboxes;
`FleetMoves` moves sandboxes between nodes and drains a node (`Cordons` keeps new ones off
it); `Delegations` makes and checks the access delegation grants of the sandboxes it places.
The gateway keeps its own keys, console sessions, registries and eval runs (what the routes
it shares with a node daemon use: `cella.server.front`).
"""

from __future__ import annotations

import asyncio
import logging
import os
from pathlib import Path
from typing import Any

import httpx2

from cella import errors
from cella.config import DaemonSettings
from cella.fleet.backups import GatewayBackups
from cella.fleet.cordons import Cordons
from cella.fleet.delegation import Delegations
from cella.fleet.growth import Growth
from cella.fleet.holds import Holds
from cella.fleet.homes import Homes
from cella.fleet.launch import Launcher
from cella.fleet.locator import Locator
from cella.fleet.membership import Membership
from cella.fleet.moves import FleetMoves
from cella.fleet.named_templates import NamedTemplates
from cella.fleet.node_client import GATHER_TIMEOUT, Node
from cella.fleet.placement_table import Placements
from cella.fleet.planner import Planner
from cella.fleet.quotas import Quotas
from cella.fleet.replicas import Replicas
from cella.fleet.rewrites import FleetRewrites
from cella.fleet.shared_secrets import SharedSecrets
from cella.fleet.shared_webhooks import SharedWebhooks
from cella.fleet.snapshots import FleetSnapshots
from cella.fleet.templates import FleetTemplates
from cella.fleet.volumes import FleetVolumes
from cella.service.background import Background
from cella.service.evals import Evals
from cella.service.image_registries import ImageRegistries
from cella.service.keys import Keys, Principal
from cella.service.sessions import Sessions
from cella.store import Store
from cella.store.sealing import seal_store
from cella.store.sql import Lease, Locks, Presence
from cella.telemetry.prometheus import Exposition, merge

log = logging.getLogger("cella.gateway")


class Gateway:
    def __init__(self, settings: DaemonSettings, address: str, node_root: Path | None) -> None:
        os.umask(0o077)
        self.settings = settings
        self.prometheus = Exposition()  # the gateway's own requests; nodes count the rest
        root = settings.data_dir
        root.mkdir(parents=True, exist_ok=True)
        # one PostgreSQL database for several gateways, else SQLite files of this one
        shared = settings.database_url

        def kept_in(file: str) -> Path | str:
            return shared or root / file

        self.shared = shared is not None
        self.store = Store(kept_in("gateway.db"))
        self.presence = Presence(kept_in(""))  # that this gateway lives, to the others
        self.presence.hold()
        secrets_key = seal_store(
            self.store,
            settings.secrets_key_file or root / "secrets.key",
            settings.secrets_key_command,
        )
        self.placements = Placements(kept_in("placements.db"))
        self.background = Background()  # backups, which run on if their caller leaves
        self.backups = GatewayBackups(root, self.store, lambda: secrets_key)
        # delegation tokens are checked against the grants the gateway made
        self.keys = Keys(self.store, grant_of=lambda sid: self.delegations.grant_of(sid))
        self.keys.ensure_admin_key(root)
        self.delegations = Delegations(kept_in("grants.db"), settings, self.placements, self.keys)
        self.sessions = Sessions(self.keys, root / "session.key")  # the web console's
        self.evals = Evals(  # eval runs are recorded here, not on a node
            self.store, lambda sid: where.tenant if (where := self.placements.get(sid)) else None
        )
        self.membership = Membership(
            address,
            settings.ray_allow_unauthenticated,
            str(node_root or root / "nodes"),
            self.placements,
            on_join=self._joining,
            lease=Lease(kept_in(""), "membership"),  # one gateway marks sandboxes lost
        )
        self.secrets = SharedSecrets(self.store, secrets_key, self.membership)
        self.image_registries = ImageRegistries(self.store)  # lent to a node for a pull
        self.webhooks = SharedWebhooks(self.store, self.membership)
        homes = Homes(kept_in("homes.db"))  # the node each volume and named template lives on
        self.volumes = FleetVolumes(self.membership, homes)
        self.template_homes = NamedTemplates(self.membership, homes)
        self.templates = FleetTemplates(kept_in("templates.db"), self.membership)
        self.locator = Locator(self.membership, self.placements)
        self.snapshots = FleetSnapshots(self.membership)
        self.rewrites = FleetRewrites(
            kept_in("rewrites.db"), root / "rewrites.key", self.locator, self.keys, self.delegations
        )
        # nodes that take nothing new (an older gateway kept them in a file of its own)
        self.cordons = Cordons(kept_in("cordons.db"), legacy=root / "cordoned.json")
        planner = Planner(self.membership, self.cordons, self.templates.shippable)
        self.growth = Growth(
            self.membership,
            planner,
            settings.fleet_autoscale,
            settings.fleet_scale_up_wait_s,
            settings.fleet_scale_down_grace_s,
        )
        self.moves = FleetMoves(
            self.membership, self.locator, planner, self.cordons, self.growth, self.volumes
        )
        self.launcher = Launcher(
            self.membership,
            self.locator,
            Quotas(
                self.placements,
                self.membership,
                settings.max_sandboxes_per_tenant,
                # what every gateway is making: a gateway that is gone holds nothing
                Holds(self.placements.db, self.presence.id, self.presence.alive),
            ),
            planner,
            self.snapshots,
            self.delegations,
            self.rewrites,
            self.volumes,
            self.growth,
            self.templates,
        )
        self.replicas = Replicas(
            kept_in("replicas.db"),
            settings,
            self.membership,
            self.locator,
            planner,
            self.snapshots,
            # records an older gateway kept in its own file, before it shared a database
            legacy=root / "replicas.db" if self.shared else None,
            locks=Locks(kept_in("")),  # one gateway refreshes a replica at a time
            lease=Lease(kept_in(""), "replicas"),  # one runs the period
        )
        self.launcher.created = self._created
        self.launcher.keeps_memory = self.replicas.keep_memory
        self.locator.shown = self.replicas.shown
        self.snapshots.hidden = self.replicas.hidden
        self.membership.on_lost = self.replicas.recover

    async def start(self) -> None:
        """Joins the cluster and every live node (and its daemon) before serving."""
        await self.membership.start()
        await self.growth.start()
        self.replicas.start()

    async def shutdown(self) -> None:
        await self.replicas.shutdown()
        await self.growth.shutdown()
        await self.background.close()
        await self.membership.shutdown()
        self.presence.close()

    def _created(self, who: Principal, body: dict[str, Any], replicate: bool) -> None:
        if self.replicas.wanted(who.tenant, replicate):
            self.replicas.add(str(body["id"]), who.tenant)

    async def _joining(self, node: Node) -> None:
        await self.secrets.push_to(node)  # a sandbox placed there may use any of them
        await self.webhooks.push_to(node)  # and its events go to every webhook
        await self.templates.push_to(node)  # templates built through here: shipped there
        link = self.rewrites.link(node.name)  # its rewrites are decided here
        if link is not None:
            await node.json("PUT", "/v1/fleet/link", json=link)

    async def metrics_text(self) -> str:
        """The gateway's metrics and every healthy node's, each sample labelled with its
        node; a node that does not answer is left out (and `cella_fleet_node_up` says so)."""

        async def of(node: Node) -> str | None:
            try:
                answer = await node.call("GET", "/metrics", timeout=GATHER_TIMEOUT)
            except (httpx2.HTTPError, OSError, errors.CellaError) as exc:
                log.warning("metrics of node %s: %s", node.name, exc)
                return None
            return answer.text if answer.is_success else None

        nodes = self.membership.healthy()
        texts = await asyncio.gather(*(of(n) for n in nodes))
        up = "".join(
            f'cella_fleet_node_up{{node="{n.name}"}} {int(t is not None)}\n'
            for n, t in zip(nodes, texts, strict=True)
        )
        own = (
            self.prometheus.text()
            + "# HELP cella_fleet_node_up Whether the node's metrics answered.\n"
            + "# TYPE cella_fleet_node_up gauge\n"
            + up
        )
        return merge({"": own, **{n.name: t for n, t in zip(nodes, texts, strict=True) if t}})

    async def snapshot_id(self, who: Principal, ref: str) -> str:
        """The id of the caller's snapshot `ref`, wherever in the fleet it is."""
        snap, _ = await self.snapshots.resolve(who, ref)
        return str(snap["id"])
