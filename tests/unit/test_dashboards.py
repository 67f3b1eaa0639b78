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
from syncscope.thresholds import load_config

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
    levels = cfg.alerts["SyncscopeStepTimeCVHigh"].levels
    assert [s["value"] for s in steps] == [None] + [lv.threshold for lv in levels]
    # Change the config, and the dashboards follow.
    mutated = load_config({"alerts.SyncscopeFabricContention.levels.0.threshold": 3.0})
    fabric = generator.dashboards(mutated)[UIDS[1]]
    index = next(p for p in fabric["panels"] if p["title"].startswith("Contention index"))
    assert index["fieldConfig"]["defaults"]["thresholds"]["steps"][1]["value"] == 3.0


def _validator(schema: dict):
    jsonschema = pytest.importorskip(
        "jsonschema",
        reason="jsonschema missing: run scripts/install-observability-tools (check-jsonschema)",
    )
    return jsonschema.Draft7Validator(schema)


def without_prometheus_annotation_fields(d: dict) -> dict:
    """The dashboard less the fields a Prometheus annotation query keeps on the annotation
    itself (Grafana's prometheus annotations.ts reads expr, step, titleFormat, textFormat,
    tagKeys there), which @grafana/schema's AnnotationQuery type does not list."""
    d = copy.deepcopy(d)
    for annotation in d["annotations"]["list"]:
        extra = set(annotation) - {"datasource", "enable", "hide", "iconColor", "name"}
        assert extra <= set(generator.ANNOTATION_EXTRAS), extra
        for key in extra:
            del annotation[key]
    return d


def test_dashboards_match_grafana_schema():
    validator = _validator(json.loads((SCHEMA_DIR / "dashboard.schema.json").read_text()))
    for uid in UIDS:
        errors = [
            f"{list(e.absolute_path)}: {e.message}"
            for e in validator.iter_errors(without_prometheus_annotation_fields(dashboard(uid)))
        ]
        assert errors == [], uid


def test_the_schema_is_strict_enough_to_catch_a_typo():
    validator = _validator(json.loads((SCHEMA_DIR / "dashboard.schema.json").read_text()))
    broken = without_prometheus_annotation_fields(dashboard(UIDS[0]))
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
        assert names == ["datasource", "job", "node", "rank"]
        assert d["templating"]["list"][0]["type"] == "datasource"
        job, node, rank = d["templating"]["list"][1:]
        # One training job at a time: All would merge the same rank of several jobs.
        assert job["multi"] is False and job["includeAll"] is False
        for v in (node, rank):
            assert v["multi"] and v["includeAll"] and v["current"]["value"] == ["$__all"]
            assert v["query"].startswith(f"label_values({rules.SYNC_PER_STEP}{{")
        assert node["allValue"] == ".*" and rank["allValue"] == ".+"
        assert 'node=~"$node"' in rank["query"]
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


def test_every_family_syncscope_emits_is_read_by_a_shipped_rule_or_dashboard():
    """The converse: a family no rule, alert, panel, variable or annotation reads is dead (remove
    it) or a view nobody ships (draw it). Families of other software (the client's process_*,
    Prometheus' up and ALERTS) are not syncscope's to ship a view of."""
    from syncscope.catalog import CATALOG

    read: set[str] = set()
    for group in rules.rule_groups(load_config())["groups"]:
        for rule in group["rules"]:
            read |= rules.metric_names(rule["expr"])
    for expr in _all_exprs():
        read |= rules.metric_names(expr)
    for uid in UIDS:  # the annotations (restarts, alerts) too
        for annotation in dashboard(uid)["annotations"]["list"]:
            read |= rules.metric_names(annotation.get("expr", ""))
    suffixes = {"histogram": ("_bucket", "_sum", "_count")}
    unread = [
        spec.name
        for spec in CATALOG
        if spec.name.startswith("syncscope_")
        and not read & {spec.name + s for s in suffixes.get(spec.type, ("",))}
    ]
    assert not unread, unread


