"""Prometheus rules: generated from one config, checked and unit-tested by promtool, and broken on purpose."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest

from syncscope.cli import main as syncscope
from syncscope.monitoring import dashboards, generate, prometheus_config
from syncscope.monitoring import rules as gen
from syncscope.thresholds import Thresholds, duration_seconds, load_config

yaml = pytest.importorskip("yaml", reason="PyYAML missing: run scripts/install-observability-tools")

ROOT = Path(__file__).resolve().parents[2]
PROM = ROOT / "deploy" / "prometheus"
TESTS_DIR = PROM / "tests"
RUNBOOK = ROOT / "docs" / "runbook.md"
PROMTOOL = shutil.which("promtool")
needs_promtool = pytest.mark.skipif(
    PROMTOOL is None,
    reason="promtool not installed: run scripts/install-observability-tools (apt prometheus)",
)


render = prometheus_config
RULES_PATH = ROOT / generate.RULES_PATH
PROMETHEUS_RULE_PATH = ROOT / generate.PROMETHEUS_RULE_PATH


# A guard against a hang, not a speed check. Every promtool test file at once was 82 s of CPU
# (2026-12-07; the two-day trends 60 s of it, at a 1m rule interval), 25 s with the trends in
# trends.test.yml at 5m; `make test` runs it at idle priority beside the quiet tests, where
# the 82 s took 256 s in one fresh-clone run and over 300 s in the next, the same day.
PROMTOOL_TIMEOUT_S = 900


def promtool(*args: str | Path, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    assert PROMTOOL is not None
    return subprocess.run(
        [PROMTOOL, *map(str, args)],
        capture_output=True,
        text=True,
        cwd=cwd,
        timeout=PROMTOOL_TIMEOUT_S,
    )


def rules_doc() -> dict:
    return yaml.safe_load(RULES_PATH.read_text())


def recording_rules(doc: dict) -> list[dict]:
    """Every recording rule, over the recording groups."""
    return [r for g in doc["groups"] for r in g["rules"] if "record" in r]


def alert_rules(doc: dict) -> list[dict]:
    (group,) = (g for g in doc["groups"] if g["name"] == gen.ALERTS_GROUP)
    return group["rules"]


def test_generated_files_match_the_package():
    """Rules, PrometheusRule, compose config, dashboards, contract, README table: all current."""
    assert generate.main(ROOT, check=True) == 0, "run: syncscope generate"


def test_prometheus_rule_carries_the_same_groups():
    cr = yaml.safe_load(PROMETHEUS_RULE_PATH.read_text())
    assert cr["apiVersion"] == "monitoring.coreos.com/v1" and cr["kind"] == "PrometheusRule"
    assert cr["spec"] == rules_doc()


@needs_promtool
def test_promtool_check_rules_including_lint():
    result = promtool("check", "rules", RULES_PATH)
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.slow
@pytest.mark.timeout(PROMTOOL_TIMEOUT_S + 60)
@needs_promtool
def test_promtool_unit_tests_pass():
    """Also the mutation tests' control: the rules they break are generated afresh (_layout),
    and the tree's are what a fresh generation writes (test_generated_files_match_the_package),
    so these pass unbroken."""
    files = sorted(TESTS_DIR.glob("*.test.yml"))
    assert len(files) >= 6
    result = promtool("test", "rules", *files)
    assert result.returncode == 0, result.stdout + result.stderr


def _test_files() -> list[dict]:
    return [yaml.safe_load(p.read_text()) for p in sorted(TESTS_DIR.glob("*.test.yml"))]


def test_every_recording_rule_has_a_promtool_case():
    used: set[str] = set()
    for doc in _test_files():
        for group in doc["tests"]:
            for case in group.get("promql_expr_test", []):
                used |= gen.metric_names(case["expr"])
    recorded = {r["record"] for r in recording_rules(rules_doc())}
    assert recorded - used == set()


def test_every_alert_severity_is_tested_on_both_sides_of_its_for_boundary():
    """Silent one evaluation before the alert fires, firing at the next evaluation."""
    seen: dict[tuple[str, str], list[int]] = {}
    for doc in _test_files():
        # Without a fixed order promtool runs the groups in random order (flaky for-timing).
        assert doc["group_eval_order"] == list(gen.GROUP_ORDER)
        step = duration_seconds(doc["evaluation_interval"])
        for group in doc["tests"]:
            cases = group.get("alert_rule_test", [])
            by_time = {(c["alertname"], duration_seconds(c["eval_time"])): c for c in cases}
            for (alert, t), case in by_time.items():
                before = by_time.get((alert, t - step))
                for exp in case["exp_alerts"]:
                    severity = exp["exp_labels"]["severity"]
                    silent = before is not None and not any(
                        e["exp_labels"]["severity"] == severity
                        and e["exp_labels"] == exp["exp_labels"]
                        for e in before["exp_alerts"]
                    )
                    if silent:
                        seen.setdefault((alert, severity), []).append(int(t))
                        # Exact annotations, not just labels.
                        assert set(exp["exp_annotations"]) == {
                            "summary",
                            "description",
                            "runbook_url",
                            "dashboard_url",
                        }
    expected = {(r["alert"], r["labels"]["severity"]) for r in alert_rules(rules_doc())}
    assert expected - set(seen) == set()


def test_alerts_have_severity_for_annotations_and_a_runbook_anchor():
    runbook = RUNBOOK.read_text()
    alerts = alert_rules(rules_doc())
    assert {a["alert"] for a in alerts} == {
        "SyncscopeStepTimeCVHigh",
        "SyncscopeStraggler",
        "SyncscopeSyncAmplification",
        "SyncscopeStructuralCoupling",
        "SyncscopeFabricContention",
        "SyncscopeSlowLink",
        "SyncscopeLocalityFault",
        "SyncscopePacingEngagedLong",
        "SyncscopeAgentDroppingRecords",
        "SyncscopeExporterDown",
        "SyncscopeRankSilent",
    }
    cfg = load_config()
    for a in alerts:
        assert a["labels"]["severity"] in {"info", "warning", "critical"}
        assert duration_seconds(a["for"]) > 0
        assert a["annotations"]["summary"] and a["annotations"]["description"]
        anchor = f"alert-name-{a['alert'].lower()}"
        # Absolute, so that Alertmanager's and the pager's links work; the e2e tests match
        # the suffix.
        assert a["annotations"]["runbook_url"] == (
            f"https://github.com/syncscope/syncscope/blob/main/docs/runbook.md#{anchor}"
        )
        assert a["annotations"]["runbook_url"].startswith(cfg.runbook_url_base)
        # GitHub derives the anchor from the heading; the explicit id serves other renderers.
        assert f"## Alert Name: {a['alert']}\n" in runbook
        assert f'<a id="{anchor}"></a>' in runbook
        dashboard = a["annotations"]["dashboard_url"]
        assert dashboard.startswith("https://grafana.set-dashboard-url-base.invalid/d/")
        uid = dashboard.split("/d/", 1)[1].split("?", 1)[0]
        assert uid in {dashboards.OVERVIEW_UID, dashboards.FABRIC_UID}
        if a["alert"] != "SyncscopeExporterDown":  # its job is the scrape job
            assert dashboard.endswith("?var-job={{ $labels.job | urlquery }}")


def test_urls_follow_the_config():
    cfg = load_config(
        {"runbook_url_base": "https://wiki.example/rb", "dashboard_url_base": "https://g.example/"}
    )
    (straggler,) = [a for a in gen.alerting_rules(cfg) if a["alert"] == "SyncscopeStraggler"]
    assert straggler["annotations"]["runbook_url"] == (
        "https://wiki.example/rb#alert-name-syncscopestraggler"
    )
    assert straggler["annotations"]["dashboard_url"] == (
        "https://g.example/d/syncscope-job-overview?var-job={{ $labels.job | urlquery }}"
    )


def test_alerts_are_one_per_job_not_one_per_rank():
    """No alert keeps a per-rank label: a thousand ranks must not mean a thousand alerts."""
    for doc in _test_files():
        for group in doc["tests"]:
            for case in group.get("alert_rule_test", []):
                for exp in case["exp_alerts"]:
                    assert not {"rank", "local_rank", "fault"} & set(exp["exp_labels"]), exp


def test_recording_rule_names_follow_level_metric_operations():
    for rule in recording_rules(rules_doc()):
        level, metric, ops = rule["record"].split(":")
        assert re.fullmatch(r"[a-z]+(_[a-z]+)*", level), rule["record"]
        assert metric.startswith("syncscope_") and re.fullmatch(r"[a-z0-9_]+", ops), rule["record"]
        # The level names the labels the result keeps.
        for label in level.split("_"):
            assert label in {
                "job",
                "rank",
                "op",
                "group",
                "phase",
                "fault",
                "stride",
                "slot",
                "node",
                "le",
                "category",
                "stage",
            }, rule["record"]


def test_rules_only_use_contract_metrics_and_their_own_records():
    contract = gen.series_conditions()
    recorded = {r["record"] for r in recording_rules(rules_doc())}
    for group in rules_doc()["groups"]:
        for rule in group["rules"]:
            unknown = gen.metric_names(rule["expr"]) - contract.keys() - recorded
            assert not unknown, (rule.get("record") or rule.get("alert"), unknown)


def test_shipped_thresholds_are_production_values():
    """This machine's scheduler noise alone gives CV 0.2-0.3: tests override, never the config."""
    cv = load_config().alerts["SyncscopeStepTimeCVHigh"].levels
    assert [(lv.severity, lv.threshold) for lv in cv] == [("warning", 0.1), ("critical", 0.2)]


