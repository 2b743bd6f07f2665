"""Egress rule evaluation (pure logic)."""

from __future__ import annotations

import ipaddress

import pytest
from hypothesis import given
from hypothesis import strategies as st

from cella.policy.egress import Boundary, Policy, host_matches, parse_rule

ip = ipaddress.ip_address
PUBLIC = [ip("93.184.216.34")]


@pytest.mark.parametrize(
    "text",
    ["", "**", "*.", "exa mple.com", "a..b", "-a.com", "a.com:0", "a.com:65536", "a.com:x",
     "*.*.com", "a*.com", "[::1", "x" * 301],
)  # fmt: skip
def test_bad_rules_are_refused_with_a_reason(text: str) -> None:
    with pytest.raises(ValueError, match="invalid rule"):
        parse_rule(text)


def test_rule_forms() -> None:
    assert parse_rule("PyPI.org").domain == "pypi.org"
    wild = parse_rule("*.github.com:443")
    assert (wild.domain, wild.wildcard, wild.port) == ("github.com", True, 443)
    assert parse_rule("10.0.0.0/8").network == ipaddress.ip_network("10.0.0.0/8")
    assert parse_rule("[2001:db8::1]:80").port == 80
    assert parse_rule("1.2.3.4:22").network == ipaddress.ip_network("1.2.3.4/32")


def test_default_deny() -> None:
    decision = Policy().decide("pypi.org", 443, PUBLIC)
    assert not decision.allowed and decision.reason == "no rule allows it"


def test_exact_and_wildcard_domains() -> None:
    p = Policy.parse(["pypi.org", "*.github.com"])
    assert p.decide("pypi.org", 443, PUBLIC).allowed
    assert p.decide("PyPI.org.", 443, PUBLIC).allowed  # case and the root dot
    assert not p.decide("files.pypi.org", 443, PUBLIC).allowed
    assert p.decide("api.github.com", 443, PUBLIC).allowed
    assert p.decide("a.b.github.com", 80, PUBLIC).allowed
    assert not p.decide("github.com", 443, PUBLIC).allowed  # *. is subdomains only
    assert not p.decide("evilgithub.com", 443, PUBLIC).allowed


def test_ports() -> None:
    p = Policy.parse(["pypi.org:443"])
    assert p.decide("pypi.org", 443, PUBLIC).allowed
    assert not p.decide("pypi.org", 80, PUBLIC).allowed


def test_deny_wins() -> None:
    p = Policy.parse(["*.example.com", "93.184.216.0/24"], ["bad.example.com", "93.184.216.34"])
    assert p.decide("good.example.com", 443, [ip("1.1.1.1")]).allowed
    assert p.decide("bad.example.com", 443, PUBLIC).reason == "denied by rule bad.example.com"
    # a name that resolves into a denied address is denied too
    assert not p.decide("good.example.com", 443, PUBLIC).allowed
    assert not p.decide("93.184.216.34", 443).allowed


def test_raw_ips_need_address_rules() -> None:
    p = Policy.parse(["example.com"])
    assert p.decide("example.com", 80, PUBLIC).allowed
    refused = p.decide("93.184.216.34", 80)
    assert not refused.allowed and "address rule" in refused.reason
    assert Policy.parse(["93.184.216.0/24:80"]).decide("93.184.216.34", 80).allowed


