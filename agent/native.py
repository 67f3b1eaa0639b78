"""syncscope's C++ library: the dispatcher kernel that times c10d ops (csrc/c10d_timing.cpp), the
backward phase's gradient trigger (csrc/backward_trigger.cpp, grad_triggers.py's native mode)
and the phase clock's busiest hooks (csrc/hot_path.cpp, phase_hooks.instrument); built once per
torch version and source, loaded into the training process with ctypes.

The Python kernel (collectives.py) costs ~35 µs per collective, which an FSDP2 job issuing
tens per step pays on its training thread; the C++ one ~4 µs (docs/parallelism.md). Building
needs a C++ compiler and torch's headers (the wheel ships them) and takes ~15 s, so it never
happens inside attach(): `scripts/setup` runs `python -m syncscope.agent.native`, and an agent
that finds no library for its torch falls back to the Python kernel and says so once.

The library lives in $SYNCSCOPE_NATIVE_DIR, else ~/.cache/syncscope/native, under a directory
named by the torch version and the source's hash: a torch upgrade or a changed source never
loads a stale build.
"""

from __future__ import annotations

import argparse
import ctypes
import hashlib
import logging
import os
import sys
from pathlib import Path
from typing import Any

log = logging.getLogger("syncscope.agent")

CSRC = Path(__file__).with_name("csrc")
SOURCES = (  # they include clock.h
    CSRC / "c10d_timing.cpp",
    CSRC / "backward_trigger.cpp",
    CSRC / "hot_path.cpp",
)
NAME = "syncscope_c10d"
ABI = 8  # csrc's kAbi: a library answering another is not loaded
ENV_DIR = "SYNCSCOPE_NATIVE_DIR"
DRAIN_BATCH = 4096


class _Record(ctypes.Structure):
    _fields_ = [  # noqa: RUF012 - ctypes' declaration
        ("t0", ctypes.c_int64),
        ("t1", ctypes.c_int64),
        ("bytes", ctypes.c_int64),
        ("step", ctypes.c_int64),
        ("op", ctypes.c_int32),
        ("group", ctypes.c_int32),
        ("in_autograd", ctypes.c_int32),
        ("pad", ctypes.c_int32),
    ]


def build_dir(torch_version: str) -> Path:
    files = sorted(CSRC.glob("*.cpp")) + sorted(CSRC.glob("*.h"))  # what the build reads
    digest = hashlib.sha256(b"".join(f.read_bytes() for f in files)).hexdigest()[:12]
    base = os.environ.get(ENV_DIR) or str(Path.home() / ".cache" / "syncscope" / "native")
    return Path(base) / f"torch-{torch_version}-{digest}"


def library_file(torch_version: str) -> Path:
    return build_dir(torch_version) / f"{NAME}.so"


def build(verbose: bool = False) -> Path:
    """Compile the kernel for the installed torch (a no-op when it is built); its path."""
    import torch
    from torch.utils import cpp_extension

    out = build_dir(torch.__version__)
    out.mkdir(parents=True, exist_ok=True)
    cpp_extension.load(
        name=NAME,
        sources=[str(source) for source in SOURCES],
        build_directory=str(out),
        is_python_module=False,
        extra_cflags=["-O2"],
        verbose=verbose,
    )
    return library_file(torch.__version__)


