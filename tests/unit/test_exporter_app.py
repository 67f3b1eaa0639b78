"""The exporter app in-process (lifespan included): ingest validation, metrics, state, auth."""

from __future__ import annotations

import copy
import statistics

import pytest
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families
from syncscope.exporter.app import create_app
from syncscope.exporter.settings import Settings

from syncscope.catalog import STEP_WINDOW
from syncscope.thresholds import load_config
from tests.conftest import parse_samples

BATCH = {
    "schema_version": 1,
    "agent": {"job": "j", "rank": 0, "local_rank": 0, "world_size": 2, "incarnation": "a1"},
    "dropped_total": 3,
    "steps": [
        {
            "step": i,
            "duration_s": 0.1,
            "end_unix_s": 1.7e9 + i,
            "phases": {
                "data": 0.01,
                "forward": 0.02,
                "backward": 0.03,
                "optimizer": 0.01,
                "comm_exposed": 0.02,
                "other": 0.01,
            },
        }
        for i in range(10)
    ],
    "collectives": [
        {"op": "all_reduce", "group": "default_pg", "bytes": 1024.0, "duration_s": 0.01, "step": i}
        for i in range(10)
    ],
}


# The same ten steps as BATCH in wire schema 2, the agent's own: rows of integer nanoseconds on
# a monotonic clock, one offset to unix time per batch; `other` is what the phases leave.
MS = 1_000_000
BATCH_V2 = {
    "schema_version": 2,
    "agent": BATCH["agent"],
    "clock_offset_ns": 1_700_000_000 * 10**9 - 5_000 * 10**9,
    "dropped_total": 3,
    "steps": [
        [i, (5_000 + i) * 10**9, 100 * MS, 10 * MS, 20 * MS, 30 * MS, 10 * MS, 20 * MS, 0]
        for i in range(10)
    ],
    "collectives": [["all_reduce", "default_pg", 1024, 10 * MS, i] for i in range(10)],
}


@pytest.fixture
def client():
    with TestClient(create_app(Settings(max_body_bytes=200_000))) as c:
        yield c


def test_ingest_then_scrape(client):
    r = client.post("/v1/ingest", json={**BATCH, "agent": {**BATCH["agent"], "hostname": "h"}})
    assert r.status_code == 200, r.text
    assert "all_reduce|default_pg|10" in r.json()["baselines"]
    # A second rank on the same host: per-rank series name the node, per-node ones sum both.
    other = {**BATCH, "agent": {**BATCH["agent"], "rank": 1, "local_rank": 1, "hostname": "h"}}
    assert client.post("/v1/ingest", json=other).status_code == 200
    text = client.get("/metrics").text
    rank0 = (("job", "j"), ("local_rank", "0"), ("node", "h"), ("rank", "0"))
    rank1 = (("job", "j"), ("local_rank", "1"), ("node", "h"), ("rank", "1"))
    assert parse_samples(text, "syncscope_steps_total") == {rank0: 10.0, rank1: 10.0}
    phases = parse_samples(text, "syncscope_phase_seconds_total")
    assert sum(phases.values()) == pytest.approx(2.0)
    assert parse_samples(text, "syncscope_agent_records_dropped_total")
    assert parse_samples(text, "syncscope_rank_collective_seconds_total") == {
        # no group facts in these batches: the group's lowest rank is not known (empty)
        (("group", "default_pg"), ("group_first", ""), *rank0): pytest.approx(0.1),
        (("group", "default_pg"), ("group_first", ""), *rank1): pytest.approx(0.1),
    }
    node = (("job", "j"), ("node", "h"))
    assert parse_samples(text, "syncscope_collective_bytes_total") == {
        (("group", "default_pg"), *node, ("op", "all_reduce")): 20480.0
    }
    assert parse_samples(text, "syncscope_step_duration_seconds_count") == {node: 20.0}
    assert parse_samples(text, "syncscope_world_size") == {node: 2.0}
    ok = parse_samples(text, "syncscope_exporter_collector_success")
    assert ok and all(v == 1.0 for v in ok.values())
    (took,) = parse_samples(text, "syncscope_exporter_collect_duration_seconds").values()
    state = client.get("/v1/state?recent=5").json()
    # each collector's time of the last scrape, in the state rather than a series each
    collectors = state["collectors"]
    assert {(("collector", name),) for name in collectors} == set(ok)
    assert all(c["ok"] for c in collectors.values())
    assert 0 < sum(c["seconds"] for c in collectors.values()) <= took
    rank = state["jobs"]["j"]["ranks"][0]
    assert len(rank["recent_steps"]) == 5 and rank["steps_total"] == 10
    # no Prometheus read back: the lead is this node's own
    assert rank["lead_scope"] == "node" and rank["arrival_lead_s"] == rank["node_lead_s"]
    assert "Arrival lead (among this node's ranks)" in client.get("/").text


