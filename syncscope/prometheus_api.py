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
    # Parameters longer than this go in a POST's body (both engines take /api/v1/query's form
    # either way), not the URL: servers and proxies cap a request line at 8-16 KB.
    MAX_URL_PARAMS = 4096

    def __init__(self, url: str, timeout: float = 30.0) -> None:
        self.url = url.rstrip("/")
        self.timeout = timeout
        self.received_bytes = 0  # reply bodies read, in all

    def get(self, path: str, params: dict[str, Any] | None = None) -> Any:
        """`data` of the reply to `path` (e.g. /api/v1/rules) with `params`: a GET, or a POST
        where they are too long for a URL."""
        form = urllib.parse.urlencode(params) if params else ""
        if len(form) > self.MAX_URL_PARAMS:
            request = urllib.request.Request(self.url + path, data=form.encode(), method="POST")
        else:
            request = urllib.request.Request(self.url + path + ("?" + form if form else ""))
        with urllib.request.urlopen(request, timeout=self.timeout) as reply:  # noqa: S310 - the operator's or our own URL
            raw = reply.read()
        self.received_bytes += len(raw)
        body = json.loads(raw)
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
