"""Start ranks by forking a process that has already imported torch.

Importing torch and its distributed packages costs a rank ~5 s of CPU; a 4-rank job on two
cores pays ~10 s of it before its first step. A `ForkServer` pays it once: a single-threaded
``python -m syncscope.lab.forkserver`` imports `PRELOAD`, then forks one child per request, and
each child becomes ``python -m <module> <args>`` with the request's environment, working
directory, stdio and (for an emulated node) network and UTS namespaces, set up as
``ip netns exec`` and ``unshare --uts`` would. The client gets a `Forked`, which answers as a
`subprocess.Popen` does (pid, poll, wait, kill, returncode).

A child must not differ from a fresh interpreter in anything read at import time: the server
runs with OMP_NUM_THREADS=1 (so importing torch starts no thread: a fork copies only the calling
thread), and `launch` sends it only the lab workload under the server's own PYTHONPATH.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import runpy
import select
import signal
import socket
import struct
import subprocess
import sys
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import IO, Any

PRELOAD = (
    "torch",
    "torch.distributed",
    "torch.distributed.checkpoint",
    "torch.distributed.fsdp",
    "torch.distributed.pipelining",
    "torch.distributed.tensor",
    "torch.nn.parallel",
)
NETNS_DIR = "/var/run/netns"  # where `ip netns add` mounts a namespace
_CLONE_NEWNS, _CLONE_NEWUTS, _CLONE_NEWNET = 0x00020000, 0x04000000, 0x40000000
_MS_REC, _MS_SLAVE, _MNT_DETACH = 0x4000, 0x80000, 2
_PR_SET_PDEATHSIG = 1
_HEADER = struct.Struct("!I")
_LIBC = ctypes.CDLL(None, use_errno=True)  # setns, unshare, mount, umount2, prctl


@dataclass(frozen=True)
class Placement:
    """Where a rank runs: inside a named network namespace, with its own hostname if given."""

    netns: str | None = None
    hostname: str | None = None

    def prefix(self) -> list[str]:
        """The command prefix that places a freshly executed process the same way."""
        out = ["ip", "netns", "exec", self.netns] if self.netns else []
        if self.hostname:
            out += ["unshare", "--uts", "--", "sh", "-c", 'hostname "$0" && exec "$@"']
            out.append(self.hostname)
        return out


def _check(result: int, what: str) -> None:
    if result != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def _enter(place: Placement) -> None:
    """Join the placement's namespaces, as `ip netns exec` does: the network namespace, then a
    mount namespace of its own whose /sys shows that network namespace's interfaces."""
    if place.netns:
        fd = os.open(os.path.join(NETNS_DIR, place.netns), os.O_RDONLY)
        try:
            _check(_LIBC.setns(fd, _CLONE_NEWNET), f"setns {place.netns}")
        finally:
            os.close(fd)
        _check(_LIBC.unshare(_CLONE_NEWNS), "unshare mount namespace")
        _check(_LIBC.mount(b"none", b"/", None, _MS_REC | _MS_SLAVE, None), "mount / slave")
        _check(_LIBC.umount2(b"/sys", _MNT_DETACH), "umount /sys")
        _check(_LIBC.mount(place.netns.encode(), b"/sys", b"sysfs", 0, None), "mount /sys")
    if place.hostname:
        _check(_LIBC.unshare(_CLONE_NEWUTS), "unshare UTS namespace")
        socket.sethostname(place.hostname)


# -- the server ---------------------------------------------------------------------------------
def _read_request(conn: socket.socket) -> tuple[dict[str, Any], list[int]]:
    data, fds, _flags, _addr = socket.recv_fds(conn, 1 << 16, 3)
    while len(data) < _HEADER.size or len(data) - _HEADER.size < _HEADER.unpack_from(data)[0]:
        more = conn.recv(1 << 16)
        if not more:
            raise EOFError("the client hung up mid-request")
        data += more
    return json.loads(data[_HEADER.size :]), list(fds)


def _become(request: dict[str, Any], fds: list[int], keep_closed: list[socket.socket]) -> None:
    """In the forked child: take the request's stdio, place, directory and environment."""
    _LIBC.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)  # the server gone (its client died): go too
    for s in keep_closed:
        s.close()
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
    for fd in set(fds):
        if fd > 2:
            os.close(fd)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    _enter(Placement(request.get("netns"), request.get("hostname")))
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])


def serve(path: str, preload: Sequence[str]) -> dict[str, Any] | None:
    """Import ``preload``, listen on ``path`` and fork a child per request until stdin closes.
    Returns in a child only (its request); the server itself exits here."""
    for name in preload:
        __import__(name)
    # The client decides when the server stops: it closes our stdin (its end closes with it,
    # however it dies). No PDEATHSIG here: it fires when the *thread* that started us exits, and
    # a test may start the server from a thread that ends long before the session does.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(64)
    print("ready", flush=True)
    children: dict[int, socket.socket] = {}
    while True:
        readable, _, _ = select.select([listener, sys.stdin], [], [], 0.05)
        if sys.stdin in readable and not os.read(sys.stdin.fileno(), 1):
            break  # the client closed our stdin: stop
        if listener in readable:
            conn, _ = listener.accept()
            try:
                request, fds = _read_request(conn)
            except (OSError, EOFError, ValueError):
                conn.close()
                continue
            pid = os.fork()
            if pid == 0:
                _become(request, fds, [listener, conn, *children.values()])
                return request
            for fd in fds:
                os.close(fd)
            conn.sendall(json.dumps({"pid": pid}).encode() + b"\n")
            children[pid] = conn
        while children:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                break
            conn = children.pop(pid)
            code = os.waitstatus_to_exitcode(status)
            with contextlib.suppress(OSError):
                conn.sendall(json.dumps({"returncode": code}).encode() + b"\n")
            conn.close()
    for pid in children:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    return None


