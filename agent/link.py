"""The network link a rank's collectives leave the node by: its name, what it is known to carry,
and its byte counters, for the slow-link verdict.

Which interface: the one the process group was told to use (GLOO_SOCKET_IFNAME, then
NCCL_SOCKET_IFNAME, first name of a comma list, NCCL's ``^`` exclusions and ``=`` exact
prefixes understood), else the interface of the default route. What it is known to carry: the
least of its negotiated speed (/sys/class/net/IF/speed, Mbit/s; veth and some virtual NICs
report a nominal figure) and the rate of a token-bucket (tbf) root qdisc shaping it, read once
with ``tc -j qdisc show`` when the agent starts (a link slow from the start is the case this
serves; a later change of the shaping is not seen). The counters
(/sys/class/net/IF/statistics/{tx,rx}_bytes) are read at every flush on the reporter's thread:
two small file reads, no subprocess after start-up.

Sent in the batch's `topology` dict under the `link_*` keys (syncscope.agent.topology.KEYS);
anything unknown is left out, never an error.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
from collections.abc import Callable, Mapping
from typing import Any

log = logging.getLogger("syncscope.agent")

IFNAME_VARS = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")
ROUTE_FILE = "/proc/net/route"
MAX_IFNAME = 15  # IFNAMSIZ - 1


def _named(value: str, present: list[str]) -> str | None:
    """The interface an *_SOCKET_IFNAME value selects among `present` (None: none of them)."""
    names = [v.strip() for v in value.split(",") if v.strip()]
    if not names:
        return None
    if names[0].startswith("^"):  # NCCL: every interface but these prefixes
        excluded = [n.lstrip("^=") for n in names]
        rest = [p for p in present if p != "lo" and not any(p.startswith(x) for x in excluded)]
        return rest[0] if rest else None
    first = names[0]
    if first.startswith("="):  # NCCL: exactly this name
        return first[1:] if first[1:] in present else None
    if first in present:
        return first
    prefixed = [p for p in present if p.startswith(first)]  # NCCL: a prefix
    return prefixed[0] if prefixed else None


def default_route_interface(route_text: str) -> str | None:
    """The interface of the default route in /proc/net/route's text."""
    for line in route_text.splitlines()[1:]:
        fields = line.split()
        if len(fields) > 2 and fields[1] == "00000000":
            return fields[0]
    return None


def comm_interface(
    env: Mapping[str, str], present: list[str], route_text: str | None
) -> str | None:
    for var in IFNAME_VARS:
        if env.get(var):
            return _named(env[var], present)
    return default_route_interface(route_text) if route_text else None


def shaped_rate_bytes(tc_json: str) -> float | None:
    """The rate (bytes/s) of a tbf root qdisc in ``tc -j qdisc show dev IF`` output."""
    try:
        entries = json.loads(tc_json)
    except ValueError:
        return None
    for entry in entries if isinstance(entries, list) else []:
        if isinstance(entry, dict) and entry.get("kind") == "tbf" and entry.get("root"):
            rate = (entry.get("options") or {}).get("rate")
            if isinstance(rate, (int, float)) and rate > 0:
                return float(rate)
    return None


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read(4096).strip()
    except (OSError, UnicodeDecodeError):
        return None


def _tc_qdisc(ifname: str) -> str | None:
    tc = shutil.which("tc")
    if tc is None:
        return None
    try:
        out = subprocess.run(
            [tc, "-j", "qdisc", "show", "dev", ifname],
            capture_output=True,
            text=True,
            timeout=2,
            check=False,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout if out.returncode == 0 else None


class LinkSampler:
    """The `link_*` part of the reporter's topology; never raises."""

    def __init__(
        self,
        env: Mapping[str, str] | None = None,
        *,
        sys_class_net: str = "/sys/class/net",
        read: Callable[[str], str | None] = _read,
        tc_qdisc: Callable[[str], str | None] = _tc_qdisc,
    ) -> None:
        self.base = sys_class_net
        self.read = read
        self.static: dict[str, Any] = {}
        self.ifname: str | None = None
        try:
            present = sorted(os.listdir(sys_class_net))
        except OSError:
            present = []
        try:
            env = os.environ if env is None else env
            ifname = comm_interface(env, present, read(ROUTE_FILE))
            if ifname is None or ifname not in present:
                return
            self.ifname = ifname[:MAX_IFNAME]
            self.static["link_interface"] = self.ifname
            speed = read(f"{sys_class_net}/{ifname}/speed")
            known = []
            if speed and speed.lstrip("-").isdigit() and int(speed) > 0:
                self.static["link_speed_bytes_per_second"] = int(speed) * 1e6 / 8
                known.append(self.static["link_speed_bytes_per_second"])
            qdisc = tc_qdisc(ifname)
            shaped = shaped_rate_bytes(qdisc) if qdisc else None
            if shaped is not None:
                self.static["link_shaped_bytes_per_second"] = shaped
                known.append(shaped)
            if known:
                self.static["link_capacity_bytes_per_second"] = min(known)
        except Exception as exc:  # noqa: BLE001 - link facts are optional, never fatal
            log.debug("syncscope: no link facts: %s", exc)
            self.static = {}
            self.ifname = None

    def __call__(self) -> dict[str, Any]:
        if self.ifname is None:
            return {}
        out = dict(self.static)
        for direction in ("tx", "rx"):
            text = self.read(f"{self.base}/{self.ifname}/statistics/{direction}_bytes")
            if text is not None and text.isdigit():
                out[f"link_{direction}_bytes"] = int(text)
        return out


def with_link(
    gpu: Callable[[], dict[str, Any] | None] | None,
    link: LinkSampler,
    groups: Callable[[], dict[str, str]] | None = None,
) -> Callable[[], dict[str, Any] | None]:
    """The reporter's topology callable: the GPU sampler's dict (None on CPU) plus link facts
    and the rank's process groups (collectives.GroupLabels.facts)."""

    def topology() -> dict[str, Any] | None:
        out = gpu() if gpu is not None else None
        facts = {**link(), **(groups() if groups is not None else {})}
        return {**(out or {}), **facts} if facts else out

    return topology
