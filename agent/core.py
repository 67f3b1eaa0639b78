"""attach(): wires the phase clock, collective timing, pacing and the reporter into a job."""

from __future__ import annotations

import atexit
import contextlib
import logging
import sys
import time
import uuid
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import replace
from typing import TYPE_CHECKING, Any, Protocol

from syncscope.agent import checkpointing
from syncscope.agent.attach_checks import DdpOutside, DdpUnseen, StoppedSteps
from syncscope.agent.collectives import (
    Blocked,
    CollectiveInterceptor,
    GroupLabels,
    bucket_timing_hook,
)
from syncscope.agent.compiles import CompileWatch
from syncscope.agent.config import AgentConfig, process_identity, process_started_unix_s
from syncscope.agent.link import LinkSampler, with_link
from syncscope.agent.local_arrival import LocalArrival
from syncscope.agent.new_optimizer import NewOptimizer
from syncscope.agent.phase_hooks import Instrumented, instrument, optimizers_of, parts_of
from syncscope.agent.phases import PhaseClock
from syncscope.agent.queues import RecordQueues
from syncscope.agent.recording import RecordWriter
from syncscope.agent.shm_ring import ShmTransport
from syncscope.agent.step_pacing import StepPacer
from syncscope.agent.transport import Reporter

from syncscope.wire import MAX_LABEL_LEN, MAX_WORK

if TYPE_CHECKING:
    from syncscope.agent.native import Native
    from syncscope.agent.nccl_trace import FlightRecorderReader, StepTimeline
    from syncscope.agent.pacing import PacingController
    from syncscope.agent.topology import TopologySampler

log = logging.getLogger("syncscope.agent")


class RankAgent(Protocol):
    """What attach() returns: the live `Agent`, or an `InertAgent` when syncscope is switched
    off or could not start. Integrations (syncscope.integrations) use nothing else."""

    errors: int  # hook failures caught on the training thread
    last_error: BaseException | None

    def step(self) -> AbstractContextManager[None]:
        """`with agent.step():` marks one training step when no optimizer hook does."""
        ...

    def count(self, samples: int | None = None, tokens: int | None = None) -> None:
        """Add to the work this rank does in the current step; replaces what the model's
        inputs or the per-step settings say for this step. Call it before the step ends."""
        ...

    def checkpoint(self, kind: str = "save") -> AbstractContextManager[None]:
        """`with agent.checkpoint("save"):` (or "load") times the block as checkpoint time,
        for saves and loads that do not go through torch.save/torch.load or
        torch.distributed.checkpoint (which are timed without it)."""
        ...

    def close(self) -> None:
        """Remove hooks and patches, send what is left. Safe to call twice."""
        ...

    @property
    def dropped_total(self) -> int:
        """Records lost so far: refused by a full queue, or in a failed send."""
        ...

    @property
    def stats(self) -> dict[str, int]:
        """Counters for the curious (and the tests): steps, sent_records, dropped_records,
        errors (the training thread's and the reporter's)."""
        ...


class _StepContext:
    __slots__ = ("clock",)

    def __init__(self, clock: PhaseClock) -> None:
        self.clock = clock

    def __enter__(self) -> None:
        try:
            self.clock.begin_manual_step()
        except BaseException as exc:  # noqa: BLE001
            self.clock.on_error(exc)

    def __exit__(self, *_exc: object) -> None:
        clock = self.clock
        try:
            t = time.perf_counter_ns()
            clock.end_step(t)
            after = clock.after_step  # the transport's step hook, as optimizer_post calls it
            if after is not None and t >= clock.after_at and clock.step % clock.after_every == 0:
                clock.after_at = after(clock.step) or 0
        except BaseException as exc:  # noqa: BLE001
            clock.on_error(exc)