@pytest.mark.parametrize(
    ("body", "status", "reason"),
    [
        (b"{not json", 400, "malformed_json"),
        (b'{"schema_version": 1, "agent": NaN}', 400, "malformed_json"),
        (b'{"schema_version": 1}', 422, "invalid_schema"),
        (b"x" * 300_000, 413, "too_large"),
    ],
)
def test_bad_bodies_are_refused_and_lose_nothing(client, body, status, reason):
    client.post("/v1/ingest", json=BATCH)
    before = client.get("/metrics").text
    r = client.post("/v1/ingest", content=body, headers={"content-type": "application/json"})
    assert r.status_code == status and r.json()["error"] == reason
    after = client.get("/metrics").text
    assert parse_samples(after, "syncscope_steps_total") == parse_samples(
        before, "syncscope_steps_total"
    )
    assert parse_samples(after, "syncscope_exporter_ingest_rejected_total")


@pytest.mark.parametrize(
    ("path", "value"),
    [
        (("steps", 0, "duration_s"), -1.0),
        (("steps", 0, "duration_s"), 1e12),
        (("collectives", 0, "bytes"), -5.0),
        (("agent", "rank"), "zero"),
        (("agent", "world_size"), 0),
    ],
)
def test_out_of_range_values_get_422(client, path, value):
    bad = copy.deepcopy(BATCH)
    target = bad
    for p in path[:-1]:
        target = target[p]
    target[path[-1]] = value
    r = client.post("/v1/ingest", json=bad)
    assert r.status_code == 422
    assert "input" not in r.text  # errors never echo what was sent


def test_token_required_over_tcp():
    with TestClient(create_app(Settings(token="s3cret"))) as c:
        assert c.post("/v1/ingest", json=BATCH).status_code == 401
        assert (
            c.post("/v1/ingest", json=BATCH, headers={"Authorization": "Bearer wrong"}).status_code
            == 401
        )
        assert (
            c.post("/v1/ingest", json=BATCH, headers={"Authorization": "Bearer s3cret"}).status_code
            == 200
        )


def test_restarted_rank_keeps_counters_and_sums_drops(client):
    client.post("/v1/ingest", json=BATCH)
    again = copy.deepcopy(BATCH)
    again["agent"]["incarnation"] = "b2"
    again["dropped_total"] = 2
    client.post("/v1/ingest", json=again)
    text = client.get("/metrics").text
    assert list(parse_samples(text, "syncscope_steps_total").values()) == [20.0]
    assert list(parse_samples(text, "syncscope_agent_records_dropped_total").values()) == [5.0]
    assert client.get("/v1/state").json()["jobs"]["j"]["ranks"][0]["restarts"] == 1


def test_openapi_publishes_the_ingest_schema(client):
    spec = client.get("/openapi.json").json()
    body = spec["paths"]["/v1/ingest"]["post"]["requestBody"]["content"]["application/json"][
        "schema"
    ]
    versions = [ref["$ref"].rsplit("/", 1)[1] for ref in body["oneOf"]]
    assert versions == ["BatchV1", "BatchV2"]
    schemas = spec["components"]["schemas"]
    for name in versions:  # every $ref resolves inside the published spec
        assert schemas[name]["properties"]["agent"]["$ref"].endswith("/AgentInfo")
    assert "AgentInfo" in schemas and "StepRecord" in schemas


