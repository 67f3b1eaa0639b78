"""Every collective and point-to-point op a CPU process group runs, timed where torch funnels
them all: the dispatcher's `c10d::` ops.

Whatever issues a collective (torch.distributed's functions, DTensor's functional collectives,
FSDP2, pipelining's send and recv, DDP's reducer, a user's comm hook) ends in a ProcessGroup
method whose C++ front calls the dispatcher op `c10d::<op>`. A kernel registered for those ops at
the BackendSelect key sees every call, redispatches it to the backend's kernel, and times those
on CPU tensors. The kernel is C++ where its library is built (native.py, csrc/c10d_timing.cpp):
it times each op from issue to completion (the Work's future, else the end of its first wait)
and keeps the records until `poll()` moves them into the queue; the transports poll before they
drain. Elsewhere a Python kernel (`torch.library`, several times dearer per call) times from the
issue to the end of the first wait for it (`Work.wait`, or `wait_tensor` for a functional
collective). Why there, and what each costs: docs/parallelism.md.

Time blocked: `Work.wait` and `_c10d_functional::wait_tensor` add the time the training thread
spends in them to `Blocked.ns`; the phase clock moves it out of the phase it interrupted into
exposed communication (phases.py).

Only CPU tensors are timed: a GPU collective returns before the GPU runs it, and Flight Recorder
reports its GPU duration (nccl_trace.py); meta and fake tensors (compilers tracing) pass through.
The agent installs the kernels only where its phase clock is the CPU one: a CUDA job's NCCL
collectives never pay for them.
"""

from __future__ import annotations

import contextlib
import logging
import sys
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NamedTuple

from syncscope.wire import GROUP_FACT, GROUP_FIRST_FACT, MAX_LABEL_LEN, MAX_TOPOLOGY_TEXT

if TYPE_CHECKING:
    from syncscope.agent.native import Native
    from syncscope.agent.queues import RecordQueues

log = logging.getLogger("syncscope.agent")
_now = time.perf_counter_ns
MAX_GROUP_LABELS = 32  # distinct group labels per process; the rest are "other"
MAX_GROUP_FACTS = 16  # groups whose members a rank reports (topology holds 64 entries)
# Every call passes BackendSelect, also one made inside another op's kernel (a functional
# collective's c10d op), where the autograd keys are already excluded.
DISPATCH_KEY = "BackendSelect"
MAX_UNWAITED = 256  # entries (2 per collective) awaiting a wait; then completed ones are pruned

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
# The op of DDP's bucket all-reduces (its reducer's allreduce_): the one op left out on DDP's
# group while its backward runs (CollectiveInterceptor)
SKIPPED_OP = "all_reduce"
NOT_COLLECTIVES = frozenset({"check_for_nan"})  # c10d ops that move no data between ranks
_OP_LABELS = [label for label, _group_at, _size_at in C10D_OPS.values()]  # by the C++ op index
_SKIPPED_INDEXES = [i for i, label in enumerate(_OP_LABELS) if label == SKIPPED_OP]


def nbytes(value: Any) -> int:
    """Bytes of a tensor, or of every tensor in (nested) lists of them."""
    if isinstance(value, (list, tuple)):
        if len(value) == 1 and not isinstance(value[0], (list, tuple)):
            value = value[0]  # the usual case: one tensor
        else:
            return sum(nbytes(v) for v in value)
    return int(value.nbytes) if hasattr(value, "nbytes") else 0


