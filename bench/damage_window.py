"""How long does a single bad write to the segment let more run than the limit? (R-A16)

For each kind of bad write, 6 handler processes cycle slots of 0.5 s on a provider with
a limit of 3; each body counts itself in a shared counter while it runs (the bodies, not
the records: a bad write can free a record whose body goes on), and a monitor samples
that counter every millisecond. One bad write is made (as a scribbling program would),
and the time during which more than 3 bodies ran is measured, from the write to the last
sample above the limit; each kind ROUNDS times, the longest window reported. Prints one
line per kind and a JSON summary. Run: ``.venv/bin/python bench/damage_window.py``
(about a minute and a half).
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import secrets
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

LIMIT = 3
WORKERS = 6
BODY_S = 0.5  # long enough that a sweep can come while a damaged body still runs
ROUNDS = 3


def _worker(config: str, segment: str, stop_at: float, bodies: Any) -> None:
    from handler_shim import Admission, AdmissionTimeout

    adm = Admission.attach(config=config, segment=segment, generation="bench")
    while time.time() < stop_at:
        try:
            with adm.slot_blocking("p1", timeout=1.0):
                with bodies.get_lock():
                    bodies.value += 1
                time.sleep(BODY_S)
                with bodies.get_lock():
                    bodies.value -= 1
        except AdmissionTimeout:
            pass
    adm.close(grace=1.0)


def _scribble(kind: str, buf: object) -> None:
    from shm_layout import layout, platform
    from shm_layout.layout import HOLDER, MEMBER, PROVIDER
    from shm_layout.rows import holder_base, member_base, provider_base

    base = provider_base(0)
    if kind == "running := 0":
        PROVIDER["running"].put(buf, 0, base)
    elif kind == "waiting := 32":
        PROVIDER["waiting"].put(buf, 32, base)
    elif kind == "running := 0xFFFFFFFF":
        PROVIDER["running"].put(buf, 0xFFFFFFFF, base)
    elif kind == "a live member's serial + 1":
        for m in range(layout.MEMBER_COUNT):
            mb = member_base(m)
            if MEMBER["in_use"].get(buf, mb):
                MEMBER["serial"].put(buf, MEMBER["serial"].get(buf, mb) + 1, mb)
                return
    elif kind == "a deadline an hour ahead, limit 96":
        PROVIDER["expires_mono"].put(buf, platform.deadline_now() + 3600, base)
        PROVIDER["published_limit"].put(buf, 96, base)
    elif kind == "a running record's state := 0":
        # the youngest body's record: the damaged body runs longest after the write
        running = [
            holder_base(0, h)
            for h in range(layout.HOLDERS_PER_PROVIDER)
            if HOLDER["state"].get(buf, holder_base(0, h)) == layout.HOLDER_RUNNING
        ]
        if running:
            youngest = max(running, key=lambda hb: HOLDER["since_mono"].get(buf, hb))
            HOLDER["state"].put(buf, 0, youngest)


KINDS = [
    "running := 0",
    "running := 0xFFFFFFFF",
    "waiting := 32",
    "a live member's serial + 1",
    "a deadline an hour ahead, limit 96",
    "a running record's state := 0",
]


def measure(kind: str) -> dict[str, object]:
    from shm_layout.segment import Segment, unlink_segment

    with tempfile.TemporaryDirectory() as d:
        config = os.path.join(d, "g.json")
        Path(config).write_text(json.dumps({"providers": [{"id": "p1", "maxConcurrent": LIMIT}]}))
        segment = "/gwb-" + secrets.token_hex(5)
        seg = Segment.open(segment)
        stop_at = time.time() + 5.5
        ctx = mp.get_context("spawn")
        bodies = ctx.Value("i", 0)
        procs = [
            ctx.Process(target=_worker, args=(config, segment, stop_at, bodies))
            for _ in range(WORKERS)
        ]
        for p in procs:
            p.start()
        time.sleep(1.5)  # all running, the queue formed
        wrote = time.monotonic()
        _scribble(kind, seg.buf)
        last_over = None
        peak = 0
        while time.monotonic() - wrote < 3.0:
            n = bodies.value
            peak = max(peak, n)
            if n > LIMIT:
                last_over = time.monotonic()
            time.sleep(0.001)
        for p in procs:
            p.join(10)
        seg.close()
        unlink_segment(segment)
    window = 0.0 if last_over is None else last_over - wrote
    return {"kind": kind, "over_limit_s": round(window, 3), "peak_running": peak}


def worst(kind: str) -> dict[str, object]:
    rounds = [measure(kind) for _ in range(ROUNDS)]
    return max(rounds, key=lambda r: (r["over_limit_s"], r["peak_running"]))  # type: ignore[return-value]


def main() -> int:
    results = [worst(kind) for kind in KINDS]
    for r in results:
        print(
            f"{r['kind']:<38} bodies over the limit for {r['over_limit_s']:.3f} s "
            f"(peak {r['peak_running']} on a limit of {LIMIT}; worst of {ROUNDS})"
        )
    print(json.dumps(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
