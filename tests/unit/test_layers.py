"""The layers point one way: core ← agent, exporter ← monitoring, simulator, integrations ←
lab ← cli (the command line runs the lab's demo). A module imports syncscope modules of its own room or of a lower layer only; agent and
exporter, side by side, never import each other. Read from the source (every import statement,
also inside functions), so nothing needs importing to be checked.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator, Mapping
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


def imported(module: str, source: str) -> Iterator[tuple[int, str]]:
    """(line, syncscope module) for every import in `source`, relative ones resolved."""
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
            else:
                yield node.lineno, base


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
