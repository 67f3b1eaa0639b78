"""Paging: whole incidents, through the rules (promtool) and the shipped Alertmanager config.

deploy/prometheus/tests/paging.test.yml states, scenario by scenario, every alert firing at
each evaluation, and promtool checks those sets against the generated rules. Here a real
Alertmanager runs deploy/alertmanager/alertmanager.yml (its route, grouping and inhibitions as
shipped; webhooks added to its receivers, its waits cut to a second) and the sets are replayed
into it in order, as Prometheus would send them: what a team's chat ("default") and pager
("pager") would receive.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import json
import shutil
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from syncscope.lab.servers import _Server
from syncscope.monitoring import generate, rules
from syncscope.thresholds import duration_seconds
from tests.conftest import Webhook, shipped_alertmanager_config

yaml = pytest.importorskip("yaml", reason="PyYAML missing: run scripts/install-observability-tools")

ROOT = Path(__file__).resolve().parents[2]
SCENARIOS = ROOT / "deploy" / "prometheus" / "tests" / "paging.test.yml"
RULES = ROOT / generate.RULES_PATH
FIRING = 'ALERTS{alertstate="firing"}'
AM_BINARY = shutil.which("prometheus-alertmanager") or shutil.which("alertmanager")
PROMTOOL = shutil.which("promtool")
needs_alertmanager = pytest.mark.skipif(
    AM_BINARY is None,
    reason="prometheus-alertmanager not installed (scripts/install-observability-tools)",
)
needs_promtool = pytest.mark.skipif(
    PROMTOOL is None, reason="promtool not installed (scripts/install-observability-tools)"
)
# Alertmanager's waits in these tests; a change of a group is notified within GROUP_INTERVAL,
# so SETTLE after each change is enough to have seen every notification it causes.
GROUP_WAIT, GROUP_INTERVAL, SETTLE = "500ms", "1s", 2.5

Labels = dict[str, str]


class ShippedAlertmanager(_Server):
    """A real Alertmanager on 127.0.0.1 with the shipped route and inhibitions."""

    def __init__(self, hook_url: str, workdir: Path) -> None:
        assert AM_BINARY is not None
        config = workdir / "alertmanager.yml"
        config.write_text(shipped_alertmanager_config(hook_url, GROUP_WAIT, GROUP_INTERVAL))
        args = [
            f"--config.file={config}",
            f"--storage.path={workdir / 'data'}",
            "--cluster.listen-address=",
        ]
        super().__init__(AM_BINARY, args, None)

    def post(self, alerts: list[dict[str, Any]]) -> None:
        request = urllib.request.Request(
            self.url + "/api/v2/alerts",
            data=json.dumps(alerts).encode(),
            headers={"Content-Type": "application/json"},
            method="POST",
        )
        with urllib.request.urlopen(request, timeout=5) as reply:  # noqa: S310 - 127.0.0.1
            assert reply.status == 200


@pytest.fixture
def am(tmp_path: Path) -> Iterator[tuple[ShippedAlertmanager, Webhook]]:
    with contextlib.ExitStack() as stack:
        hook = Webhook()
        stack.callback(hook.stop)
        manager = ShippedAlertmanager(hook.url, tmp_path)
        stack.callback(manager.stop)
        manager.wait_ready()
        yield manager, hook


def _iso(t: float) -> str:
    return dt.datetime.fromtimestamp(t, dt.timezone.utc).isoformat()


def _alert(labels: Labels, starts: float, ends: float) -> dict[str, Any]:
    return {"labels": labels, "annotations": {}, "startsAt": _iso(starts), "endsAt": _iso(ends)}


def replay(manager: ShippedAlertmanager, steps: list[tuple[float, list[Labels]]]) -> int:
    """Send Alertmanager the firing sets in order, as Prometheus would; each change is given
    SETTLE to be notified before the next. Returns how many changes were sent."""
    since: dict[frozenset, float] = {}
    changes = 0
    for _t, firing in steps:
        now = time.time()
        current = {frozenset(labels.items()): labels for labels in firing}
        gone = [dict(key) for key in since if key not in current]
        if set(current) == set(since):
            continue
        for key in current:
            since.setdefault(key, now)
        alerts = [_alert(labels, since[key], now + 3600) for key, labels in current.items()]
        alerts += [_alert(labels, since.pop(frozenset(labels.items())), now) for labels in gone]
        manager.post(alerts)
        changes += 1
        time.sleep(SETTLE)
    return changes


def _labels(text: str) -> Labels:
    """``ALERTS{a="b",...}`` as promtool's exp_samples write it, without ``alertstate``."""
    inner = text[text.index("{") + 1 : text.rindex("}")]
    pairs = [part.split("=", 1) for part in inner.split(",") if part]
    labels = {k.strip(): json.loads(v) for k, v in pairs}
    labels.pop("alertstate", None)
    return labels