def test_non_public_addresses_are_guarded() -> None:
    p = Policy.parse(["internal.example", "0.0.0.0/0", "::/0"])
    for addr in ("127.0.0.1", "10.1.2.3", "169.254.169.254", "192.168.1.1", "::1",
                 "::ffff:127.0.0.1", "fd00::2", "fec0::1", "100.64.0.1", "2002:7f00:1::1",
                 "64:ff9b::a9fe:a9fe"):  # fmt: skip
        decision = p.decide("internal.example", 80, [ip(addr)])
        assert not decision.allowed, addr
        assert "non-public" in decision.reason and "only the operator" in decision.reason
        assert not p.decide(addr, 80).allowed  # /0 does not open the host's own addresses
    # control: public addresses, also in IPv6 forms that carry them
    for addr in ("93.184.216.34", "::ffff:93.184.216.34", "2606:4700::1111"):
        assert p.decide("internal.example", 80, [ip(addr)]).allowed, addr
        assert p.decide(addr, 80).allowed, addr
    # the operator's host table opens them
    assert p.decide("internal.example", 80, [ip("10.1.2.3")], trusted=True).allowed
    # a tenant's narrow address rule does not, unless the operator's tenant networks hold it
    narrow = Policy.parse(["internal.example", "10.1.0.0/16"])
    assert not narrow.decide("internal.example", 80, [ip("10.1.2.3")]).allowed
    assert not narrow.decide("10.1.2.3", 5432).allowed
    opened = Boundary(tenant_networks=(ipaddress.ip_network("10.1.0.0/16"),))
    assert narrow.decide("internal.example", 80, [ip("10.1.2.3")], boundary=opened).allowed
    assert narrow.decide("10.1.2.3", 5432, boundary=opened).allowed
    assert not narrow.decide("10.2.0.1", 5432, boundary=opened).allowed  # outside the network
    # a rule wider than the operator's network opens only what is public
    wide = Policy.parse(["internal.example", "10.0.0.0/8", "0.0.0.0/0"])
    assert not wide.decide("10.1.2.3", 5432, boundary=opened).allowed
    assert not wide.decide("internal.example", 80, [ip("10.1.2.3")], boundary=opened).allowed
    assert wide.decide("internal.example", 80, [ip("10.1.2.3")], trusted=True).allowed  # its name
    # inside the operator's network a tenant's rule is still needed
    assert (
        not Policy.parse(["internal.example"])
        .decide("internal.example", 80, [ip("10.1.2.3")], boundary=opened)
        .allowed
    )
    # a trusted name is not a way to reach a literal address
    assert not p.decide("127.0.0.1", 80, trusted=True).allowed


def test_the_hosts_and_the_fleets_own_addresses_are_closed_even_if_public() -> None:
    host = ip("93.184.216.34")
    boundary = Boundary(protected=frozenset({host}))
    p = Policy.parse(["example.com", "93.184.216.0/24"])
    refused = p.decide("example.com", 443, [host], boundary=boundary)
    assert not refused.allowed and "this host or of a fleet node" in refused.reason
    assert not p.decide("93.184.216.34", 443, boundary=boundary).allowed
    assert not p.decide("::ffff:93.184.216.34", 443, boundary=boundary).allowed
    # control: its neighbour in the same public network
    assert p.decide("93.184.216.35", 443, boundary=boundary).allowed
    assert p.decide("example.com", 443, [ip("93.184.216.35")], boundary=boundary).allowed


@pytest.mark.parametrize(
    "text",
    ["127.0.0.1", "127.0.0.1/32:8420", "10.0.0.0/8", "169.254.169.254:80", "192.168.0.0/16",
     "100.64.0.0/10", "[::1]", "[fd00::/8]", "[fe80::/10]", "[fec0::1]", "[::ffff:127.0.0.1]",
     "[::ffff:10.0.0.0/104]", "[2002:7f00::/24]", "[64:ff9b::a9fe:a9fe]", "localhost",
     "*.localhost:80"],
)  # fmt: skip
def test_tenant_rules_naming_restricted_addresses_are_refused(text: str) -> None:
    why = Boundary().refusal(parse_rule(text))
    assert why is not None and repr(text) in why
    assert "operator" in str(why)


@pytest.mark.parametrize(
    "text",
    ["0.0.0.0/0", "[::/0]", "0.0.0.0/1", "10.0.0.0/7", "93.184.216.34", "[2606:4700::1]",
     "[::ffff:93.184.216.34]", "pypi.org", "*.github.com:443", "*"],
)  # fmt: skip
def test_rules_that_reach_public_addresses_stay(text: str) -> None:
    assert Boundary().refusal(parse_rule(text)) is None


