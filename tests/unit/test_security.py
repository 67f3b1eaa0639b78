"""The exporter's security defaults: loopback binds, unix socket 0660, token, limits, listeners."""

from __future__ import annotations

import http.client
import json
import os
import socket
import stat
import subprocess
import sys
import time

import pytest
from fastapi.testclient import TestClient
from syncscope.exporter.__main__ import build_parser, settings_from_args
from syncscope.exporter.app import create_app
from syncscope.exporter.settings import Settings

from syncscope.lab.servers import free_port
from syncscope.wire import INGEST_PATH
from tests.unit.test_fuzz_ingest import valid_batch

TOKEN = "s3cret-token"


def test_defaults_bind_loopback_only():
    args = build_parser().parse_args([])
    settings = settings_from_args(args)
    assert settings.host == "127.0.0.1" and settings.ingest_socket is None
    assert settings.metrics_port is None  # no wider listener unless asked for
    wide = settings_from_args(
        build_parser().parse_args(["--metrics-host", "0.0.0.0", "--metrics-port", "9465"])
    )
    assert (wide.host, wide.metrics_host, wide.metrics_port) == ("127.0.0.1", "0.0.0.0", 9465)


def test_token_guards_tcp_ingest_and_forwarded_headers_do_not_bypass_it():
    with TestClient(create_app(Settings(token=TOKEN))) as c:
        for headers in (
            {},
            {"Authorization": "Bearer wrong"},
            {"Authorization": "Bearer " + TOKEN[:-1]},
            {"Authorization": "Bearer " + TOKEN + "x"},
            {"Authorization": TOKEN},
            {"Authorization": "Bearer", "X-Forwarded-For": "127.0.0.1"},
            {"X-Forwarded-For": "", "Forwarded": "for=unix"},
        ):
            r = c.post(INGEST_PATH, json=valid_batch(), headers=headers)
            assert r.status_code == 401, headers
            assert r.json() == {
                "error": "unauthorised",
                "detail": "a valid bearer token is required for TCP ingest",
            }
        ok = c.post(INGEST_PATH, json=valid_batch(), headers={"Authorization": "Bearer " + TOKEN})
        assert ok.status_code == 200
        text = c.get("/metrics").text
        assert 'syncscope_exporter_ingest_rejected_total{reason="unauthorised"} 7.0' in text


def test_no_route_reads_a_path_from_its_input():
    with TestClient(create_app(Settings())) as c:
        spec = c.get("/openapi.json").json()
        assert set(spec["paths"]) == {INGEST_PATH, "/metrics", "/healthz", "/v1/state"}
        for probe in (
            "/ui/..%2F..%2F..%2Fetc%2Fpasswd",
            "/ui/%2e%2e/%2e%2e/etc/passwd",
            "/ui/page.css%00.py",
            "/../../etc/passwd",
            "/v1/state/../../etc/passwd",
        ):
            r = c.get(probe)
            assert r.status_code == 404, (probe, r.status_code)
            assert "root:" not in r.text


def test_body_limits_and_slow_bodies():
    with TestClient(create_app(Settings(max_body_bytes=1000))) as c:
        r = c.post(INGEST_PATH, content=b"{" + b" " * 2000 + b"}")
        assert r.status_code == 413 and r.json()["error"] == "too_large"
        r = c.post(INGEST_PATH, content=b"{" + b" " * 2000 + b"}", headers={"content-length": "5"})
        assert r.status_code in (400, 413)


def _start(args: list[str]) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "syncscope.exporter", *args],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )


def _wait_http(port: int, proc: subprocess.Popen, path: str = "/metrics") -> None:
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.stderr.read().decode() if proc.stderr else ""
        try:
            status, _ = _get(port, path)
            if status == 200:
                return
        except OSError:
            time.sleep(0.1)
    raise AssertionError("exporter did not come up")


def _get(port: int, path: str, method: str = "GET", body: bytes | None = None, headers=None):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
    try:
        conn.request(method, path, body=body, headers=headers or {})
        r = conn.getresponse()
        return r.status, r.read()
    finally:
        conn.close()


class _UnixConn(http.client.HTTPConnection):
    def __init__(self, path: str) -> None:
        super().__init__("localhost", timeout=5)
        self.path_ = path

    def connect(self) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(5)
        self.sock.connect(self.path_)


@pytest.mark.slow
def test_metrics_listener_serves_metrics_only_and_unix_ingest_is_0660(tmp_path):
    """A real exporter: main listener on loopback, metrics-only listener, unix socket, token."""
    main_port, metrics_port = free_port(), free_port()
    sock_path = str(tmp_path / "ingest.sock")
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")
    proc = _start(
        [
            "--host",
            "127.0.0.1",
            "--port",
            str(main_port),
            "--metrics-host",
            "127.0.0.1",  # a real deployment would say 0.0.0.0 here; tests stay on loopback
            "--metrics-port",
            str(metrics_port),
            "--ingest-socket",
            sock_path,
            "--token-file",
            str(token_file),
        ]
    )
    try:
        _wait_http(main_port, proc)
        assert stat.S_IMODE(os.stat(sock_path).st_mode) == 0o660
        body = json.dumps(valid_batch(job="sec")).encode()
        hdr = {"content-type": "application/json"}
        # unix socket: the file mode is the access control, no token needed
        conn = _UnixConn(sock_path)
        conn.request("POST", INGEST_PATH, body=body, headers=hdr)
        assert conn.getresponse().status == 200
        conn.close()
        # TCP: the token is required
        assert _get(main_port, INGEST_PATH, "POST", body, hdr)[0] == 401
        auth = {**hdr, "Authorization": "Bearer " + TOKEN}
        assert _get(main_port, INGEST_PATH, "POST", body, auth)[0] == 200
        # the metrics-only listener: /metrics and nothing else, not even with the token
        status, text = _get(metrics_port, "/metrics")
        assert status == 200 and b'syncscope_steps_total{job="sec"' in text
        # The node label names the host (issue 17: a page says where a rank is); pids and
        # incarnations stay in /v1/state.
        assert b'node="node-1"' in text and b"inc-1" not in text
        for method, path in (
            ("POST", INGEST_PATH),
            ("GET", "/v1/state"),
            ("GET", "/"),
            ("GET", "/ui/status"),
            ("GET", "/openapi.json"),
            ("GET", "/docs"),
            ("GET", "/healthz"),
            ("POST", "/metrics"),
        ):
            status, _ = _get(metrics_port, path, method, body if method == "POST" else None, auth)
            assert status == 404, (method, path, status)
        # the main listener still serves everything
        assert _get(main_port, "/v1/state")[0] == 200
        assert _get(main_port, "/openapi.json")[0] == 200
    finally:
        proc.terminate()
        proc.wait(10)


def test_metrics_port_must_differ_from_main_port():
    proc = _start(["--port", "9999", "--metrics-port", "9999"])
    assert proc.wait(30) == 2