def run_child(request: dict[str, Any]) -> int:
    """Run ``python -m module args`` in this (forked) interpreter; its exit status."""
    sys.argv = [request["module"], *request["args"]]
    try:
        runpy.run_module(request["module"], run_name="__main__", alter_sys=True)
    except SystemExit as exc:
        if exc.code is None or isinstance(exc.code, int):
            return exc.code or 0
        print(exc.code, file=sys.stderr)
        return 1
    return 0


# -- the client ---------------------------------------------------------------------------------
class Forked:
    """A child of a `ForkServer`, answering as `subprocess.Popen` does."""

    def __init__(self, conn: socket.socket, args: list[str]) -> None:
        self._conn = conn
        self._buffer = b""
        self.args = args
        self.returncode: int | None = None
        self.pid = int(self._message(None)["pid"])

    def _message(self, timeout: float | None) -> dict[str, Any]:
        self._conn.settimeout(timeout)
        while b"\n" not in self._buffer:
            chunk = self._conn.recv(4096)
            if not chunk:  # the server is gone, and with it (PDEATHSIG) the child
                return {"returncode": -signal.SIGKILL}
            self._buffer += chunk
        line, self._buffer = self._buffer.split(b"\n", 1)
        return json.loads(line)

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            try:
                self.returncode = int(self._message(timeout)["returncode"])
            except (TimeoutError, BlockingIOError):
                raise subprocess.TimeoutExpired(self.args, timeout or 0) from None
            self._conn.close()
        return self.returncode

    def poll(self) -> int | None:
        if self.returncode is None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.wait(0)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


Stream = int | IO[bytes] | None


FORKED_MODULE = "syncscope.lab.workload"  # the one module a server forks (the lab's ranks)


class ForkServer:
    """A running ``python -m syncscope.lab.forkserver``; `spawn` forks a rank from it."""

    def __init__(self, preload: Sequence[str] = PRELOAD, timeout: float = 120.0) -> None:
        self._dir = tempfile.mkdtemp(prefix="syncscope-fork-")
        self.path = os.path.join(self._dir, "sock")
        self.env = dict(os.environ, OMP_NUM_THREADS="1")
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "syncscope.lab.forkserver", self.path, *preload],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=self.env,
        )
        assert self._proc.stdout is not None
        ready, _, _ = select.select([self._proc.stdout], [], [], timeout)
        if not ready or self._proc.stdout.readline().strip() != b"ready":
            self.close()
            raise RuntimeError("the fork server did not start")

    def serves(self, module: str, env: Mapping[str, str]) -> bool:
        """Whether a child of this server is the same as a fresh ``python -m module``."""
        return module == FORKED_MODULE and env.get("PYTHONPATH") == self.env.get("PYTHONPATH")

    def spawn(
        self,
        module: str,
        args: Sequence[str],
        env: Mapping[str, str],
        stdout: Stream = None,
        stderr: Stream = None,
        place: Placement | None = None,
    ) -> Forked:
        place = place or Placement()
        opened: list[int] = []

        def fd_of(stream: Stream, inherited: int) -> int:
            if stream is None:
                return inherited
            if stream == subprocess.DEVNULL:
                opened.append(os.open(os.devnull, os.O_RDWR))
                return opened[-1]
            return stream if isinstance(stream, int) else stream.fileno()

        out = fd_of(stdout, 1)
        err = out if stderr == subprocess.STDOUT else fd_of(stderr, 2)
        stdin = fd_of(subprocess.DEVNULL, 0)
        body = json.dumps(
            {
                "module": module,
                "args": list(args),
                "env": dict(env),
                "cwd": os.getcwd(),
                "netns": place.netns,
                "hostname": place.hostname,
            }
        ).encode()
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            conn.connect(self.path)
            message = _HEADER.pack(len(body)) + body
            sent = socket.send_fds(conn, [message[: 1 << 15]], [stdin, out, err])
            conn.sendall(message[sent:])
            return Forked(conn, [*place.prefix(), sys.executable, "-m", module, *args])
        except BaseException:
            conn.close()
            raise
        finally:
            for fd in opened:
                os.close(fd)

    def close(self) -> None:
        """Stop the server; it kills the children still running."""
        if self._proc.poll() is None:
            assert self._proc.stdin is not None
            self._proc.stdin.close()
            try:
                self._proc.wait(10)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
        if self._proc.stdout is not None:
            self._proc.stdout.close()
        with contextlib.suppress(OSError):
            os.unlink(self.path)
        with contextlib.suppress(OSError):
            os.rmdir(self._dir)


def main() -> None:
    request = serve(sys.argv[1], sys.argv[2:])
    if request is not None:
        sys.exit(run_child(request))


if __name__ == "__main__":
    main()
