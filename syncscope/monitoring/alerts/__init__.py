"""Each alert's expression and annotations, one function per alert, in a module per area that
mirrors the promtool test files (deploy/prometheus/tests/<area>.test.yml). The thresholds file
gives each alert's for:, levels and thresholds; rules.alerting_rules puts them together."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from syncscope.monitoring.alerts import fabric, health, locality, pacing, step, sync
from syncscope.monitoring.alerts.base import AlertInput

__all__ = ["ALERT_TEXTS", "AlertInput"]

ALERT_TEXTS: dict[str, Callable[[AlertInput], dict[str, Any]]] = {
    "SyncscopeStepTimeCVHigh": step.step_time_cv_high_text,
    "SyncscopeStraggler": sync.straggler_text,
    "SyncscopeSyncAmplification": sync.sync_amplification_text,
    "SyncscopeStructuralCoupling": sync.structural_coupling_text,
    "SyncscopeFabricContention": fabric.fabric_contention_text,
    "SyncscopeSlowLink": fabric.slow_link_text,
    "SyncscopeLocalityFault": locality.locality_fault_text,
    "SyncscopePacingEngagedLong": pacing.pacing_engaged_long_text,
    "SyncscopeAgentDroppingRecords": health.agent_dropping_records_text,
    "SyncscopeExporterDown": health.exporter_down_text,
    "SyncscopeRankSilent": health.rank_silent_text,
}
