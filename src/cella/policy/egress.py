"""Egress rules: which (host, port) a sandbox may connect to.

A rule is `host[:port]`: an exact domain (`pypi.org`), a wildcard for its subdomains
(`*.github.com`, which does not match `github.com` itself), an IP address or a CIDR block
(`10.1.0.0/16`), or `*` for every name (`*:443`: every name on one port). No port means any
port. Default deny; deny rules win over allow rules.

Names are resolved on the host, never in the guest. A name allowed by a domain rule is still
refused when it resolves to a non-public address (loopback, private, link-local: the host's
own services and the metadata endpoint) unless a CIDR rule allows that address or the name
comes from the operator's override table. A raw IP is judged by CIDR rules only, so the
address of an allowed domain is not reachable by its number alone.
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network
MAX_RULES = 256
_LABEL = r"(?!-)[a-z0-9_-]{1,63}(?<!-)"
_DOMAIN = re.compile(rf"^{_LABEL}(\.{_LABEL})*$")


@dataclass(frozen=True, slots=True)
class Rule:
    text: str
    domain: str | None = None  # exact domain, or the suffix of a wildcard
    wildcard: bool = False
    network: IPNetwork | None = None
    port: int | None = None

    def matches_name(self, name: str, port: int) -> bool:
        if self.domain is None or not self._port_ok(port):
            return False
        if self.domain == "*":  # every name (still subject to the non-public guard)
            return True
        if self.wildcard:
            return name.endswith("." + self.domain)
        return name == self.domain

    def covers(self, address: IPAddress, port: int) -> bool:
        return self.network is not None and self._port_ok(port) and address in self.network

    def _port_ok(self, port: int) -> bool:
        return self.port is None or self.port == port

    def opens(self, address: IPAddress, port: int) -> bool:
        """Covers the address, and may open it even if non-public: only a rule at least as
        narrow as a /8 (IPv6: /16) can, so `0.0.0.0/0` never reaches the host's loopback."""
        if not self.covers(address, port):
            return False
        assert self.network is not None
        return address.is_global or self.network.prefixlen >= (
            8 if self.network.version == 4 else 16
        )


def parse_rule(text: str) -> Rule:
    """One rule from its text form; ValueError says what is wrong with it."""
    raw = text.strip().lower()
    if not raw or len(raw) > 300:
        raise ValueError(f"invalid rule {text!r}: empty or too long")
    host, port = raw, None
    if raw.startswith("["):  # [v6]:port
        end = raw.find("]")
        if end < 0:
            raise ValueError(f"invalid rule {text!r}: unclosed [")
        host, rest = raw[1:end], raw[end + 1 :]
        if rest:
            if not rest.startswith(":"):
                raise ValueError(f"invalid rule {text!r}")
            port = _port(rest[1:], text)
    elif raw.count(":") == 1:
        host, port_text = raw.split(":")
        port = _port(port_text, text)
    try:
        network = ipaddress.ip_network(host, strict=False)
    except ValueError:
        network = None
    if network is not None:
        return Rule(text=text.strip(), network=network, port=port)
    if host == "*":
        return Rule(text=text.strip(), domain="*", port=port)
    wildcard = host.startswith("*.")
    domain = host[2:] if wildcard else host
    domain = domain.rstrip(".")
    if len(domain) > 253 or not _DOMAIN.match(domain) or "*" in domain:
        raise ValueError(
            f"invalid rule {text!r}: expected a domain, *.domain, IP or CIDR, then :port or not"
        )
    return Rule(text=text.strip(), domain=domain, wildcard=wildcard, port=port)


def _port(value: str, text: str) -> int:
    if not value.isdigit() or not 1 <= int(value) <= 65535:
        raise ValueError(f"invalid rule {text!r}: port must be 1-65535")
    return int(value)


@dataclass(frozen=True, slots=True)
class Decision:
    allowed: bool
    reason: str


def _address(host: str) -> IPAddress | None:
    try:
        return ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        return None


@dataclass(frozen=True, slots=True)
class Policy:
    allow: tuple[Rule, ...] = ()
    deny: tuple[Rule, ...] = ()

    @classmethod
    def parse(cls, allow: Iterable[str] = (), deny: Iterable[str] = ()) -> Policy:
        allow_rules = tuple(parse_rule(r) for r in allow)
        deny_rules = tuple(parse_rule(r) for r in deny)
        if len(allow_rules) + len(deny_rules) > MAX_RULES:
            raise ValueError(f"at most {MAX_RULES} rules")
        return cls(allow_rules, deny_rules)

    def needs_addresses(self, host: str, port: int) -> bool:
        """Whether `decide` needs the host's resolved addresses: only for a name a name rule
        allows. A lookup is itself a message to the name's DNS servers, so names the guest
        makes up (`<data>.attacker.example`) are never looked up."""
        name = host.lower().rstrip(".")
        if _address(name) is not None:
            return False
        if any(r.matches_name(name, port) for r in self.deny):
            return False
        return any(r.matches_name(name, port) for r in self.allow)

    def decide(
        self,
        host: str,
        port: int,
        addresses: Sequence[IPAddress] = (),
        *,
        trusted: bool = False,
    ) -> Decision:
        """`addresses`: what the host resolves `host` to; `trusted`: the name comes from the
        operator's override table (its non-public addresses are intended, and address rules
        may allow it: its addresses come from the table, not from DNS)."""
        name = host.lower().rstrip(".")
        if not name:
            return Decision(False, "no destination name (TLS without SNI?)")
        literal = _address(name)
        if literal is not None:
            addresses, trusted = [literal], False
        for rule in self.deny:
            if rule.matches_name(name, port) or any(rule.covers(a, port) for a in addresses):
                return Decision(False, f"denied by rule {rule.text}")
        by_cidr = next(
            (r for r in self.allow if addresses and all(r.opens(a, port) for a in addresses)),
            None,
        )
        if literal is not None:
            if by_cidr is not None:
                return Decision(True, f"allowed by rule {by_cidr.text}")
            return Decision(False, "an IP address is allowed only by an address rule")
        by_name = next((r for r in self.allow if r.matches_name(name, port)), None)
        if by_name is None:
            if by_cidr is not None and trusted:
                return Decision(True, f"allowed by rule {by_cidr.text}")
            return Decision(False, "no rule allows it")
        if not addresses:
            return Decision(False, f"{name} does not resolve")
        for a in addresses:
            guarded = not a.is_global and not trusted
            if guarded and not any(r.opens(a, port) for r in self.allow):
                return Decision(False, f"{name} resolves to non-public address {a}")
        return Decision(True, f"allowed by rule {by_name.text}")


def host_matches(patterns: Iterable[Rule], host: str) -> bool:
    """Whether a secret bound to these host patterns may be used toward `host` (any port)."""
    name = host.lower().rstrip(".")
    for rule in patterns:
        if rule.domain is not None and (
            name == rule.domain if not rule.wildcard else name.endswith("." + rule.domain)
        ):
            return True
        literal = _address(name)
        if rule.network is not None and literal is not None and literal in rule.network:
            return True
    return False
