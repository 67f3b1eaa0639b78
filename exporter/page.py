"""The built-in status page at `/`: what is wrong with the job, at a glance, without Grafana.

It is rendered on the server from the same snapshot as /metrics and /v1/state (so there is one
renderer, testable without a browser); a small script re-fetches the body every two seconds,
and without script a meta refresh does. Nothing comes from a CDN: the stylesheet and the script
are served from exporter/static. Every state is written out in words and every chart has a text
equivalent, so nothing depends on telling colours apart. Links are relative, so the page also
works behind `kubectl port-forward` or a path-prefixing proxy.
"""

from __future__ import annotations

import html
import statistics
import time
from collections.abc import Mapping, Sequence
from importlib import resources
from typing import Any

from fastapi import FastAPI
from fastapi.responses import HTMLResponse, Response
from syncscope.exporter.diagnosis import (
    Diagnosis,
    Victim,
    locality_fault,
    snapshot,
    throttle_reasons,
)
from syncscope.exporter.energy import CpuEnergy
from syncscope.exporter.findings import rank_list
from syncscope.exporter.gpu import ENERGY_KEY, has_gpu, topology_number
from syncscope.exporter.settings import Settings
from syncscope.exporter.store import JobView, RankView, Store, StoreView

from syncscope import __version__
from syncscope.catalog import STEP_WINDOW
from syncscope.wire import PacingState, Phase

REFRESH_MS = 2000
TREND_STEPS = 120  # steps in the job's sparklines
RANK_TREND_STEPS = 60  # steps in each rank's sparkline
CV_WINDOW = 20  # steps per point of the rolling step-time CV
MAX_RANK_ROWS = 64  # a node rarely has more; beyond it the table keeps the interesting ones

MODE_NAMES = {
    "straggler": "Straggler",
    "sync_amplification": "Synchronization amplification",
    "fabric_contention": "Fabric contention",
    "slow_link": "Slow link",
    "runtime_jitter": "Runtime jitter",
    "locality": "GPU locality",
}
MODE_MISSING = {
    "straggler": "needs arrival leads from at least two ranks",
    "sync_amplification": "needs steps reported by every rank",
    "fabric_contention": "needs DDP's exposed communication from every rank",
    "slow_link": "needs the job-wide view (--prometheus-url) and the ranks' link facts",
    "runtime_jitter": "needs a few steps",
    "locality": "no GPU topology reported (CPU ranks, or NVML unavailable)",
}
PHASE_NAMES = {p: p.label for p in Phase} | {Phase.COMM_EXPOSED: "exposed comm"}
# Colour plus a texture per phase, so the stacked bars read without colour vision too.
# (fill, texture ink, texture: one of solid, slash, backslash, dots, hlines, vlines, cross)
PHASE_STYLE = {
    Phase.DATA: ("#2a9d8f", "#e9f5f3", "slash"),
    Phase.FORWARD: ("#3a6fd8", "#ffffff", "solid"),
    Phase.BACKWARD: ("#7b4fc4", "#efe8fb", "dots"),
    Phase.OPTIMIZER: ("#d99a16", "#5b3d00", "hlines"),
    Phase.COMM_EXPOSED: ("#d1495b", "#fff1f1", "cross"),
    Phase.PACING: ("#5c946e", "#eef7f0", "vlines"),
    Phase.OTHER: ("#9aa1ab", "#3d434b", "backslash"),
}
STATIC = {"page.css": "text/css; charset=utf-8", "page.js": "text/javascript; charset=utf-8"}
HEADERS = {
    "Content-Security-Policy": (
        "default-src 'none'; style-src 'self'; script-src 'self'; connect-src 'self'; "
        "img-src 'self' data:; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
    ),
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-store",
}

_e = html.escape


# -- formatting -----------------------------------------------------------------------------
def fmt_s(value: float | None) -> str:
    """Seconds as a short human duration; an em dash when unknown."""
    if value is None:
        return "—"
    if abs(value) >= 10:
        return f"{value:.1f} s"
    if abs(value) >= 1:
        return f"{value:.2f} s"
    return f"{value * 1e3:.1f} ms"


def _capital(text: str) -> str:
    return text[:1].upper() + text[1:]


def _fmt_num(value: float | None, digits: int = 2) -> str:
    return "—" if value is None else f"{value:.{digits}f}"


def _ranges(numbers: list[int]) -> str:
    """[0, 1, 2, 5] -> '0–2, 5'."""
    out: list[tuple[int, int]] = []
    for n in sorted(set(numbers)):
        if out and out[-1][1] == n - 1:
            out[-1] = (out[-1][0], n)
        else:
            out.append((n, n))
    return ", ".join(str(a) if a == b else f"{a}–{b}" for a, b in out)


