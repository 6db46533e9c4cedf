"""A handler process that keeps N requests going through admission to the fake farm.

    python load_worker.py --segment S --provider P --farm URL --threads N --hold-ms MS

Each thread loops: take a slot (``slot_blocking``), call ``GET {farm}/work``, release.
Prints ``ready``, then on ``exit`` (or end of input) stops and prints ``done <count>``.
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
import urllib.request

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from handler_shim import Admission, AdmissionTimeout, QueueFull


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--segment", required=True)
    ap.add_argument("--provider", default="p1")
    ap.add_argument("--farm", required=True)
    ap.add_argument("--threads", type=int, default=4)
    ap.add_argument("--hold-ms", type=float, default=30.0)
    args = ap.parse_args()
    adm = Admission.attach(segment=args.segment, generation="share-test")
    stop = threading.Event()
    done = [0] * args.threads
    url = f"{args.farm.removesuffix('/v1')}/work?ms={args.hold_ms:g}"

    def loop(i: int) -> None:
        while not stop.is_set():
            try:
                with adm.slot_blocking(args.provider, timeout=0.5):
                    with urllib.request.urlopen(url, timeout=30) as answer:
                        answer.read()
                    done[i] += 1
            except (AdmissionTimeout, QueueFull):
                stop.wait(0.01)

    threads = [threading.Thread(target=loop, args=(i,), daemon=True) for i in range(args.threads)]
    for t in threads:
        t.start()
    print("ready", flush=True)
    for line in sys.stdin:
        if line.strip() == "exit":
            break
    stop.set()
    for t in threads:
        t.join(30)
    adm.close()
    print(f"done {sum(done)}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
