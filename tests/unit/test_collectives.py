"""The collective interceptor: every c10d op on CPU tensors is timed at the dispatcher, whatever
API issued it, and the training thread's waits for collectives are counted as blocked."""

from __future__ import annotations

import collections
import threading
import time
from typing import Any

import pytest

torch = pytest.importorskip("torch")

import torch.distributed as dist  # noqa: E402
from syncscope.agent import attach  # noqa: E402
from syncscope.agent.collectives import (  # noqa: E402
    C10D_OPS,
    MAX_UNWAITED,
    NOT_COLLECTIVES,
    Blocked,
    CollectiveInterceptor,
    GroupLabels,
    group_label,
)
from syncscope.agent.phases import COMM_END, FWD_POST  # noqa: E402
from syncscope.agent.queues import RecordQueues  # noqa: E402

from syncscope.wire import OPS, Phase  # noqa: E402
from tests.conftest import step_rows  # noqa: E402

# clock: phases judged against sleeps on the real clock (pyproject.toml's markers).
pytestmark = pytest.mark.clock


def c10d_schemas() -> dict[str, object]:
    # The dispatcher's registry is the one list of what torch can run as a c10d op; torch has
    # no public listing of it, so this test (not the agent) reads it through torch._C.
    import torch.distributed  # noqa: F401 - registers the c10d ops

    return {
        s.name.removeprefix("c10d::"): s
        for s in torch._C._jit_get_all_schemas()
        if s.name.startswith("c10d::")
    }


def test_every_c10d_op_this_torch_registers_is_intercepted_or_known_not_to_be_one():
    schemas = c10d_schemas()
    assert schemas, "no c10d ops registered: torch.distributed is unavailable?"
    missing = sorted(set(schemas) - set(C10D_OPS) - NOT_COLLECTIVES)
    assert not missing, f"c10d ops syncscope does not time (add them to C10D_OPS): {missing}"
    for name, (label, group_at, size_at) in C10D_OPS.items():
        if name not in schemas:
            continue  # an op an older torch lacks is skipped at install
        args = schemas[name].arguments
        assert "ProcessGroup" in str(args[group_at].type), (name, args[group_at])
        assert label in OPS, (name, label)
        if size_at is not None:
            assert "Tensor" in str(args[size_at].type), (name, args[size_at])


def test_group_labels_name_the_mesh_dimension_or_the_group():
    assert group_label("3", "mesh_tp") == "tp"
    assert group_label("0", "default_pg") == "default_pg"
    assert group_label("7", "undefined") == "pg7"
    assert group_label("7", "") == "pg7"


@pytest.fixture(params=["c++", "python"])
def intercepted(gloo_world_of_one, request):
    """An interceptor with the C++ kernel (which `scripts/setup` builds: its absence is a
    failure here, not a skip) and one with the Python fallback."""
    queues = RecordQueues(1024)
    blocked = Blocked()
    interceptor = CollectiveInterceptor(
        queues, GroupLabels(), blocked, native=request.param == "c++"
    )
    interceptor.install()
    try:
        assert interceptor.kernel == request.param, (
            "no C++ kernel for this torch: run `python -m syncscope.agent.native`"
        )
        yield queues.collectives, blocked, interceptor
    finally:
        interceptor.uninstall()


def ops_of(
    sink: collections.deque, interceptor: CollectiveInterceptor, settle_s: float = 2.0
) -> list[tuple]:
    """The records so far; completions arrive on gloo's thread, so wait for them briefly (the
    C++ kernel keeps them until a poll, which the transports do before they drain)."""
    deadline = time.monotonic() + settle_s
    seen = -1
    while time.monotonic() < deadline:
        interceptor.poll()
        if len(sink) == seen:
            break
        seen = len(sink)
        time.sleep(0.05)
    return list(sink)


def test_every_api_that_issues_a_collective_is_timed_with_its_size(intercepted):
    sink, _blocked, interceptor = intercepted
    import torch.distributed._functional_collectives as funcol

    t = torch.ones(256)  # 1 KiB
    out = torch.empty(256)
    single = hasattr(dist, "all_gather_single")  # the names torch 2.13 added
    dist.all_reduce(t)
    (dist.all_gather_single if single else dist.all_gather_into_tensor)(out, t)
    # gloo emulates this one with a Work that has no future: timed to the end of its wait()
    (dist.reduce_scatter_single if single else dist.reduce_scatter_tensor)(out, t)
    dist.broadcast(t, src=0)
    dist.barrier()
    work = dist.all_reduce(t, async_op=True)
    work.wait()
    funcol.wait_tensor(funcol.all_reduce(t, "sum", dist.group.WORLD))
    got = [(op, group, size) for op, group, size, _d, _s in ops_of(sink, interceptor)]
    assert got == [
        ("all_reduce", "default_pg", 1024),
        ("all_gather", "default_pg", 1024),
        ("reduce_scatter", "default_pg", 1024),
        ("broadcast", "default_pg", 1024),
        ("barrier", "default_pg", 0),
        ("all_reduce", "default_pg", 1024),
        ("all_reduce", "default_pg", 1024),
    ], got
    assert all(d > 0 for _op, _g, _s, d, _step in sink)
    assert interceptor.dropped == 0


