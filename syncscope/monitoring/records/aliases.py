"""The deprecated aliases (promtool tests: deploy/prometheus/tests/aliases.test.yml): every old
name of a renamed series (syncscope.recorded.DEPRECATED_ALIASES) recorded as a copy of the new
one, for one release, in a rule group of their own that a deployment can drop."""

from __future__ import annotations

from typing import Any

from syncscope.monitoring.records.base import record
from syncscope.recorded import DEPRECATED_ALIASES


def records() -> list[dict[str, Any]]:
    return [record(old, new) for old, new in DEPRECATED_ALIASES.items()]
