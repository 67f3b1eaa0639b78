"""The exporter app in-process (lifespan included): ingest validation, metrics, state, auth."""

from __future__ import annotations

import copy

import pytest
from fastapi.testclient import TestClient
from syncscope.exporter.app import create_app
from syncscope.exporter.settings import Settings

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


@pytest.fixture
def client():
    with TestClient(create_app(Settings(max_body_bytes=200_000))) as c:
        yield c


def test_ingest_then_scrape(client):
    r = client.post("/v1/ingest", json=BATCH)
    assert r.status_code == 200, r.text
    assert "all_reduce|default_pg|10" in r.json()["baselines"]
    text = client.get("/metrics").text
    assert parse_samples(text, "syncscope_steps_total") == {
        (("job", "j"), ("local_rank", "0"), ("rank", "0")): 10.0
    }
    phases = parse_samples(text, "syncscope_phase_seconds_total")
    assert sum(phases.values()) == pytest.approx(1.0)
    assert parse_samples(text, "syncscope_agent_records_dropped_total")
    assert parse_samples(text, "syncscope_collective_bytes_total") == {
        (
            ("group", "default_pg"),
            ("job", "j"),
            ("local_rank", "0"),
            ("op", "all_reduce"),
            ("rank", "0"),
        ): 10240.0
    }
    ok = parse_samples(text, "syncscope_exporter_collector_success")
    assert ok and all(v == 1.0 for v in ok.values())
    state = client.get("/v1/state?recent=5").json()
    rank = state["jobs"]["j"]["ranks"][0]
    assert len(rank["recent_steps"]) == 5 and rank["steps_total"] == 10


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
    assert body["properties"]["agent"]["$ref"].endswith("/AgentInfo")
    assert "AgentInfo" in spec["components"]["schemas"]
