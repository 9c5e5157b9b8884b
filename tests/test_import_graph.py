"""Imports flow one way: no cycle among Tandem's modules (counting imports inside functions too),
none among the packages under ``tandem.parties`` (a module-level check misses ``data.load ->
alignment.aligned_file`` beside ``alignment.cli -> data``), the systems (split learning, FL,
elastic training, alignment) import none of each other, the layers import downwards only
(transports <- engine <- parties), and split learning's core (any transport, no TOML, no process)
imports nothing of its process/CLI layer (``tandem.parties.split.process``)."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "tandem"


def modules() -> dict[str, tuple[Path, bool]]:
    """Dotted module name -> (file, is a package)."""
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        is_pkg = parts[-1] == "__init__"
        out[".".join(parts[:-1] if is_pkg else parts)] = (path, is_pkg)
    return out


def import_graph() -> dict[str, set[str]]:
    """Module -> the Tandem modules it imports anywhere in its body. ``from pkg import name``
    counts as importing ``pkg.name`` when that is a module, else ``pkg``."""
    mods = modules()
    graph: dict[str, set[str]] = {m: set() for m in mods}
    for mod, (path, is_pkg) in mods.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                graph[mod] |= {a.name for a in node.names if a.name in mods}
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    anchor = mod.split(".") if is_pkg else mod.split(".")[:-1]
                    anchor = anchor[: len(anchor) - node.level + 1]
                    base = ".".join(anchor + ([node.module] if node.module else []))
                else:
                    base = node.module or ""
                for alias in node.names:
                    target = f"{base}.{alias.name}"
                    if target in mods:
                        graph[mod].add(target)
                    elif base in mods:
                        graph[mod].add(base)
    return graph


PARTIES = "tandem.parties"
#: The systems: each may use the shared packages (data, export, models, files, ...), none
#: another system.
SYSTEMS = ("alignment", "elastic", "fl", "split")


def package_of(module: str) -> str | None:
    """The package (or top-level module) directly under ``tandem.parties`` holding ``module``."""
    parts = module.split(".")
    return ".".join(parts[:3]) if len(parts) > 2 and module.startswith(PARTIES + ".") else None


def package_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """Package -> the other packages under ``tandem.parties`` its modules import."""
    out: dict[str, set[str]] = {}
    for mod, deps in graph.items():
        if (pkg := package_of(mod)) is not None:
            out.setdefault(pkg, set()).update(
                d for dep in deps if (d := package_of(dep)) not in (None, pkg)
            )
    for deps in list(out.values()):
        for d in deps:
            out.setdefault(d, set())
    return out


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as a path ``[a, b, ..., a]``, or None."""
    state: dict[str, int] = {}  # 1 on the current path, 2 finished
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return path[path.index(nxt) :] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_the_graph_sees_imports_inside_functions():
    graph = import_graph()
    process = "tandem.parties.split.process"
    assert f"{process}.predict_cli" in graph[f"{process}.cli"]  # in register()
    assert f"{process}.cli_report" in graph[f"{process}.predict_cli"]
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]


def test_no_import_cycles():
    assert find_cycle(import_graph()) is None


def test_no_cycles_between_packages_under_parties():
    old = {  # the cycle this test was written for: data read alignment's file, alignment read data
        "tandem.parties.data.load": {"tandem.parties.alignment.aligned_file"},
        "tandem.parties.alignment.cli": {"tandem.parties.data"},
    }
    assert find_cycle(package_graph(old)) == [
        "tandem.parties.alignment",
        "tandem.parties.data",
        "tandem.parties.alignment",
    ]
    packages = package_graph(import_graph())
    assert "tandem.parties.data" in packages["tandem.parties.alignment"]  # the graph sees them
    assert find_cycle(packages) is None


def test_systems_import_none_of_each_other():
    systems = {f"{PARTIES}.{s}" for s in SYSTEMS}
    packages = package_graph(import_graph())
    wrong = sorted(f"{a} imports {b}" for a in systems for b in packages[a] & systems)
    assert wrong == []


def test_layers_import_downwards_only():
    forbidden = {
        "tandem.transports": ("tandem.engine", "tandem.parties"),
        "tandem.engine": ("tandem.parties",),
    }
    wrong = [
        f"{mod} imports {dep}"
        for mod, deps in import_graph().items()
        for layer, above in forbidden.items()
        if mod.startswith(layer + ".") or mod == layer
        for dep in deps
        if dep.startswith(above)
    ]
    assert wrong == []


SPLIT, SPLIT_PROCESS = f"{PARTIES}.split", f"{PARTIES}.split.process"


def in_package(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def test_split_core_imports_nothing_of_its_process_layer():
    graph = import_graph()
    core = [m for m in graph if in_package(m, SPLIT) and not in_package(m, SPLIT_PROCESS)]
    assert f"{SPLIT}.party" in core and f"{SPLIT}.inference" in core
    assert f"{SPLIT}.party" in graph[f"{SPLIT_PROCESS}.standalone"]  # the graph sees the layer
    wrong = sorted(
        f"{m} imports {dep}" for m in core for dep in graph[m] if in_package(dep, SPLIT_PROCESS)
    )
    assert wrong == []


def test_nothing_outside_tandem_testing_imports_it():
    """`tandem.testing` holds attacks for tests and `bench.hostile`: no part of Tandem itself
    depends on it."""
    graph = import_graph()
    users = {
        mod: sorted(t for t in targets if t.startswith("tandem.testing"))
        for mod, targets in graph.items()
        if not mod.startswith("tandem.testing")
    }
    assert {m: t for m, t in users.items() if t} == {}
