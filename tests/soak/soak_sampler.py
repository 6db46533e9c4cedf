"""The chaos soak's limit sampler: its own process, so the driver's threads never starve it.

    python tests/soak/soak_sampler.py SEGMENT OUTFILE PERIOD_S P_INDEX... [--understate N]

Appends one record per sample to OUTFILE: the time (f64) and, per provider row
index given, the highest limit its fields allow (i32): ``max(fallback,
published)``, clamped as the ledger clamps. Expiry is ignored on purpose, so
the check built on these samples is never stricter than the product. Reads are
lock-free and sequence-checked (a copy taken while a writer holds the lock is
retried). Runs until its parent dies or it is killed.
"""

from __future__ import annotations

import os
import struct
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from shm_layout import rows
from shm_layout.layout import HEADER, PROVIDER, RUNNING_ROOM
from shm_layout.segment import map_readonly


def record_format(n: int) -> struct.Struct:
    return struct.Struct(f"<d{n}i")


def main() -> int:
    args = sys.argv[1:]
    understate = 0
    if "--understate" in args:
        i = args.index("--understate")
        understate = int(args[i + 1])
        del args[i : i + 2]
    segment, out, period = args[0], args[1], float(args[2])
    indexes = [int(a) for a in args[3:]]
    rec = record_format(len(indexes))
    buf = map_readonly(segment)
    parent = os.getppid()
    seq = HEADER["change_seq"]
    fd = os.open(out, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    while os.getppid() == parent:
        before = seq.get(buf)
        if before % 2 == 0:
            values = []
            for p in indexes:
                base = rows.provider_base(p)
                fallback = min(max(PROVIDER["fallback_limit"].get(buf, base), 0), RUNNING_ROOM)
                published = min(PROVIDER["published_limit"].get(buf, base), RUNNING_ROOM)
                values.append(max(fallback, published) - understate)
            if seq.get(buf) == before:
                os.write(fd, rec.pack(time.time(), *values))
                time.sleep(period)
                continue
        time.sleep(0.0002)
    return 0


if __name__ == "__main__":
    sys.exit(main())