def firing_sets(doc: dict[str, Any], scenario: str) -> list[tuple[float, list[Labels]]]:
    """A scenario's complete firing sets, by evaluation time."""
    (group,) = [g for g in doc["tests"] if g["name"] == scenario]
    steps = [
        (duration_seconds(case["eval_time"]), [_labels(s["labels"]) for s in case["exp_samples"]])
        for case in group["promql_expr_test"]
        if case["expr"] == FIRING
    ]
    assert steps, f"{scenario}: no {FIRING} cases"
    return sorted(steps, key=lambda step: step[0])


def scenario(name: str) -> list[tuple[float, list[Labels]]]:
    return firing_sets(yaml.safe_load(SCENARIOS.read_text()), name)


def alertnames(notification: dict[str, Any]) -> list[tuple[str, str]]:
    return sorted(
        (a["labels"]["alertname"], a["labels"].get("job", "")) for a in notification["alerts"]
    )


def promtool_passes(test_file: Path) -> None:
    assert PROMTOOL is not None
    result = subprocess.run(
        [PROMTOOL, "test", "rules", str(test_file)], capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stdout + result.stderr


# ------------------------------------------------------------------ the scenarios' rule side


@pytest.mark.slow
@needs_promtool
def test_the_replayed_firing_sets_are_what_the_rules_produce():
    promtool_passes(SCENARIOS)


def test_scenarios_state_the_firing_sets_replayed_here():
    doc = yaml.safe_load(SCENARIOS.read_text())
    names = {g["name"] for g in doc["tests"]}
    assert {
        "a straggler incident",
        "a clean job end",
        "a rank dies and the job hangs",
        "the exporters restart one by one",
        "a checkpoint every 100 steps",
    } <= names
    # The straggler incident fires more than one alert: inhibition has work to do.
    assert max(len(s) for _t, s in scenario("a straggler incident")) == 3


# ------------------------------------------------------------- through a real Alertmanager


def test_the_straggler_fires_before_what_it_inhibits_shipped_and_shortened():
    """Inhibition mutes a target only while its source fires: were amplification to fire
    first, it would be notified on its own. So every alert the straggler inhibits waits
    longer (for:) than the straggler, as shipped and with the demo's shortened for:."""
    from syncscope.thresholds import fast_for_overrides, load_config

    am_config = yaml.safe_load((ROOT / "deploy" / "alertmanager" / "alertmanager.yml").read_text())
    (rule,) = [
        r for r in am_config["inhibit_rules"]
        if r["source_matchers"] == ['alertname="SyncscopeStraggler"']
    ]  # fmt: skip
    (target,) = rule["target_matchers"]
    inhibited = target.split('=~"', 1)[1].rstrip('"').split("|")
    assert "SyncscopeSyncAmplification" in inhibited
    shipped = load_config()
    for fors in (
        {name: a.for_ for name, a in shipped.alerts.items()},
        {k.split(".")[1]: v for k, v in fast_for_overrides(shipped, "2s").items()},
    ):
        source = duration_seconds(fors["SyncscopeStraggler"])
        for name in inhibited:
            assert duration_seconds(fors[name]) > source, (name, fors)


def test_the_straggler_outlasts_what_it_inhibits_shipped_and_shortened():
    """...and the other way round when it clears: those alerts read rates over windows.rate,
    so they carry the straggler's effect that long after it has gone (it recovered, the job
    ended). The straggler keeps firing at least that long, as shipped and in the demo."""
    from syncscope.thresholds import demo_overrides, load_config

    for cfg in (load_config(), load_config(demo_overrides(load_config()))):
        keep = cfg.alerts["SyncscopeStraggler"].keep_firing_for
        keep = "0s" if keep is None else keep
        assert duration_seconds(keep) >= duration_seconds(cfg.windows.rate), keep
    (rule,) = [r for r in rules.alerting_rules(load_config()) if r["alert"] == "SyncscopeStraggler"]
    assert rule["keep_firing_for"] == load_config().alerts["SyncscopeStraggler"].keep_firing_for


@pytest.mark.slow
@needs_alertmanager
def test_a_straggler_incident_is_one_notification(am):
    manager, hook = am
    # Straggler first, then amplification, then pacing: three alerts over half an hour; then
    # the job ends, what the straggler inhibits resolving first and the straggler last.
    assert replay(manager, scenario("a straggler incident")) == 5
    (notification,) = hook.to("default")
    assert alertnames(notification) == [("SyncscopeStraggler", "train")]
    assert hook.to("pager") == []


@pytest.mark.slow
@needs_alertmanager
def test_a_clean_job_end_notifies_nobody(am):
    manager, hook = am
    steps = scenario("a clean job end")
    assert len(steps) >= 3 and all(firing == [] for _t, firing in steps)
    replay(manager, steps)
    assert hook.notifications == []


@pytest.mark.slow
@needs_alertmanager
def test_a_hung_job_is_one_page(am):
    manager, hook = am
    replay(manager, scenario("a rank dies and the job hangs"))
    (page,) = hook.to("pager")
    assert alertnames(page) == [("SyncscopeRankSilent", "hung")]
    assert hook.to("default") == []


@pytest.mark.slow
@needs_alertmanager
def test_checkpoints_every_100_steps_page_nobody(am):
    manager, hook = am
    replay(manager, scenario("a checkpoint every 100 steps"))
    assert hook.notifications == []


def _rolling_restart(nodes: int, down_min: int = 2, start_min: int = 5) -> tuple[str, int]:
    """A promtool scenario: ``nodes`` exporters (one rank each, job "big") restarting one after
    the other from ``start_min``, each unreachable for ``down_min`` minutes; the firing set is
    stated for every minute: one SyncscopeExporterDown warning for the scrape job, from five
    minutes (its for:) after the first exporter goes down until the last one is back."""
    end = start_min + nodes * down_min + 5
    lines = [
        "rule_files: [../rules/syncscope.rules.yml]",
        "evaluation_interval: 1m",
        f"group_eval_order: [{', '.join(rules.GROUP_ORDER)}]",
        "tests:",
        "  - name: rolling restart",
        "    interval: 1m",
        "    input_series:",
    ]
    for i in range(nodes):
        down = start_min + i * down_min
        back = down + down_min
        inst = f"n{i}:9464"
        lab = f'job="big",rank="{i}",local_rank="0",instance="{inst}"'
        gap = " _" * (down_min - 1)
        series = {
            f'up{{job="syncscope-exporter",instance="{inst}"}}': (
                f"1x{down - 1} 0x{down_min - 1} 1x{end - back}"
            ),
            f"syncscope_rank_last_report_timestamp_seconds{{{lab}}}": (
                f"0+60x{down - 1} stale{gap} {back * 60}+60x{end - back}"
            ),
            f"syncscope_steps_total{{{lab}}}": f"0+60x{down - 1} stale{gap} 0+60x{end - back}",
            f"syncscope_world_size{{{lab}}}": (
                f"{nodes}x{down - 1} stale{gap} {nodes}x{end - back}"
            ),
        }
        for name, values in series.items():
            lines += [f"      - series: '{name}'", f"        values: '{values}'"]
    lines.append("    promql_expr_test:")
    last_back = start_min + nodes * down_min
    alert = (
        'ALERTS{alertname="SyncscopeExporterDown",alertstate="firing",'
        'job="syncscope-exporter",severity="warning"}'
    )
    for minute in range(end + 1):
        lines += [f"      - expr: '{FIRING}'", f"        eval_time: {minute}m"]
        if start_min + 5 <= minute < last_back:
            lines += [
                "        exp_samples:",
                f"          - labels: '{alert}'",
                "            value: 1",
            ]
        else:
            lines.append("        exp_samples: []")
    return "\n".join(lines) + "\n", end


@pytest.mark.slow
@needs_promtool
@needs_alertmanager
def test_128_exporters_restarting_one_by_one_page_nobody(am, tmp_path):
    (tmp_path / "rules").mkdir()
    shutil.copy(RULES, tmp_path / "rules" / RULES.name)
    (tmp_path / "tests").mkdir()
    text, _end = _rolling_restart(128)
    test_file = tmp_path / "tests" / "restart.test.yml"
    test_file.write_text(text)
    promtool_passes(test_file)  # the rules fire exactly the sets stated there
    manager, hook = am
    replay(manager, firing_sets(yaml.safe_load(text), "rolling restart"))
    assert hook.to("pager") == []
    (notification,) = hook.to("default")
    assert alertnames(notification) == [("SyncscopeExporterDown", "syncscope-exporter")]


@pytest.mark.slow
@needs_alertmanager
def test_straggler_inhibits_what_it_causes_per_job(am):
    """Two jobs' incidents at once (the critical CV level included), and a third whose straggler
    arrives first and its consequences later: one notification per job, the straggler's."""
    manager, hook = am
    caused = [
        ("SyncscopeSyncAmplification", "warning"),
        ("SyncscopeStepTimeCVHigh", "warning"),
        ("SyncscopeStepTimeCVHigh", "critical"),
        ("SyncscopePacingEngagedLong", "warning"),
    ]
    straggler = ("SyncscopeStraggler", "warning")
    now = time.time()

    def alerts(job: str, which: list[tuple[str, str]]) -> list[dict[str, Any]]:
        return [
            _alert({"alertname": name, "severity": sev, "job": job}, now, now + 3600)
            for name, sev in which
        ]

    manager.post(alerts("a", [straggler, *caused]) + alerts("b", [straggler, *caused]))
    manager.post(alerts("c", [straggler]))
    time.sleep(SETTLE)
    manager.post(alerts("c", caused))
    time.sleep(SETTLE)
    by_job = sorted(alertnames(n) for n in hook.to("default"))
    assert by_job == [
        [("SyncscopeStraggler", "a")],
        [("SyncscopeStraggler", "b")],
        [("SyncscopeStraggler", "c")],
    ]
    assert hook.to("pager") == []
