"""The shared-memory ring's layout, which the agent writes (agent/shm_ring.py) and the exporter
reads (exporter/shm_reader.py): a wire format, declared once.

One file, `<dir>/<job>.<rank>.<pid>.<incarnation>.ring`, single producer (the training thread),
single consumer; little-endian:

  header (HEADER_BYTES)
    0   8s  magic                 8   I  version        12  I  slot bytes
    16  Q   capacity (slots)      24  Q  write_seq (producer)
    32  Q   read_seq (consumer)   40  Q  dropped_total (producer: every record the agent lost)
    48  q   clock_offset_ns       56  I  closed flag    60  I  meta length
    64  q   heartbeat unix ns     72  Q  pid            80  I  a reader opened it
    128 ... meta: JSON of the agent's identity and its static topology (written once)
  slots: capacity x SLOT_BYTES; slot i holds record seq where seq % capacity == i:
    stamp (Q, seq + 1), kind (Q), payload, stamp again (Q, seq + 1)
    a step's payload (version 2): the wire's 11-field step row, its work (samples, tokens; -1:
    not known) last; version 1 lacks the work. The exporter reads every version (STEP_SLOTS).
    an event's payload (version 3, KIND_EVENT): the wire's event row, its kind as the index of
    its name in wire.EVENT_KINDS. Rings of versions 1 and 2 have no events.

Protocol: the producer writes a slot only while write_seq - read_seq < capacity, then publishes
write_seq; the consumer reads [read_seq, write_seq), then publishes read_seq. A full ring
refuses the new record and counts it as dropped: tail drop, bounded memory, never a wait. A slot
caught half-written (a foreign writer, a weakly ordered CPU) fails its stamps and counts dropped.
"""

from __future__ import annotations

import os
import re
import struct
import urllib.parse
from typing import Any

MAGIC = b"SSRING01"
VERSION = 3  # 2: step slots carry the step's work (samples, tokens); 3: event slots
HEADER_BYTES = 4096
META_OFFSET = 128
SLOT_BYTES = 160
DEFAULT_CAPACITY = 16384  # slots: 2.5 MiB; at 10 ms steps with 2 records each, 80 s of them
DEFAULT_DIR = "/dev/shm/syncscope"
SUFFIX = ".ring"
HOUSEKEEPING_EVERY = 4  # pumps between header updates (offset, heartbeat, dropped)
NAME_CACHE = 1024  # (op, group) pairs whose encoded names a ring keeps

KIND_STEP = 1
KIND_COLLECTIVE = 2
KIND_EVENT = 3
OP_BYTES = 32
GROUP_BYTES = 64

HEAD = struct.Struct("<8sIIQQQQqII qQ")
WRITE_SEQ = struct.Struct("<Q")  # at 24
READ_SEQ_AT = 32
WRITE_SEQ_AT = 24
DROPPED_AT = 40
OFFSET_AT = 48
CLOSED_AT = 56
HEARTBEAT_AT = 64
READER_AT = 80
Q = struct.Struct("<Q")
q = struct.Struct("<q")
I32 = struct.Struct("<I")
# stamp, kind, 11 x int64 (a step row: wire.StepRowWithWork), 48 pad, stamp
STEP_SLOT = struct.Struct("<QQ11q48xQ")
STEP_FIELDS = 11
# Version 1: stamp, kind, 9 x int64 (a step row without its work), 64 pad, stamp
STEP_SLOT_V1 = struct.Struct("<QQ9q64xQ")
# by the ring's version: what a reader reads
STEP_SLOTS = {1: STEP_SLOT_V1, 2: STEP_SLOT, VERSION: STEP_SLOT}
# stamp, kind, op, group, bytes, duration_ns, step, 16 pad, stamp
COLL_SLOT = struct.Struct(f"<QQ{OP_BYTES}s{GROUP_BYTES}sqqq16xQ")
# stamp, kind, event kind (index in wire.EVENT_KINDS), step (-1: none), end_ns, duration_ns,
# 104 pad, stamp
EVENT_SLOT = struct.Struct("<QQqqqq104xQ")
assert all(slot.size == SLOT_BYTES for slot in (*STEP_SLOTS.values(), COLL_SLOT, EVENT_SLOT))


def ring_dir(url: str) -> str:
    """The directory of `shm:///path` (or `shm://` for the default)."""
    parsed = urllib.parse.urlsplit(url)
    if parsed.scheme != "shm":
        raise ValueError(f"not a shm:// exporter URL: {url!r}")
    return parsed.path or DEFAULT_DIR


def ring_name(identity: dict[str, Any]) -> str:
    safe = re.sub(r"[^A-Za-z0-9_-]", "_", str(identity.get("job", "job")))[:64]
    return (
        f"{safe}.{int(identity.get('rank', 0))}.{int(identity.get('pid', os.getpid()))}."
        f"{identity.get('incarnation', 'x')}{SUFFIX}"
    )