def test_collectives_nobody_waits_for_in_python_neither_leak_nor_count_as_lost(intercepted):
    # DDP waits for its own broadcasts in C++: the interceptor never sees their wait. The C++
    # kernel times them to their completion all the same; the Python one leaves them out.
    sink, _blocked, interceptor = intercepted
    n = 3 * MAX_UNWAITED
    for _ in range(n):
        work = dist.all_reduce(torch.ones(4), async_op=True)
        deadline = time.monotonic() + 5
        while not work.is_completed() and time.monotonic() < deadline:  # done, never waited
            time.sleep(0.0001)
    assert len(interceptor.pending) <= MAX_UNWAITED
    got = ops_of(sink, interceptor)
    assert interceptor.dropped == 0
    if interceptor.kernel == "c++":
        assert len(got) == n and all(d > 0 for _o, _g, _s, d, _step in got)
    else:
        assert got == []


def test_a_new_group_gets_its_own_label(intercepted):
    sink, _blocked, interceptor = intercepted
    group = dist.new_group([0], group_desc="tp") if _takes_desc() else dist.new_group([0])
    dist.all_reduce(torch.ones(4), group=group)
    (record,) = ops_of(sink, interceptor)
    assert record[1] == (
        "tp" if _takes_desc() else f"pg{dist.distributed_c10d._get_process_group_name(group)}"
    )


def _takes_desc() -> bool:
    import inspect

    return "group_desc" in inspect.signature(dist.new_group).parameters


def test_waits_on_the_training_thread_are_blocked_time_and_others_are_not(intercepted):
    _sink, blocked, _ = intercepted
    before = blocked.ns
    dist.all_reduce(torch.ones(4))  # synchronous: torch.distributed waits on the work
    assert blocked.ns > before
    mid = blocked.ns

    def elsewhere() -> None:
        dist.all_reduce(torch.ones(4)).__class__  # noqa: B018 - issued and waited off-thread

    thread = threading.Thread(target=elsewhere)
    thread.start()
    thread.join()
    assert blocked.ns == mid


def test_uninstall_leaves_torch_as_it_was(gloo_world_of_one):
    queues = RecordQueues(64)
    before = dist.Work.wait
    interceptor = CollectiveInterceptor(queues, GroupLabels(), Blocked())
    interceptor.install()
    assert dist.Work.wait is not before
    interceptor.uninstall()
    assert dist.Work.wait is before
    dist.all_reduce(torch.ones(4))
    assert list(ops_of(queues.collectives, interceptor, 0.3)) == []


def train(model: torch.nn.Module, steps: int, *shape: int) -> Any:
    """attach() to `model` (no exporter, no flush, every step's phases timed), then `steps`
    training steps; the agent. A model with a `blocked` attribute gets the agent's
    collectives.Blocked there."""
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    agent = attach(model=model, optimizer=opt, exporter=None, flush_interval_s=3600, phase_every=1)
    if hasattr(model, "blocked"):
        model.blocked = agent.patch.blocked
    try:
        for _ in range(steps):
            model(torch.randn(*shape)).sum().backward()
            opt.step()
            opt.zero_grad()
    except BaseException:
        agent.close()
        raise
    return agent


@pytest.mark.parametrize("kernel", ["c++", "python"])
def test_ddp_gradient_sync_is_timed_once_as_its_exposed_part(
    gloo_world_of_one, monkeypatch, kernel
):
    monkeypatch.delenv("SYNCSCOPE_EXPORTER", raising=False)
    monkeypatch.setenv("SYNCSCOPE_NATIVE_COLLECTIVES", "1" if kernel == "c++" else "0")
    agent = train(torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(64, 64)), 3, 8, 64)
    try:
        assert agent.patch.kernel == kernel
        dist.all_reduce(torch.ones(4))  # the user's own call on the same group still counts
        ops = [(op, step) for op, _g, _s, _d, step in ops_of(agent.queues.collectives, agent.patch)]
        # Its bucket all-reduces in backward are not recorded beside the sync. DDP's own
        # broadcasts (its bucket order, after the first step), which it waits for in C++, are
        # timed to their completion by the C++ kernel; the Python one never sees them end.
        broadcasts = [o for o in ops if o[0] == "broadcast"]
        assert [o for o in ops if o[0] != "broadcast"] == [
            ("ddp_grad_sync", 0),
            ("ddp_grad_sync", 1),
            ("ddp_grad_sync", 2),
            ("all_reduce", 3),
        ]
        assert (broadcasts != []) == (kernel == "c++"), ops
    finally:
        agent.close()


