"""Pacing on real 4-rank gloo jobs: it stays off when balanced, paces only early ranks
behind a steady straggler, and its kill file turns it off within one step."""

from __future__ import annotations

import json
import statistics
import time
from typing import Any

import pytest

from tests.conftest import Exporter, Job, by_rank, parse_samples, wait_until

# quiet: the controller judges each step's waits, which a starved core moves (pyproject.toml).
pytestmark = [pytest.mark.slow, pytest.mark.quiet]
SLOW_RANK = 1
WARM_UP = 64  # steps before the exporter's first answer sets the transfer baselines
ENGAGED_AFTER = 32  # steps for the delay to rise to its level (rise 0.25 per step)
PACED_S = 14  # seconds paced before the kill file: the later half of them at the level
AFTER_KILL_S = 5  # and run after it: ~80 steps of ~60 ms


def records(tmp_path, world=4) -> dict[int, list[dict[str, Any]]]:
    out = {}
    for rank in range(world):
        with open(tmp_path / f"rec-{rank}.jsonl") as f:
            lines = [json.loads(line) for line in f]
            out[rank] = [r for r in lines if "event" not in r]  # steps, not the startup
    return out


def early_ranks_paced(exporter, world=4):
    """The per-rank pacing state once all four ranks report it and three are engaged."""
    active = by_rank(parse_samples(exporter.metrics_text(), "syncscope_pacing_active"))
    return active if len(active) == world and sum(active.values()) == world - 1 else None


def test_balanced_job_never_engages(exporter, job_factory, tmp_path):
    job = job_factory(
        4,
        ["--duration", "25", "--pacing"],
        exporter.url,
        SYNCSCOPE_RECORD=str(tmp_path / "rec-{rank}.jsonl"),
    )
    seen = []
    while job.running():
        seen.append(by_rank(parse_samples(exporter.metrics_text(), "syncscope_pacing_active")))
        time.sleep(1)
    job.wait()
    assert any(len(s) == 4 for s in seen), "pacing state never reported"
    assert all(v == 0.0 for s in seen for v in s.values()), seen
    rows = [r for ranks in records(tmp_path).values() for r in ranks]
    total_delay = sum(r["phases"]["pacing"] for r in rows)
    # 4 ranks on 2 shared cores see real transient imbalance from the scheduler; a brief
    # engagement on one is allowed, a throughput cost is not: under 1 % of the run's time.
    assert total_delay <= 0.01 * sum(r["step_s"] for r in rows), total_delay


