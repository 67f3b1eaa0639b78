"""`syncscope-exporter` / `python -m syncscope.exporter`: run the node sidecar under uvicorn."""

from __future__ import annotations

import argparse
import os
import socket
import sys

from syncscope.exporter.settings import Settings


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
    p.add_argument("--log-level", default=d.log_level)
    return p


def settings_from_args(args: argparse.Namespace) -> Settings:
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
        stale_after_s=args.stale_after,
        expire_after_s=args.expire_after,
        log_level=args.log_level,
    )


def bind_sockets(settings: Settings) -> list[socket.socket]:
    """The TCP socket, and the unix socket when asked for (created 0660, owner's group)."""
    family = socket.AF_INET6 if ":" in settings.host else socket.AF_INET
    tcp = socket.socket(family, socket.SOCK_STREAM)
    tcp.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    tcp.bind((settings.host, settings.port))
    sockets = [tcp]
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


def serve(settings: Settings) -> None:
    import uvicorn
    from syncscope.exporter.app import create_app

    config = uvicorn.Config(create_app(settings), log_level=settings.log_level, access_log=False)
    server = uvicorn.Server(config)
    server.run(sockets=bind_sockets(settings))


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        settings = settings_from_args(args)
    except OSError as exc:
        print(f"syncscope-exporter: cannot read token file: {exc}", file=sys.stderr)
        return 2
    try:
        serve(settings)
    except OSError as exc:
        print(
            f"syncscope-exporter: cannot listen on {settings.host}:{settings.port}: {exc}",
            file=sys.stderr,
        )
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
