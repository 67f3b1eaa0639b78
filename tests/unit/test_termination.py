"""SIGTERM to a running pytest (a CI job's timeout, `kill`) ends the run as Ctrl-C does
(tests/conftest.py's end_on_termination): what a fixture started is stopped by its teardown,
serial or under pytest-xdist with only the controller told, where the default action left the
suite's exporters running for good."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import ROOT

# A test whose fixture starts a process, says its pid, and stops it at teardown; the test
# itself waits long past the time the run is given.
STARTS_A_PROCESS = """
import os, subprocess, sys, time
import pytest

@pytest.fixture
def server():
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    with open(os.environ["STARTED"], "w") as out:
        out.write(str(proc.pid))
    yield proc
    proc.kill()
    proc.wait()

def test_runs_long(server):
    time.sleep(120)
"""


def alive(pid: int) -> bool:
    """Whether `pid` is a process that has not exited (a zombie has)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


@pytest.mark.parametrize("xdist", [False, True])
def test_sigterm_to_pytest_stops_what_its_fixtures_started(tmp_path: Path, xdist: bool) -> None:
    (tmp_path / "test_long.py").write_text(STARTS_A_PROCESS)
    started = tmp_path / "started"
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p"]
    command += ["tests.conftest", "--rootdir", str(tmp_path), str(tmp_path / "test_long.py")]
    command += ["-n", "1"] if xdist else []
    env = dict(os.environ, STARTED=str(started), PYTHONPATH=str(ROOT))
    run = subprocess.Popen(
        command, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
    )
    try:
        deadline = time.monotonic() + 60
        while not (started.exists() and started.read_text()) and time.monotonic() < deadline:
            assert run.poll() is None, run.communicate()[0].decode(errors="replace")
            time.sleep(0.1)
        child = int(started.read_text())
        assert alive(child)
        run.send_signal(signal.SIGTERM)  # the pytest process alone, not its group
        output = run.communicate(timeout=30)[0].decode(errors="replace")
    finally:
        if run.poll() is None:
            run.kill()
            run.wait()
    deadline = time.monotonic() + 10
    while alive(child) and time.monotonic() < deadline:
        time.sleep(0.1)
    left = alive(child)
    if left:
        os.kill(child, signal.SIGKILL)
    assert not left, f"pid {child} still ran after its pytest ended:\n{output}"
    assert "KeyboardInterrupt: SIGTERM received" in output, output