def _numbers(value: object) -> set[float]:
    if isinstance(value, bool):
        return set()
    if isinstance(value, int | float):
        return {float(value)}
    if isinstance(value, dict):
        return {n for v in value.values() for n in _numbers(v)}
    if isinstance(value, list):
        return {n for v in value for n in _numbers(v)}
    return set()


# Config numbers an alert shares with the exporter's diagnosis, declared once there.
SHARED_WITH_THE_EXPORTER: dict[str, list[Callable[[Thresholds], float]]] = {
    "SyncscopeStraggler": [lambda cfg: cfg.diagnosis.skew_floor_s]
}


def test_thresholds_live_in_one_place():
    """An alert expression holds its own level's threshold and its own parameters from the
    config (other levels' thresholds excluded) and no other number."""
    cfg = load_config()
    for alert in gen.alerting_rules(cfg):
        spec = cfg.alerts[alert["alert"]]
        level = next(lv for lv in spec.levels if lv.severity == alert["labels"]["severity"])
        # The alert's entry as the file writes it (JSON), its levels left out.
        params = _numbers(
            spec.model_dump(mode="json", by_alias=True, exclude_unset=True, exclude={"levels"})
        )
        # Numbers standing alone: not part of a name, a duration ([1m]) or a decimal.
        numbers = {float(n) for n in re.findall(r"(?<![\w.])\d+(?:\.\d+)?(?![\w.])", alert["expr"])}
        shared = {float(get(cfg)) for get in SHARED_WITH_THE_EXPORTER.get(alert["alert"], ())}
        allowed = {0.0} | params | shared
        allowed |= {float(level.threshold)} if level.threshold is not None else set()
        assert numbers <= allowed, (alert["alert"], numbers)
        if level.threshold is not None:
            assert float(level.threshold) in numbers, alert["alert"]


