"""The Python frames a piece of code enters, counted exactly (the benches' attribution).

`sys.setprofile` sees every Python frame the calling thread enters, whoever calls it. cProfile
does not always: on Python 3.12 (its profiler on sys.monitoring), with torch 2.11, it records no
frame between DDP's `__call__` and its layers', the agent's forward included, with or without
the agent, which a GPU machine's image has.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any


def frames_entered(where: str, run: Callable[[], object]) -> dict[str, int]:
    """{function name: calls} of the Python frames whose code lies under the folder `where`
    that `run()` enters on this thread."""
    counts: dict[str, int] = {}

    def count(frame: Any, event: str, _arg: Any) -> None:
        code = frame.f_code
        if event == "call" and code.co_filename.startswith(where):
            counts[code.co_name] = counts.get(code.co_name, 0) + 1

    previous = sys.getprofile()
    sys.setprofile(count)
    try:
        run()
    finally:
        sys.setprofile(previous)
    return counts


def per_step(counts: dict[str, int], steps: int) -> str:
    """`counts` over `steps` steps: their total a step, then each function's."""
    names = ", ".join(f"{k} {v / steps:g}" for k, v in sorted(counts.items()))
    return f"{sum(counts.values()) / steps:g} ({names})"
