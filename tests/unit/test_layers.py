"""The shape of `src/cella`, checked from its imports (like import-linter's contracts): each
area imports only the areas below it (docs/architecture.md draws them), and no module
imports itself back through others. Every import counts: at the top, inside functions,
and under TYPE_CHECKING (a lazy import hides a circle; it does not remove it)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[2] / "src"

# area -> the areas it may import (besides itself). Pure rooms at the bottom; the parts of a
# host (state, disks, guest channel, images, VMM, proxy) above them; the service rooms; the
# doors (cella's API and the foreign ones, the fleet) on top; clients talk HTTP only.
PURE = {"errors", "config", "models", "policy"}
HOST_PARTS = {"paths", "_proc", "store", "storage", "guest", "images", "runtime", "network",
              "telemetry"}  # fmt: skip
ALLOWED: dict[str, set[str]] = {
    "errors": set(),
    "config": set(),
    "policy": set(),
    "models": {"errors", "policy"},
    "paths": {"config", "errors"},
    "_proc": {"errors"},
    "store": PURE,
    "storage": PURE | {"_proc"},
    "guest": PURE,
    "images": PURE | {"paths", "_proc"},
    "runtime": PURE | {"paths", "_proc", "guest", "images", "storage"},
    "network": PURE | {"paths", "_proc"},
    "telemetry": PURE | {"store"},
    "service": PURE | HOST_PARTS,
    "sdk": PURE,
    "eval": PURE | {"sdk"},
    "integrations": PURE | {"sdk"},
    "server": PURE | {"paths", "store", "guest", "service", "telemetry"},
    "fleet": PURE | {"paths", "store", "network", "service", "server", "sdk", "eval", "telemetry"},
    "cli": {"*"},  # the entry points: they put the rest together
    "cella": {"sdk", "errors", "models", "config"},  # the package's own __init__
}


def modules() -> dict[str, Path]:
    found = {}
    for path in SRC.rglob("*.py"):
        parts = list(path.relative_to(SRC).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


MODULES = modules()


def imports_of(name: str, path: Path) -> set[str]:
    """The cella modules `name` imports (`from cella import errors` is cella.errors)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            subs = {f"{module}.{a.name}" for a in node.names} & MODULES.keys()
            found |= subs or {module}
    return {m for m in found if m in MODULES and m != name}


GRAPH = {name: imports_of(name, path) for name, path in MODULES.items()}


def area(module: str) -> str:
    return module.split(".")[1] if "." in module else "cella"


def test_the_graph_was_read() -> None:  # control: the checks below see real edges
    assert "cella.service.daemon" in GRAPH
    assert "cella.errors" in GRAPH["cella.service.daemon"]
    assert len(GRAPH) > 100 and sum(map(len, GRAPH.values())) > 400


@pytest.mark.parametrize("module", sorted(GRAPH))
def test_imports_point_down(module: str) -> None:
    own = area(module)
    allowed = ALLOWED.get(own)
    assert allowed is not None, f"{own}: an area no rule names (add it to ALLOWED)"
    if "*" in allowed:
        return
    upward = sorted(m for m in GRAPH[module] if area(m) != own and area(m) not in allowed)
    assert not upward, f"{module} imports {upward}: {own} may import only {sorted(allowed)}"


def test_no_module_imports_itself_back() -> None:
    circles = []
    state: dict[str, int] = {}  # 1: on the path, 2: done
    path: list[str] = []

    def visit(node: str) -> None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(GRAPH[node]):
            if state.get(nxt) == 1:
                circles.append([*path[path.index(nxt) :], nxt])
            elif nxt not in state:
                visit(nxt)
        path.pop()
        state[node] = 2

    for node in sorted(GRAPH):
        if node not in state:
            visit(node)
    assert not circles, "\n".join(" -> ".join(c) for c in circles)


def test_api_layers_reach_the_store_and_driver_only_through_service_rooms() -> None:
    offenders = []
    for name, path in MODULES.items():
        if area(name) in {"service", "cli"}:
            continue
        text = path.read_text()
        for needle in ("svc.store", "svc.driver", "daemon.store", "daemon.driver"):
            if needle in text:
                offenders.append(f"{name}: {needle}")
    assert not offenders, offenders


def test_the_runtime_contract_names_no_backend() -> None:
    """A second VMM is a folder under runtime/ and a line in the selector: nothing above
    the selector, and not the contract, imports a backend."""
    backends = {m for m in MODULES if m.startswith("cella.runtime.qemu")}
    assert backends  # control: the QEMU backend is there to be found
    assert not GRAPH["cella.runtime.contract"] & backends
    outside = {
        name: sorted(GRAPH[name] & backends)
        for name in GRAPH
        if area(name) in {"service", "server", "fleet"} and GRAPH[name] & backends
    }
    assert not outside, outside


def test_service_rooms_keep_to_400_lines() -> None:
    long = {
        name: n
        for name, path in MODULES.items()
        if area(name) == "service" and (n := len(path.read_text().splitlines())) > 400
    }
    assert not long, long
