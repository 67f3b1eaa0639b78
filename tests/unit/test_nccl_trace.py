"""Flight Recorder reader on CPU: a constructed NCCL dump (tests/fixtures/gpu), a real gloo dump
from torch on this machine (same entry schema, no durations), de-duplication, bounds, fallback."""

from __future__ import annotations

import copy
import json
import logging
import math
import os
import pickle
import tempfile
import time
from collections import Counter, deque
from pathlib import Path
from types import SimpleNamespace

import pytest
from syncscope.agent.local_arrival import LocalArrival
from syncscope.agent.nccl_trace import (
    BUFFER_SIZE_ENV,
    ENABLE_TIMING_ENV,
    LEGACY_BUFFER_SIZE_ENV,
    FlightRecorderReader,
    StepTimeline,
    check_timing_at_attach,
    dump_every_steps,
    entry_bytes,
    op_label,
)

from tests.conftest import make_reporter
from tests.fixtures.gpu import load_fr_dump

T0 = 1_795_357_313_000_000_000  # the constructed dump's clock (CLOCK_REALTIME ns)


def dump_bytes(dump: dict) -> bytes:
    return pickle.dumps(dump)


def reader_for(dump: dict, sink: deque | None = None, **kw) -> FlightRecorderReader:
    box = {"dump": dump}
    reader = FlightRecorderReader(
        sink if sink is not None else deque(maxlen=1000),
        dump=lambda: dump_bytes(box["dump"]),
        **kw,
    )
    reader.box = box  # type: ignore[attr-defined]
    return reader


def completed(entry: dict, duration_ms: float) -> dict:
    entry = dict(entry, state="completed", duration_ms=duration_ms)
    entry["time_discovered_completed_ns"] = entry["time_created_ns"] + 1_000_000
    return entry


# -- parsing the documented fields ----------------------------------------------------------------
def test_constructed_dump_becomes_gloo_shaped_records():
    timeline = StepTimeline()
    timeline.mark(0, T0 + 10_000_000)  # step 0 ends after records 0..3
    timeline.mark(1, T0 + 20_000_000)  # step 1 ends after records 4..6
    reader = reader_for(load_fr_dump(), timeline=timeline, current_step=lambda: 2)
    assert reader.poll() == 7
    records = list(reader.sink)
    assert records[0] == ("broadcast", "default_pg", 1024 * 1024 * 2.0, 412_000, 0)
    assert records[1] == ("all_reduce", "default_pg", 6553600 * 2.0, 2_050_000, 0)
    assert records[3][:3] == ("all_reduce", "default_pg", 3276800 * 2.0)
    # all-gather sized by what the rank ends up with (the gathered output), as on gloo
    assert records[4] == ("all_gather", "default_pg", 8192 * 4.0, 51_000, 1)
    # record 6 is still scheduled; 7 completed after it (out of order) and is not held back
    assert records[5][0] == "all_reduce" and records[5][3] == 1_970_000 and records[5][4] == 2
    # record 8: a coalesced reduce-scatter on a group without a description, sized by input
    assert records[6] == ("reduce_scatter", "pg1", 2 * 4096 * 4.0, 300_000, 2)
    assert reader.stats["p2p_skipped"] == 1  # the send
    assert reader.stats["no_duration"] == 0
    assert reader.floor == 6  # the lowest id still running: later dumps look from there


def test_op_names_are_normalised_to_the_gloo_labels():
    dump = load_fr_dump()
    dump["entries"] = [completed(e, 0.1) for e in dump["entries"]]
    reader = reader_for(dump)
    reader.poll()
    by_op = {(r[0], r[1]) for r in reader.sink}
    assert ("reduce_scatter", "pg1") in by_op
    assert ("all_reduce", "default_pg") in by_op
    assert op_label("nccl:recv 1<-0") is None
    assert op_label("nccl:ALLGATHER_coalesced") == "all_gather"
    assert op_label("nccl:all_reduce_barrier") == "barrier"
    assert op_label("nccl:gather") == "other"