# -- small SVG charts -------------------------------------------------------------------------
def sparkline(
    values: list[float], label: str, width: int = 140, height: int = 28, wide: bool = False
) -> str:
    """An inline SVG line from 0 to the maximum, with its numbers in the accessible label.

    `wide` lets the line stretch to its container's width (the cards) instead of a fixed size.
    """
    if len(values) < 2:
        return f'<span class="muted">{_e(label)}: not enough steps yet</span>'
    top = max(values) or 1.0
    step = (width - 4) / (len(values) - 1)
    pts = " ".join(
        f"{2 + i * step:.1f},{height - 2 - (v / top) * (height - 4):.1f}"
        for i, v in enumerate(values)
    )
    last_x, last_y = pts.rsplit(" ", 1)[-1].split(",")
    marker = "" if wide else f'<circle class="spark-last" cx="{last_x}" cy="{last_y}" r="2.2"/>'
    size = 'preserveAspectRatio="none"' if wide else f'width="{width}" height="{height}"'
    return (
        f'<svg class="spark{" wide" if wide else ""}" viewBox="0 0 {width} {height}" {size} '
        f'role="img" aria-label="{_e(label)}"><title>{_e(label)}</title>'
        f'<line class="spark-base" x1="2" y1="{height - 2}" x2="{width - 2}" y2="{height - 2}" '
        'vector-effect="non-scaling-stroke"/>'
        f'<polyline class="spark-line" points="{pts}" vector-effect="non-scaling-stroke"/>'
        f"{marker}</svg>"
    )


def _series_label(name: str, values: list[float], fmt: Any) -> str:
    return (
        f"{name} over the last {len(values)} steps: min {fmt(min(values))}, "
        f"median {fmt(statistics.median(values))}, max {fmt(max(values))}, last {fmt(values[-1])}"
    )


def phase_bar(shares: Sequence[float], width: int = 150, height: int = 14) -> str:
    """Stacked bar of phase shares (one per Phase; patterned), plus the two largest as text."""
    if not shares:
        return '<span class="muted">no steps yet</span>'
    total = sum(max(0.0, s) for s in shares) or 1.0
    x = 0.0
    rects = []
    for p in Phase:
        w = max(0.0, shares[p]) / total * width
        if w >= 0.5:
            rects.append(
                f'<rect x="{x:.1f}" y="0" width="{w:.1f}" height="{height}" fill="url(#ph-'
                f'{p.label})"><title>{PHASE_NAMES[p]} {shares[p]:.0%}</title></rect>'
            )
        x += w
    top = sorted(((shares[p], p) for p in Phase), reverse=True)
    words = ", ".join(f"{PHASE_NAMES[p]} {s:.0%}" for s, p in top if s >= 0.005)
    caption = " · ".join(f"{PHASE_NAMES[p]} {s:.0%}" for s, p in top[:2] if s >= 0.005)
    frame = f'<rect class="bar-frame" x="0.5" y="0.5" width="{width - 1}" height="{height - 1}"/>'
    return (
        f'<svg class="bar" viewBox="0 0 {width} {height}" width="{width}" height="{height}" '
        f'role="img" aria-label="share of step: {_e(words)}">{"".join(rects)}{frame}</svg>'
        f'<span class="bar-caption">{_e(caption)}</span>'
    )


def score_meter(score: float, line: float, width: int = 56, height: int = 8) -> str:
    """A mode's score as a bar, marked at ``line`` (the verdict score the exporter runs with)."""
    w = max(0.0, min(1.0, score)) * width
    mark = line * width
    return (
        f'<svg class="meter" viewBox="0 0 {width} {height}" width="{width}" height="{height}" '
        f'aria-hidden="true"><rect class="meter-bg" x="0" y="0" width="{width}" '
        f'height="{height}"/><rect class="meter-fill{" hot" if score >= line else ""}" x="0" '
        f'y="0" width="{w:.1f}" height="{height}"/>'
        f'<line class="meter-mark" x1="{mark}" y1="0" x2="{mark}" y2="{height}"/></svg>'
    )


def pattern_defs() -> str:
    """The phase patterns, defined once per page (the refreshed body refers to them by id)."""
    textures = {
        "solid": "",
        "slash": '<path d="M-1,1 l2,-2 M0,6 l6,-6 M5,7 l2,-2" stroke="{ink}" stroke-width="1.2"/>',
        "backslash": '<path d="M-1,5 l2,2 M0,0 l6,6 M5,-1 l2,2" stroke="{ink}" stroke-width="1.2"/>',
        "dots": '<circle cx="3" cy="3" r="1.2" fill="{ink}"/>',
        "hlines": '<path d="M0,3 h6" stroke="{ink}" stroke-width="1.4"/>',
        "vlines": '<path d="M3,0 v6" stroke="{ink}" stroke-width="1.4"/>',
        "cross": '<path d="M0,0 l6,6 M6,0 l-6,6" stroke="{ink}" stroke-width="1"/>',
    }
    parts = []
    for p, (fill, ink, texture) in PHASE_STYLE.items():
        parts.append(
            f'<pattern id="ph-{p.label}" width="6" height="6" patternUnits="userSpaceOnUse">'
            f'<rect width="6" height="6" fill="{fill}"/>{textures[texture].format(ink=ink)}'
            "</pattern>"
        )
    return (
        '<svg class="defs" width="0" height="0" aria-hidden="true" focusable="false"><defs>'
        + "".join(parts)
        + "</defs></svg>"
    )


