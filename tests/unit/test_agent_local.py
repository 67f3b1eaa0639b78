"""What a rank keeps of each flush: the record file, the local arrival estimate, and pacing's use
of its DDP transfer baseline."""

from __future__ import annotations

import json
import random

import pytest
from syncscope.agent.local_arrival import MAX_MEMO_KEYS, LocalArrival
from syncscope.agent.pacing import PacingConfig, PacingController
from syncscope.agent.phases import COMM_END, FWD_POST, STEP_END
from syncscope.agent.recording import RecordWriter
from syncscope.agent.step_pacing import StepPacer

from syncscope.wire import DDP_GRAD_SYNC, PHASES

MS = 1_000_000  # ns


def read_lines(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


# -- the record file ------------------------------------------------------------------------------
def test_record_lines_carry_every_field_in_seconds(tmp_path):
    writer = RecordWriter(str(tmp_path / "r{rank}.jsonl"), {"rank": 3, "world_size": 8})
    offset = 1_700_000_000 * 10**9
    rows = [
        (7, 5_000 * MS, 20 * MS, 1 * MS, 2 * MS, 3 * MS, 4 * MS, 5 * MS, 0),
        (8, 5_030 * MS, 30 * MS, 0, 0, 0, 0, 0, 30 * MS),
    ]
    writer.write(rows, {7: 0.004}, offset)
    writer.close()
    first, second = read_lines(tmp_path / "r3.jsonl")
    assert first == {
        "rank": 3,
        "world_size": 8,
        "step": 7,
        "step_s": 0.020,
        "phases": dict(zip(PHASES, (0.001, 0.002, 0.003, 0.004, 0.005, 0.0, 0.005), strict=True)),
        "wait_s": 0.004,
        "end_unix_s": 1_700_000_005.0,
    }
    assert list(first["phases"]) == list(PHASES)  # wire order, `other` last
    assert second["wait_s"] == 0.0  # a step without collectives waited for no one
    assert second["phases"]["pacing"] == 0.030 and second["phases"]["other"] == 0.0


def test_record_file_appends_and_ignores_writes_after_close(tmp_path):
    path = tmp_path / "r.jsonl"
    row = (0, 0, 10 * MS, 0, 0, 0, 0, 0, 0)
    for _ in range(2):  # two incarnations of the rank: the file grows
        writer = RecordWriter(str(path), {"rank": 0, "world_size": 1})
        writer.write([row], {}, 0)
        writer.close()
    writer.write([row], {}, 0)  # a flush that outlived close()
    writer.close()
    assert len(read_lines(path)) == 2


# -- the local arrival estimate -------------------------------------------------------------------
def coll(op: str, dur_ms: float, step: int, group: str = "g", nbytes: int = 1 << 20) -> tuple:
    return (op, group, nbytes, int(dur_ms * MS), step)


def test_waits_are_summed_per_step_and_the_ddp_baseline_is_its_transfer():
    arrival = LocalArrival()
    # Step 0 holds the fastest call of each key (its baseline); later steps wait beyond it.
    waits = arrival.observe(
        [
            coll(DDP_GRAD_SYNC, 3, 0),
            coll("all_reduce", 1, 0),
            coll(DDP_GRAD_SYNC, 5, 1),
            coll("all_reduce", 4, 1),
            coll(DDP_GRAD_SYNC, 3.5, 2),
        ]
    )
    assert waits == pytest.approx({0: 0.0, 1: 0.002 + 0.003, 2: 0.0005})
    assert arrival.ddp_baseline_s == pytest.approx(0.003)  # the sync key's baseline
    assert arrival.baselines_text() == pytest.approx(
        {f"{DDP_GRAD_SYNC}|g|20": 0.003, "all_reduce|g|20": 0.001}
    )


def test_the_exporters_baselines_replace_the_ranks_own_and_junk_is_ignored():
    arrival = LocalArrival()
    arrival.observe([coll(DDP_GRAD_SYNC, 3, 0)])  # alone, this rank thinks 3 ms is transfer
    reply = {
        "baselines": {
            f"{DDP_GRAD_SYNC}|g|20": 0.001,  # a peer that never waits: the real transfer
            "all_reduce|g|20": "fast",  # not a number
            "no-separators": 0.5,  # not a key
        }
    }
    arrival.merge_reply(json.dumps(reply).encode())
    assert arrival.ddp_baseline_s == pytest.approx(0.001)
    # ...and the node-wide baseline now sets this rank's waits too
    assert arrival.observe([coll(DDP_GRAD_SYNC, 3, 1)]) == pytest.approx({1: 0.002})
    # The exporter's latest answer is the transfer, also above this rank's own smallest call:
    # that minimum is the low tail of the transfer, not its typical value.
    arrival.merge_reply(json.dumps({"baselines": {f"{DDP_GRAD_SYNC}|g|20": 0.004}}).encode())
    assert arrival.ddp_baseline_s == pytest.approx(0.004)
    assert arrival.observe([coll(DDP_GRAD_SYNC, 5, 2)]) == pytest.approx({2: 0.001})
    assert arrival.ddp_baseline_s == pytest.approx(0.004)
    arrival.merge_reply(b'{"accepted": true}')  # nothing to merge
    assert set(arrival.baselines_text()) == {f"{DDP_GRAD_SYNC}|g|20"}


def test_drained_hands_the_waits_to_the_record_file(tmp_path):
    record = RecordWriter(str(tmp_path / "r.jsonl"), {"rank": 0, "world_size": 2})
    arrival = LocalArrival(record)
    steps = [(s, s * 20 * MS, 20 * MS, 0, 0, 0, 0, 0, 0) for s in range(2)]
    arrival.drained(steps, [coll(DDP_GRAD_SYNC, 2, 0), coll(DDP_GRAD_SYNC, 7, 1)], 0)
    record.close()
    assert [r["wait_s"] for r in read_lines(tmp_path / "r.jsonl")] == pytest.approx([0.0, 0.005])


def test_the_key_memo_stays_bounded():
    arrival = LocalArrival()
    arrival.observe([coll("all_reduce", 1, 0, nbytes=n) for n in range(MAX_MEMO_KEYS + 2)])
    arrival.observe([coll("all_reduce", 1, 1)])
    assert len(arrival._keys) == 1  # cleared once past the bound, then refilled


# -- pacing's use of the baseline -----------------------------------------------------------------
class Baseline:
    ddp_baseline_s = 0.0
    first_baseline_s = 0.0


def engaged_pacer(baseline: Baseline, kill_file: str | None = None) -> StepPacer:
    return StepPacer(PacingController(PacingConfig(min_samples=4)), baseline, kill_file)


def test_nothing_is_fed_until_a_baseline_is_known():
    baseline = Baseline()
    pacer = engaged_pacer(baseline)
    assert all(pacer.pace(40 * MS, 100 * MS) == 0 for _ in range(20))
    baseline.ddp_baseline_s = 0.010
    # Had those 20 steps been fed, 4 samples would be in and the first of these would delay.
    assert [pacer.pace(40 * MS, 100 * MS) for _ in range(3)] == [0, 0, 0]
    assert pacer.pace(40 * MS, 100 * MS) > 0


def test_the_wait_fed_is_the_exposed_sync_less_the_baseline():
    baseline = Baseline()
    baseline.ddp_baseline_s = 0.010
    pacer = engaged_pacer(baseline)
    reference = PacingController(PacingConfig(min_samples=4))
    for _ in range(30):
        delay_ns = pacer.pace(40 * MS, 100 * MS)
        assert delay_ns == int(reference.update(0.030, 0.100) * 1e9)
    assert delay_ns > 0 and pacer.controller.active
    assert pacer.pace(5 * MS, 100 * MS) == int(reference.update(0.0, 0.100) * 1e9)  # clipped at 0


def test_the_kill_file_switches_pacing_off_for_good(tmp_path):
    kill = tmp_path / "stop-pacing"
    baseline = Baseline()
    baseline.ddp_baseline_s = 0.010
    pacer = engaged_pacer(baseline, str(kill))
    delays = [pacer.pace(40 * MS, 100 * MS) for _ in range(30)]
    assert delays[-1] > 0
    kill.touch()
    assert pacer.pace(40 * MS, 100 * MS) == 0 and not pacer.controller.enabled
    kill.unlink()
    assert pacer.pace(40 * MS, 100 * MS) == 0  # stays off after the file is gone
    assert pacer.controller.state().enabled is False


def test_on_the_gpu_path_a_second_process_group_switches_pacing_off_for_good(caplog):
    """The CUDA clock gives only a step's exposed communication (no first wait). Engaged on
    one group; once the rank's collectives use a second (a tensor-parallel pair, say), a delay
    could hold up a peer there: off, with a warning, and it stays off."""
    baseline = Baseline()
    baseline.ddp_baseline_s = 0.010
    groups = [1]
    pacer = StepPacer(
        PacingController(PacingConfig(min_samples=4)), baseline, None, lambda: groups[0]
    )
    delays = [pacer.pace(40 * MS, 100 * MS) for _ in range(30)]
    assert delays[-1] > 0 and pacer.controller.active
    groups[0] = 2
    assert pacer.pace(40 * MS, 100 * MS) == 0 and not pacer.controller.enabled
    assert "2 process groups" in caplog.text
    groups[0] = 1
    assert pacer.pace(40 * MS, 100 * MS) == 0


@pytest.mark.parametrize("at", [COMM_END, FWD_POST])
def test_the_cpu_path_feeds_the_steps_first_wait_less_its_own_transfer(at):
    """On the CPU clock the signal is the step's first wait: DDP's sync (less DDP's baseline)
    or another collective's, here in forward (less the baseline of the one steps complete
    first). A second group changes nothing there; a step without any wait feeds nothing."""
    baseline = Baseline()
    baseline.ddp_baseline_s, baseline.first_baseline_s = 0.010, 0.004
    pacer = StepPacer(PacingController(PacingConfig(min_samples=4)), baseline, None, lambda: 3)
    reference = PacingController(PacingConfig(min_samples=4))
    expected_wait = 0.024 if at == COMM_END else 0.030
    for _ in range(30):  # 40 ms of exposed communication in all, 34 of them the first wait
        delay_ns = pacer.pace(40 * MS, 100 * MS, 34 * MS, at)
        assert abs(delay_ns - reference.update(expected_wait, 0.100) * 1e9) <= 1  # ns rounding
    assert delay_ns > 0 and pacer.controller.enabled and pacer.controller.active
    total = pacer.controller.total_delay_s  # grows with every delay the controller returns
    assert pacer.pace(40 * MS, 100 * MS, -1, at) == delay_ns  # not fed: the delay is held
    assert pacer.controller.total_delay_s == total
    baseline.first_baseline_s = baseline.ddp_baseline_s = 0.0  # not known: nothing fed
    assert pacer.pace(40 * MS, 100 * MS, 34 * MS, at) == 0
    assert pacer.controller.total_delay_s == total


def test_a_first_wait_at_an_unusual_point_of_the_step_is_not_fed():
    """A logging all-reduce every 10th step after the optimizer is those steps' first wait,
    with no slack. Fed, those near-zero waits inflate the noise estimate: on the tensor x FSDP2
    job (a stop flag's broadcast every 10th step) a 28 ms lead sat under a 32 ms threshold for
    hundreds of steps. Only first waits at the usual point of the step are fed; the others
    hold the delay as it was. After a change of habit, the new point is the usual one."""
    rng = random.Random(0)
    baseline = Baseline()
    baseline.ddp_baseline_s = baseline.first_baseline_s = 0.002
    pacer = StepPacer(PacingController(PacingConfig(world_size=4)), baseline)
    reference = PacingController(PacingConfig(world_size=4))  # fed the usual steps only
    for step in range(200):
        if step % 10 == 9:
            held = pacer.pace(35 * MS, 70 * MS, 0, STEP_END)
            assert abs(held - reference.current_delay_s * 1e9) <= 1e3
            continue
        wait = rng.gauss(0.028, 0.002)
        delay = pacer.pace(35 * MS, 70 * MS, int((wait + 0.002) * 1e9), COMM_END)
        assert abs(delay - reference.update(wait, 0.070) * 1e9) <= 1e3  # ns rounding
    assert pacer.controller.active and delay > 0.010 * 1e9
    # From now on every first wait comes in forward: fed once it is the majority of 32 steps.
    fed = [pacer.pace(35 * MS, 70 * MS, 30 * MS, FWD_POST) for _ in range(32)]
    total = pacer.controller.total_delay_s
    assert pacer.pace(35 * MS, 70 * MS, 30 * MS, FWD_POST) >= 0
    assert pacer.controller.total_delay_s > total, fed  # fed again


def test_the_collective_steps_complete_first_sets_the_first_baseline():
    arrival = LocalArrival()
    arrival.observe(
        [
            coll("all_gather", 3, 0, group="dp"),
            coll("all_reduce", 1, 0, group="tp"),
            coll(DDP_GRAD_SYNC, 2, 0),
            coll("all_gather", 5, 1, group="dp"),
            coll("all_reduce", 1, 1, group="tp"),
            coll("all_reduce", 2, 2, group="tp"),  # a step whose all-gather was not drained
        ]
    )
    assert arrival.first_baseline_s == pytest.approx(0.003)  # dp's all-gather, first in 2 of 3
    assert arrival.ddp_baseline_s == pytest.approx(0.002)
    reply = {"baselines": {"all_gather|dp|20": 0.0045, "all_reduce|tp|20": 0.0002}}
    arrival.merge_reply(json.dumps(reply).encode())
    assert arrival.first_baseline_s == pytest.approx(0.0045)  # the node's, for that key


def test_group_labels_count_groups_by_their_ranks():
    """Two handles on the same ranks are one group (DDP on the default group and a broadcast
    on it); a sub-group is another; one with unknown ranks counts by its label."""
    from syncscope.agent.collectives import GroupLabels

    labels = GroupLabels()

    class Group:
        def __init__(self, name: str, ranks: list[int]) -> None:
            self.group_name, self.group_desc, self.ranks = name, "", ranks

    import syncscope.agent.collectives as coll

    original = coll._members
    coll._members = lambda group: tuple(group.ranks)
    groups = [Group("0", [0, 1, 2, 3]), Group("1", [0, 1, 2, 3]), Group("mesh_tp", [0, 1])]
    groups.append(Group("mesh_pp", []))  # alive together: labels are kept by the group's id
    try:
        labels(groups[0])
        labels(groups[1])
        assert labels.group_count() == 1
        labels(groups[2])
        assert labels.group_count() == 2
        labels(groups[3])
        assert labels.group_count() == 3
    finally:
        coll._members = original


def test_a_group_too_large_to_list_is_reported_by_its_lowest_rank():
    """A group's ranks go in a topology fact while they fit a topology value; a larger group
    (a data-parallel group across thousands of nodes) by its lowest rank, which with its label
    names it for the job-wide rules (recorded.GROUP_NEXT_HOP)."""
    from syncscope.agent.collectives import GroupLabels

    from syncscope.wire import MAX_TOPOLOGY_TEXT, group_first, group_ranks

    labels = GroupLabels()
    labels.members = {"tp": (8, 9), "dp": tuple(range(3, 8 * 1000, 8))}
    facts = labels.facts()
    assert len(",".join(map(str, labels.members["dp"]))) > MAX_TOPOLOGY_TEXT
    assert facts == {"group.tp": "8,9", "group_first.dp": "3"}
    assert group_ranks(facts, "tp") == (8, 9) and group_first(facts, "tp") == 8
    assert group_ranks(facts, "dp") == () and group_first(facts, "dp") == 3
    assert group_first(facts, "pp") is None
