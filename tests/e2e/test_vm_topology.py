"""Beyond one Prometheus: two vmagent shards scrape the exporters of two nodes, remote-write into
one VictoriaMetrics, vmalert evaluates the shipped rules (the vmalert variant, e2e windows)
against it and notifies a real Alertmanager, and every exporter reads the job-wide view back
from VictoriaMetrics. A 4-rank job, nodes node0 (ranks 0, 1) and node1 (ranks 2, 3) on
127.0.0.1, rank 3 slowed 30 ms in forward.

Held: each exporter is scraped by exactly one shard (no target twice, none missed); the straggler
alert reaches Alertmanager naming rank 3 on node1; both exporters, reading VictoriaMetrics,
name rank 3 (node0's from the job-wide view only: it hosts none of the late ranks).
"""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest

from syncscope.lab.launch import launch, wait_all
from syncscope.lab.servers import (
    Alertmanager,
    VictoriaMetrics,
    VMAgent,
    VMAlert,
    free_port,
    get_json,
    start_exporter,
)
from syncscope.monitoring.engines import write_rules
from syncscope.monitoring.prometheus_config import render_scrape_config
from syncscope.thresholds import demo_overrides, load_config
from tests.conftest import wait_until

NEEDED = ("victoria-metrics", "vmagent", "vmalert")
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        any(shutil.which(b) is None for b in NEEDED)
        or not (shutil.which("prometheus-alertmanager") or shutil.which("alertmanager")),
        reason="VictoriaMetrics, vmagent, vmalert or Alertmanager not installed "
        "(scripts/setup test installs them)",
    ),
]
SLOW_RANK = 3
SHARDS = 2
JOB = "vmtopology"


def straggler_alerts(am: Alertmanager) -> list[dict]:
    return [
        a
        for a in am.alerts()
        if a["labels"].get("alertname") == "SyncscopeStraggler"
        and a["labels"].get("job") == JOB
        and a["status"]["state"] == "active"
    ]


def rule_errors(vmalert: VMAlert) -> list[str]:
    groups = get_json(vmalert.url + "/api/v1/rules")["data"]["groups"]
    return [
        f"{r.get('name')}: {r.get('lastError')}"
        for g in groups
        for r in g["rules"]
        if r.get("lastError")
    ][:5] or [f"{len(groups)} groups, no error"]


def test_vmagent_shards_victoriametrics_and_vmalert_name_a_remote_straggler(tmp_path):
    work = str(tmp_path)
    servers: list = []
    exporters: list[subprocess.Popen] = []
    ranks: list[subprocess.Popen] = []
    try:
        vm = VictoriaMetrics(work)
        servers.append(vm)
        am = Alertmanager("http://127.0.0.1:9/", work)  # nobody listens: alerts stay in its API
        servers.append(am)
        vm.wait_ready()
        am.wait_ready()
        rules = write_rules(tmp_path / "rules", demo_overrides(load_config()), engine="vmalert")
        vmalert = VMAlert(str(rules), vm.url, notifier_url=am.url, evaluation_interval="1s")
        servers.append(vmalert)
        ports = [free_port() for _ in range(2)]
        for port in ports:
            readback = ["--prometheus-url", vm.url, "--prometheus-interval", "2"]
            exporters.append(
                start_exporter(port, readback, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            )
        targets = [f"127.0.0.1:{port}" for port in ports]
        scrape = render_scrape_config(targets, "1s")
        shards = [
            VMAgent(scrape, work, vm.url + "/api/v1/write", shard=i, shards=SHARDS)
            for i in range(SHARDS)
        ]
        servers += shards
        for server in [vmalert, *shards]:
            server.wait_ready()

        env = {k: v for k, v in os.environ.items() if k != "SYNCSCOPE_EXPORTER"}
        env["SYNCSCOPE_JOB"] = JOB

        def node_env(rank: int) -> dict[str, str]:
            node = rank // 2
            return {
                "SYNCSCOPE_NODE": f"node{node}",
                "SYNCSCOPE_EXPORTER": f"http://{targets[node]}",
            }

        args = ["--duration", "70", "--slow-rank", str(SLOW_RANK), "--slow-ms", "30"]
        ranks = launch(
            4,
            args,
            env=env,
            local_world_size=2,
            rank_env=node_env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )

        # Each exporter scraped by exactly one shard: two shards without cluster mode would
        # list every target twice. (Which shard gets which target is the label hash's choice.)
        def split() -> list[set[str]]:
            got = [shard.scraped() for shard in shards]
            return got if sum(len(g) for g in got) == len(targets) else []

        by_shard = wait_until(split, timeout=30)
        print(f"targets by shard: {by_shard}")
        assert by_shard, [shard.scraped() for shard in shards]
        assert set().union(*by_shard) == set(targets)
        # ... and so every exporter's series reach VictoriaMetrics once.
        up = wait_until(lambda: vm.query('up{job="syncscope-exporter"}'), timeout=30)
        assert sorted(r["metric"]["instance"] for r in up) == sorted(targets), up

        fired = wait_until(lambda: straggler_alerts(am), timeout=90, interval=1)
        assert fired, (
            "the straggler alert never reached Alertmanager: "
            f"ALERTS {[a['metric'] for a in vm.query('ALERTS')]}, "
            f"lag {vm.query('job_rank:syncscope_straggler_lag_seconds:argmin_lead')}, "
            f"skew {vm.query('job:syncscope_phase_comm_exposed_seconds_per_step:max_minus_min')}, "
            f"ratio {vm.query('job_rank:syncscope_straggler_lag_step:ratio')}, "
            f"alertmanager {am.alerts()}, vmalert errors {rule_errors(vmalert)}"
        )
        # The alert is the job's; its text names the rank and node (vmalert's query template).
        summaries = {a["annotations"]["summary"] for a in fired}
        assert summaries == {f"Job {JOB} has a straggler: rank {SLOW_RANK} (node node1)."}, (
            summaries
        )

        def verdicts() -> list[object]:
            states = [get_json(f"http://{t}/v1/state") for t in targets]
            named = [(s["jobs"][JOB]["diagnosis"]["straggler"] or {}).get("rank") for s in states]
            return named if named == [SLOW_RANK, SLOW_RANK] else []

        assert wait_until(verdicts, timeout=30), [
            get_json(f"http://{t}/v1/state")["jobs"][JOB]["diagnosis"] for t in targets
        ]
        for proc in ranks:
            proc.kill()
        wait_all(ranks, 30)
    finally:
        for proc in ranks:
            if proc.poll() is None:
                proc.kill()
        for proc in exporters:
            proc.terminate()
            proc.wait(10)
        for server in reversed(servers):
            server.stop()