def phase_legend() -> str:
    items = "".join(
        f'<li><svg width="14" height="14" aria-hidden="true"><rect width="14" height="14" '
        f'fill="url(#ph-{p.label})" class="swatch"/></svg>{PHASE_NAMES[p]}</li>'
        for p in Phase
    )
    return f'<ul class="legend" aria-label="phase legend">{items}</ul>'


# -- the body ---------------------------------------------------------------------------------
def _job_series(ranks: Sequence[RankView]) -> list[float]:
    """Step time of the job per step: the median over the ranks that reported that step."""
    by_step: dict[int, list[float]] = {}
    for r in ranks:
        for s in r.recent_steps:
            by_step.setdefault(s.step, []).append(s.step_s)
    return [statistics.median(by_step[k]) for k in sorted(by_step)]


def _rolling_cv(values: list[float], window: int) -> list[float]:
    out = []
    for i in range(window, len(values) + 1):
        chunk = values[i - window : i]
        mean = sum(chunk) / window
        out.append(statistics.pstdev(chunk) / mean if mean > 0 else 0.0)
    return out


def _victim_text(v: Victim, root: int) -> str:
    whom = (
        "the straggler"
        if v.waits_for == root
        else f"rank {v.waits_for}"
        if v.waits_for is not None
        else "a rank on another node"
    )
    return f"rank {v.rank} waits {v.wait_s * 1e3:.1f} ms per step in {v.group}, for {whom}"


def _banner(job: JobView, live: Sequence[RankView]) -> tuple[str, str]:
    """(html, one-line headline for screen readers)."""
    diag = job.diagnosis
    s = diag.straggler
    name = job.name
    if not live:
        text = f"No rank of job {name} has reported recently: the job may have stopped."
        return (
            f'<div class="banner banner-info"><span class="icon" aria-hidden="true">⏸</span><p>{_e(text)}</p></div>',
            text,
        )
    if s:
        cause = s.cause
        cause_html = (
            f'Cause: <strong class="cause">{_e(cause.replace("_", " "))}</strong> — {_e(s.cause_reason)}.'
            if cause != "unknown"
            else f"Cause: <strong>unknown</strong> — {_e(s.cause_reason)}."
        )
        mode = diag.modes.get("straggler")
        head = f"Straggler: rank {s.rank} of job {name}, cause {cause.replace('_', ' ')}"
        chain = "".join(f"<li>{_e(_victim_text(v, s.rank))}</li>" for v in diag.victims[:8])
        more = len(diag.victims) - 8
        chain += f"<li>… and {more} more ranks</li>" if more > 0 else ""
        waits = f'<p>Who waits for whom:</p><ul class="wait-chain">{chain}</ul>' if chain else ""
        return (
            '<div class="banner banner-bad" data-kind="straggler">'
            '<span class="icon" aria-hidden="true">⚠</span><div>'
            f'<p class="banner-title">STRAGGLER: rank {s.rank}</p>'
            f"<p>{_e(_capital(mode.reason if mode else ''))}. Every other rank waits for it, "
            f"directly or through a rank that does.</p><p>{cause_html}</p>{waits}</div></div>",
            head,
        )
    if diag.warming_up is not None:
        text = (
            f"Job {name}: {diag.warming_up.text}. No verdict until every rank has delivered a "
            "settled window of steps: its first step and those a checkpoint load or a "
            "recompilation fell in are left out."
        )
        return (
            '<div class="banner banner-info" data-kind="warming-up"><span class="icon" '
            f'aria-hidden="true">⏳</span><p>{_e(_capital(text))}</p></div>',
            text,
        )
    if diag.skew_s is None:
        text = "Collecting: the straggler check needs a few steps from at least two ranks."
        return (
            f'<div class="banner banner-info"><span class="icon" aria-hidden="true">ℹ</span><p>{_e(text)}</p></div>',
            text,
        )
    mode = diag.modes.get("straggler")
    reason = mode.reason if mode else ""
    flagged = [MODE_NAMES[m] for m, v in diag.modes.items() if v.verdict]
    if flagged:
        title = f"No straggler · detected: {', '.join(flagged)}"
        kind, icon = "banner-warn", "▲"
    else:
        title, kind, icon = "No straggler · no failure mode detected", "banner-ok", "✓"
    text = f"Job {name}: {title}. {_capital(reason)}."
    return (
        f'<div class="banner {kind}"><span class="icon" aria-hidden="true">{icon}</span>'
        f'<div><p class="banner-title">{_e(title)}</p><p>{_e(_capital(reason))}. See the failure '
        "modes below for the reasons.</p></div></div>",
        text,
    )


def _fmt_count(value: float) -> str:
    """1234.5 -> '1,234', 2.5e6 -> '2.5 M': rates of samples and tokens."""
    for scale, suffix in ((1e9, " G"), (1e6, " M")):
        if value >= scale:
            return f"{value / scale:.1f}{suffix}"
    return f"{value:,.0f}" if value >= 10 else f"{value:.2f}"


