"""attach(): wires the phase clock, collective timing, pacing and the reporter into a job."""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import sys
import time
import uuid
from collections import deque
from typing import Any

from syncscope.agent.collectives import CollectivePatch, GroupLabels, bucket_timing_hook
from syncscope.agent.config import AgentConfig, process_identity
from syncscope.agent.nccl_trace import nccl_group_exists
from syncscope.agent.phases import PhaseClock
from syncscope.agent.transport import Reporter

log = logging.getLogger("syncscope.agent")


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
        try:
            self.clock.end_step(time.perf_counter_ns())
        except BaseException as exc:  # noqa: BLE001
            self.clock.on_error(exc)


class Agent:
    """One rank's agent. Use `attach()` to make one; `close()` (or process exit) ends it."""

    def __init__(self, model: Any, optimizer: Any, config: AgentConfig) -> None:
        self.config = config
        self.errors = 0
        self.last_error: BaseException | None = None
        self._closed = False
        steps: deque = deque(maxlen=config.queue_size)
        collectives: deque = deque(maxlen=config.queue_size * 4)
        torch = sys.modules.get("torch") if model is None and optimizer is None else _import_torch()
        labels = GroupLabels()
        ddp_group, ddp_bytes, queue_callback, ddp_model = None, 0.0, None, None
        if model is not None and torch is not None:
            queue_callback = torch.autograd.Variable._execution_engine.queue_callback
            ddp = torch.nn.parallel.DistributedDataParallel
            if isinstance(model, ddp):
                ddp_model = model
                ddp_group = labels(model.process_group)
                ddp_bytes = float(
                    sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
                )
        # On CUDA (docs/gpu.md): GPU-side phases from CUDA events, NCCL durations from Flight
        # Recorder, GPU topology from NVML/sysfs; all resolved or read off the training thread.
        cuda_index = _cuda_device(torch, model, optimizer)
        clock_cls, clock_kw, timeline = PhaseClock, {}, None
        if cuda_index is not None:
            from syncscope.agent.cuda_timing import CudaPhaseClock
            from syncscope.agent.nccl_trace import StepTimeline

            timeline = StepTimeline()
            clock_cls, clock_kw = CudaPhaseClock, {"timeline": timeline}
        self.clock = clock_cls(
            steps,
            collectives,
            queue_callback,
            ddp_group,
            ddp_bytes,
            self._on_error,
            ddp_model=ddp_model,
            **clock_kw,
        )
        self.nccl_reader: Any = None
        self.topology: Any = None
        if cuda_index is not None:
            from syncscope.agent import nccl_trace
            from syncscope.agent.topology import TopologySampler, locator_from_torch

            if _dist_available(torch) and nccl_trace.flight_recorder_available(torch):
                after, _timed = nccl_trace.check_timing_at_attach(torch)
                self.nccl_reader = nccl_trace.FlightRecorderReader(
                    collectives,
                    timeline=timeline,
                    current_step=lambda: self.clock.step,
                    attached_after_group=after,
                )
            try:
                self.topology = TopologySampler(locator_from_torch(torch, cuda_index))
            except Exception as exc:  # noqa: BLE001 - topology is never worth failing attach
                log.info("syncscope: no GPU topology (%r)", exc)
        identity = process_identity()
        identity.update(
            job=config.job[:64], incarnation=uuid.uuid4().hex[:16], started_unix_s=time.time()
        )
        self.identity = identity

        self.patch: CollectivePatch | None = None
        # NCCL calls return before the GPU runs them: a CPU timer would time the enqueue only;
        # Flight Recorder gives their real durations instead.
        if (
            config.patch_collectives
            and torch is not None
            and _dist_available(torch)
            and not nccl_group_exists(torch)
        ):
            self.patch = CollectivePatch(collectives, lambda: self.clock.step, labels)
            self.patch.install()
        self.pacer: Any = None
        self.reporter = Reporter(
            identity=identity,
            url=config.exporter,
            token=config.token,
            steps=steps,
            collectives=collectives,
            flush_interval_s=config.flush_interval_s,
            send_timeout_s=config.send_timeout_s,
            record_path=config.record.replace("{rank}", str(identity["rank"]))
            if config.record
            else None,
            dropped_elsewhere=self._dropped_on_training_thread,
            pacing_state=self._pacing_state,
            topology=self.topology if self.topology is not None else (lambda: None),
            estimate=config.pacing,  # (and the record file, which the reporter knows of)
        )
        if config.pacing:
            self._enable_pacing()
        self.clock.instrument(model, optimizer)
        if model is not None and config.detail == "buckets" and ddp_group is not None:
            try:
                model.register_comm_hook(
                    model.process_group, bucket_timing_hook(identity["world_size"])
                )
            except Exception as exc:  # noqa: BLE001 - e.g. the user registered their own hook
                log.warning("syncscope: per-bucket timing unavailable (%s); default path only", exc)
        self.reporter.start()
        if cuda_index is not None:
            self.clock.start()  # the CUDA-event resolver thread
        if self.nccl_reader is not None:
            self.nccl_reader.start()
        atexit.register(self.close)

    # -- public -------------------------------------------------------------------------------
    def step(self) -> _StepContext:
        """`with agent.step():` marks one training step when no optimizer hook does."""
        return _StepContext(self.clock)

    def close(self) -> None:
        """Remove hooks and patches, send what is left. Safe to call twice."""
        if self._closed:
            return
        self._closed = True
        with contextlib.suppress(Exception):
            self.clock.uninstrument()
        if self.patch is not None:
            self.patch.uninstall()
        if self.nccl_reader is not None:
            self.nccl_reader.stop()
        stop_clock = getattr(self.clock, "stop", None)
        if stop_clock is not None:
            stop_clock()  # resolve what the GPU has finished, so the reporter sends it
        self.reporter.stop()
        if self.topology is not None:
            self.topology.close()

    @property
    def stats(self) -> dict[str, int]:
        """Counters for the curious (and the tests): steps seen, records sent and dropped."""
        return {
            "steps": self.clock.step,
            "sent_records": self.reporter.sent_records,
            "dropped_records": self.reporter.dropped_total,
            "errors": self.errors + self.reporter.errors,
        }

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

    def _enable_pacing(self) -> None:
        """Pacing (paper §5.3, controller in agent/pacing.py) at the step boundary.

        The wait fed to the controller is this step's exposed DDP sync minus the node-wide
        transfer baseline; until a baseline is known (first flush) nothing is fed, so start-up
        transients cannot engage it. The kill file, checked every step (one stat, ~1 µs, only
        with pacing on), switches pacing off for the rest of the process's life.
        """
        from dataclasses import replace

        from syncscope.agent.pacing import PacingConfig, PacingController

        config = replace(PacingConfig.from_env(), world_size=int(self.identity["world_size"]))
        pacer = self.pacer = PacingController(config)
        kill_file = self.config.pacing_kill_file
        exists = os.path.exists
        reporter = self.reporter

        def pace(comm_ns: int, step_ns: int) -> int:
            if kill_file is not None and exists(kill_file):
                if pacer.enabled:
                    pacer.disable()
                    log.warning("syncscope: pacing switched off by %s", kill_file)
                return 0
            baseline = reporter.ddp_baseline_s
            if baseline <= 0.0 or not pacer.enabled:
                return 0
            delay = pacer.update(max(0.0, comm_ns / 1e9 - baseline), step_ns / 1e9)
            return int(delay * 1e9)

        self.clock.pacer = pace

    def _pacing_state(self) -> dict[str, Any] | None:
        p = self.pacer
        if p is None:
            return None
        return {
            "enabled": bool(p.enabled),
            "active": bool(p.active),
            "current_delay_s": float(p.current_delay_s),
            "threshold_s": float(p.threshold_s),
            "engagements": int(p.engagements),
            "total_delay_s": float(p.total_delay_s),
        }


