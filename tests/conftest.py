"""Shared fixtures: a real exporter on 127.0.0.1, real multi-rank jobs, scrape parsing."""

from __future__ import annotations

import contextlib
import gc
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from syncscope.lab.launch import fork_ranks, launch, wait_all
from syncscope.lab.nodes import EmulatedNodes, NodesUnavailable
from syncscope.lab.servers import free_port, start_exporter

ROOT = Path(__file__).resolve().parents[1]
UNIT = ROOT / "tests" / "unit"


def torch_available() -> bool:
    try:
        import torch  # noqa: F401
    except ImportError:
        return False
    return True


def pytest_configure(config: pytest.Config) -> None:
    # pytest-xdist's controller: its workers run the tests (and what they start)
    controller = config.getoption("dist", "no") != "no" and not hasattr(config, "workerinput")
    end_on_termination(forward=controller)


def end_on_termination(forward: bool) -> None:
    """SIGTERM or SIGHUP to this pytest process (a CI job's timeout, `kill`, a closed terminal)
    ends the run as Ctrl-C does: KeyboardInterrupt, so every fixture and `with` block stops what
    it started (exporters, Prometheus, jobs, emulated nodes' namespaces), where the default
    action would leave them running for good. `forward`: the signal goes on to this process's
    children first (pytest-xdist's workers, which do the same). A child forked from this
    process that has not exec'd yet takes the default action. A handler someone else installed
    stays."""
    pid = os.getpid()

    def interrupt(signum: int, _frame: Any) -> None:
        if os.getpid() != pid:
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        for child in children(pid) if forward else ():
            with contextlib.suppress(OSError):
                os.kill(child, signum)
        raise KeyboardInterrupt(f"{signal.Signals(signum).name} received")

    for signum in (signal.SIGTERM, signal.SIGHUP):
        if signal.getsignal(signum) == signal.SIG_DFL:
            signal.signal(signum, interrupt)


def children(pid: int) -> list[int]:
    """The processes whose parent is `pid` (from /proc)."""
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError, ValueError, IndexError):
                stat = Path(f"/proc/{entry}/stat").read_text()
                if int(stat[stat.rindex(")") + 2 :].split()[1]) == pid:
                    out.append(int(entry))
    return out


SKIP_STEPS = 10  # warm-up steps left out of an emulated job's truth (gloo connecting, allocations)


@contextmanager
def emulated(nodes: int, ranks_per_node: int, **kw: Any) -> Iterator[EmulatedNodes]:
    """syncscope.lab.nodes.EmulatedNodes, skipped with the kernel's reason where refused."""
    cluster = EmulatedNodes(nodes, ranks_per_node, **kw)
    try:
        cluster.__enter__()
    except NodesUnavailable as exc:
        pytest.skip(str(exc))
    try:
        yield cluster
    finally:
        cluster.close()


def cuda_available() -> bool:
    try:
        import torch

        return bool(torch.cuda.is_available())
    except ImportError:
        return False


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    skip_gpu = pytest.mark.skip(
        reason="needs a CUDA GPU; none on this machine (run on the device machine)"
    )
    gpu = cuda_available()
    for item in items:
        if "gpu" in item.keywords and not gpu:
            item.add_marker(skip_gpu)
        # A unit test runs no training job whose timing it judges: all of them run beside
        # the quiet ones, at idle priority, but those that judge phases against sleeps
        # (pyproject.toml's markers: at idle priority a wake-up can wait tens of ms for a core).
        if item.path.is_relative_to(UNIT) and "clock" not in item.keywords:
            item.add_marker(pytest.mark.background)
        tiers = [tier for tier in ("quiet", "background", "relative") if tier in item.keywords]
        if len(tiers) > 1:
            raise pytest.UsageError(f"{item.nodeid}: {' and '.join(tiers)} exclude each other")
    # pytest-xdist runs items that share a node id once: such tests must say so (`serial`)
    by_id: dict[str, list[pytest.Item]] = {}
    for item in items:
        by_id.setdefault(item.nodeid, []).append(item)
    shared = [i for i, same in by_id.items() if len(same) > 1 and "serial" not in same[0].keywords]
    if shared:
        raise pytest.UsageError(f"items share a node id, not marked serial: {shared}")
    # `make test` runs the serial tests apart in the background tier only
    apart = [i.nodeid for i in items if "serial" in i.keywords and "background" not in i.keywords]
    if apart:
        raise pytest.UsageError(f"marked serial but not background: {sorted(set(apart))}")


