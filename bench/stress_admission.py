"""Reproduce the rare 'admission record was removed while waiting' (docs/benchmarks.md).

    .venv/bin/python bench/stress_admission.py [TRIALS] [PROCESSES] [SECONDS]

Each trial starts PROCESSES handler processes (default 8) that loop on empty
``slot_blocking`` slots against one provider with limit 4 for SECONDS (default 3),
on a fresh segment. A process that gets the AdmissionError dumps the holder record
of its ticket as it saw it, stops, and the trial is reported. With layout 1's Python
writers it hit about once in 20-60 trials on 2 cores (a lock-free read caught a field
half written by pack_into); the compiled core writes whole values. Kept as a
regression check (docs/benchmarks.md).
"""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

WORKER = r"""
import json, os, sys, time
sys.path.insert(0, {root!r})
from handler_shim import Admission, AdmissionError
from shm_layout import rows
from shm_layout.layout import HEADER, PROVIDER

adm = Admission.attach(config=sys.argv[1], segment=sys.argv[2], generation="stress")
end = time.monotonic() + float(sys.argv[3])
slots, seen = 0, []
while time.monotonic() < end and not seen:
    try:
        with adm.slot_blocking("p1"):
            pass
        slots += 1
    except AdmissionError as exc:
        seen.append({{
            "error": str(exc), "me": os.getpid(),
            "reclaimed": PROVIDER["reclaimed_total"].get(adm._buf, rows.provider_base(0)),
            "lock_repairs": HEADER["repairs"].get(adm._buf),
        }})
adm.close()
print(json.dumps({{"slots": slots, "seen": seen}}))
"""


def main() -> int:
    trials = int(sys.argv[1]) if len(sys.argv) > 1 else 20
    processes = int(sys.argv[2]) if len(sys.argv) > 2 else 8
    seconds = sys.argv[3] if len(sys.argv) > 3 else "3"
    sys.path.insert(0, ROOT)
    from shm_layout import unlink_segment

    with tempfile.TemporaryDirectory(prefix="gwstress-") as tmp:
        config = os.path.join(tmp, "gateway.json")
        with open(config, "w") as f:
            json.dump({"providers": [{"id": "p1", "maxConcurrent": 4}]}, f)
        found = 0
        for trial in range(trials):
            name = "/gws-" + secrets.token_hex(4)
            try:
                procs = [
                    subprocess.Popen(
                        [sys.executable, "-c", WORKER.format(root=ROOT), config, name, seconds],
                        stdout=subprocess.PIPE,
                        text=True,
                    )
                    for _ in range(processes)
                ]
                results = [json.loads(p.communicate()[0]) for p in procs]
            finally:
                unlink_segment(name)
            seen = [s for r in results for s in r["seen"]]
            found += bool(seen)
            print(f"trial {trial}: {sum(r['slots'] for r in results)} slots, {len(seen)} errors")
            for s in seen:
                print("   ", json.dumps(s))
    print(f"{found} of {trials} trials saw the error")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
