"""Running the gateway like infrastructure (collected by `tests/integration/test_fleet.py`
only, inside a loopback-only network namespace): retries that are safe through it
(`Idempotency-Key` on creates, forks and snapshots), and `cella backup` / `cella restore` of
its data directory onto a fresh one, where a new gateway finds the fleet's sandboxes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx2
import pytest

from tests.daemon import Daemon
from tests.fleet.conftest import SHAPE, Fleet


@pytest.fixture(scope="module")
def ops(fleet: Fleet) -> Any:
    """A tenant of these checks, its client made now (the gateway may serve TLS by now:
    `langsmith_checks`' last check turns it on)."""
    key = fleet.admin.post("/v1/keys", json={"tenant": "ops"}).json()["key"]
    with fleet.client(key) as client:
        yield client


def post(client: httpx2.Client, path: str, key: str | None, body: dict[str, Any]) -> Any:
    headers = {"Idempotency-Key": key} if key else {}
    return client.post(path, json=body, headers=headers)


def made_once(client: httpx2.Client, path: str, key: str, body: dict[str, Any]) -> Any:
    """Two requests with one key sent together (the second while the first is in flight),
    then a third after they are answered: one answer, three times."""
    with ThreadPoolExecutor(2) as pool:
        both = list(pool.map(lambda _: post(client, path, key, body), range(2)))
    later = post(client, path, key, body)
    answers = [*both, later]
    assert all(a.status_code in (200, 201) for a in answers), [a.text for a in answers]
    first = answers[0].json()
    assert all(a.json() == first or same_ids(a.json(), first) for a in answers), answers
    return first


def same_ids(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """The same things made (a retry reads them again: their state may have moved on)."""

    def ids(x: dict[str, Any]) -> list[str]:
        return [s["id"] for s in x["sandboxes"]] if "sandboxes" in x else [x["id"]]

    return ids(a) == ids(b)


def listed(client: httpx2.Client) -> set[str]:
    return {s["id"] for s in client.get("/v1/sandboxes").json()["sandboxes"]}


def delete_all(client: httpx2.Client) -> None:
    for sandbox_id in listed(client):
        client.delete(f"/v1/sandboxes/{sandbox_id}")
    for snap in client.get("/v1/snapshots").json()["snapshots"]:
        client.delete(f"/v1/snapshots/{snap['id']}")


def test_retries_through_the_gateway_make_one_sandbox(fleet: Fleet, ops: httpx2.Client) -> None:
    tenant = ops
    before = listed(tenant)
    body = {**SHAPE, "labels": {"suite": "retries"}}
    first = made_once(tenant, "/v1/sandboxes", "ops-create-1", body)
    # the same key with another body: refused, and nothing made
    other = post(tenant, "/v1/sandboxes", "ops-create-1", {**SHAPE, "labels": {"suite": "x"}})
    assert other.status_code == 409, other.text
    assert "Idempotency-Key" in other.json()["error"]["message"]
    # the control: another key with the same body makes another sandbox
    second = post(tenant, "/v1/sandboxes", "ops-create-2", body)
    assert second.status_code == 201, second.text
    assert second.json()["id"] != first["id"]
    assert listed(tenant) - before == {first["id"], second.json()["id"]}
    # a key is the tenant's: another tenant's request with it is its own
    other_key = fleet.admin.post("/v1/keys", json={"tenant": "ops-other"}).json()["key"]
    with fleet.client(other_key) as stranger:
        theirs = post(stranger, "/v1/sandboxes", "ops-create-1", body)
        assert theirs.status_code == 201 and theirs.json()["id"] != first["id"], theirs.text
        delete_all(stranger)

    # a fork of a sandbox, a snapshot (relayed to its node) and a fork of the snapshot
    forked = made_once(tenant, f"/v1/sandboxes/{first['id']}/fork", "ops-fork-1", {"count": 1})
    assert len(forked["sandboxes"]) == 1
    snap = made_once(tenant, f"/v1/sandboxes/{first['id']}/snapshots", "ops-snap-1", {})
    snaps = [s["id"] for s in tenant.get("/v1/snapshots").json()["snapshots"]]
    assert snaps.count(snap["id"]) == 1
    path = f"/v1/snapshots/{snap['id']}/fork"
    from_snap = made_once(tenant, path, "ops-fork-2", {"count": 1})
    made = {first["id"], second.json()["id"], forked["sandboxes"][0]["id"]}
    assert listed(tenant) - before == made | {from_snap["sandboxes"][0]["id"]}
    delete_all(tenant)


def cella(env: dict[str, str], *args: str) -> Any:
    done = subprocess.run(
        [sys.executable, "-m", "cella.cli", *args, "--json"],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return json.loads(done.stdout)


def test_a_gateway_backup_restores_onto_a_fresh_data_dir(
    fleet: Fleet, ops: httpx2.Client, tmp_path: Path
) -> None:
    tenant, gateway = ops, fleet.gateway
    body = {**SHAPE, "name": "kept"}
    kept = post(tenant, "/v1/sandboxes", "ops-backup-1", body).json()
    ran = tenant.post(
        f"/v1/sandboxes/{kept['id']}/exec", json={"command": "echo kept > /root/mark"}
    )
    assert ran.status_code == 200, ran.text
    put = tenant.put("/v1/secrets/ops-token", json={"value": "ops-s3cr3t", "hosts": ["api.test"]})
    assert put.status_code == 200, put.text
    env = {**os.environ, "CELLA_URL": gateway.url, "CELLA_API_KEY": gateway.admin_key}
    if gateway.tls is not None:  # the gateway serves TLS by now (langsmith_checks' last)
        env["SSL_CERT_FILE"] = gateway.settings["tls_cert"]
    tenant_key = tenant.headers["authorization"].split()[1]
    refused = tenant.post("/v1/backups", json={"dest": str(tmp_path / "not-mine")})
    assert refused.status_code == 403, refused.text  # a tenant's key backs up nothing

    report = cella(env, "backup", str(tmp_path / "backup"))
    assert report["kind"] == "gateway" and report["store"] == "gateway.db", report
    assert report["secrets_key"] == "excluded" and report["sealed_values"] >= 1
    held = json.loads((tmp_path / "backup" / "backup.json").read_text())["files"]
    assert {"data/gateway.db", "data/placements.db", "data/admin.key"} <= set(held)
    assert not any(name.startswith("data/vms/") for name in held)  # no node's sandbox

    fresh = tmp_path / "restored"
    restored = Daemon(fresh, args=gateway.args, **gateway.settings)
    gateway.stop()
    try:
        done = cella(
            env,
            "restore",
            str(tmp_path / "backup"),
            "--data-dir",
            str(fresh),
            "--secrets-key-file",
            str(gateway.data_dir / "secrets.key"),
        )
        assert done["kind"] == "gateway", done
        restored.start(timeout=120)
        with httpx2.Client(
            base_url=restored.url,
            headers={"authorization": f"Bearer {tenant_key}"},  # the tenant's key, restored
            timeout=httpx2.Timeout(120.0),
            verify=restored.tls or True,
        ) as again:
            assert kept["id"] in listed(again)
            got = again.post(f"/v1/sandboxes/{kept['id']}/exec", json={"command": "cat /root/mark"})
            assert got.status_code == 200 and got.json()["stdout"] == "kept\n", got.text
            secret = again.get("/v1/secrets/ops-token")
            assert secret.status_code == 200 and "ops-s3cr3t" not in secret.text, secret.text
            # its keys came along: a retry of the create gets the first sandbox
            retried = post(again, "/v1/sandboxes", "ops-backup-1", body)
            assert retried.status_code == 201 and retried.json()["id"] == kept["id"], retried.text
    finally:
        restored.stop()
        gateway.start(timeout=120)  # the fleet's own gateway again, for the checks after
    assert tenant.get(f"/v1/sandboxes/{kept['id']}").status_code == 200
    assert tenant.delete("/v1/secrets/ops-token").status_code == 204
    delete_all(tenant)
