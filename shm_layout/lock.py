"""The segment lock: a named semaphore whose holder is written into the header (R-A6).

Invariant: while ``lock_owner_pid`` is non-zero, that process (identified by
pid and start time) holds the lock. The holder writes its identity right
after taking the semaphore and clears it right before posting it, so a
non-zero owner that is dead can only mean it died holding the lock.

A waiter that cannot take the lock watches the owner. When the owner is
dead (recovered within about 0.1 s), or the owner field stays empty for
``EMPTY_OWNER_STUCK_S`` with no acquisition in between (a death inside the
few-statement windows between the semaphore call and the owner fields), it
recovers: under the small recovery semaphore it
checks that nothing changed, clears the owner, flags ``repair_needed`` and
posts the semaphore on the dead holder's behalf. The next holder repairs
the counters from the holder records (the records are the truth).

Unlike nginx's ``ngx_shmtx_force_unlock``, which frees the lock but leaves
the data it guarded as the dead worker left it, every recovery here is
followed by a repair.

``change_seq`` is a sequence counter for lock-free readers: odd while a
holder may be writing, even otherwise. A reader that sees it change, or odd,
retries.
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import time
from collections.abc import Callable
from types import TracebackType

import posix_ipc

from shm_layout import ipc, names
from shm_layout.layout import H
from shm_layout.liveness import is_alive, my_identity

log = logging.getLogger("gateway_capacity.lock")

SLICE_S = 0.05  # how often a blocked waiter looks at the owner
# An empty owner is ambiguous: a holder that died right after sem_wait, or a live one
# descheduled between sem_wait and writing its owner (or between clearing it and
# sem_post). Robbing the live one would let two processes in, so wait long enough that
# no runnable process can still be inside that window. R-A6's 1 s is met for the case
# that matters, a holder that died with its owner recorded.
EMPTY_OWNER_STUCK_S = 5.0


class SegmentLock:
    def __init__(
        self,
        segment: str,
        buf: mmap.mmap,
        mode: int,
        on_repair: Callable[[], None],
    ) -> None:
        self._buf = buf
        self._sem = ipc.open_semaphore(names.lock_name(segment), mode, 1)
        self._recovery = ipc.open_semaphore(names.recovery_name(segment), mode, 1)
        self._on_repair = on_repair
        self._use_timeouts = ipc.timeouts_supported()
        self._pid, self._start = my_identity()

    # --- public -----------------------------------------------------------------------
    def acquire(self) -> None:
        if not ipc.try_acquire(self._sem):
            self._wait()
        buf = self._buf
        try:
            H["lock_owner_start"].put(buf, self._start)  # start before pid: module docstring
            H["lock_owner_pid"].put(buf, self._pid)
            H["lock_seq"].put(buf, H["lock_seq"].get(buf) + 1)
            seq = H["change_seq"].get(buf)
            H["change_seq"].put(buf, seq + 1 if seq % 2 == 0 else seq + 2)
            if H["repair_needed"].get(buf):
                log.warning(
                    "repairing counters from the holder records (a lock holder died or was "
                    "interrupted mid-update)"
                )
                self._on_repair()
                H["repair_needed"].put(buf, 0)
        except BaseException:  # e.g. KeyboardInterrupt: never leave the lock held by us
            H["repair_needed"].put(buf, 1)
            self.release()
            raise

    def release(self) -> None:
        buf = self._buf
        H["change_seq"].put(buf, H["change_seq"].get(buf) + 1)
        H["lock_owner_pid"].put(buf, 0)
        H["lock_owner_start"].put(buf, 0.0)
        self._sem.release()

    def __enter__(self) -> SegmentLock:
        self.acquire()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if exc_type is not None:
            # An exception (a KeyboardInterrupt, a SystemExit from a signal handler) may
            # have stopped a write half way: the next holder recounts from the records.
            H["repair_needed"].put(self._buf, 1)
        self.release()

    def close(self) -> None:
        for sem in (self._sem, self._recovery):
            with contextlib.suppress(posix_ipc.ExistentialError):
                sem.close()

    # --- slow path --------------------------------------------------------------------
    def _owner(self) -> tuple[int, float, int]:
        buf = self._buf
        return (
            H["lock_owner_pid"].get(buf),
            H["lock_owner_start"].get(buf),
            H["lock_seq"].get(buf),
        )

    def _wait(self) -> None:
        observed = self._owner()
        since = time.monotonic()
        while True:
            if ipc.timed_acquire(self._sem, SLICE_S, use_timeouts=self._use_timeouts):
                return
            current = self._owner()
            now = time.monotonic()
            if current != observed:
                observed, since = current, now
                continue
            pid, start, _ = current
            if pid == 0:
                stuck = now - since >= EMPTY_OWNER_STUCK_S
            else:
                stuck = not is_alive(pid, start)
            if stuck:
                self._recover(observed)
                observed, since = self._owner(), time.monotonic()

    def _recover(self, observed: tuple[int, float, int]) -> None:
        self._take_recovery()
        try:
            if self._owner() != observed:
                return  # someone else recovered it, or it moved on
            pid = observed[0]
            log.warning(
                "segment lock holder %s is gone; recovering the lock",
                f"pid {pid}" if pid else "(unrecorded)",
            )
            buf = self._buf
            H["lock_owner_pid"].put(buf, 0)
            H["lock_owner_start"].put(buf, 0.0)
            H["lock_seq"].put(buf, observed[2] + 1)
            H["repair_needed"].put(buf, 1)
            H["repairs"].put(buf, H["repairs"].get(buf) + 1)
            self._sem.release()
        finally:
            H["recovery_owner_pid"].put(self._buf, 0)
            self._recovery.release()

    def _recovery_owner(self) -> tuple[int, float]:
        return H["recovery_owner_pid"].get(self._buf), H["recovery_owner_start"].get(self._buf)

    def _take_recovery(self) -> None:
        # The same rules as for the lock itself: a recorded holder that is dead is taken
        # over at once; an unrecorded one only after EMPTY_OWNER_STUCK_S, since a live
        # process may be descheduled between taking .R and writing its name.
        observed = self._recovery_owner()
        since = time.monotonic()
        while not ipc.timed_acquire(self._recovery, SLICE_S, use_timeouts=self._use_timeouts):
            current = self._recovery_owner()
            if current != observed:
                observed, since = current, time.monotonic()
                continue
            pid, start = current
            if (pid != 0 and not is_alive(pid, start)) or (
                pid == 0 and time.monotonic() - since >= EMPTY_OWNER_STUCK_S
            ):
                break  # take it over: the dead holder's post will never come
        H["recovery_owner_start"].put(self._buf, self._start)
        H["recovery_owner_pid"].put(self._buf, self._pid)
