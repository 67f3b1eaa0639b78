"""Fuzzing the ingest endpoint: Hypothesis against the wire schema, Schemathesis against the spec.

Every generated request must get a 2xx or a clear 4xx, never a 5xx; what is already stored
must survive untouched (a sentinel rank is checked throughout); series cardinality stays under
the configured caps, and what the caps refused is counted.

The example count per test is SYNCSCOPE_FUZZ_EXAMPLES (default 150, for the suite). The full
run (docs/reliability.md) uses 10000 and writes its counts to SYNCSCOPE_FUZZ_REPORT:
  make fuzz, which is SYNCSCOPE_FUZZ_EXAMPLES=10000 SYNCSCOPE_FUZZ_REPORT=fuzz-report.json \\
      .venv/bin/pytest -q tests/unit/test_fuzz_ingest.py -p no:cacheprovider
"""

from __future__ import annotations

import copy
import json
import math
import os
import shutil
import subprocess
from collections import Counter
from typing import Any

import pytest
import schemathesis
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from prometheus_client.parser import text_string_to_metric_families
from schemathesis import GenerationMode
from syncscope.exporter.app import create_app
from syncscope.exporter.settings import Settings
from syncscope.exporter.store import clean_label

from syncscope.wire import INGEST_PATH, PHASES

# Schemathesis's items (one per API operation) share one node id, which pytest-xdist runs once;
# test_zz_fuzz_summary reads what every test of the file counted: one process for all of them.
pytestmark = pytest.mark.serial

EXAMPLES = int(os.environ.get("SYNCSCOPE_FUZZ_EXAMPLES", "150"))
REPORT = os.environ.get("SYNCSCOPE_FUZZ_REPORT")
# Small caps so that generated floods of ranks, jobs and (op, group) pairs really hit them.
CAPS = {"max_ranks": 48, "max_jobs": 4, "max_series_per_rank": 8}
# Nothing expires during a long run: the sentinel must still be there at the end.
SETTINGS = Settings(max_body_bytes=256 * 1024, expire_after_s=1e9, **CAPS)
FUZZ = settings(
    max_examples=EXAMPLES,
    deadline=None,
    database=None,
    suppress_health_check=list(HealthCheck),
    derandomize=False,
)

APP = create_app(SETTINGS)
CLIENT = TestClient(APP, raise_server_exceptions=False)
COUNTS: dict[str, Counter] = {"hypothesis": Counter(), "schemathesis": Counter()}


def valid_batch(
    job: str = "fuzz", rank: int = 0, steps: int = 3, version: int = 1
) -> dict[str, Any]:
    """A batch the exporter accepts, in wire schema 1 (objects) or 2 (the agent's rows)."""
    if version == 2:
        ms = 1_000_000
        return {
            **valid_batch(job, rank, 0),
            "schema_version": 2,
            "clock_offset_ns": 1_700_000_000 * 10**9,
            "steps": [[i, i * 10**9, 10 * ms, *[ms] * 6] for i in range(steps)],
            "collectives": [["ddp_grad_sync", "default_pg", 4096, 2 * ms, i] for i in range(steps)],
        }
    return {
        "schema_version": 1,
        "agent": {
            "job": job,
            "rank": rank,
            "local_rank": rank % 8,
            "world_size": 8,
            "incarnation": "inc-1",
            "hostname": "node-1",
            "pid": 123,
            "started_unix_s": 1.7e9,
        },
        "dropped_total": 0,
        "steps": [
            {
                "step": i,
                "duration_s": 0.01,
                "end_unix_s": 1.7e9 + i,
                "phases": {p: 0.001 for p in PHASES},
            }
            for i in range(steps)
        ],
        "collectives": [
            {
                "op": "ddp_grad_sync",
                "group": "default_pg",
                "bytes": 4096.0,
                "duration_s": 0.002,
                "step": i,
            }
            for i in range(steps)
        ],
        "pacing": {"enabled": True, "active": False, "current_delay_s": 0.0},
        "topology": {"gpu_uuid": "GPU-0", "pcie_link_width": 16},
    }


SENTINEL = valid_batch(job="sentinel", rank=0, steps=5)


