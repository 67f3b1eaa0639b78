"""Grafana dashboards: generated from one source, valid against Grafana's schema, and using only real series."""

from __future__ import annotations

import copy
import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from syncscope.monitoring import dashboards as generator
from syncscope.monitoring import rules
from syncscope.monitoring.config import load_config

yaml = pytest.importorskip("yaml", reason="PyYAML missing: run scripts/install-observability-tools")

ROOT = Path(__file__).resolve().parents[2]
DASH_DIR = ROOT / "dashboards"
SCHEMA_DIR = DASH_DIR / "schema"
UIDS = ("syncscope-job-overview", "syncscope-fabric-locality")
SDK_PIN = "1769699379!11.6.0"


def dashboard(uid: str) -> dict:
    return json.loads((DASH_DIR / f"{uid}.json").read_text())


def panels(uid: str) -> list[dict]:
    return [p for p in dashboard(uid)["panels"] if p["type"] != "row"]


def test_the_sdk_is_the_build_the_json_was_generated_with():
    from importlib.metadata import version

    assert version("grafana-foundation-sdk") == SDK_PIN


def test_regenerating_changes_nothing():
    for name, text in generator.render_files(load_config()).items():
        assert (DASH_DIR / name).read_text() == text, f"{name} is stale: run syncscope generate"


def test_panel_thresholds_come_from_the_alert_config():
    cfg = load_config()
    cv = next(p for p in panels(UIDS[0]) if p["title"] == "Step-time CV")
    steps = cv["fieldConfig"]["defaults"]["thresholds"]["steps"]
    levels = cfg["alerts"]["SyncscopeStepTimeCVHigh"]["levels"]
    assert [s["value"] for s in steps] == [None] + [lv["threshold"] for lv in levels]
    # Change the config, and the dashboards follow.
    mutated = load_config({"alerts.SyncscopeFabricContention.levels.0.threshold": 3.0})
    fabric = generator.dashboards(mutated)[UIDS[1]]
    index = next(p for p in fabric["panels"] if p["title"] == "Contention index")
    assert index["fieldConfig"]["defaults"]["thresholds"]["steps"][1]["value"] == 3.0


def _validator(schema: dict):
    jsonschema = pytest.importorskip(
        "jsonschema",
        reason="jsonschema missing: run scripts/install-observability-tools (check-jsonschema)",
    )
    return jsonschema.Draft7Validator(schema)


def test_dashboards_match_grafana_schema():
    validator = _validator(json.loads((SCHEMA_DIR / "dashboard.schema.json").read_text()))
    for uid in UIDS:
        errors = [
            f"{list(e.absolute_path)}: {e.message}" for e in validator.iter_errors(dashboard(uid))
        ]
        assert errors == [], uid


def test_the_schema_is_strict_enough_to_catch_a_typo():
    validator = _validator(json.loads((SCHEMA_DIR / "dashboard.schema.json").read_text()))
    broken = copy.deepcopy(dashboard(UIDS[0]))
    broken["panels"][1]["gridPos"]["width"] = 4  # Grafana's key is "w"
    broken["refresh_interval"] = "30s"
    assert len(list(validator.iter_errors(broken))) == 2


def test_panel_options_match_their_plugin_schemas():
    schema = json.loads((SCHEMA_DIR / "panels.schema.json").read_text())
    plugins = schema["definitions"]["PanelPlugins"]["properties"]
    for uid in UIDS:
        for panel in panels(uid):
            assert panel["type"] in plugins, f"no schema for panel type {panel['type']}"
            parts = {
                "options": panel.get("options", {}),
                "custom": panel.get("fieldConfig", {}).get("defaults", {}).get("custom", {}),
            }
            for part, instance in parts.items():
                if part not in plugins[panel["type"]]["properties"]:
                    assert not instance, (uid, panel["title"], part)
                    continue
                sub = dict(
                    plugins[panel["type"]]["properties"][part], definitions=schema["definitions"]
                )
                errors = [e.message for e in _validator(sub).iter_errors(instance)]
                assert errors == [], (uid, panel["title"], part)