def test_overrides_apply_and_typos_fail(tmp_path):
    cfg = load_config({"alerts.SyncscopeStepTimeCVHigh.levels.0.threshold": 0.5})
    assert cfg.alerts["SyncscopeStepTimeCVHigh"].levels[0].threshold == 0.5
    with pytest.raises(KeyError):
        load_config({"alerts.SyncscopeStepTimeCVHigh.levels.0.treshold": 0.5})
    out = tmp_path / "rules"
    assert (
        syncscope(["rules", "--out", str(out), "--fast-for", "2s", "--set", "windows.rate=10s"])
        == 0
    )
    doc = yaml.safe_load((out / "syncscope.rules.yml").read_text())
    fors = {a["alert"]: a["for"] for a in alert_rules(doc)}
    assert fors["SyncscopeStraggler"] == "2s" and fors["SyncscopeSyncAmplification"] == "4s"
    assert min(duration_seconds(f) for f in fors.values()) == 2.0
    steps_rate = next(r for r in recording_rules(doc) if r["record"] == gen.STEPS_RATE)
    assert "[10s]" in steps_rate["expr"]


# Each mutation must make the named promtool test file fail, naming the alert or rule.
MUTATIONS = [
    ("alerts.SyncscopeStepTimeCVHigh.levels.0.threshold", 0.3, "step", "SyncscopeStepTimeCVHigh"),
    ("alerts.SyncscopeStepTimeCVHigh.for", "11m", "step", "SyncscopeStepTimeCVHigh"),
    ("alerts.SyncscopeStraggler.levels.0.threshold", 0.25, "sync", "SyncscopeStraggler"),
    (
        "alerts.SyncscopeSyncAmplification.levels.0.threshold",
        0.5,
        "sync",
        "SyncscopeSyncAmplification",
    ),
    (
        "alerts.SyncscopeFabricContention.levels.0.threshold",
        2.5,
        "fabric",
        "SyncscopeFabricContention",
    ),
    ("contention_max_skew_ratio", 0.5, "fabric", "SyncscopeFabricContention"),
    # A lower floor lets the flag broadcast's cheap excess alert; a higher one silences train's.
    (
        "alerts.SyncscopeFabricContention.min_cost_share",
        0.001,
        "fabric",
        "SyncscopeFabricContention",
    ),
    (
        "alerts.SyncscopeFabricContention.min_cost_share",
        0.02,
        "fabric",
        "SyncscopeFabricContention",
    ),
    (
        "alerts.SyncscopeAgentDroppingRecords.levels.0.threshold",
        0.1,
        "health",
        "SyncscopeAgentDroppingRecords",
    ),
    ("alerts.SyncscopeRankSilent.levels.0.threshold", 600, "health", "SyncscopeRankSilent"),
    ("alerts.SyncscopePacingEngagedLong.for", "20m", "pacing", "SyncscopePacingEngagedLong"),
    ("alerts.SyncscopeStructuralCoupling.for", "16m", "sync", "SyncscopeStructuralCoupling"),
    ("windows.straggler", "1m", "sync", "straggler"),
    # The checkpoint gate: a narrower factor lets steady steps across the widest bucket page
    # ("ckpt10"); a tail quantile beyond the checkpoints' 1% lets the checkpoints page.
    ("alerts.SyncscopeStepTimeCVHigh.outliers.factor", 2.5, "step", "ckpt10"),
    ("alerts.SyncscopeStepTimeCVHigh.outliers.quantiles.2", 0.995, "step", "ckpt"),
    ("alerts.SyncscopeStepTimeCVHigh.outliers.quantiles.2", 0.995, "paging", "ckpt"),
    ("alerts.SyncscopeStraggler.for", "15m", "paging", "SyncscopeStraggler"),
    ("alerts.SyncscopeExporterDown.levels.0.threshold", 0.5, "health", "SyncscopeExporterDown"),
    ("alerts.SyncscopeExporterDown.levels.1.threshold", 0.25, "health", "SyncscopeExporterDown"),
    ("alerts.SyncscopeExporterDown.levels.1.threshold", 0.1, "paging", "SyncscopeExporterDown"),
    ("alerts.SyncscopeExporterDown.none_scraped_severity", None, "health", "SyncscopeExporterDown"),
    ("alerts.SyncscopeRankSilent.lookback", "5m", "health", "SyncscopeRankSilent"),
    ("alerts.SyncscopeRankSilent.levels.0.threshold", 300, "paging", "SyncscopeRankSilent"),
]