def sentinel_series(text: str) -> dict[tuple, float]:
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.labels.get("job") == "sentinel" and "rank" in s.labels:
                out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def scrape() -> str:
    r = CLIENT.get("/metrics")
    assert r.status_code == 200, r.text[:300]
    return r.text


@pytest.fixture(scope="module", autouse=True)
def sentinel() -> dict[tuple, float]:
    """One rank stored before any fuzzing; every check compares against this scrape."""
    CLIENT.__enter__()
    r = CLIENT.post(INGEST_PATH, json=SENTINEL)
    assert r.status_code == 200, r.text
    global SENTINEL_SERIES
    SENTINEL_SERIES = sentinel_series(scrape())
    assert SENTINEL_SERIES
    yield SENTINEL_SERIES
    CLIENT.__exit__(None, None, None)


SENTINEL_SERIES: dict[tuple, float] = {}


def check_invariants() -> None:
    """Nothing stored is lost or corrupted; every read endpoint still answers; caps hold."""
    series = sentinel_series(scrape())
    # The sentinel rank's own series must neither vanish nor move. (Job-level series such as
    # the diagnosis legitimately change once the sentinel goes stale, so only per-rank ones.)
    for key, value in SENTINEL_SERIES.items():
        assert key in series, f"sentinel series lost: {key}"
        assert math.isclose(series[key], value, rel_tol=1e-12), (key, value, series[key])
    state = CLIENT.get("/v1/state?recent=300")
    assert state.status_code == 200, state.text[:300]
    view = state.json()
    ranks = sum(len(j["ranks"]) for j in view["jobs"].values())
    assert ranks <= CAPS["max_ranks"]
    assert len(view["jobs"]) <= CAPS["max_jobs"]
    for job in view["jobs"].values():
        for r in job["ranks"]:
            assert len(r["collectives"]) <= CAPS["max_series_per_rank"]


def tally(tool: str, status: int) -> None:
    counts = COUNTS[tool]
    counts["payloads"] += 1
    counts[f"{status // 100}xx"] += 1
    counts[str(status)] += 1


# -- Hypothesis against the wire schema -----------------------------------------------------------

NASTY_TEXT = st.text(
    alphabet=st.one_of(
        st.characters(codec="utf-8"),
        st.sampled_from(['"', "\\", "\n", "\r", "\t", "{", "}", "=", ",", "\x00", "\u2028", "é"]),
        st.sampled_from(["\U0001f600", "\u202e", "\ufeff", "\ud800"]),
    ),
    max_size=80,
)
JSON_SCALAR = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([1e308, -1e308, 1e-320, -0.0, 86_400.0, 86_400.0001, 2.0**50, 2.0**62]),
    NASTY_TEXT,
)
JSON_VALUE = st.recursive(
    JSON_SCALAR,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(NASTY_TEXT, inner, max_size=4),
    max_leaves=12,
)


def _paths(value: Any, prefix: tuple = ()) -> list[tuple]:
    out = [prefix]
    if isinstance(value, dict):
        for k, v in value.items():
            out += _paths(v, (*prefix, k))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            out += _paths(v, (*prefix, i))
    return out


@st.composite
def mutated_batches(draw: Any) -> bytes:
    """A valid batch with a few of its values, keys or lists replaced by hostile ones."""
    batch = valid_batch(
        job=draw(st.sampled_from(["fuzz", "fuzz-2"]) | NASTY_TEXT),
        rank=draw(st.integers(0, 2**20) | st.integers(0, 64)),
        steps=draw(st.integers(0, 4)),
        version=draw(st.sampled_from([1, 2])),
    )
    for _ in range(draw(st.integers(1, 4))):
        paths = [p for p in _paths(batch) if p]
        path = draw(st.sampled_from(paths))
        target = batch
        for p in path[:-1]:
            target = target[p]
        action = draw(st.sampled_from(["replace", "delete", "add_key", "grow"]))
        if action == "replace":
            target[path[-1]] = draw(JSON_VALUE)
        elif action == "delete":
            del target[path[-1]]
        elif action == "add_key" and isinstance(target, dict):
            target[draw(NASTY_TEXT)] = draw(JSON_VALUE)
        elif action == "grow" and isinstance(
            target.get(path[-1]) if isinstance(target, dict) else None, list
        ):
            items = target[path[-1]]
            if items:
                items.extend(
                    copy.deepcopy(items[0])
                    for _ in range(draw(st.sampled_from([1, 10, 100, 4100])))
                )
    # allow_nan: NaN and Infinity literals are what a sloppy client really sends.
    return json.dumps(batch, allow_nan=True).encode("utf-8", "surrogatepass")