def test_uids_tags_variables_and_layout():
    for uid in UIDS:
        d = dashboard(uid)
        assert d["uid"] == uid and d["tags"] == ["syncscope"]
        names = [v["name"] for v in d["templating"]["list"]]
        assert names == ["datasource", "job", "rank"]
        assert d["templating"]["list"][0]["type"] == "datasource"
        ids = [p["id"] for p in d["panels"]]
        assert len(ids) == len(set(ids))
        cells: set[tuple[int, int]] = set()
        for p in d["panels"]:
            g = p["gridPos"]
            assert g["x"] + g["w"] <= 24, p["title"]
            area = {
                (x, y)
                for x in range(g["x"], g["x"] + g["w"])
                for y in range(g["y"], g["y"] + g["h"])
            }
            assert not cells & area, f"{p['title']} overlaps another panel"
            cells |= area
            if p["type"] != "row":
                assert p["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
                assert p["description"], p["title"]
                for t in p["targets"]:
                    assert t["datasource"]["uid"] == "${datasource}"
                    assert "$job" in t["expr"] or not _uses_job_label(t["expr"]), (
                        p["title"],
                        t["expr"],
                    )


def _uses_job_label(expr: str) -> bool:
    """Per-job series must follow the job variable; exporter self-metrics and up have no job."""
    names = rules.metric_names(expr)
    return any(
        n.startswith(("syncscope_", "job")) and not n.startswith("syncscope_exporter_")
        for n in names
    )


def _all_exprs() -> list[str]:
    exprs = []
    for uid in UIDS:
        d = dashboard(uid)
        exprs += [t["expr"] for p in panels(uid) for t in p["targets"]]
        exprs += [v["query"] for v in d["templating"]["list"] if v["type"] == "query"]
    return exprs


def test_every_series_a_dashboard_reads_is_in_the_contract_or_recorded():
    contract = rules.series_conditions()
    recorded = {r["record"] for r in rules.recording_rules(load_config())}
    for expr in _all_exprs():
        names = rules.metric_names(expr)
        assert names, expr
        assert names <= contract.keys() | recorded, (expr, names - contract.keys() - recorded)


def test_failure_mode_panels_are_present():
    overview = {p["title"] for p in panels(UIDS[0])}
    fabric = {p["title"] for p in panels(UIDS[1])}
    assert {
        "Throughput",
        "Step time",
        "Step-time CV",
        "Phase shares",
        "Sync amplification",
        "Straggler",
        "Pacing engaged",
        "Active syncscope alerts",
    } <= overview
    assert {
        "Bus bandwidth by op",
        "Transfer vs wait by op",
        "Arrival lead by rank",
        "Topology",
        "Locality faults",
        "Contention index",
    } <= fabric
    heat = next(p for p in panels(UIDS[1]) if p["title"] == "Arrival lead by rank")
    assert heat["type"] == "heatmap"


def test_queries_json_lists_every_panel_target_with_flags():
    listed = json.loads((DASH_DIR / "queries.json").read_text())
    targets = [
        (uid, p["id"], t["refId"], t["expr"])
        for uid in UIDS
        for p in panels(uid)
        for t in p["targets"]
    ]
    assert [(q["dashboard"], q["panel_id"], q["ref_id"], q["expr"]) for q in listed] == targets
    contract = rules.series_conditions()
    for q in listed:
        raw = rules.metric_names(q["expr"])
        if any(contract.get(n) == "gpu" for n in raw) or "gpu_locality" in q["expr"]:
            assert "gpu" in q["needs"], q
        if any(contract.get(n) == "pacing" for n in raw) or "pacing_delay:ratio" in q["expr"]:
            assert "pacing" in q["needs"], q
        if "ALERTS" in raw:
            assert "alerts" in q["needs"]
    plain = [q for q in listed if not q["needs"]]
    assert len(plain) > len(listed) / 2


def test_evaluable_queries_fill_in_every_variable():
    for q in generator.evaluable_queries(rate_interval="30s", have={"pacing"}):
        assert "$" not in q["promql"], q["promql"]
        assert q["expected_data"] == (set(q["needs"]) <= {"pacing"})
    with pytest.raises(KeyError):
        generator.substitute("rate(x[$__range])", {"job": ".+"})


@pytest.mark.skipif(
    shutil.which("promtool") is None,
    reason="promtool not installed: run scripts/install-observability-tools",
)
def test_every_dashboard_query_parses(tmp_path):
    """promtool has no PromQL linter in 2.42; a rule file of the queries gets them parsed."""
    listed = generator.evaluable_queries()
    group = {
        "name": "dashboard-queries",
        "rules": [
            {"record": f"syncscope_dashboard_query_{i}", "expr": q["promql"]}
            for i, q in enumerate(listed)
        ],
    }
    path = tmp_path / "queries.rules.yml"
    path.write_text(yaml.safe_dump({"groups": [group]}))
    result = subprocess.run(
        ["promtool", "check", "rules", "--lint=none", str(path)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_schema_sources_are_pinned():
    pkg = json.loads((SCHEMA_DIR / "package.json").read_text())
    assert pkg["devDependencies"] == {
        "@grafana/schema": "11.6.0",
        "ts-json-schema-generator": "2.9.0",
    }
    lock = json.loads((SCHEMA_DIR / "package-lock.json").read_text())
    assert lock["packages"]["node_modules/@grafana/schema"]["version"] == "11.6.0"
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert f'"grafana-foundation-sdk=={SDK_PIN}"' in pyproject
    assert re.search(r"schemaVersion", (DASH_DIR / f"{UIDS[0]}.json").read_text())