class Native:
    """The loaded library: install kernels, drain their records, name their groups, and the
    step number the kernels stamp on what they see (`step.value`, set by the phase clock)."""

    # csrc/hot_path.cpp's hooks: the optimizer's step pre- and post-hooks,
    # torch.autograd.backward, a model's forward, a parameter's gradient (the trigger's), the
    # callback A it queues
    HOT_PRE, HOT_POST, HOT_BACKWARD, HOT_FORWARD, HOT_GRAD, HOT_DONE, HOT_FWD_PRE, HOT_FWD_POST = (
        range(8)
    )

    def __init__(self, lib: ctypes.CDLL) -> None:
        self._lib = lib
        lib.syncscope_install.argtypes = [ctypes.c_char_p] + [ctypes.c_int32] * 3
        lib.syncscope_install.restype = ctypes.c_int32
        lib.syncscope_error.restype = ctypes.c_char_p
        lib.syncscope_drain.argtypes = [ctypes.POINTER(_Record), ctypes.c_int64]
        lib.syncscope_drain.restype = ctypes.c_int64
        lib.syncscope_group.argtypes = [
            ctypes.c_int32,
            ctypes.c_char_p,
            ctypes.c_int64,
            ctypes.c_char_p,
            ctypes.c_int64,
        ]
        lib.syncscope_group.restype = ctypes.c_int32
        lib.syncscope_skip.argtypes = [ctypes.c_uint64, ctypes.c_char_p, ctypes.c_int32]
        lib.syncscope_skip.restype = None
        lib.syncscope_skipped.argtypes = [ctypes.POINTER(ctypes.c_int64)]
        lib.syncscope_skipped.restype = ctypes.c_int64
        lib.syncscope_trigger_install.restype = ctypes.c_int32
        lib.syncscope_trigger_error.restype = ctypes.c_char_p
        self.step = ctypes.c_int64.in_dll(lib, "syncscope_step")
        # The backward trigger's state (csrc/backward_trigger.cpp): armed by the backward
        # wrapper, and when the callback the first watched gradient queued last ran (ns).
        self.bwd_armed = ctypes.c_int64.in_dll(lib, "syncscope_bwd_armed")
        self.bwd_done = ctypes.c_int64.in_dll(lib, "syncscope_bwd_done")
        self._trigger_ops: Any = None
        self._dropped = ctypes.c_int64.in_dll(lib, "syncscope_dropped")
        self._buffer = (_Record * DRAIN_BATCH)()
        # The same library, its calls holding the GIL: they build Python objects.
        holding_gil = ctypes.PyDLL(lib._name)
        self._hot = holding_gil.syncscope_hot_hook
        self._hot.argtypes = [ctypes.c_int] + [ctypes.py_object] * 3
        self._hot.restype = ctypes.py_object
        self._trigger_calls = holding_gil.syncscope_trigger_calls
        self._trigger_calls.argtypes = [ctypes.py_object]
        self._trigger_calls.restype = None

    def hot_hook(self, kind: int, target: Any, fallback: Any, constants: tuple) -> Any:
        """A hook in C (csrc/hot_path.cpp) doing what the Python callable `fallback` does in its
        common case, and calling it otherwise. `kind`: HOT_PRE (`target`: the clock), HOT_POST
        ((the clock, its bound end_step and _quiet_end, phase_hooks' end mode)),
        HOT_BACKWARD (`target`: (phase_hooks.Clocks, torch.autograd.backward, the clock
        class)), HOT_FORWARD (phase_hooks._hot_forward's), HOT_GRAD ((the clock, callback A:
        a HOT_DONE hook or its bound _backward_done)), HOT_DONE (the clock), HOT_FWD_PRE or
        HOT_FWD_POST ((the clock, its module's ForwardHooks, torch's global forward hooks));
        `constants`: phase_hooks.HOT_CONSTANTS. Raises what the library says (a clock whose
        attributes are not slots: TypeError)."""
        return self._hot(kind, target, fallback, constants)

    def trigger_calls(self, on_grad: Any) -> None:
        """The armed trigger's first watched gradient calls `on_grad(None)` under the GIL (a
        clock that marks its boundaries: its callback A is Python's), or with None stamps the
        time in C++ again (csrc/backward_trigger.cpp)."""
        self._trigger_calls(on_grad)

    def install(self, name: str, op: int, group_at: int, size_at: int | None) -> None:
        """Time c10d op `name`; raises RuntimeError with the dispatcher's reason."""
        size = -1 if size_at is None else size_at
        if self._lib.syncscope_install(name.encode(), op, group_at, size) != 0:
            raise RuntimeError(self._lib.syncscope_error().decode(errors="replace"))

    def trigger_ops(self, torch: Any) -> Any:
        """torch.ops.syncscope with the trigger's ops defined (watch_grad(param) -> hook,
        unwatch_grad(param, hook)); raises RuntimeError with the dispatcher's reason."""
        if self._trigger_ops is None:
            if self._lib.syncscope_trigger_install() != 0:
                raise RuntimeError(self._lib.syncscope_trigger_error().decode(errors="replace"))
            self._trigger_ops = torch.ops.syncscope
        return self._trigger_ops

    def uninstall(self) -> None:
        self._lib.syncscope_uninstall()

    def skip(self, ops: list[int], groups: list[str]) -> None:
        """Leave the ops numbered `ops` untimed inside autograd on the process groups named
        `groups` (DDP's bucket all-reduces: never recorded, so never timed); replaces the
        last call's. Names with a NUL in them are left out."""
        names = [g.encode() for g in groups if "\0" not in g]
        mask = 0
        for op in ops:
            if 0 <= op < 64:
                mask |= 1 << op
        self._lib.syncscope_skip(mask, b"".join(n + b"\0" for n in names), len(names))

    def skipped(self) -> tuple[int, int]:
        """(step, bytes): what `skip` left untimed in the last step that had any before the
        current one ((-1, 0) until there is one): DDP's buckets, and anything else on its group."""
        step = ctypes.c_int64(-1)
        nbytes = self._lib.syncscope_skipped(ctypes.byref(step))
        return step.value, int(nbytes)

    def drain(self) -> list[tuple[int, int, int, int, int, int, bool]]:
        """The records completed so far: (op, group, bytes, t0, t1, step, in_autograd)."""
        out = []
        buffer = self._buffer
        while True:
            n = self._lib.syncscope_drain(buffer, DRAIN_BATCH)
            out += [
                (r.op, r.group, r.bytes, r.t0, r.t1, r.step, bool(r.in_autograd))
                for r in buffer[:n]
            ]
            if n < DRAIN_BATCH:
                return out

    def group(self, index: int) -> tuple[str, str] | None:
        """(name, description) of the kernels' group `index`; None for an unknown one."""
        name, desc = ctypes.create_string_buffer(256), ctypes.create_string_buffer(256)
        if self._lib.syncscope_group(index, name, 256, desc, 256) != 0:
            return None
        return name.value.decode(errors="replace"), desc.value.decode(errors="replace")

    @property
    def dropped(self) -> int:
        return int(self._dropped.value)


