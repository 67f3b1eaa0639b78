"""Start an N-rank job on this machine, one process per rank, the way torchrun would.

Rendezvous goes through a FileStore and gloo is pinned to the loopback interface, so a local
job opens no port on any other address. A caller that spreads ranks over emulated nodes
(syncscope.lab.nodes) passes a per-rank placement (network namespace, hostname) and environment.
After `fork_ranks(True)` the lab workload's ranks are forked from a process that has
already imported torch (syncscope.lab.forkserver) instead of executed afresh; the test suite
does so.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable, Mapping, Sequence
from typing import IO, Protocol

from syncscope.lab.forkserver import FORKED_MODULE, ForkServer, Placement


class RankProcess(Protocol):
    """A started rank: a `subprocess.Popen` or a `syncscope.lab.forkserver.Forked`."""

    pid: int
    returncode: int | None

    def poll(self) -> int | None: ...
    def wait(self, timeout: float | None = None) -> int: ...
    def kill(self) -> None: ...
    def terminate(self) -> None: ...


class _Forking:
    enabled = False
    server: ForkServer | None = None


def fork_ranks(enabled: bool) -> None:
    """From now on, fork the lab workload's ranks from one process that has imported torch,
    started at the first launch that needs it (False: stop it, and execute each rank afresh)."""
    _Forking.enabled = enabled
    if not enabled and _Forking.server is not None:
        _Forking.server.close()
        _Forking.server = None


def fork_server() -> ForkServer | None:
    """The server ranks are forked from, started now if need be (None: forking is off)."""
    if _Forking.enabled and _Forking.server is None:
        _Forking.server = ForkServer()
    return _Forking.server


def _fork_server(module: str, env: Mapping[str, str]) -> ForkServer | None:
    if module != FORKED_MODULE:  # a trainer's script: not started (~5 s of CPU) for nothing
        return None
    server = fork_server()
    return server if server is not None and server.serves(module, env) else None


def launch(
    world_size: int,
    args: Sequence[str],
    env: Mapping[str, str] | None = None,
    module: str = FORKED_MODULE,
    stdout: int | IO[bytes] | None = None,
    stderr: int | IO[bytes] | None = None,
    *,
    local_world_size: int | None = None,
    prefix: Callable[[int], Sequence[str]] | None = None,
    place: Callable[[int], Placement] | None = None,
    rank_env: Callable[[int], Mapping[str, str]] | None = None,
) -> list[RankProcess]:
    """Spawn `python -m module *args` once per rank with torchrun's environment variables.

    Ranks are numbered node by node: LOCAL_RANK is rank mod ``local_world_size`` (default:
    all ranks on one node). ``place(rank)`` puts the rank in a network namespace (and UTS
    namespace), ``prefix(rank)`` goes before the command instead (the rank is then executed,
    never forked), and ``rank_env(rank)`` overrides that rank's variables (e.g.
    ``GLOO_SOCKET_IFNAME``).
    """
    local = local_world_size or world_size
    init_dir = tempfile.mkdtemp(prefix="syncscope-init-")
    # The ranks read the store only while they initialise; the launcher's exit removes it.
    atexit.register(shutil.rmtree, init_dir, True)
    base = dict(os.environ if env is None else env)
    base.update(
        {
            "WORLD_SIZE": str(world_size),
            "LOCAL_WORLD_SIZE": str(local),
            # A FileStore needs only a shared filesystem, so it also spans network namespaces.
            "SYNCSCOPE_INIT_FILE": os.path.join(init_dir, "store"),
            "GLOO_SOCKET_IFNAME": "lo",
            "MASTER_ADDR": "127.0.0.1",
            "OMP_NUM_THREADS": "1",
        }
    )
    procs: list[RankProcess] = []
    for rank in range(world_size):
        rank_vars = dict(base, RANK=str(rank), LOCAL_RANK=str(rank % local))
        if rank_env is not None:
            rank_vars.update(rank_env(rank))
        where = place(rank) if place else Placement()
        server = None if prefix else _fork_server(module, rank_vars)
        if server is not None:
            procs.append(server.spawn(module, args, rank_vars, stdout, stderr, where))
            continue
        before = prefix(rank) if prefix else where.prefix()
        command = [*before, sys.executable, "-m", module, *args]
        procs.append(subprocess.Popen(command, env=rank_vars, stdout=stdout, stderr=stderr))
    return procs


def stop(proc: RankProcess, grace: float = 5.0) -> None:
    """Terminate a rank (or any process), killing it after ``grace`` seconds."""
    if proc.poll() is None:
        proc.terminate()
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(grace)
    if proc.poll() is None:
        proc.kill()
        proc.wait()


def wait_all(procs: Sequence[RankProcess], timeout: float) -> list[int]:
    """Wait for every rank; kill the rest if one fails or time runs out."""
    import time

    deadline = time.monotonic() + timeout
    codes = []
    try:
        for p in procs:
            codes.append(p.wait(timeout=max(0.1, deadline - time.monotonic())))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return codes
