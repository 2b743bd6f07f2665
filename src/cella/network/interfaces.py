"""The host's own addresses, from its interfaces: sandboxes never reach them by a tenant's
rule (the daemon, the proxy and whatever else listens on the host), public or not."""

from __future__ import annotations

import ipaddress
import socket

import psutil

from cella.policy.egress import IPAddress


def host_addresses() -> frozenset[IPAddress]:
    found: set[IPAddress] = set()
    for entries in psutil.net_if_addrs().values():
        for entry in entries:
            if entry.family in (socket.AF_INET, socket.AF_INET6):
                try:  # a link-local IPv6 address carries its interface: fe80::1%eth0
                    found.add(ipaddress.ip_address(entry.address.split("%")[0]))
                except ValueError:
                    continue
    return frozenset(found)