_loaded: list[Native | None] = []  # the process's one load attempt


def load(torch: Any) -> Native | None:
    """The library built for this torch, loaded once per process; None (said once, in the
    log) where there is none or it does not load: the caller falls back to Python."""
    if _loaded:
        return _loaded[0]
    native = None
    path = library_file(torch.__version__)
    try:
        if not path.is_file():
            # What a plain `pip install` gets until the kernel is built: said at attach, once.
            log.warning(
                "syncscope: no C++ library for torch %s at %s; timing collectives in Python "
                "(several times dearer per collective), the backward phase from Python's "
                "gradient hooks and every step in Python's hooks (1.5 to 2 times the training "
                "thread's cost per step). Build it once per torch: python -m "
                "syncscope.agent.native",
                torch.__version__,
                path,
            )
        else:
            lib = ctypes.CDLL(str(path))
            if lib.syncscope_abi() != ABI:
                raise RuntimeError(f"ABI {lib.syncscope_abi()}, expected {ABI}")
            native = Native(lib)
    except Exception as exc:  # noqa: BLE001 - the Python kernel serves instead
        log.warning("syncscope: the C++ library did not load (%s); using Python", exc)
        native = None
    _loaded.append(native)
    return native


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Build syncscope's C++ c10d kernel.")
    parser.add_argument("--verbose", action="store_true")
    args = parser.parse_args(argv)
    print(build(verbose=args.verbose))
    return 0


if __name__ == "__main__":
    sys.exit(main())
