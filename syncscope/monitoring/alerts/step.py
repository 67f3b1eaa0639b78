"""Alerts of this area (promtool tests: deploy/prometheus/tests/step.test.yml)."""

from __future__ import annotations

from typing import Any

from syncscope.catalog import STEP_WINDOW
from syncscope.monitoring.alerts.base import AlertInput
from syncscope.monitoring.promql import pct
from syncscope.recorded import STEP_CV, STEP_OUTLIER_QUANTILE, WINDOW_FULL
from syncscope.thresholds import required


def step_time_cv_high_text(alert: AlertInput) -> dict[str, Any]:
    entry, threshold = alert.entry, alert.threshold
    # The exporter's CV covers its last STEP_WINDOW steps, so one checkpoint (a single
    # step many times the others) lifts it for as many steps, which at multi-second steps
    # outlasts any for:. The step-duration histogram over a window of time says whether
    # the variation is frequent: enough steps far (factor ×) above or below the median.
    o = required(entry.outliers, "outliers")
    lo, mid, hi = o.quantiles
    factor = o.factor

    def q(p: float) -> str:
        return f'{STEP_OUTLIER_QUANTILE}{{quantile="{p}"}}'

    return {
        "expr": f"""
  {STEP_CV} > {threshold}
and on (job)
  (
        {q(hi)}
      > ignoring (quantile)
        {factor} * {q(mid)}
    or
        {q(lo)} * {factor}
      < ignoring (quantile)
        {q(mid)}
  )
and on (job)
  {WINDOW_FULL}
""",
        "summary": "Step time is unstable in job {{ $labels.job }}.",
        "description": (
            f"The coefficient of variation of step time over the last {STEP_WINDOW} steps is "
            '{{ printf "%.2f" $value }} in job {{ $labels.job }} (threshold '
            f"{threshold}), and over the last {o.window} more than {pct(1 - hi)} of the steps "
            f"took over {factor} times the median step or more than {pct(lo)} under 1/"
            f"{factor} of it: frequent jitter, not a rare long step such as a checkpoint. "
            "Synchronous training turns this jitter into idle time on every rank."
        ),
    }
