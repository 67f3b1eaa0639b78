"""Emulated nodes on this machine: one network namespace per node joined by a bridge, one exporter
per node, and one real gloo job whose ranks talk across the namespaces' veth links.

Layout, namespaces named ``syncscope-<pid>-<instance>-{switch,node<i>}``::

    netns ...-switch:  bridge br0 with ports port0, port1, ...
                         │ veth           │ veth
    netns ...-node0:   node0 10.213.0.1/24   netns ...-node1: node1 10.213.0.2/24   (and lo)

Addresses exist only inside the namespaces made here; the root namespace gets no interface.
Each node's exporter runs in the root namespace on 127.0.0.1 and takes its ranks' records on
a unix socket, which crosses network namespaces because the filesystem is shared; the
FileStore rendezvous does too. With ``hostnames`` each rank also gets its own UTS namespace
named ``node<i>`` (and SYNCSCOPE_NODE says the same), so the exporters see a distinct node per
node. Needs root and iproute2; where refused,
entering raises `NodesUnavailable`.

    with EmulatedNodes(nodes=2, ranks_per_node=2) as cluster:
        cluster.run(["--duration", "20", "--slow-rank", "3"], job="x")  # or .launch(): Popens
        states = cluster.states()  # each node's exporter /v1/state
        truth = cluster.truth(skip_steps=10)  # the pooled per-step truth (syncscope.lab.truth)
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import IO, Any

from syncscope.lab.forkserver import Placement
from syncscope.lab.launch import RankProcess, launch, stop, wait_all
from syncscope.lab.servers import free_port, get_json, start_exporter
from syncscope.lab.truth import Truth, truth_from_dir

NAME_PREFIX = "syncscope-"
SUBNET = "10.213.0"
_STALE = re.compile(rf"^{NAME_PREFIX}(\d+)-\d+-(?:node\d+|switch)$")
# tbf's queue bound: packets that would wait longer than this are dropped, as on a real port.
TBF_LATENCY = "50ms"
FLOW_PORT = 5201  # a competing flow's receiver, on a node's address inside its namespace
# A bulk TCP flow (competing_flow): the receiver drains, the sender writes as fast as it may.
_RECEIVER = """
import socket, sys
s = socket.socket()
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind((sys.argv[1], int(sys.argv[2])))
s.listen(1)
c, _ = s.accept()
while c.recv(1 << 20):
    pass
"""
_SENDER = """
import socket, sys, time
deadline = time.monotonic() + 10
while True:
    try:
        c = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=1)
        break
    except OSError:
        if time.monotonic() > deadline:
            raise
        time.sleep(0.05)
c.settimeout(None)
block = bytes(1 << 20)
while True:
    c.sendall(block)
"""


class NodesUnavailable(RuntimeError):
    """The kernel or permissions refuse network namespaces here (or iproute2 is missing)."""


@dataclass
class Node:
    """One emulated node: its namespace, its veth end and address, and its exporter."""

    index: int
    netns: str
    ifname: str  # the node's end of its veth pair, inside netns
    port_ifname: str  # the switch's end, inside the switch namespace
    address: str
    exporter_port: int
    socket_path: str = ""  # the exporter's ingest socket, in the workdir made on entry
    exporter: subprocess.Popen | None = None

    @property
    def exporter_url(self) -> str:
        return f"http://127.0.0.1:{self.exporter_port}"

    @property
    def ingest_url(self) -> str:
        return f"unix://{self.socket_path}"

    def state(self, recent: int = 0) -> dict[str, Any]:
        state: dict[str, Any] = get_json(f"{self.exporter_url}/v1/state?recent={recent}")
        return state


def iproute(*cmd: str) -> str:
    """Run an iproute2 command; any refusal is NodesUnavailable with the command's stderr."""
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    except FileNotFoundError as exc:
        raise NodesUnavailable(
            f"network namespaces need root and iproute2: {cmd[0]} not found"
        ) from exc
    if done.returncode != 0:
        raise NodesUnavailable(
            "network namespaces need root and iproute2: "
            f"`{' '.join(cmd)}` failed: {done.stderr.strip() or done.returncode}"
        )
    return done.stdout


