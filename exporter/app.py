"""The exporter's FastAPI application: ingest, /metrics, /healthz, /v1/state."""

from __future__ import annotations

import hmac
import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.process_collector import ProcessCollector
from pydantic import TypeAdapter, ValidationError
from syncscope.exporter.collectors import StoreCollector
from syncscope.exporter.page import install_page
from syncscope.exporter.settings import Settings
from syncscope.exporter.store import Store

from syncscope import __version__
from syncscope.wire import INGEST_PATH, Batch

_batch_adapter = TypeAdapter(Batch)
_batch_schema = _batch_adapter.json_schema(ref_template="#/components/schemas/{model}")
_batch_defs = _batch_schema.pop("$defs", {})


class BadRequest(Exception):
    def __init__(self, status: int, reason: str, detail: Any) -> None:
        self.status, self.reason, self.detail = status, reason, detail


def _no_constants(name: str) -> Any:
    raise ValueError(f"{name} is not a number JSON allows")


def parse_batch(body: bytes) -> Batch:
    """Strict JSON (no NaN/Infinity) then schema validation; errors never echo the input."""
    try:
        raw = json.loads(body, parse_constant=_no_constants)
    except (ValueError, UnicodeDecodeError) as exc:
        raise BadRequest(400, "malformed_json", f"body is not valid JSON: {exc}") from None
    try:
        return _batch_adapter.validate_python(raw)
    except ValidationError as exc:
        errors = [
            {"loc": [str(p) for p in e["loc"]][:8], "msg": e["msg"][:200], "type": e["type"]}
            for e in exc.errors(include_url=False, include_input=False)[:20]
        ]
        raise BadRequest(422, "invalid_schema", errors) from None


async def _read_limited(request: Request, limit: int) -> bytes:
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise BadRequest(413, "too_large", f"body over {limit} bytes")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise BadRequest(413, "too_large", f"body over {limit} bytes")
        chunks.append(chunk)
    return b"".join(chunks)


def _authorised(request: Request, token: str | None) -> bool:
    if not token:
        return True
    client = request.scope.get("client")
    if not client or not client[0]:  # unix socket: file permissions are the access control
        return True
    header = request.headers.get("authorization", "")
    expected = ("Bearer " + token).encode()
    return hmac.compare_digest(header.encode(), expected)


def create_app(settings: Settings | None = None, store: Store | None = None) -> FastAPI:
    settings = settings or Settings()
    store = store or Store(settings)
    registry = CollectorRegistry(auto_describe=False)
    registry.register(StoreCollector(store))
    registry.register(ProcessCollector(registry=None))

    @asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        yield

    app = FastAPI(title="syncscope exporter", version=__version__, lifespan=lifespan)
    app.state.store = store
    app.state.settings = settings

    @app.exception_handler(BadRequest)
    async def _bad_request(_request: Request, exc: BadRequest) -> JSONResponse:
        store.reject(exc.reason)
        return JSONResponse({"error": exc.reason, "detail": exc.detail}, status_code=exc.status)

    @app.post(
        INGEST_PATH,
        summary="Accept one batch of step and collective records from an agent",
        openapi_extra={
            "requestBody": {
                "required": True,
                "content": {"application/json": {"schema": _batch_schema}},
            }
        },
        responses={
            400: {"description": "malformed JSON"},
            401: {"description": "missing or wrong token"},
            413: {"description": "body too large"},
            422: {"description": "schema violation"},
        },
    )
    async def ingest(request: Request) -> JSONResponse:
        if not _authorised(request, settings.token):
            raise BadRequest(401, "unauthorised", "a valid bearer token is required for TCP ingest")
        batch = parse_batch(await _read_limited(request, settings.max_body_bytes))
        reply = store.ingest(batch)
        if not reply.get("accepted"):
            raise BadRequest(429, "capacity", reply.get("reason", "refused"))
        return JSONResponse(reply)

    @app.get("/metrics", summary="Prometheus metrics")
    def metrics() -> Response:
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/healthz", summary="Liveness")
    def healthz() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/v1/state", summary="Everything the exporter knows, as JSON")
    def state(recent: int = 0) -> JSONResponse:
        view = store.view()
        keep = max(0, min(recent, settings.recent_steps))
        for job in view["jobs"].values():
            for r in job["ranks"]:
                r["recent_steps"] = r["recent_steps"][-keep:] if keep else []
        view["version"] = __version__
        return JSONResponse(view)

    install_page(app, store, settings)
    plain_openapi = app.openapi

    def openapi() -> dict[str, Any]:
        # The ingest body is declared by hand (we parse it ourselves, strictly); its $defs go
        # where its $refs point, so the published spec is complete for clients and fuzzers.
        schema = plain_openapi()
        schema.setdefault("components", {}).setdefault("schemas", {}).update(_batch_defs)
        return schema

    app.openapi = openapi  # type: ignore[method-assign]
    return app
