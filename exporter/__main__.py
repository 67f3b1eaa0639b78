"""`syncscope-exporter` / `python -m syncscope.exporter`: run the node sidecar under uvicorn."""

from __future__ import annotations

import argparse
import os
import socket
import sys

from syncscope.exporter.settings import Settings, Thresholds

from syncscope.thresholds import checked_overrides


def _price(text: str) -> float:
    """A GPU-hour's price: a finite number, not below 0 (argparse names the flag on error)."""
    value = float(text)
    if not 0.0 <= value < float("inf"):
        raise ValueError(text)
    return value


def build_parser() -> argparse.ArgumentParser:
    d = Settings()
    p = argparse.ArgumentParser(prog="syncscope-exporter", description="syncscope node sidecar")
    p.add_argument(
        "--host", default=d.host, help="address for ingest and /metrics (default %(default)s)"
    )
    p.add_argument("--port", type=int, default=d.port)
    p.add_argument(
        "--ingest-socket", default=None, help="also serve on this unix socket (mode 0660)"
    )
    p.add_argument(
        "--token-file", default=None, help="file holding the bearer token for TCP ingest"
    )
    p.add_argument(
        "--stale-after",
        type=float,
        default=d.stale_after_s,
        help="seconds before a silent rank is stale",
    )
    p.add_argument(
        "--expire-after",
        type=float,
        default=d.expire_after_s,
        help="seconds before it is forgotten",
    )
    p.add_argument(
        "--metrics-host",
        default=None,
        help="address of an extra listener that serves GET /metrics and nothing else, for a "
        "Prometheus on another machine (default: --host)",
    )
    p.add_argument(
        "--metrics-port",
        type=int,
        default=None,
        help="port of that metrics-only listener (must differ from --port; default: none)",
    )
    p.add_argument(
        "--prometheus-url",
        default=os.environ.get("SYNCSCOPE_PROMETHEUS_URL") or None,
        help="Prometheus that scrapes every node of the job, e.g. http://prometheus:9090: the "
        "exporter reads the job-wide leads, transfer and amplification back from it "
        "(env SYNCSCOPE_PROMETHEUS_URL; default: none, a node-local view)",
    )
    p.add_argument(
        "--prometheus-interval",
        type=float,
        default=d.prometheus_interval_s,
        help="seconds between reads of the job-wide rules (default %(default)s)",
    )
    p.add_argument(
        "--shm-dir",
        default=None,
        help="also read agents' shared-memory rings in this directory (agents attached with "
        "exporter='shm:///that/dir'; default: none)",
    )
    p.add_argument(
        "--powercap-root",
        default=d.powercap_root,
        help="Linux powercap directory the CPU packages' RAPL energy is read from, e.g. the "
        "host's /sys mounted elsewhere in a container ('' for none; default %(default)s)",
    )
    p.add_argument(
        "--state-file",
        default=os.environ.get("SYNCSCOPE_STATE_FILE") or None,
        help="keep the counters (steps, phases, collectives, work, goodput and badput) in this "
        "file across the exporter's restarts: written atomically every --state-interval "
        "seconds and at shutdown, loaded at start; a corrupt file is moved to PATH.corrupt "
        "(env SYNCSCOPE_STATE_FILE; default: none, counters restart with the exporter)",
    )
    p.add_argument(
        "--state-interval",
        type=float,
        default=d.state_interval_s,
        help="seconds between writes of the state file (default %(default)s)",
    )
    p.add_argument(
        "--price-per-gpu-hour",
        type=_price,
        default=os.environ.get("SYNCSCOPE_PRICE_PER_GPU_HOUR") or None,
        help="what one GPU-hour costs on this node, in your currency: cost per million tokens "
        "and the cost of lost time follow (env SYNCSCOPE_PRICE_PER_GPU_HOUR; default: none)",
    )
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="PATH=VALUE",
        help="override one threshold of the diagnosis and verdict, as `syncscope rules --set` "
        "does for the rules (give both the same ones), e.g. "
        "alerts.SyncscopeFabricContention.levels.0.threshold=1.3; repeatable",
    )
    p.add_argument("--log-level", default=d.log_level)
    return p


