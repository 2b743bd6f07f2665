"""What a guest server is asked for and what its answer may set in a browser: the path
sent to the guest is the one the daemon checked; a guest's cookies stay inside its port's
path on the daemon's host, and inside its own host name when reached by it."""

from __future__ import annotations

import pytest

from cella.server.routes.ports import cookie_for_host, cookie_under
from cella.service.ports import guest_path

PREFIX = "/v1/services/sb-0123456789abcdef/8000"
HOST = "8000-sb-0123456789abcdef.localhost"


@pytest.mark.parametrize(
    ("matched", "sent"),
    [
        ("", "/"),
        ("index.html", "/index.html"),
        ("static/", "/static/"),
        ("a/../b", "/b"),  # `%2e%2e` arrives decoded, as `..`
        ("../../v1/keys", "/v1/keys"),  # never above the guest's root
        ("contexts/../execute", "/execute"),
        ("a//b", "/a/b"),
        ("a/./b/.", "/a/b/"),
        ("a/b/..", "/a/"),
        ("a?b=1#c", "/a%3Fb=1%23c"),  # a decoded `?` or `#` stays in the path
        ("sp ace/é", "/sp%20ace/%C3%A9"),
        ("100%", "/100%25"),
    ],
)
def test_the_guest_is_sent_the_path_that_was_matched(matched: str, sent: str) -> None:
    assert guest_path(matched) == sent


@pytest.mark.parametrize(
    ("cookie", "kept"),
    [
        ("app=1; Path=/; HttpOnly", f"app=1; HttpOnly; Path={PREFIX}/"),
        ("app=1; path=/docs", f"app=1; Path={PREFIX}/docs"),
        ("here=1", f"here=1; Path={PREFIX}/set"),  # the default path of `/set/deep`
        ("here=1; Path=relative", f"here=1; Path={PREFIX}/set"),
        ("cella_session=planted; Path=/", None),
        (f"cella_service_sb-0123456789abcdef_8000=x; Path={PREFIX}", None),
        ("=cella_session=planted", None),  # nameless: sent as `cella_session=planted`
        ("cella_session", None),
        ("wide=1; Domain=127.0.0.1", None),
        ("wide=1; Path=/; domain=.localhost", None),
    ],
)
def test_a_cookie_on_the_daemons_host_stays_in_its_ports_path(
    cookie: str, kept: str | None
) -> None:
    assert cookie_under(cookie, PREFIX, "/set/deep") == kept


def test_a_cookie_at_the_guests_root_gets_the_ports_path() -> None:
    assert cookie_under("a=1", PREFIX, "/") == f"a=1; Path={PREFIX}/"


@pytest.mark.parametrize(
    ("cookie", "kept"),
    [
        ("app=1; Path=/", True),
        ("cella_session=its-own; Path=/", True),  # host-only: never sent to the daemon's
        (f"own=1; Domain={HOST}", True),
        (f"own=1; Domain=.{HOST.upper()}", True),
        ("parent=1; Domain=localhost", False),
        ("parent=1; Domain=.localhost", False),
        ("daemon=1; Domain=127.0.0.1", False),
        ("other=1; Domain=8001-sb-0123456789abcdef.localhost", False),
        ("=nameless", False),
    ],
)
def test_a_cookie_on_a_host_name_stays_on_that_host(cookie: str, kept: bool) -> None:
    assert cookie_for_host(cookie, HOST) == (cookie if kept else None)