def _series(client) -> dict[str, dict]:
    text = client.get("/metrics").text
    names = (
        "syncscope_steps_total",
        "syncscope_step_seconds_sum",
        "syncscope_phase_seconds_total",
        "syncscope_collective_bytes_total",
        "syncscope_collective_seconds_total",
        "syncscope_agent_records_dropped_total",
    )
    return {name: parse_samples(text, name) for name in names}


def test_schema_v2_rows_store_what_v1_objects_store():
    """The agent's row format and the object format are two spellings of the same records."""
    with TestClient(create_app(Settings())) as v1, TestClient(create_app(Settings())) as v2:
        for _ in range(2):  # twice: the second batch meets the baselines the first one set
            a = v1.post("/v1/ingest", json=BATCH)
            b = v2.post("/v1/ingest", json=BATCH_V2)
            assert a.status_code == b.status_code == 200, b.text
            assert a.json()["baselines"] == pytest.approx(b.json()["baselines"])
        a, b = _series(v1), _series(v2)
        assert a["syncscope_steps_total"] and a.keys() == b.keys()
        for name in a:
            assert a[name].keys() == b[name].keys(), name
            for key, value in a[name].items():
                assert b[name][key] == pytest.approx(value), (name, key)
        steps = v2.get("/v1/state?recent=10").json()["jobs"]["j"]["ranks"][0]["recent_steps"]
        assert steps[-1]["phases"]["other"] == pytest.approx(0.01)
        assert [s["step"] for s in steps] == list(range(10))


@pytest.mark.parametrize(
    ("mutate", "where"),
    [
        (lambda b: b["steps"][0].pop(), "steps"),  # a row one field short
        (lambda b: b["steps"][0].__setitem__(3, -1), "steps"),  # negative nanoseconds
        (lambda b: b["steps"][0].__setitem__(2, 0.5), "steps"),  # nanoseconds are integers
        (lambda b: b["collectives"][0].__setitem__(2, -4), "collectives"),
        (lambda b: b.pop("clock_offset_ns"), "clock_offset_ns"),
        # within bounds field by field, but no unix time: refused as a whole
        (lambda b: b.__setitem__("clock_offset_ns", -(10**18)), "unix time"),
        (lambda b: b.__setitem__("steps", [{"step": 0}]), "steps"),  # v1 objects under v2
        (lambda b: b.__setitem__("schema_version", 3), "schema_version"),
    ],
)
def test_bad_v2_rows_get_422_and_lose_nothing(client, mutate, where):
    assert client.post("/v1/ingest", json=BATCH_V2).status_code == 200
    before = _series(client)
    bad = copy.deepcopy(BATCH_V2)
    bad["agent"] = {**BATCH_V2["agent"], "rank": 1}
    mutate(bad)
    r = client.post("/v1/ingest", json=bad)
    assert r.status_code == 422, r.text
    assert where in r.text and "input" not in r.text
    assert _series(client) == before


def _ratio_buckets(client, durations: list[float], job: str) -> dict[str, float]:
    """{le: non-cumulative count} of the node's step-ratio histogram after these steps."""
    batch = {
        **BATCH,
        "agent": {**BATCH["agent"], "job": job, "hostname": "h"},
        "steps": [
            {"step": i, "duration_s": d, "end_unix_s": 1.7e9 + i, "phases": {"forward": d}}
            for i, d in enumerate(durations)
        ],
        "collectives": [],
    }
    assert client.post("/v1/ingest", json=batch).status_code == 200
    text = client.get("/metrics").text
    cumulative = {
        dict(k)["le"]: v
        for k, v in parse_samples(text, "syncscope_step_duration_ratio_bucket").items()
        if dict(k)["job"] == job
    }
    les = sorted(cumulative, key=float)
    return {le: cumulative[le] - (cumulative[les[i - 1]] if i else 0) for i, le in enumerate(les)}


