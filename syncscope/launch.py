"""Start an N-rank job on this machine, one process per rank, the way torchrun would.

Rendezvous goes through a FileStore and gloo is pinned to the loopback interface, so a local
job opens no port on any other address.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from collections.abc import Mapping, Sequence
from typing import IO


def launch(
    world_size: int,
    args: Sequence[str],
    env: Mapping[str, str] | None = None,
    module: str = "syncscope.workload",
    stdout: int | IO[bytes] | None = None,
    stderr: int | IO[bytes] | None = None,
) -> list[subprocess.Popen]:
    """Spawn `python -m module *args` once per rank with torchrun's environment variables."""
    init_dir = tempfile.mkdtemp(prefix="syncscope-init-")
    base = dict(os.environ if env is None else env)
    base.update(
        {
            "WORLD_SIZE": str(world_size),
            "LOCAL_WORLD_SIZE": str(world_size),
            "SYNCSCOPE_INIT_FILE": os.path.join(init_dir, "store"),
            "GLOO_SOCKET_IFNAME": "lo",
            "MASTER_ADDR": "127.0.0.1",
            "OMP_NUM_THREADS": "1",
        }
    )
    procs = []
    for rank in range(world_size):
        rank_env = dict(base, RANK=str(rank), LOCAL_RANK=str(rank))
        procs.append(
            subprocess.Popen(
                [sys.executable, "-m", module, *args], env=rank_env, stdout=stdout, stderr=stderr
            )
        )
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
