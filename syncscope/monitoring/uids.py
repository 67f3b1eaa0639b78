"""The dashboards' UIDs: the dashboards are built under them and the alerts link to them."""

from __future__ import annotations

OVERVIEW_UID = "syncscope-job-overview"
FABRIC_UID = "syncscope-fabric-locality"