@pytest.mark.parametrize("step_s", [0.012, 1.2])
def test_jitter_shows_at_any_step_length(client, step_s):
    """Issue 17: steps 8 % under, at and 8 % over 1.2 s (or 12 ms) land in the ratio buckets
    either side of the rank's median; steady steps next to it. Absolute buckets (1, 2.5 s) hold
    all of them in one."""
    jittery = _ratio_buckets(client, [step_s * (0.92, 1.0, 1.08)[i % 3] for i in range(195)], "j")
    steady = _ratio_buckets(client, [step_s] * 195, "steady")
    # A rank's median is first taken at its 16th step, from the 15 before: 180 steps carry one.
    assert sum(jittery.values()) == sum(steady.values()) == 180
    assert jittery["0.95"] == jittery["1.05"] == jittery["1.1"] == 60
    assert steady["1.05"] == 180


def test_the_lead_gauge_is_node_local_and_the_state_job_wide():
    """One meaning per number: with Prometheus's job-wide leads read back, /v1/state (and the
    diagnosis) carry them, while the syncscope_arrival_lead_seconds gauge stays the exporter's
    own measurement over this node's ranks (rank 1 blocked 30 ms more than rank 0)."""
    from syncscope.exporter.jobwide import JobWide
    from syncscope.exporter.store import Store

    settings = Settings(max_body_bytes=200_000)
    store = Store(settings)
    job_wide = JobWide({0: 0.050, 1: 0.080}, None, None, 0.0, straggler=(0, 0.030))
    store.job_wide = lambda job, as_of=None: job_wide  # as a PrometheusReader would
    # Two ranks of four here: the job-wide view is the job's
    agents = [
        {**BATCH_V2["agent"], "rank": r, "local_rank": r, "hostname": "h", "world_size": 4}
        for r in (0, 1)
    ]
    with TestClient(create_app(settings, store)) as c:
        for agent in agents:  # both report before any step, so that every step pools both
            batch = {**BATCH_V2, "agent": agent, "steps": [], "collectives": []}
            assert c.post("/v1/ingest", json=batch).status_code == 200
        for agent, exposed_ms in zip(agents, (20, 50), strict=True):
            steps = [[*row[:7], exposed_ms * MS, 0] for row in BATCH_V2["steps"]]
            batch = {**BATCH_V2, "agent": agent, "steps": steps}
            assert c.post("/v1/ingest", json=batch).status_code == 200
        gauge = parse_samples(c.get("/metrics").text, "syncscope_arrival_lead_seconds")
        state = c.get("/v1/state").json()["jobs"]["j"]
        page = c.get("/").text
    node_local = {dict(k)["rank"]: v for k, v in gauge.items()}
    assert node_local == {"0": pytest.approx(0.0), "1": pytest.approx(0.030)}, node_local
    leads = {r["rank"]: r["arrival_lead_s"] for r in state["ranks"]}
    assert leads == {0: pytest.approx(0.050), 1: pytest.approx(0.080)}, leads
    # and says whose they are; the node's own stays beside them
    assert {r["lead_scope"] for r in state["ranks"]} == {"job"}
    assert "Arrival lead (the job's, read back from Prometheus)" in page
    own = {r["rank"]: r["node_lead_s"] for r in state["ranks"]}
    assert own == {0: pytest.approx(0.0), 1: pytest.approx(0.030)}, own
    # The job-wide view names a straggler at SyncscopeStraggler's line, and the page says so.
    cfg = load_config()
    ratio = min(lv.threshold for lv in cfg.alerts["SyncscopeStraggler"].levels)
    step = statistics.median(r["step_time_median_s"] for r in state["ranks"])
    line = max(cfg.diagnosis.skew_floor_s, ratio * step)
    assert f"straggler threshold {line * 1e3:.1f} ms" in page, (line, step)


def test_a_gpu_hour_price_is_exported_per_job_and_node_only_where_given():
    """--price-per-gpu-hour: one series per job and node the exporter serves, the price as
    given; none without it; a price that is not a finite number >= 0 is refused by name."""
    from syncscope.exporter.__main__ import build_parser, settings_from_args

    batch = {**BATCH, "agent": {**BATCH["agent"], "hostname": "h"}}
    with TestClient(create_app(Settings(price_per_gpu_hour=2.5))) as priced:
        assert priced.post("/v1/ingest", json=batch).status_code == 200
        text = priced.get("/metrics").text
    assert parse_samples(text, "syncscope_gpu_hour_price") == {(("job", "j"), ("node", "h")): 2.5}
    with TestClient(create_app(Settings())) as plain:
        assert plain.post("/v1/ingest", json=batch).status_code == 200
        assert "syncscope_gpu_hour_price{" not in plain.get("/metrics").text
    parser = build_parser()
    assert (
        settings_from_args(parser.parse_args(["--price-per-gpu-hour", "3"])).price_per_gpu_hour
        == 3.0
    )
    assert settings_from_args(parser.parse_args([])).price_per_gpu_hour is None
    for bad in ("-1", "nan", "inf", "cheap"):
        with pytest.raises(SystemExit):
            parser.parse_args(["--price-per-gpu-hour", bad])