def _fmt_joules(value: float) -> str:
    for scale, unit in ((1e9, "GJ"), (1e6, "MJ"), (1e3, "kJ")):
        if value >= scale:
            return f"{value / scale:.2f} {unit}"
    return f"{value:.0f} J"


def _work_card(live: Sequence[RankView]) -> tuple[str, str, str, str]:
    """Samples and tokens per second of the ranks here: what the job gets done."""
    samples = [r.samples_per_s for r in live if r.samples_per_s is not None]
    tokens = [r.tokens_per_s for r in live if r.tokens_per_s is not None]
    if not samples and not tokens:
        return (
            "Work done",
            "—",
            "samples not known: the model's inputs do not say; set samples_per_step or call "
            "agent.count()",
            "",
        )
    value = f"{_fmt_count(sum(samples))} samples/s" if samples else "samples not known"
    counted = f"{_fmt_count(sum(tokens))} tokens/s" if tokens else "tokens not known"
    ranks = max(len(samples), len(tokens))
    note = f"{counted} · {ranks} rank{'s' if ranks != 1 else ''} here, last {STEP_WINDOW} steps"
    return "Work done", value, note, ""


def gpu_energy_line(ranks: Sequence[RankView]) -> tuple[str, bool]:
    """(what the ranks' GPUs used or why no GPU energy is known, whether it is known)."""
    gpus = [r.topology for r in ranks if r.topology is not None and has_gpu(r.topology)]
    known = [j for j in (topology_number(t.get(ENERGY_KEY)) for t in gpus) if j is not None]
    if known:
        n = len(known)
        return (
            f"GPU: {_fmt_joules(sum(known))} on {n} GPU{'s' if n != 1 else ''} since driver load",
            True,
        )
    if not gpus:
        return "GPU: no NVML (no rank here reports a GPU)", False
    if not any("nvml" in str(t.get("topology_source", "")) for t in gpus):
        return "GPU: no NVML (GPU facts from sysfs only)", False
    if not any(ENERGY_KEY in t for t in gpus):
        # agent/core.py leaves it out of the ring's header, where it would never change
        return "GPU: not sent (the shared-memory transport sends GPU state once)", False
    return "GPU: NVML has no energy counter on these GPUs", False


def cpu_energy_line(energy: CpuEnergy | None) -> tuple[str, bool]:
    """(what the host's CPU packages used or why that is not known, whether it is known)."""
    if energy is None:
        return "CPU: not read (no --powercap-root)", False
    if not energy.packages:
        return f"CPU: {energy.missing}", False
    n = len(energy.packages)
    total = sum(p.joules for p in energy.packages)
    return f"CPU: {_fmt_joules(total)} on {n} package{'s' if n != 1 else ''} since first read", True


def _energy_card(ranks: Sequence[RankView], cpu: CpuEnergy | None) -> tuple[str, str, str, str]:
    """Which energy is measured here and why the rest is not (per sample: in Prometheus)."""
    (gpu_text, gpu_known), (cpu_text, cpu_known) = gpu_energy_line(ranks), cpu_energy_line(cpu)
    sources = [name for name, known in (("GPU", gpu_known), ("CPU", cpu_known)) if known]
    value = " + ".join(sources) + " measured" if sources else "not measured"
    return "Energy", value, f"{gpu_text} · {cpu_text}", ""


def _cards(
    live: Sequence[RankView],
    diag: Diagnosis,
    cpu: CpuEnergy | None = None,
) -> str:
    series = _job_series(live)[-(TREND_STEPS + CV_WINDOW - 1) :]
    trend = series[-TREND_STEPS:]
    medians = [r.step_time_median_s for r in live if r.step_time_median_s]
    step = statistics.median(medians) if medians else None
    cvs = [r.step_time_cv for r in live if r.step_time_cv is not None]
    cv = statistics.median(cvs) if cvs else None
    rolling = _rolling_cv(series, CV_WINDOW)
    skew = diag.skew_s
    threshold = diag.skew_line_s
    cards = [
        (
            "Step time",
            fmt_s(step),
            f"median over ranks, last {STEP_WINDOW} steps",
            sparkline(trend, _series_label("Step time", trend, fmt_s), 300, 34, wide=True)
            if len(trend) > 1
            else "",
        ),
        (
            "Step-time CV",
            _fmt_num(cv),
            f"rolling {CV_WINDOW}-step CV below",
            sparkline(
                rolling,
                _series_label(f"{CV_WINDOW}-step CV", rolling, _fmt_num),
                300,
                34,
                wide=True,
            )
            if len(rolling) > 1
            else "",
        ),
        (
            "Arrival skew",
            fmt_s(skew),
            f"straggler threshold {fmt_s(threshold)}" if threshold else "latest minus earliest",
            "",
        ),
        (
            "Throughput",
            f"{1 / step:.1f} steps/s" if step else "—",
            f"{live[0].steps_total} steps so far (rank {live[0].rank})" if live else "",
            "",
        ),
        _work_card(live),
        _energy_card(live, cpu),
    ]
    return (
        '<div class="cards">'
        + "".join(
            f'<div class="card"><div class="card-label">{_e(label)}</div>'
            f'<div class="card-value">{_e(value)}</div><div class="card-note">{_e(note)}</div>{chart}</div>'
            for label, value, note, chart in cards
        )
        + "</div>"
    )