def test_entry_bytes_by_dtype():
    e = {"input_sizes": [[2, 3], [4]], "input_dtypes": ["BFloat16", "Double"]}
    assert entry_bytes(e, "all_reduce") == 2 * 3 * 2 + 4 * 8
    assert entry_bytes({"input_sizes": [[]], "input_dtypes": ["Float"]}, "all_reduce") == 4
    assert entry_bytes({"input_sizes": [], "input_dtypes": []}, "barrier") == 0


# -- de-duplication and bounds ---------------------------------------------------------------------
def test_each_record_id_is_reported_once_across_dumps():
    dump = load_fr_dump()
    reader = reader_for(dump)
    assert reader.poll() == 7
    assert reader.poll() == 0  # same dump again: nothing new
    later = copy.deepcopy(dump)
    later["entries"][6] = completed(later["entries"][6], 3.5)  # the pending one finished
    later["entries"][9] = completed(later["entries"][9], 0.02)
    nxt = later["entries"][9]["record_id"] + 1
    later["entries"].append(
        completed(dict(later["entries"][1], record_id=nxt, time_created_ns=T0 + 40_000_000), 1.1)
    )
    reader.box["dump"] = later
    assert reader.poll() == 3  # 6, 9 and the new one; never 0..5, 7 or 8 again
    assert reader.poll() == 0
    durations = sorted(r[3] for r in reader.sink)
    assert len(durations) == 10 == len(set(range(11)) - {5})  # 11 entries, one p2p
    assert reader.floor == nxt + 1 and reader.done == set()


def test_stopping_for_good_reads_what_completed_since_the_last_dump():
    dump = load_fr_dump()
    reader = reader_for(dump)
    reader.start()
    reader.stop()  # the thread ends without a dump: no step end asked for one
    assert len(reader.sink) == 0 and reader.stats["dumps"] == 0
    reader = reader_for(dump)
    reader.start()
    reader.stop(final=True)  # the agent's close: the entries since the last dump are read
    assert len(reader.sink) == 7 and reader.stats["dumps"] == 1


def test_the_ring_buffer_moving_on_keeps_memory_bounded():
    base = load_fr_dump()["entries"][1]
    reader = reader_for({"entries": []}, sink=deque(maxlen=100_000))
    pending = dict(base, record_id=0, state="started")
    for start in range(1, 5001, 500):  # a ring of 500 entries sliding past a stuck entry
        window = [completed(dict(base, record_id=i), 1.0) for i in range(start, start + 500)]
        reader.box["dump"] = {"entries": [pending, *window] if start == 1 else window}
        reader.poll()
        assert len(reader.done) <= 500
    assert reader.stats["records"] == 5000


def test_a_flight_recorder_reset_is_detected():
    base = load_fr_dump()["entries"][1]
    reader = reader_for({"entries": [completed(dict(base, record_id=i), 1.0) for i in range(50)]})
    assert reader.poll() == 50
    reader.box["dump"] = {"entries": [completed(dict(base, record_id=i), 1.0) for i in range(3)]}
    assert reader.poll() == 3
    assert reader.stats["resets"] == 1


def test_records_per_dump_are_capped_and_overflow_is_counted():
    base = load_fr_dump()["entries"][1]
    entries = [
        completed(dict(base, record_id=i, duration_ms=float(i)), float(i)) for i in range(10)
    ]
    reader = reader_for({"entries": entries}, max_records_per_poll=3)
    assert reader.poll() == 3
    assert [r[3] for r in reader.sink] == [7_000_000, 8_000_000, 9_000_000]  # the newest
    assert reader.stats["dropped"] == 7
    small = reader_for({"entries": entries}, sink=deque(maxlen=4))
    small.poll()
    assert small.stats["dropped"] == 6 and len(small.sink) == 4
    assert [r[3] for r in small.sink] == [0, 1_000_000, 2_000_000, 3_000_000]  # tail drop


