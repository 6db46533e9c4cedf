"""A handler process for cross-process tests, driven by arguments and stdin.

    python tests/agent.py --segment S [--config C] --gen G --provider P COMMAND

It prints one JSON object per line (flushed) for each event, with
``t`` = time.time(). Commands:

  hold [--timeout T] [--threads N]   take N slots (threads), report each, then
                                     release all on the stdin line "release",
                                     and exit on "exit" or end of input
  cycle N [--hold-ms MS]             N slot_blocking enter/exit rounds
  async-hold [--timeout T]           like hold with one slot, via ``async with slot``
  lock                               take the segment lock and never release it
  rawlock                            take the lock semaphore only (a death inside
                                     the window before the owner is written)
  scribble                           take the lock, corrupt the counters, hang
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from handler_shim import Admission, AdmissionTimeout, QueueFull

_print_lock = threading.Lock()


def emit(event: str, **fields: object) -> None:
    with _print_lock:
        print(
            json.dumps({"event": event, "pid": os.getpid(), "t": time.time(), **fields}), flush=True
        )


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--segment")
    ap.add_argument("--config")
    ap.add_argument("--gen", default="test")
    ap.add_argument("--provider", default="p1")
    ap.add_argument("command")
    ap.add_argument("count", nargs="?", type=int, default=1)
    ap.add_argument("--timeout", type=float, default=None)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--hold-ms", type=float, default=0.0)
    args = ap.parse_args()

    adm = Admission.attach(config=args.config, generation=args.gen, segment=args.segment)
    emit("attached", segment=adm.segment_name)

    if args.command in ("lock", "rawlock", "scribble"):
        seg = adm._seg  # the test wants a process that dies inside the lock
        if args.command == "rawlock":
            seg.lock._sem.acquire()
        else:
            seg.lock.acquire()
            if args.command == "scribble":
                from shm_layout.layout import P
                from shm_layout.ledger import provider_base

                P["running"].put(seg.buf, 17, provider_base(0))
                P["waiting"].put(seg.buf, 9, provider_base(0))
        emit("locked")
        time.sleep(3600)
        return 0

    if args.command == "cycle":
        for _ in range(args.count):
            with adm.slot_blocking(args.provider, timeout=args.timeout):
                if args.hold_ms:
                    time.sleep(args.hold_ms / 1000)
        emit("done")
        adm.close()
        return 0

    release = threading.Event()

    def one(i: int) -> None:
        try:
            with adm.slot_blocking(args.provider, timeout=args.timeout):
                emit("admitted", i=i)
                release.wait()
            emit("released", i=i)
        except QueueFull:
            emit("queue_full", i=i)
        except AdmissionTimeout:
            emit("timeout", i=i)

    if args.command == "hold":
        threads = [threading.Thread(target=one, args=(i,)) for i in range(args.threads)]
        for t in threads:
            t.start()
        emit("started", threads=args.threads)
    elif args.command == "async-hold":

        async def go() -> None:
            try:
                async with adm.slot(args.provider, timeout=args.timeout):
                    emit("admitted", i=0)
                    await asyncio.get_running_loop().run_in_executor(None, release.wait)
                emit("released", i=0)
            except QueueFull:
                emit("queue_full", i=0)
            except AdmissionTimeout:
                emit("timeout", i=0)

        threads = [threading.Thread(target=lambda: asyncio.run(go()))]
        threads[0].start()
        emit("started", threads=1)
    else:
        ap.error(f"unknown command {args.command}")

    for line in sys.stdin:
        word = line.strip()
        if word == "release":
            release.set()
        elif word == "exit":
            break
    release.set()
    for t in threads:
        t.join()
    adm.close()
    emit("closed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
