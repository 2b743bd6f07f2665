"""Templates once per fleet (collected by `tests/integration/test_fleet.py` only, inside a
loopback-only network namespace): a template built at the gateway is built on one node and
shipped by digest to a node that keeps its own templates when a sandbox of it is placed
there; a copy altered on its way is refused there (the control: the same relay, not
altering, delivers it)."""

from __future__ import annotations

import contextlib
import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import httpx2

from cella.fleet.relay import NODE_HINT
from cella.fleet.tls import trusting
from cella.images.oci import file_sha256
from tests.fleet.conftest import NODE_SETTINGS, SHAPE, Fleet
from tests.fleet.outside import PASSWORD, REGISTRY, USER, Outside
from tests.fleet.shared_checks import made, shell, wait_for

NAME = "fleet-ship"
OWN = "t1"  # a node with its own template directory (other nodes here share the cache's)


def node_info(fleet: Fleet, node: str) -> dict[str, Any]:
    return next(n for n in fleet.admin.get("/v1/fleet").json()["nodes"] if n["name"] == node)


def as_admin(fleet: Fleet, node: str, method: str, path: str, **kwargs: Any) -> httpx2.Response:
    """A call straight to a node daemon with its admin key (as the gateway makes them)."""
    key = (fleet.node_root / node / "admin.key").read_text().strip()
    return httpx2.request(
        method,
        f"{node_info(fleet, node)['url']}{path}",
        headers={"authorization": f"Bearer {key}"},
        verify=trusting((fleet.node_root / node / "tls" / "node.crt").read_text()),
        timeout=120,
        **kwargs,
    )


