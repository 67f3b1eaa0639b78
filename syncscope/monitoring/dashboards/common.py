"""Constants the dashboards share: UIDs, the template variables' selectors, limits."""

from __future__ import annotations

import re

from grafana_foundation_sdk.models import dashboard as dm

from syncscope.monitoring.uids import FABRIC_UID, OVERVIEW_UID  # noqa: F401 - declared there
from syncscope.wire import Phase

QUERIES_FILE = "queries.json"
TAGS = ["syncscope"]
GRID_WIDTH = 24


DS = dm.DataSourceRef(type_val="prometheus", uid="${datasource}")

# Panel selectors: Grafana variables plus the deployment's own rank selector from the config.
# `job` is single-valued (one training job at a time: the same rank of two jobs is two ranks);
# `node` and `rank` are multi-valued with All. All for `node` is ".*" so that a series without
# the label still matches.
JOB = 'job=~"$job"'
NODE = 'node=~"$node"'
RANK = 'rank=~"$rank"'
RATE = "$__rate_interval"
RANGE = "$__range"
INTERVAL = "$__interval"  # the step between a panel's points: days-long panels average over it
NODE_ALL = ".*"
RANK_ALL = ".+"
BY_RANK = "job, node, rank"
# What a per-rank panel draws: the TOP ranks that stand out, and the job's spread.
TOP = 5
TRIAGE_ROWS = 5
BAND = ((0.1, "p10"), (0.5, "median"), (0.9, "p90"))
# The most series any panel query may return while no rank is selected (scale bench, tests).
MAX_SERIES = 30
ALERT_PREFIX = "Syncscope"
ANNOTATION_STEP = "15s"  # the shipped scrape interval
# Phases whose per-rank difference from the job's median says why a rank is late.
TRIAGE_PHASES = (Phase.DATA, Phase.FORWARD, Phase.BACKWARD, Phase.OPTIMIZER, Phase.COMM_EXPOSED)
PHASE_COLUMNS = {
    Phase.DATA: "Δ data",
    Phase.FORWARD: "Δ forward",
    Phase.BACKWARD: "Δ backward",
    Phase.OPTIMIZER: "Δ optimizer",
    Phase.COMM_EXPOSED: "Δ exposed comm",
}
# A dashboard link keeps the time range and the data source.
KEEP = "${__url_time_range}&${datasource:queryparam}"


_ALERT_SERIES = re.compile(r"\bALERTS(_FOR_STATE)?\b")


_VARIABLE = re.compile(r"\$\{(\w+)(?::\w+)?\}|\$(\w+)")


# What Grafana's Prometheus data source escapes in a single value interpolated into a
# regular-expression matcher (prometheusSpecialRegexEscape).
_REGEX_SPECIAL = re.compile(r"[$^*{}\[\]'+?.()|]")