# The decision verdict's line, in words first: (tag class, tag text) per verdict and health.
VERDICT_TAGS = {
    ("coupling", "healthy"): ("tag-warn", "▲ coupling, not infrastructure"),
    ("coupling", "unknown"): ("tag-warn", "▲ coupling · hardware health not known"),
    ("infrastructure", "unhealthy"): ("tag-bad", "⚠ infrastructure"),
}


def _verdict_line(diag: Diagnosis) -> str:
    """The decision verdict: coupling or infrastructure, with its evidence, or none."""
    v = diag.verdict
    if v is None:
        text = (
            f"none yet: {diag.warming_up.text}"
            if diag.warming_up is not None
            else "none: the job loses no time to coupling or to its infrastructure"
            if diag.modes
            else "none yet: the diagnosis needs a few steps"
        )
        return f'<p class="job-verdict" data-verdict="none"><strong>Verdict:</strong> {text}.</p>'
    kind, tag = VERDICT_TAGS.get((v.verdict, v.hardware), ("tag", v.verdict))
    return (
        f'<p class="job-verdict" data-verdict="{_e(v.verdict)}" data-hardware="{_e(v.hardware)}">'
        f'<strong>Verdict:</strong> <span class="tag {kind}">{_e(tag)}</span> '
        f"{_e(_capital(v.reason))}.</p>"
    )


def _modes_table(diag: Diagnosis, line: float) -> str:
    rows = []
    for mode, title in MODE_NAMES.items():
        m = diag.modes.get(mode)
        if m is None:
            rows.append(
                f'<tr class="mode-na"><th scope="row">{title}</th><td><span class="verdict na">'
                f'— not assessed</span></td><td class="num">—</td><td>{_e(MODE_MISSING[mode])}</td></tr>'
            )
            continue
        verdict = (
            '<span class="verdict bad">▲ DETECTED</span>'
            if m.verdict
            else '<span class="verdict ok">✓ not detected</span>'
        )
        rows.append(
            f'<tr class="{"mode-bad" if m.verdict else "mode-ok"}"><th scope="row">{title}</th>'
            f'<td>{verdict}</td><td class="num">{score_meter(m.score, line)} {m.score:.2f}</td>'
            f"<td>{_e(m.reason)}</td></tr>"
        )
    return (
        f'<table class="modes"><caption>Failure modes (paper §3.3); a score of {line:.2f} or '
        'more is a detection</caption><thead><tr><th scope="col">Mode</th><th scope="col">Verdict'
        '</th><th scope="col" class="num">Score</th><th scope="col">Why</th></tr></thead><tbody>'
        + "".join(rows)
        + "</tbody></table>"
    )


def _pacing(p: PacingState | None) -> str:
    if p is None or not p.enabled:
        return '<span class="muted">off</span>'
    if p.active:
        return (
            f'<span class="tag tag-warn">ACTIVE</span> +{_e(fmt_s(p.current_delay_s))}/step'
            f'<div class="sub">engaged {p.engagements}×</div>'
        )
    return (
        f'<span class="tag">armed</span><div class="sub">threshold {_e(fmt_s(p.threshold_s))}'
        f", engaged {p.engagements}×</div>"
    )


