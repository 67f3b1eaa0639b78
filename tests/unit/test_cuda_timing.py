"""CUDA-event phase timing, on CPU: a fake stream whose events behave like CUDA's (recorded at the
tail of the queue, completed once the stream has run that far). The real CUDA path is checked in
tests/gpu/test_gpu_agent.py."""

from __future__ import annotations

import threading
import time
from collections import deque

import pytest
from syncscope.agent.capture_mode import (
    CU_STREAM_CAPTURE_MODE_THREAD_LOCAL,
    thread_local_capture_mode,
)
from syncscope.agent.cuda_timing import (
    CudaPhaseClock,
    StreamOf,
    torch_event_factory,
    torch_stream_of,
)
from syncscope.agent.nccl_trace import StepTimeline
from syncscope.agent.phase_hooks import (
    Clocks,
    StepOfSeveral,
    instrument,
    timed_backward,
    timed_forward,
)
from syncscope.agent.phases import ROW_WORK

from syncscope.wire import DDP_GRAD_SYNC

# clock: phases judged against sleeps on the real clock (pyproject.toml's markers).
pytestmark = pytest.mark.clock

MS = 1_000_000  # ns


class FakeStream:
    """GPU time in ms: `enqueue` adds work at the tail, `run_all`/`run_to` executes it."""

    def __init__(self) -> None:
        self.tail = 0.0
        self.executed = 0.0
        self.query_threads: set[str] = set()
        self.record_threads: set[str] = set()

    def enqueue(self, ms: float) -> None:
        self.tail += ms

    def run_all(self) -> None:
        self.executed = self.tail


class FakeEvent:
    def __init__(self, stream: FakeStream, fail: bool = False) -> None:
        self.stream = stream
        self.t: float | None = None
        self.fail = fail
        self.fail_query = False
        self.recorded_on: list = []

    def record(self, stream=None) -> None:
        if self.fail:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        self.stream.record_threads.add(threading.current_thread().name)
        self.recorded_on.append(stream)
        self.t = self.stream.tail

    def query(self) -> bool:
        self.stream.query_threads.add(threading.current_thread().name)
        if self.fail_query:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        return self.t is not None and self.stream.executed >= self.t

    def elapsed_time(self, end: FakeEvent) -> float:
        return end.t - self.t  # type: ignore[operator]


class Loop:
    """Drives the clock's hooks in the order a DDP training step fires them."""

    PHASES = {"data": 3.0, "forward": 5.0, "loss": 0.5, "backward": 9.0, "comm": 4.0, "clip": 1.0}
    OPT = 2.0

    def __init__(self, **kw) -> None:
        self.stream = FakeStream()
        self.steps: deque = deque(maxlen=1000)
        self.colls: deque = deque(maxlen=1000)
        self.callbacks: list = []
        self.errors: list[BaseException] = []
        self.clock = CudaPhaseClock(
            self.steps,
            self.colls,
            self.callbacks.append,
            "default_pg",
            4096.0,
            self.errors.append,
            event_factory=kw.pop("event_factory", lambda: FakeEvent(self.stream)),
            **kw,
        )
        # The wrappers the agent puts on the model's forward and on torch.autograd.backward.
        self.forward = timed_forward(self.clock, self.stream.enqueue)
        registered = Clocks()
        registered.clocks = (self.clock,)
        self.backward = timed_backward(self._backward, registered)

    def _backward(self, p: dict[str, float]) -> None:
        """What autograd's engine does inside loss.backward() of a DDP model."""
        self.stream.enqueue(p["backward"])
        self.clock.grad_ready(None)  # the first parameter gradient: queues A (not when quiet)
        if self.callbacks:
            self.callbacks.pop(0)()  # callback A: backward done, queues B
        self.stream.enqueue(p["comm"])
        if self.callbacks:
            self.callbacks.pop(0)()  # callback B: gradients reduced

    def step(self, **override: float) -> None:
        p = {**self.PHASES, **override}
        s, c = self.stream, self.clock
        s.enqueue(p["data"])
        self.forward(p["forward"])
        s.enqueue(p["loss"])
        self.backward(p)
        s.enqueue(p["clip"])
        c.optimizer_pre(None, None, None)
        s.enqueue(override.get("opt", self.OPT))
        c.optimizer_post(None, None, None)


