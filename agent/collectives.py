"""Every collective and point-to-point op a CPU process group runs, timed where torch funnels
them all: the dispatcher's `c10d::` ops.

Whatever issues a collective — torch.distributed's functions (whatever torch names them next;
2.13 added `all_gather_single`), DTensor's functional collectives, FSDP2, pipelining's send and
recv, DDP's reducer, a user's comm hook — ends in a ProcessGroup method whose C++ front calls
the dispatcher op `c10d::<op>` (torch/csrc/distributed/c10d/ProcessGroup.hpp). A Python kernel
registered with `torch.library` for those ops at the BackendSelect key (which every call passes,
inference mode included) sees each call, redispatches it to the backend's kernel, and times the
Work it returns to its completion through the Work's future. The alternatives read in torch's
source fall short: a patch of `torch.distributed.*` sees Python callers only (not DDP, not
functional collectives), a completion hook exists only on NCCL (and is deprecated), and a
TorchDispatchMode would send every aten op through Python.

Time blocked: `Work.wait` (what every synchronous collective, FSDP2 and pipelining call) and
`_c10d_functional::wait_tensor` (DTensor's AsyncCollectiveTensor) add the time the training
thread spends in them to `Blocked.ns`; the phase clock moves it out of the phase it interrupted
into exposed communication (phases.py).

Only CPU tensors are timed: a GPU collective returns before the GPU runs it, and Flight Recorder
reports its GPU duration (nccl_trace.py); meta and fake tensors (compilers tracing) pass through.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from syncscope.wire import MAX_LABEL_LEN

if TYPE_CHECKING:
    from syncscope.agent.queues import RecordQueues

_now = time.perf_counter_ns
MAX_GROUP_LABELS = 32  # distinct group labels per process; the rest are "other"
DISPATCH_KEY = "BackendSelect"
MAX_UNWAITED = 256  # works without a future awaiting their wait(); beyond, the oldest is dropped

# c10d op -> (op label, position of its ProcessGroup, position of the argument whose bytes are
# the collective's size, or None). Sizes follow nccl-tests: the full buffer a rank ends up with
# (all_gather) or contributes (reduce_scatter, all_to_all, gather). tests/unit/test_collectives
# fails when a torch upgrade registers a c10d op that is in neither table.
C10D_OPS: dict[str, tuple[str, int, int | None]] = {
    "allreduce_": ("all_reduce", 1, 0),
    "allreduce_coalesced_": ("all_reduce", 1, 0),
    "allgather_": ("all_gather", 2, 0),
    "_allgather_base_": ("all_gather", 2, 0),
    "allgather_coalesced_": ("all_gather", 2, 0),
    "allgather_into_tensor_coalesced_": ("all_gather", 2, 0),
    "reduce_scatter_": ("reduce_scatter", 2, 1),
    "_reduce_scatter_base_": ("reduce_scatter", 2, 1),
    "reduce_scatter_tensor_coalesced_": ("reduce_scatter", 2, 1),
    "alltoall_": ("all_to_all", 2, 1),
    "alltoall_base_": ("all_to_all", 2, 1),
    "broadcast_": ("broadcast", 1, 0),
    "reduce_": ("reduce", 1, 0),
    "gather_": ("gather", 2, 1),
    "scatter_": ("scatter", 2, 0),
    "barrier": ("barrier", 1, None),
    "monitored_barrier_": ("barrier", 1, None),
    "send": ("send", 1, 0),
    "recv_": ("recv", 1, 0),
    "recv_any_source_": ("recv", 1, 0),
}
NOT_COLLECTIVES = frozenset({"check_for_nan"})  # c10d ops that move no data between ranks


def nbytes(value: Any) -> int:
    """Bytes of a tensor, or of every tensor in (nested) lists of them."""
    if isinstance(value, (list, tuple)):
        return sum(nbytes(v) for v in value)
    return int(value.numel() * value.element_size()) if hasattr(value, "numel") else 0


def _first_tensor(value: Any) -> Any:
    while isinstance(value, (list, tuple)):
        if not value:
            return None
        value = value[0]
    return value


def group_label(name: str, desc: str) -> str:
    """A process group's label: the DeviceMesh dimension it spans (`mesh_dp` -> `dp`), else its
    description where torch has one, else 'pg' + its name."""
    if desc and desc != "undefined":
        return desc.removeprefix("mesh_")[:MAX_LABEL_LEN]
    return ("pg" + name)[:MAX_LABEL_LEN]


class GroupLabels:
    """Bounded mapping from process groups to label values (cardinality stays capped).

    Takes the Python ProcessGroup or the boxed one a dispatcher kernel receives."""

    def __init__(self) -> None:
        self._by_id: dict[int, str] = {}

    def __call__(self, group: Any) -> str:
        if group is not None and not hasattr(group, "group_desc"):
            group = _unbox_group(group)
        key = id(group)
        label = self._by_id.get(key)
        if label is None:
            if len(self._by_id) >= MAX_GROUP_LABELS:
                return "other"
            label = self._by_id[key] = self._resolve(group)
        return label

    @staticmethod
    def _resolve(group: Any) -> str:
        try:
            from torch.distributed import distributed_c10d as c10d

            if group is None:
                group = c10d._get_default_group()
            desc = getattr(group, "group_desc", "") or ""
            return group_label(str(getattr(group, "group_name", "") or ""), desc)
        except Exception:  # noqa: BLE001 - a label is never worth an exception
            return "unknown"


def _unbox_group(boxed: Any) -> Any:
    import torch.distributed as dist

    return dist.ProcessGroup.unbox(boxed)


class Blocked:
    """Nanoseconds the training thread has spent blocked waiting for collectives (it only
    grows); waits on other threads are not the training loop's."""

    __slots__ = ("ns", "thread")

    def __init__(self) -> None:
        self.ns = 0
        self.thread = threading.get_ident()


