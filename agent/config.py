"""Agent settings: one typed object, from keyword arguments first, then SYNCSCOPE_* variables."""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping
from dataclasses import dataclass, fields

from syncscope.wire import MAX_LABEL_LEN

DETAIL_LEVELS = ("default", "buckets")


def _env_bool(value: str | None) -> bool | None:
    if value is None or value == "":
        return None
    return value.strip().lower() in ("1", "true", "yes", "on")


@dataclass
class AgentConfig:
    """Everything a user may set; every field has an env var named SYNCSCOPE_<FIELD>."""

    # http://host:port or unix:///path (HTTP, a reporter thread), shm:///dir (a local exporter
    # reading a shared-memory ring, no thread: agent/shm_ring.py); None: keep records local only
    exporter: str | None = None
    job: str = "default"
    # "default": phases + DDP's exposed communication from autograd callbacks (tens of µs a
    # step: docs/evaluation.md). "buckets": also time every DDP bucket through a comm hook
    # (80–200 µs per bucket).
    detail: str = "default"
    pacing: bool = False
    pacing_kill_file: str | None = None  # pacing stops while this file exists
    # Each flush takes the training process's GIL for ~0.2 ms of reporter CPU per second of
    # 10 ms steps (bench/bench_agent_overhead.py); once a second keeps that near 0.02 % and is
    # still far finer than any Prometheus scrape.
    flush_interval_s: float = 1.0
    queue_size: int = 8192  # records held between flushes; beyond it they are dropped and counted
    send_timeout_s: float = 1.0
    ring_slots: int = 16384  # shm:// only: records the ring holds for the exporter (160 B each)
    # The transport's work falls on every Nth step boundary, the same steps on every rank, so
    # the ranks pause together rather than each at its own phase. shm://: the
    # training thread moves queued rows into the ring there (its first Python code after a
    # step's kernels runs on cold CPU caches, ~30 µs on a 10 ms CPU step, so once per N steps
    # costs less than every step). http/unix: the reporter flushes at the first such boundary
    # of each `flush_interval_s` tick of the wall clock (agent/transport.py).
    align_every_steps: int = 16
    # Time the phases of one step in N, the same steps on every rank (agent/phases.py, "Phase
    # sampling"); the others count their total and work, and report the last timed step's
    # phase shares: a counted step costs the training thread about a third less than a timed
    # one (docs/evaluation.md). For steps of a few ms; with pacing on every step is timed.
    # Not the default: a clean tensor-parallel, pipeline or FSDP run sampled 1 in 16 drew
    # straggler verdicts in the test suite (a timed step's noise carried by the next 15).
    phase_every: int = 1
    token: str | None = None  # bearer token for TCP ingest
    record: str | None = None  # also append step records as JSON lines here ({rank} is replaced)
    patch_collectives: bool = True
    # Time c10d ops with the C++ kernel where it is built (agent/native.py), else in Python
    native_collectives: bool = True
    # Trigger the backward phase from C++ gradient hooks where that library is built, no entry
    # into Python from the autograd engine (agent/grad_triggers.py), and run the forward,
    # backward and optimizer hooks' common case in C (agent/csrc/hot_path.cpp); else Python's
    native_backward: bool = True
    # The work this rank does per step (syncscope_rank_samples_total, _tokens_total). Unset,
    # it is read from the model's inputs (agent/step_work.py) where they say it unambiguously;
    # `agent.count(samples=, tokens=)` in a step overrides both for that step.
    samples_per_step: int | None = None
    tokens_per_step: int | None = None
    # The keyword argument of the model's forward that holds the batch when forward gets no
    # positional one (Hugging Face models: input_ids; the integration sets main_input_name).
    batch_argument: str = "input_ids"
    # Read the work from the model's inputs. Off for inputs whose leading dimension is not
    # the batch (sequence-first RNN or transformer inputs): then only what is set counts.
    detect_work: bool = True
    # The number of this incarnation's first step: the steps a restored checkpoint has done,
    # so that step numbers continue across restarts and the exporter sees the steps a restart
    # runs again (lost progress). Unset: read from the optimizer's restored state at the first
    # step where it keeps one (Adam's "step"), else 0.
    start_step: int | None = None
    disable: bool = False  # hard off switch: attach() returns an agent that does nothing

    @staticmethod
    def env_name(field_name: str) -> str:
        """``phase_every`` -> ``SYNCSCOPE_PHASE_EVERY``."""
        return "SYNCSCOPE_" + field_name.upper()

    @classmethod
    def resolve(
        cls, overrides: Mapping[str, object], env: Mapping[str, str] = os.environ
    ) -> AgentConfig:
        """Keyword arguments win over the environment, which wins over the defaults."""
        known = {f.name: f for f in fields(cls)}
        unknown = set(overrides) - set(known)
        if unknown:
            raise TypeError(f"attach() got unknown settings: {', '.join(sorted(unknown))}")
        values: dict[str, object] = {}
        for name, f in known.items():
            raw = env.get(cls.env_name(name))
            if raw is None or raw == "":
                continue
            kind = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", "")
            if kind.startswith("bool"):
                values[name] = _env_bool(raw)
            elif kind.startswith("int"):
                values[name] = int(raw)
            elif kind.startswith("float"):
                values[name] = float(raw)
            else:
                values[name] = raw
        if "job" not in values:
            launcher_job = launcher_job_id(env)
            if launcher_job:
                values["job"] = launcher_job
        values.update({k: v for k, v in overrides.items() if v is not None})
        config = cls(**values)  # type: ignore[arg-type]
        if config.detail not in DETAIL_LEVELS:
            raise ValueError(f"detail must be one of {DETAIL_LEVELS}, not {config.detail!r}")
        if config.phase_every < 1:
            raise ValueError(f"phase_every must be 1 or more, not {config.phase_every!r}")
        return config


