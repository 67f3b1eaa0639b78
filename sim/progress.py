"""A stdlib progress bar on stderr, drawn only when stderr is a terminal."""

from __future__ import annotations

import sys
import time
from typing import TextIO


class Progress:
    """Counts units of work (simulated steps) and redraws at most ~10 times a second.

    Silent when the stream is not a TTY (pipes, CI logs, tests), so output stays clean.
    """

    def __init__(
        self, total: int, label: str = "", stream: TextIO | None = None, width: int = 30
    ) -> None:
        self.total = max(int(total), 1)
        self.label = label
        self.stream = stream if stream is not None else sys.stderr
        self.width = width
        self.done = 0
        self.enabled = bool(getattr(self.stream, "isatty", lambda: False)())
        self._started = time.monotonic()
        self._last_draw = 0.0

    def __call__(self, units: int) -> None:
        self.advance(units)

    def advance(self, units: int) -> None:
        self.done = min(self.done + units, self.total)
        if not self.enabled:
            return
        now = time.monotonic()
        if now - self._last_draw >= 0.1 or self.done >= self.total:
            self._last_draw = now
            self._draw(now)

    def _draw(self, now: float) -> None:
        fraction = self.done / self.total
        filled = int(fraction * self.width)
        elapsed = now - self._started
        eta = elapsed / fraction - elapsed if fraction > 0 else 0.0
        bar = "█" * filled + "·" * (self.width - filled)
        self.stream.write(
            f"\r{self.label} {bar} {fraction:4.0%}  {elapsed:5.1f}s elapsed, ~{eta:4.1f}s left "
        )
        self.stream.flush()

    def close(self) -> None:
        if self.enabled:
            self.stream.write("\r" + " " * (len(self.label) + self.width + 40) + "\r")
            self.stream.flush()

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
