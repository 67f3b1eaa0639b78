"""Faults around a running job: the sidecar must never slow, hang or crash training (issue 7).

In-process checks of the reporter come first (fast); then real 4-rank gloo jobs with a real
exporter process that is killed and restarted, stalled (SIGSTOP), or outlived by a killed
rank. Every server binds 127.0.0.1; every wait is bounded.

Record accounting used throughout: a `syncscope.lab.workload --duration` run of S steps produces
exactly S step records, S `ddp_grad_sync` records and S // 10 broadcasts (rank 0's stop flag),
and the agent must account for each as sent or dropped.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import statistics
import threading
import time
from collections import deque
from typing import Any

import pytest
from syncscope.agent.transport import Reporter, split_batch

from tests.conftest import Exporter, by_rank, make_reporter, parse_samples, wait_until

WORLD = 4
# Median step time during a fault over the rest of the run: the bound is the machine's noise
# (+-30 % between 100-step windows of an undisturbed run here), not a performance target.
NOISE_BOUND = 1.5
STEPS = 'syncscope_steps_total{job="restart"}'


def produced(result: dict[str, Any]) -> int:
    """Records a workload rank produced: a step row and its DDP sync row per step, the stop
    broadcast every 10 steps, its startup event (goodput's badput) once, and DDP's own two
    broadcasts of its rebuilt bucket order after the first step (which DDP waits for in C++:
    the C++ kernel times them to their completion)."""
    steps = len(result["step_times"])
    return 2 * steps + steps // 10 + 1 + 2


def rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


def median_ratio(results: list[dict], window: tuple[int, int], warmup: int = 20) -> float:
    """Median step time inside `window` (step indices) over the median of the rest of the run.

    Whole-run baselines, because 100-step medians here wander by +-30 % from scheduler noise
    alone (4 ranks on 2 shared cores; measured, docs/reliability.md). A loop that waited on the
    reporter would show up as steps of a second (the send timeout), see `longest_step`.
    """
    lo, hi = window
    during = [t for r in results for t in r["step_times"][lo:hi]]
    rest = [
        t
        for r in results
        for t in r["step_times"][warmup:lo] + r["step_times"][hi : len(r["step_times"]) - 5]
    ]
    return statistics.median(during) / statistics.median(rest)


def longest_step(results: list[dict], window: tuple[int, int]) -> float:
    return max(t for r in results for t in r["step_times"][window[0] : window[1]])


def steps_within(results: list[dict], t0: float, t1: float) -> tuple[int, int]:
    """The step indices (lo, hi) that every rank ended between unix times t0 and t1: where a
    fault was, by the clock. (Not by the exporter's step counts: a count is not a step number
    once rows were dropped, and on a loaded machine a 32-row queue drops some before the
    fault too.)"""
    lo = max(next((i for i, t in enumerate(r["step_ends"]) if t >= t0), 1 << 30) for r in results)
    hi = min(sum(1 for t in r["step_ends"] if t <= t1) for r in results)
    assert hi - lo >= 5, f"5 steps at least between {t0:.3f} and {t1:.3f}: {lo}..{hi}"
    return lo, hi


def first_steps_seen(exporter: Exporter, job: str) -> dict[int, int]:
    view = exporter.state(recent=300)
    ranks = view["jobs"].get(job, {}).get("ranks", [])
    return {r["rank"]: r["recent_steps"][0]["step"] for r in ranks if r["recent_steps"]}


def all_ranks(seen: dict[int, int], world: int = WORLD) -> dict[int, int] | None:
    return seen if len(seen) == world else None


# -- in-process: the reporter against a server that accepts and never answers --------------------


class StalledServer:
    """Accepts TCP connections on 127.0.0.1 and reads, but never answers (a stuck ingest)."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.port = self.sock.getsockname()[1]
        self.conns: list[socket.socket] = []
        self._stop = False
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        self.sock.settimeout(0.2)
        while not self._stop:
            with contextlib.suppress(OSError):
                conn, _ = self.sock.accept()
                self.conns.append(conn)

    def close(self) -> None:
        self._stop = True
        self.thread.join(2)
        for c in self.conns:
            c.close()
        self.sock.close()


def fault_reporter(url: str, steps: deque, colls: deque, **kw: Any) -> Reporter:
    """Fast flushes and a short send timeout, so faults show within a test's seconds."""
    kw = {"flush_interval_s": 0.05, "send_timeout_s": 0.3, **kw}
    return make_reporter(url, steps, colls, **kw)


def step_record(i: int) -> tuple:
    return (i, i * 1_000_000, 1_000_000, 0, 0, 0, 0, 0, 0)


def test_stalled_exporter_costs_records_not_training_time():
    server = StalledServer()
    steps: deque = deque(maxlen=64)
    colls: deque = deque(maxlen=256)
    reporter = fault_reporter(f"http://127.0.0.1:{server.port}", steps, colls)
    reporter.start()
    produced_n, refused, gaps = 0, 0, []
    try:
        # A 1 ms "training loop" for 2 s while every send hangs until its timeout.
        last = time.perf_counter()
        deadline = last + 2.0
        while time.perf_counter() < deadline:
            time.sleep(0.001)
            if len(steps) < steps.maxlen:  # what PhaseClock.end_step does: tail drop, counted
                steps.append(step_record(produced_n))
            else:
                refused += 1
            produced_n += 1
            now = time.perf_counter()
            gaps.append(now - last)
            last = now
        assert len(steps) <= steps.maxlen
    finally:
        reporter.stop(timeout=2)
        server.close()
    assert reporter.sent_records == 0
    assert reporter.drained_records + refused + len(steps) == produced_n
    assert reporter.send_dropped == reporter.drained_records
    # The loop never waited on the reporter: its worst iteration is scheduler noise, not the
    # 0.3 s send timeout.
    assert max(gaps) < 0.1, f"longest loop iteration {max(gaps) * 1e3:.1f} ms"


def test_unexpected_reporter_error_counts_the_records_it_held():
    def broken() -> dict:
        raise RuntimeError("pacing state exploded")

    steps: deque = deque(step_record(i) for i in range(10))
    colls: deque = deque()
    reporter = fault_reporter("http://127.0.0.1:9", steps, colls, pacing_state=broken)
    reporter.flush()
    assert reporter.errors == 1
    assert reporter.drained_records == 10 and reporter.send_dropped == 10


def test_backlog_is_split_into_bounded_requests_with_collectives_beside_their_steps():
    # Rows as queued: a step row starts with its step, a collective row ends with it.
    steps = [(i, 0, 10) for i in range(3000)]
    colls = [("all_reduce", k, i) for i in range(3000) for k in range(2)]
    chunks = split_batch(steps, colls, 1024)
    assert sum(len(s) for s, _ in chunks) == 3000 and sum(len(c) for _, c in chunks) == 6000
    for s, c in chunks:
        assert len(s) + len(c) <= 1024 + 2
        assert {x[-1] for x in c} <= {x[0] for x in s}
    one_step_many = split_batch([(0, 0, 10)], [("all_reduce", 0, 0)] * 5000, 1024)
    assert all(len(c) <= 1024 for _, c in one_step_many)
    assert sum(len(c) for _, c in one_step_many) == 5000


# -- real jobs, real exporter processes ------------------------------------------------------------


@pytest.mark.slow
def test_exporter_killed_and_restarted_mid_run(job_factory, tmp_path):
    """Kill -9 mid-run, restart 10 s later on the same port. Prometheus-style counter reset."""
    first = Exporter()
    port = first.port
    second = None
    prom = None
    try:
        if shutil.which("prometheus"):
            from syncscope.lab.servers import Prometheus
            from syncscope.monitoring.prometheus_config import render_config

            prom = Prometheus(render_config(f"127.0.0.1:{port}", "1s", []), str(tmp_path))
        job = job_factory(WORLD, ["--duration", "25"], first.url, job="restart")
        assert wait_until(lambda: len(first_steps_seen(first, "restart")) == WORLD, 60)
        time.sleep(5)
        if prom is not None:
            # Prometheus hands a new target to its scrapers up to 5 s after it is ready, and the
            # forked ranks report within 2 s of the launch: without this wait a loaded machine
            # kills the first exporter before Prometheus has one sample of it, and there is no
            # reset to see.
            assert wait_until(lambda: len(prom.query(STEPS)) == WORLD, 15), prom.query("up")
        before = first.metrics_text()
        started_before = first.state()["started_unix_s"]
        steps_at_kill = by_rank(parse_samples(before, "syncscope_steps_total"))
        first.proc.kill()  # SIGKILL: no goodbye, connections reset
        first.proc.wait(10)
        t_kill, killed_unix = time.monotonic(), time.time()
        time.sleep(10)
        assert job.running(), "the job must outlive the outage for this test to mean anything"
        up_unix = time.time()
        second = Exporter(port=port)
        t_up = time.monotonic()
        resumed = wait_until(
            lambda: all_ranks(first_steps_seen(second, "restart")),
            timeout=8,
            interval=0.1,
        )
        resume_s = time.monotonic() - t_up
        assert resumed, "ranks did not report to the restarted exporter"
        assert resume_s <= 5.0, f"reports resumed {resume_s:.2f} s after the restart"
        print(f"\nreports resumed {resume_s:.2f} s after the restarted exporter answered")

        # Counters restart the Prometheus way: one drop to a small value, then monotone.
        state = second.state()
        assert state["started_unix_s"] > started_before
        scrapes = []
        for _ in range(4):
            scrapes.append(by_rank(parse_samples(second.metrics_text(), "syncscope_steps_total")))
            time.sleep(0.7)
        for rank in range(WORLD):
            series = [s[rank] for s in scrapes]
            assert series[0] < steps_at_kill[rank], "expected a counter reset after restart"
            assert series == sorted(series), f"rank {rank} steps not monotone: {series}"
        start_times = parse_samples(second.metrics_text(), "syncscope_exporter_start_time_seconds")
        assert list(start_times.values()) == [pytest.approx(state["started_unix_s"])]

        results = job.wait(120)  # every rank exits 0: nothing reached the training loop
        time.sleep(1.0)
        final = second.metrics_text()
        dropped_seen = by_rank(parse_samples(final, "syncscope_agent_records_dropped_total"))
        for r in results:
            stats = r["stats"]
            assert stats["sent_records"] + stats["dropped_records"] == produced(r), stats
            assert stats["dropped_records"] > 0  # the outage cost records ...
            assert dropped_seen[r["rank"]] == stats["dropped_records"]  # ... all of them counted

        # Step time while nothing listens (the first half of the gap: the second half holds
        # the new exporter's start-up, a CPU burst on this 2-core machine) vs just before.
        outage = steps_within(results, killed_unix + 0.5, (killed_unix + up_unix) / 2)
        print(f"steps during the outage: {outage}")
        ratio = median_ratio(results, outage)
        longest = longest_step(results, outage)
        print(f"longest step during the outage: {longest * 1e3:.1f} ms")
        assert longest < 0.5, longest
        print(f"median step time during the outage / rest of the run: {ratio:.3f}")
        assert ratio <= NOISE_BOUND, ratio
        assert time.monotonic() - t_kill < 90

        if prom is not None:
            # The real thing: rate() over the restart never goes negative, and a reset is seen.
            # It held the first exporter's counters (above) and has scraped the second's.
            assert wait_until(
                lambda: prom.query(
                    f"syncscope_exporter_start_time_seconds >= {state['started_unix_s'] - 1e-3}"
                ),
                15,
            )
            resets = prom.query(f"resets({STEPS}[5m])")
            low = prom.query(f"min(min_over_time(rate({STEPS}[3s])[5m:1s]))")
            print(f"prometheus: resets {resets} min rate {low}")
            assert len(resets) == WORLD, resets
            assert all(float(x["value"][1]) >= 1 for x in resets), resets
            assert low and float(low[0]["value"][1]) >= 0, low
    finally:
        for e in (first, second):
            if e is not None:
                e.stop()
        if prom is not None:
            prom.stop()


@pytest.mark.slow
def test_stalled_exporter_keeps_queue_bounded_memory_flat_and_loop_unblocked(exporter, job_factory):
    """SIGSTOP the exporter for 8 s: connections are accepted by the kernel, never answered."""
    job = job_factory(
        WORLD, ["--duration", "24"], exporter.url, job="stall", SYNCSCOPE_QUEUE_SIZE="32"
    )
    assert wait_until(lambda: len(first_steps_seen(exporter, "stall")) == WORLD, 60)
    time.sleep(3)
    steps_at_stall = by_rank(parse_samples(exporter.metrics_text(), "syncscope_steps_total"))
    rss: dict[int, list[int]] = {i: [] for i in range(WORLD)}
    os.kill(exporter.proc.pid, signal.SIGSTOP)
    stopped_unix = time.time()
    try:
        for _ in range(16):  # 8 s of stall, RSS sampled every 0.5 s
            for i, p in enumerate(job.procs):
                rss[i].append(rss_kib(p.pid))
            time.sleep(0.5)
    finally:
        os.kill(exporter.proc.pid, signal.SIGCONT)
        continued_unix = time.time()
    assert wait_until(
        lambda: (
            min(by_rank(parse_samples(exporter.metrics_text(), "syncscope_steps_total")).values())
            > max(steps_at_stall.values())
        ),
        timeout=10,
        interval=0.2,
    ), "reports did not resume after the stall"
    results = job.wait(120)
    for i, samples in rss.items():
        growth = max(samples) - min(samples)
        assert growth < 8 * 1024, f"rank {i} RSS grew {growth} KiB during the stall: {samples}"
    for r in results:
        stats = r["stats"]
        assert stats["sent_records"] + stats["dropped_records"] == produced(r), stats
        assert stats["dropped_records"] > 0
    stall = steps_within(results, stopped_unix + 0.5, continued_unix)
    ratio = median_ratio(results, stall)
    longest = longest_step(results, stall)
    print(f"longest step during the stall: {longest * 1e3:.1f} ms")
    assert longest < 0.5, longest
    print(f"\nsteps during the stall: {stall}")
    print(f"median step time during the stall / rest of the run: {ratio:.3f}; rss {rss}")
    assert ratio <= NOISE_BOUND, ratio


@pytest.mark.slow
def test_killed_rank_goes_stale_expires_and_elastic_restart_is_clean(job_factory):
    """Rank killed: stale, then expired, bystanders untouched; a torchrun-style restart of the
    job's ranks is a new incarnation whose steps add to the old counters, each counted once."""
    # The restart must report before the killed ranks expire, or it is a new rank and no
    # restart: from the kill that is 2 s to go stale, 2.5 s here, and a 2-rank job's start
    # (~6 s on an idle 2-core machine; in CI once over 10 s, and a 14 s expiry lost the restart).
    expire_s = 30
    exporter = Exporter(["--stale-after", "2", "--expire-after", str(expire_s)])
    try:
        bystander = job_factory(2, ["--duration", "40"], exporter.url, job="bystander")
        victim = job_factory(2, ["--duration", "40"], exporter.url, job="victim")

        def both_reporting() -> bool:
            jobs = exporter.state()["jobs"]
            return all(
                len(jobs.get(j, {}).get("ranks", [])) == 2
                and min(r["steps_total"] for r in jobs[j]["ranks"]) > 20
                for j in ("bystander", "victim")
            )

        assert wait_until(both_reporting, 60)
        victim.procs[1].kill()

        def rank_view(job: str, rank: int) -> dict | None:
            for r in exporter.state()["jobs"].get(job, {}).get("ranks", []):
                if r["rank"] == rank:
                    return r
            return None

        assert wait_until(lambda: (rank_view("victim", 1) or {}).get("stale"), 6, 0.2)
        # torchrun's elastic agent now stops the whole worker group; so do we
        victim.kill()
        by_before = {r: rank_view("bystander", r)["steps_total"] for r in (0, 1)}
        time.sleep(2.5)
        for r in (0, 1):
            view = rank_view("bystander", r)
            assert not view["stale"] and view["steps_total"] > by_before[r], view
        ranks_gauge = parse_samples(exporter.metrics_text(), "syncscope_exporter_ranks")
        assert ranks_gauge[(("job", "victim"),)] == 0 and ranks_gauge[(("job", "bystander"),)] == 2

        old = {r: rank_view("victim", r) for r in (0, 1)}
        relaunched = time.monotonic()
        restarted = job_factory(2, ["--steps", "60"], exporter.url, job="victim")
        assert wait_until(
            lambda: (
                (rank_view("victim", 0) or {}).get("incarnation")
                not in (None, old[0]["incarnation"])
            ),
            60,
            0.2,
        )
        back_s = time.monotonic() - relaunched  # from the relaunch to its first report
        print(f"\nthe relaunched job reported {back_s:.1f} s after its launch")
        new_results = restarted.wait(120)
        time.sleep(1.0)
        for r in (0, 1):
            view = rank_view("victim", r)
            assert view["restarts"] == 1 and view["incarnation"] != old[r]["incarnation"], (
                back_s,
                view,
            )
            stats = new_results[r]["stats"]
            assert stats["dropped_records"] == 0
            # each step exactly once: what the old incarnation delivered plus the new 60
            assert view["steps_total"] == old[r]["steps_total"] + 60, (view, old[r])

        restarted.kill()
        t0 = time.monotonic()
        assert wait_until(lambda: "victim" not in exporter.state()["jobs"], expire_s + 6, 0.5)
        print(f"\nvictim gone {time.monotonic() - t0:.1f} s after its restarted job was over")
        text = exporter.metrics_text()
        assert 'job="victim"' not in text
        assert len(by_rank(parse_samples(text, "syncscope_steps_total"))) == 2  # bystander only
        bystander.kill()
    finally:
        exporter.stop()
