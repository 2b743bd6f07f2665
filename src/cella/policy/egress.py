"""Egress rules: which (host, port) a sandbox may connect to.

A rule is `host[:port]`: an exact domain (`pypi.org`), a wildcard for its subdomains
(`*.github.com`, which does not match `github.com` itself), an IP address or a CIDR block
(`10.1.0.0/16`), or `*` for every name (`*:443`: every name on one port). No port means any
port. Default deny; deny rules win over allow rules.

Names are resolved on the host, never in the guest. A raw IP is judged by CIDR rules only,
so the address of an allowed domain is not reachable by its number alone.

Rules are the tenant's; the `Boundary` is the operator's. Restricted addresses (everything
not public: loopback, private and shared ranges, link-local with every metadata endpoint,
unique- and site-local IPv6, IPv4 addresses embedded in IPv6 forms of these; plus the host's
own interface addresses and every fleet node's) are reached only through the operator: a
name in the operator's host table, or an address inside the operator's tenant networks by a
tenant's CIDR rule inside them too. A tenant's rule that could only name restricted addresses
is refused when it is set (`Boundary.refusal`); the same check runs again at every connect.
The host's and the fleet's own addresses stay closed inside tenant networks too: only the
host table reaches them.
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


# What "not public" means here: IANA's special-purpose blocks that are not globally
# reachable, and multicast; spelled out rather than left to a Python version's `is_global`
# (3.11 calls site-local IPv6 global).
NOT_PUBLIC: tuple[IPNetwork, ...] = tuple(
    ipaddress.collapse_addresses(
        ipaddress.IPv4Network(n)
        for n in (
            "0.0.0.0/8", "10.0.0.0/8", "100.64.0.0/10", "127.0.0.0/8", "169.254.0.0/16",
            "172.16.0.0/12", "192.0.0.0/24", "192.0.2.0/24", "192.88.99.0/24",
            "192.168.0.0/16", "198.18.0.0/15", "198.51.100.0/24", "203.0.113.0/24",
            "224.0.0.0/4", "240.0.0.0/4",
        )
    )
) + tuple(
    ipaddress.collapse_addresses(
        ipaddress.IPv6Network(n)
        for n in (
            "::/128", "::1/128", "64:ff9b:1::/48", "100::/64", "2001::/23", "2001:db8::/32",
            "fc00::/7", "fe80::/10", "fec0::/10", "ff00::/8",
        )
    )
)  # fmt: skip
# IPv6 prefixes that carry an IPv4 address, and the bit where it starts: the host's kernel
# (or a NAT64/6to4 gateway) turns them into IPv4, so they are judged as that IPv4 address
_EMBEDDING = (
    (ipaddress.IPv6Network("::ffff:0:0/96"), 96),  # IPv4-mapped
    (ipaddress.IPv6Network("::/96"), 96),  # IPv4-compatible (deprecated)
    (ipaddress.IPv6Network("64:ff9b::/96"), 96),  # NAT64
    (ipaddress.IPv6Network("2002::/16"), 16),  # 6to4
)
_LOOPBACK_V6 = ipaddress.IPv6Network("::/127")  # :: and ::1 are not IPv4-compatible forms


def as_ipv4(network: IPNetwork) -> IPNetwork:
    """The IPv4 network an IPv6 form stands for (mapped, compatible, NAT64, 6to4), else the
    network itself."""
    if network.version == 6:
        for prefix, start in _EMBEDDING:
            if network.subnet_of(prefix) and not network.subnet_of(_LOOPBACK_V6):
                bits = int(network.network_address) >> (96 - start) & 0xFFFFFFFF
                length = min(max(network.prefixlen - start, 0), 32)
                return ipaddress.IPv4Network((bits, length), strict=False)
    return network


def _single(address: IPAddress) -> IPNetwork:
    return ipaddress.ip_network(address)


@dataclass(frozen=True, slots=True)
class Boundary:
    """The operator's line around tenants' rules.

    `protected`: addresses beyond the non-public ranges that sandboxes never reach by a
    tenant's rule (the host's own interface addresses, every fleet node's);
    `tenant_networks`: the non-public networks the operator lets tenants' CIDR rules open;
    `names`: the operator's host table (its names may resolve anywhere)."""

    protected: frozenset[IPAddress] = frozenset()
    tenant_networks: tuple[IPNetwork, ...] = ()
    names: frozenset[str] = frozenset()

    @classmethod
    def from_json(cls, data: dict[str, list[str]]) -> Boundary:
        return cls(
            frozenset(ipaddress.ip_address(a) for a in data.get("protected", ())),
            tuple(ipaddress.ip_network(n, strict=False) for n in data.get("tenant_networks", ())),
            frozenset(n.lower() for n in data.get("names", ())),
        )

    def to_json(self) -> dict[str, list[str]]:
        return {
            "protected": sorted(map(str, self.protected)),
            "tenant_networks": [str(n) for n in self.tenant_networks],
            "names": sorted(self.names),
        }

    def closed(self, address: IPAddress) -> str | None:
        """Why a tenant's rule alone cannot reach `address` (None: it is public)."""
        if self._protects(address):
            return f"{address}, an address of this host or of a fleet node"
        if any(_within(as_ipv4(_single(address)), block) for block in NOT_PUBLIC):
            return f"non-public address {address}"
        return None

    def opened(self, address: IPAddress) -> bool:
        """Inside a network the operator lets tenants open. The host's and the fleet's own
        addresses never are (a corporate network opened to tenants must not open the Ray
        ports of the nodes in it): only a name in the operator's host table reaches them."""
        if self._protects(address):
            return False
        return self.holds(_single(address))

    def holds(self, network: IPNetwork) -> bool:
        """The whole network lies inside the operator's tenant networks."""
        return any(_within(as_ipv4(network), as_ipv4(n)) for n in self.tenant_networks)

    def _protects(self, address: IPAddress) -> bool:
        return address in self.protected or (
            as_ipv4(_single(address)).network_address in self.protected
        )

    def refusal(self, rule: Rule) -> str | None:
        """Why a tenant may not set this allow rule (None: it may): it names only
        restricted addresses, outside the operator's tenant networks. A wider rule (say
        `0.0.0.0/0`) stays: it opens only what is public."""
        setting = "egress_tenant_networks"
        if rule.network is not None:
            net = as_ipv4(rule.network)
            if rule.network.num_addresses == 1:
                address = rule.network.network_address
                if self.closed(address) is None or self.opened(address):
                    return None
                if self._protects(address):
                    return (
                        f"rule {rule.text!r} names {address}, an address of this host or of a "
                        "fleet node: only a name in the operator's egress_hosts reaches it"
                    )
            elif not any(_within(net, block) for block in NOT_PUBLIC) or self.holds(net):
                return None  # it reaches public addresses, or opened ones
            opened = ", ".join(map(str, self.tenant_networks)) or "none"
            return (
                f"rule {rule.text!r} names addresses that are not public; only the operator "
                f"opens those: {setting} lists the networks tenants may open (now: {opened}), "
                "egress_hosts the internal hosts"
            )
        name = rule.domain or ""
        if (name == "localhost" or name.endswith(".localhost")) and name not in self.names:
            return (
                f"rule {rule.text!r} names the host's loopback: only a name in the operator's "
                "egress_hosts reaches it"
            )
        return None


