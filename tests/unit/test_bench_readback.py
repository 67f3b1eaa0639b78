"""bench/bench_readback.py at a tiny size on a real Prometheus: one node's read cycle after
aa1b01e returns fewer series than the seven unmatched queries of before, few for its 8 ranks,
and names the planted straggler; the load phases run. The rules' straggler window is 20 s and
the engine scrapes and evaluates every 5 s (shipped: 5 min and 15 s) so that the lead comes
within a minute."""

from __future__ import annotations

import importlib.util
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest
from syncscope.exporter.jobwide import Interest, cycle_queries

BENCH = Path(__file__).resolve().parents[2] / "bench"
# The bench's own modules, loaded by name: bench_readback imports bench_scale and scale_engines.
MODULES = ("scale_engines", "bench_scale", "bench_readback")


def load(name: str) -> ModuleType:
    """bench/<name>.py as module `name`, in sys.modules (bench/ is not on sys.path here)."""
    spec = importlib.util.spec_from_file_location(name, BENCH / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def bench() -> Iterator[ModuleType]:
    try:
        for name in MODULES:
            module = load(name)
        yield module
    finally:
        for name in MODULES:
            sys.modules.pop(name, None)


@pytest.mark.slow
@pytest.mark.timeout(420)
@pytest.mark.skipif(
    shutil.which("prometheus") is None,
    reason="prometheus is not installed (scripts/setup installs it)",
)
def test_a_nodes_read_cycle_is_smaller_than_before_and_names_the_straggler(bench, tmp_path):
    args = bench.parse_args(
        [
            "--nodes=16",
            "--straggler-window=20s",
            "--engine-interval=5s",
            "--readers=4",
            "--cycles=2",
            "--before-readers=2",
            "--before-cycles=2",
            "--idle-s=2",
            "--per-query=3",
            "--wait-timeout=240",
        ]
    )
    out = bench.run(args)
    one = out["one_cycle"]
    before, after = one["before"], one["after"]
    assert before["ok"] and after["ok"]
    assert before["queries"] == 7 and after["queries"] <= 4
    # every rank's lead (128) and every node's link before; the node's 8 ranks, the job's
    # series, the slowest link and the world group's least blocked member after
    assert after["series"] < before["series"]
    assert after["series"] <= 200
    assert after["bytes"] < before["bytes"]
    assert one["straggler_named"] == one["straggler_planted"] == out["job"]["straggler"]
    assert one["local_leads"] == list(range(8))
    assert out["interest"]["nodes"] == ["node0000"]
    # 128 ranks are too many to list: the world group is asked for by label and lowest rank
    assert out["interest"]["large"] == [("default_pg", 0)]
    # ... and the rules name its least blocked member: the straggler
    assert one["hops"] == {"default_pg": {0: out["job"]["straggler"]}}
    for side in ("after_load", "before_load"):
        assert out[side]["failed"] == 0 and out[side]["cycles"] == out[side]["readers"] * 2
    # each query of the cycle timed: the hop query's text does not list the group's ranks
    first = cycle_queries({"j": Interest(frozenset({"n"}))})
    assert set(out["per_query"]) == {*first, "hop"}
    assert out["per_query"]["hop"]["chars"] < 200, out["per_query"]["hop"]
    assert all(q["chars"] > 0 and q["wall_s"] > 0 for q in out["per_query"].values())
    assert out["projection"]["after"]["series_per_s"] == pytest.approx(
        12_500 / 15 * after["series"]
    )
