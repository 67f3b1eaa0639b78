"""Node-local diagnosis in the paper's §3.3 terms, shared by /metrics, /v1/state and the page.

Each mode gives a score in 0..1 and a one-line reason; `verdict` is the score crossing 0.5.
  straggler           arrival skew (max − min lead) above max(skew threshold, 5 % of the
                      median step); the rank with the smallest lead is named. Score: skew ÷ step.
  sync_amplification  the share of step time ranks spend waiting for peers (mean wait ÷ mean
                      step), scaled so that 25 % waiting scores 1.
  fabric_contention   exposed communication that is *not* waiting (transfer beyond what the
                      overlap hides) while skew is low, as a share of step; 25 % scores 1.
  runtime_jitter      median step-time CV over the window; CV 0.2 scores 1.
  locality            1 when any rank reports a degraded PCIe link or a NUMA mismatch.
The straggler's cause is the phase (data, forward, backward, optimizer) that makes up at least
80 % of its extra time over the peers' median, a throttling GPU, a locality fault, or unknown.
"""

from __future__ import annotations

import statistics
from typing import Any

CAUSE_PHASES = ("data", "forward", "backward", "optimizer")
CAUSE_SHARE = 0.8


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def _phase_means(rank: dict[str, Any]) -> dict[str, float]:
    steps = rank["recent_steps"][-100:]
    if not steps:
        return {}
    return {p: sum(s["phases"][p] for s in steps) / len(steps) for p in CAUSE_PHASES}


def _locality_fault(topology: dict[str, Any] | None) -> str | None:
    if not topology:
        return None
    width, max_width = topology.get("pcie_link_width"), topology.get("pcie_link_max_width")
    gen, max_gen = topology.get("pcie_link_generation"), topology.get("pcie_link_max_generation")
    if (
        isinstance(width, (int, float))
        and isinstance(max_width, (int, float))
        and 0 < width < max_width
    ):
        return f"PCIe link x{int(width)} of x{int(max_width)}"
    if isinstance(gen, (int, float)) and isinstance(max_gen, (int, float)) and 0 < gen < max_gen:
        return f"PCIe gen {int(gen)} of {int(max_gen)}"
    if topology.get("numa_mismatch") in (1, True, "1"):
        return "process runs on another NUMA node than its GPU"
    return None


def straggler_cause(straggler: dict[str, Any], peers: list[dict[str, Any]]) -> tuple[str, str]:
    """(cause, reason) for a named straggler; cause is a phase, gpu_throttle, locality or unknown."""
    fault = _locality_fault(straggler.get("topology"))
    if fault:
        return "locality", fault
    topo = straggler.get("topology") or {}
    clocks = [p["topology"].get("sm_clock_hertz") for p in peers if p.get("topology")]
    clocks = [c for c in clocks if isinstance(c, (int, float))]
    own = topo.get("sm_clock_hertz")
    if (
        topo.get("throttle_reasons")
        and isinstance(own, (int, float))
        and clocks
        and own < 0.95 * statistics.median(clocks)
    ):
        return (
            "gpu_throttle",
            f"SM clock {own / 1e6:.0f} MHz vs peers' {statistics.median(clocks) / 1e6:.0f} MHz, throttling",
        )
    mine = _phase_means(straggler)
    others = [_phase_means(p) for p in peers]
    others = [o for o in others if o]
    if not mine or not others:
        return "unknown", "not enough steps to compare phases"
    gaps = {p: mine[p] - statistics.median(o[p] for o in others) for p in CAUSE_PHASES}
    positive = {p: g for p, g in gaps.items() if g > 0}
    total = sum(positive.values())
    if total <= 0:
        return "unknown", "no phase is slower than on its peers"
    phase, gap = max(positive.items(), key=lambda kv: kv[1])
    if gap >= CAUSE_SHARE * total:
        return (
            phase,
            f"{phase} takes {gap * 1e3:.1f} ms longer than on its peers ({gap / total:.0%} of its extra time)",
        )
    return "unknown", "no single phase explains 80 % of its extra time"


def diagnose_job(ranks: list[dict[str, Any]], settings: Any) -> dict[str, Any]:
    """Scores, verdicts and reasons for one job's ranks on this node."""
    live = [r for r in ranks if not r["stale"] and r["steps_total"] > 0]
    out: dict[str, Any] = {"modes": {}, "straggler": None, "skew_s": None}
    if not live:
        return out
    step = _median([r["step_time_median_s"] for r in live if r["step_time_median_s"]]) or 0.0
    leads = [(r["arrival_lead_s"], r) for r in live if r["arrival_lead_s"] is not None]
    modes = out["modes"]
    if len(leads) >= 2 and step > 0:
        lo, slow = min(leads, key=lambda x: x[0])
        hi = max(lead for lead, _ in leads)
        skew = hi - lo
        out["skew_s"] = skew
        threshold = max(settings.skew_threshold_s, 0.05 * step)
        score = min(1.0, skew / step)
        if skew > threshold:
            peers = [r for _, r in leads if r is not slow]
            cause, why = straggler_cause(slow, peers)
            out["straggler"] = {"rank": slow["rank"], "cause": cause, "cause_reason": why}
            modes["straggler"] = (
                max(score, 0.5),
                f"rank {slow['rank']} arrives {skew * 1e3:.1f} ms after the earliest peer",
            )
        else:
            modes["straggler"] = (
                min(score, 0.49),
                f"arrival skew {skew * 1e3:.1f} ms is below {threshold * 1e3:.1f} ms",
            )
    waits = [r["wait_mean_s"] for r in live if r["wait_mean_s"] is not None]
    if waits and step > 0:
        ratio = statistics.mean(waits) / step
        modes["sync_amplification"] = (
            min(1.0, ratio / 0.25),
            f"ranks wait for peers {ratio:.0%} of each step",
        )
        exposed = statistics.mean(r["phase_shares"].get("comm_exposed", 0.0) for r in live)
        transfer = max(0.0, exposed - ratio)
        skew_low = out["skew_s"] is None or out["skew_s"] <= max(
            settings.skew_threshold_s, 0.05 * step
        )
        score = min(1.0, transfer / 0.25) if skew_low else 0.0
        modes["fabric_contention"] = (
            score,
            f"exposed transfer (not waiting) is {transfer:.0%} of each step",
        )
    cvs = [r["step_time_cv"] for r in live if r["step_time_cv"] is not None]
    if cvs:
        cv = statistics.median(cvs)
        modes["runtime_jitter"] = (min(1.0, cv / 0.2), f"median step-time CV {cv:.2f}")
    topologies = [r for r in live if r.get("topology")]
    if topologies:
        faults = [(r["rank"], _locality_fault(r["topology"])) for r in topologies]
        faults = [(rank, f) for rank, f in faults if f]
        reason = (
            f"rank {faults[0][0]}: {faults[0][1]}"
            if faults
            else "PCIe links at full width, NUMA aligned"
        )
        modes["locality"] = (1.0 if faults else 0.0, reason)
    out["modes"] = {
        m: {"score": s, "verdict": s >= 0.5, "reason": why} for m, (s, why) in modes.items()
    }
    return out
