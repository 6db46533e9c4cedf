"""Handler load for the demo: one process of one generation, many concurrent requests.

    python -m gateway_capacity.demo_load --config C --generation G --provider P
        --clients N --stop-file F --parent-pid PID

Each client loops: ``async with adm.slot(provider, cls=...)``, a simulated upstream
call of 0.5-2 s (``--body``), release; with ``--cls`` it also reports how long its
requests waited for admission. It stops taking new slots once ``--stop-file`` exists
(or its parent is gone), lets running ones finish, and prints one JSON line of
totals.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import time

from gateway_capacity.exits import EXIT_OK
from handler_shim import Admission, AdmissionTimeout, QueueFull


async def _load(adm: Admission, args: argparse.Namespace) -> dict[str, int]:
    totals = {"admitted": 0, "queue_full": 0, "timeouts": 0}
    rng = random.Random(args.seed)
    waits: list[float] = []  # seconds from asking to admission

    def stopping() -> bool:
        return os.path.exists(args.stop_file) or os.getppid() != args.parent_pid

    async def client() -> None:
        await asyncio.sleep(rng.uniform(0, 0.5))  # do not arrive in one burst
        while not stopping():
            asked = time.monotonic()
            try:
                async with adm.slot(args.provider, timeout=30.0, cls=args.cls):
                    waits.append(time.monotonic() - asked)
                    totals["admitted"] += 1
                    await asyncio.sleep(rng.uniform(*args.body))  # the upstream call
            except QueueFull:
                totals["queue_full"] += 1
                await asyncio.sleep(0.2)
            except AdmissionTimeout:
                totals["timeouts"] += 1

    await asyncio.gather(*(client() for _ in range(args.clients)))
    if args.cls is not None and waits:
        totals["wait_max_ms"] = round(max(waits) * 1000)
        totals["wait_p50_ms"] = round(sorted(waits)[len(waits) // 2] * 1000)
    return totals


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", required=True)
    ap.add_argument("--segment")
    ap.add_argument("--generation", required=True)
    ap.add_argument("--provider", required=True)
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--stop-file", required=True)
    ap.add_argument("--parent-pid", type=int, required=True)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--cls", default=None, help="the admission class of every request")
    ap.add_argument("--body", type=float, nargs=2, default=(0.5, 2.0), metavar=("MIN", "MAX"))
    args = ap.parse_args()
    adm = Admission.attach(config=args.config, generation=args.generation, segment=args.segment)
    try:
        totals = asyncio.run(_load(adm, args))
    finally:
        adm.close()
    print(json.dumps({"generation": args.generation, **totals}), flush=True)
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
