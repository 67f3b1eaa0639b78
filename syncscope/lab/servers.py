"""The real servers syncscope starts on this machine, all on 127.0.0.1: its exporter, Prometheus,
Alertmanager, and VictoriaMetrics with vmalert.

The demo uses them; so do the tests and benches that need a live exporter, Prometheus,
Alertmanager or VictoriaMetrics.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.parse
import urllib.request
from collections.abc import Mapping, Sequence
from typing import Any

from syncscope.prometheus_api import PrometheusAPI

# Ports free_port has handed out in this process: a port is free until its server binds it, so
# two asked for before either server starts (a Prometheus and the exporters it will scrape)
# could otherwise be the same one, and the second server's bind fails.
_handed_out: set[int] = set()


def _ephemeral_low() -> int:
    """The lowest of the kernel's local ports for outgoing connections."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


def free_port() -> int:
    """A port free on 127.0.0.1 now, never handed out before by this process, and below the
    kernel's ephemeral range.

    A port the kernel picks for ``bind(("127.0.0.1", 0))`` comes from the same range as the
    local port of every outgoing connection on the machine: between the check here and the
    server's bind, any ``connect()`` (a scrape, a rendezvous, another test's client) may take it
    and the server's bind fails. Below that range only an explicit bind can."""
    low = _ephemeral_low()
    first = max(1024, low - 12000)
    rng = random.SystemRandom()
    for _ in range(1000):
        port = rng.randrange(first, low) if low - first >= 1000 else 0
        if port in _handed_out:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            port = s.getsockname()[1]
        if port not in _handed_out:
            _handed_out.add(port)
            return port
    raise RuntimeError("no free port on 127.0.0.1")


def listens(pid: int, port: int) -> bool:
    """Whether process `pid` holds the TCP socket listening on `port` (Linux's /proc; True
    where /proc cannot tell). A server's health answer alone does not say the server is the
    one just started: another process may hold the port, and the new one's bind then fails."""
    inodes = set()
    try:
        for table in ("/proc/net/tcp", "/proc/net/tcp6"):
            with open(table) as f:
                for row in f.read().splitlines()[1:]:
                    fields = row.split()
                    local, state, inode = fields[1], fields[3], fields[9]
                    if state == "0A" and int(local.rsplit(":", 1)[1], 16) == port:  # LISTEN
                        inodes.add(f"socket:[{inode}]")
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return True
    for fd in fds:
        with contextlib.suppress(OSError):
            if os.readlink(f"/proc/{pid}/fd/{fd}") in inodes:
                return True
    return False


def get_json(url: str, timeout: float = 2.0) -> Any:
    with urllib.request.urlopen(url, timeout=timeout) as r:  # noqa: S310 - our own 127.0.0.1 server
        return json.loads(r.read())


def start_exporter(port: int, extra: list[str] | None = None, **popen: Any) -> subprocess.Popen:
    """Start the real exporter on 127.0.0.1:port and wait until it answers /healthz from the
    socket it holds."""
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
            if listens(proc.pid, port):
                return proc
        time.sleep(0.1)
    proc.kill()
    raise RuntimeError("exporter did not come up within 20 s")


