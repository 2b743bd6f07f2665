"""The API over TLS, and no API in clear beyond loopback: a daemon with a certificate of
its own, the SDK and plain HTTP clients against it."""

from __future__ import annotations

import ssl
import subprocess
import sys
from pathlib import Path

import httpx2
import pytest

from cella.fleet.tls import node_certificate
from cella.models import RewriteRule, SandboxPort
from tests.daemon import Daemon, DaemonFactory, free_port

pytestmark = pytest.mark.vm


@pytest.fixture(scope="module")
def daemon(
    tmp_path_factory: pytest.TempPathFactory, module_daemon_factory: DaemonFactory
) -> Daemon:
    base = tmp_path_factory.mktemp("tls")
    cert, key = node_certificate(base, "127.0.0.1", "test")  # self-signed, for 127.0.0.1
    return module_daemon_factory(data_dir=base / "data", tls_cert=str(cert), tls_key=str(key))


def test_the_api_speaks_tls_only(daemon: Daemon, monkeypatch: pytest.MonkeyPatch) -> None:
    cert = str(daemon.data_dir.parent / "node.crt")
    trusted = ssl.create_default_context(cafile=cert)
    auth = {"Authorization": f"Bearer {daemon.admin_key}"}
    r = httpx2.get(f"{daemon.url}/v1/sandboxes", headers=auth, verify=trusted)
    assert daemon.url.startswith("https://") and r.status_code == 200
    # the same port in clear: no answer in HTTP
    with pytest.raises(httpx2.RemoteProtocolError, match="without sending a response"):
        httpx2.get(f"http://127.0.0.1:{daemon.port}/v1/health", timeout=5)
    # a client that does not trust the certificate
    with pytest.raises(httpx2.ConnectError, match="CERTIFICATE_VERIFY_FAILED"):
        httpx2.get(f"{daemon.url}/v1/health", timeout=5)
    # the SDK, trusting the certificate the usual way, drives a sandbox
    monkeypatch.setenv("SSL_CERT_FILE", cert)
    with daemon.client() as client, client.create() as sb:
        assert sb.exec("echo over tls").stdout == b"over tls\n"
        # a rewrite rule: the proxy reaches the daemon in clear on a loopback port of its
        # own (`proxy_api_port`), so it works here as on a daemon without TLS
        served = sb.exec("cd /tmp && echo served-here > page.txt && "
                         "(nohup python3 -m http.server 8000 >/dev/null 2>&1 &)")  # fmt: skip
        assert served.exit_code == 0, served.stderr
        to_itself = RewriteRule(host="api.internal", to=SandboxPort(sandbox=sb.id, port=8000))
        sb.set_network(rewrites=[to_itself])
        got = sb.exec("for i in $(seq 50); do curl -sf http://api.internal/page.txt && break; "
                      "sleep 0.2; done")  # fmt: skip
        assert got.stdout == b"served-here\n", got.stdout + got.stderr
        sb.set_network(allow=["pypi.org"])  # the rule gone: the name is refused again
        assert sb.refresh().info.network.allow == ["pypi.org"]
        assert sb.exec("curl -sf -m 10 http://api.internal/page.txt").exit_code != 0
        # access delegation the same way: `cella.api` in the guest is this TLS daemon
        key = client.create_key("tls-team")["key"]
    with daemon.client(key) as team, team.create(access_delegation={"mode": "inherit"}) as box:
        listed = box.exec("curl -s -m 20 http://cella.api/v1/sandboxes")
        assert box.id in listed.stdout.decode(), listed.stdout + listed.stderr
    daemon_file = (daemon.data_dir / "daemon.json").read_text()
    assert f'"url": "{daemon.url}"' in daemon_file  # local clients find https


def test_no_clear_text_api_beyond_loopback(tmp_path: Path) -> None:
    """Refused before anything is bound (nothing listens beyond loopback in a test); what
    is let through is in tests/unit/test_settings.py, and the daemons of every other test
    are the same command on loopback."""
    serve = [sys.executable, "-m", "cella.cli", "serve", "--data-dir", str(tmp_path)]
    refused = subprocess.run(
        [*serve, "--listen", f"0.0.0.0:{free_port()}"], capture_output=True, text=True, timeout=60
    )
    assert refused.returncode == 2 and "not a loopback address" in refused.stderr
    half = subprocess.run(
        [*serve, "--listen", f"127.0.0.1:{free_port()}", "--tls-cert", str(tmp_path / "c")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert half.returncode == 2 and "both tls_cert and tls_key" in half.stderr
