"""The lab's servers: ports handed out once, and a server counted as started only when the
answer comes from the socket it holds."""

from __future__ import annotations

import http.server
import threading

import pytest

from syncscope.lab.servers import free_port, start_exporter


def test_free_port_never_hands_out_a_port_twice():
    # Nothing binds these: the kernel may give any of them again, free_port must not.
    ports = [free_port() for _ in range(2000)]
    assert len(set(ports)) == len(ports)


class _Healthy(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:  # noqa: N802 - the handler's API
        body = b'{"status": "ok"}'
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *_args: object) -> None:
        pass


def test_an_exporter_whose_port_another_server_answers_is_not_started():
    """Another process answers /healthz on the port: the new exporter cannot bind it, and
    start_exporter says so rather than return an exporter nobody can reach."""
    other = http.server.HTTPServer(("127.0.0.1", 0), _Healthy)
    thread = threading.Thread(target=other.serve_forever, daemon=True)
    thread.start()
    try:
        with pytest.raises(RuntimeError, match="exporter exited"):
            proc = start_exporter(other.server_address[1])
            proc.kill()  # reached only when the check failed
            proc.wait()
    finally:
        other.shutdown()
        other.server_close()