def _layout(tmp_path: Path, overrides: dict) -> Path:
    """tests/ beside a freshly generated rules/, as in the tree (the tests use ../rules)."""
    gen.write_rules(tmp_path / "rules", overrides)
    shutil.copytree(TESTS_DIR, tmp_path / "tests")
    return tmp_path / "tests"


@pytest.mark.slow
@needs_promtool
@pytest.mark.parametrize(
    ("key", "value", "test_file", "culprit"), MUTATIONS, ids=[m[0] for m in MUTATIONS]
)
def test_a_broken_threshold_fails_the_promtool_tests(tmp_path, key, value, test_file, culprit):
    tests = _layout(tmp_path, {key: value})
    path = tests / f"{test_file}.test.yml"
    # Only the file's test groups that name the culprit: the others' alerts and series do not
    # involve it, and promtool's time goes with the groups it evaluates (the 23 runs: 52 s of
    # CPU with whole files, 27 s so).
    doc = yaml.safe_load(path.read_text())
    doc["tests"] = [group for group in doc["tests"] if culprit in yaml.safe_dump(group)]
    assert doc["tests"], f"no test group of {path.name} names {culprit}"
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    result = promtool("test", "rules", path)
    assert result.returncode != 0, f"promtool tests still pass with {key}={value}"
    assert culprit in result.stdout + result.stderr


