"""Exceptions landing anywhere leave nothing behind (R-A12); a stalled lock never freezes an
event loop (R-A11)."""

from __future__ import annotations

import asyncio
import os
import random
import signal
import time
from collections.abc import Callable
from pathlib import Path

from gwtest import P1Segment, wait_until

from shm_layout.view import read_view

MakeP1Segment = Callable[..., P1Segment]


def _records_of(segment: str, pid: int) -> list[str]:
    return [h.state for h in read_view(segment).holders if h.pid == pid]


def test_r_a12_a_sigint_storm_leaves_no_record_in_a_process_that_goes_on(
    lock_kind: str, p1_segment: MakeP1Segment, tmp_path: Path
) -> None:
    """SIGINT every 0.2-5 ms, landing in every part of slot entry and exit, to a handler
    that catches KeyboardInterrupt and keeps serving: no record is left behind (a left
    one would hold a slot until the process exits); afterwards the process is alive,
    holds nothing, and all 3 slots can be had."""
    seg = p1_segment(3)
    segment_name = seg.name
    stop = tmp_path / "stop"
    target = seg.handler("interruptible", "--stop-file", str(stop))
    target.expect("serving")
    time.sleep(0.3)  # out of its own print() and into the serving loop
    rng = random.Random(7)
    sent = 0
    end = time.monotonic() + 6.0
    while time.monotonic() < end:
        os.kill(target.pid, signal.SIGINT)
        sent += 1
        time.sleep(rng.uniform(0.0002, 0.005))
    stop.touch()
    quiet = target.expect("quiet", timeout=20)
    assert quiet["interrupts"] > 100, quiet  # the storm really landed
    assert quiet["slots"] > 0
    assert target.proc.poll() is None  # it went on living
    assert wait_until(lambda: _records_of(segment_name, target.pid) == [], timeout=3), _records_of(
        segment_name, target.pid
    )
    adm = seg.attach("after")
    try:
        with (
            adm.slot_blocking("p1", timeout=2),
            adm.slot_blocking("p1", timeout=2),
            adm.slot_blocking("p1", timeout=2),
        ):
            pass  # 3 of 3 obtainable
    finally:
        adm.close()
    target.finish()


def test_r_a11_a_stopped_lock_holder_never_freezes_the_event_loop(
    lock_kind: str, p1_segment: MakeP1Segment
) -> None:
    """A lock holder SIGSTOPped for 3 s does not block another process's event loop:
    async slot() never waits for the lock on the loop."""
    seg = p1_segment(2)
    adm = seg.attach("async")
    holder = seg.locker()
    os.kill(holder.pid, signal.SIGSTOP)

    async def main() -> tuple[float, float]:
        loop = asyncio.get_running_loop()
        worst = 0.0
        admitted_at: list[float] = []

        async def take() -> None:
            async with adm.slot("p1", timeout=30):
                admitted_at.append(loop.time())

        task = asyncio.create_task(take())
        started = loop.time()
        last = started
        while loop.time() - started < 3.0:  # the holder stays stopped all this time
            await asyncio.sleep(0.01)
            now = loop.time()
            worst = max(worst, now - last)
            last = now
        assert not admitted_at
        holder.kill()  # the kernel frees the lock; the waiting thread gets in
        await asyncio.wait_for(task, 10)
        return worst, admitted_at[0] - started

    try:
        worst, admitted = asyncio.run(main())
    finally:
        adm.close()
    assert worst < 0.5, f"the event loop was blocked for {worst:.2f}s"
    assert admitted >= 3.0


def test_r_a12_close_while_other_threads_wait_for_the_lock_leaves_nothing(
    lock_kind: str, p1_segment: MakeP1Segment
) -> None:
    """A handler shutting down (close(), or the atexit hook) while its threads are still
    inside slot(), waiting for a lock another process holds: close() returns, the
    threads finish, and no record of this process is left."""
    import threading

    seg = p1_segment(4)
    adm = seg.attach("closing")
    holder = seg.locker()
    outcomes: list[str] = []

    def worker() -> None:
        try:
            with adm.slot_blocking("p1", timeout=5):
                time.sleep(0.2)
            outcomes.append("ok")
        except Exception as exc:  # recorded and asserted below
            outcomes.append(f"{type(exc).__name__}: {exc}")

    threads = [threading.Thread(target=worker) for _ in range(3)]
    for t in threads:
        t.start()
    time.sleep(0.3)  # all three are inside the core, waiting for the lock
    killer = threading.Timer(1.0, holder.kill)
    killer.start()
    adm.close()  # must not raise while they are inside
    for t in threads:
        t.join(10)
    killer.join()
    assert len(outcomes) == 3, outcomes
    assert wait_until(lambda: _records_of(seg.name, os.getpid()) == [], timeout=3)
