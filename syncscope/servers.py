"""The real servers syncscope starts on this machine, all on 127.0.0.1: its exporter and Prometheus.

The demo uses them; so do the tests and benches that need a live exporter or Prometheus.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from typing import Any


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get_json(url: str, timeout: float = 2.0) -> Any:
    with urllib.request.urlopen(url, timeout=timeout) as r:  # noqa: S310 - our own 127.0.0.1 server
        return json.loads(r.read())


def start_exporter(port: int, extra: list[str] | None = None, **popen: Any) -> subprocess.Popen:
    """Start the real exporter on 127.0.0.1:port and wait until it answers /healthz."""
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "syncscope.exporter",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            *(extra or []),
        ],
        **popen,
    )
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"exporter exited with {proc.returncode}")
        with contextlib.suppress(OSError):
            get_json(f"http://127.0.0.1:{port}/healthz", timeout=0.5)
            return proc
        time.sleep(0.1)
    proc.kill()
    raise RuntimeError("exporter did not come up within 20 s")


class Prometheus:
    """A real Prometheus process on 127.0.0.1 with a temporary TSDB."""

    def __init__(self, config_text: str, workdir: str, port: int | None = None) -> None:
        binary = shutil.which("prometheus")
        if binary is None:
            raise FileNotFoundError("prometheus is not installed (scripts/setup installs it)")
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        config = os.path.join(workdir, "prometheus.yml")
        with open(config, "w") as f:
            f.write(config_text)
        self.proc = subprocess.Popen(
            [
                binary,
                f"--config.file={config}",
                f"--storage.tsdb.path={os.path.join(workdir, 'tsdb')}",
                f"--web.listen-address=127.0.0.1:{self.port}",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )

    def wait_ready(self, timeout: float = 30) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"prometheus exited with {self.proc.returncode}")
            with (
                contextlib.suppress(OSError),
                urllib.request.urlopen(self.url + "/-/ready", timeout=1) as r,
            ):  # noqa: S310
                if r.status == 200:
                    return
            time.sleep(0.2)
        raise RuntimeError("prometheus not ready")

    def query(self, promql: str) -> list[dict[str, Any]]:
        url = self.url + "/api/v1/query?" + urllib.parse.urlencode({"query": promql})
        reply = get_json(url)
        if reply.get("status") != "success":
            raise RuntimeError(f"query failed: {promql}: {reply}")
        return reply["data"]["result"]

    def alerts(self) -> list[dict[str, Any]]:
        return get_json(self.url + "/api/v1/alerts")["data"]["alerts"]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(10)
            if self.proc.poll() is None:
                self.proc.kill()