def test_render_config_for_the_e2e_harness():
    text = render.render_config("127.0.0.1:9464", "1s", ["rules/*.yml"])
    cfg = yaml.safe_load(text)
    assert cfg["global"] == {
        "scrape_interval": "1s",
        "scrape_timeout": "1s",
        "evaluation_interval": "1s",
    }
    (scrape,) = cfg["scrape_configs"]
    assert scrape["honor_labels"] is True
    assert scrape["static_configs"] == [{"targets": ["127.0.0.1:9464"]}]
    assert "alerting" not in cfg
    slow = yaml.safe_load(render.render_config(["a:1", "b:2"], "30s", [], alertmanager="am:9093"))
    assert slow["global"]["scrape_timeout"] == "10s"
    assert slow["alerting"]["alertmanagers"][0]["static_configs"][0]["targets"] == ["am:9093"]
    with pytest.raises(ValueError):
        duration_seconds("1 minute")


@needs_promtool
def test_promtool_check_config_with_the_rules(tmp_path):
    shutil.copytree(PROM / "rules", tmp_path / "rules")
    for name, text in {
        "e2e.yml": render.render_config("127.0.0.1:9464", "1s", ["rules/*.yml"]),
        # The compose file's config, with the rules where compose mounts them.
        "compose.yml": render.compose_config().replace("/etc/prometheus/rules", "rules"),
    }.items():
        (tmp_path / name).write_text(text)
        result = promtool("check", "config", tmp_path / name)
        assert result.returncode == 0, result.stdout + result.stderr
        assert "32 rules found" in result.stdout or "rules found" in result.stdout


def test_thresholds_file_is_plain_json():
    from syncscope.thresholds import thresholds_text

    data = json.loads(thresholds_text())
    assert set(data["alerts"]) == {a["alert"] for a in alert_rules(rules_doc())}


def test_each_alert_is_declared_where_its_promtool_tests_are():
    """One function per alert, in the module of its area; the promtool test file of that area
    (deploy/prometheus/tests/<area>.test.yml) tests it. Every alert of the thresholds has one."""
    from syncscope.monitoring.alerts import ALERT_TEXTS

    assert set(ALERT_TEXTS) == set(load_config().alerts)
    for name, text in ALERT_TEXTS.items():
        area = text.__module__.rsplit(".", 1)[1]
        tests = ROOT / "deploy" / "prometheus" / "tests" / f"{area}.test.yml"
        assert tests.exists(), (name, area)
        assert f"alertname: {name}" in tests.read_text(), (name, tests)


