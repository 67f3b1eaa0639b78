"""Prometheus's HTTP API (`/api/v1/...`): the one client every part of syncscope reads it with.

The exporter reads the job-wide rules back through it; the lab's servers, renderer and the
scale bench query it. JSON over HTTP with a timeout, nothing else: a reply whose status is not
"success" raises PrometheusError with Prometheus's own error text.
"""

from __future__ import annotations

import json
import urllib.parse
import urllib.request
from typing import Any


class PrometheusError(RuntimeError):
    """Prometheus answered, but not with success (a bad query, an overloaded server)."""


class PrometheusAPI:
    def __init__(self, url: str, timeout: float = 30.0) -> None:
        self.url = url.rstrip("/")
        self.timeout = timeout

    def get(self, path: str, params: dict[str, Any] | None = None) -> Any:
        """`data` of the reply to GET `path` (e.g. /api/v1/rules) with `params`."""
        url = self.url + path + ("?" + urllib.parse.urlencode(params) if params else "")
        with urllib.request.urlopen(url, timeout=self.timeout) as reply:  # noqa: S310 - the operator's or our own URL
            body = json.loads(reply.read())
        if not isinstance(body, dict) or body.get("status") != "success":
            error = body.get("error", body.get("status")) if isinstance(body, dict) else body
            raise PrometheusError(f"GET {path} {params or ''}: {error}")
        return body["data"]

    def instant(self, promql: str, at: float | None = None) -> list[dict[str, Any]]:
        """An instant query, now or at unix time `at`; a scalar comes back as one sample."""
        params: dict[str, Any] = {"query": promql}
        if at is not None:
            params["time"] = f"{at:.3f}"
        data = self.get("/api/v1/query", params)
        if data["resultType"] == "scalar":
            return [{"metric": {}, "value": data["result"]}]
        return list(data["result"])

    def range(self, promql: str, start: float, end: float, step: float) -> list[dict[str, Any]]:
        params = {"query": promql, "start": f"{start:.3f}", "end": f"{end:.3f}", "step": step}
        return list(self.get("/api/v1/query_range", params)["result"])
