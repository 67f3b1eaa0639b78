"""The layers point one way: core ← agent, exporter ← monitoring, simulator, integrations ←
lab ← cli (the command line runs the lab's demo). A module imports syncscope modules of its own room or of a lower layer only; agent and
exporter, side by side, never import each other. Inside the exporter, its modules import one
another in one declared order (EXPORTER_ORDER), so none is in an import cycle; and nothing
installed imports bench/, which is not. Read from the source (every import statement, also
inside functions and under TYPE_CHECKING), so nothing needs importing to be checked.
"""

from __future__ import annotations

import ast
from collections.abc import Collection, Iterator, Mapping
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# The checkout's folders of each package (pyproject.toml's package-dir).
SOURCES = {"syncscope": "syncscope", "syncscope.agent": "agent", "syncscope.exporter": "exporter"}
SOURCES["syncscope.sim"] = "sim"
# Room -> layer. A room is a package below syncscope, or "core" for syncscope's own modules.
LAYERS = {
    "core": 0,
    "agent": 1,
    "exporter": 1,
    "monitoring": 2,
    "sim": 2,
    "integrations": 2,
    "lab": 3,
    "cli": 4,
}

# The exporter's modules in the one order they import each other: each imports only modules
# listed before it, inside functions and under TYPE_CHECKING too (an import moved into a
# function still ties the two modules together; it only hides the cycle until it runs). A
# new module takes its place here.
EXPORTER_ORDER = (
    # settings (with the diagnosis's lines), the per-rank and per-job accumulators the store
    # keeps, the diagnosis's result types, and Prometheus's job-wide view read back
    "settings",
    "throughput",
    "pooling",
    "findings",
    "jobwide",
    # the ingest state and its views, and what feeds and keeps it
    "store",
    "shm_reader",
    "state_file",
    # the node's own readings beside the views (GPU, CPU energy)
    "gpu",
    "energy",
    # the diagnosis: the decision verdict, then the modes that add it, and the diagnosed view
    "verdict",
    "diagnosis",
    # presentation: the metrics, the status page, the app and its command
    "collectors",
    "page",
    "app",
    "__main__",
)


def room(module: str) -> str:
    """syncscope.exporter.store -> exporter; syncscope.catalog -> core; syncscope.cli -> cli."""
    parts = module.split(".")
    if len(parts) >= 2 and parts[1] in LAYERS and parts[1] != "core":
        return parts[1]
    return "core"


def modules() -> Iterator[tuple[str, Path]]:
    for package, folder in SOURCES.items():
        base = ROOT / folder
        for path in sorted(base.rglob("*.py")):
            rel = path.relative_to(base).with_suffix("")
            if package == "syncscope" and rel.parts[0] in {"agent", "exporter", "sim"}:
                continue  # not there in a checkout; guard against a stray copy
            parts = [p for p in rel.parts if p != "__init__"]
            yield ".".join([package, *parts]), path


def imported(module: str, source: str, modules: Collection[str] = ()) -> Iterator[tuple[int, str]]:
    """(line, module) for every import in `source`, relative ones resolved; `from p import m`
    names p.m where that is one of `modules` (or p is syncscope itself), else p."""
    package = module if module.endswith("__init__") else module.rsplit(".", 1)[0]
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base]) if base else ".".join(anchor)
            if base == "syncscope":  # from syncscope import catalog, lab
                for alias in node.names:
                    yield node.lineno, f"{base}.{alias.name}"
                continue
            yield node.lineno, base
            for alias in node.names:  # from syncscope.exporter import verdict
                if f"{base}.{alias.name}" in modules:
                    yield node.lineno, f"{base}.{alias.name}"


def violations(sources: Mapping[str, str]) -> list[str]:
    """Every import of `sources` ({module: its source}) against the layers."""
    out = []
    for module, source in sources.items():
        mine = room(module)
        for line, name in imported(module, source):
            if name != "syncscope" and not name.startswith("syncscope."):
                continue
            theirs = room(name)
            if theirs != mine and LAYERS[theirs] >= LAYERS[mine]:
                out.append(f"{module}:{line} ({mine}) imports {name} ({theirs})")
    return out