def test_each_recording_rule_is_declared_where_its_promtool_tests_are():
    """The recording rules of an area sit in syncscope/monitoring/records/<area>.py and the
    promtool test file of that area (deploy/prometheus/tests/<area>.test.yml) asks for them."""
    from syncscope.monitoring.records import AREAS

    cfg = load_config()
    for area in AREAS:
        name = area.__name__.rsplit(".", 1)[1]
        tests = (TESTS_DIR / f"{name}.test.yml").read_text()
        for rule in area.records(cfg):
            assert rule["record"] in tests, (rule["record"], name)


def _exported_stems() -> set[str]:
    from syncscope import catalog

    return {re.sub(r"_total$", "", spec.name) for spec in catalog.CATALOG}


def _misnamed(exprs: dict[str, str]) -> set[str]:
    """The records ({name: expression}) whose metric part starts with the name of a metric
    syncscope exports that the rule does not read, itself or through the records it reads."""
    stems = _exported_stems()

    def reads(name: str, seen: frozenset[str] = frozenset()) -> set[str]:
        out: set[str] = set()
        for n in gen.metric_names(exprs.get(name, "")) - seen:
            if n in exprs:
                out |= reads(n, seen | {name})
            out.add(re.sub(r"_(total|sum|count|bucket)$", "", n))
        return out

    return {
        name
        for name in exprs
        for stem in stems
        if re.match(rf"{re.escape(stem)}(_|$)", name.split(":")[1]) and stem not in reads(name)
    }


def _record_exprs(groups: list[dict]) -> dict[str, str]:
    exprs: dict[str, str] = {}
    for group in groups:
        for rule in group["rules"]:
            if "record" in rule:  # the quantiles' several rules under one name: read together
                exprs[rule["record"]] = exprs.get(rule["record"], "") + "\n" + rule["expr"]
    return exprs


def test_a_record_named_after_an_exported_metric_reads_it():
    """`level:metric:operations` names what the rule reads: a record whose metric part begins
    with the name of an exported metric reads that metric. Planted: the old names of the series
    renamed for reading something else (the exporter's lead gauge, the collective counters, the
    step counters)."""
    groups = [g for g in rules_doc()["groups"] if g["name"] != gen.ALIASES_GROUP]
    exprs = _record_exprs(groups)
    assert _misnamed(exprs) == set()
    from syncscope.recorded import DEPRECATED_ALIASES

    planted = {**exprs, **{old: exprs[new] for old, new in DEPRECATED_ALIASES.items()}}
    assert _misnamed(planted) == {
        "job_rank:syncscope_collective_seconds_per_step:ratio",
        "job:syncscope_collective_seconds_per_step:min",
        "job_rank:syncscope_arrival_lead_seconds:avg",
        "job:syncscope_arrival_lead_seconds:max_minus_min",
        "job_group:syncscope_collective_seconds_beyond_least:ratio",
        "job:syncscope_steps_total:count_full_window",
    }


def test_old_names_are_aliases_in_their_own_last_group_and_nothing_reads_them():
    """Each renamed series' old name is recorded, for one release, as a bare copy of the new
    series in the last group, which a deployment can drop; no other rule, no alert and no
    dashboard query reads an old name."""
    from syncscope.recorded import DEPRECATED_ALIASES

    doc = rules_doc()
    assert doc["groups"][-1]["name"] == gen.ALIASES_GROUP == gen.GROUP_ORDER[-1]
    aliases = doc["groups"][-1]["rules"]
    assert {r["record"]: r["expr"] for r in aliases} == DEPRECATED_ALIASES
    assert all(set(r) == {"record", "expr"} for r in aliases)
    current = {r["record"] for g in doc["groups"][:-1] for r in g["rules"] if "record" in r}
    assert set(DEPRECATED_ALIASES.values()) <= current
    assert not set(DEPRECATED_ALIASES) & current
    for group in doc["groups"][:-1]:
        for rule in group["rules"]:
            read = gen.metric_names(rule["expr"]) | gen.metric_names(str(rule.get("annotations")))
            assert not read & set(DEPRECATED_ALIASES), rule.get("record") or rule.get("alert")
    for path in (ROOT / "dashboards").glob("*.json"):
        text = path.read_text()
        assert not [old for old in DEPRECATED_ALIASES if old in text], path
