"""The lab's servers: ports handed out once and out of the way of outgoing connections, a
server whose port was taken started on another, and a server counted as started only when the
answer comes from the socket it holds."""

from __future__ import annotations

import http.server
import shutil
import socket
import threading

import pytest

from syncscope.lab import servers
from syncscope.lab.servers import Prometheus, free_port, start_exporter


def test_free_port_never_hands_out_a_port_twice():
    # Nothing binds these: the kernel may give any of them again, free_port must not.
    ports = [free_port() for _ in range(2000)]
    assert len(set(ports)) == len(ports)


def test_free_port_is_below_the_range_outgoing_connections_take():
    with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
        low = int(f.read().split()[0])
    ports = [free_port() for _ in range(200)]
    assert all(1024 <= p < low for p in ports), [p for p in ports if not 1024 <= p < low]


@pytest.mark.skipif(shutil.which("prometheus") is None, reason="prometheus is not installed")
def test_a_server_whose_port_was_taken_before_it_bound_starts_on_another(tmp_path, monkeypatch):
    """Between free_port's check and the server's bind another process takes the port: the
    server exits (bind: address already in use), and the lab starts it again on a new port."""
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    handed: list[int] = []

    def taken_first() -> int:
        handed.append(taken.getsockname()[1] if not handed else free_port())
        return handed[-1]

    monkeypatch.setattr(servers, "free_port", taken_first)
    prom = Prometheus("global:\n  scrape_interval: 15s\n", str(tmp_path))
    try:
        prom.wait_ready()
        assert len(handed) == 2
        assert prom.port == handed[1] != taken.getsockname()[1]
        assert servers.listens(prom.proc.pid, prom.port)
    finally:
        prom.stop()
        taken.close()


@pytest.mark.skipif(shutil.which("prometheus") is None, reason="prometheus is not installed")
def test_a_server_that_fails_says_why(tmp_path):
    with pytest.raises(
        RuntimeError, match=r"(?s)prometheus exited with \d+:.*Error loading config"
    ):
        prom = Prometheus("global: [not, a, mapping]\n", str(tmp_path))
        try:
            prom.wait_ready()
        finally:
            prom.stop()


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
