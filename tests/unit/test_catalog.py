"""The metric catalog: well-formed, the contract file is its output, and a real scrape matches it."""

from __future__ import annotations

import copy
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from syncscope import catalog
from syncscope.catalog import CATALOG, CONDITIONS, TYPES, MetricSpec
from tests.unit import test_exporter_app as app_tests

CONTRACT = Path(__file__).resolve().parents[2] / "deploy" / "metrics-contract.txt"
client = app_tests.client  # the exporter in-process, lifespan included

# Conditions under which the scrape below must show series: everything but a named straggler
# (it needs a slow rank) and what only Prometheus synthesises.
SHOWN = {"always", "gpu", "pacing", "rejections", "process", "work"}


def test_the_contract_file_is_the_catalogs_output():
    assert CONTRACT.read_text() == catalog.contract_text(), (
        "deploy/metrics-contract.txt is generated from syncscope/catalog.py: regenerate it"
    )


def test_every_spec_follows_the_naming_rules_and_has_its_constant():
    names = [m.name for m in CATALOG]
    assert len(names) == len(set(names))
    constants = {k: v for k, v in vars(catalog).items() if isinstance(v, MetricSpec)}
    assert set(constants.values()) == set(CATALOG)
    for constant, m in constants.items():
        assert constant == m.name.removeprefix("syncscope_").upper(), constant
        assert m.type in TYPES and m.condition in CONDITIONS, m
        assert m.help.endswith(".") and m.labels == tuple(dict.fromkeys(m.labels)), m
        assert m.name.endswith("_total") == (m.type == "counter"), m
        assert m.family == (m.name[: -len("_total")] if m.type == "counter" else m.name)
        if m.type == "info":
            assert m.name.endswith("_info"), m
        if m.unit:  # base units, in the name (prometheus naming practice)
            assert f"_{m.unit}" in m.name, m


def test_the_markdown_table_lists_every_family_the_exporter_emits():
    rows = catalog.markdown_table().splitlines()
    assert rows[0] == "| Metric | Type | Labels | Help |"
    emitted = [m for m in CATALOG if m.condition != "prometheus"]
    assert len(rows) == 2 + len(emitted)
    for row, m in zip(rows[2:], emitted, strict=True):
        assert row.startswith(f"| `{m.name}` | {m.type} |") and m.help in row


def test_the_throttle_help_lists_the_reasons_the_diagnosis_names():
    from syncscope.exporter.diagnosis import THROTTLE_BITS

    for reason in catalog.CLOCK_EVENT_REASONS:
        assert f"{reason.bit:#x} {reason.short}" in catalog.GPU_THROTTLE_REASONS.help
        assert (THROTTLE_BITS.get(reason.bit) == reason.words) == reason.slows


def test_a_real_scrape_emits_exactly_the_declared_families_types_and_labels(client):
    assert client.post("/v1/ingest", json=app_tests.BATCH).status_code == 200
    gpu_rank = copy.deepcopy(app_tests.BATCH)
    gpu_rank["agent"] = {**gpu_rank["agent"], "rank": 1, "local_rank": 1, "incarnation": "b1"}
    gpu_rank["pacing"] = {"enabled": True, "active": True, "current_delay_s": 0.002}
    gpu_rank["topology"] = {
        "gpu_uuid": "GPU-1",
        "pci_bus_id": "0000:1b:00.0",
        "gpu_name": "NVIDIA H100",
        "gpu_numa_node": 0,
        "nic": "mlx5_0",
        "nic_distance": "same_pcie_switch",
        "pcie_link_width": 16,
        "pcie_link_max_width": 16,
        "pcie_link_generation": 5,
        "pcie_link_max_generation": 5,
        "nvlink_active_links": 18,
        "process_numa_nodes": "1",
        "numa_mismatch": 1,  # a fault, so that its family has a series
        "sm_clock_hertz": 1.98e9,
        "throttle_reasons": 0,
        "temperature_celsius": 45,
        "power_watts": 350.5,
        "energy_joules": 1.25e6,
        "xid_errors": 0,
        "last_xid": 0,
        "ecc_uncorrected_errors": 0,
        "row_remap_pending": 0,
        "row_remap_failure": 0,
    }
    assert client.post("/v1/ingest", json=gpu_rank).status_code == 200
    working = copy.deepcopy(app_tests.BATCH_V2)  # rows with their work: samples, tokens
    working["agent"] = {**working["agent"], "rank": 2, "local_rank": 0, "incarnation": "c1"}
    working["steps"] = [[*row, 32, 32 * 512] for row in working["steps"]]
    assert client.post("/v1/ingest", json=working).status_code == 200
    assert client.post("/v1/ingest", content=b"{not json").status_code == 400  # a rejection

    by_family = {m.family: m for m in CATALOG}
    shown = set()
    for family in text_string_to_metric_families(client.get("/metrics").text):
        spec = by_family.get(family.name)
        assert spec is not None, f"{family.name} is emitted but not in syncscope/catalog.py"
        assert family.type == ("gauge" if spec.type == "info" else spec.type), spec
        assert family.documentation == spec.help
        for sample in family.samples:
            assert set(sample.labels) - {"le"} == set(spec.labels), (spec.name, sample)
        if family.samples:
            shown.add(spec.name)
    expected = {m.name for m in CATALOG if m.condition in SHOWN}
    assert expected - shown == set()
