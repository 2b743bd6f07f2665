"""Host-level admission: tenant quotas and committed RAM/vCPUs, refused with clear codes."""

from __future__ import annotations

import pytest

from cella import errors
from tests.daemon import DaemonFactory

pytestmark = pytest.mark.vm


def test_quotas_and_capacity_refuse_what_would_exceed_them(daemon_factory: DaemonFactory) -> None:
    d = daemon_factory(
        pool_size="0",
        max_sandboxes_per_tenant="2",
        max_host_memory_mib="1300",
        max_host_vcpus="4",
    )
    with d.client() as admin:
        bob = d.client(admin.create_key("bob")["key"])
        a = admin.create()
        b = admin.create()
        with pytest.raises(errors.QuotaExceeded):
            admin.create()  # the tenant's third
        cap = admin.capacity()
        assert (cap.memory_mib, cap.memory_mib_committed, cap.memory_mib_free) == (
            1300,
            1024,
            276,
        )
        assert (cap.vcpus_committed, cap.vcpus_free, cap.live_sandboxes) == (2, 2, 2)
        with pytest.raises(errors.PermissionDenied):
            bob.capacity()
        with pytest.raises(errors.CapacityExceeded, match="MiB"):
            bob.create()  # 3 x 512 MiB > 1300 MiB on the host
        with pytest.raises(errors.QuotaExceeded):
            a.fork(2)  # counted before anything is made
        assert sorted(s.id for s in admin.list()) == sorted([a.id, b.id])
        assert bob.list() == []
        b.delete()  # frees both the quota and the capacity
        (c,) = a.fork(1)
        assert c.exec("echo ok").stdout == b"ok\n"
        with pytest.raises(errors.CapacityExceeded, match="vCPUs"):
            bob.create(vcpus=3, memory_mib=128)
        bob.close()
