"""Thin helpers over posix_ipc: creation modes and waits that never rely on timeouts.

macOS has no ``sem_timedwait``: posix_ipc there turns any timeout into an
infinite wait (``SEMAPHORE_TIMEOUT_SUPPORTED`` is False). Nothing in this
project may depend on timed waits (R-A10), so every timed wait goes through
:func:`timed_acquire`, which polls with a non-blocking try when timeouts are
unavailable. Setting ``GATEWAY_CAPACITY_NO_SEM_TIMEOUT=1`` forces that path
on Linux so that the tests run it too.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import posix_ipc

FORCE_NO_TIMEOUT_ENV = "GATEWAY_CAPACITY_NO_SEM_TIMEOUT"

# posix_ipc.PermissionsError is not a PermissionError: catch both wherever an object of
# another user may be met, and turn them into one line that says what to do.
DENIED = (PermissionError, posix_ipc.PermissionsError)

OWNER_ONLY = 0o600
GROUP_SHARED = 0o660

_umask_guard = threading.Lock()


def _fresh_guard_in_child() -> None:
    global _umask_guard
    _umask_guard = threading.Lock()  # a parent thread may have held it at fork


os.register_at_fork(after_in_child=_fresh_guard_in_child)


def timeouts_supported() -> bool:
    if os.environ.get(FORCE_NO_TIMEOUT_ENV, "") not in ("", "0"):
        return False
    return bool(posix_ipc.SEMAPHORE_TIMEOUT_SUPPORTED)


@contextmanager
def exact_mode(mode: int) -> Iterator[None]:
    """Create IPC objects with exactly ``mode`` whatever the process umask (R-G6).

    The umask is process-wide; it is changed only for the few microseconds of
    one ``sem_open``/``shm_open`` and only ever made stricter than 0o777-mode.
    """
    with _umask_guard:
        old = os.umask(0o777 & ~mode)
        try:
            yield
        finally:
            os.umask(old)


def open_semaphore(name: str, mode: int, initial_value: int) -> posix_ipc.Semaphore:
    """Open ``name``, creating it with ``mode`` and ``initial_value`` if it does not exist."""
    with exact_mode(mode):
        return posix_ipc.Semaphore(name, posix_ipc.O_CREAT, mode, initial_value)


# sem_wait is never restarted after a signal handler runs (signal(7)); posix_ipc then
# raises SignalError. Every wait here retries, so a handler's SIGUSR1/SIGHUP/SIGCHLD
# neither kills the dispatcher thread nor leaves a slot behind.


def try_acquire(sem: posix_ipc.Semaphore) -> bool:
    while True:
        try:
            sem.acquire(0)
        except posix_ipc.BusyError:
            return False
        except posix_ipc.SignalError:
            continue
        return True


def wait(sem: posix_ipc.Semaphore) -> None:
    """Block until ``sem`` is acquired; no timeout (portable, R-A10)."""
    while True:
        try:
            sem.acquire()
        except posix_ipc.SignalError:
            continue
        return


def timed_acquire(sem: posix_ipc.Semaphore, timeout: float, *, use_timeouts: bool) -> bool:
    """Acquire within ``timeout`` seconds; False when it could not."""
    if try_acquire(sem):
        return True
    deadline = time.monotonic() + timeout
    if use_timeouts:
        while True:
            try:
                sem.acquire(max(deadline - time.monotonic(), 0.0))
            except posix_ipc.BusyError:
                return False
            except posix_ipc.SignalError:
                if time.monotonic() >= deadline:
                    return try_acquire(sem)
                continue
            return True
    pause = 0.0001
    while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return False
        time.sleep(min(pause, remaining))
        if try_acquire(sem):
            return True
        pause = min(pause * 2, 0.002)


def drain(sem: posix_ipc.Semaphore) -> int:
    """Take every pending post; returns how many there were."""
    taken = 0
    while try_acquire(sem):
        taken += 1
    return taken


def unlink_semaphore(name: str) -> bool:
    try:
        posix_ipc.unlink_semaphore(name)
    except (posix_ipc.ExistentialError, *DENIED):
        return False
    return True
