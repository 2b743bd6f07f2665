"""Rewrite rules' pieces that need no VM: what a rule may name (`models.RewriteRule`), what
`strip`, `redact` and `keep` do to a request's headers (`policy/rewrites.py`), the deny
rule that still wins, and how a LangSmith `rewrite` rule is read."""

from __future__ import annotations

from types import SimpleNamespace

import pydantic
import pytest

from cella import errors
from cella.models import NetworkPolicy, RewriteRule
from cella.network.rewrites import ROUTE_HOST, rewrites_from, route
from cella.policy.egress import Policy
from cella.policy.rewrites import guard, redact
from cella.server.compat.langsmith.proxy_config import rewrite_rules


class Headers:
    """A multi-valued header map with the calls mitmproxy's `Headers` has that `guard`
    uses (case-insensitive names, several values a name)."""

    def __init__(self, *pairs: tuple[str, str]) -> None:
        self.pairs = list(pairs)

    def get_all(self, name: str) -> list[str]:
        return [v for k, v in self.pairs if k.lower() == name.lower()]

    def set_all(self, name: str, values: list[str]) -> None:
        del self[name]
        self.pairs += [(name, v) for v in values]

    def __delitem__(self, name: str) -> None:
        self.pairs = [(k, v) for k, v in self.pairs if k.lower() != name.lower()]


def to(sandbox: str = "sb-1", port: int = 8000) -> dict[str, object]:
    return {"sandbox": sandbox, "port": port}


def test_a_rewrite_names_one_exact_host_and_a_sandbox_port() -> None:
    rule = RewriteRule.model_validate({"host": "API.Internal.", "to": to()})
    assert rule.host == "api.internal" and rule.credentials == "strip"
    for host in ("10.0.0.1", "*.internal", "*", "api.internal:80", "cella.api", "a b"):
        with pytest.raises(pydantic.ValidationError):
            RewriteRule.model_validate({"host": host, "to": to()})
    for target in (to(port=0), to(port=70000), to(sandbox="")):
        with pytest.raises(pydantic.ValidationError):
            RewriteRule.model_validate({"host": "api.internal", "to": target})
    with pytest.raises(pydantic.ValidationError):
        RewriteRule.model_validate({"host": "a.b", "to": to(), "credentials": "leak"})
    twice = [{"host": "a.b", "to": to()}, {"host": "a.b", "to": to(port=1)}]
    with pytest.raises(pydantic.ValidationError, match="one rewrite a host"):
        NetworkPolicy.model_validate({"rewrites": twice})


def test_strip_removes_credential_headers_and_those_rules_add() -> None:
    headers = Headers(
        ("Authorization", "Bearer x"),
        ("Cookie", "a=1"),
        ("Cookie", "b=2"),
        ("X-Api-Key", "k"),
        ("X-Rule", "secret"),
        ("Accept", "*/*"),
    )
    acted = guard(headers, "strip", ["X-Rule"])
    assert acted == ["authorization", "cookie", "x-api-key", "x-rule"]
    assert headers.pairs == [("Accept", "*/*")]


def test_redact_keeps_each_header_with_a_marker() -> None:
    headers = Headers(("authorization", "Basic Z3Vlc3Q6cHc="), ("Cookie", "a=1"), ("Cookie", "b"))
    assert guard(headers, "redact") == ["authorization", "cookie"]
    assert headers.get_all("Authorization") == ["Basic redacted"]
    assert headers.get_all("cookie") == ["redacted", "redacted"]
    # only a known scheme is kept: a header rule's value may begin with its secret
    assert redact("Authorization", "s3cr3t rest") == "redacted"
    assert redact("Authorization", "Bearer") == "redacted"
    assert redact("X-Token", "Bearer abc") == "redacted"


def test_keep_leaves_every_header() -> None:
    headers = Headers(("Authorization", "Bearer x"), ("Cookie", "a=1"))
    assert guard(headers, "keep", ["Authorization"]) == []
    assert headers.pairs == [("Authorization", "Bearer x"), ("Cookie", "a=1")]


def test_the_proxy_sends_a_rewritten_request_to_the_daemons_door() -> None:
    """What the addon is given (`SandboxEgress.attach` through `Rewrites.for_proxy`), and
    the request it makes of it: the daemon's path, its token, the Host the sandbox sent."""
    msg = {
        "rewrites": {
            "upstream": ["::1", 8420],
            "token": "tok",
            "rules": [
                {"host": "api.internal", "sandbox": "sb-b", "port": 8000, "credentials": "keep"}
            ],
        }
    }
    rewrites = rewrites_from(msg)
    assert rewrites is not None and rewrites.upstream == ("::1", 8420)
    rule = rewrites.find("API.internal.")
    assert rule is not None and (rule.sandbox, rule.port, rule.credentials) == (
        "sb-b",
        8000,
        "keep",
    )
    assert rewrites.find("other.internal") is None
    assert rewrites_from({"rewrites": None}) is None and rewrites_from({}) is None
    req = SimpleNamespace(
        host="api.internal",
        port=443,
        scheme="https",
        path="/a/../b?x=1",
        host_header="api.internal:8443",
        headers={"x-cella-rewrite-token": "the guest's"},
    )
    route(req, "sb-a", rewrites, rule)
    assert (req.scheme, req.host, req.port) == ("http", ROUTE_HOST, 8420)
    assert req.path == "/v1/rewrites/sb-a/api.internal/a/../b?x=1"  # as the sandbox sent it
    assert req.host_header == "[::1]:8420"
    assert req.headers == {
        "x-cella-rewrite-token": "tok",  # the proxy's, never the guest's
        "x-cella-rewrite-host": "api.internal:8443",
    }


def test_a_deny_rule_still_wins_over_a_rewrite() -> None:
    policy = Policy.parse([], ["*.internal", "other.test:80"])
    denied = policy.denial("API.internal.", 443)
    assert denied is not None and "*.internal" in denied.reason
    assert policy.denial("other.test", 443) is None  # a port rule covers only its port
    assert Policy.parse(["api.internal"], []).denial("api.internal", 80) is None


def test_a_langsmith_rewrite_rule_is_one_cella_rule_per_host() -> None:
    rule = {
        "name": "svc",
        "type": "rewrite",
        "match_hosts": ["a.internal", "b.internal"],
        "rewrite": {"sandbox": "server", "port": 8080},
    }
    rules = rewrite_rules(rule)
    assert [(r.host, r.to.sandbox, r.to.port, r.credentials) for r in rules] == [
        ("a.internal", "server", 8080, "strip"),  # LangSmith's default
        ("b.internal", "server", 8080, "strip"),
    ]
    refused = [
        ({**rule, "rewrite": {"host": "example.com", "port": 443}}, "outside host"),
        ({**rule, "match_paths": ["/v1/*"]}, "match_paths"),
        ({**rule, "match_headers": ["x: y"]}, "match_headers"),
        ({**rule, "rewrite": {**rule["rewrite"], "via": "x"}}, "via"),  # type: ignore[dict-item]
    ]
    for given, named in refused:
        with pytest.raises(errors.RequestError, match=f"not supported by cella.*{named}"):
            rewrite_rules(given)
    for given in (
        {**rule, "rewrite": {"port": 8080}},
        {**rule, "match_hosts": []},
        {**rule, "rewrite": None},
    ):
        with pytest.raises(errors.InvalidArgument):
            rewrite_rules(given)
