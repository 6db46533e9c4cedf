"""How long does a single bad write to the segment let more run than the limit? (R-A16)

For each kind of bad write, 6 handler processes (tests/agent.py-like workers here) cycle
slots of 50 ms on a provider with a limit of 3; a monitor reads the holder records
lock-free every millisecond and counts RUNNING ones. One bad write is made (as a
scribbling program would), and the time during which more than 3 records ran is
measured, from the write to the last sample above the limit. Prints one line per kind
and a JSON summary. Run: ``.venv/bin/python bench/damage_window.py`` (about 30 s).
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

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

LIMIT = 3
WORKERS = 6
BODY_S = 0.05


def _worker(config: str, segment: str, stop_at: float) -> None:
    from handler_shim import Admission, AdmissionTimeout

    adm = Admission.attach(config=config, segment=segment, generation="bench")
    while time.time() < stop_at:
        try:
            with adm.slot_blocking("p1", timeout=1.0):
                time.sleep(BODY_S)
        except AdmissionTimeout:
            pass
    adm.close(grace=1.0)


def _running(buf: object) -> int:
    from shm_layout import layout
    from shm_layout.ledger import holder_base

    return sum(
        1
        for h in range(layout.HOLDERS_PER_PROVIDER)
        if layout.HOLDER["state"].get(buf, holder_base(0, h)) == layout.HOLDER_RUNNING
    )


def _scribble(kind: str, buf: object) -> None:
    from shm_layout import layout, platform
    from shm_layout.layout import HOLDER, MEMBER, PROVIDER
    from shm_layout.ledger import holder_base, member_base, provider_base

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
        for h in range(layout.HOLDERS_PER_PROVIDER):
            hb = holder_base(0, h)
            if HOLDER["state"].get(buf, hb) == layout.HOLDER_RUNNING:
                HOLDER["state"].put(buf, 0, hb)
                return


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
        stop_at = time.time() + 4.0
        ctx = mp.get_context("spawn")
        procs = [ctx.Process(target=_worker, args=(config, segment, stop_at)) for _ in range(WORKERS)]
        for p in procs:
            p.start()
        time.sleep(1.5)  # all running, the queue formed
        wrote = time.monotonic()
        _scribble(kind, seg.buf)
        last_over = None
        peak = 0
        while time.monotonic() - wrote < 2.0:
            n = _running(seg.buf)
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


def main() -> int:
    results = [measure(kind) for kind in KINDS]
    for r in results:
        print(f"{r['kind']:<38} over the limit for {r['over_limit_s']:.3f} s (peak {r['peak_running']})")
    print(json.dumps(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