def _straggling_job(
    settings: Settings, phase_every: int = 1, scrapes: list[str] | None = None
) -> tuple[dict, str]:
    """/v1/state's job and the status page after two ranks' first (warm-up) step and a settled
    window of steps of 100 ms (before it the exporter names nothing): rank 1 waits 50 ms at
    the sync each step and rank 0 20 ms, so rank 0 arrives 30 ms after rank 1.
    Rank 0 says it times its phases in 1 step of `phase_every` (1: the field left out).
    `scrapes`: /metrics is appended to it."""
    agents = [{**BATCH_V2["agent"], "rank": r, "local_rank": r, "hostname": "h"} for r in (0, 1)]
    if phase_every != 1:
        agents[0]["phase_every"] = phase_every
    with TestClient(create_app(settings)) as c:
        for agent in agents:  # both report before any step, so that every step pools both
            batch = {**BATCH_V2, "agent": agent, "steps": [], "collectives": []}
            assert c.post("/v1/ingest", json=batch).status_code == 200
        for agent, exposed_ms in zip(agents, (20, 50), strict=True):
            steps = [
                [
                    i,
                    (5_000 + i) * 10**9,
                    100 * MS,
                    10 * MS,
                    20 * MS,
                    30 * MS,
                    10 * MS,
                    exposed_ms * MS,
                    0,
                ]
                for i in range(1 + STEP_WINDOW)
            ]
            batch = {**BATCH_V2, "agent": agent, "steps": steps, "collectives": []}
            assert c.post("/v1/ingest", json=batch).status_code == 200
        if scrapes is not None:
            scrapes.append(c.get("/metrics").text)
        return c.get("/v1/state").json()["jobs"]["j"], c.get("/").text


def test_a_rank_that_samples_its_phases_is_shown_so():
    """An agent timing its phases in 1 step of N (phase sampling) says so: /v1/state carries
    it per rank, the page marks that rank's phase bar, and only that rank's, and /metrics has
    syncscope_phase_sampling_every for that rank alone (what the dashboard's "Phases timed"
    reads); an agent that does not say is every step timed. A value the wire does not allow is
    refused."""
    scrapes: list[str] = []
    job, page = _straggling_job(Settings(), phase_every=8, scrapes=scrapes)
    assert {r["rank"]: r["phase_every"] for r in job["ranks"]} == {0: 8, 1: 1}
    assert page.count("timed 1 step in 8") == 1
    assert "timed 1 step in" not in _straggling_job(Settings(), scrapes=scrapes)[1]
    sampled, timed = (
        [
            (s.labels["rank"], s.value)
            for family in text_string_to_metric_families(text)
            if family.name == "syncscope_phase_sampling_every"
            for s in family.samples
        ]
        for text in scrapes
    )
    assert sampled == [("0", 8.0)] and timed == []
    bad = {**BATCH_V2, "agent": {**BATCH_V2["agent"], "phase_every": 0}}
    with TestClient(create_app(Settings())) as c:
        assert c.post("/v1/ingest", json=bad).status_code == 422
        assert c.get("/v1/state").json()["jobs"] == {}


