"""Each rank's throughput per GPU against its own best sustained level: what the decision
verdict (exporter/verdict.py) compares to say a job slows down when no failure mode is named.

A rank's steps are cut into blocks of BLOCK_STEPS, the diagnosis window's length, and at least
the thresholds' rate window of step time: at 10 ms steps, 100 steps are a second, and a
neighbour's burst or a pause of a few seconds would fill every block the verdict reads. A
block's rate is per second of step time (time between steps — a restart, a hang — is not in
it): samples where at least half its steps said how many, else steps. The first block after
each (re)start of the rank is warm-up (compilation, autotuning, a cold data loader) and is left
out. Then

  current   the median of the last CURRENT_BLOCKS blocks' rates: a fall most of them show, not
            one block that holds a checkpoint;
  sustained the median of the last SUSTAINED_BLOCKS blocks' rates, taken as each block closes;
  baseline  the best sustained level of the last `horizon_s` (the thresholds' trend window, a
            day), kept per hour: one fast block cannot lift it, and a level the job left a day
            ago (a new phase, longer sequences) ages out.

Not for comparing jobs, or ranks of different work: the baseline is the rank's own. The store
keeps one `Throughput` per rank (RankState); the state file keeps it across exporter restarts.
A job that changes its own work (larger batches counted as steps, an evaluation phase) reads
as a fall until the baseline ages out: the verdict says so, and stays at the info level.
"""

from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass, field

from syncscope.catalog import STEP_WINDOW

BLOCK_STEPS = STEP_WINDOW
CURRENT_BLOCKS = 3
SUSTAINED_BLOCKS = 5
BUCKET_S = 3600.0
UNITS = ("samples", "steps")


@dataclass(frozen=True)
class ThroughputView:
    """A rank's throughput per GPU as of the snapshot, in `unit` per second of step time."""

    unit: str  # one of UNITS
    current_per_s: float | None  # None until CURRENT_BLOCKS blocks after warm-up
    baseline_per_s: float | None  # None until SUSTAINED_BLOCKS blocks after warm-up


@dataclass
class Throughput:
    """One rank's blocks of steps, and the best sustained rate per hour (the store's lock held)."""

    unit: str = ""  # of every rate kept; "" before the first block after warm-up
    blocks: int = 0  # closed since the rank's (re)start, warm-up included
    rates: deque[float] = field(default_factory=lambda: deque(maxlen=SUSTAINED_BLOCKS))
    best: dict[int, float] = field(default_factory=dict)  # hour (unix s // BUCKET_S) -> rate
    # The block in progress: its steps and step time, and those of its steps that said samples.
    steps: int = 0
    seconds: float = 0.0
    work_steps: int = 0
    work_seconds: float = 0.0
    samples: int = 0

    def add(
        self, seconds: float, samples: int, end_unix_s: float, horizon_s: float, block_s: float
    ) -> None:
        """One step of `seconds`; `samples` < 0 where the step did not say. A block closes at
        BLOCK_STEPS steps once it holds `block_s` of step time."""
        self.steps += 1
        self.seconds += seconds
        if samples >= 0:
            self.work_steps += 1
            self.work_seconds += seconds
            self.samples += samples
        if self.steps >= BLOCK_STEPS and self.seconds >= block_s:
            self._close(end_unix_s, horizon_s)

    def _close(self, at: float, horizon_s: float) -> None:
        by_samples = 2 * self.work_steps >= self.steps and self.work_seconds > 0
        unit = "samples" if by_samples else "steps"
        rate = (
            self.samples / self.work_seconds
            if by_samples
            else self.steps / self.seconds
            if self.seconds > 0
            else None
        )
        self.steps = self.work_steps = self.samples = 0
        self.seconds = self.work_seconds = 0.0
        self.blocks += 1
        if self.blocks == 1 or rate is None:
            return  # warm-up
        if unit != self.unit:  # the agents started or stopped saying samples: start over
            self.unit = unit
            self.rates.clear()
            self.best.clear()
        self.rates.append(rate)
        if len(self.rates) >= SUSTAINED_BLOCKS:
            hour = int(at // BUCKET_S)
            sustained = statistics.median(self.rates)
            if sustained > self.best.get(hour, 0.0):
                self.best[hour] = sustained
        oldest = int((at - horizon_s) // BUCKET_S)
        for hour in [h for h in self.best if h < oldest]:
            del self.best[hour]

    def restart(self) -> None:
        """A new incarnation of the rank: warm-up again, the current level anew; the baseline
        stays (a restart from a checkpoint is the same job)."""
        self.blocks = self.steps = self.work_steps = self.samples = 0
        self.seconds = self.work_seconds = 0.0
        self.rates.clear()

    def view(self) -> ThroughputView | None:
        if not self.unit:
            return None
        recent = list(self.rates)[-CURRENT_BLOCKS:]
        return ThroughputView(
            self.unit,
            statistics.median(recent) if len(recent) >= CURRENT_BLOCKS else None,
            max(self.best.values()) if self.best else None,
        )
