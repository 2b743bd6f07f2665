"""A fleet on a real multi-node Ray cluster, run inside a loopback-only network namespace.

Ray binds and probes more than loopback when it can, so the fleet's checks (an autoscaling
cluster whose nodes come and go, `tests/fleet/autoscale_checks.py`; then
`tests/fleet/fleet_checks.py`: a head, three and then four nodes with Ray's token
authentication on, node daemons, a gateway, real microVMs, and a second cluster without
token authentication that the gateway and nodes refuse) run in a pytest of their own inside
`unshare -n` with only `lo` up; this test starts it and requires every check to pass, none
skipped.
"""

from __future__ import annotations

import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from tests.fleet.e2b_checks import E2B
from tests.sdk_env import sdk_python

pytestmark = [pytest.mark.vm, pytest.mark.slow]
ROOT = Path(__file__).resolve().parents[2]
# run in one session: first the autoscaler's checks on a cluster of their own (gone before
# the next one starts), then on one cluster: the fleet's own checks, what its nodes share
# (volumes, webhooks, templates), moves (also of sandboxes mounting volumes), then E2B's
# SDK's, placement around a silent node and replication through E2B's SDK (which speaks
# plain HTTP to the gateway: before the next), then the LangSmith SDK's (whose last check
# has the gateway serve TLS), a template shipped by digest to a node that joins for it, the
# operator's (safe retries, backups of the gateway), replicas, then two more gateways
# sharing PostgreSQL (one killed: they leave the nodes pointing at a gateway that is gone,
# so they run last)
CHECKS = [
    ROOT / "tests" / "fleet" / name
    for name in (
        "autoscale_checks.py",
        "fleet_checks.py",
        "shared_checks.py",
        "move_checks.py",
        "volume_move_checks.py",
        "e2b_checks.py",
        "placement_checks.py",
        "langsmith_checks.py",
        "template_ship_checks.py",
        "ops_checks.py",
        "replica_checks.py",
        "gateways_checks.py",
    )
]


def check_names() -> list[str]:
    return [
        line.split("(")[0][4:]
        for checks in CHECKS
        for line in checks.read_text().splitlines()
        if line.startswith("def test_")
    ]


@pytest.mark.timeout(1500)
def test_the_fleet_on_a_ray_cluster(tmp_path: Path) -> None:
    sdk_python("e2b-2.63.0", E2B)  # the registry is out of the namespace's reach
    report = tmp_path / "fleet.xml"
    inner = (
        "ip link set lo up && exec "
        f"{sys.executable} -m pytest -q -p no:cacheprovider -p no:randomly "
        f"--junitxml={report} {' '.join(map(str, CHECKS))}"
    )
    proc = subprocess.run(
        ["unshare", "--net", "--", "sh", "-c", inner],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=1400,
        check=False,
    )
    failures = proc.stdout.find("= FAILURES =")  # the first failure's story, whole
    output = proc.stdout[max(0, failures) :][:30000] + proc.stderr[-5000:]
    assert report.exists(), output
    cases = ET.parse(report).getroot().iter("testcase")
    outcomes, seconds = {}, {}
    for case in cases:
        seconds[case.get("name")] = float(case.get("time") or 0)
        failed = case.find("failure") is not None or case.find("error") is not None
        skipped = case.find("skipped") is not None
        outcomes[case.get("name")] = "failed" if failed else "skipped" if skipped else "passed"
    slowest = sorted(seconds.items(), key=lambda item: -item[1])[:15]
    print("slowest fleet checks:", *(f"{t:7.1f} s  {name}" for name, t in slowest), sep="\n")
    assert outcomes == dict.fromkeys(check_names(), "passed"), output
    assert proc.returncode == 0, output
