"""The documentation's check (syncscope/monitoring/docs_check.py): the checkout passes it, and
each fault it looks for is caught when planted in a temporary copy."""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import pytest

from syncscope.monitoring import docs_check, reference

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def known() -> docs_check.Known:
    return docs_check.known_from_code(ROOT)


@pytest.fixture(scope="module")
def expected_reference() -> dict[str, str]:
    return reference.files()


def test_the_docs_pass_the_check(known, expected_reference):
    problems = docs_check.check(ROOT, known, expected_reference)
    assert problems == [], "\n".join(map(str, problems))


def test_the_readme_is_a_front_page():
    words = docs_check.readme_words((ROOT / "README.md").read_text())
    assert words <= docs_check.README_MAX_WORDS
    readme = (ROOT / "README.md").read_text()
    assert "make demo" in readme and "make test" in readme


def test_the_known_names_come_from_the_code(known):
    assert "syncscope_steps_total" in known.metrics
    assert "syncscope_step_duration_seconds_bucket" in known.metrics
    assert "SyncscopeStepTimeCVHigh" in known.alerts
    assert "job:syncscope_step_time_cv:max" in known.records
    assert "SyncscopeCallback" in known.identifiers
    assert "--prometheus-url" in known.flags["syncscope-exporter"]
    assert known.flags["syncscope exporter"] == known.flags["syncscope-exporter"]
    assert "--check" in known.flags["syncscope generate"]


@pytest.mark.parametrize(
    ("heading", "anchor"),
    [
        ("Alert Name: SyncscopeStraggler", "alert-name-syncscopestraggler"),
        ("Goodput and badput over the job's life", "goodput-and-badput-over-the-jobs-life"),
        ("`syncscope project`: fit and project", "syncscope-project-fit-and-project"),
        ("1,024 × 8 again (commit 25a2b79)", "1024--8-again-commit-25a2b79"),
        ("Fabric: contention and the slow link", "fabric-contention-and-the-slow-link"),
    ],
)
def test_anchors_follow_githubs_rules(heading, anchor):
    assert docs_check.slug(heading) == anchor


def test_repeated_headings_and_explicit_anchors():
    text = '# A\n\n## Notes\n\n```\n# not a heading\n```\n\n## Notes\n\n<a id="here"></a>\n'
    assert docs_check.anchors(text) == {"a", "notes", "notes-1", "here"}


def _tree(tmp_path: Path, expected_reference: dict[str, str]) -> Path:
    """A small checkout: a README, two guides, the generated reference and one source file."""
    root = tmp_path / "checkout"
    (root / "docs").mkdir(parents=True)
    (root / "agent").mkdir()
    (root / "agent" / "pacing.py").write_text("")
    (root / "docs" / "runbook.md").write_text(  # the alerts' anchors, which rules.md links to
        "".join(f"## Alert Name: {name}\n\n" for name in sorted(known_alerts()))
    )
    for rel, text in expected_reference.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    (root / "README.md").write_text(
        "# syncscope\n\nSee [the guide](docs/guide.md#attach-it) and "
        "[the metrics](docs/reference/metrics.md).\n\n"
        "```bash\nsyncscope-exporter --prometheus-url http://p:9090 --port 9464\n```\n"
    )
    (root / "docs" / "guide.md").write_text(
        "# Guide\n\n## Attach it\n\nWatch `syncscope_step_time_cv` and "
        "`job:syncscope_step_time_cv:max`; SyncscopeStraggler pages. The controller is "
        "[agent/pacing.py](../agent/pacing.py); back to [the top](#guide). "
        "Run `syncscope generate --check`.\n"
    )
    return root


def known_alerts() -> set[str]:
    return reference.alert_names()


def _kinds(problems: list[docs_check.Problem]) -> list[tuple[str, str]]:
    return [(p.path, p.kind) for p in problems]


def test_a_clean_copy_passes(tmp_path, known, expected_reference):
    root = _tree(tmp_path, expected_reference)
    assert docs_check.check(root, known, expected_reference) == []


def test_a_broken_link_and_a_missing_anchor_are_reported(tmp_path, known, expected_reference):
    root = _tree(tmp_path, expected_reference)
    guide = root / "docs" / "guide.md"
    guide.write_text(
        guide.read_text() + "\nSee [gone](gone.md), [nowhere](#no-such-heading) and "
        "[the runbook's](reference/rules.md#not-there).\n"
    )
    problems = docs_check.check(root, known, expected_reference)
    assert _kinds(problems) == [
        ("docs/guide.md", "anchor"),
        ("docs/guide.md", "anchor"),
        ("docs/guide.md", "link"),
    ], problems
    assert any("gone.md" in p.message for p in problems)


def test_an_unknown_metric_alert_record_and_flag_are_reported(tmp_path, known, expected_reference):
    root = _tree(tmp_path, expected_reference)
    guide = root / "docs" / "guide.md"
    guide.write_text(
        guide.read_text() + "\nAlso `syncscope_step_time_cv_ratio`, SyncscopeStragglerOld, "
        "`job:syncscope_no_such:rate`, and:\n\n```bash\nsyncscope-exporter \\\n"
        "    --prometheus-url http://p:9090 --no-such-flag\nsyncscope rules --outdir x\n```\n"
    )
    problems = docs_check.check(root, known, expected_reference)
    assert sorted(p.kind for p in problems) == ["alert", "flag", "flag", "metric", "record"]
    messages = " ".join(p.message for p in problems)
    for name in (
        "syncscope_step_time_cv_ratio",
        "SyncscopeStragglerOld",
        "job:syncscope_no_such:rate",
        "syncscope-exporter --no-such-flag",
        "syncscope rules --outdir",
    ):
        assert name in messages


