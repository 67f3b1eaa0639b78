"""The job overview's triage row and its step-time panel, rendered from a real run.

A real 4-rank gloo job with rank 2 slowed 30 ms in every forward reports to a real exporter;
a real Prometheus scrapes it with syncscope's rules (local_config: 1 s scrapes, 10 s windows,
`for: 2s`). Once SyncscopeStraggler fires, syncscope.lab.render runs the checked-in
dashboard's panels against that Prometheus the way Grafana would (variables, table merge,
sort, organize, units) and this test checks the triage table's FIRST row is the straggler, on
its node, with its cause, the phase that makes it late, the alert and its cost. The PNGs go to
the test's tmp dir, and also to $SYNCSCOPE_DASHBOARD_PNGS when set: that is how the docs/ PNGs
are made (`SYNCSCOPE_DASHBOARD_PNGS=docs pytest tests/e2e/test_dashboard_render.py`).
"""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path
from typing import Any

import pytest
from syncscope.agent.config import node_name

from syncscope.lab import render
from syncscope.lab.servers import Prometheus
from syncscope.monitoring import dashboards as D
from syncscope.monitoring.prometheus_config import local_config
from syncscope.prometheus_api import PrometheusAPI
from syncscope.wire import Phase
from tests.conftest import wait_until


def _missing() -> str | None:
    if shutil.which("prometheus") is None:
        return "prometheus not installed (scripts/setup test installs it)"
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        return "the playwright package is not installed"
    if not os.path.exists(render.CHROMIUM):
        return "Debian chromium is not installed (apt-get install chromium)"
    return None


pytestmark = [pytest.mark.slow, pytest.mark.skipif(_missing() is not None, reason=str(_missing()))]
SLOW_RANK = 2
SLOW_MS = 30
JOB = "render"
RENDER_AFTER_S = 65


def firing(prom: Prometheus, alertname: str) -> list[dict[str, Any]]:
    return [
        a
        for a in prom.alerts()
        if a["labels"].get("alertname") == alertname
        and a["labels"].get("job") == JOB
        and a["state"] == "firing"
    ]