class Agent:
    """One rank's agent. Use `attach()` to make one; `close()` (or process exit) ends it.

    Its parts: `queues`, which the producers fill and the reporter drains; producers `clock`
    (phases from hooks on the model and optimizer; on CUDA it also records CUDA events),
    `patch` (every c10d op on CPU tensors, timed at the dispatcher) and `nccl_reader` (Flight
    Recorder, NCCL groups); `topology` (GPU locality, sampled on the reporter's thread); `arrival`,
    the local arrival estimate, only when `pacer` (pacing's controller) or `record` (the record
    file) reads it; and `reporter`, which sends everything to the exporter.
    """

    def __init__(self, model: Any, optimizer: Any, config: AgentConfig) -> None:
        self.config = config
        self.errors = 0
        self.last_error: BaseException | None = None
        self._closed = False
        self.hooks: Instrumented | None = None  # on the model and optimizer, for the clock
        # The optimizer a loop builds in place of the one given, followed (StoppedSteps asks)
        self.new_optimizer: NewOptimizer | None = None
        optimizers = optimizers_of(optimizer)
        torch = sys.modules.get("torch") if model is None and not optimizers else _import_torch()
        model = model_parts(torch, model)
        self.identity = _identity(config)
        self.queues = RecordQueues(config.queue_size)
        labels = self.labels = GroupLabels()
        ddp_model, ddp_group, ddp_bytes = _ddp_sync(torch, model, labels)
        # On CUDA (docs/gpu.md): GPU-side phases from CUDA events, NCCL durations from Flight
        # Recorder, GPU topology from NVML/sysfs; all resolved or read off the training thread.
        cuda_index = _cuda_device(torch, model, optimizers)
        timeline = _step_timeline() if cuda_index is not None else None
        self.clock = self._make_clock(
            torch, model, ddp_model, ddp_group, ddp_bytes, timeline, cuda_index
        )
        self.queues.clock = self.clock
        self.clock.phase_every = config.phase_every
        self.clock.events = self.queues.events
        self._number_steps(optimizers, config)
        self.nccl_reader: FlightRecorderReader | None = None
        self.topology: TopologySampler | None = None
        if cuda_index is not None:
            self.nccl_reader = self._flight_recorder_reader(torch, timeline)
            self.topology = _topology_sampler(torch, cuda_index)
        # On CUDA the clock ties the queue's records to GPU steps and NCCL is Flight Recorder's.
        self.patch = (
            self._intercept_collectives(torch, labels, model, ddp_model, ddp_group)
            if cuda_index is None
            else None
        )
        if self.patch is not None:
            self.clock.blocked = self.patch.blocked
        self.checkpoints = checkpointing.CheckpointTimer(self.clock, self._on_error)
        self.compiles = CompileWatch(self.clock, self._on_error)
        self._count_work(torch, model, config)
        self.record = RecordWriter(config.record, self.identity) if config.record else None
        self.arrival = LocalArrival(self.record) if config.pacing or self.record else None
        self.pacer: PacingController | None = None
        if config.pacing and self.arrival is not None:
            self.pacer = self._enable_pacing(self.arrival)
        # The exporter tells estimated phases from timed ones (pacing times every step).
        self.identity["phase_every"] = config.phase_every if self.pacer is None else 1
        self.link = LinkSampler()
        # Where optimizers end the steps: the look for one that stopped stepping, at the
        # transport's drains, and with the shm ring (no thread) also every LOOK_EVERY batches
        # of a step (step_work.py), as the forwards that go on with no step are what it seeks.
        self.stopped_steps = StoppedSteps(self.clock, optimizers) if optimizers else None
        self.reporter: Reporter | ShmTransport
        if config.exporter is not None and config.exporter.startswith("shm:"):
            # A local exporter reads a shared-memory ring: no reporter thread (shm_ring.py).
            self.reporter = self._shm_transport(config.exporter)
            self.clock.work.on_batches = self.stopped_steps
        else:
            self.reporter = self._http_reporter(config)
        # Hooks and patches go in last, so that a failure above leaves none of them in place.
        if self.patch is not None:
            self.patch.install()
            counter = self.clock.step_counter = self.patch.step_counter
            if counter is not None:
                counter.value = self.clock.step
        self.hooks = instrument(self.clock, model, optimizers, self._native_backward(torch))
        watch, parts = self.stopped_steps, parts_of(model)
        if watch is not None and self.hooks.step_hooks is not None and parts:
            follower = NewOptimizer(self.clock, self.hooks, parts, optimizers[0])
            self.new_optimizer = watch.follower = follower
        try:
            checkpointing.install(self.checkpoints)
        except Exception as exc:  # noqa: BLE001 - no checkpoint time, everything else stands
            self._on_error(exc)
        self.compiles.install()
        # The transport's work falls on step boundaries every rank agrees on, so the ranks
        # pause together: the ring is pumped at every `align_every_steps`-th step
        # (shm_ring.py); the HTTP reporter's thread is woken at the first such step of each
        # flush interval (transport.py), so the clock calls it at every step.
        if isinstance(self.reporter, ShmTransport):
            self.clock.after_every = max(1, config.align_every_steps)
            self.clock.after_step = self.reporter.pump
        else:
            self.clock.after_step = self.reporter.at_step
        if ddp_model is not None and config.detail == "buckets" and ddp_group is not None:
            self._time_buckets(ddp_model, ddp_group)
        self.reporter.start()
        self.clock.start()
        if self.nccl_reader is not None:
            self.nccl_reader.start()
        atexit.register(self.close)
        _OPEN.add(self)

    def _http_reporter(self, config: AgentConfig) -> Reporter:
        return Reporter(
            identity=self.identity,
            url=config.exporter,
            token=config.token,
            steps=self.queues.steps,
            collectives=self.queues.collectives,
            flush_interval_s=config.flush_interval_s,
            send_timeout_s=config.send_timeout_s,
            align_every_steps=config.align_every_steps,
            dropped_elsewhere=self._dropped_on_training_thread,
            pacing_state=self.pacer.state if self.pacer is not None else None,
            topology=with_link(self.topology, self.link, self.labels.facts),
            on_drained=self.arrival.drained if self.arrival is not None else None,
            on_reply=self.arrival.merge_reply if self.arrival is not None else None,
            events=self.queues.events,
            on_events=self.record.write_events if self.record is not None else None,
            before_drain=self._before_drain(),
            finish_rows=self.clock.finish,
        )

    def _before_drain(self) -> Callable[[], None] | None:
        """What the transport calls before each drain: the C++ kernel's records into the
        queues, and the StoppedSteps look where optimizers end the steps."""
        poll = self.patch.poll if self.patch is not None else None
        watch = self.stopped_steps
        if watch is None or poll is None:
            return watch or poll

        def both() -> None:
            poll()
            watch()

        return both

    def _shm_transport(self, url: str) -> ShmTransport:
        if self.pacer is not None or self.record is not None:
            # Both read the exporter's replies or the reporter's flushes (local_arrival.py).
            log.warning(
                "syncscope: pacing and the record file need the HTTP reporter; with %s they "
                "see no data",
                url,
            )
        topology = None
        with contextlib.suppress(Exception):  # static facts, sampled once, off the hot path
            topology = with_link(self.topology, self.link, self.labels.facts)()
        if topology:
            from syncscope.agent.topology import LIVE_KEYS

            # Written once into the ring's header: a counter frozen there would read as a GPU
            # that draws no energy, error counts as a GPU that never has an error, its first
            # throttle reasons and link as the whole run's. No series instead, and the
            # verdict's throttle, PCIe link and XID/ECC checks unknown (docs/gpu.md).
            topology = {k: v for k, v in topology.items() if k not in LIVE_KEYS}
        return ShmTransport(
            identity=self.identity,
            url=url,
            steps=self.queues.steps,
            collectives=self.queues.collectives,
            events=self.queues.events,
            dropped_elsewhere=self._dropped_on_training_thread,
            topology=topology,
            capacity=self.config.ring_slots,
            before_drain=self._before_drain(),
            finish_rows=self.clock.finish,
        )

    # -- public -------------------------------------------------------------------------------
    def step(self) -> _StepContext:
        """`with agent.step():` marks one training step when no optimizer hook does."""
        return _StepContext(self.clock)

    def count(self, samples: int | None = None, tokens: int | None = None) -> None:
        """Add to the work this rank does in the current step: samples and/or tokens.

        Calls in one step add up (once per micro-batch, or once with the step's totals); for
        that step they replace what the model's inputs show and the `samples_per_step` /
        `tokens_per_step` settings. Call it before the step ends (before `optimizer.step()`,
        or inside `with agent.step()`):

            agent.count(samples=len(batch), tokens=batch["input_ids"].numel())
        """
        try:
            self.clock.work.count(samples, tokens)
        except BaseException as exc:  # noqa: BLE001 - nothing may reach the training loop
            self._on_error(exc)

    def checkpoint(self, kind: str = "save") -> AbstractContextManager[None]:
        """Time the block as one checkpoint save (kind "save") or load ("load").

        torch.save, torch.load and torch.distributed.checkpoint's save and load are timed
        without it (agent/checkpointing.py); use it around other ways of saving or loading
        (safetensors, a framework's own writer). Only the thread that attached the agent is
        timed, and calls nested in a timed call count once:

            with agent.checkpoint("save"):
                save_file(model.state_dict(), path)
        """
        try:
            return checkpointing.CheckpointContext(
                self.checkpoints, checkpointing.checkpoint_kind(kind)
            )
        except BaseException as exc:  # noqa: BLE001 - nothing may reach the training loop
            self._on_error(exc)
            return contextlib.nullcontext()

    def close(self) -> None:
        """Remove hooks and patches, send what is left. Safe to call twice."""
        if self._closed:
            return
        self._closed = True
        # The exit hook holds the agent, and through its clock the model, the optimizer and
        # their process group: a closed agent left registered would keep all of them (GPU
        # memory, gloo's threads) until the interpreter exits.
        atexit.unregister(self.close)
        _OPEN.discard(self)
        with contextlib.suppress(Exception):
            if self.new_optimizer is not None:
                self.new_optimizer.close()
        with contextlib.suppress(Exception):
            if self.hooks is not None:
                self.hooks.remove()
        with contextlib.suppress(Exception):
            checkpointing.uninstall(self.checkpoints)
        self.compiles.uninstall()
        self.clock.after_step = None
        self.clock.on_first_step = None
        if self.patch is not None:
            self.patch.uninstall()
        if self.nccl_reader is not None:
            self.nccl_reader.stop(final=True)  # before the reporter's last send
        self.clock.stop()  # resolve what the GPU has finished, so the reporter sends it
        self.reporter.stop()
        if self.record is not None:
            self.record.close()
        if self.topology is not None:
            self.topology.close()

    @property
    def dropped_total(self) -> int:
        """Records lost so far: refused by a full queue, or in a failed send."""
        return self.reporter.dropped_total

    @property
    def stats(self) -> dict[str, int]:
        """Counters for the curious (and the tests): steps seen, records sent and dropped."""
        return {
            "steps": self.clock.step,
            "sent_records": self.reporter.sent_records,
            "dropped_records": self.dropped_total,
            "errors": self.errors + self.reporter.errors,
        }

    # -- construction -------------------------------------------------------------------------
    def _number_steps(self, optimizers: list[Any], config: AgentConfig) -> None:
        """Step numbers that continue across restarts, and what the startup is measured from."""
        clock = self.clock
        if config.start_step is not None and config.start_step > 0:
            clock.step = int(config.start_step)
        elif config.start_step is None and optimizers:
            clock.detect_start = optimizers
        # The process's start on the clock's timeline (perf_counter ns).
        offset = time.time_ns() - time.perf_counter_ns()
        clock.process_started_ns = int(self.identity["process_started_unix_s"] * 1e9) - offset
        clock.on_first_step = self._after_first_step

    def _after_first_step(self) -> None:
        try:  # a torch.distributed.checkpoint imported after attach() is wrapped now
            checkpointing.wrap_available()
        except Exception as exc:  # noqa: BLE001
            self._on_error(exc)
        self.compiles.install()  # and a torch.compile'd model has compiled in it

    def _count_work(self, torch: Any, model: Any, config: AgentConfig) -> None:
        """Samples and tokens per step: as set, else read from the model's inputs."""
        work = self.clock.work
        if config.samples_per_step is not None and config.samples_per_step >= 0:
            work.samples_per_step = min(MAX_WORK, config.samples_per_step)
        if config.tokens_per_step is not None and config.tokens_per_step >= 0:
            work.tokens_per_step = min(MAX_WORK, config.tokens_per_step)
        both_set = work.samples_per_step >= 0 and work.tokens_per_step >= 0
        if model is not None and torch is not None and config.detect_work and not both_set:
            work.count_inputs(torch, config.batch_argument)

    def _make_clock(
        self,
        torch: Any,
        model: Any,
        ddp_model: Any,
        ddp_group: str | None,
        ddp_bytes: float,
        timeline: StepTimeline | None,
        cuda_index: int | None,
    ) -> PhaseClock:
        """The CPU phase clock, or with a step timeline (CUDA) the one that also records CUDA
        events at each boundary and resolves them into GPU-side phases on a thread of its own."""
        queue_callback = None
        if model is not None and torch is not None:
            queue_callback = torch.autograd.Variable._execution_engine.queue_callback
        args = (
            self.queues.steps,
            self.queues.collectives,
            queue_callback,
            ddp_group,
            ddp_bytes,
            self._on_error,
        )
        if timeline is None or cuda_index is None:
            return PhaseClock(*args, ddp_model=ddp_model)
        from syncscope.agent import cuda_timing

        stream_of = cuda_timing.torch_stream_of(torch, cuda_index)
        return cuda_timing.CudaPhaseClock(
            *args,
            ddp_model=ddp_model,
            timeline=timeline,
            event_factory=cuda_timing.torch_event_factory(torch, stream_of),
            stream_of=stream_of,
            resolve_every=self.config.align_every_steps,
        )

    def _flight_recorder_reader(
        self, torch: Any, timeline: StepTimeline | None
    ) -> FlightRecorderReader | None:
        """NCCL collectives' durations, where this torch has Flight Recorder (CUDA builds)."""
        from syncscope.agent import nccl_trace

        if not (_dist_available(torch) and nccl_trace.flight_recorder_available(torch)):
            return None
        after, _timed = nccl_trace.check_timing_at_attach(torch)
        return nccl_trace.FlightRecorderReader(
            self.queues.collectives,
            timeline=timeline,
            current_step=self.queues.current_step,
            attached_after_group=after,
        )

    def _intercept_collectives(
        self, torch: Any, labels: GroupLabels, model: Any, ddp_model: Any, ddp_group: str | None
    ) -> CollectiveInterceptor | None:
        """The dispatcher-level timing of every c10d op (installed with the other hooks).

        DDP's reducer all-reduces its buckets on the DDP group while a backward is pending: that
        sync is timed as its exposed part (phases.py), and with `detail="buckets"` per bucket by
        the comm hook (collectives.bucket_timing_hook), so those calls are left out here."""
        if not (self.config.patch_collectives and torch is not None and _dist_available(torch)):
            return None
        clock = self.clock
        return CollectiveInterceptor(
            self.queues,
            labels,
            Blocked(),
            skip_group=getattr(ddp_model, "process_group", None) if ddp_group else None,
            skip_while=lambda: clock.bwd_pending or clock.bwd_depth > 0,
            native=self.config.native_collectives,
            watch=_ddp_outside(torch, model) if ddp_group is None else None,
            on_skipped=_ddp_unseen(torch, model, ddp_model) if ddp_group is not None else None,
        )

    def _native_backward(self, torch: Any) -> Native | None:
        """The C++ library for the backward's trigger and the hooks in C, where it is built and
        asked for (CudaPhaseClock's trigger stays Python: it marks callback A with a CUDA event,
        phase_hooks.instrument)."""
        if torch is None or not self.config.native_backward:
            return None
        from syncscope.agent import native

        return native.load(torch)

    def _enable_pacing(self, arrival: LocalArrival) -> PacingController:
        """Pacing (paper §5.3, agent/pacing.py) at the step boundary (agent/step_pacing.py)."""
        from syncscope.agent.pacing import PacingConfig, PacingController

        config = replace(PacingConfig.from_env(), world_size=int(self.identity["world_size"]))
        controller = PacingController(config)
        labels, reader = self.labels, self.nccl_reader

        def group_count() -> int:  # the gloo path's groups, or those in NCCL's dumps
            return max(labels.group_count(), reader.labels.group_count() if reader else 0)

        self.clock.pacer = StepPacer(
            controller, arrival, self.config.pacing_kill_file, group_count
        ).pace
        return controller

    def _time_buckets(self, model: Any, ddp_group: str) -> None:
        patch, step_of = self.patch, self.queues.current_step

        def record(size: int, duration_ns: int) -> None:  # on a gloo thread: append only
            # NCCL buckets (no interceptor on CUDA) are Flight Recorder's, never a CPU timer's
            if patch is not None:
                patch.record("all_reduce", ddp_group, size, duration_ns, step_of())

        for each in _ddp_models(model):
            try:
                each.register_comm_hook(
                    each.process_group, bucket_timing_hook(self.identity["world_size"], record)
                )
            except Exception as exc:  # noqa: BLE001 - e.g. the user registered their own hook
                log.warning("syncscope: per-bucket timing unavailable (%s); default path only", exc)

    # -- internals ----------------------------------------------------------------------------
    def _on_error(self, exc: BaseException) -> None:
        self.errors += 1
        self.last_error = exc
        if self.errors == 1:
            log.warning("syncscope: a hook failed and was ignored: %r", exc)

    def _dropped_on_training_thread(self) -> int:
        return (
            self.clock.dropped
            + (self.patch.dropped if self.patch is not None else 0)
            + (self.nccl_reader.stats["dropped"] if self.nccl_reader is not None else 0)
        )


