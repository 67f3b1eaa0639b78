"""The step loop of synchronous data-parallel training, with the agent's pacing controller in it.

One step, per rank ``i`` (time measured from the end of the previous step's all-reduce):

    start_i   = optimizer_i + data_i + pacing delay_i + checkpoint stall_i + hiccup_i
    arrival_i = start_i + forward_i + backward_i          (backward end = last bucket ready)
    ready_ib  = arrival_i - backward_i · (1 - b/B)         (bucket b of B, b = 1..B)

Bucket ``b``'s all-reduce starts when its last contributor is ready and after bucket ``b-1``
(one communication stream) and takes ``c`` seconds from the fabric model:

    E_b = max(E_{b-1}, max_i ready_ib) + c,     step time T = E_B

So buckets overlap the backward pass, and the exposed communication of rank ``i`` is
``T - arrival_i`` = its wait for the last rank + the un-overlapped transfer. The wait
``max_j arrival_j - arrival_i`` is what the agent measures and what the pacing controller gets;
the delay it returns is inserted before the next step's forward pass, exactly as the agent does.

The controller is :class:`syncscope.agent.pacing.PacingController` itself, in its vectorised
form: one object for all ranks, the same arithmetic as in a training process.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import numpy as np
from syncscope.agent.pacing import PacingConfig, PacingController
from syncscope.sim.compute import ComputeSampler
from syncscope.sim.fabric import Fabric
from syncscope.sim.params import SimParams
from syncscope.sim.stats import QuantileSketch, StreamingMoments

from syncscope.wire import PHASES

PHASE_INDEX = {name: i for i, name in enumerate(PHASES)}


@dataclass
class StepChunk:
    """Per-step outputs for a block of consecutive steps (arrays of length ``len(step_s)``)."""

    first_step: int
    step_s: np.ndarray
    bucket_comm_s: np.ndarray  # one bucket's all-reduce time under that step's contention
    phase_s: np.ndarray  # (steps, len(PHASES)): mean seconds per rank in each phase
    wait_mean_s: np.ndarray
    wait_max_s: np.ndarray
    delay_mean_s: np.ndarray
    paced_fraction: np.ndarray
    waits: np.ndarray | None = None  # (steps, ranks) when asked for
    rank_phase_s: np.ndarray | None = None  # (steps, ranks, len(PHASES)) when asked for

    def __len__(self) -> int:
        return len(self.step_s)


@dataclass
class SimSummary:
    """What one run gives: the numbers of paper Table 1 and the phase breakdown."""

    name: str
    nodes: int
    ranks: int
    pacing: bool
    steps: int
    mean_step_s: float
    std_step_s: float
    cv: float
    p50_step_s: float
    p99_step_s: float
    throughput: float  # samples per second
    phase_shares: dict[str, float]
    mean_wait_s: float
    mean_delay_s: float
    paced_fraction: float
    engagements: int
    ideal_bucket_comm_s: float
    mean_bucket_comm_s: float
    extra: dict[str, float] = field(default_factory=dict)

    def as_dict(self) -> dict[str, object]:
        return {k: getattr(self, k) for k in self.__dataclass_fields__}


class Simulator:
    """One simulated job of ``nodes`` nodes; ``pacing`` turns the agent's controller on.

    Compute and fabric draw from separate random streams seeded from ``seed``, so a baseline and
    a paced run with the same seed see the same compute times and the same other tenants: the
    difference between them is the controller's doing (common random numbers).
    """

    def __init__(
        self,
        params: SimParams,
        nodes: int,
        *,
        pacing: bool | PacingConfig = False,
        seed: int | None = None,
        block: int = 128,
    ) -> None:
        if nodes < 1:
            raise ValueError("nodes must be >= 1")
        self.params = params
        self.nodes = nodes
        self.ranks = params.ranks(nodes)
        seed = params.seed if seed is None else seed
        compute_rng, fabric_rng = (
            np.random.default_rng(s) for s in np.random.SeedSequence([seed, nodes]).spawn(2)
        )
        self.compute = ComputeSampler(params.compute, self.ranks, compute_rng, block=block)
        self.fabric = Fabric(params.fabric, nodes, fabric_rng)
        if pacing is True:
            pacing = params.pacing_config(self.ranks)
        self.controller = (
            PacingController(pacing, ranks=self.ranks) if isinstance(pacing, PacingConfig) else None
        )
        self.delay = np.zeros(self.ranks)
        self.step_index = 0
        buckets = params.fabric.buckets
        # Share of the backward pass still to run when bucket b (1..B) is ready.
        self._remaining = 1.0 - np.arange(1, buckets + 1) / buckets
        ckpt = params.checkpoint
        self._ckpt_stall = np.zeros(self.ranks)
        if ckpt.every_steps > 0 and ckpt.stall_s > 0:
            if ckpt.ranks == "all":
                self._ckpt_stall[:] = ckpt.stall_s
            else:
                self._ckpt_stall[0] = ckpt.stall_s

    def iter_chunks(
        self, steps: int, chunk: int = 256, keep_waits: bool = False, keep_ranks: bool = False
    ) -> Iterator[StepChunk]:
        """Run ``steps`` steps, yielding their outputs ``chunk`` steps at a time.

        ``keep_waits`` adds every rank's wait, ``keep_ranks`` every rank's phases (what the
        agent would record); memory is bounded by the chunk size either way.
        """
        done = 0
        while done < steps:
            size = min(chunk, steps - done)
            yield self._run_chunk(size, keep_waits or keep_ranks, keep_ranks)
            done += size

    def _run_chunk(self, size: int, keep_waits: bool, keep_ranks: bool) -> StepChunk:
        p = self.params
        cm = p.compute
        out = StepChunk(
            first_step=self.step_index,
            step_s=np.empty(size),
            bucket_comm_s=np.empty(size),
            phase_s=np.zeros((size, len(PHASES))),
            wait_mean_s=np.empty(size),
            wait_max_s=np.empty(size),
            delay_mean_s=np.zeros(size),
            paced_fraction=np.zeros(size),
            waits=np.empty((size, self.ranks)) if keep_waits else None,
            rank_phase_s=np.zeros((size, self.ranks, len(PHASES))) if keep_ranks else None,
        )
        i_data, i_fwd, i_bwd, i_opt = (PHASE_INDEX[k] for k in PHASES[:4])
        i_comm, i_pace, i_other = (PHASE_INDEX[k] for k in PHASES[4:])
        ckpt_every = p.checkpoint.every_steps if p.checkpoint.stall_s > 0 else 0
        remaining = self._remaining
        single_bucket = len(remaining) == 1
        fabric = self.fabric
        controller = self.controller
        gpu_before_backward = cm.forward_s + cm.optimizer_s
        for k in range(size):
            draw = self.compute.draw()
            factor = draw.factor
            backward = cm.backward_s * factor
            start = draw.data + draw.hiccup + gpu_before_backward * factor
            if controller is not None:
                start = start + self.delay
            stalled = ckpt_every and (self.step_index + 1) % ckpt_every == 0
            if stalled:
                start = start + self._ckpt_stall
            arrival = start + backward
            last = float(arrival.max())
            if single_bucket:
                ready = (last,)
            else:
                ready = (arrival[:, None] - backward[:, None] * remaining).max(axis=0).tolist()
            waits = last - arrival
            fabric.advance()
            bucket_s = fabric.bucket_time(fabric.skew_load(waits))
            end = 0.0
            for r in ready:
                end = (end if end > r else r) + bucket_s
            mean_arrival = float(arrival.mean())

            out.step_s[k] = end
            out.bucket_comm_s[k] = bucket_s
            out.wait_mean_s[k] = last - mean_arrival
            out.wait_max_s[k] = last - float(arrival.min())
            phases = out.phase_s[k]
            mean_factor = float(factor.mean())
            phases[i_data] = float(draw.data.mean())
            phases[i_fwd] = cm.forward_s * mean_factor
            phases[i_bwd] = cm.backward_s * mean_factor
            phases[i_opt] = cm.optimizer_s * mean_factor
            phases[i_comm] = end - mean_arrival
            phases[i_other] = float(draw.hiccup.mean()) + (
                float(self._ckpt_stall.mean()) if stalled else 0.0
            )
            applied_delay = self.delay
            if controller is not None:
                phases[i_pace] = float(self.delay.mean())
                out.delay_mean_s[k] = phases[i_pace]
                out.paced_fraction[k] = float(np.count_nonzero(self.delay)) / self.ranks
                self.delay = controller.update(waits, end)
            if out.waits is not None:
                out.waits[k] = waits
            if out.rank_phase_s is not None:
                per_rank = out.rank_phase_s[k]
                per_rank[:, i_data] = draw.data
                per_rank[:, i_fwd] = cm.forward_s * factor
                per_rank[:, i_bwd] = backward
                per_rank[:, i_opt] = cm.optimizer_s * factor
                per_rank[:, i_comm] = end - arrival
                per_rank[:, i_other] = draw.hiccup + (self._ckpt_stall if stalled else 0.0)
                if controller is not None:
                    per_rank[:, i_pace] = applied_delay
            self.step_index += 1
        return out

    def run(
        self,
        steps: int | None = None,
        warmup_steps: int | None = None,
        progress: Callable[[int], None] | None = None,
    ) -> SimSummary:
        """Run and summarise; the first ``warmup_steps`` are simulated but not counted."""
        p = self.params
        steps = p.steps if steps is None else steps
        warmup = p.warmup_steps if warmup_steps is None else warmup_steps
        for chunk in self.iter_chunks(warmup):
            if progress is not None:
                progress(len(chunk))
        step_time = StreamingMoments()
        sketch = QuantileSketch()
        phase_sum = np.zeros(len(PHASES))
        wait_sum = delay_sum = paced_sum = 0.0
        comm = StreamingMoments()
        engaged_before = self._engagements()
        for chunk in self.iter_chunks(steps):
            step_time.add_array(chunk.step_s)
            sketch.add_array(chunk.step_s)
            comm.add_array(chunk.bucket_comm_s)
            phase_sum += chunk.phase_s.sum(axis=0)
            wait_sum += float(chunk.wait_mean_s.sum())
            delay_sum += float(chunk.delay_mean_s.sum())
            paced_sum += float(chunk.paced_fraction.sum())
            if progress is not None:
                progress(len(chunk))
        n = max(step_time.count, 1)
        total_time = step_time.mean * n
        shares = {
            name: (float(phase_sum[i]) / total_time if total_time > 0 else 0.0)
            for i, name in enumerate(PHASES)
        }
        mean_step = step_time.mean
        return SimSummary(
            name=p.name,
            nodes=self.nodes,
            ranks=self.ranks,
            pacing=self.controller is not None,
            steps=step_time.count,
            mean_step_s=mean_step,
            std_step_s=step_time.std,
            cv=step_time.cv,
            p50_step_s=sketch.quantile(0.50),
            p99_step_s=sketch.quantile(0.99),
            throughput=(p.samples_per_rank * self.ranks / mean_step) if mean_step > 0 else 0.0,
            phase_shares=shares,
            mean_wait_s=wait_sum / n,
            mean_delay_s=delay_sum / n,
            paced_fraction=paced_sum / n,
            engagements=self._engagements() - engaged_before,
            ideal_bucket_comm_s=self.fabric.ideal_bucket_time(),
            mean_bucket_comm_s=comm.mean,
        )

    def _engagements(self) -> int:
        if self.controller is None:
            return 0
        return int(np.sum(self.controller.engagements))


def simulate(
    params: SimParams,
    nodes: int,
    *,
    pacing: bool = False,
    steps: int | None = None,
    warmup_steps: int | None = None,
    seed: int | None = None,
    progress: Callable[[int], None] | None = None,
) -> SimSummary:
    """One run, summarised: the convenience entry point."""
    sim = Simulator(params, nodes, pacing=pacing, seed=seed)
    return sim.run(steps, warmup_steps, progress)
