"""bench/bench_scale.py without engines: one emulated node's series per rank against issue 32's
bound; the VictoriaMetrics path's shards' scrape config, the iterations read from vmalert's
duration summary and rule timings, and which evaluation wrote a stored straggler sample
(bench/scale_engines.py); the loss counters' increases (bench_scale)."""

from __future__ import annotations

import importlib.util
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from types import ModuleType

import pytest
import yaml
from syncscope.exporter.pooling import SAMPLE_SLOTS, SAMPLE_STRIDES

from syncscope.monitoring import victoriametrics

BENCH = Path(__file__).resolve().parents[2] / "bench"


def load(name: str) -> ModuleType:
    """bench/<name>.py as module `name`, in sys.modules: dataclasses look their module up, and
    bench_scale imports scale_engines by name (bench/ is not on sys.path here)."""
    spec = importlib.util.spec_from_file_location(name, BENCH / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def engines():
    try:
        yield load("scale_engines")
    finally:
        sys.modules.pop("scale_engines", None)


@pytest.fixture(scope="module")
def bench(engines):
    try:
        yield load("bench_scale")
    finally:
        sys.modules.pop("bench_scale", None)


def test_a_node_with_full_rings_stays_within_the_series_per_rank_bound(bench):
    families = bench.node_series(per_node=8)
    # every ring full: the heaviest the node's exposition gets
    assert families["syncscope_node_sampled_step"] == len(SAMPLE_STRIDES) * SAMPLE_SLOTS
    assert families["syncscope_node_sampled_transfer_seconds"] == len(SAMPLE_STRIDES) * SAMPLE_SLOTS
    # per rank: 8 ranks' phases, pacing and GPU state are there
    assert families["syncscope_phase_seconds_total"] == 8 * 7
    assert families["syncscope_pacing_active"] == families["syncscope_gpu_info"] == 8
    assert bench.series_per_rank(families, per_node=8) <= bench.SERIES_PER_RANK_TARGET


def test_vmagent_config_is_the_shipped_scrape_with_one_target_per_node(engines):
    config = yaml.safe_load(engines.vmagent_config(ports=[8123, 8124, 8123]))
    shipped = yaml.safe_load(
        victoriametrics.files(engines.load_config())[victoriametrics.VMAGENT_PATH]
    )
    assert config["global"] == shipped["global"]
    (scrape,) = config["scrape_configs"]
    assert scrape["honor_labels"] is True
    assert scrape["job_name"] == shipped["scrape_configs"][0]["job_name"]
    assert [c["labels"] for c in scrape["static_configs"]] == [
        {"__metrics_path__": f"/metrics/{n}", "instance": f"node{n:04d}:9464"} for n in range(3)
    ]
    # each node at its emulator process's port
    assert [c["targets"] for c in scrape["static_configs"]] == [
        ["127.0.0.1:8123"],
        ["127.0.0.1:8124"],
        ["127.0.0.1:8123"],
    ]


def test_iterations_from_the_duration_summary(engines):
    assert engines.new_iterations(None, (1.0, 4.0), 100.0) == []  # the baseline
    assert engines.new_iterations((1.0, 4.0), (1.0, 4.0), 101.0) == []
    ((when, took),) = engines.new_iterations((1.0, 4.0), (1.5, 5.0), 102.0)
    assert took == pytest.approx(0.5) and when == pytest.approx(101.5)
    two = engines.new_iterations((1.5, 5.0), (2.5, 7.0), 130.0)
    assert [t for _, t in two] == pytest.approx([0.5, 0.5])


def test_vmalert_rule_times_are_cumulative_within_an_iteration(engines):
    watch = engines.Watch(engine=None)
    at, earlier = "2026-11-26T13:50:34.927240668Z", "2026-11-26T13:50:19.927240668Z"
    groups = [
        {
            "name": "g",
            "rules": [
                {"name": "a", "lastEvaluation": at, "evaluationTime": 0.030},
                {"name": "b", "lastEvaluation": at, "evaluationTime": 0.045},
                # not yet run in this iteration: the previous one's, whole
                {"name": "c", "lastEvaluation": earlier, "evaluationTime": 0.050},
            ],
        }
    ]
    watch.read_rules(groups, cumulative=True)
    took = {key: next(iter(e.values())) for key, e in watch.rules.items()}
    assert took == pytest.approx({"g/00 a": 0.030, "g/01 b": 0.015, "g/02 c": 0.050})
    assert watch.rule_evaluations("a") == [engines.unix_time(at)]


def test_a_stored_sample_belongs_to_the_first_evaluation_at_or_after_it(engines):
    # vmalert stamps a record with its query time: the evaluation's start rounded down to 15 s.
    evaluations = [100.3, 115.2, 130.1, 145.4]
    stored = [
        {"metric": {"rank": "11"}, "timestamps": [90_000, 105_000]},
        {"metric": {"rank": "12"}, "timestamps": [105_000, 120_000]},
    ]
    assert engines.named_by_evaluation(evaluations, stored) == {
        100.3: {"11"},
        115.2: {"11", "12"},
        130.1: {"12"},
        145.4: set(),
    }


def test_counter_increases_from_the_last_value_before_the_window(bench):
    counters = {
        "vm x_dropped_total": [(1.0, 5.0), (10.0, 7.0), (20.0, 9.0), (30.0, 12.0)],
        "vm y_errors_total": [(1.0, 3.0), (30.0, 3.0)],
    }
    assert bench.increases(counters, 15.0, 25.0) == {"vm x_dropped_total": 2.0}
    assert bench.increases(counters, 0.0, 40.0) == {"vm x_dropped_total": 7.0}


def test_an_emulator_pool_serves_the_job_a_single_process_does(bench):
    """--workers: the nodes spread over processes, each served at its worker's port, with the
    series one process would serve, and the workers' figures summed."""

    def series(port: int, node: int) -> set[str]:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics/{node}", timeout=30) as r:
            lines = r.read().decode().splitlines()
        return {line.rpartition(" ")[0] for line in lines if line and not line.startswith("#")}

    # Both feed by the wall clock, each node on its own schedule: 10 s steps from 25 s ago,
    # so steps 0 and 1 (an all_gather, an all_reduce) are in every feed and no new series
    # comes before step 10's broadcast, 85 s away. With 1 s steps from 10 s ago, step 10 ended
    # 1 s after the first feed: a node fed after it in one emulator and not yet in the other
    # served a broadcast series more (seen under load).
    job = bench.Job(4, 2, 10.0, 0.03, time.time() - 25)
    single = bench.Emulator(job, 5.0, 20)
    pool = bench.EmulatorPool(job, 5.0, 20, workers=2)
    try:
        single.feed_all()
        pool.feed_all()
        single.start()
        pool.start()
        ports = pool.ports
        assert ports[0] == ports[2] != ports[1] == ports[3]  # node n in worker n mod 2
        assert pool.stats()["first_scrape"] is None
        for node in range(4):
            assert series(ports[node], node) == series(single.port, node)
            assert f'node="node{node:04d}"' in "".join(series(ports[node], node))
        with pytest.raises(urllib.error.HTTPError):
            series(ports[0], 1)  # worker 0 holds nodes 0 and 2 only
        stats = pool.stats()
        assert stats["first_scrape"] is not None
        assert stats["scrapes"] == 8  # each node twice
        assert stats["records"] > 0
        assert len(stats["feed_late_s"]) == 2  # one list per worker
        pool.reset_first_scrape()
        assert pool.stats()["first_scrape"] is None
    finally:
        pool.close()
        single.close()
    assert not any(proc.is_alive() for proc in pool.procs)


def test_a_replicated_node_serves_the_series_the_node_itself_would(bench):
    """--replicate: a node that copies node 0's exposition has exactly the series (names and
    labels) that node's own exporter renders, and its own hostname, ranks and GPUs."""
    from prometheus_client.parser import text_string_to_metric_families

    scale = bench
    job = scale.Job(6, 8, 1.0, 0.03, time.time() - 300)
    assert scale.replicated_prototypes(job) == {0, 3}

    def series(body: bytes) -> set[tuple[str, frozenset]]:
        return {
            (s.name, frozenset(s.labels.items()))
            for family in text_string_to_metric_families(body.decode())
            for s in family.samples
        }

    real = scale.Emulator(job, 5.0, 20)
    copied = scale.Emulator(job, 5.0, 20, replicate=True)
    try:
        real.feed_all()
        copied.feed_all()
        assert sorted(copied.nodes) == [0, 3]  # only the prototypes are fed
        for node in (1, 5):
            own, _ = real.exposition(node)
            replica, _ = copied.exposition(node)
            assert series(replica) == series(own)
            assert scale.hostname(node).encode() in replica
            assert scale.hostname(0).encode() not in replica
        # The straggler's node is fed for real: its exposition is its own.
        assert series(copied.exposition(3)[0]) == series(real.exposition(3)[0])
    finally:
        real.server.server_close()
        copied.server.server_close()


def test_two_forms_answer_alike_up_to_float_rounding_only(bench):
    assert bench.alike(0.0, -0.0)
    assert bench.alike(1e-18, 0.0)  # a sum taken in another order
    assert bench.alike(0.06 - 0.02, 0.04)
    assert bench.alike(float("nan"), float("nan"))
    assert not bench.alike(0.04, 0.0401)
    assert not bench.alike(-0.04, 0.0)