@contextlib.contextmanager
def relay_to(fleet: Fleet, node: str) -> Iterator[dict[str, Any]]:
    """A plain-HTTP relay on loopback to a node daemon that, while `tamper` is set, flips a
    byte in the middle of every template base it carries."""
    upstream = node_info(fleet, node)["url"]
    verify = trusting((fleet.node_root / node / "tls" / "node.crt").read_text())
    state: dict[str, Any] = {"tamper": False, "flipped": 0}

    class Relay(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            headers = {"authorization": self.headers.get("authorization", "")}
            got = httpx2.get(upstream + self.path, headers=headers, verify=verify, timeout=120)
            body = bytearray(got.content)
            if state["tamper"] and self.path.endswith("/base") and body:
                body[len(body) // 2] ^= 0x01
                state["flipped"] += 1
            self.send_response(got.status_code)
            self.send_header("content-type", got.headers.get("content-type", "application/json"))
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(bytes(body))

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Relay)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        state["url"] = f"http://127.0.0.1:{server.server_address[1]}"
        yield state
    finally:
        server.shutdown()
        server.server_close()


def test_a_template_is_built_once_and_shipped_by_digest(
    fleet: Fleet, tenant: httpx2.Client, outside: Outside
) -> None:
    # the tenant's key through a new client: the gateway may serve TLS by now (the
    # LangSmith checks' last step), which clients made before do not speak
    tenant = fleet.client(tenant.headers["authorization"].split()[1])
    fleet.cluster.add(OWN, **NODE_SETTINGS, template_dir="templates")
    own = fleet.node_root / OWN / "templates"
    login = {"value": f"{USER}:{PASSWORD}", "hosts": [outside.registry.addr]}
    try:
        wait_for(lambda: any(n["name"] == OWN and n["healthy"]
                             for n in fleet.admin.get("/v1/fleet").json()["nodes"]),
                 180, f"{OWN} to join")  # fmt: skip
        assert fleet.admin.put("/v1/secrets/fleet-ship-registry", json=login).status_code == 200
        image = outside.image.replace(REGISTRY, outside.registry.addr)
        body = {"name": NAME, "image": image, "registry_secret": "fleet-ship-registry"}
        answer = fleet.admin.post("/v1/templates", json=body, headers={NODE_HINT: "n1"},
                                  timeout=600)  # fmt: skip
        assert answer.status_code == 200, answer.text
        events = [json.loads(line) for line in answer.text.splitlines() if line.strip()]
        assert events[-1]["type"] == "done", events[-1]
        named = {e["message"].split("]")[0] + "]" for e in events if e["type"] == "progress"}
        assert named == {"[n1]"}, named  # built on one node only
        shown = made(fleet.admin.get(f"/v1/templates/{NAME}"), 200)
        assert (shown["built_on"], shown["builds"], shown["ships"]) == ("n1", 1, 0), shown
        assert OWN not in shown["nodes"]
        source = made(as_admin(fleet, "n1", "GET", f"/v1/templates/{NAME}"), 200)
        assert as_admin(fleet, OWN, "GET", f"/v1/templates/{NAME}").status_code == 404

        # a sandbox of it placed on the node that lacks it: shipped there, not built
        sb = made(tenant.post("/v1/sandboxes", json={**SHAPE, "template": NAME},
                              headers={NODE_HINT: OWN}))  # fmt: skip
        try:
            assert fleet.node_of(str(sb["id"])) == OWN
            assert "from the upper layer" in shell(tenant, sb["id"], "cat /app/hello.txt")
        finally:
            tenant.delete(f"/v1/sandboxes/{sb['id']}")
        there = made(as_admin(fleet, OWN, "GET", f"/v1/templates/{NAME}"), 200)
        assert there["sha256"] == source["sha256"] and there["shipped_from"] == "n1", there
        assert there["seconds"] == source["seconds"]  # the build's own timings, not a new build
        bases = list(own.glob("*.qcow2"))
        assert [file_sha256(b) for b in bases] == [source["sha256"]]
        shown = made(fleet.admin.get(f"/v1/templates/{NAME}"), 200)
        assert (shown["builds"], shown["ships"]) == (1, 1) and OWN in shown["nodes"], shown

        # a copy altered on its way is refused and deleted; the same relay unaltered delivers
        assert as_admin(fleet, OWN, "DELETE", f"/v1/templates/{NAME}").status_code == 204
        key = (fleet.node_root / "n1" / "admin.key").read_text().strip()
        with relay_to(fleet, "n1") as relay:
            asked = {"source_url": relay["url"], "source_key": key, "source_node": "n1",
                     "name": NAME}  # fmt: skip
            relay["tamper"] = True
            refused = as_admin(fleet, OWN, "POST", "/v1/templates/import", json=asked)
            assert refused.status_code == 409, refused.text
            assert refused.json()["error"]["code"] == "template_corrupt", refused.text
            assert relay["flipped"] == 1
            assert list(own.glob("*.qcow2")) == [] and list(own.glob(".incoming-*")) == []
            assert as_admin(fleet, OWN, "GET", f"/v1/templates/{NAME}").status_code == 404
            relay["tamper"] = False
            taken = as_admin(fleet, OWN, "POST", "/v1/templates/import", json=asked)
            assert taken.status_code == 201, taken.text
            assert taken.json()["sha256"] == source["sha256"]
        assert [file_sha256(b) for b in own.glob("*.qcow2")] == [source["sha256"]]
    finally:
        fleet.admin.delete(f"/v1/templates/{NAME}")
        fleet.admin.delete("/v1/secrets/fleet-ship-registry")
        fleet.cluster.kill(OWN)
        tenant.close()
        # the checks after these find the fleet as it was: the gateway knows OWN is gone
        # (a node that merely does not answer is still planned on)
        wait_for(lambda: own_gone(fleet), timeout=180, what=f"the gateway to see {OWN} gone")
    assert list(own.glob("*.qcow2")) == []  # removed from every node


def own_gone(fleet: Fleet) -> bool:
    nodes = {n["name"]: n for n in fleet.admin.get("/v1/fleet").json()["nodes"]}
    node = nodes.get(OWN)
    return node is None or (
        not node["healthy"] and "does not answer" not in (node.get("reason") or "")
    )
