"""The exporter's FastAPI application: ingest, /metrics, /healthz, /v1/state."""

from __future__ import annotations

import asyncio
import gc
import hashlib
import hmac
import json
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from typing import Annotated, Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.process_collector import ProcessCollector
from pydantic import Field, TypeAdapter, ValidationError
from starlette.concurrency import run_in_threadpool
from syncscope.exporter.collectors import StoreCollector
from syncscope.exporter.diagnosis import snapshot
from syncscope.exporter.energy import PowercapReader
from syncscope.exporter.jobwide import PrometheusReader
from syncscope.exporter.page import install_page
from syncscope.exporter.settings import Settings
from syncscope.exporter.store import Ingest, Store, as_json

from syncscope import __version__
from syncscope.wire import INGEST_PATH, BadRows, BatchV1, BatchV2

# Tagged by schema_version: a batch is checked against its own version only, so the errors
# name that version's fields instead of listing both versions' mismatches.
_batch_adapter: TypeAdapter[BatchV1 | BatchV2] = TypeAdapter(
    Annotated[BatchV1 | BatchV2, Field(discriminator="schema_version")]
)
_batch_schema = _batch_adapter.json_schema(ref_template="#/components/schemas/{model}")
_batch_defs = _batch_schema.pop("$defs", {})
# OpenAPI discriminators map *string* values; schema_version is an integer, and each branch
# already pins it (const 1 / const 2), so oneOf alone is exact. Published without the mapping,
# which clients and fuzzers would otherwise read as schema_version == "1".
_batch_schema.pop("discriminator", None)
# A client that cannot deliver its body within this long is holding a connection, not sending.
BODY_READ_TIMEOUT_S = 10.0
METRICS_PATH = "/metrics"


class BadRequest(Exception):
    """A refused request. `counted` is False when the store has already counted the refusal."""

    def __init__(self, status: int, reason: str, detail: Any, counted: bool = False) -> None:
        self.status, self.reason, self.detail = status, reason, detail
        self.counted = counted


def _no_constants(name: str) -> Any:
    raise ValueError(f"{name} is not a number JSON allows")


def parse_batch(body: bytes) -> Ingest:
    """Strict JSON (no NaN/Infinity) then schema validation; errors never echo the input."""
    try:
        raw = json.loads(body, parse_constant=_no_constants)
    except (ValueError, UnicodeDecodeError) as exc:
        raise BadRequest(400, "malformed_json", f"body is not valid JSON: {exc}") from None
    except RecursionError:  # '[[[[...' a few thousand deep: refuse, never crash
        raise BadRequest(400, "malformed_json", "body nests too deeply") from None
    try:
        return Ingest.of(_batch_adapter.validate_python(raw))
    except ValidationError as exc:
        errors = [
            {"loc": [str(p) for p in e["loc"]][:8], "msg": e["msg"][:200], "type": e["type"]}
            for e in exc.errors(include_url=False, include_input=False)[:20]
        ]
        raise BadRequest(422, "invalid_schema", errors) from None
    except BadRows as exc:
        raise BadRequest(422, "invalid_schema", [{"msg": str(exc)[:200]}]) from None


async def _read_limited(request: Request, limit: int) -> bytes:
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise BadRequest(413, "too_large", f"body over {limit} bytes")
    chunks, size = [], 0

    async def read() -> None:
        nonlocal size
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise BadRequest(413, "too_large", f"body over {limit} bytes")
            chunks.append(chunk)

    try:
        await asyncio.wait_for(read(), BODY_READ_TIMEOUT_S)
    except asyncio.TimeoutError:
        raise BadRequest(
            408, "slow_body", f"body not received within {BODY_READ_TIMEOUT_S:g} s"
        ) from None
    return b"".join(chunks)


def _on_unix_socket(scope: Mapping[str, Any]) -> bool:
    # uvicorn reports a unix listener as (path, None); a TCP one as (address, port).
    server = scope.get("server")
    return server is not None and len(server) == 2 and server[1] is None


def _digest(text: str) -> bytes:
    return hashlib.sha256(text.encode("utf-8", "surrogateescape")).digest()


def _authorised(request: Request, token: str | None) -> bool:
    if not token:
        return True
    if _on_unix_socket(request.scope):  # file permissions (0660) are the access control there
        return True
    # Fixed-length digests compared in constant time: neither content nor length leaks.
    header = request.headers.get("authorization", "")
    return hmac.compare_digest(_digest(header), _digest("Bearer " + token))