def launcher_job_id(env: Mapping[str, str] = os.environ) -> str | None:
    """The job's identity from its launcher, the same in every incarnation of the job: a
    torchelastic run id (torchrun's default "none" is no id), else Slurm's job id."""
    run_id = env.get("TORCHELASTIC_RUN_ID", "")
    if run_id and run_id != "none":
        return run_id
    return env.get("SLURM_JOB_ID") or None


# Where a node's name comes from, first found: syncscope's own setting; Kubernetes' node name
# (set through the downward API: fieldRef spec.nodeName, as deploy/kubernetes does); Slurm's.
# A pod's hostname is the pod's name, which joins with no node_exporter or dcgm-exporter series.
NODE_NAME_VARIABLES = ("SYNCSCOPE_NODE", "NODE_NAME", "SLURMD_NODENAME")


def node_name(env: Mapping[str, str] = os.environ) -> str:
    for variable in NODE_NAME_VARIABLES:
        if env.get(variable):
            return env[variable][:MAX_LABEL_LEN]
    return socket.gethostname()[:MAX_LABEL_LEN]


def process_started_unix_s(proc: str = "/proc") -> float | None:
    """When this process started, in unix seconds: now less the process's age, which is the
    time since boot (/proc/uptime) less the kernel's start time of the process (/proc/self/stat,
    clock ticks after boot); to a clock tick, where /proc/stat's btime would be to a second.
    None where either is unreadable or the result is not a time before now."""
    import time

    try:
        with open(f"{proc}/self/stat") as f:
            stat = f.read()
        # Fields after the command name (which may hold spaces and parentheses); the start
        # time is field 22 of the whole line, the 20th after the name.
        start_ticks = int(stat.rsplit(")", 1)[1].split()[19])
        with open(f"{proc}/uptime") as f:
            uptime = float(f.read().split()[0])
        age = uptime - start_ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None
    return time.time() - age if age >= 0 else None


def process_identity(env: Mapping[str, str] = os.environ) -> dict[str, object]:
    """Rank, local rank and world size from torch.distributed when it is up, else torchrun's env."""
    rank = int(env.get("RANK", "0"))
    world = int(env.get("WORLD_SIZE", "1"))
    local_rank = int(env.get("LOCAL_RANK", str(rank)))
    try:
        import sys

        dist = sys.modules.get("torch.distributed")
        if dist is not None and dist.is_available() and dist.is_initialized():
            rank, world = dist.get_rank(), dist.get_world_size()
    except Exception:  # identity is best effort; never fail attach() over it
        pass
    return {
        "rank": rank,
        "local_rank": local_rank,
        "world_size": world,
        "hostname": node_name(env),
        "pid": os.getpid(),
    }