class InertAgent:
    """What attach() returns when syncscope is switched off or could not start: the same
    interface as `Agent`, doing nothing."""

    def __init__(self) -> None:
        self.errors = 0
        self.last_error: BaseException | None = None

    def step(self) -> AbstractContextManager[None]:
        return contextlib.nullcontext()

    def count(self, samples: int | None = None, tokens: int | None = None) -> None:
        pass

    def checkpoint(self, kind: str = "save") -> AbstractContextManager[None]:
        return contextlib.nullcontext()

    def close(self) -> None:
        pass

    @property
    def dropped_total(self) -> int:
        return 0

    @property
    def stats(self) -> dict[str, int]:
        return {"steps": 0, "sent_records": 0, "dropped_records": 0, "errors": 0}


def _identity(config: AgentConfig) -> dict[str, Any]:
    """Who reports: the process's rank and host, the job, and this incarnation of the agent."""
    identity = process_identity()
    now = time.time()
    identity.update(
        job=config.job[:MAX_LABEL_LEN],
        incarnation=uuid.uuid4().hex[:16],
        started_unix_s=now,
        # Startup is measured from here: the kernel's start of the process, else attach().
        process_started_unix_s=process_started_unix_s() or now,
    )
    return identity


def _import_torch() -> Any:
    try:
        import torch

        return torch
    except ImportError:
        return None


