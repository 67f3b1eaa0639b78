"""`syncscope demo` cleans up after itself: a demo that fails stops every process it started."""

from __future__ import annotations

import pytest

from syncscope import demo
from syncscope.cli import build_parser


def test_a_demo_that_fails_after_starting_the_exporter_stops_it(monkeypatch):
    started = []
    real_start = demo.start_exporter

    def spy(*args, **kwargs):
        proc = real_start(*args, **kwargs)
        started.append(proc)
        return proc

    def broken_launch(*_args, **_kwargs):
        raise OSError("no ranks today")

    monkeypatch.setattr(demo, "start_exporter", spy)
    monkeypatch.setattr(demo, "launch", broken_launch)
    args = build_parser().parse_args(["demo", "--duration", "1", "--prometheus", "off"])
    with pytest.raises(OSError, match="no ranks today"):
        demo.run(args)
    assert len(started) == 1
    assert started[0].poll() is not None, "the exporter outlived the failed demo"
