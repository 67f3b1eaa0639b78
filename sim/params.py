"""A complete simulation parameter set, and its JSON form (the files in sim/params/)."""

from __future__ import annotations

import copy
import json
from dataclasses import asdict, dataclass, field, fields, replace
from importlib import resources
from pathlib import Path
from typing import Any

from syncscope.agent.pacing import PacingConfig
from syncscope.sim.compute import ComputeModel
from syncscope.sim.fabric import FabricModel


@dataclass(frozen=True)
class CheckpointModel:
    """Periodic checkpoint stalls: every ``every_steps`` steps, ``stall_s`` seconds.

    ``ranks = "all"``: a synchronous save on every rank (no skew, a long step). ``"first"``: rank
    0 writes while the others run ahead and wait for it at the next collective (a skew spike that
    the pacing controller must not mistake for an imbalance).
    """

    every_steps: int = 0
    stall_s: float = 0.0
    ranks: str = "all"

    def __post_init__(self) -> None:
        if self.every_steps < 0 or self.stall_s < 0 or self.ranks not in ("all", "first"):
            raise ValueError("CheckpointModel: every_steps, stall_s >= 0; ranks 'all' or 'first'")


@dataclass(frozen=True)
class SimParams:
    """Everything one simulated job needs, plus the run settings of a parameter file."""

    name: str = "custom"
    description: str = ""
    samples_per_rank: float = 1.0
    compute: ComputeModel = field(default_factory=ComputeModel)
    fabric: FabricModel = field(default_factory=FabricModel)
    checkpoint: CheckpointModel = field(default_factory=CheckpointModel)
    # PacingConfig fields that differ from the agent's defaults (world_size is set per run).
    pacing: dict[str, Any] = field(default_factory=dict)
    nodes: tuple[int, ...] = (4, 8, 16)
    steps: int = 2000
    warmup_steps: int = 200
    seed: int = 0
    # Free-form: reference numbers (e.g. the paper's), notes, ablations.
    extra: dict[str, Any] = field(default_factory=dict)

    def pacing_config(self, world_size: int) -> PacingConfig:
        return PacingConfig(**{**self.pacing, "world_size": world_size})

    def ranks(self, nodes: int) -> int:
        return nodes * self.fabric.gpus_per_node

    def with_overrides(self, overrides: dict[str, Any]) -> SimParams:
        """Copy with dotted-path overrides, e.g. ``{"fabric.skew_coupling": 0.0}``."""
        data = self.to_dict()
        for path, value in overrides.items():
            node = data
            *parents, leaf = path.split(".")
            for key in parents:
                node = node.setdefault(key, {})
            node[leaf] = value
        return params_from_dict(data)

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["nodes"] = list(self.nodes)
        return data


_SECTIONS = {"compute": ComputeModel, "fabric": FabricModel, "checkpoint": CheckpointModel}


def params_from_dict(data: dict[str, Any]) -> SimParams:
    """Build SimParams from a plain dict; unknown keys raise so that typos do not pass silently."""
    # Keys starting with "$" are comments (JSON has none), at any level of a parameter file.
    data = {k: v for k, v in copy.deepcopy(data).items() if not k.startswith("$")}
    known = {f.name for f in fields(SimParams)}
    unknown = set(data) - known
    if unknown:
        raise ValueError(f"unknown parameter keys: {', '.join(sorted(unknown))}")
    for key, cls in _SECTIONS.items():
        section = data.get(key, {})
        if isinstance(section, dict):
            section = {k: v for k, v in section.items() if not k.startswith("$")}
            allowed = {f.name for f in fields(cls)}
            bad = set(section) - allowed
            if bad:
                raise ValueError(f"unknown {key} keys: {', '.join(sorted(bad))}")
            data[key] = cls(**section)
    pacing = {k: v for k, v in data.get("pacing", {}).items() if not k.startswith("$")}
    PacingConfig(**pacing)  # validate early
    data["pacing"] = pacing
    if "nodes" in data:
        data["nodes"] = tuple(int(n) for n in data["nodes"])
    return replace(SimParams(), **data)


def load_params(source: str | Path) -> SimParams:
    """Load a parameter file: a path, or the name of a bundled set (``paper_table1``)."""
    path = Path(source)
    if path.suffix != ".json" and not path.exists():
        text = resources.files("syncscope.sim").joinpath("params", f"{source}.json").read_text()
    else:
        text = path.read_text()
    return params_from_dict(json.loads(text))


def bundled_params() -> list[str]:
    """Names of the parameter sets shipped in sim/params/."""
    folder = resources.files("syncscope.sim").joinpath("params")
    return sorted(p.name[:-5] for p in folder.iterdir() if p.name.endswith(".json"))
