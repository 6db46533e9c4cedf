"""The limit in force is judged at the moment of the section, not when the request
started waiting for the lock (R-A1, R-L7).

The core reads the clock itself once it holds the segment lock. A time read by the
caller before it waited for the lock would be stale behind a lock holder stopped for
longer than a publication's remaining life: every waiting request would be admitted
against the expired publication, three running against a fallback of one.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable

from gwtest import P1Segment, wait_until

from shm_layout import writer
from shm_layout.view import read_view


def test_r_a1_an_expired_publication_is_not_applied_after_a_stalled_lock(
    lock_kind: str, p1_segment: Callable[..., P1Segment]
) -> None:
    p1_only = p1_segment(1)
    adm = p1_only.attach("stale")
    seg = adm._seg
    epoch = writer.take_epoch(seg, os.getpid(), 0.0, time.time(), 1.0, "test")
    now = time.time()
    expires = now + 1.5
    publication = writer.Publication(
        "p1",
        True,
        1,
        "provider",
        limit=3,
        reason="test",
        observed_at=now - 28.5,
        expires_at=expires,
    )
    writer.publish(seg, epoch, 1, "ok", [publication], now)
    holder = p1_only.locker()
    os.kill(holder.pid, signal.SIGSTOP)
    release = threading.Event()
    admitted: list[float] = []

    def one() -> None:
        with adm.slot_blocking("p1", timeout=20):
            admitted.append(time.time())
            release.wait(20)

    threads = [threading.Thread(target=one) for _ in range(3)]
    try:
        for t in threads:
            t.start()  # each reads the clock, then waits for the stalled lock
        assert wait_until(lambda: time.time() > expires + 0.5, 10)
        holder.kill()  # the kernel frees the lock: the fallback of 1 is in force now
        assert wait_until(lambda: len(admitted) >= 1, 10)
        time.sleep(0.5)  # room for a wrong second admission to happen
        p1 = read_view(p1_only.name).provider("p1")
        assert p1 is not None
        assert p1.effective_limit == 1
        assert (len(admitted), p1.running) == (1, 1), admitted
    finally:
        release.set()
        for t in threads:
            t.join()
        adm.close()