def model_parts(torch: Any, model: Any) -> Any:
    """`model` as attach() takes it: None, one module, or a pipeline rank's stages (a list or
    tuple of modules, or an nn.ModuleList, whose own forward nobody calls) as a list."""
    if isinstance(model, (list, tuple)) or (
        torch is not None and isinstance(model, torch.nn.ModuleList)
    ):
        parts = list(model)
        return parts[0] if len(parts) == 1 else parts or None
    return model


def _ddp_sync(torch: Any, model: Any, labels: GroupLabels) -> tuple[Any, str | None, float]:
    """(the DDP module, its group's label, bytes of gradients it synchronises per step), or
    (None, None, 0.0) when the model synchronises no gradients through DDP. Several DDP modules
    (a GAN's two: attach(model=[generator, critic])) on the first one's group are one DdpModels;
    the buckets of one on another group are timed as that group's all-reduces."""
    if model is None or torch is None:
        return None, None, 0.0
    ddp = torch.nn.parallel.DistributedDataParallel
    models = [m for m in parts_of(model) if isinstance(m, ddp)]
    if not models:
        return None, None, 0.0
    group = models[0].process_group
    models = [m for m in models if m.process_group is group]
    synced = models[0] if len(models) == 1 else DdpModels(models)
    return synced, labels(group), float(sum(map(_grad_bytes, models)))