def test_the_dump_period_is_a_power_of_two_of_steps_within_budget():
    # 45 ms dumps, 0.1 % budget -> 45 s between dumps; 100 ms steps -> 450 -> 512 steps
    assert dump_every_steps(0.045, 0.1, 0.001, 5.0, 120.0) == 512
    # ranks of one job: same step time; dump costs 40 and 45 ms -> the same period. At 55 ms
    # a rank doubles it: every dump of that rank still falls on a step the others dump at too.
    assert dump_every_steps(0.040, 0.1, 0.001, 5.0, 120.0) == 512
    assert dump_every_steps(0.055, 0.1, 0.001, 5.0, 120.0) == 1024
    # cheap dumps on slow steps: never more often than min_interval_s (5 s / 2 s -> 4 steps)
    assert dump_every_steps(0.001, 2.0, 0.001, 5.0, 120.0) == 4
    assert dump_every_steps(0.045, 0.0, 0.001, 5.0, 120.0) == 1  # no step time yet


def test_dumps_happen_only_right_after_the_agreed_steps():
    timeline = StepTimeline(dump_every=4)
    now = {"step": 0}
    dumped_at: list[int] = []

    def dump() -> bytes:
        dumped_at.append(now["step"])
        return dump_bytes(load_fr_dump())

    reader = FlightRecorderReader(
        deque(maxlen=1000),
        dump=dump,
        timeline=timeline,
        current_step=lambda: now["step"],
        thread_guard=lambda: True,
    )
    reader.reschedule = lambda: None  # keep the period at 4 for the test
    reader.start()
    for step in range(12):
        timeline.mark(step)
        now["step"] = step + 1
        deadline = time.monotonic() + 2
        while (step + 1) % 4 == 0 and len(dumped_at) < (step + 1) // 4:
            assert time.monotonic() < deadline, "no dump after an agreed step"
            time.sleep(0.001)
        time.sleep(0.005)  # between agreed steps: room for an unwanted dump to show
    reader.stop()
    assert dumped_at == [4, 8, 12]  # right after steps 3, 7 and 11 ended, nowhere else
    assert reader.stats["records"] == 7


def test_the_period_adapts_to_the_measured_cost_and_step_time():
    timeline = StepTimeline()
    for step in range(10):
        timeline.mark(step, T0 + step * 100_000_000)  # 100 ms steps
    reader = reader_for({"entries": []}, timeline=timeline, budget=0.001)
    reader.stats["last_dump_seconds"] = 0.045
    reader.reschedule()
    assert timeline.step_seconds() == pytest.approx(0.1)
    assert timeline.dump_every == 512


def test_the_dump_thread_leaves_global_capture_mode_before_its_first_dump():
    order: list[str] = []
    timeline = StepTimeline(dump_every=1)

    def dump() -> bytes:
        order.append("dump")
        return dump_bytes({"entries": []})

    reader = FlightRecorderReader(
        deque(), dump=dump, timeline=timeline, thread_guard=lambda: order.append("guard")
    )
    reader.start()
    timeline.mark(0)
    deadline = time.monotonic() + 2
    while "dump" not in order and time.monotonic() < deadline:
        time.sleep(0.005)
    reader.stop()
    assert order[:2] == ["guard", "dump"]


# -- timing off: warn once, fall back --------------------------------------------------------------
def without_durations(dump: dict) -> dict:
    dump = copy.deepcopy(dump)
    for e in dump["entries"]:
        e.pop("duration_ms", None)
    return dump


@pytest.mark.parametrize("attached_after_group", [False, True])
def test_no_durations_falls_back_with_one_warning(caplog, attached_after_group):
    reader = reader_for(
        without_durations(load_fr_dump()), attached_after_group=attached_after_group
    )
    with caplog.at_level(logging.INFO, logger="syncscope.agent"):
        for _ in range(reader.PROBE_DUMPS):
            # every probe needs fresh completed entries: shift the ids each time
            reader.box["dump"]["entries"] = [
                dict(e, record_id=e["record_id"] + 100) for e in reader.box["dump"]["entries"]
            ]
            reader.poll()
    assert not reader.active and ENABLE_TIMING_ENV in reader.fallback_reason
    warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
    # attach() already warned when it could tell; otherwise the reader's warning is the one
    assert len(warnings) == (0 if attached_after_group else 1)
    assert reader.poll() == 0  # stays off: no more dumps holding the GIL


def fake_torch(initialized: bool, backend: str = "nccl") -> SimpleNamespace:
    dist = SimpleNamespace(
        is_available=lambda: True,
        is_initialized=lambda: initialized,
        get_backend=lambda: backend,
    )
    return SimpleNamespace(distributed=dist)