RAW_BODIES = st.one_of(
    st.binary(max_size=512),
    st.sampled_from(
        [
            b"",
            b"null",
            b"[]",
            b'"text"',
            b"{" * 20_000,
            b"[" * 20_000 + b"]" * 20_000,
            b'{"schema_version": 1e999}',
            b'{"schema_version": 1, "agent": {"rank": -Infinity}}',
            b"\xef\xbb\xbf{}",
            b"9" * 5000,
        ]
    ),
)


@pytest.mark.slow
@FUZZ
@given(body=st.one_of(mutated_batches(), mutated_batches(), RAW_BODIES))
def test_hypothesis_hostile_batches_never_5xx(body: bytes) -> None:
    r = CLIENT.post(INGEST_PATH, content=body, headers={"content-type": "application/json"})
    tally("hypothesis", r.status_code)
    assert r.status_code < 500, r.text[:500]
    assert r.status_code in (200, 400, 413, 422, 429), r.status_code
    if r.status_code != 200:
        reply = r.json()
        assert reply["error"] and "detail" in reply
        # errors never echo what was sent back to the sender
        if isinstance(reply["detail"], list):
            assert all("input" not in e and "ctx" not in e for e in reply["detail"])
    if COUNTS["hypothesis"]["payloads"] % 50 == 0:
        check_invariants()


@pytest.mark.slow
@FUZZ
@given(job=NASTY_TEXT, group=NASTY_TEXT, host=NASTY_TEXT, version=st.sampled_from([1, 2]))
def test_hypothesis_label_values_are_sanitised(
    job: str, group: str, host: str, version: int
) -> None:
    """Quotes, newlines, unicode: accepted, cleaned, and the scrape still parses to the same label."""
    with TestClient(create_app(Settings()), raise_server_exceptions=False) as client:
        batch = valid_batch(job=job, version=version)
        batch["agent"]["hostname"] = host
        for c in batch["collectives"]:
            if version == 2:
                c[1] = group
            else:
                c["group"] = group
        body = json.dumps(batch).encode("utf-8", "surrogatepass")
        r = client.post(INGEST_PATH, content=body, headers={"content-type": "application/json"})
        tally("hypothesis", r.status_code)
        too_long = max(len(job), len(group), len(host)) > 64
        surrogate = any("\ud800" <= ch <= "\udfff" for ch in job + group + host)
        if too_long or surrogate:
            assert r.status_code == 422, r.status_code
            return
        assert r.status_code == 200, r.text[:300]
        text = client.get("/metrics").text
        jobs = {
            s.labels.get("job")
            for f in text_string_to_metric_families(text)
            for s in f.samples
            if s.name == "syncscope_steps_total"
        }
        assert jobs == {clean_label(job)}
        groups = {
            s.labels.get("group")
            for f in text_string_to_metric_families(text)
            for s in f.samples
            if s.name == "syncscope_collective_calls_total"
        }
        assert groups == {clean_label(group)}
        assert client.get("/v1/state").status_code == 200


def test_flood_of_ranks_jobs_and_series_is_capped_and_counted() -> None:
    settings_ = Settings(max_ranks=10, max_jobs=2, max_series_per_rank=3)
    with TestClient(create_app(settings_)) as client:
        codes = Counter()
        for i in range(40):
            codes[
                client.post(INGEST_PATH, json=valid_batch(job=f"j{i % 5}", rank=i)).status_code
            ] += 1
        flood = valid_batch(job="j0", rank=0, steps=1)
        flood["collectives"] = [
            {"op": "all_reduce", "group": f"g{i}", "bytes": 1.0, "duration_s": 0.001, "step": 0}
            for i in range(20)
        ]
        assert client.post(INGEST_PATH, json=flood).status_code == 200
        view = client.get("/v1/state").json()
        text = client.get("/metrics").text
    assert sum(len(j["ranks"]) for j in view["jobs"].values()) == 10
    assert set(view["jobs"]) == {"j0", "j1"}
    rank0 = next(r for r in view["jobs"]["j0"]["ranks"] if r["rank"] == 0)
    assert len(rank0["collectives"]) == 3  # ddp_grad_sync + 2 of the 20 flooded groups
    rejected = {
        dict(s.labels)["reason"]: s.value
        for f in text_string_to_metric_families(text)
        for s in f.samples
        if s.name == "syncscope_exporter_ingest_rejected_total"
    }
    assert codes[200] == 10 and codes[429] == 30
    # each refused request is counted once, under the cap that refused it
    assert rejected.get("too_many_jobs", 0) + rejected.get("too_many_ranks", 0) == 30
    assert rejected["too_many_series"] == 18
    assert "capacity" not in rejected