def _ranks_table(job: JobView, now: float) -> str:
    named = job.diagnosis.straggler
    straggler = named.rank if named else None
    shown: Sequence[RankView] = job.ranks
    if len(shown) > MAX_RANK_ROWS:
        first = [r for r in shown if r.rank == straggler or r.stale][:MAX_RANK_ROWS]
        rest = [r for r in shown if r not in first][: MAX_RANK_ROWS - len(first)]
        shown = sorted(first + rest, key=lambda r: r.rank)
    rows = []
    for r in shown:
        is_straggler = r.rank == straggler
        status = []
        if named and is_straggler:
            status.append(
                '<span class="tag tag-bad">⚠ STRAGGLER</span>'
                f'<div class="sub">cause: {_e(named.cause.replace("_", " "))}</div>'
            )
        if r.stale:
            ago = now - r.last_report_unix_s
            status.append(
                f'<span class="tag tag-stale">⏸ stale</span><div class="sub">silent {ago:.0f} s</div>'
            )
        if not status:
            status.append('<span class="tag tag-ok">✓ ok</span>')
        if r.restarts:
            status.append(f'<div class="sub">restarted {int(r.restarts)}×</div>')
        if r.dropped_total:
            status.append(f'<div class="sub">{int(r.dropped_total)} records dropped</div>')
        steps = [s.step_s for s in r.recent_steps[-RANK_TREND_STEPS:]]
        trend = (
            sparkline(steps, _series_label(f"Rank {r.rank} step time", steps, fmt_s), 96, 22)
            if len(steps) > 1
            else '<span class="muted">—</span>'
        )
        lead = fmt_s(r.arrival_lead_s)
        if is_straggler:
            lead += ' <span class="sub-inline">(arrives last)</span>'
        classes = ["straggler"] if is_straggler else []
        if r.stale:
            classes.append("stale")
        rows.append(
            f'<tr class="{" ".join(classes)}"><th scope="row" class="num">{r.rank}</th>'
            f"<td>{''.join(status)}</td>"
            f'<td class="num">{r.steps_total}</td>'
            f'<td class="num">{fmt_s(r.step_time_median_s)}</td>'
            f"<td>{trend}</td>"
            f'<td class="num">{_fmt_num(r.step_time_cv)}</td>'
            f'<td class="phases">{phase_bar(r.phase_shares)}{_sampled(r.phase_every)}</td>'
            f'<td class="num">{lead}</td>'
            f'<td class="num">{fmt_s(r.wait_mean_s)}</td>'
            f"<td>{_pacing(r.pacing)}</td>"
            f'<td class="host">{_e(r.hostname)}<div class="sub">local {r.local_rank} · pid {r.pid}</div></td></tr>'
        )
    head = (
        "Rank",
        "Status",
        "Steps",
        "Step (median)",
        f"Step time, last {RANK_TREND_STEPS}",
        "CV",
        "Phases (share of step)",
        "Arrival lead",
        "Wait / step",
        "Pacing",
        "Host",
    )
    numeric = {"Rank", "Steps", "Step (median)", "CV", "Arrival lead", "Wait / step"}
    ths = "".join(
        f'<th scope="col"{" class=num" if h in numeric else ""}>{_e(h)}</th>' for h in head
    )
    hidden = len(job.ranks) - len(shown)
    more = (
        f'<p class="muted">{hidden} more ranks are not shown here; all are in '
        '<a href="v1/state">/v1/state</a>.</p>'
        if hidden
        else ""
    )
    scope = (
        "the job's, read back from Prometheus"
        if any(r.lead_scope == "job" for r in job.ranks)
        else "among this node's ranks"
    )
    return more + (
        '<div class="scroll"><table class="ranks"><caption>Ranks on this node. Arrival lead '
        f"({scope}): how early a rank reaches the gradient sync before the last peer (the "
        "straggler's is near 0); wait: its time blocked there per step.</caption>"
        f"<thead><tr>{ths}</tr></thead><tbody>{''.join(rows)}</tbody></table></div>"
    )


def _sampled(every: int) -> str:
    """A rank whose phases are sampled says so under its bar: most of its steps' phases are
    estimates, the timed steps' shares of their totals (agent/phases.py)."""
    if every <= 1:
        return ""
    return (
        f'<div class="sub" title="the other steps\' phases are estimates: the timed steps\' '
        f'shares of their totals">timed 1 step in {every}</div>'
    )


def _topology(ranks: Sequence[RankView]) -> str:
    hosts: dict[str, list[int]] = {}
    for r in ranks:
        hosts.setdefault(r.hostname or "unknown host", []).append(r.rank)
    world = max((r.world_size for r in ranks), default=0)
    lines = [
        f"<li><strong>{_e(h)}</strong>: ranks {_ranges(rs)}</li>" for h, rs in sorted(hosts.items())
    ]
    summary = (
        f"<p>{len(ranks)} of {world} ranks report to this exporter, on "
        f'{len(hosts)} host{"s" if len(hosts) != 1 else ""}.</p><ul class="hosts">{"".join(lines)}</ul>'
    )
    with_topo = [(r, r.topology) for r in ranks if has_gpu(r.topology)]
    if not with_topo:
        return (
            summary + '<p class="muted">No GPU topology reported: CPU ranks (gloo), or NVML '
            "unavailable on this node. Locality faults cannot be checked.</p>"
        )
    rows = []
    for r, t in with_topo:

        def val(key: str, topo: Mapping[str, Any] = t) -> str:
            v = topo.get(key)
            return "unknown" if v is None or v == "" else _e(str(v))

        fault = locality_fault(t)
        link = f"gen {val('pcie_link_generation')}/{val('pcie_link_max_generation')} · x{val('pcie_link_width')}/x{val('pcie_link_max_width')}"
        numa = f"GPU {val('gpu_numa_node')}"
        if t.get("process_numa_nodes") not in (None, ""):
            numa += f'<div class="sub">process {val("process_numa_nodes")}</div>'
        if not t.get("gpu_name") and t.get("name"):
            t = {**t, "gpu_name": t["name"]}
        if fault and "NUMA" in fault:
            numa += ' <span class="tag tag-bad">⚠ mismatch</span>'
        clock = t.get("sm_clock_hertz")
        reasons = throttle_reasons(t)
        clock_text = (
            f"{float(clock) / 1e6:.0f} MHz" if isinstance(clock, (int, float)) else "unknown"
        )
        if reasons:
            clock_text += f' <span class="tag tag-warn">⚠ {_e(", ".join(reasons))}</span>'
        if fault and fault.startswith("PCIe"):
            link += ' <span class="tag tag-bad">⚠ degraded</span>'
        rows.append(
            f'<tr><th scope="row" class="num">{r.rank}</th><td>{val("gpu_name", t)}'
            f'<div class="sub">{val("pci_bus_id")}</div></td>'
            f"<td>{link}</td>"
            f'<td>{numa}</td><td>{val("nic")}<div class="sub">{val("nic_distance")}</div></td>'
            f"<td>{clock_text}</td></tr>"
        )
    return (
        summary + '<div class="scroll"><table class="topo"><thead><tr><th scope="col">Rank</th>'
        '<th scope="col">GPU</th><th scope="col">PCIe link (now/max)</th><th scope="col">NUMA'
        '</th><th scope="col">Nearest NIC</th><th scope="col">SM clock</th></tr></thead><tbody>'
        + "".join(rows)
        + "</tbody></table></div>"
    )