def test_attach_before_the_group_turns_timing_on():
    env: dict[str, str] = {}
    assert check_timing_at_attach(fake_torch(False), env) == (False, True)
    assert env[ENABLE_TIMING_ENV] == "1"
    env = {ENABLE_TIMING_ENV: "0"}  # the user said no: respected
    check_timing_at_attach(fake_torch(False), env)
    assert env[ENABLE_TIMING_ENV] == "0"


def test_attach_after_an_untimed_nccl_group_warns_once(caplog):
    with caplog.at_level(logging.WARNING, logger="syncscope.agent"):
        assert check_timing_at_attach(fake_torch(True), {}) == (True, False)
        assert check_timing_at_attach(fake_torch(True), {ENABLE_TIMING_ENV: "1"}) == (True, True)
        assert check_timing_at_attach(fake_torch(True, "gloo"), {}) == (False, True)
    assert len(caplog.records) == 1
    assert "after the NCCL process group was created" in caplog.text
    assert f"{ENABLE_TIMING_ENV}=1" in caplog.text


# -- steps ----------------------------------------------------------------------------------------
def test_timeline_places_entries_in_their_step():
    t = StepTimeline(maxlen=3)
    assert t.step_at(5, current=7) == 7  # nothing marked yet: the step in progress
    for step, end in enumerate((100, 200, 300, 400)):
        t.mark(step, end)
    assert t.step_at(250, current=9) == 2
    assert t.step_at(300, current=9) == 2  # created exactly at a step end: that step
    assert t.step_at(450, current=4) == 4
    assert t.step_at(50, current=9) == 1  # older than the kept window: the oldest kept


def test_records_feed_the_same_estimator_as_the_gloo_path(tmp_path):
    colls: deque = deque(maxlen=1000)
    reader_for(load_fr_dump(), sink=colls).poll()
    arrival = LocalArrival()
    reporter = make_reporter(
        None, deque(), colls, identity={"rank": 0, "world_size": 2}, on_drained=arrival.drained
    )
    reporter.flush()
    assert not colls
    baselines = arrival.baselines_text()
    # the two 13 MB buckets share a key; the rolling minimum of 2.05 ms and 1.31 ms, 1.97 ms
    assert baselines["all_reduce|default_pg|23"] == pytest.approx(1.31e-3)
    assert "broadcast|default_pg|21" in baselines


# -- a real Flight Recorder dump from this machine's torch (gloo: same schema, no durations) -------
@pytest.fixture
def gloo_dump():
    torch = pytest.importorskip("torch")
    import torch.distributed as dist

    c10d = torch._C._distributed_c10d
    if not hasattr(c10d, "_dump_fr_trace"):
        pytest.skip("this torch has no generic Flight Recorder dump")
    if dist.is_initialized():
        pytest.skip("a process group already exists in this process")
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    store = tempfile.mktemp(prefix="syncscope-fr-")
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    try:
        t = torch.ones(1024, dtype=torch.bfloat16)
        dist.all_reduce(t)
        dist.broadcast(t, 0)
        dist.all_gather([torch.zeros(4)], torch.ones(4))
        dist.barrier()
        yield c10d._dump_fr_trace(
            includeCollectives=True, includeStackTraces=False, onlyActive=False
        )
    finally:
        dist.destroy_process_group()


def test_a_real_dump_parses_and_untimed_entries_are_not_reported(gloo_dump):
    reader = FlightRecorderReader(deque(maxlen=100), dump=lambda: gloo_dump)
    assert reader.poll() == 0  # gloo entries stay "scheduled": no completion, no duration
    assert reader.stats["entries_seen"] >= 4 and reader.stats["errors"] == 0
    # the same real entries, as NCCL with timing would report them once complete
    entries = pickle.loads(gloo_dump)["entries"]
    timed = [completed(e, 0.5) for e in entries]
    # (the ring buffer holds up to 2000 entries of this process, earlier tests' included)
    sink: deque = deque(maxlen=len(entries))
    reader = FlightRecorderReader(sink, dump=lambda: pickle.dumps({"entries": timed}))
    assert reader.poll() == len(entries)
    # The ring buffer is process-wide: earlier tests' groups may have left entries before ours.
    ops = [(r[0], r[1], r[2]) for r in reader.sink][-4:]
    assert ops[:3] == [
        ("all_reduce", "default_pg", 2048.0),
        ("broadcast", "default_pg", 2048.0),
        ("all_gather", "default_pg", 16.0),
    ]
    assert ops[3][0] == "barrier"