class _Server:
    """A server binary on 127.0.0.1 with its config in ``workdir``, stopped by ``stop()``."""

    ready_path = "/-/ready"
    listen_flag = "--web.listen-address"  # VictoriaMetrics' binaries: -httpListenAddr

    def __init__(self, binary: str, args: list[str], port: int | None) -> None:
        """Start ``binary``; where ``port`` is None, on a free_port, and on another if a
        process took that one before the server bound it (its log says so)."""
        self.name = os.path.basename(binary)
        fd, self.log_path = tempfile.mkstemp(prefix=f"syncscope-{self.name}-", suffix=".log")
        os.close(fd)
        for _attempt in range(5):
            self.port = port or free_port()
            self.url = f"http://127.0.0.1:{self.port}"
            self.address = f"127.0.0.1:{self.port}"
            with open(self.log_path, "wb") as log:
                self.proc = subprocess.Popen(
                    [binary, *args, f"{self.listen_flag}={self.address}"],
                    stdout=log,
                    stderr=subprocess.STDOUT,
                )
            if port is not None or not self._lost_its_port():
                return
        tail = self.log_tail()
        os.remove(self.log_path)
        raise RuntimeError(f"{self.name}: every port tried was taken\n{tail}")

    def _lost_its_port(self, timeout: float = 15) -> bool:
        """Whether the server exited because its port was taken; False once it listens (or
        after ``timeout``: wait_ready says the rest)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            listening = listens(self.proc.pid, self.port)  # before poll: exited wins
            if self.proc.poll() is not None:
                return "address already in use" in self.log_tail().lower()
            if listening:
                return False
            time.sleep(0.05)
        return False

    def log_tail(self, chars: int = 3000) -> str:
        """The end of what the server printed."""
        with contextlib.suppress(OSError), open(self.log_path, errors="replace") as f:
            return f.read()[-chars:]
        return ""

    def wait_ready(self, timeout: float = 30) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"{self.name} exited with {self.proc.returncode}:\n{self.log_tail()}"
                )
            with (
                contextlib.suppress(OSError),
                urllib.request.urlopen(self.url + self.ready_path, timeout=1) as r,
            ):  # noqa: S310
                if r.status == 200 and listens(self.proc.pid, self.port):
                    return
            time.sleep(0.2)
        raise RuntimeError(f"{self.name} not ready:\n{self.log_tail()}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(10)
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait()
        with contextlib.suppress(OSError):
            os.remove(self.log_path)


def _write(workdir: str, name: str, text: str) -> str:
    path = os.path.join(workdir, name)
    with open(path, "w") as f:
        f.write(text)
    return path


class _Queries:
    """Instant and range queries over a Prometheus-compatible query API (``self.api``): what the
    harness asks of Prometheus, and of VictoriaMetrics in its place."""

    api: PrometheusAPI

    def query(self, promql: str, at: float | None = None) -> list[dict[str, Any]]:
        """An instant query, now or at unix time ``at``."""
        return self.api.instant(promql, at)

    def query_range(
        self, promql: str, start: float, end: float, step: float = 1.0
    ) -> dict[float, dict[str, float]]:
        """{evaluation time: {the series' labels as text ("k=v,…", sorted, no __name__):
        value}} from ``start`` to ``end``;
        with ``step`` the rules' evaluation interval, every evaluation the rules made."""
        times = [start + i * step for i in range(int((end - start) // step) + 1)]
        out: dict[float, dict[str, float]] = {round(t, 3): {} for t in times}
        for series in self.api.range(promql, start, end, step):
            metric = sorted(series["metric"].items())
            labels = ",".join(f"{k}={v}" for k, v in metric if k != "__name__")
            for t, value in series["values"]:
                out.setdefault(round(float(t), 3), {})[labels] = float(value)
        return out


class Prometheus(_Queries, _Server):
    """A real Prometheus process on 127.0.0.1 with a temporary TSDB."""

    def __init__(self, config_text: str, workdir: str, port: int | None = None) -> None:
        binary = shutil.which("prometheus")
        if binary is None:
            raise FileNotFoundError("prometheus is not installed (scripts/setup installs it)")
        config = _write(workdir, "prometheus.yml", config_text)
        storage = os.path.join(workdir, "tsdb")
        super().__init__(
            binary, [f"--config.file={config}", f"--storage.tsdb.path={storage}"], port
        )
        self.api = PrometheusAPI(self.url, timeout=10.0)

    def alerts(self) -> list[dict[str, Any]]:
        alerts: list[dict[str, Any]] = self.api.get("/api/v1/alerts")["alerts"]
        return alerts


def alertmanager_config(
    webhook_url: str,
    group_wait: str = "1s",
    group_interval: str = "1s",
    repeat_interval: str = "1m",
) -> str:
    """Alertmanager YAML sending every alert, firing and resolved, to one webhook.

    Each alert is its own group (``group_by: [...]``) and the waits are a second, so a test
    sees a notification within seconds of Prometheus sending the alert.
    """
    config = {
        "route": {
            "receiver": "webhook",
            "group_by": ["..."],
            "group_wait": group_wait,
            "group_interval": group_interval,
            "repeat_interval": repeat_interval,
        },
        "receivers": [
            {
                "name": "webhook",
                "webhook_configs": [{"url": webhook_url, "send_resolved": True}],
            }
        ],
    }
    return json.dumps(config, indent=2)  # JSON is YAML


class Alertmanager(_Server):
    """A real Alertmanager on 127.0.0.1 routing every alert to ``webhook_url``.

    Gossip is off (an empty ``--cluster.listen-address``), so it opens nothing on 0.0.0.0:9094;
    its silences and notification log live in ``workdir``. Give Prometheus ``self.address``
    (``render_config(..., alertmanager=am.address)``).
    """

    def __init__(
        self,
        webhook_url: str,
        workdir: str,
        port: int | None = None,
        config: str | None = None,
        **timing: str,
    ) -> None:
        """``config``: an Alertmanager YAML of one's own (the shipped one, with webhooks) in
        place of alertmanager_config(webhook_url, **timing)."""
        binary = shutil.which("prometheus-alertmanager") or shutil.which("alertmanager")
        if binary is None:
            raise FileNotFoundError(
                "prometheus-alertmanager is not installed (scripts/setup test installs it)"
            )
        text = config if config is not None else alertmanager_config(webhook_url, **timing)
        config = _write(workdir, "alertmanager.yml", text)
        storage = os.path.join(workdir, "alertmanager-data")
        super().__init__(
            binary,
            [f"--config.file={config}", f"--storage.path={storage}", "--cluster.listen-address="],
            port,
        )

    def alerts(self) -> list[dict[str, Any]]:
        """The alerts Alertmanager holds now (API v2)."""
        result: list[dict[str, Any]] = get_json(self.url + "/api/v2/alerts")
        return result


# VictoriaMetrics' query settings that make its answers Prometheus's (docs/victoriametrics.md):
# Prometheus's fixed 5 min lookback in place of one guessed from the samples' spacing, no
# response cache (data is imported into the past, which a cached answer would hide), and no
# 30 s hold-back of the newest points.
VICTORIAMETRICS_PROMETHEUS_FLAGS = (
    "-search.maxLookback=5m",
    "-search.disableCache",
    "-search.latencyOffset=0s",
)


def _vm_binary(name: str) -> str:
    binary = shutil.which(name)
    if binary is None:
        raise FileNotFoundError(f"{name} is not installed (scripts/setup test installs it)")
    return binary


class VictoriaMetrics(_Queries, _Server):
    """A real single-node VictoriaMetrics on 127.0.0.1 with its storage in ``workdir``.

    It serves Prometheus's query API (``self.api``, ``query``, ``query_range``) and takes samples through
    ``import_prometheus`` (exposition text with millisecond timestamps) or remote write
    (``self.url + "/api/v1/write"``). Retention is 100 years so that data at a fixed past
    time is kept.
    """

    ready_path = "/health"
    listen_flag = "-httpListenAddr"

    def __init__(
        self,
        workdir: str,
        port: int | None = None,
        extra: list[str] | None = None,
        query_flags: Sequence[str] = VICTORIAMETRICS_PROMETHEUS_FLAGS,
        flush_every: float | None = None,
    ) -> None:
        """``query_flags``: in place of Prometheus's query semantics, e.g. the flags the
        generated compose project runs it with (bench/scale_engines.py).

        ``flush_every`` (seconds): force a flush that often while it runs. A query asked again
        is answered from a tag-filters cache that VictoriaMetrics (1.79) invalidates at most
        every 10 s, so a new series stays out of the answers of every query repeated since it
        was written (each rule, each evaluation) for up to 10 s more: measured, a record
        appeared 10 s after its input, each further step of a chain of groups 10 s later again,
        and ~1 s each with a flush every 0.5 s (docs/victoriametrics.md). Against 1 s
        evaluations of a minute-long job that is the difference; against minutes-long ``for:``
        windows it is not, so only the lab flushes."""
        storage = os.path.join(workdir, "victoria-metrics-data")
        args = [
            f"-storageDataPath={storage}",
            "-retentionPeriod=100y",
            *query_flags,
            *(extra or []),
        ]
        super().__init__(_vm_binary("victoria-metrics"), args, port)
        self.api = PrometheusAPI(self.url, timeout=10.0)
        self._stopping = threading.Event()
        self._flusher: threading.Thread | None = None
        if flush_every is not None:
            self._flusher = threading.Thread(
                target=self._flush_loop, args=(flush_every,), name="vm-flush", daemon=True
            )
            self._flusher.start()

    def _flush_loop(self, every: float) -> None:
        while not self._stopping.wait(every):
            with contextlib.suppress(OSError):  # not up yet, or stopping
                self.force_flush()

    def stop(self) -> None:
        self._stopping.set()
        if self._flusher is not None:
            self._flusher.join()
        super().stop()

    def import_prometheus(self, text: str) -> None:
        """Import exposition-format lines (``name{labels} value timestamp_ms``), then make
        them searchable at once (VictoriaMetrics otherwise shows new rows within a second)."""
        request = urllib.request.Request(
            self.url + "/api/v1/import/prometheus", data=text.encode(), method="POST"
        )
        with urllib.request.urlopen(request, timeout=30) as r:  # noqa: S310 - our own 127.0.0.1 server
            r.read()
        self.force_flush()

    def force_flush(self) -> None:
        with urllib.request.urlopen(self.url + "/internal/force_flush", timeout=10) as r:  # noqa: S310
            r.read()

    def export(self, match: str, start: float, end: float) -> list[dict[str, Any]]:
        """Every stored sample of the series ``match`` (a series selector) from ``start`` to
        ``end`` (unix seconds), as stored: one ``{"metric", "values", "timestamps"}`` (ms) per
        series. No lookback fills a gap, so a series absent at an evaluation has no sample."""
        query = urllib.parse.urlencode({"match[]": match, "start": start, "end": end})
        with urllib.request.urlopen(f"{self.url}/api/v1/export?{query}", timeout=60) as r:  # noqa: S310
            return [json.loads(line) for line in r.read().splitlines() if line.strip()]


def vmalert_replay(
    rule_file: str,
    datasource_url: str,
    time_from: float,
    time_to: float,
    rules_delay: str = "1s",
    timeout: float = 300,
) -> subprocess.CompletedProcess[str]:
    """Run ``vmalert -replay``: evaluate ``rule_file`` against ``datasource_url`` at every
    evaluation from ``time_from`` to ``time_to`` (unix seconds) and write the results back to it.

    Groups run one after the other, and each group's rules one after the other over the whole
    range, ``rules_delay`` apart so that a rule reads the previous rule's results. Raises
    RuntimeError (with the end of vmalert's log) when vmalert fails.
    """

    def rfc3339(t: float) -> str:
        return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t))

    args = [
        _vm_binary("vmalert"),
        f"-rule={rule_file}",
        f"-datasource.url={datasource_url}",
        f"-remoteWrite.url={datasource_url}",
        # Replay's range queries take this as their step: 0 is each group's interval (the
        # default, 5m, would record one point in five).
        "-datasource.queryStep=0s",
        "-remoteWrite.flushInterval=100ms",
        f"-replay.timeFrom={rfc3339(time_from)}",
        f"-replay.timeTo={rfc3339(time_to)}",
        f"-replay.rulesDelay={rules_delay}",
        "-replay.maxDatapointsPerQuery=10000",  # VictoriaMetrics answers at most 30000
        "-replay.disableProgressBar",
        "-httpListenAddr=127.0.0.1:0",
    ]
    done = subprocess.run(args, capture_output=True, text=True, timeout=timeout, check=False)
    if done.returncode != 0:
        log = (done.stderr or done.stdout)[-3000:]
        raise RuntimeError(f"vmalert -replay exited with {done.returncode}:\n{log}")
    return done


class VMAlert(_Server):
    """A real vmalert on 127.0.0.1 evaluating ``rule_file`` against ``datasource_url`` (a
    VictoriaMetrics), writing recorded series and alert state back to it and sending alerts to
    ``notifier_url`` (an Alertmanager) when given."""

    ready_path = "/health"
    listen_flag = "-httpListenAddr"

    def __init__(
        self,
        rule_file: str,
        datasource_url: str,
        port: int | None = None,
        notifier_url: str | None = None,
        evaluation_interval: str = "15s",
        flush_interval: str | None = "200ms",
    ) -> None:
        """``flush_interval``: how often it remote-writes its records and alert state (None:
        vmalert's default, 5 s, as the generated compose project runs it). A rule of another
        group reads a record only once it is written: at 1 s evaluations the default holds
        each step of a chain of groups up to 5 s."""
        args = [
            f"-rule={rule_file}",
            f"-datasource.url={datasource_url}",
            f"-remoteWrite.url={datasource_url}",
            f"-remoteRead.url={datasource_url}",
            f"-evaluationInterval={evaluation_interval}",
        ]
        if notifier_url:
            args.append(f"-notifier.url={notifier_url}")
        if flush_interval is not None:
            args.append(f"-remoteWrite.flushInterval={flush_interval}")
        super().__init__(_vm_binary("vmalert"), args, port)
        self.api = PrometheusAPI(self.url, timeout=10.0)


class VMAgent(_Server):
    """A real vmagent on 127.0.0.1: shard ``shard`` of ``shards`` scraping the targets in
    ``config_text`` (prometheus_config.render_scrape_config) and remote-writing to
    ``remote_write_url`` (a VictoriaMetrics' ``/api/v1/write``). Shards given the same config
    split the targets by a hash of each target's labels (``-promscrape.cluster.*``): each is
    scraped by exactly one shard."""

    ready_path = "/health"
    listen_flag = "-httpListenAddr"

    def __init__(
        self,
        config_text: str,
        workdir: str,
        remote_write_url: str,
        shard: int = 0,
        shards: int = 1,
        port: int | None = None,
        flush_interval: str | None = "200ms",
    ) -> None:
        """``flush_interval``: how often it remote-writes what it scraped (None: vmagent's
        default, 1 s, as the generated compose project runs it)."""
        config = _write(workdir, f"vmagent-{shard}.yml", config_text)
        args = [
            f"-promscrape.config={config}",
            f"-remoteWrite.url={remote_write_url}",
            f"-remoteWrite.tmpDataPath={os.path.join(workdir, f'vmagent-{shard}-data')}",
            f"-promscrape.cluster.membersCount={shards}",
            f"-promscrape.cluster.memberNum={shard}",
        ]
        if flush_interval is not None:
            args.append(f"-remoteWrite.flushInterval={flush_interval}")
        super().__init__(_vm_binary("vmagent"), args, port)

    def scraped(self) -> set[str]:
        """The targets this shard scrapes (host:port), as its targets API lists them."""
        data = get_json(self.url + "/api/v1/targets")
        return {t["labels"]["instance"] for t in data["data"]["activeTargets"]}


class VMStack(_Queries):
    """In place of one Prometheus: ``shards`` vmagent shards scrape the targets every second
    and remote-write into one VictoriaMetrics; vmalert evaluates syncscope's rules (the vmalert
    variant, with local_config's short windows and ``overrides``) every second against it,
    writes records and alert state (ALERTS) back and notifies ``alertmanager`` (host:port) when
    given. ``url``, ``query``, ``query_range`` and ``stop`` are what the harness asks of a
    Prometheus; exporters read the job-wide view back from ``url``.

    VictoriaMetrics starts first (its address is known before the exporters start) and is
    flushed every 0.5 s, so that a new series reaches every rule within a second, as on
    Prometheus (``VictoriaMetrics``' ``flush_every``); ``evaluate`` adds the shards and vmalert
    once the targets are."""

    def __init__(self, workdir: str, port: int | None = None) -> None:
        self.workdir = workdir
        self.vm = VictoriaMetrics(workdir, port=port, flush_every=0.5)
        self.servers: list[_Server] = [self.vm]
        self.shards: list[VMAgent] = []
        self.url = self.vm.url
        self.api = self.vm.api
        self.vm.wait_ready()

    def evaluate(
        self,
        exporter_ports: Sequence[int],
        overrides: Mapping[str, Any] | None = None,
        alertmanager: str | None = None,
        shards: int = 2,
    ) -> None:
        """Shards scraping the exporters on 127.0.0.1 at ``exporter_ports``, and vmalert."""
        from syncscope.monitoring.engines import write_rules
        from syncscope.monitoring.prometheus_config import local_overrides, render_scrape_config

        rules = write_rules(
            os.path.join(self.workdir, "rules"), local_overrides(overrides), engine="vmalert"
        )
        # vmalert 1.79 refuses alerting rules without a notifier and has no blackhole: without
        # an Alertmanager, alerts go to a port nobody listens on (ALERTS is still written).
        notifier = f"http://{alertmanager or f'127.0.0.1:{free_port()}'}"
        vmalert = VMAlert(str(rules), self.url, notifier_url=notifier, evaluation_interval="1s")
        self.servers.append(vmalert)
        scrape = render_scrape_config([f"127.0.0.1:{p}" for p in exporter_ports], "1s")
        write = self.url + "/api/v1/write"
        for i in range(shards):
            self.shards.append(VMAgent(scrape, self.workdir, write, shard=i, shards=shards))
        self.servers += self.shards
        for server in self.servers:
            server.wait_ready()

    def scraped_by_shard(self) -> list[set[str]]:
        """Each shard's targets (host:port)."""
        return [shard.scraped() for shard in self.shards]

    def stop(self) -> None:
        for server in reversed(self.servers):
            server.stop()
