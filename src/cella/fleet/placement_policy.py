"""Where a new sandbox goes: the pure decision, from what each node reports.

A node must have room (free RAM and vCPUs after what it has committed and what the gateway
is placing there right now) and, where any node has it, the template built or shippable
there (one built through the gateway is shipped by digest). Among those, the node the
caller asked for wins (an eval task forks on the node it runs on), then a node that already
holds the snapshot (no files to move), then one that holds the template (no base to ship),
then one with a warm pool of the template, then the one with the most free memory, so
creates spread over equal nodes.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Candidate:
    name: str
    memory_mib_free: int
    vcpus_free: int
    holds_snapshot: bool = False
    pooled_template: bool = False
    preferred: bool = False  # the caller asked for this node (`X-Cella-Node`)
    has_template: bool = True  # its template is built there, or can be shipped there
    ships_template: bool = False  # ... but only after it is shipped there

    def fits(self, vcpus: int, memory_mib: int) -> int:
        """How many sandboxes of this shape fit here."""
        return max(0, min(self.memory_mib_free // memory_mib, self.vcpus_free // vcpus))


def ranked(candidates: list[Candidate], vcpus: int, memory_mib: int) -> list[Candidate]:
    """Nodes with room for one such sandbox, best first; only nodes that have the template
    built, if any has."""
    room = [c for c in candidates if c.fits(vcpus, memory_mib) > 0]
    if any(c.has_template for c in room):
        room = [c for c in room if c.has_template]
    return sorted(
        room,
        key=lambda c: (
            not c.preferred,
            not c.holds_snapshot,
            c.ships_template,
            not c.pooled_template,
            -c.memory_mib_free,
            c.name,
        ),
    )


def spread(candidates: list[Candidate], vcpus: int, memory_mib: int, count: int) -> dict[str, int]:
    """`count` sandboxes over the nodes: as many as fit on the best node, the rest on the
    next; empty if they do not all fit in the fleet."""
    plan: dict[str, int] = {}
    left = count
    for c in ranked(candidates, vcpus, memory_mib):
        take = min(left, c.fits(vcpus, memory_mib))
        plan[c.name] = take
        left -= take
        if left == 0:
            return plan
    return {}