def test_the_default_dump_on_a_cpu_build_turns_the_reader_off_quietly():
    pytest.importorskip("torch")
    import torch

    if hasattr(torch._C._distributed_c10d, "_dump_nccl_trace"):
        pytest.skip("this torch has NCCL")
    reader = FlightRecorderReader(deque())
    assert reader.poll() == 0 and reader.stats["errors"] == 0  # no NCCL group: not even tried
    reader = FlightRecorderReader(deque(), ready=lambda: True)
    for _ in range(3):
        assert reader.poll() == 0
    assert not reader.active and reader.stats["errors"] == 3


def test_no_dumps_before_the_nccl_group_exists():
    calls = []
    reader = FlightRecorderReader(deque(), dump=lambda: calls.append(1) or b"", ready=lambda: False)
    for _ in range(5):
        assert reader.poll() == 0
    assert calls == [] and reader.active and reader.stats["errors"] == 0


# -- the captured H100 dumps (tests/fixtures/gpu/captured-h100, torch 2.11, NCCL 2.28) ----------
CAPTURED = Path(__file__).resolve().parents[1] / "fixtures" / "gpu" / "captured-h100"
# Written out here, not taken from the module: profiling name -> op, dtype -> bytes.
OWN_OPS = {
    "all_reduce": "all_reduce",
    "allreduce_coalesced": "all_reduce",
    "broadcast": "broadcast",
    "_all_gather_base": "all_gather",
    "all_gather_into_tensor_coalesced": "all_gather",
    "_reduce_scatter_base": "reduce_scatter",
}
OWN_BYTES = {"Float": 4, "BFloat16": 2}


def own_parse(path: Path) -> Counter:
    """(op, group description, bytes, duration ns) of every timed entry, parsed from the JSON."""
    out: Counter = Counter()
    for e in json.loads(path.read_text())["entries"]:
        if e["state"] != "completed" or e.get("duration_ms") is None:
            continue
        op = OWN_OPS[e["profiling_name"].removeprefix("nccl:")]
        sizes = e["output_sizes"] if op == "all_gather" else e["input_sizes"]
        dtypes = e["output_dtypes"] if op == "all_gather" else e["input_dtypes"]
        nbytes = sum(
            math.prod(shape) * OWN_BYTES[dt] for shape, dt in zip(sizes, dtypes, strict=True)
        )
        out[(op, e["process_group"][1], float(nbytes), round(e["duration_ms"] * 1e6))] += 1
    return out


def test_the_captured_dump_reads_as_an_independent_parse_of_it():
    reader = reader_for(load_fr_dump(CAPTURED / "fr-dump.json"))
    reader.poll()
    ours = Counter((r[0], r[1], r[2], r[3]) for r in reader.sink)
    expected = own_parse(CAPTURED / "fr-dump.json")
    assert sum(expected.values()) == 59
    assert ours == expected
    assert ("all_reduce", "tp", 1_048_576.0) in {k[:3] for k in ours}  # the described subgroup
    assert ("all_reduce", "default_pg", 120.0) in {k[:3] for k in ours}  # coalesced 10 + 20


def test_completed_entries_without_a_duration_yet_are_read_again():
    # right after the GPU finished, 53 entries are completed but not retired: no duration yet
    reader = reader_for(load_fr_dump(CAPTURED / "fr-dump-synced.json"))
    assert reader.poll() == 6
    assert reader.stats["no_duration"] == 0 and reader.active
    reader.box["dump"] = load_fr_dump(CAPTURED / "fr-dump.json")  # the watchdog retired them
    assert reader.poll() == 53
    ours = Counter((r[0], r[1], r[2], r[3]) for r in reader.sink)
    assert ours == own_parse(CAPTURED / "fr-dump.json")  # nothing lost, nothing twice