def test_every_series_a_dashboard_reads_is_in_the_contract_or_recorded():
    contract = rules.series_conditions()
    recorded = {r["record"] for r in rules.recording_rules(load_config())}
    for expr in _all_exprs():
        names = rules.metric_names(expr)
        # ALERTS_FOR_STATE is Prometheus' own, like ALERTS: when each alert became active.
        assert names or "ALERTS_FOR_STATE{" in expr, expr
        assert names <= contract.keys() | recorded, (expr, names - contract.keys() - recorded)


def test_failure_mode_panels_are_present():
    overview = {p["title"] for p in panels(UIDS[0])}
    fabric = {p["title"] for p in panels(UIDS[1])}
    assert {
        "Late ranks",
        "Throughput",
        "Step time",
        "Step-time CV",
        "Phase shares",
        "Phases timed",
        "Phases of the selected ranks",
        "Phases of the selected ranks against the job's median rank",
        "Sync amplification",
        "Ranks paced",
        "Active syncscope alerts",
    } <= overview
    assert {
        "Bus bandwidth by op: the slowest groups",
        "Transfer vs wait by op",
        "Arrival lead: the 20 latest ranks",
        "Topology",
        "Locality faults",
        "Contention index: the most contended groups",
    } <= fabric
    heat = next(p for p in panels(UIDS[1]) if p["title"] == "Arrival lead: the 20 latest ranks")
    assert heat["type"] == "heatmap"
    # Grafana's default filter (le 1e-9) would hide the straggler's own row: its lead is 0.
    assert heat["options"]["filterValues"]["le"] < 0


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
        if any(contract.get(n) == "phase_sampling" for n in raw):
            assert "phase_sampling" in q["needs"], q
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


def test_panel_queries_select_one_job_and_optionally_a_rank():
    everything = generator.panel_queries(job="train.v2", range_="30m")
    assert everything == generator.evaluable_queries(job=r"train\\.v2", range_="30m")
    texts = [q["promql"] for q in everything]
    assert all("$" not in t for t in texts)
    assert any('rank=~".+"' in t for t in texts) and any('node=~".*"' in t for t in texts)
    assert any("[30m] @ end()" in t for t in texts)
    one = generator.panel_queries(job="train.v2", rank="17", node="host-3")
    assert any('rank=~"17"' in t["promql"] and 'node=~"host-3"' in t["promql"] for t in one)
    for a in generator.annotation_queries(job="j"):
        assert "$" not in a["promql"] and a["step"]


def test_exact_values_are_written_into_promql_strings_as_grafana_writes_them():
    # Regular-expression metacharacters escaped and the escape doubled for PromQL's string
    # literal; not re.escape's "remote\-straggler": Prometheus refuses "\-" in a string (400).
    assert generator.exact_value("remote-straggler") == "remote-straggler"
    assert generator.exact_value("train.v2") == r"train\\.v2"  # the regexp train\.v2
    assert generator.exact_value(r"a\b") == r"a\\\\b"  # the regexp a\\b
    assert generator.exact_value('(x|"y")') == r"\\(x\\|\"y\"\\)"
    job = generator.panel_queries(job="remote-straggler")[0]["promql"]
    assert 'job=~"remote-straggler"' in job, job


PER_RANK_BOUNDS = ("topk(", "bottomk(", "quantile by (")


def _per_rank_series() -> set[str]:
    from syncscope import catalog

    raw = {m.name for m in catalog.CATALOG if "rank" in m.labels}
    raw |= {
        m.name + s
        for m in catalog.CATALOG
        if "rank" in m.labels
        for s in ("_bucket", "_sum", "_count")
    }
    recorded = {r["record"] for r in rules.recording_rules(load_config())}
    return raw | {name for name in recorded if name.startswith("job_rank")}


def test_no_panel_draws_one_series_per_rank():
    """At a thousand ranks a panel of one line per rank is unreadable and slow: every query
    that reads a per-rank series bounds what it returns with topk/bottomk/quantile, or
    aggregates it to labels other than rank and node (the scale bench counts the series)."""
    per_rank = _per_rank_series()
    for uid in UIDS:
        for p in panels(uid):
            for t in p["targets"]:
                expr = t["expr"]
                if not rules.metric_names(expr) & per_rank:
                    continue
                groupings = re.findall(r"\bby \(([^)]*)\)", expr)
                aggregated = groupings and not any(
                    {"rank", "node"} & {g.strip() for g in grouping.split(",")}
                    for grouping in groupings
                )
                assert aggregated or any(b in expr for b in PER_RANK_BOUNDS), (p["title"], expr)
    # And the bounds are small: k of topk/bottomk and row limits stay under MAX_SERIES.
    for q in json.loads((DASH_DIR / "queries.json").read_text()):
        for k in re.findall(r"(?:topk|bottomk)\((\d+),", q["expr"]):
            assert int(k) <= generator.MAX_SERIES, q


