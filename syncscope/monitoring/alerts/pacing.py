"""Alerts of this area (promtool tests: deploy/prometheus/tests/pacing.test.yml)."""

from __future__ import annotations

from typing import Any

from syncscope.monitoring.alerts.base import AlertInput
from syncscope.recorded import PACING_ACTIVE


def pacing_engaged_long_text(alert: AlertInput) -> dict[str, Any]:
    entry = alert.entry
    return {
        "expr": f"{PACING_ACTIVE} > 0",
        "summary": f"Pacing has been engaged in job {{{{ $labels.job }}}} for {entry.for_}.",
        "description": (
            "The pacing controller has delayed ranks of job {{ $labels.job }} without a "
            f"break for {entry.for_} ({{{{ $value }}}} rank(s) paced now). Pacing absorbs "
            "transient imbalance; a persistent one has a structural cause (a straggler, a "
            "locality fault, contention) that pacing only hides."
        ),
    }