def test_the_exporters_set_moves_its_diagnosis_and_verdict_as_it_moves_the_rules():
    """`--set` reaches the store's diagnosis, the verdict and the page, not only the rules: a
    30 ms arrival skew over a 100 ms step is a straggler at the shipped line (5 % of the step)
    and none once the line is raised to 60 % of it (60 ms)."""
    from syncscope.exporter.__main__ import build_parser, settings_from_args

    from syncscope.thresholds import load_config

    step_s, skew_s = 0.100, 0.050 - 0.020
    shipped = load_config().diagnosis
    shipped_line = max(shipped.skew_floor_s, shipped.skew_step_fraction * step_s)
    assert shipped_line < skew_s  # the test's premise, from the shipped file
    raised = 2 * skew_s / step_s
    args = build_parser().parse_args(["--set", f"diagnosis.skew_step_fraction={raised}"])

    before, page_before = _straggling_job(settings_from_args(build_parser().parse_args([])))
    after, page_after = _straggling_job(settings_from_args(args))

    assert before["diagnosis"]["skew_s"] == pytest.approx(skew_s)
    assert before["diagnosis"]["straggler"]["rank"] == 0
    assert before["diagnosis"]["modes"]["straggler"]["verdict"] is True
    assert before["diagnosis"]["verdict"]["verdict"] == "coupling"
    assert f"straggler threshold {shipped_line * 1e3:.1f} ms" in page_before

    assert after["diagnosis"]["skew_s"] == pytest.approx(skew_s)
    assert after["diagnosis"]["straggler"] is None
    assert after["diagnosis"]["modes"]["straggler"]["verdict"] is False
    assert "verdict" not in after["diagnosis"]  # the job loses no time by the raised line
    assert f"straggler threshold {raised * step_s * 1e3:.1f} ms" in page_after


def test_the_exporters_set_is_parsed_into_settings_and_a_typo_stops_it_at_start(
    monkeypatch, capsys
):
    """`--set PATH=VALUE` (repeatable, as for `syncscope rules`) gives Settings the overridden
    lines; without it, the shipped ones. A path the thresholds file does not have exits 2
    naming it, before anything listens."""
    from syncscope.exporter import __main__ as exporter_main
    from syncscope.exporter.diagnosis import DEFAULT_THRESHOLDS

    parser = exporter_main.build_parser()
    assert exporter_main.settings_from_args(parser.parse_args([])).thresholds == DEFAULT_THRESHOLDS
    settings = exporter_main.settings_from_args(
        parser.parse_args(
            [
                "--set",
                "alerts.SyncscopeFabricContention.levels.0.threshold=1.3",
                "--set",
                "diagnosis.verdict_score=0.4",
                "--set",
                "diagnosis.skew_floor_s=0.02",
            ]
        )
    )
    t = settings.thresholds
    assert (t.contention_inflation, t.verdict_score) == (1.3, 0.4)
    assert settings.skew_threshold_s == 0.02
    assert t.skew_step_fraction == DEFAULT_THRESHOLDS.skew_step_fraction  # the rest: shipped
    assert t != DEFAULT_THRESHOLDS

    def no_server(*args, **kwargs):
        raise AssertionError("a bad --set must stop the exporter before it serves")

    monkeypatch.setattr(exporter_main, "serve", no_server)
    typo = "alerts.SyncscopeFabricContention.levels.0.treshold"
    assert exporter_main.main(["--set", f"{typo}=1.3"]) == 2
    assert typo in capsys.readouterr().err


def test_the_exporters_set_moves_the_windows_of_its_own_baselines():
    """The node-local contention baseline, the throughput's shortest block and its baseline's
    horizon are the rules' windows: `--set windows.*` moves them in the exporter as in the rules."""
    from syncscope.exporter.__main__ import build_parser, settings_from_args
    from syncscope.exporter.store import Store

    args = ["--set", "windows.contention_baseline=2h", "--set", "windows.rate=30s"]
    settings = settings_from_args(build_parser().parse_args([*args, "--set", "windows.trend=3d"]))
    t = settings.thresholds
    assert (t.contention_baseline_s, t.contention_recent_s) == (7200.0, 30.0)
    assert (t.throughput_block_s, t.throughput_horizon_s) == (30.0, 3 * 86400.0)
    store = Store(settings)
    with TestClient(create_app(settings, store)) as c:
        assert c.post("/v1/ingest", json=BATCH_V2).status_code == 200
    (pool,) = store.pools.values()
    assert (pool.baseline_window_s, pool.recent_window_s) == (7200.0, 30.0)