def phases_ms(record: tuple) -> dict[str, float]:
    names = ("data", "forward", "backward", "optimizer", "comm_exposed", "pacing")
    phases = record[3:ROW_WORK]
    return {n: v / MS for n, v in zip(names, phases, strict=True)} | {"total": record[2] / MS}


def test_gpu_timed_steps_carry_the_work_the_cpu_clock_counted():
    """A step goes out with GPU phases, and with the samples and tokens of its own CPU step."""
    loop = Loop()
    for k in range(4):
        loop.clock.work.count(samples=10 + k, tokens=None if k == 2 else 100 * k)
        loop.step()
    loop.stream.run_all()
    assert loop.clock.resolve() == 4 and loop.clock.gpu_steps == 3
    assert [r[ROW_WORK:] for r in loop.steps] == [(10, 0), (11, 100), (12, -1), (13, 300)]


def test_gpu_phases_are_the_gpu_time_between_boundaries_and_add_up():
    loop = Loop()
    for _ in range(5):
        loop.step()
    assert not loop.steps  # nothing reported before the GPU has run it
    loop.stream.run_all()
    assert loop.clock.resolve() == 5
    records = list(loop.steps)
    assert [r[0] for r in records] == [0, 1, 2, 3, 4]
    assert loop.clock.cpu_steps == 1  # step 0 has no start event: CPU phases
    for r in records[1:]:
        p = phases_ms(r)
        assert p["data"] == pytest.approx(3.0)
        assert p["forward"] == pytest.approx(5.0)
        assert p["backward"] == pytest.approx(9.0)
        assert p["comm_exposed"] == pytest.approx(4.0)
        assert p["optimizer"] == pytest.approx(2.0)
        assert p["total"] == pytest.approx(24.5)  # + loss and clipping, which are "other"
        assert sum(r[3:ROW_WORK]) <= r[2]
    ddp = list(loop.colls)
    assert len(ddp) == 5 and all(c[0] == DDP_GRAD_SYNC for c in ddp)
    assert [c[3] for c in ddp[1:]] == [4 * MS] * 4  # the GPU's exposed communication
    assert [c[4] for c in ddp] == [0, 1, 2, 3, 4]
    assert loop.errors == []


def test_steps_are_resolved_in_order_only_once_the_gpu_passed_them():
    loop = Loop()
    for _ in range(3):
        loop.step()
    loop.stream.executed = 24.5 * 1.5  # step 0 done, step 1 half-way
    assert loop.clock.resolve() == 1 and [r[0] for r in loop.steps] == [0]
    loop.stream.run_all()
    assert loop.clock.resolve() == 2 and [r[0] for r in loop.steps] == [0, 1, 2]


def test_a_slow_gpu_phase_shows_in_that_phase():
    loop = Loop()
    loop.step()
    loop.step(backward=30.0)
    loop.step(comm=15.0)
    loop.stream.run_all()
    loop.clock.resolve()
    _, slow_backward, slow_comm = (phases_ms(r) for r in loop.steps)
    assert slow_backward["backward"] == pytest.approx(30.0)
    assert slow_comm["comm_exposed"] == pytest.approx(15.0)


def test_the_resolver_thread_does_all_querying():
    loop = Loop(poll_interval_s=0.01)
    loop.clock.start()
    for _ in range(4):
        loop.step()
    loop.stream.run_all()
    deadline = time.monotonic() + 5
    while len(loop.steps) < 4 and time.monotonic() < deadline:
        time.sleep(0.01)
    loop.clock.stop()
    assert len(loop.steps) == 4
    assert loop.stream.record_threads == {threading.current_thread().name}
    assert loop.stream.query_threads == {"syncscope-cuda-events"}


def test_events_are_reused_not_created_per_step():
    loop = Loop()
    for _ in range(50):
        loop.step()
        loop.stream.run_all()
        loop.clock.resolve()
    assert loop.clock.gpu_steps == 49
    assert loop.clock.events_created <= 2 * 7 + 1  # one step in flight, one resolving, one end