def _storage_key(tensor: Any) -> tuple[str, int]:
    return ("storage", tensor.untyped_storage().data_ptr())


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
        self._named: dict[str, str] = {}  # torch's group name -> label (the C++ kernel's)
        self.members: dict[str, tuple[int, ...]] = {}  # label -> the group's global ranks
        # Distinct process groups seen, by their ranks (a label where they are unknown): two
        # handles on the same ranks (DDP on the default group, a broadcast on it) are one.
        self.groups_seen: set[object] = set()
        # facts() as of `members` (None: not yet, or a group was added since): the reporter
        # asks every flush, and a group of thousands of ranks is joined and scanned once.
        self._facts: dict[str, str] | None = None

    def group_count(self) -> int:
        return len(self.groups_seen)

    def facts(self) -> dict[str, str]:
        """The groups this rank is in, as topology facts: "group.<label>" -> its ranks ("2,3"),
        for the exporter to follow a wait to the rank waited for; a group too large to list in
        a topology value (MAX_TOPOLOGY_TEXT) as "group_first.<label>" -> its lowest rank, by
        which the job-wide rules name its least blocked member. Groups past MAX_GROUP_FACTS
        are left out."""
        if self._facts is None:
            out: dict[str, str] = {}
            for label, ranks in list(self.members.items())[:MAX_GROUP_FACTS]:
                text = ",".join(map(str, ranks))
                if len(text) <= MAX_TOPOLOGY_TEXT:
                    out[GROUP_FACT + label] = text
                else:
                    out[GROUP_FIRST_FACT + label] = str(min(ranks))
            self._facts = out
        return dict(self._facts)

    def __call__(self, group: Any) -> str:
        if type(group) is _SCRIPT_OBJECT[0]:  # what a dispatcher kernel receives
            group = _unbox_group(group)
        key = id(group)
        label = self._by_id.get(key)
        if label is None:
            if len(self._by_id) >= MAX_GROUP_LABELS:
                return "other"
            label = self._by_id[key] = self._resolve(group)
            members = _members(group)
            if members:
                self.members[label] = members
                self._facts = None
            self.groups_seen.add(members or label)
        return label

    def named(self, name: str, desc: str) -> str:
        """The label of the group torch registered as `name` (what the C++ kernel reports)."""
        label = self._named.get(name)
        if label is None:
            group = _group_named(name)
            if group is not None:
                label = self(group)
            else:  # not resolvable to a ProcessGroup: labelled, its members unknown
                full = len(self._by_id) >= MAX_GROUP_LABELS
                label = "other" if full else group_label(name, desc)
                self.groups_seen.add(label)
            self._named[name] = label
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


# torch.ScriptObject, Work.unbox and ProcessGroup.unbox, set when the kernels are installed
# (only then do boxed groups and works reach this module)
_SCRIPT_OBJECT: list[Any] = [None]
_WORK: list[Any] = [None]
_PROCESS_GROUP: list[Any] = [None]


def _members(group: Any) -> tuple[int, ...]:
    try:
        import torch.distributed as dist

        return tuple(dist.get_process_group_ranks(group or dist.group.WORLD))
    except Exception:  # noqa: BLE001 - membership is a nicety, never an error
        return ()


def _group_named(name: str) -> Any:
    """The ProcessGroup torch registered under `name`, or None."""
    try:
        from torch.distributed.distributed_c10d import _resolve_process_group

        return _resolve_process_group(name)  # type: ignore[arg-type] # a GroupName (NewType)
    except Exception:  # noqa: BLE001 - then the label comes from the name alone
        return None


def _unbox_group(boxed: Any) -> Any:
    return _PROCESS_GROUP[0](boxed)


class Blocked:
    """Nanoseconds the training thread has spent blocked waiting for collectives (it only
    grows); waits on other threads are not the training loop's. `first_ns` is the first such
    wait since the phase clock last set it to -1 (at each step's end): pacing's signal."""

    __slots__ = ("first_ns", "ns", "thread")

    def __init__(self) -> None:
        self.ns = 0
        self.first_ns = -1
        self.thread = threading.get_ident()


