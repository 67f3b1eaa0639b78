"""The documentation's check: README.md and docs/**/*.md against the code and against themselves.

`check(root)` returns every problem found, each with its file and line; tests/unit/test_docs.py
runs it on the checkout (and on planted faults in a temporary copy). What it checks:

- links: every relative link and image resolves to a file or folder of the checkout, and every
  `#anchor` to a heading (GitHub's anchor rules) or an explicit `<a id>` of the target page;
- names: every metric (`syncscope_*`), alert (`Syncscope*`) and recorded series
  (`level:syncscope_*:operations`) the docs mention exists in the catalog, the thresholds file
  or the rule generators;
- flags: every `--flag` written after a `syncscope` or `syncscope-exporter` command, in code,
  is an option of that command's parser;
- words: nothing about how the project was built (notebook names, issue numbers, the
  machinery that ran it, machine-local paths);
- the README's length (at most README_MAX_WORDS words, counted as `wc -w` counts);
- the generated reference (docs/reference/) is current (`syncscope generate` rewrites it);
- runnable blocks: a shell block marked runnable (```` ```bash runnable ```` or an
  `<!-- runnable -->` line before its fence) is a bash/sh block; `runnable_blocks()` lists
  them, and tests/unit/test_docs.py runs each with `bash -euo pipefail` (see `run_block`).
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path

README = "README.md"
DOCS_DIR = "docs"
README_MAX_WORDS = 1500

# Words that describe how the project was built rather than how to use it.
BANNED = (
    (re.compile(r"FIELD-NOTES", re.I), "a lab notebook that is not in the repository"),
    (re.compile(r"\bissues? #?\d+\b", re.I), "an issue number"),
    (re.compile(r"\bsessions?\b", re.I), "the machinery that built the project"),
    (re.compile(r"\bdevice (?:time|machine)\b", re.I), "the machinery that built the project"),
    (re.compile(r"/work/"), "a machine-local path"),
    (re.compile(r"\.\./shared\b"), "a machine-local path"),
)

_FENCE = re.compile(r"^\s*(```|~~~)")
_HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
_LINK = re.compile(r"!?\[(?:[^\]\\]|\\.)*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_HTML_LINK = re.compile(r"<(?:a|img)\b[^>]*?\b(?:href|src)=\"([^\"]+)\"", re.I)
_HTML_ANCHOR = re.compile(r"<a\b[^>]*?\b(?:id|name)=\"([^\"]+)\"", re.I)
_INLINE_CODE = re.compile(r"(`+)(.+?)\1")
_RECORDED = re.compile(r"(?<![\w:])[a-z_]+:syncscope_[a-z0-9_]*:[a-z0-9_]+(?![\w:])")
_METRIC = re.compile(r"(?<![\w/.:-])syncscope_[a-z0-9_]+(?![\w-])")
_ALERT = re.compile(r"(?<!\w)Syncscope[A-Z]\w*")
_COMMAND = re.compile(
    r"(?:^|(?<=[\s(`'\"]))(?:[\w./-]*/bin/)?"
    r"(syncscope-exporter|python3? -m syncscope\.exporter|syncscope(?:\s+[a-z][a-z-]*)?)"
    r"(?![\w./-])"
)
_RUNNABLE_COMMENT = re.compile(r"^\s*<!--\s*runnable\s*-->\s*$", re.I)
_SHELLS = ("bash", "sh", "shell", "console")
RUNNABLE_TIMEOUT_S = 120
_SEPARATOR = re.compile(r"\|\|?|;|&&|(?<!\S)[<>]|(?<!\S)#")


@dataclass(frozen=True, order=True)
class Problem:
    path: str
    line: int
    kind: str  # link, anchor, metric, alert, record, flag, words, length, stale, runnable
    message: str

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: {self.kind}: {self.message}"


@dataclass
class Known:
    """What the code declares: the names and flags the docs may mention."""

    metrics: set[str] = field(default_factory=set)
    alerts: set[str] = field(default_factory=set)
    records: set[str] = field(default_factory=set)
    # Other CamelCase names that start with Syncscope (classes: SyncscopeCallback).
    identifiers: set[str] = field(default_factory=set)
    # "syncscope-exporter", "syncscope", "syncscope rules", ... -> its option strings.
    flags: dict[str, set[str]] = field(default_factory=dict)


def known_from_code(root: Path | None = None) -> Known:
    """Names and flags from the catalog, the thresholds file, the rule generators, the parsers
    and (for the Syncscope* class names) the source of the checkout at `root`."""
    from syncscope import catalog
    from syncscope.monitoring import reference

    metrics = set()
    for m in catalog.CATALOG:
        metrics.add(m.name)
        if m.type == "histogram":
            metrics.update(m.name + s for s in ("_bucket", "_sum", "_count"))
    identifiers: set[str] = set()
    if root is not None:
        for folder in ("syncscope", "agent", "exporter", "sim"):
            for path in sorted((root / folder).rglob("*.py")):
                identifiers.update(re.findall(r"^\s*class (Syncscope\w+)", path.read_text(), re.M))
    return Known(
        metrics=metrics,
        alerts=reference.alert_names(),
        records=reference.recorded_names(),
        identifiers=identifiers,
        flags={name: reference.parser_flags(p) for name, p in reference.cli_parsers().items()},
    )


def doc_files(root: Path) -> list[Path]:
    files = [root / README] if (root / README).exists() else []
    return files + sorted((root / DOCS_DIR).rglob("*.md"))


# ---------------------------------------------------------------------------------- anchors


def slug(heading: str) -> str:
    """GitHub's anchor for a heading's text (before de-duplication)."""
    text = re.sub(r"<[^>]+>", "", heading)
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", text)
    text = text.replace("`", "").strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def _prose_lines(text: str) -> Iterator[tuple[int, str, bool]]:
    """(line number, line, inside a fenced code block) for every line."""
    fence: str | None = None
    for number, line in enumerate(text.splitlines(), 1):
        match = _FENCE.match(line)
        if match:
            if fence is None:
                fence = match.group(1)
                yield number, line, True
                continue
            if match.group(1) == fence:
                fence = None
                yield number, line, True
                continue
        yield number, line, fence is not None


def anchors(text: str) -> set[str]:
    """Every anchor a page has: its headings' (duplicates numbered as GitHub does) and its
    explicit `<a id>`/`<a name>` ones."""
    seen: dict[str, int] = {}
    out: set[str] = set()
    for _number, line, in_code in _prose_lines(text):
        if in_code:
            continue
        out.update(_HTML_ANCHOR.findall(line))
        match = _HEADING.match(line)
        if not match:
            continue
        base = slug(match.group(2))
        count = seen.get(base, 0)
        seen[base] = count + 1
        out.add(base if count == 0 else f"{base}-{count}")
    return out


# ------------------------------------------------------------------------------------ checks


def _without_inline_code(line: str) -> str:
    return _INLINE_CODE.sub(lambda m: " " * len(m.group(0)), line)


def check_links(root: Path, path: Path, text: str, cache: dict[Path, set[str]]) -> list[Problem]:
    rel = path.relative_to(root).as_posix()
    problems = []
    for number, line, in_code in _prose_lines(text):
        if in_code:
            continue
        bare = _without_inline_code(line)
        for target in _LINK.findall(bare) + _HTML_LINK.findall(bare):
            if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I):
                continue  # http:, https:, mailto:
            file_part, _, anchor = target.partition("#")
            dest = (path.parent / file_part).resolve() if file_part else path
            try:
                dest.relative_to(root.resolve())
                inside = True
            except ValueError:
                inside = False
            if file_part and (not inside or not dest.exists()):
                problems.append(Problem(rel, number, "link", f"{target}: no such file"))
                continue
            if not anchor:
                continue
            if dest.suffix != ".md" or dest.is_dir():
                problems.append(Problem(rel, number, "anchor", f"{target}: not a Markdown page"))
                continue
            if dest not in cache:
                cache[dest] = anchors(dest.read_text(encoding="utf-8"))
            if anchor not in cache[dest]:
                problems.append(Problem(rel, number, "anchor", f"{target}: no such heading"))
    return problems


def check_names(rel: str, text: str, known: Known) -> list[Problem]:
    problems = []
    for number, line in enumerate(text.splitlines(), 1):
        for name in _RECORDED.findall(line):
            if name not in known.records:
                problems.append(Problem(rel, number, "record", f"{name}: no rule records it"))
        rest = _RECORDED.sub(" ", line)
        for name in _METRIC.findall(rest):
            if name in known.metrics:
                continue
            if name.endswith("_") and any(m.startswith(name) for m in known.metrics):
                continue  # a family prefix: syncscope_gpu_*
            problems.append(Problem(rel, number, "metric", f"{name}: not in syncscope/catalog.py"))
        for name in _ALERT.findall(line):
            if name not in known.alerts and name not in known.identifiers:
                problems.append(Problem(rel, number, "alert", f"{name}: no such alert"))
    return problems


def _code_segments(text: str) -> Iterator[tuple[int, str]]:
    """(line, text) of every piece of code: inline code spans, and fenced lines with their
    backslash continuations joined."""
    pending: tuple[int, str] | None = None
    for number, line, in_code in _prose_lines(text):
        if in_code:
            if _FENCE.match(line):
                continue
            if pending is not None:
                line = pending[1] + " " + line.strip()
                number = pending[0]
                pending = None
            if line.rstrip().endswith("\\"):
                pending = (number, line.rstrip()[:-1])
                continue
            yield number, line
        else:
            for match in _INLINE_CODE.finditer(line):
                yield number, match.group(2)


def check_flags(rel: str, text: str, known: Known) -> list[Problem]:
    problems = []
    for number, code in _code_segments(text):
        for match in _COMMAND.finditer(code):
            words = match.group(1).split()
            if words[0] in ("python", "python3"):
                command = "syncscope-exporter"
            elif len(words) == 2 and f"syncscope {words[1]}" in known.flags:
                command = f"syncscope {words[1]}"
            elif len(words) == 2:
                continue  # prose in code ("syncscope is ..."), or a path
            else:
                command = words[0]
            flags = known.flags.get(command)
            if flags is None:
                continue
            args = _SEPARATOR.split(code[match.end() :], maxsplit=1)[0]
            for token in re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", args):
                if token not in flags:
                    problems.append(
                        Problem(rel, number, "flag", f"`{command} {token}`: no such option")
                    )
    return problems


def check_words(rel: str, text: str) -> list[Problem]:
    problems = []
    for number, line in enumerate(text.splitlines(), 1):
        for pattern, why in BANNED:
            match = pattern.search(line)
            if match:
                problems.append(Problem(rel, number, "words", f"{match.group(0)!r}: {why}"))
    return problems


@dataclass(frozen=True)
class Block:
    """A fenced block marked runnable: where it starts, its info string and its lines."""

    path: str
    line: int
    info: str
    code: str


def _fence_info(line: str) -> str:
    return _FENCE.sub("", line, count=1).strip()


def runnable_blocks(rel: str, text: str) -> tuple[list[Block], list[Problem]]:
    """The blocks of a page marked runnable (```` ```bash runnable ````, or a line
    `<!-- runnable -->` right before the fence, blank lines between allowed), and a problem
    for each marker that marks nothing or marks a block that is not bash/sh."""
    blocks: list[Block] = []
    problems: list[Problem] = []
    marker: int | None = None  # the line of a pending <!-- runnable --> comment
    fence: str | None = None
    start, info, marked = 0, "", False
    lines: list[str] = []
    for number, line in enumerate(text.splitlines(), 1):
        match = _FENCE.match(line)
        if fence is None and match:
            fence, start, info, lines = match.group(1), number, _fence_info(line), []
            marked = marker is not None or "runnable" in info.split()[1:]
            marker = None
            continue
        if fence is not None:
            if not (match and match.group(1) == fence and not _fence_info(line)):
                lines.append(line)
                continue
            fence = None
            if not marked:
                continue
            language = info.split()[0] if info.split() else ""
            if language in _SHELLS:
                blocks.append(Block(rel, start, info, "\n".join(lines) + "\n"))
            else:
                problems.append(
                    Problem(
                        rel,
                        start,
                        "runnable",
                        f"a {language or 'plain'} block is marked runnable (only bash/sh run)",
                    )
                )
            continue
        if _RUNNABLE_COMMENT.match(line):
            if marker is not None:
                problems.append(Problem(rel, marker, "runnable", "the marker marks no block"))
            marker = number
        elif line.strip() and marker is not None:
            problems.append(Problem(rel, marker, "runnable", "the marker marks no block"))
            marker = None
    if marker is not None:
        problems.append(Problem(rel, marker, "runnable", "the marker marks no block"))
    return blocks, problems


def all_runnable_blocks(root: Path) -> list[Block]:
    blocks: list[Block] = []
    for path in doc_files(root):
        blocks += runnable_blocks(path.relative_to(root).as_posix(), path.read_text("utf-8"))[0]
    return blocks


def run_block(
    block: Block,
    cwd: Path,
    env: Mapping[str, str] | None = None,
    timeout: float = RUNNABLE_TIMEOUT_S,
) -> Problem | None:
    """Run one block with `bash -euo pipefail` in `cwd`; a problem if it fails or times out.
    A block's `$ ` prompts are removed first, so a console block runs as written."""
    import subprocess

    code = "\n".join(
        line[2:] if line.startswith("$ ") else line for line in block.code.splitlines()
    )
    try:
        done = subprocess.run(
            ["bash", "-euo", "pipefail", "-c", code],
            cwd=cwd,
            env=None if env is None else dict(env),
            capture_output=True,
            text=True,
            timeout=timeout,
            stdin=subprocess.DEVNULL,
        )
    except subprocess.TimeoutExpired:
        return Problem(block.path, block.line, "runnable", f"did not finish in {timeout:g} s")
    if done.returncode != 0:
        tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
        return Problem(
            block.path, block.line, "runnable", f"exit {done.returncode}: " + " | ".join(tail)
        )
    return None


def readme_words(text: str) -> int:
    return len(text.split())


def check_reference(root: Path, expected: Mapping[str, str] | None = None) -> list[Problem]:
    """The generated reference pages against what `syncscope generate` would write."""
    if expected is None:
        from syncscope.monitoring import reference

        expected = reference.files()
    problems = []
    for rel, text in sorted(expected.items()):
        path = root / rel
        if not path.exists():
            problems.append(Problem(rel, 0, "stale", "missing (run: syncscope generate)"))
        elif path.read_text(encoding="utf-8") != text:
            problems.append(Problem(rel, 0, "stale", "out of date (run: syncscope generate)"))
    return problems


def check(
    root: Path, known: Known | None = None, reference: Mapping[str, str] | None = None
) -> list[Problem]:
    """Every problem in the checkout's (or a copy's) README.md and docs/**/*.md, sorted."""
    known = known if known is not None else known_from_code(root)
    problems = check_reference(root, reference)
    cache: dict[Path, set[str]] = {}
    for path in doc_files(root):
        text = path.read_text(encoding="utf-8")
        rel = path.relative_to(root).as_posix()
        problems += check_links(root, path, text, cache)
        problems += check_names(rel, text, known)
        problems += check_flags(rel, text, known)
        problems += check_words(rel, text)
        problems += runnable_blocks(rel, text)[1]
        if rel == README and readme_words(text) > README_MAX_WORDS:
            problems.append(
                Problem(
                    rel, 0, "length", f"{readme_words(text)} words (at most {README_MAX_WORDS})"
                )
            )
    return sorted(problems)


def main() -> int:
    """`python -m syncscope.monitoring.docs_check [ROOT]`: print the problems; 1 if any."""
    import sys

    root = Path(sys.argv[1] if len(sys.argv) > 1 else ".").resolve()
    problems = check(root)
    for problem in problems:
        print(problem)
    print(f"{len(problems)} problem(s)", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    raise SystemExit(main())
