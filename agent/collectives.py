"""Timing of direct torch.distributed collectives, by patching them (the only other patch
syncscope makes is the torch.autograd.backward wrapper in phases.py).

Only Python callers go through these functions (user code, comm hooks, DDP's constructor);
DDP's own gradient all-reduce does not, which is why phases.py measures it separately. Both
`torch.distributed.X` and `torch.distributed.distributed_c10d.X` are replaced, because some
helpers (all_gather_object) resolve the name in the latter module only.
"""

from __future__ import annotations

import inspect
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


def _tensor_bytes(t: Any) -> int:
    return t.numel() * t.element_size()


def _list_bytes(ts: Any) -> int:
    return sum(t.numel() * t.element_size() for t in ts)


# function name -> (op label, index of the argument whose size is the collective's size,
# how to size it). Sizes follow nccl-tests: the full buffer a rank ends up with or contributes.
_SPECS: dict[str, tuple[str, int, Callable[[Any], int] | None]] = {
    "all_reduce": ("all_reduce", 0, _tensor_bytes),
    "all_gather": ("all_gather", 0, _list_bytes),
    "all_gather_into_tensor": ("all_gather", 0, _tensor_bytes),
    "reduce_scatter": ("reduce_scatter", 1, _list_bytes),
    "reduce_scatter_tensor": ("reduce_scatter", 1, _tensor_bytes),
    "broadcast": ("broadcast", 0, _tensor_bytes),
    "barrier": ("barrier", 0, None),
    "all_to_all": ("all_to_all", 1, _list_bytes),
    "all_to_all_single": ("all_to_all", 1, _tensor_bytes),
}


def group_label(name: str, desc: str) -> str:
    """A process group's label: its description where torch has one, else 'pg' + its name."""
    if desc and desc != "undefined":
        return desc[:MAX_LABEL_LEN]
    return ("pg" + name)[:MAX_LABEL_LEN]


class GroupLabels:
    """Bounded mapping from process groups to label values (cardinality stays capped)."""

    def __init__(self) -> None:
        self._by_id: dict[int, str] = {}

    def __call__(self, group: Any) -> str:
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
            return group_label(str(c10d._get_process_group_name(group)), desc)
        except Exception:  # noqa: BLE001 - a label is never worth an exception
            return "unknown"


class CollectivePatch:
    """Wraps torch.distributed collectives to record (op, group, bytes, duration_ns, step)."""

    def __init__(self, queues: RecordQueues, labels: GroupLabels) -> None:
        self.sink = queues.collectives
        self.step_of = queues.current_step
        self.labels = labels
        self.originals: dict[tuple[Any, str], Any] = {}
        self.dropped = 0
        self._local = threading.local()
        self._backends: dict[int | None, str] = {}  # id(group) -> its backend, asked once

    def timed_by_flight_recorder(self, group: Any, target: Any) -> bool:
        """NCCL calls return before the GPU runs them: a CPU timer would time the enqueue, and
        Flight Recorder (agent/nccl_trace.py) reports them with their GPU duration. attach()
        leaves this patch out when the NCCL group exists; when attach() ran first, this is
        where NCCL groups are told apart."""
        key = None if group is None else id(group)
        backend = self._backends.get(key)
        if backend is None:
            try:
                import torch.distributed as dist

                backend = str(dist.get_backend(group)).lower()
            except Exception:  # noqa: BLE001 - not initialised yet, or an unknown group
                return False
            self._backends[key] = backend
        if "nccl" not in backend:
            return False
        if backend == "nccl":
            return True
        # a group with a backend per device ("cpu:gloo,cuda:nccl"): the tensor's device decides
        first = target[0] if isinstance(target, (list, tuple)) and target else target
        return bool(getattr(first, "is_cuda", True))

    def install(self) -> None:
        import torch.distributed as dist
        from torch.distributed import distributed_c10d as c10d

        for name, spec in _SPECS.items():
            original = getattr(c10d, name, None)
            if original is None or getattr(original, "__syncscope_wrapped__", False):
                continue
            wrapper = self._wrap(name, original, spec)
            for module in (dist, c10d):
                if getattr(module, name, None) is original:
                    self.originals[(module, name)] = original
                    setattr(module, name, wrapper)

    def uninstall(self) -> None:
        for (module, name), original in self.originals.items():
            current = getattr(module, name, None)
            if getattr(current, "__syncscope_wrapped__", False):
                setattr(module, name, original)
        self.originals.clear()

    def _record(self, op: str, group: Any, nbytes: int, duration_ns: int) -> None:
        sink = self.sink
        if len(sink) < (sink.maxlen or sys.maxsize):  # tail drop, counted (see phases.py)
            sink.append((op, self.labels(group), nbytes, duration_ns, self.step_of()))
        else:
            self.dropped += 1

    def _wrap(self, name: str, original: Any, spec: tuple[str, int, Any]) -> Any:
        op, size_arg, sizer = spec
        params = list(inspect.signature(original).parameters)
        group_pos = params.index("group")
        async_pos = params.index("async_op")
        size_name = params[size_arg]
        local = self._local
        patch = self

        def timed(*args: Any, **kwargs: Any) -> Any:
            if getattr(local, "busy", False):  # a collective built from another one
                return original(*args, **kwargs)
            try:
                group = (
                    kwargs["group"]
                    if "group" in kwargs
                    else (args[group_pos] if len(args) > group_pos else None)
                )
                target = (
                    kwargs.get(size_name, args[size_arg] if len(args) > size_arg else None)
                    if sizer is not None
                    else None
                )
                if patch.timed_by_flight_recorder(group, target):
                    return original(*args, **kwargs)
            except Exception:  # noqa: BLE001 - timing must never break the collective
                return original(*args, **kwargs)
            local.busy = True
            try:
                t0 = _now()
                result = original(*args, **kwargs)
                t1 = _now()
            finally:
                local.busy = False
            try:
                async_op = kwargs.get(
                    "async_op", args[async_pos] if len(args) > async_pos else False
                )
                nbytes = sizer(target) if sizer is not None else 0
                if async_op and result is not None:
                    fut = result.get_future()
                    fut.then(lambda _f: patch._record(op, group, nbytes, _now() - t0))
                else:
                    patch._record(op, group, nbytes, t1 - t0)
            except BaseException:  # noqa: BLE001 - timing must never break the collective
                patch.dropped += 1
            return result

        timed.__syncscope_wrapped__ = True  # type: ignore[attr-defined]
        timed.__wrapped__ = original  # type: ignore[attr-defined]
        timed.__name__ = name
        timed.__doc__ = original.__doc__
        return timed


def bucket_timing_hook(world_size: int) -> Callable[[Any, Any], Any]:
    """A DDP comm hook that all-reduces each bucket through the (patched, hence timed) API.

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
