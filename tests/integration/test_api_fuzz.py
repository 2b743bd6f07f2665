"""A bounded schemathesis run against the committed OpenAPI on a live daemon: no 5xx."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.daemon import Daemon, DaemonFactory

pytestmark = [pytest.mark.vm, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture()
def small_daemon(daemon_factory: DaemonFactory) -> Daemon:
    # tight limits keep the fuzzer's valid creates cheap: one small VM each
    return daemon_factory(
        max_vcpus="1",
        max_memory_mib="256",
        max_upload_mib="1",
        pool_size="0",
        max_sandboxes_per_tenant="3",
    )


@pytest.mark.hardening
@pytest.mark.timeout(1200)
def test_no_server_errors_under_fuzzing(small_daemon: Daemon) -> None:
    fuzz(small_daemon, examples=40, seed=7)


def fuzz(small_daemon: Daemon, examples: int, seed: int) -> None:
    with small_daemon.client() as client:
        target = client.create(memory_mib=256)  # one real sandbox for the per-sandbox routes
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "schemathesis.cli",
            "--config-file",
            str(Path(__file__).with_name("schemathesis.toml")),
            "run",
            str(ROOT / "openapi.json"),
            "--url",
            small_daemon.url,
            "-H",
            f"Authorization: Bearer {small_daemon.admin_key}",
            "--checks",
            "not_a_server_error",
            "--max-examples",
            str(examples),
            "--phases",
            "examples,coverage,fuzzing",
            "--seed",
            str(seed),
            "--request-timeout",
            "120",
            "--generation-allow-x00",
            "true",
            # the target must stay running for the other routes to be exercised
            "--exclude-operation-id",
            "delete_sandbox_v1_sandboxes__sandbox_id__delete",
            "--exclude-operation-id",
            "stop_sandbox_v1_sandboxes__sandbox_id__stop_post",
            # they pull from the URL they are given: fuzzing them would send traffic anywhere
            "--exclude-operation-id",
            "import_snapshot_v1_snapshots_import_post",
            "--exclude-operation-id",
            "import_sandbox_v1_sandboxes_import_post",
            "--exclude-operation-id",
            "import_template_v1_templates_import_post",
            # a move's export freezes the target and its finish removes it
            "--exclude-operation-id",
            "export_sandbox_v1_sandboxes__sandbox_id__export_post",
            "--exclude-operation-id",
            "finish_export_v1_sandboxes__sandbox_id__export_finish_post",
            # a webhook's URL is looked up when it is set: fuzzing it would ask DNS anything
            "--exclude-operation-id",
            "create_webhook_v1_webhooks_post",
            "--exclude-operation-id",
            "update_webhook_v1_webhooks__webhook_id__patch",
            # the fuzzer finds key ids in the audit log and would revoke the key it uses
            "--exclude-operation-id",
            "revoke_key_v1_keys__key_id__delete",
        ],
        capture_output=True,
        text=True,
        timeout=1100,
        env={"PATH": "/usr/bin:/bin", "CELLA_FUZZ_SANDBOX": target.id},
    )
    failures = result.stdout.find("FAILURES")  # the failing calls first, whole
    report = result.stdout[max(0, failures) :][:12000] + result.stderr[-2000:]
    assert result.returncode == 0, report
    assert "passed" in result.stdout.lower()
    with small_daemon.client() as client:
        assert client.get(target.id).state == "running"  # the target was not broken