def test_triage_row_comes_first_with_named_columns_units_and_links():
    d = dashboard(UIDS[0])
    assert d["panels"][0]["type"] == "row" and d["panels"][0]["title"].startswith("Triage")
    table = d["panels"][1]
    assert table["title"] == "Late ranks" and table["type"] == "table"
    assert table["gridPos"]["y"] == 1  # above the fold
    ids = [t["id"] for t in table["transformations"]]
    assert ids == ["merge", "sortBy", "organize"]
    organize = table["transformations"][2]["options"]
    refs = [t["refId"] for t in table["targets"]]
    # Every query's value column is named or hidden: no "Value #X" header is left.
    for ref in refs:
        name = f"Value #{ref}"
        assert name in organize["renameByName"] or organize["excludeByName"].get(name), name
    renamed = organize["renameByName"]
    assert {
        "Rank",
        "Node",
        "GPU",
        "Cause",
        "Late by",
        "Alert for",
        "Cost",
    } <= set(renamed.values())
    assert table["transformations"][1]["options"]["sort"] == [{"field": "Value #A", "desc": True}]
    overrides = {
        o["matcher"]["options"]: {p["id"]: p["value"] for p in o["properties"]}
        for o in table["fieldConfig"]["overrides"]
    }
    # Seconds in seconds, shares in percent, durations as durations.
    assert overrides["Late by"]["unit"] == "s"
    assert overrides["Of a step"]["unit"] == "percentunit"
    assert all(
        overrides[generator.PHASE_COLUMNS[p]]["unit"] == "s" for p in generator.TRIAGE_PHASES
    )
    assert overrides["Alert for"]["unit"] == "dtdurations"
    assert "GPU-h/h" in overrides["Cost"]["unit"]
    assert table["fieldConfig"]["defaults"]["unit"] != "percentunit"
    rank_urls = [link["url"] for link in overrides["Rank"]["links"]]
    assert any(u.startswith(f"/d/{UIDS[0]}?") and "var-rank=${__value.raw}" in u for u in rank_urls)
    node_urls = [link["url"] for link in overrides["Node"]["links"]]
    assert any(u.startswith(f"/d/{UIDS[1]}?") and "var-node=${__value.raw}" in u for u in node_urls)
    # Rows: the latest ranks first; the cause, GPU, the alert and the cost on the same rows.
    assert table["targets"][0]["expr"].startswith(f"topk({generator.TRIAGE_ROWS}, ")
    exprs = "\n".join(t["expr"] for t in table["targets"])
    for needle in (
        "syncscope_straggler_cause",
        "syncscope_gpu_info",
        "ALERTS_FOR_STATE",
        rules.LEAD,
    ):
        assert needle in exprs


def _mappings(d: dict) -> list[dict]:
    found = []
    for p in d["panels"]:
        found += p.get("fieldConfig", {}).get("defaults", {}).get("mappings", [])
        for o in p.get("fieldConfig", {}).get("overrides", []):
            found += [m for pr in o["properties"] if pr["id"] == "mappings" for m in pr["value"]]
    return found


def test_trouble_is_never_coloured_green():
    trouble = {"down", "failing", "fault", "mismatch", "firing"}
    seen = set()
    for uid in UIDS:
        for mapping in _mappings(dashboard(uid)):
            for value, result in mapping["options"].items():
                text = result.get("text", value)
                if text in trouble:
                    seen.add(text)
                    assert result["color"] == "red", (uid, mapping)
    assert {"down", "failing", "fault"} <= seen