class CollectiveInterceptor:
    """Times every c10d op on CPU tensors, issue to completion, into `queues.collectives` as
    (op, group, bytes, duration_ns, step); adds the training thread's waits to `blocked`.

    `skip(group_label)`: true while calls on that group are part of something timed another
    way (DDP's gradient sync, timed as its exposed part by the phase clock). Several agents in
    one process share one set of kernels (_Kernels); each gets every call.
    """

    def __init__(
        self,
        queues: RecordQueues,
        labels: GroupLabels,
        blocked: Blocked,
        skip: Callable[[str], bool] | None = None,
    ) -> None:
        self.sink = queues.collectives
        self.step_of = queues.current_step
        self.labels = labels
        self.blocked = blocked
        self.skip = skip
        self.dropped = 0
        # Works without a future, timed to the end of their wait(): Work -> what was issued
        self.pending: dict[Any, tuple[str, str, int, int, int]] = {}

    def install(self) -> None:
        _KERNELS.add(self)

    def uninstall(self) -> None:
        _KERNELS.discard(self)

    def _record(self, op: str, group: str, size: int, duration_ns: int, step: int) -> None:
        sink = self.sink
        if len(sink) < (sink.maxlen or sys.maxsize):  # tail drop, counted (see phases.py)
            sink.append((op, group, size, duration_ns, step))
        else:
            self.dropped += 1

    def issued(
        self, spec: tuple[str, int, int | None], args: tuple, out: Any, t0: int, work: Any
    ) -> None:
        """A c10d op on CPU tensors returned `out` (its Work unboxed: `work`); time it."""
        label, group_at, size_at = spec
        try:
            group = self.labels(args[group_at])
            skip = self.skip
            if skip is not None and skip(group):
                return
            size = nbytes(args[size_at]) if size_at is not None else 0
            step = self.step_of()
            if work is None:  # a blocking op (monitored_barrier_): done on return
                self._record(label, group, size, _now() - t0, step)
                return
            try:
                future = work.get_future()
            except RuntimeError:  # gloo's emulated reduce-scatter: no future; see waited()
                pending = self.pending
                if len(pending) >= MAX_UNWAITED:  # never waited for: forget the oldest
                    pending.pop(next(iter(pending)))
                    self.dropped += 1
                pending[work] = (label, group, size, t0, step)
                return
            future.then(lambda _f: self._record(label, group, size, _now() - t0, step))
        except BaseException:  # noqa: BLE001 - timing must never break the collective
            self.dropped += 1

    def waited(self, work: Any, t0: int, t1: int, on_thread: int) -> None:
        """Someone's wait() on `work` ran from t0 to t1 on thread `on_thread`."""
        blocked = self.blocked
        if on_thread == blocked.thread:
            blocked.ns += t1 - t0
        if self.pending:
            issued = self.pending.pop(work, None)
            if issued is not None:
                op, group, size, t_issue, step = issued
                self._record(op, group, size, t1 - t_issue, step)