class CollectiveInterceptor:
    """Times every c10d op on CPU tensors, issue to completion, into `queues.collectives` as
    (op, group, bytes, duration_ns, step); adds the training thread's waits to `blocked`.

    All-reduces on `skip_group` (a ProcessGroup) while `skip_while()` are left out: they are
    DDP's bucket all-reduces, timed another way (DDP's gradient sync, timed as its exposed part
    by the phase clock); the C++ kernel leaves out those it saw issued inside autograd, which is
    where DDP's reducer issues them. Only all-reduces: the reducer issues nothing else there,
    so every other collective on that group is recorded, in backward too (an expert-parallel
    model's all-to-all in a custom autograd.Function's backward). What remains folded into
    DDP's sync, unrecorded: a user's own all-reduce on DDP's group issued inside autograd (a
    custom backward's) or, with the Python kernel, while a backward is pending; nothing at the
    dispatcher tells it from the reducer's. Several agents in one process share one set of
    kernels (_Kernels); each gets every call. `native=False` keeps the kernels in Python (the
    first interceptor installed decides for the process).
    """

    def __init__(
        self,
        queues: RecordQueues,
        labels: GroupLabels,
        blocked: Blocked,
        skip_group: Any = None,
        skip_while: Callable[[], bool] = lambda: False,
        native: bool = True,
        watch: Callable[[str, str, int, int, bool], None] | None = None,
        on_skipped: Callable[[int, int], None] | None = None,
    ) -> None:
        self.sink = queues.collectives
        # told of every op the C++ kernel completed: (op, group, bytes, step, inside autograd)
        self.watch = watch
        # told at each poll of the C++ kernel's (step, bytes) left untimed in its last whole step
        self.on_skipped = on_skipped
        self.step_of = queues.current_step
        self.labels = labels
        self.blocked = blocked
        self.skip_group = skip_group
        self.skip_name = str(getattr(skip_group, "group_name", "") or "") if skip_group else ""
        self.skip_while = skip_while
        self.native = native
        self.dropped = 0
        # Collectives issued and not yet waited for, by Work and by their tensor's storage
        self.pending: dict[Any, _Pending] = {}

    def install(self) -> None:
        _KERNELS.add(self)

    def uninstall(self) -> None:
        _KERNELS.discard(self)

    def poll(self) -> None:
        """Move what the C++ kernel has completed into the queues (the transports call it
        before they drain); nothing to do with the Python kernel."""
        try:
            _KERNELS.poll()
        except Exception:  # noqa: BLE001 - the reporter must go on; what was drained is lost
            self.dropped += 1

    @property
    def kernel(self) -> str:
        """Which kernel times the c10d ops while this is installed: "c++" or "python"."""
        return "c++" if _KERNELS.native is not None else "python"

    @property
    def step_counter(self) -> Any:
        """The C++ kernel's step number (`.value`), which the phase clock keeps current; None
        with the Python kernel, which asks `queues.current_step()` at each call."""
        native = _KERNELS.native
        return native.step if native is not None else None

    def completed(
        self,
        op: str,
        name: str,
        desc: str,
        size: int,
        duration_ns: int,
        step: int,
        in_autograd: bool,
    ) -> None:
        """One collective the C++ kernel timed, on group `name` (torch's) described `desc`."""
        if in_autograd and name == self.skip_name and op == SKIPPED_OP:  # DDP's buckets
            return
        group = self.labels.named(name, desc)
        self.record(op, group, size, duration_ns, step)
        if self.watch is not None:
            self.watch(op, group, size, step, in_autograd)

    def record(self, op: str, group: str, size: int, duration_ns: int, step: int) -> None:
        """Queue one collective's row; a full queue refuses it, counted in `dropped`."""
        sink = self.sink
        if len(sink) < (sink.maxlen or sys.maxsize):  # tail drop, counted (see phases.py)
            sink.append((op, group, size, duration_ns, step))
        else:
            self.dropped += 1

    def issued(
        self, spec: tuple[str, int, int | None], args: tuple, tensor: Any, boxed: Any, t0: int
    ) -> None:
        """A c10d op on CPU tensors (`tensor` its first) was issued at t0 and returned the
        (boxed) Work `boxed`, or None for a blocking op: timed to the end of the first wait for
        it (see `waited`)."""
        label, group_at, size_at = spec
        try:
            process_group = args[group_at]
            if type(process_group) is _SCRIPT_OBJECT[0]:
                process_group = _unbox_group(process_group)
            if label == SKIPPED_OP and process_group is self.skip_group and self.skip_while():
                return  # DDP's bucket all-reduce
            group = self.labels(process_group)
            size = nbytes(args[size_at]) if size_at is not None else 0
            step = self.step_of()
            if boxed is None:  # a blocking op (monitored_barrier_): done on return
                self.record(label, group, size, _now() - t0, step)
                return
            work = _WORK[0](boxed)
            pending = self.pending
            if len(pending) >= MAX_UNWAITED:
                self._prune()
            # A functional collective is waited for through its tensor (wait_tensor), perhaps a
            # view of it (AsyncCollectiveTensor applies views before waiting): keyed by its
            # storage, held meanwhile so that no other tensor gets that storage. The rest are
            # waited for through their Work.
            storage = _storage_key(tensor)
            entry = _Pending(label, group, size, t0, step, work, tensor, storage)
            pending[work] = entry
            if storage is not None:
                pending[storage] = entry
        except BaseException:  # noqa: BLE001 - timing must never break the collective
            self.dropped += 1

    def waited(self, key: Any, t0: int, t1: int, on_thread: int) -> None:
        """A wait for `key` (a Work, or a collective's tensor's _storage_key) ran from t0 to t1 on
        thread `on_thread`: blocked time on the training thread, and the collective's
        completion (it completed by the time its first wait returned)."""
        blocked = self.blocked
        if on_thread == blocked.thread:
            blocked.ns += t1 - t0
            if blocked.first_ns < 0:
                blocked.first_ns = t1 - t0
        if self.pending:
            entry = self.pending.get(key)
            if entry is not None:
                self._forget(entry)
                self.record(entry.op, entry.group, entry.size, t1 - entry.t0, entry.step)

    def _prune(self) -> None:
        """Forget what completed without a wait we see (DDP's own broadcasts are waited for in
        C++: those go untimed); past MAX_UNWAITED unfinished ones, the oldest, counted."""
        for entry in {id(e): e for e in self.pending.values()}.values():
            if entry.work.is_completed():
                self._forget(entry)
        while len(self.pending) >= MAX_UNWAITED:
            self._forget(next(iter(self.pending.values())))
            self.dropped += 1

    def _forget(self, entry: _Pending) -> None:
        self.pending.pop(entry.work, None)
        self.pending.pop(entry.storage, None)