@pytest.fixture(scope="session", autouse=True)
def ranks_forked_from_a_warm_process() -> Iterator[None]:
    """Every lab job's ranks forked from one process that has imported torch (~5 s of CPU a
    rank saved; syncscope.lab.forkserver), started by the session's first job."""
    fork_ranks(True)
    yield
    fork_ranks(False)


@pytest.fixture(autouse=True)
def no_collection_of_earlier_tests_objects(request: pytest.FixtureRequest) -> Iterator[None]:
    """A `clock` test's phases clear of the garbage collector's passes over what earlier tests in
    the process left (frozen, so that no pass looks at them until the test ends): a generation-1
    pass over them took 38.7 ms inside a timed forward phase, where such a test allows 20 ms for
    a late wake-up (test_backward_timing.py's split backward, after test_hot_path.py and
    test_hot_path_budget.py in one process, every time)."""
    if request.node.get_closest_marker("clock") is None:
        yield
        return
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


@pytest.fixture
def gloo_world_of_one(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """A real gloo process group of one rank in this process (skipped where one exists)."""
    dist = pytest.importorskip("torch.distributed")
    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available")
    if dist.is_initialized():
        pytest.skip("a process group already exists in this process")
    store = tmp_path_factory.mktemp("gloo") / "store"
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("GLOO_SOCKET_IFNAME", "lo")
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
        try:
            yield
        finally:
            dist.destroy_process_group()


class Exporter:
    """A real `python -m syncscope.exporter` process and helpers to read it."""

    def __init__(self, extra: list[str] | None = None, port: int | None = None) -> None:
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc = start_exporter(
            self.port, extra, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )

    def get(self, path: str) -> bytes:
        with urllib.request.urlopen(self.url + path, timeout=5) as r:
            return r.read()

    def state(self, recent: int = 0) -> dict[str, Any]:
        return json.loads(self.get(f"/v1/state?recent={recent}"))

    def metrics_text(self) -> str:
        return self.get("/metrics").decode()

    def samples(self, name: str) -> dict[tuple[tuple[str, str], ...], float]:
        """{sorted label items: value} for one sample name in a real scrape."""
        return parse_samples(self.metrics_text(), name)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()


def parse_samples(text: str, name: str) -> dict[tuple[tuple[str, str], ...], float]:
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == name:
                out[tuple(sorted(s.labels.items()))] = s.value
    return out


def by_rank(samples: dict[tuple[tuple[str, str], ...], float]) -> dict[int, float]:
    return {int(dict(k)["rank"]): v for k, v in samples.items()}


@pytest.fixture
def exporter() -> Iterator[Exporter]:
    e = Exporter()
    yield e
    e.stop()


class Job:
    """A real N-rank gloo DDP job of syncscope.lab.workload, one process per rank."""

    count = 0

    def __init__(
        self,
        world: int,
        args: list[str],
        exporter_url: str | None,
        tmp: str,
        job: str = "test",
        **env: str,
    ) -> None:
        self.tmp = tmp
        full_env = dict(os.environ, SYNCSCOPE_JOB=job, **env)
        full_env.pop("SYNCSCOPE_EXPORTER", None)
        if exporter_url:
            full_env["SYNCSCOPE_EXPORTER"] = exporter_url
        Job.count += 1
        self.result_prefix = os.path.join(tmp, f"job{Job.count}-result")
        # stderr to a file: an undrained pipe would block a rank that logs a lot
        self.log = open(os.path.join(tmp, f"job{Job.count}-stderr.log"), "w+b")  # noqa: SIM115
        self.procs = launch(
            world,
            [*args, "--result", self.result_prefix + "-{rank}.json"],
            env=full_env,
            stdout=subprocess.DEVNULL,
            stderr=self.log,
        )

    def running(self) -> bool:
        return any(p.poll() is None for p in self.procs)

    def wait(self, timeout: float = 180) -> list[dict[str, Any]]:
        codes = wait_all(self.procs, timeout)
        if codes != [0] * len(codes):
            self.log.flush()
            with open(self.log.name, errors="replace") as f:
                raise AssertionError(f"ranks failed: {codes}\n{f.read()[-6000:]}")
        results = []
        for rank in range(len(self.procs)):
            with open(f"{self.result_prefix}-{rank}.json") as f:
                results.append(json.load(f))
        return results

    def kill(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        self.log.close()


@pytest.fixture
def job_factory(tmp_path: Any) -> Iterator[Any]:
    jobs: list[Job] = []

    def make(world: int, args: list[str], exporter_url: str | None, **kw: Any) -> Job:
        job = Job(world, args, exporter_url, str(tmp_path), **kw)
        jobs.append(job)
        return job

    yield make
    for j in jobs:
        j.kill()


class RunOnce:
    """A module's jobs, each run once by the first test that asks for it (`runs(key)`) and
    judged by every test that needs it; a failure (or skip) of the run is every such test's."""

    def __init__(self, run: Any) -> None:
        self.run = run
        self.done: dict[Any, Any] = {}

    def __call__(self, key: Any) -> Any:
        if key not in self.done:
            try:
                self.done[key] = (True, self.run(key))
            except (Exception, pytest.skip.Exception) as exc:
                self.done[key] = (False, exc)
        ok, result = self.done[key]
        if not ok:
            raise result
        return result


def wait_until(predicate: Any, timeout: float, interval: float = 0.5) -> Any:
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        last = predicate()
        if last:
            return last
        time.sleep(interval)
    return last


def make_reporter(url: str | None, steps: Any, colls: Any, **overrides: Any) -> Any:
    """An agent Reporter over the given queues with quiet test defaults; keywords override."""
    from syncscope.agent.transport import Reporter

    kwargs: dict[str, Any] = {
        "identity": {"job": "t", "rank": 0, "local_rank": 0, "world_size": 1, "incarnation": "x"},
        "url": url,
        "token": None,
        "steps": steps,
        "collectives": colls,
        "flush_interval_s": 1.0,
        "send_timeout_s": 1.0,
        "dropped_elsewhere": lambda: 0,
        "pacing_state": lambda: None,
        "topology": lambda: None,
    }
    kwargs.update(overrides)
    return Reporter(**kwargs)


def promtool() -> str | None:
    return shutil.which("promtool")


PYTHON = sys.executable


def shipped_alertmanager_config(hook_url: str, group_wait: str, group_interval: str) -> str:
    """deploy/alertmanager/alertmanager.yml as shipped (route, grouping, inhibitions), each
    receiver a webhook to ``hook_url/<receiver>`` (firing only), its waits cut for a test."""
    import yaml

    cfg = yaml.safe_load((ROOT / "deploy" / "alertmanager" / "alertmanager.yml").read_text())
    cfg["route"].update(group_wait=group_wait, group_interval=group_interval)
    for receiver in cfg["receivers"]:
        url = f"{hook_url}/{receiver['name']}"
        receiver["webhook_configs"] = [{"url": url, "send_resolved": False}]
    return json.dumps(cfg)  # JSON is YAML


class Webhook:
    """A webhook receiver on 127.0.0.1 keeping every notification with the path it came to."""

    def __init__(self) -> None:
        self.notifications: list[tuple[str, dict[str, Any]]] = []
        received = self.notifications

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - http.server's name
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                received.append((self.path.rsplit("/", 1)[-1], json.loads(body)))
                self.send_response(200)
                self.end_headers()

            def log_message(self, *_args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/hook"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def to(self, receiver: str) -> list[dict[str, Any]]:
        """The notifications posted to .../<receiver> (the URL's last path segment)."""
        return [body for name, body in list(self.notifications) if name == receiver]

    def alerts(self, alertname: str, status: str) -> list[dict[str, Any]]:
        """Every alert of that name and status in any notification."""
        return [
            a
            for _, n in list(self.notifications)
            for a in n["alerts"]
            if a["labels"].get("alertname") == alertname and a["status"] == status
        ]

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def chain_end(waits_for: dict[int, int | None], rank: int) -> int | None:
    """Where following whom each victim waits for from `rank` ends: the first rank that is
    no victim (the root, if the chain is right), or None on a cycle."""
    seen, at = set(), rank
    while at in waits_for:
        if at in seen:
            return None
        seen.add(at)
        nxt = waits_for[at]
        if nxt is None:
            return None
        at = nxt
    return at


def step_rows(agent: Any) -> list[tuple]:
    """The agent's queued step rows as its reporter sends them: quiet steps' rows made whole
    (PhaseClock.finish; their estimated sync records are left out)."""
    rows = list(agent.queues.steps)
    agent.clock.finish(rows)
    return rows