def _ddp_outside(torch: Any, model: Any) -> DdpOutside | None:
    """The DdpOutside check for `model` (one module or a list), where it is a module DDP could
    wrap unseen: none of it DDP, FSDP or DTensor-parallel (whose own all-reduces in backward,
    HSDP's, tensor parallel's, are not DDP's), and with gradients to synchronise."""
    parts = parts_of(model)
    try:
        from torch.distributed import fsdp
        from torch.distributed.tensor import DTensor
    except ImportError:
        return None
    wrappers = tuple(
        kind
        for kind in (
            torch.nn.parallel.DistributedDataParallel,
            getattr(fsdp, "FSDPModule", None),
            getattr(fsdp, "FullyShardedDataParallel", None),
        )
        if isinstance(kind, type)
    )
    if any(isinstance(part, wrappers) for part in parts):
        return None
    if any(isinstance(p, DTensor) for part in parts for p in part.parameters()):
        return None
    total = sum(map(_grad_bytes, parts))
    return DdpOutside(total) if total else None


def _ddp_unseen(torch: Any, model: Any, ddp_model: Any) -> DdpUnseen | None:
    """The DdpUnseen check for the DDP model(s) the agent times the sync of, unless `model` has
    SyncBatchNorm (whose backward all-reduces on the same group)."""
    parts = parts_of(model)
    if any(isinstance(m, torch.nn.SyncBatchNorm) for part in parts for m in part.modules()):
        return None
    return DdpUnseen([_grad_bytes(m) for m in _ddp_models(ddp_model)])


