"""What the agent tells a user whose attach() misses part of the job, once, in a log line: each
reads what the agent records anyway, on the reporter's thread (StoppedSteps, with the shm ring,
on the training thread, where it costs a few µs at its looks).

  StoppedSteps  the optimizer the steps end at has stopped stepping while the model trains on
                (the loop built a new one): the agent looks for the new one (new_optimizer.py),
                and says so where none is found
  DdpOutside    DDP synchronises the gradients of the module attach() was given from outside it
                (DistributedDataParallel wrapped it after attach(), or the agent was given another
                wrapper around DDP): its sync is `other` time
  DdpUnseen     the all-reduces inside backward on the given DDP models' group add up to what
                their gradients cannot: another DDP model there was not given (its sync untimed)
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from syncscope.agent.new_optimizer import NewOptimizer
    from syncscope.agent.phases import PhaseClock

log = logging.getLogger("syncscope.agent")


class StoppedSteps:
    """Tells `follower` (a NewOptimizer), and then the user once, that the model trains on while
    the optimizer the steps end at has stopped stepping: the loop built a new optimizer (staged
    unfreezing, a reset). Called on the HTTP reporter's thread at its flushes (every few
    seconds once no step ends); with the shm ring, which has no thread, on the training thread
    at the ring's pumps and at every LOOK_EVERY-th batch of a step (step_work.py): it reads the
    step number and the count of forwards with gradients since the step began (what work
    detection counts; where that is off, it stays silent). No step for `ask_s` and for
    `ask_steps` times the longest a step took between two looks (where one is known), while
    the forwards went on: `follower.ask()`. For `floor_s` and `steps` times that, a step's time
    known: the line, where no new optimizer was found by then."""

    def __init__(
        self,
        clock: PhaseClock,
        optimizers: list[Any],
        floor_s: float = 30.0,
        steps: float = 10.0,
        now: Any = time.monotonic,
    ) -> None:
        self.clock = clock
        self.names = ", ".join(sorted({type(o).__name__ for o in optimizers}))
        self.floor_s, self.steps, self.now = floor_s, steps, now
        self.follower: NewOptimizer | None = None  # the agent's, with one optimizer
        self.ask_s, self.ask_steps = 3.0, 3.0
        self.step = -1  # at the last look, and when it last changed
        self.since = 0.0
        self.baseline = False  # a change of step since the first look was seen
        self.step_s = 0.0  # the longest a step took between two looks (0: none seen yet)
        self.forwards = 0  # counted at the last look
        self.told = False

    def __call__(self) -> None:
        try:
            self._look()
        except Exception:  # noqa: BLE001 - a look that fails says nothing; the drain goes on
            self.told = True
            self.follower = None

    def _look(self) -> None:
        clock, t = self.clock, self.now()
        step, forwards = clock.step, clock.work.seen_batches
        if step != self.step:
            if self.baseline:  # (the first change seen may hold the start-up's first step)
                self.step_s = max(self.step_s, (t - self.since) / max(1, step - self.step))
            self.baseline = self.step >= 0
            self.step, self.since, self.forwards = step, t, forwards
            return
        going = forwards > self.forwards
        self.forwards = forwards
        idle = t - self.since
        if not going:
            return
        follower = self.follower
        # Before a step's time is known (the loop built its optimizer at or just after
        # attach()), after ask_s alone: where the old optimizer steps after all, asking cost
        # its step torch's global hook, once.
        if follower is not None and idle > max(self.ask_s, self.ask_steps * self.step_s):
            follower.ask()
        if self.step_s and not self.told and idle > max(self.floor_s, self.steps * self.step_s):
            self.told = True
            followed = follower.following() if follower is not None else None
            if followed is not None:
                self.names = type(followed).__name__
            log.warning(
                "syncscope: %d forwards in %.0f s and no step: the optimizer the steps end at "
                "(%s) has stopped stepping, no other optimizer that trains the model given to "
                "attach() has stepped since, and this rank's steps are not reported. Give "
                "attach() the model and the optimizer the loop steps.",
                forwards,
                idle,
                self.names,
            )


class DdpOutside:
    """Says once that DDP synchronises the gradients of the module attach() was given, from a
    DistributedDataParallel wrapped around it after attach(): the agent does not know DDP syncs
    it, so the ranks' wait in that sync is `other` time, not exposed communication. Told by the
    C++ kernel's records: the all-reduces issued inside backward on one group add up, in a step,
    to what DDP's buckets would (ddp_buckets_add_up: a whole multiple of the module's
    gradients' bytes, or of half of them). Given only a module that is neither DDP, FSDP nor
    DTensor-parallel (agent.core)."""

    def __init__(self, grad_bytes: int) -> None:
        self.grad_bytes = grad_bytes
        self.step = -1  # the step whose all-reduces are being added up, by group
        self.bytes: dict[str, int] = {}
        self.told = False

    def __call__(self, op: str, group: str, size: int, step: int, in_autograd: bool) -> None:
        """One completed c10d op (CollectiveInterceptor.completed)."""
        if self.told or not in_autograd or op != "all_reduce":
            return
        if step != self.step:  # the records come as the ops complete: that step's are all in
            self._judge()
            self.step, self.bytes = step, {}
        self.bytes[group] = self.bytes.get(group, 0) + size

    def _judge(self) -> None:
        for group, total in self.bytes.items():
            if total * 2 >= self.grad_bytes and ddp_buckets_add_up(total, [self.grad_bytes]):
                self.told = True
                log.warning(
                    "syncscope: DDP synchronises the gradients of the module given to attach() "
                    "from outside it (%d bytes a step on group %s; wrapped after attach(), or "
                    "given inside another wrapper): the ranks' wait in that sync reads as "
                    "`other`, not exposed communication. Give attach() the "
                    "DistributedDataParallel module.",
                    total,
                    group,
                )
                return


class DdpUnseen:
    """Says once that the all-reduces inside backward on the attached DDP models' group add up,
    in a step, to what their gradients cannot: another DDP model on that group synchronises
    there (a GAN's critic, not given to attach()). The C++ kernel leaves every all-reduce inside
    backward on that group untimed as the attached models' buckets, so that model's sync is
    neither timed nor exposed communication, and a rank late to it goes unseen: the line is a
    step's total that ddp_buckets_add_up refuses. A comm hook that sends other sizes
    (PowerSGD's) reads as another model too: the line says so. Not given for a model with
    SyncBatchNorm (its backward all-reduces on the group too). Fed by the reporter's polls (the
    C++ kernel's count of the bytes it skipped in the last whole step)."""

    def __init__(self, model_bytes: list[int]) -> None:
        self.model_bytes = [b for b in model_bytes if b >= 2][:3]  # the first three models'
        self.step = -1
        self.told = False

    def __call__(self, step: int, total: int) -> None:
        if self.told or step < 0 or step == self.step or total <= 0 or not self.model_bytes:
            return
        self.step = step
        if ddp_buckets_add_up(total, self.model_bytes):
            return
        self.told = True
        log.warning(
            "syncscope: in step %d the all-reduces inside backward on DDP's group came to %d "
            "bytes, which the gradients of the DDP models given to attach() (%s bytes) do not "
            "add up to: another DDP model on that group was not given to attach() (its sync is "
            "not timed, and a rank late to it goes unseen: attach(model=[...], "
            "optimizer=[...]) with every model), or a comm hook sends other sizes.",
            step,
            total,
            ", ".join(map(str, self.model_bytes)),
        )


# Multiples of each model's half-bytes ddp_buckets_add_up tries, but the last model's (any): a
# step of 8 syncs of one model.
MAX_TIMES = 16


def ddp_buckets_add_up(total: int, model_bytes: list[int]) -> bool:
    """Whether `total` bytes of all-reduces inside backward in one step is what DDP's buckets
    for models of `model_bytes` gradient bytes could add up to. They hold the gradients exactly:
    a step's total is a whole multiple of each model's bytes or of half of them (bf16 buckets, a
    compressing comm hook), added up over the models (a backward may reach only some,
    accumulation without no_sync() syncs them again)."""
    *rest, last = [max(1, b // 2) for b in model_bytes]
    sums = {0}
    for half in rest:
        sums = {s + k * half for s in sums for k in range(MAX_TIMES + 1)}
    return any(total >= s and (total - s) % last == 0 for s in sums)
