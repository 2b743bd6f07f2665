"""Where the fleet gateway puts new sandboxes (pure logic)."""

from __future__ import annotations

from cella.fleet.placement_policy import Candidate, ranked, spread


def node(name: str, memory: int, vcpus: int = 8, **flags: bool) -> Candidate:
    return Candidate(name=name, memory_mib_free=memory, vcpus_free=vcpus, **flags)


def test_the_node_with_most_free_memory_wins_among_equals() -> None:
    nodes = [node("a", 1024), node("b", 4096), node("c", 2048)]
    assert [c.name for c in ranked(nodes, 1, 512)] == ["b", "c", "a"]


def test_nodes_without_room_are_never_chosen() -> None:
    nodes = [node("a", 256), node("b", 4096, vcpus=0), node("c", 600)]
    assert [c.name for c in ranked(nodes, 1, 512)] == ["c"]
    assert ranked(nodes, 1, 1024) == []


def test_locality_beats_free_memory_and_a_hint_beats_locality() -> None:
    nodes = [
        node("big", 8192),
        node("pooled", 2048, pooled_template=True),
        node("holder", 1024, holds_snapshot=True),
    ]
    assert [c.name for c in ranked(nodes, 1, 512)] == ["holder", "pooled", "big"]
    hinted = [*nodes[:2], node("holder", 1024, holds_snapshot=True), node("x", 600, preferred=True)]
    assert ranked(hinted, 1, 512)[0].name == "x"


def test_a_fork_fills_the_holder_then_spills_over() -> None:
    nodes = [node("holder", 1024, holds_snapshot=True), node("b", 4096), node("c", 2048)]
    assert spread(nodes, 1, 512, 2) == {"holder": 2}
    assert spread(nodes, 1, 512, 5) == {"holder": 2, "b": 3}
    assert spread(nodes, 1, 512, 14) == {"holder": 2, "b": 8, "c": 4}


def test_a_fork_that_does_not_fit_whole_is_not_planned() -> None:
    nodes = [node("a", 1024), node("b", 1024)]
    assert spread(nodes, 1, 512, 5) == {}
    assert spread(nodes, 2, 512, 2) == {"a": 2}  # equal nodes: by name
    assert spread([node("a", 8192, vcpus=3)], 2, 512, 2) == {}  # vCPUs bound it


def test_only_nodes_with_the_template_built_take_it_when_any_has() -> None:
    nodes = [node("big", 8192, has_template=False), node("small", 1024)]
    assert [c.name for c in ranked(nodes, 1, 512)] == ["small"]
    # no node has it (yet): placed by room, and the node says what is missing
    nobody = [node("big", 8192, has_template=False), node("small", 1024, has_template=False)]
    assert [c.name for c in ranked(nobody, 1, 512)] == ["big", "small"]


def test_a_node_that_holds_the_template_beats_one_it_would_be_shipped_to() -> None:
    nodes = [node("big", 8192, ships_template=True), node("small", 1024)]
    assert [c.name for c in ranked(nodes, 1, 512)] == ["small", "big"]
    full = [node("big", 8192, ships_template=True), node("small", 256)]
    assert [c.name for c in ranked(full, 1, 512)] == ["big"]  # shipped where there is room
    hinted = [node("big", 8192, ships_template=True, preferred=True), node("small", 1024)]
    assert ranked(hinted, 1, 512)[0].name == "big"