def test_a_reset_that_refills_past_the_old_newest_is_detected():
    base = load_fr_dump()["entries"][1]

    def entries(n: int, t0: int) -> list[dict]:
        return [
            completed(dict(base, record_id=i, time_created_ns=t0 + i * 1000), 1.0) for i in range(n)
        ]

    reader = reader_for({"entries": entries(50, T0)})
    assert reader.poll() == 50
    reader.box["dump"] = {"entries": entries(80, T0 + 10**12)}  # reset_all, then 80 new calls
    assert reader.poll() == 80
    assert reader.stats["resets"] == 1
    assert reader.poll() == 0 and reader.stats["resets"] == 1  # the same dump again: no reset


def test_an_empty_flight_recorder_falls_back_with_one_warning(caplog):
    reader = reader_for({"entries": []})
    with caplog.at_level(logging.WARNING, logger="syncscope.agent"):
        for _ in range(reader.PROBE_DUMPS + 2):
            reader.poll()
    assert not reader.active and "buffer is 0" in reader.fallback_reason
    assert len(caplog.records) == 1 and BUFFER_SIZE_ENV in caplog.text


def test_attach_before_the_group_keeps_flight_recorder_entries_on_old_torch():
    env: dict[str, str] = {}
    check_timing_at_attach(fake_torch(False), env)
    assert env[BUFFER_SIZE_ENV] == env[LEGACY_BUFFER_SIZE_ENV] == "2000"
    env = {LEGACY_BUFFER_SIZE_ENV: "500"}  # the user's own size: respected
    check_timing_at_attach(fake_torch(False), env)
    assert env == {LEGACY_BUFFER_SIZE_ENV: "500", ENABLE_TIMING_ENV: "1"}


def test_attach_after_the_group_turns_timing_on_for_the_groups_that_exist(caplog):
    enabled: list[str] = []

    class Group:  # hashable, as ProcessGroup is (pg_map's keys)
        def __init__(self, name: str) -> None:
            self.name = name

        def _enable_collectives_timing(self) -> None:
            enabled.append(self.name)

    default, tp = Group("default"), Group("tp")
    torch = fake_torch(True)
    torch.distributed.distributed_c10d = SimpleNamespace(
        _get_default_group=lambda: default, _world=SimpleNamespace(pg_map={default: 0, tp: 1})
    )
    env: dict[str, str] = {}
    with caplog.at_level(logging.WARNING, logger="syncscope.agent"):
        assert check_timing_at_attach(torch, env) == (True, True)
    assert enabled == ["default", "tp"] and caplog.records == []
    assert env[ENABLE_TIMING_ENV] == "1"  # groups created later are timed too


def test_distributed_debug_detail_counts_as_timing_on(caplog):
    with caplog.at_level(logging.WARNING, logger="syncscope.agent"):
        assert check_timing_at_attach(fake_torch(True), {"TORCH_DISTRIBUTED_DEBUG": "DETAIL"}) == (
            True,
            True,
        )
    assert caplog.records == []


def test_an_untyped_coalesced_group_takes_its_members_op_and_bytes():
    # Older torch: the ops inside a coalescing manager are recorded typed and sized but without
    # events (never completed); the group's `nccl:coalesced` entry, unsized, holds the duration.
    base = load_fr_dump()["entries"][1]
    members = [
        dict(
            base,
            record_id=i,
            profiling_name="nccl:all_reduce",
            state="scheduled",
            collective_seq_id=7,
            input_sizes=[[n]],
            input_dtypes=["Float"],
            duration_ms=None,
        )
        for i, n in ((10, 100), (11, 300))
    ]
    group = completed(
        dict(
            base,
            record_id=12,
            profiling_name="nccl:coalesced",
            collective_seq_id=7,
            input_sizes=[],
            input_dtypes=[],
            output_sizes=[],
            output_dtypes=[],
        ),
        0.5,
    )
    after = completed(dict(base, record_id=13, collective_seq_id=8), 0.25)
    reader = reader_for({"entries": [*members, group, after]})
    assert reader.poll() == 2
    first = reader.sink[0]
    assert (first[0], first[2], first[3]) == ("all_reduce", 1600.0, 500_000)
    assert reader.floor == 14  # the members, never completed, do not hold the floor back