def test_triage_row_names_the_straggler_and_renders(
    exporter: Any, job_factory: Any, tmp_path: Path
) -> None:
    prom = Prometheus(local_config(exporter.port, str(tmp_path)), str(tmp_path))
    try:
        prom.wait_ready()
        start = time.time()
        job_factory(
            4,
            ["--duration", "75", "--slow-rank", str(SLOW_RANK), "--slow-ms", str(SLOW_MS)],
            exporter.url,
            job=JOB,
        )
        assert wait_until(lambda: firing(prom, "SyncscopeStraggler"), timeout=60, interval=1), (
            "SyncscopeStraggler never fired"
        )
        # A minute of the job on the chart (the alert still firing: the job runs 75 s).
        time.sleep(max(8.0, start + RENDER_AFTER_S - time.time()))
        ctx = render.Context.for_job(
            prom.url, JOB, start=start, end=time.time(), step=1.0, rate_interval="10s"
        )
        overview = render.load_dashboard(D.OVERVIEW_UID)
        table = next(p for p in overview["panels"] if p["title"] == "Late ranks")
        frame = render.panel_table(table, ctx)
        assert frame is not None and frame.length == 4, frame
        rows = [{f.display_name: f.values[r] for f in frame.fields} for r in range(frame.length)]
        first = rows[0]
        # Which rank on which node, why, since when, what it costs: all on the first row.
        assert first["Rank"] == str(SLOW_RANK), rows
        assert first["Node"] == node_name(), first  # the node label the ranks took
        assert first["Cause"] == "forward", first
        assert first["Late by"] > 0.5 * SLOW_MS / 1000, first
        assert 0 < first["Of a step"] < 1, first
        assert first[D.PHASE_COLUMNS[Phase.FORWARD]] > 0.5 * SLOW_MS / 1000, first
        assert first[D.PHASE_COLUMNS[Phase.COMM_EXPOSED]] < 0, first
        assert first["Alert"] == "firing" and first["Alert for"] > 0, first
        assert first["Cost"] > 0, first
        # The others are later than nobody by as much, and carry no cause or cost.
        for row in rows[1:]:
            assert row["Late by"] < first["Late by"] and not row.get("Cause"), row
            assert row.get("Cost") is None, row
        header = [f.display_name for f in frame.fields]
        assert not [h for h in header if h.startswith("Value") or h in ("Time", "job")], header
        # Every value column has its own unit: seconds are not percentages.
        units = {h: render.field_config(table, h).get("unit") for h in header}
        assert units["Late by"] == "s" and units["Of a step"] == "percentunit"
        assert render.format_value(first["Late by"], "s").endswith(" ms")

        shown = render.render_docs(ctx, tmp_path, keep_html=True)
        triage = shown[render.TRIAGE_FILE]["Late ranks"]["rows"]
        assert triage[0]["Rank"] == str(SLOW_RANK)
        stats = shown[render.TRIAGE_FILE]
        assert stats["Idle GPU-hours per hour"]["series"] == [JOB]
        assert stats["Straggler alert active for"]["series"] == [JOB]
        step = shown[render.STEP_TIME_FILE]["Step time"]
        assert "mean" in step["series"] and "p0.5" in step["series"], step
        assert "SyncscopeStraggler" in step["annotations"], step
        html = (tmp_path / "triage-row.html").read_text()
        assert "forward" in html and "Late by" in html and "Value #" not in html
        for name in (render.TRIAGE_FILE, render.STEP_TIME_FILE):
            png = tmp_path / name
            data = png.read_bytes()
            assert data[:8] == b"\x89PNG\r\n\x1a\n", name
            width, height = int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")
            assert width >= 600 and height >= 200, (name, width, height)
            assert len(data) > 10_000, (name, len(data))  # drawn, not a blank page
        target = os.environ.get("SYNCSCOPE_DASHBOARD_PNGS")
        if target:
            for name in (render.TRIAGE_FILE, render.STEP_TIME_FILE):
                shutil.copyfile(tmp_path / name, Path(target) / name)
    finally:
        prom.stop()


# -- at scale: every panel query against a job of many ranks ------------------------------------
SCALE_RANKS = int(os.environ.get("SYNCSCOPE_SCALE_RANKS", "256"))
RANKS_PER_NODE = 8
LABEL_VALUES = {
    "op": ("all_reduce", "ddp_grad_sync", "broadcast"),
    "group": ("0",),
    "mode": ("sync_amplification", "fabric_contention", "gpu_locality", "runtime_jitter"),
    "stride": ("1",),
    "slot": ("0", "1"),
    "interface": ("eth0",),
    "direction": ("tx", "rx"),
    "collector": ("steps", "collectives", "gpu"),
    "reason": ("bad_record",),
    "cause": ("forward",),
}


