"""Every PromQL expression the syncscope dashboards run, with Grafana's variables filled in.

The list itself is ``dashboards/queries.json`` (written by dashboards/generate.py); this
module only reads it, so it needs nothing beyond the standard library. The end-to-end test
evaluates each query against a real Prometheus:

    spec = importlib.util.spec_from_file_location("syncscope_queries", ".../dashboards/queries.py")
    queries = importlib.util.module_from_spec(spec); spec.loader.exec_module(queries)
    for q in queries.evaluable_queries(rate_interval="1m", have={"pacing"}):
        ...  # q["promql"] must return data; q["needs"] says why it may legitimately be empty

``needs`` flags: gpu, pacing, straggler, rejections (series that exist only with a GPU, the
pacing controller, a diagnosed straggler, or after a rejected record), alerts (ALERTS: only while an alert is pending or
firing), collectives (collectives other than DDP's gradient sync), low_skew (the contention
index exists only while arrival skew is below its gate).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any

QUERIES_PATH = Path(__file__).resolve().with_name("queries.json")
_VARIABLE = re.compile(r"\$\{(\w+)\}|\$(\w+)")


def load_queries(path: Path = QUERIES_PATH) -> list[dict[str, Any]]:
    """dashboard uid, panel_id, panel title, ref_id, raw expr, instant, needs."""
    return json.loads(Path(path).read_text())


def substitute(expr: str, values: dict[str, str]) -> str:
    """Replace ``$name`` / ``${name}``; an unknown variable is an error, not a silent no-op."""

    def one(match: re.Match[str]) -> str:
        name = match.group(1) or match.group(2)
        if name not in values:
            raise KeyError(f"no value for ${name} in {expr!r}")
        return values[name]

    return _VARIABLE.sub(one, expr)


def evaluable_queries(
    *,
    job: str = ".+",
    rank: str = ".+",
    rate_interval: str = "1m",
    have: Iterable[str] = (),
    path: Path = QUERIES_PATH,
) -> list[dict[str, Any]]:
    """Queries with variables filled in as ``promql``, each also with ``expected_data``.

    ``job`` and ``rank`` are regular expressions (the variables are used with ``=~``);
    ``rate_interval`` stands in for ``$__rate_interval`` (at least 4 scrape intervals, as in
    Grafana). ``expected_data`` is true when every flag in ``needs`` is in ``have``.
    """
    values = {"job": job, "rank": rank, "__rate_interval": rate_interval}
    have = set(have)
    out = []
    for query in load_queries(path):
        item = dict(query)
        item["promql"] = substitute(query["expr"], values)
        item["expected_data"] = set(query["needs"]) <= have
        out.append(item)
    return out
