"""syncscope.lab.forkserver: a forked child is `python -m module args` with the request's
environment, directory and stdio, and its exit status reaches the client as Popen's would."""

from __future__ import annotations

import json
import os
import signal
import subprocess
from collections.abc import Iterator

import pytest

from syncscope.lab.forkserver import ForkServer, Placement

PROBE = "tests.fixtures.fork_probe"


@pytest.fixture(scope="module")
def server() -> Iterator[ForkServer]:
    s = ForkServer(preload=("json",))  # nothing heavy: the mechanism, not torch
    yield s
    s.close()


def test_the_child_runs_the_module_with_its_args_env_directory_and_stdio(server, tmp_path):
    out, err = tmp_path / "out", tmp_path / "err"
    with open(out, "wb") as o, open(err, "wb") as e:
        child = server.spawn(PROBE, ["3"], dict(server.env, PROBE="yes"), stdout=o, stderr=e)
    assert child.wait(30) == 3 and child.poll() == 3
    seen = json.loads(out.read_text())
    assert seen == {"argv": ["3"], "cwd": os.getcwd(), "probe": "yes"}
    assert err.read_text() == "to stderr\n"
    with open(out, "wb") as o:
        child = server.spawn(PROBE, ["0"], server.env, stdout=o, stderr=subprocess.STDOUT)
    assert child.wait(30) == 0
    assert out.read_text().endswith("to stderr\n")


def test_a_killed_child_reads_as_killed_and_wait_times_out_while_it_runs(server):
    child = server.spawn(PROBE, ["sleep"], server.env, stdout=subprocess.DEVNULL)
    with pytest.raises(subprocess.TimeoutExpired):
        child.wait(0.2)
    assert child.poll() is None
    os.kill(child.pid, 0)  # a real process of this machine
    child.kill()
    assert child.wait(30) == -signal.SIGKILL


def test_closing_the_server_kills_the_children_still_running():
    s = ForkServer(preload=())
    child = s.spawn(PROBE, ["sleep"], s.env, stdout=subprocess.DEVNULL)
    s.close()
    assert child.wait(30) == -signal.SIGKILL
    assert not os.path.exists(s.path)


def test_a_server_started_from_a_thread_outlives_the_thread():
    # A test's launcher thread can be the first to need the server (the trainer tiers run
    # their ranks from one); the server must still serve the session after that thread ends.
    import threading

    started: list[ForkServer] = []
    thread = threading.Thread(target=lambda: started.append(ForkServer(preload=())))
    thread.start()
    thread.join()
    s = started[0]
    try:
        child = s.spawn(PROBE, ["0"], s.env, stdout=subprocess.DEVNULL)
        assert child.wait(30) == 0
    finally:
        s.close()


def test_only_the_lab_workload_under_the_servers_pythonpath_is_forked(server):
    assert server.serves("syncscope.lab.workload", server.env)
    assert not server.serves("train_script", server.env)
    assert not server.serves("syncscope.lab.workload", dict(server.env, PYTHONPATH="/elsewhere"))


def test_a_placement_is_the_prefix_a_fresh_process_would_run_under():
    assert Placement().prefix() == []
    assert Placement("ns0").prefix() == ["ip", "netns", "exec", "ns0"]
    assert Placement("ns0", "node0").prefix()[-2:] == ['hostname "$0" && exec "$@"', "node0"]