def test_a_full_queue_reports_cpu_phases_and_restarts_the_chain():
    loop = Loop(max_pending=2)
    for _ in range(4):
        loop.step()  # the GPU never catches up meanwhile
    assert [r[0] for r in loop.steps] == [2, 3]  # went out at once, with CPU phases
    loop.stream.run_all()
    loop.clock.resolve()
    loop.step()  # the first step after the break has no start event
    loop.step()
    loop.stream.run_all()
    loop.clock.resolve()
    assert [r[0] for r in loop.steps] == [2, 3, 0, 1, 4, 5]
    assert loop.clock.gpu_steps == 2 and loop.clock.cpu_steps == 4  # 1 and 5 are GPU-timed
    assert phases_ms(loop.steps[-1])["total"] == pytest.approx(24.5)


def test_a_restarted_step_leaves_its_gpu_time_in_no_step():
    """The open step is dropped (the agent followed a new optimizer): its events go back to be
    reused, and the GPU's time since the last step's end (the dropped step's forward and a
    500 ms gap) is in no step: the next one restarts the chain, the one after is GPU-timed."""
    loop = Loop()
    for _ in range(3):
        loop.step()
    loop.stream.enqueue(3.0)
    loop.forward(5.0)  # the dropped step's forward, its marks recorded
    loop.stream.enqueue(500.0)
    marks, free = len(loop.clock.marks), len(loop.clock.free)
    loop.clock.restart_step(time.perf_counter_ns())
    assert marks >= 2 and loop.clock.marks == [] and len(loop.clock.free) == free + marks
    loop.step()
    loop.step()
    loop.stream.run_all()
    loop.clock.resolve()
    assert [r[0] for r in loop.steps] == [0, 1, 2, 3, 4]
    assert all(r[2] < 100 * MS for r in loop.steps), [phases_ms(r) for r in loop.steps]
    assert phases_ms(loop.steps[-1])["total"] == pytest.approx(24.5)
    assert loop.clock.gpu_steps == 3 and loop.errors == []


def test_running_out_of_events_or_a_cuda_error_never_reaches_the_loop():
    loop = Loop(max_events=5)  # fewer than one step needs
    for _ in range(3):
        loop.step()
    loop.stream.run_all()
    loop.clock.resolve()
    assert [r[0] for r in loop.steps] == [0, 1, 2] and loop.clock.gpu_steps == 0
    failing = Loop(event_factory=lambda: FakeEvent(FakeStream(), fail=True))
    for _ in range(3):
        failing.step()
    failing.clock.resolve()
    assert len(failing.steps) == 3 and len(failing.errors) == 3  # one per step, then untimed


def test_pacing_is_fed_the_gpus_exposed_communication_and_sleeps_on_the_cpu():
    # On CUDA the CPU sees ~0 exposed communication (DDP only makes the stream wait): the
    # pacer must be fed each GPU step's, and its delay slept on the training thread.
    loop = Loop()
    fed: list[tuple[int, int]] = []

    def pacer(comm_ns: int, step_ns: int) -> int:
        fed.append((comm_ns, step_ns))
        return 2 * MS  # 2 ms before every next iteration

    loop.clock.pacer = pacer
    for _ in range(3):
        loop.step(data=3.0, comm=7.0)
    loop.stream.run_all()
    loop.clock.resolve()
    assert [c for c, _ in fed] == [7 * MS, 7 * MS]  # steps 1 and 2 (step 0 has no start)
    assert [t for _, t in fed] == [27.5 * MS, 27.5 * MS]
    assert all(r[3 + 5] == 0 for r in loop.steps)  # nothing decided before a GPU step resolved
    loop.step(data=3.0, comm=7.0)
    loop.step(data=3.0, comm=7.0)
    loop.stream.run_all()
    loop.clock.resolve()
    last = phases_ms(loop.steps[-1])
    assert last["pacing"] >= 2.0  # a real time.sleep: at least what was asked
    assert last["data"] == pytest.approx(max(0.0, 3.0 - last["pacing"]))