def test_a_stale_generated_reference_is_reported(tmp_path, known, expected_reference):
    root = _tree(tmp_path, expected_reference)
    metrics = root / "docs" / "reference" / "metrics.md"
    metrics.write_text(metrics.read_text().replace("syncscope_steps_total", "syncscope_steps"))
    (root / "docs" / "reference" / "cli.md").unlink()
    problems = docs_check.check(root, known, expected_reference)
    assert _kinds(problems) == [
        ("docs/reference/cli.md", "stale"),
        ("docs/reference/metrics.md", "stale"),
        ("docs/reference/metrics.md", "metric"),  # the planted name is unknown, too
        ("docs/reference/settings.md", "link"),  # and the page that links to cli.md breaks
    ], problems


def test_build_history_words_and_a_long_readme_are_reported(tmp_path, known, expected_reference):
    root = _tree(tmp_path, expected_reference)
    guide = root / "docs" / "guide.md"
    guide.write_text(
        guide.read_text()
        + "\nAs FIELD-NOTES says (issue 32), measured in the session under /work/main.\n"
    )
    readme = root / "README.md"
    readme.write_text(readme.read_text() + "word " * docs_check.README_MAX_WORDS)
    problems = docs_check.check(root, known, expected_reference)
    assert _kinds(problems) == [("README.md", "length")] + [("docs/guide.md", "words")] * 4


def test_the_real_checkout_copy_fails_on_a_planted_fault(tmp_path, known, expected_reference):
    """The same faults in a copy of the real docs: the check is not only clean by accident."""
    root = tmp_path / "copy"
    shutil.copytree(ROOT / "docs", root / "docs")
    shutil.copy(ROOT / "README.md", root / "README.md")
    for folder in ("agent", "exporter", "syncscope", "sim", "bench", "deploy", "dashboards"):
        (root / folder).symlink_to(ROOT / folder)
    for name in ("Makefile", "docker-compose.yml", "pyproject.toml", "tests", "scripts"):
        (root / name).symlink_to(ROOT / name)
    readme = root / "README.md"
    readme.write_text(readme.read_text().replace("docs/", "doc/", 1) + "\n`syncscope_nope`\n")
    (root / "docs" / "reference" / "rules.md").write_text("# stale\n")
    kinds = {p.kind for p in docs_check.check(root, known, expected_reference)}
    assert {"link", "metric", "stale"} <= kinds


def _block_env() -> dict[str, str]:
    """The environment the marked blocks run in: this interpreter's bin folder first on PATH, so
    that `syncscope` and `python` are the checkout's."""
    env = dict(os.environ)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    return env


def test_the_guides_mark_runnable_blocks():
    """The quick start's check and each guide's cheap commands are marked, and nothing slow is."""
    blocks = docs_check.all_runnable_blocks(ROOT)
    assert {b.path for b in blocks} >= {"docs/deploy.md", "docs/observability.md"}, blocks
    assert any("syncscope generate --check" in b.code for b in blocks)
    for block in blocks:
        assert "make demo" not in block.code and "make test" not in block.code, block


@pytest.mark.slow
@pytest.mark.parametrize(
    "block", docs_check.all_runnable_blocks(ROOT), ids=lambda b: f"{b.path}:{b.line}"
)
def test_every_runnable_block_runs(block, tmp_path):
    env = _block_env()
    env["TMPDIR"] = str(tmp_path)  # a block's `mktemp -d` output lands in pytest's folder
    problem = docs_check.run_block(block, ROOT, env, timeout=120)
    assert problem is None, str(problem)


def test_runnable_markers_are_read_and_misplaced_ones_reported():
    text = (
        "# Page\n\n```bash runnable\nsyncscope --help\n```\n\n<!-- runnable -->\n\n"
        "```sh\n$ echo one\n```\n\n```bash\nnot marked\n```\n\n<!-- runnable -->\nprose\n\n"
        "```python runnable\nprint(1)\n```\n\n<!-- runnable -->\n"
    )
    blocks, problems = docs_check.runnable_blocks("docs/p.md", text)
    assert [(b.line, b.code) for b in blocks] == [(3, "syncscope --help\n"), (9, "$ echo one\n")]
    assert [(p.line, p.kind) for p in problems] == [
        (17, "runnable"),  # a marker before prose
        (20, "runnable"),  # a Python block
        (24, "runnable"),  # a marker at the end
    ], problems


def test_a_failing_or_hanging_runnable_block_is_reported(tmp_path, known, expected_reference):
    root = _tree(tmp_path, expected_reference)
    guide = root / "docs" / "guide.md"
    guide.write_text(
        guide.read_text() + "\n```bash runnable\n$ echo ok\nfalse | cat\necho not reached\n```\n"
        '\n<!-- runnable -->\n```bash\nsleep 5\n```\n\n```bash runnable\necho "$UNSET_X"\n```\n'
        "\n<!-- runnable -->\n```python\nprint(1)\n```\n"
    )
    assert _kinds(docs_check.check(root, known, expected_reference)) == [
        ("docs/guide.md", "runnable")  # the Python block
    ]
    blocks = docs_check.all_runnable_blocks(root)
    assert len(blocks) == 3
    problems = [docs_check.run_block(b, root, _block_env(), timeout=1) for b in blocks]
    assert all(p is not None and p.kind == "runnable" for p in problems), problems
    assert "exit 1" in problems[0].message  # pipefail: `false | cat` fails the block
    assert "did not finish" in problems[1].message
    assert "UNSET_X" in problems[2].message  # -u: an unset variable fails the block
    ok = docs_check.Block("docs/guide.md", 1, "bash", "$ echo ok\n")
    assert docs_check.run_block(ok, root, _block_env()) is None