@pytest.fixture(scope="module")
def straggler_then_kill_file(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """One job, rank SLOW_RANK 30 ms late every step, pacing asked for: every early rank engaged,
    paced for PACED_S, then the kill file, and the job stopped AFTER_KILL_S later (through
    its control folder, however long engaging took). Its ranks' records, the exporter's scrape
    as the file appeared, the pacing state once all early ranks had engaged, and when the file
    appeared."""
    tmp = tmp_path_factory.mktemp("pacing")
    kill, control = tmp / "kill", tmp / "control"
    control.mkdir()
    (control / "slow").touch()  # slowed from the first step
    exporter = Exporter()
    try:
        job = Job(
            4,
            [
                *("--duration", "60", "--control", str(control), "--pacing"),
                *("--slow-rank", str(SLOW_RANK), "--slow-ms", "30"),
            ],
            exporter.url,
            str(tmp),
            SYNCSCOPE_RECORD=str(tmp / "rec-{rank}.jsonl"),
            SYNCSCOPE_PACING_KILL_FILE=str(kill),
        )
        try:
            # every early rank must have engaged before the file appears, or "paced before the
            # kill" below is asserted of a rank that had not yet seen a window of waits (CI run
            # of 160989b: two ranks active, the third not, and its records rightly held no delay)
            active = wait_until(lambda: early_ranks_paced(exporter), timeout=25)
            if active:
                time.sleep(PACED_S)
            text = exporter.metrics_text()
            kill.touch()
            killed_at = time.time()
            time.sleep(AFTER_KILL_S)
            (control / "stop").touch()
            job.wait()
        finally:
            job.kill()
    finally:
        exporter.stop()
    return {
        "active": active,
        "metrics_at_kill": text,
        "killed_at": killed_at,
        "records": records(tmp),
        "kill_file_kept": kill.exists(),
    }


def test_steady_straggler_early_ranks_paced_straggler_never(straggler_then_kill_file):
    run = straggler_then_kill_file
    active = run["active"]
    assert active and active[SLOW_RANK] == 0.0, active
    text = run["metrics_at_kill"]
    delay = by_rank(parse_samples(text, "syncscope_pacing_delay_seconds_total"))
    assert delay[SLOW_RANK] == 0.0
    assert all(delay[r] > 0 for r in range(4) if r != SLOW_RANK), delay
    assert all(
        v >= 1
        for r, v in by_rank(parse_samples(text, "syncscope_pacing_engagements_total")).items()
        if r != SLOW_RANK
    )
    straggler = {s["step"]: s for s in run["records"][SLOW_RANK]}
    assert all(s["phases"]["pacing"] == 0.0 for s in straggler.values())
    for rank, every in run["records"].items():
        if rank == SLOW_RANK:
            continue
        steps = [s for s in every if s["end_unix_s"] <= run["killed_at"]]
        first_paced = next(i for i, s in enumerate(steps) if s["phases"]["pacing"] > 0)
        assert first_paced >= 8, "engaged before it could have seen a window of waits"
        # after: the later half of the steps before the kill, the delay at its level by then
        before = steps[3:first_paced]
        after = steps[max(len(steps) // 2, first_paced + ENGAGED_AFTER) :]
        assert len(after) >= 2 * ENGAGED_AFTER, (rank, first_paced, len(steps))
        paced = statistics.mean(s["phases"]["pacing"] for s in after)
        assert paced > 0.001, (rank, paced)

        # Each step against the straggler's same step (the ranks start it together, released by
        # the last one's all-reduce), so that a machine slower in one window than in the other
        # moves both sides (a fresh-clone run: this rank's wait 33.5 → 29.8 ms around an 8.9 ms
        # delay, the windows compared with each other). Its wait beyond what the straggler's
        # lateness and the collective's own time explain falls by the delay it now sleeps: the
        # delay is taken from waiting, one for one (0.90–1.01 measured).
        def unexplained_wait(s: dict[str, Any]) -> float:
            late = straggler[s["step"]]
            lateness = work_to_arrival(late) - work_to_arrival(s)
            return s["phases"]["comm_exposed"] - late["phases"]["comm_exposed"] - lateness

        fell = statistics.median(map(unexplained_wait, before)) - statistics.median(
            map(unexplained_wait, after)
        )
        assert 0.7 * paced <= fell <= 1.3 * paced, (rank, fell, paced)
        # and it is never held so long that the straggler waits for it: at every step its work
        # and delay end before the straggler's work does (or the job's step would grow). Unless
        # its own work ran over twice its median that step, which no delay chosen before the
        # step foresees: a core starved for the rank (a fresh-clone run: rank 0's work 30.7 ms
        # at one step against 4-9 ms at the others, its delay 9.7 ms as before, the
        # straggler's 35.7 ms), at no more than 2 % of the steps.
        usual = statistics.median(map(work_to_arrival, after))
        held_up = [
            (s["step"], round(work_to_arrival(s) * 1e3, 1), round(s["phases"]["pacing"] * 1e3, 1))
            for s in after
            if work_to_arrival(s) + s["phases"]["pacing"] >= work_to_arrival(straggler[s["step"]])
        ]
        starved = [h for h in held_up if h[1] > 2e3 * usual]
        assert held_up == starved and len(starved) <= 0.02 * len(after), (rank, held_up, usual)


def work_to_arrival(step: dict[str, Any]) -> float:
    """A rank's time from its step's start to its arrival at DDP's all-reduce: its data, forward
    and backward (the slow rank's 30 ms is in its forward)."""
    phases = step["phases"]
    return float(phases["data"] + phases["forward"] + phases["backward"])


def test_kill_file_stops_pacing_within_one_step(straggler_then_kill_file):
    run = straggler_then_kill_file
    assert run["active"], "the early ranks never all engaged"
    killed_at = run["killed_at"]
    for rank, steps in run["records"].items():
        if rank == SLOW_RANK:
            continue
        after = [s for s in steps if s.get("end_unix_s", 0) > killed_at]
        assert len(after) > 20
        # the step that was running when the file appeared may still carry a delay; none after it
        assert all(s["phases"]["pacing"] == 0.0 for s in after[1:]), [
            s["phases"]["pacing"] for s in after[:5]
        ]
        before = [s for s in steps if s.get("end_unix_s", 0) <= killed_at]
        assert any(s["phases"]["pacing"] > 0 for s in before)
    assert run["kill_file_kept"]


def test_multi_group_job_paces_only_below_the_first_wait_and_nobody_waits_longer(
    exporter, job_factory, tmp_path
):
    """Tensor parallel in pairs, FSDP2 across them: (dp, tp) pairs {0,2} {1,3} and {0,1} {2,3}.
    Rank 3 loads its data 30 ms slower, before any collective of its step, so rank 1, its dp
    partner, waits for it at the step's first collective (the root's all-gather): a delay below
    that wait holds up no one, in either group. Ranks 0 and 2 wait for 3 only later in the step
    (2 in the tp all-reduce, 0 behind 2): a delay at their step's start would move the chain
    to the root, so they are not paced, and neither is the root. While rank 1 is paced nobody
    waits longer than once the kill file has switched pacing off: not the root, not the job."""
    kill = tmp_path / "kill"
    job = job_factory(
        4,
        [
            # --steps, not --duration: the stop flag's broadcast every 10th step would be those
            # steps' first wait (docs/pacing.md: a periodic collective delays engagement).
            "--steps",
            "520",
            "--parallel",
            "tp",
            "--pacing",
            "--slow-rank",
            "3",
            "--slow-ms",
            "30",
            "--slow-in",
            "data",
        ],  # fmt: skip
        exporter.url,
        SYNCSCOPE_RECORD=str(tmp_path / "rec-{rank}.jsonl"),
        SYNCSCOPE_PACING_KILL_FILE=str(kill),
    )

    def rank_1_paced() -> bool:
        active = by_rank(parse_samples(exporter.metrics_text(), "syncscope_pacing_active"))
        return active.get(1) == 1.0

    assert wait_until(rank_1_paced, timeout=40), "rank 1 never engaged"
    time.sleep(12)  # ~170 paced steps of ~70 ms
    kill.touch()
    killed_at = time.time()
    job.wait()
    rows = records(tmp_path)
    paced = {rank: sum(s["phases"]["pacing"] for s in steps) for rank, steps in rows.items()}
    assert paced[0] == paced[2] == paced[3] == 0.0, paced
    first = next(i for i, s in enumerate(rows[1]) if s["phases"]["pacing"] > 0)
    assert first <= 160, f"engaged at step {first}"

    def spans(rank: int) -> tuple[list[dict], list[dict]]:
        """The steps paced at a steady level, and those well after the kill."""
        steps = rows[rank]
        on = [s for s in steps[first + ENGAGED_AFTER :] if s["end_unix_s"] <= killed_at]
        off = [s for s in steps if s["end_unix_s"] > killed_at + 2]
        return on, off

    def median(steps: list[dict], field: str) -> float:
        return statistics.median(
            s["step_s"] if field == "step" else s["phases"][field] for s in steps
        )

    def blocked(steps: list[dict]) -> float:
        """The median step's share spent blocked in collectives."""
        return statistics.median(s["phases"]["comm_exposed"] / s["step_s"] for s in steps)

    on, off = spans(1)
    assert len(on) >= 60 and len(off) >= 60, (len(on), len(off))
    assert median(on, "pacing") >= 0.005, median(on, "pacing")  # a real share of its 30 ms wait
    assert median(off, "pacing") == 0.0
    root_on, root_off = spans(3)

    def lead_ms(steps: list[dict]) -> list[float]:
        """By how much rank 1 reaches the step's first collective (the root's all-gather, after
        its data and its delay) before rank 3, its dp partner, does (after 30 ms more data):
        the ranks share this machine's clock, so their step rows line up by wall time."""
        three = {s["step"]: s for s in rows[3]}

        def arrives(s: dict) -> float:
            return s["end_unix_s"] - s["step_s"] + s["phases"]["data"] + s["phases"]["pacing"]

        return [1e3 * (arrives(three[s["step"]]) - arrives(s)) for s in steps if s["step"] in three]

    lead_on, lead_off = lead_ms(on), lead_ms(off)
    low_on = statistics.quantiles(lead_on, n=20)[0]
    report = {
        "rank 1 delay ms": 1e3 * median(on, "pacing"),
        "rank 1 lead ms (paced, off)": (statistics.median(lead_on), statistics.median(lead_off)),
        "rank 1 lead ms, paced, 5th percentile and lowest": (low_on, min(lead_on)),
        "root comm ms (paced, off)": (
            1e3 * median(root_on, "comm_exposed"),
            1e3 * median(root_off, "comm_exposed"),
        ),
        "step ms (paced, off)": (1e3 * median(root_on, "step"), 1e3 * median(root_off, "step")),
        "root blocked share (paced, off)": (blocked(root_on), blocked(root_off)),
    }
    print(f"\n{report}")
    # Nobody waits for the paced rank: it still reaches its step's first collective before the
    # root does, so the root's wait there and everything behind it is what it was. The delay
    # came out of rank 1's lead one for one: its lead shrank by the delay. Three runs here beside
    # a loaded core read the lead 16.4-17.1 ms paced (5th percentile 14.8-15.2, one step as low
    # as 9.0: a scheduler's hiccup, not the delay) and 30.2-30.4 off, against delays of
    # 13.4-13.9 ms. The root's blocked share, the figure this used to compare, moved
    # -0.037..+0.054 between the spans with the machine's load alone (the spans are seconds
    # apart): it is reported, not judged.
    assert low_on > 0.0, report
    shrank = statistics.median(lead_off) - statistics.median(lead_on)
    assert abs(shrank - 1e3 * median(on, "pacing")) <= 3.0, report