def test_a_query_that_raises_drops_that_step_and_the_rest_still_resolve():
    loop = Loop()
    for _ in range(4):
        loop.step()
    for _kind, event in loop.clock.pending[1][1]:
        event.fail_query = True  # e.g. a sticky CUDA error seen through this step's events
    loop.stream.run_all()
    assert loop.clock.resolve() == 4
    assert [r[0] for r in loop.steps] == [0, 1, 2, 3]
    assert len(loop.errors) == 1 and loop.clock.query_errors == 1
    assert loop.clock.gpu_steps == 1  # step 3; step 2 starts the new chain
    loop.step()
    loop.stream.run_all()
    assert loop.clock.resolve() == 1 and loop.clock.gpu_steps == 2
    assert len(loop.errors) == 1  # said once, not at every poll


def test_nothing_is_recorded_while_the_stream_is_capturing_a_cuda_graph():
    capturing = [False]
    loop = Loop(stream_of=lambda _fresh: None if capturing[0] else "model-stream")
    recorded: list[FakeEvent] = []
    factory = loop.clock.event_factory
    loop.clock.event_factory = lambda: recorded.append(factory()) or recorded[-1]
    loop.step()
    capturing[0] = True  # e.g. torch.cuda.graph() around the next step
    loop.step()
    during = sum(len(e.recorded_on) for e in recorded)
    capturing[0] = False
    loop.step()
    loop.step()
    loop.stream.run_all()
    loop.clock.resolve()
    assert loop.clock.capture_skips == 1 and during == 7  # only step 0's 7 marks
    assert [r[0] for r in loop.steps] == [0, 1, 2, 3]
    assert loop.clock.gpu_steps == 1  # step 3 (1 untimed, 2 restarts the chain)


def test_events_go_on_the_model_devices_stream_not_the_current_devices():
    lookups: list[int] = []

    class FakeCuda:
        def current_stream(self, device=None):
            lookups.append(device)
            return f"stream-of-{device}"

        def is_current_stream_capturing(self):
            return False

    fake_torch = type("T", (), {"cuda": FakeCuda()})()
    loop = Loop(stream_of=torch_stream_of(fake_torch, 3))  # the model is on cuda:3
    loop.step()
    loop.step()
    streams = {s for _, e in loop.clock.pending[1][1] for s in e.recorded_on}
    assert streams == {"stream-of-3"}
    # looked up at each step's first mark, not at all 7 (a Stream object each: the costly part)
    assert lookups == [3, 3]


class DeviceStream:
    """A stream on a device, as torch.cuda.current_stream returns."""

    device = "cuda:3"


def fake_torch_events(fail: str = "") -> tuple[object, list]:
    """A torch with `Event` (failing at `fail`: "record", "elapsed_time", or "" for none) and
    `cuda.Event`; and the events of the first kind made."""
    made: list = []

    class Event:
        def __init__(self, device=None, enable_timing=False) -> None:
            assert enable_timing
            self.device, self.recorded_on = device, None
            made.append(self)

        def record(self, stream=None) -> None:
            if fail == "record":
                raise RuntimeError("record: not on this device")
            assert stream.device == self.device  # torch checks the stream's device
            self.recorded_on = stream

        def synchronize(self) -> None:
            pass

        def query(self) -> bool:
            return self.recorded_on is not None

        def elapsed_time(self, end) -> float:
            if fail == "elapsed_time":
                raise RuntimeError("elapsed_time is not supported on this device")
            return 0.01

    class CudaEvent:
        def __init__(self, enable_timing=False) -> None:
            assert enable_timing

    cuda = type("Cuda", (), {"Event": CudaEvent})
    return type("T", (), {"Event": Event, "cuda": cuda}), made


def test_marks_take_torch_events_where_they_time_on_the_models_device():
    """torch.Event's record is C (torch.cuda.Event's is a Python method, a frame at every mark):
    the clock's events are torch.Events on the model's device where two of them time each other
    there, else torch.cuda.Events; a stream capturing at attach tries none."""
    streams = StreamOf(lambda: False, DeviceStream)
    fake, made = fake_torch_events()
    factory = torch_event_factory(fake, streams)
    assert len(made) == 2 and all(e.recorded_on is not None for e in made)  # the trial's
    event = factory()
    assert type(event).__name__ == "Event" and event.device == "cuda:3"
    for fail in ("record", "elapsed_time"):
        fake, made = fake_torch_events(fail)
        assert type(torch_event_factory(fake, streams)()).__name__ == "CudaEvent", fail
    fake, made = fake_torch_events()
    capturing = StreamOf(lambda: True, DeviceStream)
    assert type(torch_event_factory(fake, capturing)()).__name__ == "CudaEvent"
    assert made == []  # nothing recorded into a graph being captured
    assert type(torch_event_factory(fake)()).__name__ == "CudaEvent"  # no stream: as before