def settings_from_args(args: argparse.Namespace) -> Settings:
    """Settings from the command line; OSError: the token file cannot be read; KeyError or
    ValueError: a --set names no threshold or gives it a bad value."""
    _, cfg = checked_overrides(args.set)
    token = None
    if args.token_file:
        with open(args.token_file) as f:
            token = f.read().strip() or None
    token = token or os.environ.get("SYNCSCOPE_TOKEN") or None
    return Settings(
        host=args.host,
        port=args.port,
        ingest_socket=args.ingest_socket,
        token=token,
        metrics_host=args.metrics_host,
        metrics_port=args.metrics_port,
        stale_after_s=args.stale_after,
        expire_after_s=args.expire_after,
        log_level=args.log_level,
        prometheus_url=args.prometheus_url,
        prometheus_interval_s=args.prometheus_interval,
        powercap_root=args.powercap_root or None,
        state_file=args.state_file or None,
        state_interval_s=args.state_interval,
        price_per_gpu_hour=args.price_per_gpu_hour,
        skew_threshold_s=cfg.diagnosis.skew_floor_s,
        thresholds=Thresholds.from_config(cfg),
    )


# Connections held open at once; beyond it uvicorn answers 503 instead of growing without bound.
MAX_CONNECTIONS = 256


def _tcp_socket(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # IPPROTO_TCP explicitly: asyncio sets TCP_NODELAY only on sockets whose proto says TCP,
    # and with proto 0 every response waited ~40 ms (Nagle vs the client's delayed ACK).
    tcp = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    # A restarted exporter rebinds its port at once despite connections in TIME_WAIT.
    tcp.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    tcp.bind((host, port))
    return tcp


def bind_sockets(settings: Settings) -> list[socket.socket]:
    """The TCP socket, the unix socket when asked for (created 0660, owner's group), and the
    metrics-only TCP socket when asked for."""
    sockets = [_tcp_socket(settings.host, settings.port)]
    if settings.metrics_port is not None:
        sockets.append(_tcp_socket(settings.metrics_host or settings.host, settings.metrics_port))
    if settings.ingest_socket:
        if os.path.exists(settings.ingest_socket):
            os.unlink(settings.ingest_socket)
        uds = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        old = os.umask(0o117)
        try:
            uds.bind(settings.ingest_socket)
        finally:
            os.umask(old)
        os.chmod(settings.ingest_socket, 0o660)
        sockets.append(uds)
    for s in sockets:
        s.listen(128)
        s.set_inheritable(True)
    return sockets


def serve(settings: Settings, shm_dir: str | None = None) -> None:
    import uvicorn
    from syncscope.exporter.app import MetricsOnlyListener, create_app

    app = create_app(settings, shm_dir=shm_dir)
    if settings.metrics_port is not None:
        app = MetricsOnlyListener(app, settings.metrics_port)
    config = uvicorn.Config(
        app,
        log_level=settings.log_level,
        access_log=False,
        # No proxy in front of the exporter: never let a header rewrite who the client is.
        proxy_headers=False,
        server_header=False,
        limit_concurrency=MAX_CONNECTIONS,
    )
    server = uvicorn.Server(config)
    server.run(sockets=bind_sockets(settings))


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        settings = settings_from_args(args)
    except OSError as exc:
        print(f"syncscope-exporter: cannot read token file: {exc}", file=sys.stderr)
        return 2
    except (KeyError, ValueError, IndexError) as exc:  # a bad --set, before anything listens
        print(f"syncscope-exporter: {exc}", file=sys.stderr)
        return 2
    if settings.metrics_port is not None and settings.metrics_port == settings.port:
        print("syncscope-exporter: --metrics-port must differ from --port", file=sys.stderr)
        return 2
    try:
        serve(settings, shm_dir=args.shm_dir)
    except OSError as exc:
        print(
            f"syncscope-exporter: cannot listen on {settings.host}:{settings.port}: {exc}",
            file=sys.stderr,
        )
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