def synthetic_metrics(now: float, started: float, ranks: int) -> str:
    """/metrics of one exporter serving a job of ``ranks`` ranks on ranks/8 nodes, every
    family of the catalog with its own labels (so it follows the contract as it changes);
    counters grow at a rate of their own per series, rank 5 the straggler."""
    from itertools import product

    from syncscope import catalog as M

    elapsed = now - started
    nodes = [f"node{n}" for n in range(max(1, ranks // RANKS_PER_NODE))]
    lines = []
    for spec in M.CATALOG:
        if spec.condition in ("prometheus", "process"):
            continue
        per_rank = "rank" in spec.labels
        others = [lb for lb in spec.labels if lb not in ("job", "node", "rank", "local_rank")]
        values_of = [
            [p.label for p in Phase] if lb == "phase" else LABEL_VALUES.get(lb, ("x",))
            for lb in others
        ]
        owners: list[dict[str, str]]
        if per_rank:
            owners = [
                {
                    "rank": str(r),
                    "local_rank": str(r % RANKS_PER_NODE),
                    "node": nodes[min(r // RANKS_PER_NODE, len(nodes) - 1)],
                }
                for r in range(ranks)
            ]
            if spec is M.STRAGGLER_CAUSE:
                owners = [{"rank": "5", "node": "node0", "local_rank": "5"}]
        elif "node" in spec.labels:
            owners = [{"node": n} for n in nodes]
        else:
            owners = [{}]
        for owner, combo in product(owners, product(*values_of)):
            labels = {"job": "scale", **owner, **dict(zip(others, combo, strict=True))}
            labels = {k: v for k, v in labels.items() if k in spec.labels}
            seed = (int(owner.get("rank", 0)) * 7919 + len(lines)) % 97 / 97
            if spec.type == "counter":
                slow = 0.5 if owner.get("rank") == "5" and "collective" in spec.name else 1.0
                value = elapsed * (1 + seed) * slow
            elif spec.type == "histogram":
                text = ",".join(f'{k}="{v}"' for k, v in labels.items())
                for le in ("0.05", "0.1", "0.5", "+Inf"):
                    share = {"0.05": 0.2, "0.1": 0.7, "0.5": 0.95, "+Inf": 1.0}[le]
                    lines.append(f'{spec.name}_bucket{{{text},le="{le}"}} {elapsed * 10 * share}')
                lines.append(f"{spec.name}_sum{{{text}}} {elapsed}")
                lines.append(f"{spec.name}_count{{{text}}} {elapsed * 10}")
                continue
            elif "start" in spec.name:  # a process's, the job's, its latest rank's start
                value = started
            elif "timestamp" in spec.name:
                value = now
            elif spec.name == M.WORLD_SIZE.name:
                value = ranks
            else:
                value = 0.01 + seed * 0.02
            text = ",".join(f'{k}="{v}"' for k, v in labels.items())
            lines.append(f"{spec.name}{{{text}}} {value}")
    return "\n".join(lines) + "\n"


@pytest.mark.background
def test_no_panel_query_returns_more_than_30_series_at_scale(tmp_path: Path) -> None:
    """Every query of both dashboards, with no rank selected, against SCALE_RANKS ranks (256
    here; SYNCSCOPE_SCALE_RANKS=1024 for the issue's figure): at most D.MAX_SERIES series."""
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    started = time.time()

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body = synthetic_metrics(time.time(), started, SCALE_RANKS).encode()
            self.send_response(200)
            self.send_header("Content-Type", "text/plain; version=0.0.4")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    prom = Prometheus(local_config(server.server_address[1], str(tmp_path)), str(tmp_path))
    try:
        prom.wait_ready()
        ranks = "job_rank:syncscope_phase_blocked_seconds_per_step:ratio"
        assert wait_until(
            lambda: len(prom.query(f'{ranks}{{job="scale"}}')) == SCALE_RANKS, 60, 1
        ), "the per-rank rules never covered every rank"
        time.sleep(12)  # a full 10 s rate window of recorded series
        end = time.time()
        counted = render.count_series(
            PrometheusAPI(prom.url),
            D.panel_queries(job="scale", rate_interval="10s", range_="20s"),
            start=end - 20,
            end=end,
            step=2,
        )
        assert not [c for c in counted if c["error"]], [c for c in counted if c["error"]]
        counts = [
            (c["series"], f"{c['dashboard']} / {c['panel']} / {c['ref_id']}") for c in counted
        ]
        too_many = [(n, name) for n, name in counts if n > D.MAX_SERIES]
        assert not too_many, too_many
        assert max(counts)[0] >= 5, counts  # the top-k lines are there
        print(f"{SCALE_RANKS} ranks: {len(counts)} queries, most series {max(counts)[0]}")
    finally:
        prom.stop()
        server.shutdown()
