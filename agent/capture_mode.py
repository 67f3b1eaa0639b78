"""Let syncscope's background threads touch CUDA while the training thread captures a CUDA graph.

A capture started in the default `capture_error_mode="global"` (`torch.cuda.graph`,
`torch.cuda.make_graphed_callables`) forbids "potentially unsafe" CUDA calls in *every* thread
that is itself in global mode, and the first such call invalidates the capture:
`cudaEventQuery` is one. syncscope's event resolver (agent/cuda_timing.py) queries events and
Flight Recorder's dump (agent/nccl_trace.py) queries the events of collectives still in flight,
both from threads of their own. PyTorch hit the same with its NCCL watchdog and fixed it by
switching that thread to thread-local capture mode (c10::cuda::CUDAStreamCaptureModeGuard);
this does the same for our threads, once per thread, through the driver API
(`cuThreadExchangeStreamCaptureMode`, per thread, no context needed). In thread-local mode a
thread's calls only conflict with captures it started itself, and it starts none.

The training thread needs the opposite care: an event recorded *inside* a capture becomes a
node of the graph, not a point in the stream, so the phase clock records nothing while the
current stream is capturing (cuda_timing.CudaPhaseClock, `stream_of`).
"""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Callable

CU_STREAM_CAPTURE_MODE_THREAD_LOCAL = 1  # CUstreamCaptureMode, cuda.h
_state = threading.local()


def _driver_exchange(mode: int) -> bool:
    lib = ctypes.CDLL("libcuda.so.1")
    value = ctypes.c_int(mode)
    return int(lib.cuThreadExchangeStreamCaptureMode(ctypes.byref(value))) == 0


def thread_local_capture_mode(exchange: Callable[[int], bool] = _driver_exchange) -> bool:
    """Put the calling thread in thread-local capture mode (once per thread). True if it is.

    Never raises: without a CUDA driver there is no capture to protect, and the answer is False.
    """
    done = getattr(_state, "done", None)
    if done is not None:
        return bool(done)
    try:
        ok = bool(exchange(CU_STREAM_CAPTURE_MODE_THREAD_LOCAL))
    except (OSError, AttributeError, TypeError, ValueError):
        ok = False
    _state.done = ok
    return ok
