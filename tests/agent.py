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
  scribble                           take the lock, corrupt the counters, hang
  interruptible --stop-file F        loop on slot_blocking, catching every
                                     KeyboardInterrupt, until the file F exists;
                                     then report and stay alive until stdin ends
  serve --stop-file F [--mark-file M] [--hold-ms MS]
                                     loop on slot_blocking until F exists, each
                                     refusal reported once per reason; then report
                                     the slots taken, and those taken once M existed

  --group-shared attaches in group-shared mode (the segment mode 0660).
  --cls NAME asks for that admission class in every slot (docs/classes.md).
  --tokens N charges every slot N tokens (docs/DESIGN.md section 6c).
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

from handler_shim import Admission, AdmissionError, AdmissionTimeout, QueueFull, RequestTooLarge

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
    ap.add_argument("--stop-file", default="")
    ap.add_argument("--mark-file", default="")
    ap.add_argument("--group-shared", action="store_true")
    ap.add_argument("--cls", default=None, help="the admission class of every slot")
    ap.add_argument("--tokens", type=int, default=0, help="the tokens every slot is charged")
    args = ap.parse_args()

    adm = Admission.attach(
        config=args.config,
        generation=args.gen,
        segment=args.segment,
        group_shared=args.group_shared,
    )
    emit("attached", segment=adm.segment_name)

    if args.command in ("lock", "scribble"):
        # the test wants a process that stops or dies inside the lock, as if frozen in
        # the middle of a section (scribble: after writing counters that are wrong)
        from gwtest import core_hooks

        core_hooks(adm._core).hold_lock(args.command == "scribble")
        emit("locked")
        time.sleep(3600)
        return 0

    if args.command == "interruptible":
        return interruptible(adm, args.provider, args.stop_file)

    if args.command == "serve":
        return serve(adm, args.provider, args.stop_file, args.mark_file, args.hold_ms)

    if args.command == "cycle":
        for _ in range(args.count):
            with adm.slot_blocking(args.provider, timeout=args.timeout, cls=args.cls):
                if args.hold_ms:
                    time.sleep(args.hold_ms / 1000)
        emit("done")
        adm.close()
        return 0

    release = threading.Event()

    def one(i: int) -> None:
        try:
            with adm.slot_blocking(
                args.provider, timeout=args.timeout, cls=args.cls, tokens=args.tokens
            ):
                emit("admitted", i=i)
                release.wait()
            emit("released", i=i)
        except QueueFull:
            emit("queue_full", i=i)
        except RequestTooLarge as exc:
            emit("too_large", i=i, tokens=exc.tokens, limit=exc.request_token_limit)
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
                async with adm.slot(args.provider, timeout=args.timeout, cls=args.cls):
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


def interruptible(adm: Admission, provider: str, stop_file: str) -> int:
    """R-A12: a handler that catches KeyboardInterrupt and goes on serving.

    The handlers nest three deep so that an interrupt landing between them (at a loop's
    back edge, where Python looks for signals) is caught one level up: the point is
    what happens inside the slot calls, not in this loop."""
    import signal

    # SIGINT as a fresh interpreter has it, whatever this process inherited: a blocked
    # mask or an ignored disposition survives fork and exec (a thread of the test
    # process that blocks SIGINT, say), and would make the storm land nowhere
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    signal.signal(signal.SIGINT, signal.default_int_handler)
    emit("sigint", mask_blocked=signal.SIGINT in signal.pthread_sigmask(signal.SIG_BLOCK, []))
    counts = {"interrupts": 0, "slots": 0}

    def serve() -> None:
        while not os.path.exists(stop_file):
            try:
                with adm.slot_blocking(provider, timeout=5.0):
                    counts["slots"] += 1
            except AdmissionTimeout:
                emit("timeout")

    def level(depth: int) -> None:
        while not os.path.exists(stop_file):
            try:
                if depth == 0:
                    serve()
                else:
                    level(depth - 1)
            except KeyboardInterrupt:
                counts["interrupts"] += 1

    emit("serving")
    while not os.path.exists(stop_file):
        try:
            level(2)
        except KeyboardInterrupt:
            counts["interrupts"] += 1
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    emit("quiet", **counts)
    for _ in sys.stdin:
        pass
    adm.close()
    return 0


def serve(adm: Admission, provider: str, stop_file: str, mark_file: str, hold_ms: float) -> int:
    """A handler that goes on serving short slots whatever the segment does."""
    counts = {"slots": 0, "slots_after_mark": 0, "refused": 0}
    reasons: list[str] = []
    emit("serving")
    while not os.path.exists(stop_file):
        # a slot after the mark is one that arrived after it (a slot that was let go
        # just before the mark, and counted just after it, touched nothing since)
        marked = bool(mark_file) and os.path.exists(mark_file)
        try:
            with adm.slot_blocking(provider, timeout=5.0):
                time.sleep(hold_ms / 1000)
            counts["slots"] += 1
            if marked:
                counts["slots_after_mark"] += 1
                if counts["slots_after_mark"] == 1:
                    emit("after_mark")
        except AdmissionError as exc:
            counts["refused"] += 1
            if str(exc) not in reasons:
                reasons.append(str(exc))
                emit("refused", reason=str(exc))
            time.sleep(0.01)
    emit("quiet", reasons=reasons, **counts)
    adm.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