def test_huge_but_legal_batch_and_oversized_bodies() -> None:
    with TestClient(create_app(Settings())) as client:
        big = valid_batch(steps=4096)
        big["collectives"] = big["collectives"] * 4  # 16384, the schema's limit
        r = client.post(INGEST_PATH, json=big)
        assert r.status_code == 200, r.text[:300]
        over = valid_batch(steps=4097)
        assert client.post(INGEST_PATH, json=over).status_code == 422
        body = b'{"schema_version": 1, "pad": "' + b"x" * (9 * 1024 * 1024) + b'"}'
        assert client.post(INGEST_PATH, content=body).status_code == 413
        # a lying Content-Length is caught while streaming, not trusted
        r = client.post(
            INGEST_PATH,
            content=iter([b"{" + b" " * (1024 * 1024)] * 10),
            headers={"content-type": "application/json"},
        )
        assert r.status_code == 413


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool not installed")
def test_promtool_accepts_scrape_with_hostile_labels() -> None:
    with TestClient(create_app(Settings())) as client:
        for i, job in enumerate(['a"b', "new\nline", "uni\u00e9\U0001f600", "back\\slash", "}{"]):
            batch = valid_batch(job=job, rank=i)
            batch["collectives"][0]["group"] = job
            assert client.post(INGEST_PATH, json=batch).status_code == 200
        text = client.get("/metrics").text
    check = subprocess.run(
        ["promtool", "check", "metrics"], input=text, capture_output=True, text=True, timeout=60
    )
    assert check.returncode == 0, check.stdout + check.stderr


# -- Schemathesis against the OpenAPI spec FastAPI publishes ---------------------------------------

SCHEMA = schemathesis.openapi.from_asgi("/openapi.json", APP)
SCHEMA.config.generation.update(modes=[GenerationMode.POSITIVE, GenerationMode.NEGATIVE])


@pytest.mark.slow
@SCHEMA.parametrize()
@FUZZ
def test_schemathesis_no_server_errors(case: Any) -> None:
    n = COUNTS["schemathesis"]["payloads"]
    body = case.body if isinstance(case.body, dict) else None
    agent = body.get("agent") if body else None
    if isinstance(agent, dict) and isinstance(agent.get("job"), str) and n % 4:
        # Three in four valid-looking batches go to two known jobs, so that the job cap does
        # not refuse them all and the store's code paths get exercised, not only the cap's.
        agent["job"] = f"fuzz-{n % 2}"
    response = case.call()
    tally("schemathesis", response.status_code)
    assert response.status_code < 500, (case.method, case.path, response.text[:500])
    if case.path == INGEST_PATH and COUNTS["schemathesis"]["payloads"] % 50 == 0:
        check_invariants()


def test_zz_fuzz_summary() -> None:
    """Runs last (file order): invariants after all fuzzing, and the counts for the record."""
    check_invariants()
    summary = {tool: dict(sorted(c.items())) for tool, c in COUNTS.items()}
    rejected = CLIENT.get("/v1/state").json()["rejected"]
    summary["rejected_by_reason"] = rejected
    summary["examples_per_test"] = EXAMPLES
    print("fuzz summary:", json.dumps(summary))
    if REPORT:
        with open(REPORT, "w") as f:
            json.dump(summary, f, indent=1)
    for tool, counts in COUNTS.items():
        assert counts["5xx"] == 0, (tool, counts)