def exporter_edges(sources: Mapping[str, str]) -> dict[tuple[str, str], int]:
    """(importer, imported) -> the first line, for every import of one exporter module by
    another (the package itself, empty, is neither)."""
    prefix = "syncscope.exporter."
    mine = {m for m in sources if m.startswith(prefix)}
    edges: dict[tuple[str, str], int] = {}
    for module in sorted(mine):
        for line, name in imported(module, sources[module], mine):
            if name in mine and name != module:
                edges.setdefault((module, name), line)
    return edges


def cycles(edges: Mapping[tuple[str, str], int]) -> list[tuple[list[str], list[str]]]:
    """Every set of modules that import each other, round or through others (Tarjan's strongly
    connected components of more than one module): a cycle through it, and its modules."""
    after: dict[str, list[str]] = {}
    for a, b in sorted(edges):
        after.setdefault(a, []).append(b)
        after.setdefault(b, [])
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[tuple[list[str], list[str]]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in after[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append((_round(min(component), set(component), after), sorted(component)))

    for v in sorted(after):
        if v not in index:
            visit(v)
    return found


def _round(start: str, component: set[str], after: Mapping[str, list[str]]) -> list[str]:
    """A shortest way from `start` back to itself inside its component (breadth first)."""
    came: dict[str, str] = {}
    queue = [start]
    while queue:
        v = queue.pop(0)
        for w in after[v]:
            if w == start:
                path = [v]
                while path[-1] != start:
                    path.append(came[path[-1]])
                return [start, *reversed(path[:-1]), start]
            if w in component and w not in came:
                came[w] = v
                queue.append(w)
    raise AssertionError("a component with no way round")


def exporter_violations(sources: Mapping[str, str]) -> list[str]:
    """Every exporter import against EXPORTER_ORDER, and every import cycle in the exporter."""
    place = {f"syncscope.exporter.{m}": i for i, m in enumerate(EXPORTER_ORDER)}
    edges = exporter_edges(sources)
    out = []
    for (a, b), line in sorted(edges.items()):
        if a not in place or b not in place:
            out.append(f"{a}:{line} imports {b}: not both in EXPORTER_ORDER")
        elif place[b] >= place[a]:
            out.append(f"{a}:{line} imports {b}, which EXPORTER_ORDER lists after it")
    for cycle, among in cycles(edges):
        steps = [f"{a}:{edges[a, b]}" for a, b in zip(cycle, cycle[1:], strict=False)]
        out.append(
            f"import cycle {' -> '.join(cycle)} (the imports at {', '.join(steps)}),"
            f" among {len(among)} modules that import each other: {', '.join(among)}"
        )
    return out


# Calls that import (or run) a module named by a string.
IMPORTING_CALLS = {"import_module", "__import__", "run_module"}


def bench_imports(sources: Mapping[str, str]) -> list[str]:
    """Every import of bench/ by the installed packages (the lab included: it is in the wheel
    and runs `syncscope demo`); the wheel has no bench/, so such an import fails installed."""
    out = []
    for module, source in sources.items():
        names = list(imported(module, source))
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.Call) and node.args:
                func = node.func
                called = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
                first = node.args[0]
                if called in IMPORTING_CALLS and isinstance(first, ast.Constant):
                    names.append((node.lineno, str(first.value)))
        for line, name in names:
            if name == "bench" or name.startswith("bench."):
                out.append(f"{module}:{line} imports {name}, which is not installed (bench/)")
    return out


def tree() -> dict[str, str]:
    return {module: path.read_text(encoding="utf-8") for module, path in modules()}


def test_the_tree_imports_only_down_the_layers():
    sources = tree()
    assert len(sources) > 60, sorted(sources)  # the walk found the packages
    assert violations(sources) == []


def test_a_wrong_way_import_is_caught():
    """Planted: the exporter reaching up into the lab, the agent sideways into the exporter,
    the core into monitoring; each is named with its line."""
    sources = tree()
    planted = {
        "syncscope.exporter.jobwide": "from syncscope.lab.servers import free_port\n",
        "syncscope.agent.core": "def f():\n    import syncscope.exporter.store\n",
        "syncscope.catalog": "from syncscope.monitoring import rules\n",
        "syncscope.monitoring.rules": "from ..lab import render\n",
    }
    for module, extra in planted.items():
        sources[module] = sources[module] + "\n" + extra
    found = violations(sources)
    assert len(found) == 4, found
    assert any("syncscope.exporter.jobwide" in v and "syncscope.lab.servers" in v for v in found)
    assert any("syncscope.agent.core" in v and "(exporter)" in v for v in found)
    assert any("syncscope.catalog" in v and "(monitoring)" in v for v in found)
    assert any("syncscope.monitoring.rules" in v and "syncscope.lab" in v for v in found)


def test_every_package_in_the_tree_is_listed_for_the_wheel():
    # A package missing from pyproject's list installs without it (the wheel then fails at
    # import, which only the slow packaging test would show).
    import tomllib

    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    dirs = {folder: name for name, folder in setuptools["package-dir"].items()}
    assert dirs, setuptools
    found = {
        ".".join((name, *init.parent.relative_to(ROOT / folder).parts))
        for folder, name in dirs.items()
        for init in (ROOT / folder).rglob("__init__.py")
    }
    assert found == set(setuptools["packages"]), found ^ set(setuptools["packages"])


def test_the_exporter_imports_its_own_modules_one_way():
    sources = tree()
    listed = {f"syncscope.exporter.{m}" for m in EXPORTER_ORDER}
    found = {m for m in sources if m.startswith("syncscope.exporter.")}
    assert found == listed, f"place each exporter module in EXPORTER_ORDER: {found ^ listed}"
    assert len(exporter_edges(sources)) > 30  # the walk found the exporter's imports
    found = exporter_violations(sources)
    assert not found, "the exporter's imports against EXPORTER_ORDER:\n" + "\n".join(found)


def test_an_exporter_cycle_is_caught_hidden_in_a_function_or_not():
    """Planted: the settings reaching up into the diagnosis inside a function (as the cycle
    this order replaced did), and the result types importing the store by its package."""
    sources = tree()
    sources["syncscope.exporter.settings"] += (
        "\ndef f():\n    from syncscope.exporter.diagnosis import DEFAULT_THRESHOLDS\n"
    )
    sources["syncscope.exporter.findings"] += "\nfrom syncscope.exporter import store\n"
    found = exporter_violations(sources)
    assert any(
        v.startswith("syncscope.exporter.settings:")
        and "imports syncscope.exporter.diagnosis, which EXPORTER_ORDER lists after it" in v
        for v in found
    ), found
    assert any(
        v.startswith("syncscope.exporter.findings:") and "imports syncscope.exporter.store," in v
        for v in found
    ), found
    cycles_found = [v for v in found if v.startswith("import cycle ")]
    assert len(cycles_found) == 1, found  # one component: settings, store, findings, diagnosis…
    assert "syncscope.exporter.settings" in cycles_found[0], cycles_found


def test_a_cycle_is_found_whatever_the_order_says():
    edges = {("a", "b"): 1, ("b", "c"): 2, ("c", "a"): 3, ("c", "d"): 4, ("d", "e"): 5}
    assert cycles(edges) == [(["a", "b", "c", "a"], ["a", "b", "c"])]
    assert cycles({("a", "b"): 1, ("b", "c"): 2}) == []


def test_nothing_installed_imports_bench():
    found = bench_imports(tree())
    assert not found, "installed code imports bench/:\n" + "\n".join(found)


def test_an_import_of_bench_is_caught():
    """Planted: the exporter importing a bench, the lab importing one by name, the agent a
    bench module inside a function."""
    sources = tree()
    sources["syncscope.exporter.app"] += "\nfrom bench.bench_scale import Job\n"
    sources["syncscope.lab.demo"] += (
        "\nimport importlib\nsim = importlib.import_module('bench.bench_sim')\n"
    )
    sources["syncscope.agent.config"] += "\ndef f():\n    import bench\n"
    found = bench_imports(sources)
    assert len(found) == 3, found
    assert any(v.startswith("syncscope.exporter.app:") and "bench.bench_scale" in v for v in found)
    assert any(v.startswith("syncscope.lab.demo:") and "bench.bench_sim" in v for v in found)
    assert any(v.startswith("syncscope.agent.config:") and "imports bench," in v for v in found)