def test_alert_and_job_start_annotations_on_both_dashboards():
    for uid in UIDS:
        names = {a["name"]: a for a in dashboard(uid)["annotations"]["list"]}
        assert {"Syncscope alerts firing", "Job start", "Exporter restarts"} <= set(names)
        assert names["Syncscope alerts firing"]["expr"].startswith("ALERTS{")
        assert 'job=~"$job"' in names["Job start"]["expr"]


@pytest.mark.skipif(
    shutil.which("promtool") is None,
    reason="promtool not installed: run scripts/install-observability-tools",
)
def test_every_dashboard_query_parses(tmp_path):
    """promtool has no PromQL linter in 2.42; a rule file of the queries gets them parsed."""
    listed = [q["promql"] for q in generator.evaluable_queries()]
    listed += [a["promql"] for a in generator.annotation_queries()]
    group = {
        "name": "dashboard-queries",
        "rules": [
            {"record": f"syncscope_dashboard_query_{i}", "expr": promql}
            for i, promql in enumerate(listed)
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


# -- the renderer's reading of the JSON (syncscope/lab/render.py), without a Prometheus
class _FakeProm:
    """Instant results for the triage table: rank 2 late by 31 ms on host-b, the rest early."""

    def instant(self, promql: str, at: float) -> list[dict]:
        def row(rank: int, value: float, **extra: str) -> dict:
            node = "host-a" if rank < 2 else "host-b"
            return {
                "metric": {"job": "j", "node": node, "rank": str(rank), **extra},
                "value": [at, str(value)],
            }

        late = {0: 0.001, 1: 0.002, 2: 0.031, 3: 0.0}
        if promql.startswith(f"topk({generator.TRIAGE_ROWS}, max by (job)"):
            return [row(r, v) for r, v in late.items()]
        if "syncscope_straggler_cause" in promql:
            return [{"metric": {"job": "j", "rank": "2", "cause": "forward"}, "value": [at, "1"]}]
        if "ALERTS_FOR_STATE" in promql:
            return [row(2, 312, alertstate="firing")]
        if promql.startswith("0 *"):
            return [row(2, 2.7)]
        if 'phase="forward"' in promql:
            return [row(r, 0.03 if r == 2 else -0.001) for r in late]
        if "/ on (job) group_left ()\n  job:syncscope_step_duration_seconds:mean" in promql:
            return [row(r, v / 0.1) for r, v in late.items()]
        return []


def test_render_reads_the_triage_table_as_grafana_would():
    from syncscope.lab import render

    ctx = render.Context(_FakeProm(), generator.variable_values(job="j"), 0.0, 300.0, 5.0)
    table = next(p for p in panels(UIDS[0]) if p["title"] == "Late ranks")
    frame = render.panel_table(table, ctx)
    assert frame is not None
    rows = [{f.display_name: f.values[r] for f in frame.fields} for r in range(frame.length)]
    assert [r["Rank"] for r in rows] == ["2", "1", "0", "3"]  # merged, sorted, latest first
    first = rows[0]
    assert (first["Node"], first["Cause"], first["Alert"], first["Cost"]) == (
        "host-b",
        "forward",
        "firing",
        2.7,
    )
    assert rows[1]["Cause"] is None and rows[1]["Cost"] is None  # the others carry neither
    header = [f.display_name for f in frame.fields]
    assert header[:3] == ["Rank", "Node", "Cause"] and not [h for h in header if "Value" in h]
    html = render.draw_table(table, frame)
    assert (
        "31.0 ms" in html
        and "31%" in html
        and "forward" in html
        and "5 minutes, 12 seconds" in html
    )
    assert "2.70 GPU-h/h" in html and "color:#F2495C" in html  # firing, in red


def test_render_formats_values_with_grafanas_units():
    from syncscope.lab import render

    assert render.format_value(0.0312, "s") == "31.2 ms"
    assert render.format_value(0, "s") == "0 s"
    assert render.format_value(2.5, "s") == "2.50 s"
    assert render.format_value(0.25, "percentunit") == "25%"
    assert render.format_value(0.312, "percentunit") == "31.2%"
    assert render.format_value(3725, "dtdurations") == "1 hour, 2 minutes"
    assert render.format_value(1.5, "suffix: GPU-h/h", 2) == "1.50 GPU-h/h"
    assert render.format_value(4.0, "none") == "4"