class MetricsOnlyListener:
    """ASGI guard for the optional wide listener: there, GET /metrics and nothing else.

    Prometheus may need the exporter on a routable address; ingest, state, the status page and
    the API docs stay on the loopback (or unix) listener. Requests are told apart by the port
    they arrived on, so the metrics port must differ from the main one.
    """

    def __init__(self, app: Any, metrics_port: int) -> None:
        self.app = app
        self.metrics_port = metrics_port

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] in ("http", "websocket"):
            server = scope.get("server")
            if (
                server
                and server[1] == self.metrics_port
                and not (
                    scope["type"] == "http"
                    and scope.get("path") == METRICS_PATH
                    and scope.get("method") in ("GET", "HEAD")
                )
            ):
                if scope["type"] == "websocket":
                    await send({"type": "websocket.close", "code": 1008})
                    return
                response = JSONResponse({"error": "not_found"}, status_code=404)
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


def create_app(
    settings: Settings | None = None, store: Store | None = None, shm_dir: str | None = None
) -> FastAPI:
    settings = settings or Settings()
    store = store or Store(settings)
    rings = None
    if shm_dir:  # agents on this node that write shared-memory rings (exporter/shm_reader.py)
        from syncscope.exporter.shm_reader import ShmPoller

        rings = ShmPoller(
            shm_dir, store.ingest, store.reject, expire_after_s=settings.expire_after_s
        )
    reader = None
    if settings.prometheus_url and store.job_wide is None:
        reader = PrometheusReader(
            settings.prometheus_url,
            settings.prometheus_interval_s,
            # the readings that tell how long a straggler has held (diagnosis.Thresholds)
            history_s=settings.thresholds.straggler_hold_s + settings.prometheus_interval_s,
            wanted=store.interest,
        )
        store.job_wide = reader.get
    if settings.powercap_root and store.cpu_energy is None:
        store.cpu_energy = PowercapReader(settings.powercap_root)
    state_file = None
    if settings.state_file:  # the counters of the exporter's last run (exporter/state_file.py)
        from syncscope.exporter.state_file import StateFile

        state_file = StateFile(settings.state_file, store, settings.state_interval_s)
        state_file.load()
    registry = CollectorRegistry(auto_describe=False)
    collector = StoreCollector(store)
    registry.register(collector)
    registry.register(ProcessCollector(registry=None))

    @asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        # Everything built so far (FastAPI, pydantic, prometheus_client, the app) lives as
        # long as the process: out of the collector's sight, a full collection walks only what
        # ingest and scrapes create, not ~100k startup objects (scrape p99, bench_exporter.py).
        gc.collect()
        gc.freeze()
        if reader is not None:
            reader.start()
        if rings is not None:
            rings.start()
        if state_file is not None:
            state_file.start()
        try:
            yield
        finally:
            if reader is not None:
                reader.stop()
            if rings is not None:
                rings.stop()
            if state_file is not None:
                state_file.stop()  # after the rings' last records: saves once more

    app = FastAPI(title="syncscope exporter", version=__version__, lifespan=lifespan)
    app.state.store = store
    app.state.settings = settings
    app.state.rings = rings
    app.state.state_file = state_file

    @app.exception_handler(BadRequest)
    async def _bad_request(_request: Request, exc: BadRequest) -> JSONResponse:
        if not exc.counted:
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
            408: {"description": "body not received in time"},
            413: {"description": "body too large"},
            422: {"description": "schema violation"},
            429: {"description": "rank, job or series limits reached (counted by reason)"},
        },
    )
    async def ingest(request: Request) -> JSONResponse:
        if not _authorised(request, settings.token):
            raise BadRequest(401, "unauthorised", "a valid bearer token is required for TCP ingest")
        body = await _read_limited(request, settings.max_body_bytes)
        # Parsing a large body takes milliseconds: do it off the event loop so that scrapes
        # and other agents' requests are not queued behind it.
        batch = await run_in_threadpool(parse_batch, body)
        if await request.is_disconnected():
            # The agent gave up waiting (send timeout) and counted these records as dropped;
            # storing them now would count them twice.
            raise BadRequest(499, "client_gone", "client disconnected before ingest")
        reply = await run_in_threadpool(store.ingest, batch)
        if not reply.get("accepted"):
            # The store has counted this under its own reason (too_many_ranks, too_many_jobs).
            raise BadRequest(429, "capacity", reply.get("reason", "refused"), counted=True)
        return JSONResponse(reply)

    @app.get("/metrics", summary="Prometheus metrics")
    def metrics() -> Response:
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/healthz", summary="Liveness")
    def healthz() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/v1/state", summary="Everything the exporter knows, as JSON")
    def state(recent: int = 0) -> JSONResponse:
        view = snapshot(store, recent=max(0, min(recent, settings.recent_steps)))
        extra = {"state_file": state_file.status()} if state_file is not None else {}
        # Each collector's time and success at the last scrape (none before the first).
        extra["collectors"] = collector.last
        return JSONResponse({**as_json(view), **extra, "version": __version__})

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