GOODPUT_WORDS = {
    "startup": "startup",
    "checkpoint_save": "checkpoint saves",
    "checkpoint_load": "checkpoint loads",
    "lost_progress": "lost progress",
    "data_wait": "data wait",
    "sync_wait": "sync wait",
    "pacing": "pacing",
    "nothing_running": "nothing running",
}


def _goodput_line(job: JobView, world: int, now: float) -> str:
    """Goodput since the job's first process started, and where the rest went."""
    g = job.goodput
    if g is None:
        return '<p class="goodput muted"><strong>Goodput:</strong> not known yet.</p>'
    hours = max(0.0, now - g.started_unix_s) / 3600
    since = f"{hours:.1f} h" if hours >= 1 else f"{hours * 60:.0f} min"
    whose = f"all {g.ranks} ranks" if g.ranks >= world else f"the {g.ranks} ranks here only"
    shares = ", ".join(
        f"{GOODPUT_WORDS.get(c, c)} {v:.1%}"
        for c, v in sorted(g.badput.items(), key=lambda kv: -kv[1])
        if v >= 0.0005
    )
    return (
        f'<p class="goodput" data-goodput="{g.ratio:.4f}"><strong>Goodput:</strong> '
        f"{g.ratio:.1%} of the rank-time since the job started {since} ago ({_e(whose)}, "
        f"restarts included) · badput: {_e(shares) or 'none'}</p>"
    )


def _job_section(
    job: JobView, settings: Settings, now: float, cpu: CpuEnergy | None = None
) -> tuple[str, str]:
    ranks = job.ranks
    live = [r for r in ranks if not r.stale]
    banner, headline = _banner(job, live)
    world = max((r.world_size for r in ranks), default=0)
    ident = "job-" + "".join(ch if ch.isalnum() else "-" for ch in job.name)
    body = (
        f'<section class="job" aria-labelledby="{_e(ident)}">'
        f'<div class="job-head"><h2 id="{_e(ident)}">Job <code>{_e(job.name)}</code></h2>'
        f'<span class="muted">{len(live)} of {len(ranks)} ranks reporting · world size {world}'
        f" · {_scope(job, world - len(ranks), now)}</span></div>"
        f"{banner}{_no_model(live)}{_cards(live or ranks, job.diagnosis, cpu)}"
        f"{_goodput_line(job, world, now)}"
        '<div class="split"><div class="panel">'
        f"{_verdict_line(job.diagnosis)}"
        f"{_modes_table(job.diagnosis, settings.thresholds.verdict_score)}</div>"
        f'<div class="panel"><h3>Topology</h3>{_topology(ranks)}</div></div>'
        f'<div class="panel"><h3>Ranks</h3>{phase_legend()}{_ranks_table(job, now)}</div></section>'
    )
    return body, headline


# Steps after which a rank with no forward or backward time is taken to have no model.
NO_MODEL_AFTER_STEPS = 10


def _no_model(live: Sequence[RankView]) -> str:
    """A notice naming the ranks that time no forward and no backward after their first
    steps: their agent found no model (the runner attached to the optimizer only, or attach()
    got none), so the phases and a straggler's cause are not known for them."""
    fwd, bwd = Phase.FORWARD, Phase.BACKWARD
    blind = [
        r.rank
        for r in live
        if r.steps_total > NO_MODEL_AFTER_STEPS
        and r.phase_seconds_total[fwd] <= 0
        and r.phase_seconds_total[bwd] <= 0
    ]
    if not blind:
        return ""
    text = (
        f"{rank_list(blind)}: no forward or backward timed. The agent found no model (attached "
        "to the optimizer only), so phases and a straggler's cause are not known there; pass "
        "the model to attach() (docs/attach.md)."
    )
    return (
        '<div class="banner banner-info" data-kind="no-model">'
        f'<span class="icon" aria-hidden="true">ℹ</span><p>{_e(text)}</p></div>'
    )


def _scope(job: JobView, elsewhere: int, now: float) -> str:
    """Whose view the figures are: the job's (Prometheus read back) or this node's."""
    if job.job_wide is not None:
        return f"job-wide view from Prometheus, read {max(0.0, now - job.job_wide.read_unix_s):.0f} s ago"
    if elsewhere > 0:
        return (
            f"node-local view: {elsewhere} ranks of this job report elsewhere (no --prometheus-url)"
        )
    return "the whole job reports here"


