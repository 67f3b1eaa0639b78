"""Fabric model: link classes, a two-tier hierarchy with oversubscription, all-reduce cost, contention.

Topology. ``gpus_per_node`` ranks share a node (intra-node links, NVLink class); nodes hang off
leaf switches, ``nodes_per_leaf`` each (0: one switch, no spine); leaves reach each other
through the spine over uplinks of capacity ``nodes_per_leaf · nic_bandwidth / oversubscription``.

All-reduce of ``S`` bytes in ``buckets`` buckets of ``S_b``, hierarchical as NCCL does it
(reduce-scatter in the node, all-reduce of its shard across ``n`` nodes, all-gather in the node):

    intra  = 2 · ((g-1)/g · S_b / intra_bandwidth + (g-1) · intra_latency)        (g > 1)
    ring   = 2 · (n-1)/n · S_b / bw_eff + 2 · (n-1) · hop_latency
    tree   = 2 · S_b / bw_eff + 2 · ceil(log2 n) · hop_latency
    bucket = intra + (ring | tree | the cheaper of the two for "auto")

With one link class (``gpus_per_node = 1``, ``nodes_per_leaf = 0``) that is the textbook ring.
Contention, only across leaves: a fraction ``cf = (L-1)/L`` of ring neighbours sit behind the
spine (``cross_leaf_fraction`` overrides), so each uplink carries ``f = nodes_in_leaf · cf``
flows, each getting ``uplink_capacity · (1 - rho_l) / f`` with ``rho_l = min(max_utilization,
u_l + k_l)``; ``bw_eff`` is the slowest of those and ``nic_bandwidth``, and crossing hops add
``spine_latency / (1 - max rho)``. ``u_l``: other tenants' traffic, an AR(1) process per leaf.
``k_l``: arrival-skew load, ``skew_coupling · cf · mean over ranks r in leaf l of min(wait_r,
park_limit) / park_limit``: early ranks' pending sends share the uplink with the critical path,
the mechanism through which pacing can pay off; ``skew_coupling = 0`` turns it off. Its strength
is an assumption calibrated on the paper's Table 1, not measured (docs/simulator.md).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

ALGORITHMS = ("ring", "tree", "auto")


@dataclass(frozen=True)
class FabricModel:
    """Link classes, hierarchy and contention parameters (see the module docstring)."""

    gradient_bytes: float = 1.0e8
    buckets: int = 1
    algorithm: str = "ring"
    gpus_per_node: int = 1
    intra_bandwidth_Bps: float = 300e9
    intra_latency_s: float = 2e-6
    nic_bandwidth_Bps: float = 12.5e9
    nic_latency_s: float = 5e-6
    nodes_per_leaf: int = 0
    oversubscription: float = 1.0
    spine_latency_s: float = 2e-6
    cross_leaf_fraction: float | None = None
    background_utilization: float = 0.0
    background_sd: float = 0.0
    background_corr_steps: float = 50.0
    skew_coupling: float = 0.0
    park_limit_s: float = 0.05
    max_utilization: float = 0.95

    def __post_init__(self) -> None:
        if self.algorithm not in ALGORITHMS:
            raise ValueError(f"FabricModel.algorithm must be one of {ALGORITHMS}")
        positive = (
            "gradient_bytes",
            "intra_bandwidth_Bps",
            "nic_bandwidth_Bps",
            "oversubscription",
            "park_limit_s",
            "background_corr_steps",
        )
        for name in positive:
            if not getattr(self, name) > 0:
                raise ValueError(f"FabricModel.{name} must be > 0")
        if self.buckets < 1 or self.gpus_per_node < 1 or self.nodes_per_leaf < 0:
            raise ValueError("FabricModel: buckets, gpus_per_node >= 1 and nodes_per_leaf >= 0")
        if not 0 <= self.max_utilization < 1:
            raise ValueError("FabricModel.max_utilization must be in [0, 1)")
        if self.skew_coupling < 0 or self.background_utilization < 0 or self.background_sd < 0:
            raise ValueError("FabricModel: loads must be >= 0")


class Fabric:
    """The fabric of one job size: precomputed topology, per-step state and cost."""

    def __init__(self, model: FabricModel, nodes: int, rng: np.random.Generator) -> None:
        self.model = m = model
        self.nodes = nodes
        self.ranks = nodes * m.gpus_per_node
        self.rng = rng
        per_leaf = m.nodes_per_leaf if m.nodes_per_leaf > 0 else nodes
        self.leaves = math.ceil(nodes / per_leaf)
        nodes_in_leaf = np.minimum(per_leaf, nodes - per_leaf * np.arange(self.leaves))
        self.leaf_rank_starts = np.arange(self.leaves) * per_leaf * m.gpus_per_node
        self.leaf_rank_counts = nodes_in_leaf * m.gpus_per_node
        if self.leaves > 1:
            cf = (
                m.cross_leaf_fraction
                if m.cross_leaf_fraction is not None
                else (self.leaves - 1) / self.leaves
            )
        else:
            cf = 0.0
        self.cross_fraction = cf
        uplink = per_leaf * m.nic_bandwidth_Bps / m.oversubscription
        flows = np.maximum(nodes_in_leaf * cf, 1.0)
        # Bandwidth per flow at zero load, per leaf.
        self._share_at_idle = uplink / flows
        g = m.gpus_per_node
        bucket_bytes = m.gradient_bytes / m.buckets
        self.bucket_bytes = bucket_bytes
        self._intra_s = (
            2.0 * ((g - 1) / g * bucket_bytes / m.intra_bandwidth_Bps + (g - 1) * m.intra_latency_s)
            if g > 1
            else 0.0
        )
        n = nodes
        # (bandwidth coefficient, latency hops) for the inter-node phase of one bucket
        ring = (2.0 * (n - 1) / n, 2.0 * (n - 1))
        tree = (2.0, 2.0 * math.ceil(math.log2(n))) if n > 1 else (0.0, 0.0)
        self._algorithms = {"ring": [ring], "tree": [tree], "auto": [ring, tree]}[m.algorithm]
        self._phi = math.exp(-1.0 / m.background_corr_steps)
        self._bg_kick = m.background_sd * math.sqrt(1.0 - self._phi**2)
        self.background = np.clip(
            m.background_utilization + m.background_sd * rng.standard_normal(self.leaves),
            0.0,
            m.max_utilization,
        )
        self._spread_fabric = self.leaves > 1 and cf > 0

    def advance(self) -> None:
        """Move the other tenants' load one step on (AR(1) per leaf uplink)."""
        m = self.model
        if m.background_sd > 0 and self.leaves > 1:
            mean = m.background_utilization
            noise = self.rng.standard_normal(self.leaves)
            self.background = mean + self._phi * (self.background - mean) + self._bg_kick * noise
            np.clip(self.background, 0.0, m.max_utilization, out=self.background)

    def skew_load(self, waits: np.ndarray) -> np.ndarray | float:
        """Per-leaf uplink load from traffic of ranks that arrived early (``k_l`` above)."""
        m = self.model
        if not self._spread_fabric or m.skew_coupling == 0:
            return 0.0
        parked = np.minimum(waits, m.park_limit_s)
        per_leaf = np.add.reduceat(parked, self.leaf_rank_starts) / self.leaf_rank_counts
        return (m.skew_coupling * self.cross_fraction / m.park_limit_s) * per_leaf

    def bucket_time(self, skew_load: np.ndarray | float = 0.0) -> float:
        """Seconds one bucket's all-reduce takes once every rank has contributed it."""
        m = self.model
        if self.nodes <= 1:
            return self._intra_s
        if self._spread_fabric:
            rho = np.minimum(self.background + skew_load, m.max_utilization)
            share = float(np.min(self._share_at_idle * (1.0 - rho)))
            bandwidth = min(m.nic_bandwidth_Bps, share)
            queueing = 1.0 / (1.0 - float(np.max(rho)))
            hop = m.nic_latency_s + self.cross_fraction * m.spine_latency_s * queueing
        else:
            bandwidth = m.nic_bandwidth_Bps
            hop = m.nic_latency_s
        inter = min(
            coeff * self.bucket_bytes / bandwidth + hops * hop for coeff, hops in self._algorithms
        )
        return self._intra_s + inter

    def ideal_bucket_time(self) -> float:
        """Bucket time on an idle fabric (no tenants, no skew): the contention-free reference."""
        saved = self.background
        self.background = np.zeros(self.leaves)
        try:
            return self.bucket_time(0.0)
        finally:
            self.background = saved