class _Pending(NamedTuple):
    """A collective issued and not yet waited for."""

    op: str
    group: str
    size: int
    t0: int
    step: int
    work: Any
    tensor: Any  # held: no other tensor gets its storage while it is pending
    storage: tuple[str, int]


class _Kernels:
    """The process's one set of dispatcher kernels and its Work.wait wrapper, installed while
    any interceptor is active (a second registration would override the first)."""

    def __init__(self) -> None:
        self.active: tuple[CollectiveInterceptor, ...] = ()
        self._libraries: list[Any] = []
        self._work_wait: Any = None
        self.native: Native | None = None  # the C++ kernels, while installed
        self._native_dropped = 0  # the C++ kernels' drop count at the last poll
        self._groups: dict[int, tuple[str, str]] = {}  # the C++ kernels' group table
        self._poll_lock = threading.Lock()

    def add(self, interceptor: CollectiveInterceptor) -> None:
        if interceptor in self.active:
            return
        if not self.active:
            self._install(interceptor.native)
        self.active = (*self.active, interceptor)
        self._skip()

    def discard(self, interceptor: CollectiveInterceptor) -> None:
        if interceptor in self.active:
            self.poll()  # what it is owed, before it leaves
        self.active = tuple(i for i in self.active if i is not interceptor)
        if not self.active:
            self._uninstall()
        else:
            self._skip()

    def _skip(self) -> None:
        """Tell the C++ kernels which all-reduces every active interceptor leaves out (its
        DDP's buckets: `completed` drops them), so that they are not timed at all."""
        native = self.native
        if native is None:
            return
        names = {i.skip_name for i in self.active}
        common = [] if len(names) != 1 or "" in names else list(names)
        native.skip(_SKIPPED_INDEXES, common)

    def poll(self) -> None:
        """Hand every record the C++ kernels completed to every active interceptor."""
        native = self.native
        if native is None:
            return
        with self._poll_lock:  # the reporter's thread and close() may both poll
            records = native.drain()
            active = self.active
            dropped = native.dropped
            for interceptor in active:  # records the C++ buffer had no room for
                interceptor.dropped += dropped - self._native_dropped
            self._native_dropped = dropped
            for op, group, size, t0, t1, step, in_autograd in records:
                name, desc = self._group(native, group)
                for interceptor in active:
                    interceptor.completed(
                        _OP_LABELS[op], name, desc, size, t1 - t0, step, in_autograd
                    )
            skipped = None
            for interceptor in active:
                if interceptor.on_skipped is not None:
                    skipped = skipped or native.skipped()
                    interceptor.on_skipped(*skipped)

    def _group(self, native: Native, index: int) -> tuple[str, str]:
        known = self._groups.get(index)
        if known is None:
            known = native.group(index) or ("other", "other")
            if index >= 0:
                self._groups[index] = known
        return known

    def _install(self, native_wanted: bool) -> None:
        import torch
        import torch.distributed as dist

        _SCRIPT_OBJECT[0], _WORK[0] = torch.ScriptObject, dist.Work.unbox
        _PROCESS_GROUP[0] = dist.ProcessGroup.unbox

        native = self._native(torch) if native_wanted else None
        lib = torch.library.Library("c10d", "IMPL")
        self._libraries.append(lib)
        for index, (name, spec) in enumerate(C10D_OPS.items()):
            try:
                op = getattr(torch.ops.c10d, name).default
            except (AttributeError, RuntimeError):  # an op this torch does not have
                continue
            if native is not None:
                try:
                    native.install(name, index, spec[1], spec[2])
                    continue
                except RuntimeError as exc:  # that op in Python, the others stay in C++
                    log.warning("syncscope: c10d::%s timed in Python: %s", name, exc)
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

    def _native(self, torch: Any) -> Native | None:
        """The C++ kernels, where they are built for this torch."""
        from syncscope.agent import native

        self.native = native.load(torch)
        self._groups = {}
        self._native_dropped = self.native.dropped if self.native is not None else 0
        return self.native

    def _uninstall(self) -> None:
        import torch.distributed as dist

        if self.native is not None:
            self.native.uninstall()
            self.native = None
        if self._work_wait is not None and getattr(dist.Work.wait, "__syncscope_wrapped__", False):
            dist.Work.wait = self._work_wait  # type: ignore[method-assign]
        self._work_wait = None
        # A torch.library.Library's registrations go with the object (a weakref finalizer).
        self._libraries.clear()

    def _timed(self, op: Any, spec: tuple[str, int, int | None]) -> Callable[..., Any]:
        redispatch = op.redispatch
        below = _dispatch_key()
        kernels = self

        def kernel(keyset: Any, *args: Any, **kwargs: Any) -> Any:
            t0 = _now()
            out = redispatch(keyset.remove(below), *args, **kwargs)
            try:
                tensor = _first_tensor(args[0])
                if tensor is None or not tensor.is_cpu:
                    return out
                boxed = out[-1] if isinstance(out, tuple) else out
            except BaseException:  # noqa: BLE001 - timing must never break the collective
                return out
            for interceptor in kernels.active:
                interceptor.issued(spec, args, tensor, boxed, t0)
            return out

        return kernel

    def _waiting(self, op: Any) -> Callable[..., Any]:
        redispatch = op.redispatch
        below = _dispatch_key()
        kernels = self

        def kernel(keyset: Any, *args: Any, **kwargs: Any) -> Any:
            t0 = _now()
            try:
                return redispatch(keyset.remove(below), *args, **kwargs)
            finally:
                t1 = _now()
                thread = threading.get_ident()
                key = None
                if any(i.pending for i in kernels.active):
                    with contextlib.suppress(Exception):  # a tensor without storage (a subclass)
                        key = _storage_key(args[0])
                for interceptor in kernels.active:
                    interceptor.waited(key, t0, t1, thread)

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