def test_the_operator_opens_networks_and_names() -> None:
    host = ip("93.184.216.34")
    boundary = Boundary(
        protected=frozenset({host}),
        tenant_networks=(ipaddress.ip_network("10.1.0.0/16"), ipaddress.ip_network("::1/128")),
        names=frozenset({"localhost"}),
    )
    for opened in ("10.1.0.0/16", "10.1.2.3:5432", "[::ffff:10.1.2.3]", "[::1]", "localhost"):
        assert boundary.refusal(parse_rule(opened)) is None, opened
    for closed in ("10.0.0.0/8", "10.2.0.1", "93.184.216.34", "127.0.0.1", "a.localhost"):
        assert boundary.refusal(parse_rule(closed)) is not None, closed
    # a node inside a network the operator opened stays closed (only the host table opens it)
    node = ip("10.1.0.5")
    fleet = Boundary(protected=frozenset({node}), tenant_networks=boundary.tenant_networks)
    assert "fleet node" in str(fleet.refusal(parse_rule("10.1.0.5")))
    assert fleet.refusal(parse_rule("10.1.0.0/24")) is None  # its network: the rest of it
    p = Policy.parse(["10.1.0.0/24", "db.internal"])
    assert not p.decide("10.1.0.5", 6379, boundary=fleet).allowed
    assert not p.decide("db.internal", 6379, [node], boundary=fleet).allowed
    assert p.decide("10.1.0.6", 6379, boundary=fleet).allowed
    assert p.decide("db.internal", 6379, [node], trusted=True, boundary=fleet).allowed
    assert Boundary.from_json(boundary.to_json()) == boundary


def test_names_must_resolve_and_have_a_name() -> None:
    p = Policy.parse(["example.com"])
    assert p.decide("example.com", 80, []).reason == "example.com does not resolve"
    assert not p.decide("", 443).allowed


def test_lookups_only_when_they_matter() -> None:
    p = Policy.parse(["example.com"], ["bad.example.com"])
    assert p.needs_addresses("example.com", 80)
    assert not p.needs_addresses("other.org", 80)  # refused by name alone
    assert not p.needs_addresses("bad.example.com", 80)
    assert not p.needs_addresses("1.2.3.4", 80)
    # an address rule allows no name: names the guest makes up are never looked up
    by_address = Policy.parse(["10.0.0.0/8", "0.0.0.0/0"])
    inside = Boundary(tenant_networks=(ipaddress.ip_network("10.0.0.0/8"),))
    assert not by_address.needs_addresses("db.internal", 5432)
    assert not by_address.needs_addresses("c2VjcmV0.attacker.example", 443)
    assert not by_address.decide("db.internal", 5432, [ip("10.1.2.3")], boundary=inside).allowed
    # unless the name is the operator's (its addresses come from the table, not DNS)
    assert by_address.decide(
        "db.internal", 5432, [ip("10.1.2.3")], trusted=True, boundary=inside
    ).allowed


def test_secret_host_binding_ignores_ports() -> None:
    hosts = [parse_rule("api.github.com"), parse_rule("*.example.com")]
    assert host_matches(hosts, "api.github.com")
    assert host_matches(hosts, "x.example.com")
    assert not host_matches(hosts, "github.com")
    assert not host_matches(hosts, "example.com")
    assert host_matches([parse_rule("10.0.0.0/8")], "10.2.3.4")


labels = st.sampled_from(["a", "b", "api", "pypi", "github"])
domains = st.lists(labels, min_size=1, max_size=3).map(lambda parts: ".".join([*parts, "com"]))
rules = st.one_of(domains, domains.map(lambda d: f"*.{d}"), domains.map(lambda d: f"{d}:443"))


@given(allow=st.lists(rules, max_size=6), deny=st.lists(rules, max_size=6), host=domains)
def test_deny_always_wins_and_nothing_is_allowed_without_a_rule(
    allow: list[str], deny: list[str], host: str
) -> None:
    p = Policy.parse(allow, deny)
    decision = p.decide(host, 443, PUBLIC)
    if any(r.matches_name(host, 443) for r in p.deny):
        assert not decision.allowed
    if decision.allowed:
        assert any(r.matches_name(host, 443) for r in p.allow)


def test_star_allows_every_name_but_not_the_hosts_own_addresses() -> None:
    p = Policy.parse(["*"], ["evil.example"])
    assert p.decide("pypi.org", 443, PUBLIC).allowed
    assert not p.decide("evil.example", 443, PUBLIC).allowed  # deny wins
    assert not p.decide("internal.example", 80, [ip("10.1.2.3")]).allowed  # non-public guard
    assert not p.decide("93.184.216.34", 80).allowed  # raw IPs still need address rules
    assert Policy.parse(["*:443"]).decide("pypi.org", 443, PUBLIC).allowed
    assert not Policy.parse(["*:443"]).decide("pypi.org", 80, PUBLIC).allowed