def _ddp_models(ddp_model: Any) -> list[Any]:
    """The DDP modules behind the clock's `ddp_model`: one, or a DdpModels' several."""
    return ddp_model.models if isinstance(ddp_model, DdpModels) else [ddp_model]


def _grad_bytes(module: Any) -> int:
    """The bytes of `module`'s trainable parameters: what DDP's buckets hold for it."""
    return sum(p.numel() * p.element_size() for p in module.parameters() if p.requires_grad)


class DdpModels:
    """Several DDP modules on one process group, as the clock takes its `ddp_model`: their
    buckets are all-reduced in the same backwards (a GAN's generator loss reaches both), and
    DDP's sync is due when any of them synchronises (not all under `no_sync()`). A sync record's
    bytes are all of theirs, also where a backward reaches only one (the critic's own loss)."""

    __slots__ = ("models", "process_group")

    def __init__(self, models: list[Any]) -> None:
        self.models = models
        self.process_group = models[0].process_group

    @property
    def require_backward_grad_sync(self) -> bool:
        return any(m.require_backward_grad_sync for m in self.models)


def _cuda_device(torch: Any, model: Any, optimizers: list[Any]) -> int | None:
    """The CUDA device the model (or optimizers') parameters live on; None on CPU."""
    if torch is None:
        return None
    try:
        first = next((p for m in parts_of(model) for p in m.parameters()), None)
        if first is None:
            params = (p for o in optimizers for g in o.param_groups for p in g["params"])
            first = next(params, None)
        if first is not None and first.is_cuda:
            index = first.device.index
            return index if index is not None else torch.cuda.current_device()
    except Exception:  # noqa: BLE001
        pass
    return None


