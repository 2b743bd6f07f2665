"""Image registries on a real store: passwords sealed at rest and through a key rotation,
one tenant's registry invisible to another, credentials only for the registry's own host;
and image references that could name a file on the host refused."""

from __future__ import annotations

from pathlib import Path

import httpx2
import pytest

from cella import errors
from cella.models import RegistryCreate
from cella.server.compat.langsmith.control import image_tag
from cella.service.image_registries import ImageRegistries, image_host
from cella.service.image_snapshots import registry_reference
from cella.store import Store
from cella.store.sealing import KeyFile, Sealer
from tests.unit.in_process import serving
from tests.unit.test_sealing import on_disk

PASSWORD = "pw-8c1f0e2a9d7b4c35"


@pytest.fixture
def store(tmp_path: Path) -> Store:
    s = Store(tmp_path / "cella.db")
    s.seal_with(KeyFile(tmp_path / "secrets.key").load(s.opens_with))
    return s


def made(rooms: ImageRegistries, tenant: str = "acme", name: str = "team") -> str:
    req = RegistryCreate(name=name, url="https://Reg.Test:5000/", username="bot", password=PASSWORD)
    return rooms.create(tenant, req).id


def test_the_password_is_sealed_and_survives_a_rotation(store: Store, tmp_path: Path) -> None:
    rooms = ImageRegistries(store)
    made(rooms)
    assert rooms.get("acme", "team").url == "reg.test:5000"  # the host, as images name it
    raw = on_disk(tmp_path / "cella.db")
    assert b"reg.test:5000" in raw  # control: the scan sees the row
    assert PASSWORD.encode() not in raw
    keys = KeyFile(tmp_path / "secrets.key")
    old = Sealer(keys.path.read_bytes())
    assert keys.rotate(store) == 1
    assert not store.opens_with(old)
    again = Store(tmp_path / "cella.db")
    again.seal_with(keys.load(again.opens_with))
    assert ImageRegistries(again).credentials("acme", "team", "reg.test:5000/x:1") == (
        f"bot:{PASSWORD}"
    )


def test_a_registry_is_its_tenants_alone(store: Store) -> None:
    rooms = ImageRegistries(store)
    registry_id = made(rooms)
    assert rooms.get("acme", registry_id).name == "team"  # control: by id and by name
    for key in (registry_id, "team"):
        with pytest.raises(errors.NotFound):
            rooms.get("other", key)
        with pytest.raises(errors.NotFound):
            rooms.credentials("other", key, "reg.test:5000/x:1")
    assert rooms.list("other") == []
    made(rooms, tenant="other")  # the same name in another tenant is its own
    with pytest.raises(errors.Conflict):
        made(rooms)


def test_credentials_go_to_their_own_host_only(store: Store) -> None:
    rooms = ImageRegistries(store)
    made(rooms)
    assert rooms.credentials("acme", "team", "reg.test:5000/team/app@sha256:" + "a" * 64)
    for elsewhere in ("reg.test/x:1", "evil.test:5000/x:1", "busybox:1", "reg.test:5001/x"):
        with pytest.raises(errors.InvalidArgument, match="is not on the registry"):
            rooms.credentials("acme", "team", elsewhere)
    assert image_host("library/busybox") == "docker.io"
    assert image_host("localhost/x") == "localhost"


def test_references_that_could_name_host_files_are_refused() -> None:
    assert registry_reference("docker://reg.test/a/b:1") == "reg.test/a/b:1"
    for bad in ("/etc/passwd", "./layout", "oci:/var/lib/x", "docker-archive:/tmp/a.tar",
                "reg.test/../x", "", "-v", "a b"):  # fmt: skip
        with pytest.raises(errors.InvalidArgument):
            registry_reference(bad)
    assert image_tag("reg.test:5000/team/app:3.12") == "3.12"
    assert image_tag("reg.test:5000/team/app") == "latest"
    assert image_tag("reg.test/app@sha256:" + "a" * 64) == "latest"


async def test_langsmith_create_snapshot_refuses_before_anything_is_made(tmp_path: Path) -> None:
    """Through the real app (fake runtime): each refusal is the SDK's error shape and leaves
    no snapshot row; the control, a registry image, is taken (a row, `building`)."""
    async with serving(tmp_path) as app:
        transport = httpx2.ASGITransport(app=app.app)
        async with httpx2.AsyncClient(transport=transport, base_url="http://cella.test") as c:
            head = {"X-Api-Key": app.admin_key}

            async def post(**body: object) -> httpx2.Response:
                return await c.post("/api/v2/sandboxes/snapshots", headers=head, json=body)

            base = {"name": "pg", "fs_capacity_bytes": 1 << 30}
            for path in ("/etc/passwd", "oci:/var/lib/cella/images/oci", "../x"):
                r = await post(**base, docker_image=path)
                assert r.status_code == 422 and "not a registry image" in r.text, r.text
            r = await post(**base, docker_image="reg.test/a:1", registry_id="nope")
            assert r.status_code == 404 and "Registry 'nope' not found" in r.text
            r = await post(**base, docker_image="reg.test/a:1", labels={"a": "b"})
            assert r.status_code == 400 and "not supported by cella" in r.text
            # a registry at an address outside the egress boundary: refused before a pull
            for image in ("127.0.0.1:9/a:7", "169.254.169.254/a:7", "10.1.2.3/a:7"):
                r = await post(**base, docker_image=image)
                assert r.status_code == 403 and "outside the egress boundary" in r.text, r.text
            assert app.daemon.snapshots.find(None) == []
            # the control, a registry by name (its pull fails later, in the background)
            r = await post(**base, docker_image="reg.test:9/a:7")
            assert r.status_code == 200, r.text
            made = r.json()
            assert made["status"] == "building" and made["name"] == "pg"
            assert [s.id for s in app.daemon.snapshots.find(None)] == [made["id"]]
