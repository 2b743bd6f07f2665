"""Which listen settings `cella serve` accepts: no API in clear beyond loopback."""

from __future__ import annotations

from pathlib import Path

import pytest

from cella.config import DaemonSettings

CERT = {"tls_cert": Path("/c.pem"), "tls_key": Path("/k.pem")}


@pytest.mark.parametrize(
    ("listen", "extra"),
    [
        ("127.0.0.1:8420", {}),
        ("127.0.0.5:8420", {}),
        ("localhost:8420", {}),
        ("[::1]:8420", {}),
        ("0.0.0.0:8420", CERT),
        ("10.1.2.3:8420", {"allow_insecure_listen": True}),
    ],
)
def test_accepted(listen: str, extra: dict[str, object]) -> None:
    DaemonSettings(listen=listen, **extra).check_listen()  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("listen", "extra", "why"),
    [
        ("0.0.0.0:8420", {}, "not a loopback address"),
        ("10.1.2.3:8420", {}, "not a loopback address"),
        ("[::]:8420", {}, "not a loopback address"),
        ("example.com:8420", {}, "not a loopback address"),
        ("127.0.0.1:8420", {"tls_cert": Path("/c.pem")}, "both tls_cert and tls_key"),
    ],
)
def test_refused(listen: str, extra: dict[str, object], why: str) -> None:
    with pytest.raises(ValueError, match=why):
        DaemonSettings(listen=listen, **extra).check_listen()  # type: ignore[arg-type]


def test_the_url_follows_tls() -> None:
    assert DaemonSettings(listen="127.0.0.1:9").url == "http://127.0.0.1:9"
    assert DaemonSettings(listen="127.0.0.1:9", **CERT).url == "https://127.0.0.1:9"  # type: ignore[arg-type]