class AllToAll(torch.autograd.Function):
    """An expert-parallel dispatch: an all-to-all in forward, its gradient's in backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        out = torch.empty_like(x)
        dist.all_to_all_single(out, x.contiguous(), group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        out = torch.empty_like(grad)
        dist.all_to_all_single(out, grad.contiguous(), group=ctx.group)
        return out, None


@pytest.mark.parametrize("kernel", ["c++", "python"])
def test_collectives_in_backward_on_ddps_group_are_recorded_and_its_buckets_are_not(
    gloo_world_of_one, monkeypatch, kernel
):
    """A custom autograd.Function's all-to-all in backward, on DDP's own group: recorded as
    every other call is (2 a step, the job's own count); DDP's bucket all-reduces, issued in
    the same backward on the same group, are still its sync and no all_reduce record."""
    monkeypatch.delenv("SYNCSCOPE_EXPORTER", raising=False)
    monkeypatch.setenv("SYNCSCOPE_NATIVE_COLLECTIVES", "1" if kernel == "c++" else "0")

    class Experts(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = torch.nn.Linear(64, 64)
            self.group: Any = None  # DDP's, once wrapped

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return AllToAll.apply(self.lin(x), self.group)

    experts = Experts()
    ddp = torch.nn.parallel.DistributedDataParallel(experts)
    experts.group = ddp.process_group
    agent = train(ddp, 3, 8, 64)
    try:
        assert agent.patch.kernel == kernel
        ops = [(op, step) for op, _g, _s, _d, step in ops_of(agent.queues.collectives, agent.patch)]
    finally:
        agent.close()
    per_step = collections.Counter(step for op, step in ops if op == "all_to_all")
    assert per_step == {0: 2, 1: 2, 2: 2}, ops
    assert [o for o in ops if o[0] not in ("all_to_all", "broadcast")] == [
        ("ddp_grad_sync", 0),
        ("ddp_grad_sync", 1),
        ("ddp_grad_sync", 2),
    ], ops


def test_time_blocked_in_a_collective_inside_forward_is_exposed_communication(
    gloo_world_of_one, monkeypatch
):
    """A forward that waits 30 ms for a collective (as an FSDP2 all-gather or a tensor-parallel
    all-reduce does) and computes ~0: the 30 ms are comm, not forward; phases still add up."""
    monkeypatch.delenv("SYNCSCOPE_EXPORTER", raising=False)
    wait_s = 0.03

    class Waits(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = torch.nn.Linear(4, 4)
            self.blocked = Blocked()  # the agent's, once attached

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            t0 = time.perf_counter_ns()  # a peer 30 ms late, as a real wait would count it
            time.sleep(wait_s)
            self.blocked.ns += time.perf_counter_ns() - t0
            return self.lin(x)

    agent = train(Waits(), 5, 2, 4)
    rows = step_rows(agent)
    agent.close()
    assert len(rows) == 5
    for _step, _end, total, data, fwd, bwd, optim, comm, pacing, _samples, _tokens in rows:
        assert comm >= wait_s * 1e9, rows  # a sleep never ends early
        assert fwd < comm, rows
        assert data + fwd + bwd + optim + comm + pacing <= total, rows
    median_fwd = sorted(r[4] for r in rows)[2]
    assert median_fwd < 0.5 * wait_s * 1e9, rows  # what is left of forward is its compute


@pytest.mark.parametrize(
    ("ddp", "forward_waits_ms", "after_backward_ms", "first"),
    [
        (False, (5, 30), 0, (FWD_POST, 5)),  # FSDP2 / tensor parallel: the first wait in forward
        (False, (), 0, None),  # nothing synchronised
        (True, (5,), 0, (FWD_POST, 5)),  # a tensor-parallel wait before DDP's sync
        (True, (), 7, (COMM_END, None)),  # DDP first; the user's all-reduce after it is later
    ],
)
def test_the_pacer_is_given_the_steps_first_wait(
    gloo_world_of_one, monkeypatch, ddp, forward_waits_ms, after_backward_ms, first
):
    """Pacing's signal on the CPU clock (agent/step_pacing.py): each step's first wait for a
    collective on the training thread, or DDP's exposed sync when nothing waited before it."""
    monkeypatch.delenv("SYNCSCOPE_EXPORTER", raising=False)

    class Waits(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = torch.nn.Linear(4, 4)
            self.interceptor: Any = None  # the agent's, once attached

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for ms in forward_waits_ms:  # waits as the Work.wait wrapper reports them
                self.interceptor.waited(None, 0, ms * 1_000_000, threading.get_ident())
            return self.lin(x)

    inner = Waits()
    model = torch.nn.parallel.DistributedDataParallel(inner) if ddp else inner
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    agent = attach(model=model, optimizer=opt, exporter=None, flush_interval_s=3600)
    inner.interceptor = agent.patch
    calls: list[tuple] = []
    agent.clock.pacer = lambda *args: calls.append(args) or 0
    try:
        for _ in range(4):
            model(torch.randn(2, 4)).sum().backward()
            if after_backward_ms:
                agent.patch.waited(None, 0, after_backward_ms * 1_000_000, threading.get_ident())
            opt.step()
            opt.zero_grad()
        rows = step_rows(agent)
    finally:
        agent.close()
    assert len(calls) == 4
    for (comm_ns, step_ns, first_ns, at), row in zip(calls, rows, strict=True):
        assert (comm_ns, step_ns) == (row[7], row[2])  # the step's exposed comm and duration
        if first is None:
            assert first_ns == -1
        elif first[0] == FWD_POST:  # seen when forward returned: a wait inside forward
            assert (first_ns, at) == (first[1] * 1_000_000, FWD_POST)
        else:  # DDP's exposed sync: part of the step's comm, without the later 7 ms
            assert at == COMM_END and 0 <= first_ns <= comm_ns - after_backward_ms * 1_000_000


def test_waits_before_the_first_marked_step_are_in_no_step(gloo_world_of_one, monkeypatch):
    """A trainer that marks steps itself (Lightning's callback) attaches, then waits in its own
    setup's collectives before the first step: that wait is no step's exposed communication."""
    monkeypatch.delenv("SYNCSCOPE_EXPORTER", raising=False)
    agent = attach(exporter=None, flush_interval_s=3600)
    try:
        dist.barrier()  # setup's collectives, blocked on the training thread
        assert agent.patch.blocked.ns > 0
        with agent.step():
            time.sleep(0.01)
        ((_step, _end, total, *phases, _samples, _tokens),) = step_rows(agent)
    finally:
        agent.close()
    assert phases[Phase.COMM_EXPOSED] == 0 and sum(phases) <= total, (phases, total)


FALLBACK_SCRIPT = """
import logging, sys, tempfile, time
import torch, torch.distributed as dist
from syncscope.agent.collectives import Blocked, CollectiveInterceptor, GroupLabels
from syncscope.agent.queues import RecordQueues
logging.basicConfig(level=logging.INFO, stream=sys.stdout, format="%(message)s")
store = tempfile.mktemp()
dist.init_process_group("gloo", init_method="file://" + store, rank=0, world_size=1)
queues = RecordQueues(64)
interceptor = CollectiveInterceptor(queues, GroupLabels(), Blocked())
interceptor.install()
dist.all_reduce(torch.ones(4))
interceptor.poll()
print("KERNEL", interceptor.kernel, [row[:3] for row in queues.collectives])
interceptor.uninstall()
"""


@pytest.mark.slow
def test_without_a_built_library_the_python_kernel_serves_and_says_why(tmp_path):
    """A machine where `python -m syncscope.agent.native` never ran (or another torch): the
    agent says where it looked and times collectives in Python all the same."""
    import os
    import subprocess
    import sys

    env = dict(os.environ, SYNCSCOPE_NATIVE_DIR=str(tmp_path), GLOO_SOCKET_IFNAME="lo")
    out = subprocess.run(
        [sys.executable, "-c", FALLBACK_SCRIPT],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    ).stdout
    assert f"no C++ library for torch {torch.__version__} at {tmp_path}" in out, out
    assert "KERNEL python [('all_reduce', 'default_pg', 16)]" in out, out


@pytest.mark.slow
def test_records_the_cpp_buffer_has_no_room_for_are_counted_as_dropped(gloo_world_of_one):
    """Nobody polls while 100 more collectives than the C++ buffer holds (65,536) run: every one
    is either queued or counted as dropped (the queue's own tail drop included)."""
    queues = RecordQueues(1024)
    interceptor = CollectiveInterceptor(queues, GroupLabels(), Blocked())
    interceptor.install()
    try:
        assert interceptor.kernel == "c++"
        t = torch.ones(1)
        n = 65_536 + 100
        for _ in range(n):
            dist.all_reduce(t)
        interceptor.poll()
        assert len(queues.collectives) + interceptor.dropped == n
        assert interceptor.dropped >= 100
    finally:
        interceptor.uninstall()
