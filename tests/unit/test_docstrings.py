"""Comments say what the code does and why; figures go to docs/evaluation.md, history to git.

Read from the source of every module under agent/, exporter/, sim/ and syncscope/ (nothing is
imported): no module, class or function docstring runs past MAX_LINES lines, and no docstring or
comment of runtime code quotes a measured run (a figure from one machine, its date, its lab
notebook) or the code's history. The lab (syncscope/lab/), which runs measurements on the
machine it is on, is exempt from the second rule only.
"""

from __future__ import annotations

import ast
import io
import re
import tokenize
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
FOLDERS = ("agent", "exporter", "sim", "syncscope")
# Test-lab code, which describes the runs it makes on this machine.
FIGURES_EXEMPT = ("syncscope/lab/",)
MAX_LINES = 25

# A line of a docstring or comment that reads like a lab notebook, and why.
NOTEBOOK = (
    (re.compile(r"(?<!\bas )\bmeasured:"), "a measured figure"),
    (re.compile(r"\bmeasured (?:on|in)\b"), "where a figure was measured"),
    (re.compile(r"\b(?:on|in) CI\b"), "a figure from CI"),
    (re.compile(r"\bthis machine\b", re.I), "a figure from one machine"),
    (re.compile(r"\bhere:\s*[~≈]?\s*\d"), "a figure from one machine"),
    (
        re.compile(r"\bon (?:the|an?) (?:[A-Z]?H\d00|A100|B200|loaded machine|quiet machine)\b"),
        "a figure from one machine",
    ),
    (re.compile(r"\b20\d\d-[01]\d-[0-3]\d\b"), "a date"),
    (re.compile(r"FIELD-NOTES", re.I), "a lab notebook that is not in the repository"),
    (re.compile(r"\bbefore commit\b|\bcommit [0-9a-f]{7,40}\b", re.I), "history"),
    (re.compile(r"\bwe used to\b|\bused to be\b", re.I), "history"),
)


def sources() -> Iterator[tuple[str, str]]:
    for folder in FOLDERS:
        for path in sorted((ROOT / folder).rglob("*.py")):
            yield path.relative_to(ROOT).as_posix(), path.read_text(encoding="utf-8")


def docstrings(tree: ast.Module) -> Iterator[tuple[str, ast.Expr]]:
    """(name, the docstring's statement) of the module and of every class and function."""
    nodes: list[ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef] = [tree]
    nodes += [
        n
        for n in ast.walk(tree)
        if isinstance(n, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
    ]
    for node in nodes:
        first = node.body[0] if node.body else None
        if ast.get_docstring(node, clean=False) is None or not isinstance(first, ast.Expr):
            continue
        yield getattr(node, "name", "module"), first


def texts(source: str, tree: ast.Module) -> Iterator[tuple[int, str]]:
    """(line number, line) of every docstring and comment."""
    for _, expr in docstrings(tree):
        value = expr.value
        assert isinstance(value, ast.Constant) and isinstance(value.value, str)
        for offset, line in enumerate(value.value.splitlines()):
            yield expr.lineno + offset, line
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.COMMENT:
            yield token.start[0], token.string


def long_docstrings() -> list[str]:
    found = []
    for rel, source in sources():
        for name, expr in docstrings(ast.parse(source)):
            lines = (expr.end_lineno or expr.lineno) - expr.lineno + 1
            if lines > MAX_LINES:
                found.append(f"{rel}:{expr.lineno}: {name}'s docstring is {lines} lines")
    return found


def notebook_lines() -> list[str]:
    found = []
    for rel, source in sources():
        if rel.startswith(FIGURES_EXEMPT):
            continue
        for lineno, line in texts(source, ast.parse(source)):
            for pattern, why in NOTEBOOK:
                if pattern.search(line):
                    found.append(f"{rel}:{lineno}: {why}: {line.strip()}")
                    break
    return found


def test_no_docstring_runs_past_the_limit() -> None:
    found = long_docstrings()
    assert not found, (
        f"{len(found)} docstrings over {MAX_LINES} lines: say what and why, and leave the"
        " design to docs/:\n" + "\n".join(found)
    )


def test_no_lab_notebook_in_runtime_comments() -> None:
    found = notebook_lines()
    assert not found, (
        f"{len(found)} comments or docstrings quote a measured run or history: figures go to"
        " docs/evaluation.md (date, commit, command), history to git:\n" + "\n".join(found)
    )


def test_the_rules_catch_what_they_are_for() -> None:
    source = (
        '"""Module.\n\nmeasured: 8.5 ms of wait on 12 ms gloo steps, 2026-11-28."""\n'
        "# 42 ms for 2000 entries on the H100\n"
        "x = 1  # the resolved value: measured on gloo + DDP\n"
        "# what a step is measured from (not a figure)\n"
    )
    hits = [
        line
        for _, line in texts(source, ast.parse(source))
        if any(pattern.search(line) for pattern, _ in NOTEBOOK)
    ]
    assert len(hits) == 3, hits