def _step_timeline() -> StepTimeline:
    from syncscope.agent.nccl_trace import StepTimeline

    return StepTimeline()


def _topology_sampler(torch: Any, cuda_index: int) -> TopologySampler | None:
    from syncscope.agent.topology import TopologySampler, locator_from_torch

    try:
        return TopologySampler(locator_from_torch(torch, cuda_index))
    except Exception as exc:  # noqa: BLE001 - topology is never worth failing attach
        log.info("syncscope: no GPU topology (%r)", exc)
        return None


def _dist_available(torch: Any) -> bool:
    try:
        import torch.distributed as dist

        return bool(dist.is_available())
    except Exception:  # noqa: BLE001
        return False


# The agents attached in this process and not yet closed: at most one, since attach() closes
# an earlier one (both would report as the same rank).
_OPEN: set[Agent] = set()


def open_agents() -> list[Agent]:
    """The agents attached in this process and not closed."""
    return list(_OPEN)


def attach(
    model: Any = None, optimizer: Any = None, exporter: str | None = None, **config: Any
) -> RankAgent:
    """Attach syncscope to this rank's training.

    model      the (DDP-wrapped) module: phases from its forward and backward; or a list of
               modules, every one's forward timed: a pipeline rank's stages (torchtitan's
               model_parts), or every model a step trains (a GAN's generator and critic)
    optimizer  step boundaries from its post-step hook, and the optimizer phase; or a list of
               those a step steps, the step ending when each has stepped since the last end
    exporter   http://host:port or unix:///path (default: $SYNCSCOPE_EXPORTER)
    **config   any AgentConfig field (job, detail, pacing, flush_interval_s, ...)
    One agent a process: an agent attached earlier and still open is closed first (an
    in-process restart that attaches again). Never raises because of syncscope itself: on an
    internal failure it logs and returns an agent that does nothing.
    """
    settings = AgentConfig.resolve({"exporter": exporter, **config})
    if settings.disable:
        return InertAgent()
    for earlier in list(_OPEN):  # one agent a process: each would report as this rank
        log.warning(
            "syncscope: attach() while an agent attached earlier in this process is open: "
            "closing that one (its last records sent), so that the exporter counts each step "
            "once; this agent takes over"
        )
        with contextlib.suppress(Exception):
            earlier.close()
    try:
        return Agent(model, optimizer, settings)
    except Exception as exc:  # noqa: BLE001 - observability must not stop training
        log.warning("syncscope: attach failed, continuing without it: %r", exc)
        return InertAgent()