def render_status(view: StoreView, settings: Settings) -> str:
    """The page body (what the script swaps in every refresh)."""
    now = view.now_unix_s
    stamp = time.strftime("%H:%M:%S UTC", time.gmtime(now))
    jobs = view.jobs
    meta = (
        f'<p class="updated">Updated {stamp} · {view.ingested_records} records '
        f"ingested since the exporter started"
    )
    rejected = sum(view.rejected.values())
    if rejected:
        meta += f" · {rejected} refused at ingest"
    meta += "</p>"
    if not jobs:
        headline = "No ranks have reported yet."
        return (
            f'<div data-headline="{_e(headline)}">{meta}<section class="empty">'
            '<div class="banner banner-info"><span class="icon" aria-hidden="true">ℹ</span>'
            '<div><p class="banner-title">No ranks have reported yet</p><p>The exporter is '
            "running and waiting for agents. This page updates by itself when the first report "
            "arrives.</p></div></div><h2>Attach a training job</h2><p>In each rank, with the "
            "exporter's address in <code>SYNCSCOPE_EXPORTER</code>:</p><pre><code>"
            "from syncscope.agent import attach\n"
            "agent = attach(model=ddp_model, optimizer=optimizer)</code></pre>"
            "<p>or, without editing the script: <code>torchrun … -m syncscope.integrations.run "
            "train.py …</code></p></section></div>"
        )
    sections, headlines = [], []
    for name in sorted(jobs):
        try:
            section, headline = _job_section(jobs[name], settings, now, view.cpu_energy)
        except Exception as exc:  # noqa: BLE001 - one odd job must not blank the whole page
            headline = f"Job {name} could not be shown."
            section = (
                f'<section class="job"><h2>Job <code>{_e(name)}</code></h2><div class="banner '
                f'banner-info"><p>{_e(headline)} ({_e(type(exc).__name__)}); its data is in '
                '<a href="v1/state?recent=300">/v1/state</a>.</p></div></section>'
            )
        sections.append(section)
        headlines.append(headline)
    return f'<div data-headline="{_e(" ".join(headlines))}">{meta}{"".join(sections)}</div>'


def render_page(view: StoreView, settings: Settings) -> str:
    """The whole document: header, links, pattern definitions and the first body."""
    v = _e(__version__)
    return (
        '<!doctype html><html lang="en"><head><meta charset="utf-8">'
        '<meta name="viewport" content="width=device-width, initial-scale=1">'
        '<title>syncscope — status</title><link rel="icon" href="data:,">'
        f'<link rel="stylesheet" href="ui/page.css?v={v}">'
        f'<script src="ui/page.js?v={v}" defer></script>'
        '<noscript><meta http-equiv="refresh" content="5"></noscript></head><body>'
        f"{pattern_defs()}"
        '<header class="top"><div class="brand"><span class="logo" aria-hidden="true">◎</span>'
        f'<span class="name">syncscope</span> <span class="muted">exporter {v}</span></div>'
        '<nav aria-label="data"><a href="metrics">Prometheus metrics <code>/metrics</code></a>'
        '<a href="v1/state?recent=300">JSON state <code>/v1/state</code></a>'
        '<a href="docs">API <code>/docs</code></a></nav>'
        '<div class="controls"><button id="pause" type="button" aria-pressed="false">'
        "Pause updates</button></div></header>"
        '<p id="conn" class="conn" role="status" hidden></p>'
        '<p id="announce" class="sr-only" aria-live="polite"></p>'
        f'<main id="status" data-refresh-ms="{REFRESH_MS}">{render_status(view, settings)}</main>'
        '<footer class="foot">Diagnosis rules: <code>docs/diagnosis.md</code> · the page refreshes '
        "every 2 s (every 5 s without JavaScript) · times are medians of the last "
        f"{STEP_WINDOW} steps unless stated</footer></body></html>"
    )


def _static(name: str) -> bytes:
    return resources.files("syncscope.exporter").joinpath("static", name).read_bytes()


def install_page(app: FastAPI, store: Store, settings: Settings) -> None:
    """Register the page's routes on the app: `/`, its body at `/ui/status`, and its assets."""
    assets = {name: _static(name) for name in STATIC}

    @app.get("/", include_in_schema=False)
    def page() -> HTMLResponse:
        return HTMLResponse(render_page(snapshot(store), settings), headers=HEADERS)

    @app.get("/ui/status", include_in_schema=False)
    def status_body() -> HTMLResponse:
        return HTMLResponse(render_status(snapshot(store), settings), headers=HEADERS)

    @app.get("/ui/{name}", include_in_schema=False)
    def asset(name: str) -> Response:
        if name not in assets:
            return Response("not found", status_code=404, media_type="text/plain")
        return Response(
            assets[name],
            media_type=STATIC[name],
            headers={"Cache-Control": "max-age=300", "X-Content-Type-Options": "nosniff"},
        )