def _within(network: IPNetwork, block: IPNetwork) -> bool:
    return network.version == block.version and network.subnet_of(block)  # type: ignore[arg-type]


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

    def denial(self, host: str, port: int) -> Decision | None:
        """A deny rule's refusal of a name (a rewrite's host needs no allow rule, but a
        deny rule still wins)."""
        name = host.lower().rstrip(".")
        rule = next((r for r in self.deny if r.matches_name(name, port)), None)
        return None if rule is None else Decision(False, f"denied by rule {rule.text}")

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
        boundary: Boundary = Boundary(),
    ) -> Decision:
        """`addresses`: what the host resolves `host` to; `trusted`: the name comes from the
        operator's host table (its addresses are the operator's choice, and address rules
        may allow it); `boundary`: what tenants' rules may open (default: nothing that is
        not public)."""
        name = host.lower().rstrip(".")
        if not name:
            return Decision(False, "no destination name (TLS without SNI?)")
        literal = _address(name)
        if literal is not None:
            addresses, trusted = [literal], False
        for rule in self.deny:
            if rule.matches_name(name, port) or any(rule.covers(a, port) for a in addresses):
                return Decision(False, f"denied by rule {rule.text}")
        if literal is not None:
            by_address = next((r for r in self.allow if r.covers(literal, port)), None)
            if by_address is None:
                return Decision(False, "an IP address is allowed only by an address rule")
            return self._guarded(literal, port, boundary) or Decision(
                True, f"allowed by rule {by_address.text}"
            )
        by_name = next((r for r in self.allow if r.matches_name(name, port)), None)
        if by_name is None:
            by_cidr = next(
                (
                    r
                    for r in self.allow
                    if addresses and all(self._opens(r, a, port, boundary) for a in addresses)
                ),
                None,
            )
            if by_cidr is not None and trusted:
                return Decision(True, f"allowed by rule {by_cidr.text}")
            return Decision(False, "no rule allows it")
        if not addresses:
            return Decision(False, f"{name} does not resolve")
        for a in addresses if not trusted else ():
            refused = self._guarded(a, port, boundary)
            if refused is not None:
                return Decision(False, f"{name} resolves to {refused.reason}")
        return Decision(True, f"allowed by rule {by_name.text}")

    @staticmethod
    def _opens(rule: Rule, address: IPAddress, port: int, boundary: Boundary) -> bool:
        """The rule covers the address, and may reach it: a public address, or one inside
        the operator's tenant networks by a rule inside them too (`0.0.0.0/0` means every
        public address, never the networks the operator opened)."""
        if not rule.covers(address, port):
            return False
        if boundary.closed(address) is None:
            return True
        assert rule.network is not None
        return boundary.opened(address) and boundary.holds(rule.network)

    def _guarded(self, address: IPAddress, port: int, boundary: Boundary) -> Decision | None:
        """A refusal if `address` is restricted and no address rule of the tenant's opens
        it inside the operator's tenant networks."""
        why = boundary.closed(address)
        if why is None or any(self._opens(r, address, port, boundary) for r in self.allow):
            return None
        return Decision(False, f"{why}, which only the operator opens")


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
