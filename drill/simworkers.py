"""Simulated llama.cpp workers for the drill: prints their URLs as one JSON line, runs until
SIGTERM.

    python drill/simworkers.py --count 2 --slots 10
"""

from __future__ import annotations

import argparse
import json
import signal
import threading

from capacity_router.simworker import SimWorker


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--count", type=int, default=2)
    ap.add_argument("--slots", type=int, default=10)
    args = ap.parse_args()
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    workers = [SimWorker(slots=args.slots) for _ in range(args.count)]
    for w in workers:
        w.start()
    print(json.dumps([w.url for w in workers]), flush=True)
    stop.wait()
    for w in workers:
        w.stop()


if __name__ == "__main__":
    main()