class _Kernels:
    """The process's one set of dispatcher kernels and its Work.wait wrapper, installed while
    any interceptor is active (a second registration would override the first)."""

    def __init__(self) -> None:
        self.active: tuple[CollectiveInterceptor, ...] = ()
        self._libraries: list[Any] = []
        self._work_wait: Any = None

    def add(self, interceptor: CollectiveInterceptor) -> None:
        if interceptor in self.active:
            return
        if not self.active:
            self._install()
        self.active = (*self.active, interceptor)

    def discard(self, interceptor: CollectiveInterceptor) -> None:
        self.active = tuple(i for i in self.active if i is not interceptor)
        if not self.active:
            self._uninstall()

    def _install(self) -> None:
        import torch
        import torch.distributed as dist

        lib = torch.library.Library("c10d", "IMPL")
        self._libraries.append(lib)
        for name, spec in C10D_OPS.items():
            try:
                op = getattr(torch.ops.c10d, name).default
            except (AttributeError, RuntimeError):  # an op this torch does not have
                continue
            lib.impl(name, self._timed(op, spec), DISPATCH_KEY, with_keyset=True)
        try:
            wait_tensor = torch.ops._c10d_functional.wait_tensor.default
        except (AttributeError, RuntimeError):
            pass
        else:
            functional = torch.library.Library("_c10d_functional", "IMPL")
            self._libraries.append(functional)
            functional.impl(
                "wait_tensor", self._waiting(wait_tensor), DISPATCH_KEY, with_keyset=True
            )
        original = dist.Work.wait
        self._work_wait = original
        dist.Work.wait = self._timed_wait(original)  # type: ignore[method-assign]

    def _uninstall(self) -> None:
        import torch.distributed as dist

        if self._work_wait is not None and getattr(dist.Work.wait, "__syncscope_wrapped__", False):
            dist.Work.wait = self._work_wait  # type: ignore[method-assign]
        self._work_wait = None
        # A torch.library.Library's registrations go with the object (a weakref finalizer).
        self._libraries.clear()

    def _timed(self, op: Any, spec: tuple[str, int, int | None]) -> Callable[..., Any]:
        from torch._C import DispatchKey
        from torch.distributed import Work

        _label, _group_at, size_at = spec
        first_at = 0 if size_at is None else size_at
        redispatch = op.redispatch
        below = DispatchKey.BackendSelect
        kernels = self

        def kernel(keyset: Any, *args: Any, **kwargs: Any) -> Any:
            t0 = _now()
            out = redispatch(keyset.remove(below), *args, **kwargs)
            try:
                tensor = _first_tensor(args[first_at])
                if tensor is None or tensor.device.type != "cpu":
                    return out
                boxed = out[-1] if isinstance(out, tuple) else out
                work = None if boxed is None else Work.unbox(boxed)
            except BaseException:  # noqa: BLE001 - timing must never break the collective
                return out
            for interceptor in kernels.active:
                interceptor.issued(spec, args, out, t0, work)
            return out

        return kernel

    def _waiting(self, op: Any) -> Callable[..., Any]:
        from torch._C import DispatchKey

        redispatch = op.redispatch
        below = DispatchKey.BackendSelect
        kernels = self

        def kernel(keyset: Any, *args: Any, **kwargs: Any) -> Any:
            t0 = _now()
            try:
                return redispatch(keyset.remove(below), *args, **kwargs)
            finally:
                t1 = _now()
                thread = threading.get_ident()
                for interceptor in kernels.active:
                    interceptor.waited(None, t0, t1, thread)

        return kernel

    def _timed_wait(self, original: Any) -> Any:
        kernels = self

        def wait(work: Any, *args: Any, **kwargs: Any) -> Any:
            t0 = _now()
            try:
                return original(work, *args, **kwargs)
            finally:
                t1 = _now()
                thread = threading.get_ident()
                for interceptor in kernels.active:
                    interceptor.waited(work, t0, t1, thread)

        wait.__syncscope_wrapped__ = True  # type: ignore[attr-defined]
        wait.__wrapped__ = original  # type: ignore[attr-defined]
        wait.__doc__ = original.__doc__
        return wait


_KERNELS = _Kernels()


def bucket_timing_hook(world_size: int) -> Callable[[Any, Any], Any]:
    """A DDP comm hook that all-reduces each bucket through torch.distributed (timed by the
    interceptor, which does not skip the DDP group when this hook is on).

    Opt-in detail level: any Python comm hook costs 80–200 µs per bucket (FIELD-NOTES), which
    is why the default path does without. The second parameter must be named `bucket`, and the
    returned future must come from a Python `.then` (returning the work's future asserts).
    """
    import torch.distributed as dist

    def syncscope_bucket_hook(process_group: Any, bucket: Any) -> Any:
        buffer = bucket.buffer()
        buffer.div_(world_size)
        work = dist.all_reduce(buffer, group=process_group, async_op=True)
        return work.get_future().then(lambda fut: fut.value()[0])

    syncscope_bucket_hook.__annotations__ = _comm_hook_annotations()
    return syncscope_bucket_hook


def _comm_hook_annotations() -> dict[str, Any]:
    """The annotations DDP.register_comm_hook accepts, as real objects.

    DDP's _check_comm_hook compares `inspect.signature(hook)` annotations by equality: `bucket`
    must be absent or `dist.GradBucket`, the return absent or `torch.futures.Future[Tensor]`.
    `from __future__ import annotations` makes this module's annotations strings ("Any"),
    which fail both checks, so the hook's are replaced here. A torch without dist.GradBucket
    gets no `bucket` annotation (an absent one passes the check too); anything else that fails
    here or in register_comm_hook falls back, with a warning, in Agent._time_buckets.
    """
    import torch
    import torch.distributed as dist

    annotations: dict[str, Any] = {"process_group": Any}
    grad_bucket = getattr(dist, "GradBucket", None)
    if grad_bucket is not None:
        annotations["bucket"] = grad_bucket
    annotations["return"] = torch.futures.Future[torch.Tensor]
    return annotations
