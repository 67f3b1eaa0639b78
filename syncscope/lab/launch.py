"""Start an N-rank job on this machine, one process per rank, the way torchrun would.

Rendezvous goes through a FileStore and gloo is pinned to the loopback interface, so a local
job opens no port on any other address. A caller that spreads ranks over emulated nodes
(syncscope.lab.nodes) passes a per-rank command prefix and environment instead.
"""

from __future__ import annotations

import atexit
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable, Mapping, Sequence
from typing import IO


def launch(
    world_size: int,
    args: Sequence[str],
    env: Mapping[str, str] | None = None,
    module: str = "syncscope.lab.workload",
    stdout: int | IO[bytes] | None = None,
    stderr: int | IO[bytes] | None = None,
    *,
    local_world_size: int | None = None,
    prefix: Callable[[int], Sequence[str]] | None = None,
    rank_env: Callable[[int], Mapping[str, str]] | None = None,
) -> list[subprocess.Popen]:
    """Spawn `python -m module *args` once per rank with torchrun's environment variables.

    Ranks are numbered node by node: LOCAL_RANK is rank mod ``local_world_size`` (default:
    all ranks on one node). ``prefix(rank)`` goes before the command (e.g. ``ip netns exec``)
    and ``rank_env(rank)`` overrides that rank's variables (e.g. ``GLOO_SOCKET_IFNAME``).
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
    procs = []
    for rank in range(world_size):
        rank_vars = dict(base, RANK=str(rank), LOCAL_RANK=str(rank % local))
        if rank_env is not None:
            rank_vars.update(rank_env(rank))
        command = [*(prefix(rank) if prefix else ()), sys.executable, "-m", module, *args]
        procs.append(subprocess.Popen(command, env=rank_vars, stdout=stdout, stderr=stderr))
    return procs


def wait_all(procs: Sequence[subprocess.Popen], timeout: float) -> list[int]:
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