def list_netns() -> list[str]:
    """Names of the network namespaces `ip netns` knows ("name (id: N)" → "name")."""
    return [line.split()[0] for line in iproute("ip", "netns", "list").splitlines() if line.strip()]


def remove_stale_netns() -> list[str]:
    """Delete namespaces of this naming scheme left by a run whose process is gone."""
    removed = []
    with contextlib.suppress(NodesUnavailable):
        for name in list_netns():
            m = _STALE.match(name)
            if m is None or _alive(int(m.group(1))):
                continue
            with contextlib.suppress(NodesUnavailable):
                iproute("ip", "netns", "delete", name)
                removed.append(name)
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class EmulatedNodes:
    """N emulated nodes of R ranks each; a context manager that removes everything on exit.

    ``link_mbit``: {node index: Mbit/s} shapes that node's link (both directions) with tbf;
    `set_link_rate` changes it while a job runs. ``workdir``: kept when given (records, logs,
    sockets), else a temporary directory removed on exit.
    """

    _instances = itertools.count()

    def __init__(
        self,
        nodes: int = 2,
        ranks_per_node: int = 2,
        *,
        link_mbit: Mapping[int, float] | None = None,
        workdir: str | None = None,
        exporter_ports: Sequence[int] | None = None,
        exporter_args: Sequence[str] = (),
        node_exporter_args: Sequence[Sequence[str]] = (),
        hostnames: bool = True,
    ) -> None:
        if nodes < 1 or ranks_per_node < 1:
            raise ValueError("need at least one node and one rank per node")
        if nodes > 250:
            raise ValueError("at most 250 nodes fit the /24")
        self.ranks_per_node = ranks_per_node
        self.world_size = nodes * ranks_per_node
        self.hostnames = hostnames
        self._link_mbit = dict(link_mbit or {})
        self._exporter_args = list(exporter_args)
        # node i's exporter's own arguments after the common ones (none where not given)
        self._node_exporter_args = [list(args) for args in node_exporter_args]
        self._own_workdir = workdir is None
        self.workdir = workdir or ""  # a temporary one is made on entry
        self.name = f"{NAME_PREFIX}{os.getpid()}-{next(self._instances)}"
        self.switch = f"{self.name}-switch"
        ports = list(exporter_ports or [])
        self.nodes = [
            Node(
                index=i,
                netns=f"{self.name}-node{i}",
                ifname=f"node{i}",
                port_ifname=f"port{i}",
                address=f"{SUBNET}.{i + 1}",
                exporter_port=ports[i] if i < len(ports) and ports[i] else free_port(),
            )
            for i in range(nodes)
        ]
        self.records_dir: str | None = None
        self._made: list[str] = []  # namespaces created, deleted in reverse order
        self.ranks: list[RankProcess] = []  # every rank launched, all stopped on exit
        self._flows: list[subprocess.Popen] = []  # competing flows' ends, stopped on exit
        self._launches = 0

    # -- lifetime ---------------------------------------------------------------------------

    def __enter__(self) -> EmulatedNodes:
        if self._own_workdir:
            self.workdir = tempfile.mkdtemp(prefix="syncscope-nodes-")
        for node in self.nodes:
            node.socket_path = os.path.join(self.workdir, f"node{node.index}.sock")
        try:
            self._create_network()
            self._start_exporters()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _add_netns(self, name: str) -> None:
        iproute("ip", "netns", "add", name)
        self._made.append(name)
        iproute("ip", "-n", name, "link", "set", "lo", "up")

    def _create_network(self) -> None:
        if shutil.which("ip") is None:
            raise NodesUnavailable("network namespaces need root and iproute2: ip not found")
        remove_stale_netns()
        self._add_netns(self.switch)
        iproute("ip", "-n", self.switch, "link", "add", "br0", "type", "bridge")
        iproute("ip", "-n", self.switch, "link", "set", "br0", "up")
        for node in self.nodes:
            self._add_netns(node.netns)
            # Both ends are born inside namespaces made here: the root namespace never sees them.
            iproute(
                "ip", "-n", self.switch, "link", "add", node.port_ifname, "type", "veth",
                "peer", "name", node.ifname, "netns", node.netns,
            )  # fmt: skip
            iproute("ip", "-n", self.switch, "link", "set", node.port_ifname, "master", "br0", "up")
            iproute("ip", "-n", node.netns, "addr", "add", f"{node.address}/24", "dev", node.ifname)
            iproute("ip", "-n", node.netns, "link", "set", node.ifname, "up")
            if node.index in self._link_mbit:
                self.set_link_rate(node.index, self._link_mbit[node.index])

    def _start_exporters(self) -> None:
        own = self._node_exporter_args
        for node in self.nodes:
            extra = own[node.index] if node.index < len(own) else ()
            log = os.path.join(self.workdir, f"exporter{node.index}.log")
            with open(log, "ab") as out:
                node.exporter = start_exporter(
                    node.exporter_port,
                    ["--ingest-socket", node.socket_path, *self._exporter_args, *extra],
                    stdout=out,
                    stderr=subprocess.STDOUT,
                )

    def close(self) -> None:
        """Stop ranks and exporters, delete the namespaces (and with them the veths)."""
        for proc in [*self.ranks, *self._flows]:
            stop(proc, grace=2.0)
        for node in self.nodes:
            if node.exporter is not None:
                stop(node.exporter)
        for name in reversed(self._made):
            with contextlib.suppress(NodesUnavailable):
                iproute("ip", "netns", "delete", name)
        self._made.clear()
        if self._own_workdir and self.workdir:
            shutil.rmtree(self.workdir, ignore_errors=True)
            self.workdir = ""

    # -- the job ----------------------------------------------------------------------------

    def node_of(self, rank: int) -> Node:
        return self.nodes[rank // self.ranks_per_node]

    def _place(self, rank: int) -> Placement:
        node = self.node_of(rank)
        # With hostnames, a UTS namespace of its own, named after the node, for the agent's
        # hostname label.
        return Placement(node.netns, f"node{node.index}" if self.hostnames else None)

    def _rank_env(self, rank: int) -> dict[str, str]:
        node = self.node_of(rank)
        env = {
            "SYNCSCOPE_EXPORTER": node.ingest_url,
            "GLOO_SOCKET_IFNAME": node.ifname,
            "MASTER_ADDR": self.nodes[0].address,
        }
        if self.hostnames:  # the node label, whatever the machine's environment says (NODE_NAME)
            env["SYNCSCOPE_NODE"] = f"node{node.index}"
        return env

    def launch(
        self,
        args: Sequence[str],
        env: Mapping[str, str] | None = None,
        module: str = "syncscope.lab.workload",
        stdout: int | IO[bytes] | None = None,
        stderr: int | IO[bytes] | None = None,
        record: bool = True,
    ) -> list[RankProcess]:
        """Start one job of ``world_size`` ranks, node i's ranks inside node i's namespace.

        With ``record`` every rank appends its steps to ``records_dir/rank{rank}.jsonl`` (a
        fresh directory per launch), the input of `truth`.
        """
        base = dict(os.environ if env is None else env)
        if record:
            self._launches += 1
            self.records_dir = os.path.join(self.workdir, f"records-{self._launches}")
            os.makedirs(self.records_dir)
            base["SYNCSCOPE_RECORD"] = os.path.join(self.records_dir, "rank{rank}.jsonl")
        procs = launch(
            self.world_size,
            args,
            env=base,
            module=module,
            stdout=stdout,
            stderr=stderr,
            local_world_size=self.ranks_per_node,
            place=self._place,
            rank_env=self._rank_env,
        )
        self.ranks += procs
        return procs

    @contextlib.contextmanager
    def running(
        self,
        args: Sequence[str],
        job: str,
        env: Mapping[str, str] | None = None,
        timeout: float = 300.0,
        record: bool = True,
    ) -> Iterator[list[RankProcess]]:
        """One job of the workload under SYNCSCOPE_JOB=job, its ranks' output in
        ``workdir/<job>.log``, its ranks yielded while it runs; on leaving, they are waited for,
        and a RuntimeError carries the log's tail if a rank failed."""
        log_path = os.path.join(self.workdir, f"{job}.log")
        with open(log_path, "w+b") as log:
            procs = self.launch(
                args,
                env=dict(os.environ if env is None else env, SYNCSCOPE_JOB=job),
                stdout=log,
                stderr=subprocess.STDOUT,
                record=record,
            )
            yield procs
            codes = wait_all(procs, timeout)
            if codes != [0] * len(codes):
                log.seek(0)
                tail = log.read()[-6000:].decode(errors="replace")
                raise RuntimeError(f"ranks of {job} exited with {codes}:\n{tail}")

    def run(self, args: Sequence[str], job: str, **kw: Any) -> None:
        """Run one job of the workload to its end: `running` (same keywords), with nothing to
        do meanwhile."""
        with self.running(args, job, **kw):
            pass

    def set_link_rate(self, node: int, mbit: float | None) -> None:
        """Shape node's link to ``mbit`` Mbit/s each way (None: unshaped), also mid-run."""
        n = self.nodes[node]
        ends = ((n.netns, n.ifname), (self.switch, n.port_ifname))
        for netns, dev in ends:
            if mbit is None:
                with contextlib.suppress(NodesUnavailable):  # nothing to remove
                    iproute("tc", "-n", netns, "qdisc", "del", "dev", dev, "root")
                continue
            # The bucket holds 5 ms at full rate (at least 16 KiB): enough for the timer to
            # keep up, small enough that a transfer cannot burst past the rate.
            burst = max(int(mbit * 1e6 / 8 * 0.005), 16 * 1024)
            iproute(
                "tc", "-n", netns, "qdisc", "replace", "dev", dev, "root", "tbf",
                "rate", f"{mbit}mbit", "burst", str(burst), "latency", TBF_LATENCY,
            )  # fmt: skip

    @contextlib.contextmanager
    def competing_flow(self, src: int, dst: int) -> Iterator[None]:
        """A bulk TCP flow from node ``src`` to node ``dst`` while the context lasts: it
        queues on src's link out and dst's link in (both ends through the one bridge), as
        another job's traffic on shared links would."""
        to = self.nodes[dst]
        ends = []
        for node, code in ((to, _RECEIVER), (self.nodes[src], _SENDER)):
            cmd = ["ip", "netns", "exec", node.netns, sys.executable, "-c", code]
            proc = subprocess.Popen(
                [*cmd, to.address, str(FLOW_PORT)],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
            self._flows.append(proc)
            ends.append(proc)
        try:
            yield
        finally:
            for proc in reversed(ends):
                stop(proc, grace=1.0)

    # -- reading it -------------------------------------------------------------------------

    @property
    def exporter_ports(self) -> list[int]:
        return [n.exporter_port for n in self.nodes]

    def states(self, recent: int = 0) -> list[dict[str, Any]]:
        """Every node's exporter /v1/state, in node order."""
        return [n.state(recent) for n in self.nodes]

    def link_bytes(self, node: int) -> tuple[int, int]:
        """(received, sent) bytes on the node's veth: proof that traffic crossed it."""
        n = self.nodes[node]
        stats = json.loads(
            iproute("ip", "-n", n.netns, "-s", "-j", "link", "show", "dev", n.ifname)
        )
        s64 = stats[0]["stats64"]
        return int(s64["rx"]["bytes"]), int(s64["tx"]["bytes"])

    def truth(
        self,
        skip_steps: int = 0,
        window_s: float | None = None,
        rule_steps: Callable[[float], tuple[int, int] | None] | None = None,
    ) -> Truth:
        """The pooled per-step truth of the latest launch (see syncscope.lab.truth), over the
        last ``window_s`` of the job (or the steps ``rule_steps`` says a rule saw) when given."""
        if self.records_dir is None:
            raise RuntimeError("no launch with record=True yet")
        return truth_from_dir(self.records_dir, skip_steps, window_s, rule_steps)