def _import_torch() -> Any:
    try:
        import torch

        return torch
    except ImportError:
        return None


def _cuda_device(torch: Any, model: Any, optimizer: Any) -> int | None:
    """The CUDA device the model (or optimizer) parameters live on; None on CPU."""
    if torch is None:
        return None
    try:
        first = next(iter(model.parameters()), None) if model is not None else None
        if first is None and optimizer is not None:
            first = next((p for g in optimizer.param_groups for p in g["params"]), None)
        if first is not None and first.is_cuda:
            index = first.device.index
            return index if index is not None else torch.cuda.current_device()
    except Exception:  # noqa: BLE001
        pass
    return None


def _dist_available(torch: Any) -> bool:
    try:
        import torch.distributed as dist

        return bool(dist.is_available())
    except Exception:  # noqa: BLE001
        return False


class _DisabledAgent:
    """What attach() returns under SYNCSCOPE_DISABLE=1: the same surface, doing nothing."""

    stats: dict[str, int] = {"steps": 0, "sent_records": 0, "dropped_records": 0, "errors": 0}

    def step(self) -> Any:
        import contextlib

        return contextlib.nullcontext()

    def close(self) -> None:
        pass


def attach(
    model: Any = None, optimizer: Any = None, exporter: str | None = None, **config: Any
) -> Any:
    """Attach syncscope to this rank's training.

    model      the (DDP-wrapped) module: phases from its forward and backward
    optimizer  step boundaries from its post-step hook, and the optimizer phase
    exporter   http://host:port or unix:///path (default: $SYNCSCOPE_EXPORTER)
    **config   any AgentConfig field (job, detail, pacing, flush_interval_s, ...)
    Never raises because of syncscope itself: on an internal failure it logs and returns an
    agent that does nothing.
    """
    settings = AgentConfig.resolve({"exporter": exporter, **config})
    if settings.disable:
        return _DisabledAgent()
    try:
        return Agent(model, optimizer, settings)
    except Exception as exc:  # noqa: BLE001 - observability must not stop training
        log.warning("syncscope: attach failed, continuing without it: %r", exc)
        return _DisabledAgent()