def _dispatch_key() -> Any:
    from torch._C import DispatchKey

    return getattr(DispatchKey, DISPATCH_KEY)


_KERNELS = _Kernels()


def bucket_timing_hook(
    world_size: int, record: Callable[[int, int], None]
) -> Callable[[Any, Any], Any]:
    """A DDP comm hook that all-reduces each bucket through torch.distributed and calls
    `record(bytes, duration_ns)` when the bucket's all-reduce completes (DDP waits for its
    future in C++, so the interceptor, which times a collective to its wait, leaves DDP's
    buckets to this hook).

    Opt-in detail level: any Python comm hook costs tens to hundreds of µs per bucket
    (docs/evaluation.md), which is why the default path does without. The second parameter must be named `bucket`, and the
    returned future must come from a Python `.then` (returning the work's future asserts).
    """
    import torch.distributed as dist

    def syncscope_bucket_hook(process_group: Any, bucket: Any) -> Any:
        buffer = bucket.buffer()
        buffer.div_(world_size)
        size = buffer.numel() * buffer.element_size()
        t0 = _now()
        work = dist.all_reduce(buffer, group=process_group, async_op=True)

        def reduced(fut: Any) -> Any:
            record(size, _now() - t0)
            return fut.value()[0]

        return work.get_future().then(reduced)

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