def test_the_resolver_thread_leaves_global_capture_mode_before_its_first_query():
    entered = threading.local()
    guard_threads: list[str] = []

    def guard() -> bool:
        entered.yes = True
        guard_threads.append(threading.current_thread().name)
        return True

    unguarded: list[str] = []

    class GuardedEvent(FakeEvent):
        def query(self) -> bool:
            if not getattr(entered, "yes", False):
                unguarded.append(threading.current_thread().name)
            return super().query()

    loop = Loop(poll_interval_s=0.01, thread_guard=guard)
    loop.clock.event_factory = lambda: GuardedEvent(loop.stream)
    loop.clock.start()
    for _ in range(3):
        loop.step()
    loop.stream.run_all()
    deadline = time.monotonic() + 5
    while len(loop.steps) < 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    loop.clock.stop()
    assert len(loop.steps) == 3 and loop.stream.query_threads == {"syncscope-cuda-events"}
    assert unguarded == [] and "syncscope-cuda-events" in guard_threads


def test_the_resolver_wakes_at_the_aligned_step_ends_not_on_its_own_timer():
    # Every 4th step end, the same steps on every rank, so their GIL holds coincide; the
    # timer (60 s here) only covers long steps.
    loop = Loop(resolve_every=4, poll_interval_s=60.0)
    loop.clock.start()
    for _ in range(3):
        loop.step()
    loop.stream.run_all()
    time.sleep(0.3)
    assert len(loop.steps) == 0 and len(loop.clock.pending) == 3  # step 3 is not a 4th
    loop.step()  # the 4th step end wakes it
    loop.stream.run_all()
    deadline = time.monotonic() + 5
    while len(loop.steps) < 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    # the 4th step's own events completed after the wake-up may wait for the next one
    assert len(loop.steps) >= 3
    loop.clock.stop()
    assert [r[0] for r in loop.steps] == [0, 1, 2, 3]


def test_thread_local_capture_mode_is_asked_once_per_thread_and_never_raises():
    calls: list[int] = []

    def exchange(mode: int) -> bool:
        calls.append(mode)
        return True

    def broken(mode: int) -> bool:
        raise OSError("libcuda.so.1: cannot open shared object file")

    results: list[bool] = []

    def run() -> None:
        results.append(thread_local_capture_mode(exchange))
        results.append(thread_local_capture_mode(exchange))

    def run_broken() -> None:
        results.append(thread_local_capture_mode(broken))

    for target in (run, run_broken):
        t = threading.Thread(target=target)
        t.start()
        t.join()
    assert calls == [CU_STREAM_CAPTURE_MODE_THREAD_LOCAL]  # once for the thread, thread-local
    assert results == [True, True, False]


def test_stop_flushes_what_the_gpu_never_finished_as_cpu_steps():
    loop = Loop()
    for _ in range(3):
        loop.step()
    t0 = time.monotonic()
    loop.clock.stop(timeout=0.2)
    assert time.monotonic() - t0 < 1.0
    assert [r[0] for r in loop.steps] == [0, 1, 2] and loop.clock.cpu_steps == 3


def test_step_ends_are_marked_on_the_timeline_for_the_nccl_reader():
    timeline = StepTimeline()
    loop = Loop(timeline=timeline)
    before = time.time_ns()
    loop.step()
    loop.step()
    assert [s for _, s in timeline.ends] == [0, 1]
    assert all(before <= t <= time.time_ns() for t, _ in timeline.ends)


