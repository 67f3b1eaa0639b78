"""Keys of the collectives' transfer baselines: (op, group, size class), shared by the agent and
the exporter.

A rank's collective duration is its wait for the last peer plus the transfer, the same for
every rank of one call; what a rank spends beyond the transfer is how early it arrived, with no
clock compared across processes. The lead has one owner per scope: the exporter's pooling, per
step over the node's ranks (exporter/pooling.py), and the recording rules over the job
(recorded.LEAD), which the exporter reads back (exporter/jobwide.py). The agent keeps only the
transfer baselines its pacing subtracts (agent/local_arrival.py), the node's where the exporter
replies with them, keyed as here.
"""

from __future__ import annotations

from syncscope.wire import size_bucket

Key = tuple[str, str, int]  # (op, group, size class)


def collective_key(op: str, group: str, nbytes: float) -> Key:
    return (op, group, size_bucket(nbytes))


def key_text(key: Key) -> str:
    return f"{key[0]}|{key[1]}|{key[2]}"


def parse_key_text(text: str) -> Key | None:
    parts = text.split("|")
    if len(parts) != 3:
        return None
    try:
        return (parts[0], parts[1], int(parts[2]))
    except ValueError:
        return None