def test_manual_steps_time_the_optimizer_to_its_post_hook():
    loop = Loop()
    c, s = loop.clock, loop.stream
    for _ in range(3):
        c.begin_manual_step()
        s.enqueue(1.0)
        c.optimizer_pre(None, None, None)
        s.enqueue(2.0)
        c.optimizer_post(None, None, None)
        s.enqueue(4.0)  # logging after the optimizer, inside the `with agent.step()` block
        c.end_step(time.perf_counter_ns())
    s.run_all()
    c.resolve()
    p = phases_ms(loop.steps[-1])
    assert p["optimizer"] == pytest.approx(2.0) and p["total"] == pytest.approx(7.0)


def test_a_gan_step_of_two_optimizers_on_the_gpu():
    """Both optimizers given (StepOfSeveral), the critic's first: its update is optimizer time,
    the GPU's gap after it before the generator's forward is data, and the step ends at the
    generator's update, with a DDP sync record for each backward."""
    loop = Loop()
    c, s = loop.clock, loop.stream
    critic_opt, generator_opt = object(), object()
    several = StepOfSeveral(c, [generator_opt, critic_opt])
    for _ in range(4):
        s.enqueue(3.0)
        for opt, gap in ((critic_opt, 1.5), (generator_opt, 0.0)):
            loop.forward(5.0)
            loop.backward(Loop.PHASES)  # backward 9, then DDP's sync 4
            c.optimizer_pre(opt, (), {})
            s.enqueue(2.0)
            several.post(opt, (), {})
            s.enqueue(gap)
    s.run_all()
    c.resolve()
    assert [r[0] for r in loop.steps] == [0, 1, 2, 3]
    for r in list(loop.steps)[1:]:
        expected = {"data": 4.5, "forward": 10.0, "backward": 18.0, "optimizer": 4.0}
        expected |= {"comm_exposed": 8.0, "pacing": 0.0, "total": 44.5}
        assert phases_ms(r) == pytest.approx(expected)
    assert len(loop.colls) == 8 and loop.errors == []


def test_the_optimizers_work_around_its_closures_is_optimizer_time_on_the_gpu():
    """optimizer.step(closure) running a DDP model's closure twice (a SAM's step): the GPU's
    work between the step's start, the closures and its end is the optimizer's (the second
    closure's forward took the first gap as data before), the gap before the step data (it
    was `other`), as the CPU clock counts them."""
    loop = Loop()
    c, s = loop.clock, loop.stream
    for _ in range(4):
        s.enqueue(3.0)  # data
        c.optimizer_pre(None, None, None)
        for gap in (0.5, 1.5):  # before each closure: the optimizer's own work
            s.enqueue(gap)
            loop.forward(5.0)
            loop.backward(Loop.PHASES)  # backward 9, then DDP's sync 4
        s.enqueue(2.0)  # the update
        c.optimizer_post(None, None, None)
    s.run_all()
    c.resolve()
    for r in list(loop.steps)[1:]:
        expected = {"data": 3.0, "forward": 10.0, "backward": 18.0, "optimizer": 4.0}
        expected |= {"comm_exposed": 8.0, "pacing": 0.0, "total": 43.0}
        assert phases_ms(r) == pytest.approx(expected)
    assert loop.errors == []


def test_with_real_torch_hooks_on_cpu():
    torch = pytest.importorskip("torch")
    stream = FakeStream()

    class WallEvent(FakeEvent):
        def record(self) -> None:  # "GPU time" = host time: a CPU loop is its own stream
            self.t = time.perf_counter_ns() / MS

        def query(self) -> bool:
            return True

    steps: deque = deque(maxlen=100)
    errors: list = []
    clock = CudaPhaseClock(
        steps,
        deque(maxlen=100),
        torch.autograd.Variable._execution_engine.queue_callback,
        None,
        0.0,
        errors.append,
        event_factory=lambda: WallEvent(stream),
    )
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    hooks = instrument(clock, model, opt)
    x = torch.randn(32, 64)
    for _ in range(6):
        time.sleep(0.002)
        opt.zero_grad()
        model(x).pow(2).mean().backward()
        opt.step()
    hooks.remove()
    clock.resolve()
    assert errors == [] and len(steps) == 6 and clock.gpu_steps == 5
    for r in list(steps)[1:]:
        p = phases_ms(r)
        assert p["data"] >= 1.5 and p["forward"] > 0 and p["backward"] > 0 and p["optimizer"] > 0
        assert sum(r[3:ROW_WORK]) <= r[2]
