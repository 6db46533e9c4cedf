"""Shared admission for every handler process and generation (REQUIREMENTS.md section 6).

One running budget and one bounded FIFO queue per provider live in the
segment. Every step that changes them (arrive, leave, grant, reap) is one call
into the compiled core (``shm_layout/_core.c``), which takes the segment lock,
does its few writes and lets the lock go with the GIL released: no thread of
this process ever holds the lock while it waits for the GIL (R-A11).
``shm_layout/ledger.py`` states the protocol and its invariants.

This module is the handler's side of it:

* a slot is a :class:`~shm_layout._core.Ticket`. The core fills it in *before*
  it lets the lock go, so an exception landing anywhere after the call still
  finds the record, and a ticket dropped while its record lives frees the
  record itself (R-A12);
* a request that must wait gets a WAITING record with a ticket, then waits on
  an in-process event. One *dispatcher* thread per process waits on this
  process's doorbell semaphore, which the granting process posts, and wakes
  the local waiters whose records changed;
* while this process waits or holds slots, a *ticker* posts the doorbell every
  ``TICK_S`` so the dispatcher also notices what nobody announces: a published
  limit that expired, or a holder that died (reaped twice a second, R-A5, so
  that even without a sidecar a dead process's places come back within 2 s).
  It uses ``time.sleep`` only: no semaphore timeouts anywhere (R-A10);
* a waiter that times out or is cancelled frees its record; if a grant raced
  with it, freeing the RUNNING record hands the slot on (R-A4);
* the async form never waits for the lock on the event loop: it tries the lock
  once (microseconds), and when the lock is busy or stalled it waits in a
  worker thread instead (R-A11).

Errors (all ``AdmissionError``, exported by ``handler_shim``)::

    AdmissionError
     +-- QueueFull          the provider's queue holds its bound already (R-A2)
     +-- AdmissionTimeout   no slot within the timeout (also a TimeoutError)
     +-- UnknownProvider    not in the segment (also a KeyError)
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import logging
import math
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TypeVar

from handler_shim import siblings
from shm_layout import _core, ipc, layout, ledger, writer
from shm_layout.errors import GatewayCapacityError
from shm_layout.layout import HOLDER_RUNNING, HOLDER_WAITING
from shm_layout.liveness import process_start
from shm_layout.names import resolve_segment_name
from shm_layout.segment import Segment

log = logging.getLogger("gateway_capacity.admission")

TICK_S = 0.25  # a waiting process looks around 4 times a second (R-A7 allows 10)
# and reaps dead holders twice a second: R-A5's 2 s must hold on a loaded host too (a
# chaos soak on 2 busy cores saw 2.7 s with a 1 s sweep while the sidecar was restarting)
SWEEP_S = 0.5

IN_CORE = 0.0  # "now" for a core step: the core reads the clock once it holds the lock
LOCK_TURN_S = 0.25  # longest wait for the lock in one off-loop turn of the async form
_fork_generation = 0


def _forked() -> None:
    global _fork_generation
    _fork_generation += 1


os.register_at_fork(after_in_child=_forked)


class AdmissionError(GatewayCapacityError):
    """Base of the errors of admitting a request (the segment's are :class:`SegmentError`)."""


class QueueFull(AdmissionError):
    """The provider's queue already holds its bound of waiters (R-A2)."""


class AdmissionTimeout(AdmissionError, TimeoutError):
    """No slot was granted within the timeout; nothing is left queued (R-A4)."""


class UnknownProvider(AdmissionError, KeyError):
    def __str__(self) -> str:
        return str(self.args[0])


@dataclass(eq=False)
class _Waiter:
    ticket: _core.Ticket
    event: threading.Event | None = None
    loop: asyncio.AbstractEventLoop | None = None
    future: asyncio.Future[None] | None = None
    done: bool = field(default=False)

    def wake(self) -> None:
        if self.event is not None:
            self.event.set()
        elif self.loop is not None and self.future is not None:
            # The loop may be gone (its asyncio.run() ended while we waited): the waiter's
            # own cleanup or close() frees the record, so there is no one left to tell.
            with contextlib.suppress(RuntimeError):
                self.loop.call_soon_threadsafe(_resolve, self.future)


def _resolve(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


@dataclass(frozen=True, slots=True)
class ProviderEntry:
    """What a shim that creates provider rows writes from its own reading of the config."""

    provider_id: str
    fallback: int
    fallback_source: str
    discovery: bool


def providers_from_config(path: str | os.PathLike[str]) -> list[ProviderEntry]:
    from sidecar.config import load_config  # config types and rules only: no httpx
    from sidecar.limits import fallback_for

    cfg = load_config(path)
    for skipped in cfg.skipped:
        log.warning("config %s: %s", cfg.source, skipped)
    out = []
    for provider in cfg.providers:
        limit, source = fallback_for(provider.max_concurrent, cfg.max_concurrent)
        out.append(ProviderEntry(provider.id, limit, source, provider.capacity_discovery))
    return out


_T = TypeVar("_T")


class Admission:
    """A handler process's attachment to the shared admission state."""

    def __init__(
        self, segment: Segment, generation: str, overflow: dict[str, str] | None = None
    ) -> None:
        self._seg = segment
        self._core = segment.core
        self._buf = segment.buf
        self._pid = os.getpid()
        self._fork_generation = _fork_generation
        self.generation = generation
        self._index: dict[str, int] = {}
        self._overflow = dict(overflow or {})  # provider id -> why it has no row
        self._waiters: dict[int, _Waiter] = {}
        self._guard = threading.Lock()  # protects _waiters and _closed
        self._closed = False
        self.wakeups = 0  # dispatcher wake-ups, for R-A7's "at most 10 a second"
        start = process_start(self._pid) or 0.0  # informational (inspect)
        member, _ = self._core.register(
            self._pid,
            start,
            layout.encode_text(generation, layout.ID_BYTES),
            layout.MAJOR,
            layout.MINOR,
            time.time(),
        )
        if member < 0:
            raise AdmissionError(
                f"segment {segment.name} already has {layout.MEMBER_COUNT} attached handler "
                "processes; stop some, or give this gateway its own segment"
            )
        self._member = member
        try:
            self._doorbell = segment.doorbell(member)
        except BaseException:
            self._core.unregister(IN_CORE)
            raise
        ipc.drain(self._doorbell)  # posts meant for an earlier owner of this member row
        self._threads = [
            threading.Thread(target=self._dispatch, name="gwcap-dispatch", daemon=True),
            threading.Thread(target=self._tick, name="gwcap-tick", daemon=True),
        ]
        for thread in self._threads:
            thread.start()
        atexit.register(self.close)

    @property
    def segment_name(self) -> str:
        return self._seg.name

    @classmethod
    def attach(
        cls,
        config: str | os.PathLike[str] | None = None,
        generation: str = "unknown",
        *,
        segment: str | None = None,
        group_shared: bool = False,
    ) -> Admission:
        """Attach to (or create) the segment for ``config`` (or ``segment``) and register.

        With ``config``, providers missing from the segment are added with their
        static fallback (R-A8, R-A9), so handlers work before any sidecar runs.
        A provider that does not fit the segment's table is named in a warning and
        raises on use; the others work (R-A13).
        """
        name = resolve_segment_name(segment, config)
        entries = providers_from_config(config) if config is not None else []
        seg = Segment.open(name, create=True, group_shared=group_shared)
        overflow: dict[str, str] = {}
        try:
            siblings.warn_if_split_budget(name, [e.provider_id for e in entries])
            for e in entries:
                try:
                    _, created = writer.ensure_provider(
                        seg, e.provider_id, e.fallback, e.fallback_source, e.discovery
                    )
                except writer.TableFull as exc:
                    overflow[e.provider_id] = str(exc)
                    continue
                if created and e.fallback > layout.RUNNING_ROOM:
                    log.warning(
                        "provider %s: maxConcurrent %d is above what the segment can hold; "
                        "admitting at most %d at once",
                        e.provider_id,
                        e.fallback,
                        layout.RUNNING_ROOM,
                    )
            if overflow:
                log.warning(
                    "segment %s holds at most %d providers; these have no budget and raise "
                    "on use: %s",
                    name,
                    layout.PROVIDER_COUNT,
                    ", ".join(sorted(overflow)),
                )
            return cls(seg, generation, overflow)
        except BaseException:
            seg.close()
            raise

    # --- the public API -----------------------------------------------------------------
    def slot_blocking(self, provider: str, timeout: float | None = None) -> _BlockingSlot:
        """Hold one running slot of ``provider`` for the body of the ``with``."""
        return _BlockingSlot(self, self._provider(provider), timeout)

    def slot(self, provider: str, timeout: float | None = None) -> _AsyncSlot:
        """``async with`` form of :meth:`slot_blocking`; never blocks the event loop on a wait."""
        return _AsyncSlot(self, self._provider(provider), timeout)

    async def acquire(self, provider: str, timeout: float | None = None) -> Ticket:
        """Take one running slot of ``provider`` and return its :class:`Ticket`, for code
        that takes and gives back the slot in different callbacks (a LiteLLM hook, say).
        The same waiting and errors as :meth:`slot`; give it back with :meth:`release`."""
        slot = self.slot(provider, timeout)
        await slot.__aenter__()
        return Ticket(provider, slot)

    def try_acquire(self, provider: str) -> Ticket | None:
        """A slot of ``provider`` only if one is free at once: one try-lock step, never
        queued, never waiting, safe on an event loop. None when the request would have to
        wait (or the lock is busy): then call :meth:`acquire`, which queues it. Raises
        ``QueueFull`` as :meth:`acquire` does. Give the ticket back with :meth:`release`."""
        slot = self.slot(provider)
        code = self._core.arrive(slot._ticket, slot._p, self._pid, IN_CORE, False, False, -1.0)
        if code == _core.ADMIT:
            return Ticket(provider, slot)
        if code == _core.FULL:
            raise self._queue_full(slot._p)
        return None  # would wait (nothing recorded), or the lock is busy

    def acquire_blocking(self, provider: str, timeout: float | None = None) -> Ticket:
        """The blocking form of :meth:`acquire`."""
        slot = self.slot_blocking(provider, timeout)
        slot.__enter__()
        return Ticket(provider, slot)

    def release(self, ticket: Ticket) -> None:
        """Give back ``ticket``'s slot. Idempotent; callable from any task or thread;
        a no-op after :meth:`close` (which released it). Never blocks an event loop:
        when the segment lock is busy, the release finishes in a thread of its own."""
        if not isinstance(ticket, Ticket):
            raise TypeError(f"release() takes a Ticket from acquire(), not {type(ticket).__name__}")
        slot = ticket._take()
        if slot is None or self._closed or slot._adm is not self:
            return
        core_ticket = slot._ticket
        if self._core.leave(core_ticket, _core.RELEASED, IN_CORE, False) == -1:
            threading.Thread(
                target=self._leave,
                args=(core_ticket, _core.RELEASED, True),
                name="gwcap-release",
                daemon=True,
            ).start()

    def retry_after(self, provider: str) -> int:
        """Seconds a refused client should wait before trying again: the provider's mean
        slot hold time x the queue ahead / the limit, clamped to [1, 60] (1 while no slot
        has been held yet). Lock-free; never raises for a known provider."""
        p = self._provider(provider)
        base = ledger.provider_base(p)
        mean = float(layout.PROVIDER["hold_mean_s"].get(self._buf, base))
        waiting = int(layout.PROVIDER["waiting"].get(self._buf, base))
        limit = ledger.limit_value(self._buf, p, time.time())
        return retry_after_seconds(mean, waiting, limit)

    def close(self) -> None:
        """Deregister; slots still held by this Admission are released."""
        if self._fork_generation != _fork_generation:
            # A forked child inherited this object (and its atexit hook): the records
            # and the member row are the parent's, not ours to free.
            self._closed = True
            return
        with self._guard:
            if self._closed:
                return
            self._closed = True
            waiters = list(self._waiters.values())
            self._waiters.clear()
        atexit.unregister(self.close)
        for w in waiters:
            w.wake()  # they find the record gone and raise
        self._doorbell.release()  # let the dispatcher see _closed
        for thread in self._threads:
            if thread is not threading.current_thread():
                # the semaphores must outlive every thread that may touch them
                thread.join()
        self._core.unregister(IN_CORE)  # frees every record of ours, grants, rings
        self._seg.close()

    def __enter__(self) -> Admission:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- arrival --------------------------------------------------------------------------
    def _provider(self, provider_id: str) -> int:
        if self._closed:
            raise AdmissionError("this Admission is closed")
        if self._fork_generation != _fork_generation:
            raise AdmissionError(
                f"Admission was attached in pid {self._pid}; call Admission.attach again in "
                "the forked child"
            )
        p = self._index.get(provider_id)
        if p is None:
            p = ledger.find_provider(self._buf, provider_id)
            if p is None:
                raise UnknownProvider(self._unknown_reason(provider_id))
            self._index[provider_id] = p
        return p

    def _unknown_reason(self, provider_id: str) -> str:
        if provider_id in self._overflow:
            return f"provider {provider_id!r} has no budget: {self._overflow[provider_id]}"
        try:
            ledger.encode_provider_id(provider_id)
        except ledger.ProviderIdError as exc:
            return str(exc)
        return (
            f"provider {provider_id!r} is not in segment {self._seg.name}: is it in the gateway "
            "config the sidecar (or the first handler) read?"
        )

    def _provider_name(self, p: int) -> str:
        for name, index in self._index.items():
            if index == p:
                return name
        return str(p)

    def _queue_full(self, p: int) -> QueueFull:
        return QueueFull(
            f"provider {self._provider_name(p)}: {layout.QUEUE_BOUND} requests are already waiting"
        )

    def _arrive_code(self, ticket: _core.Ticket, p: int, blocking: bool, timeout: float) -> int:
        code: int = self._core.arrive(ticket, p, self._pid, IN_CORE, True, blocking, timeout)
        return code

    def _state(self, ticket: _core.Ticket) -> int:
        state: int = self._core.state(ticket)
        return state

    def _leave(self, ticket: _core.Ticket, outcome: int, blocking: bool = True) -> int:
        """Free the ticket's record. -1 when the lock was busy (non-blocking only)."""
        if self._closed:
            return 0  # close() released it already
        was: int = self._core.leave(ticket, outcome, IN_CORE, blocking)
        return was

    # --- waiting, blocking form -------------------------------------------------------
    def _wait_blocking(self, ticket: _core.Ticket, deadline: float | None) -> None:
        waiter = _Waiter(ticket, event=threading.Event())
        self._add_waiter(waiter)
        assert waiter.event is not None
        try:
            while True:
                remaining = None if deadline is None else max(deadline - time.monotonic(), 0.0)
                if not waiter.event.wait(remaining):
                    self._forget(waiter)
                    self._leave(ticket, _core.TIMEOUT)  # a grant that raced is handed on
                    raise AdmissionTimeout("no slot was granted within the timeout")
                waiter.event.clear()  # before looking: a grant after the look sets it again
                if self._settled(waiter):
                    return
        finally:
            self._forget(waiter)

    def _settled(self, waiter: _Waiter) -> bool:
        """After a wake-up: True when granted, False when still waiting."""
        if self._closed:
            raise AdmissionError("this Admission was closed while waiting")
        state = self._state(waiter.ticket)
        if state == HOLDER_RUNNING:
            return True
        if state == HOLDER_WAITING:
            return False
        raise AdmissionError("the admission record was removed while waiting")

    # --- waiting: dispatcher and ticker threads ---------------------------------------
    def _add_waiter(self, waiter: _Waiter) -> None:
        with self._guard:
            if self._closed:
                raise AdmissionError("this Admission is closed")
            self._waiters[id(waiter)] = waiter
        # The grant may have happened between arrive() and now: look once more.
        self._doorbell.release()

    def _forget(self, waiter: _Waiter) -> None:
        with self._guard:
            self._waiters.pop(id(waiter), None)

    def _tick(self) -> None:
        while not self._closed:
            time.sleep(TICK_S)
            if (self._waiters or self._core.held) and not self._closed:
                self._doorbell.release()

    def _dispatch(self) -> None:
        last_sweep = 0.0
        while True:
            ipc.wait(self._doorbell)  # blocks without a timeout: portable (R-A10)
            ipc.drain(self._doorbell)
            if self._closed:
                return
            self.wakeups += 1
            with self._guard:
                waiters = list(self._waiters.values())
            try:
                for w in waiters:
                    if self._state(w.ticket) != HOLDER_WAITING:
                        w.wake()
                now = time.monotonic()
                if (waiters or self._core.held) and now - last_sweep >= SWEEP_S:
                    last_sweep = now
                    # Reclaim dead holders and apply limit changes nobody announced
                    # (R-A5, R-L7): one locked step in the core.
                    reclaimed = self._core.reap(IN_CORE)
                    if reclaimed > 0:
                        log.warning("reclaimed %d slot(s) of dead processes", reclaimed)
                repaired = self._core.take_repaired()
                if repaired:
                    log.warning(
                        "a process died holding the segment lock; counters were repaired from "
                        "the holder records"
                    )
            except _core.CoreError:
                if self._closed:
                    return
                log.exception("admission dispatcher: unexpected error; continuing")
            except Exception:  # this thread must outlive any one bad turn
                log.exception("admission dispatcher: unexpected error; continuing")

    # --- off the event loop -----------------------------------------------------------
    async def _off_loop(self, fn: Callable[..., _T], *args: object) -> _T:
        """Run a core call that may wait for the lock in a worker thread (R-A11).

        If the awaiting task is cancelled, the call still completes in its thread;
        the caller's cleanup sees its result on the ticket.
        """
        loop = asyncio.get_running_loop()
        future = loop.run_in_executor(None, fn, *args)
        try:
            return await asyncio.shield(future)
        except BaseException:
            # Let the thread finish what it started before anyone looks at the ticket.
            await _finish_quietly(future)
            raise


async def _finish_quietly(future: asyncio.Future[_T]) -> None:
    while not future.done():
        with contextlib.suppress(BaseException):
            await asyncio.shield(future)


def retry_after_seconds(mean_hold_s: float, queue_ahead: int, limit: int) -> int:
    """Mean hold x (queue ahead + this request) / limit, clamped to [1, 60] seconds."""
    if not 0.0 < mean_hold_s <= 86400.0:
        return 1
    estimate = mean_hold_s * (max(queue_ahead, 0) + 1) / max(limit, 1)
    return int(min(max(math.ceil(estimate), 1), 60))


class Ticket:
    """One slot taken with :meth:`Admission.acquire`; give it back with
    :meth:`Admission.release` (once; later calls do nothing). A ticket dropped without a
    release frees its slot when it is garbage collected (R-A12), but release it."""

    __slots__ = ("_guard", "_slot", "provider")

    def __init__(self, provider: str, slot: _Slot) -> None:
        self.provider = provider
        self._slot: _Slot | None = slot
        self._guard = threading.Lock()

    @property
    def released(self) -> bool:
        return self._slot is None

    def _take(self) -> _Slot | None:
        with self._guard:
            slot, self._slot = self._slot, None
            return slot

    def __repr__(self) -> str:
        state = "released" if self._slot is None else "held"
        return f"<Ticket provider={self.provider!r} {state}>"


class _Slot:
    """One slot of one provider: the ticket the core fills in, and how long to wait."""

    __slots__ = ("_adm", "_p", "_ticket", "_timeout")

    def __init__(self, adm: Admission, p: int, timeout: float | None) -> None:
        self._adm = adm
        self._p = p
        self._timeout = timeout
        self._ticket = _core.Ticket()


class _BlockingSlot(_Slot):
    """``with adm.slot_blocking(provider, timeout):`` one running slot for the body."""

    __slots__ = ()

    def __enter__(self) -> None:
        adm, ticket, timeout = self._adm, self._ticket, self._timeout
        try:
            if timeout is None:
                deadline = None
                code = adm._core.arrive(ticket, self._p, adm._pid, IN_CORE, True, True, -1.0)
            else:
                deadline = time.monotonic() + timeout
                code = adm._arrive_code(ticket, self._p, True, max(timeout, 0.0))
            if code == _core.ADMIT:
                return
            if code == _core.FULL:
                raise adm._queue_full(self._p)
            if code == _core.BUSY:  # the lock stayed busy for the whole timeout
                raise AdmissionTimeout("the segment lock stayed busy for the whole timeout")
            adm._wait_blocking(ticket, deadline)
        except BaseException:
            # Whatever landed (a timeout, a KeyboardInterrupt, an exception from a signal
            # handler): leave nothing behind (R-A12). Should this line itself be skipped,
            # the ticket frees its record when it is dropped.
            adm._leave(ticket, _core.CANCELLED)
            raise

    def __exit__(self, *exc_info: object) -> None:
        adm = self._adm
        if not adm._closed:  # else close() released it already
            adm._core.leave(self._ticket, _core.RELEASED, IN_CORE, True)


class _AsyncSlot(_Slot):
    """``async with adm.slot(provider, timeout):`` the same, without blocking the loop."""

    __slots__ = ()

    async def __aenter__(self) -> None:
        adm, ticket = self._adm, self._ticket
        try:
            # The fast path: one try-lock step on the loop (microseconds, R-A11).
            code = adm._core.arrive(ticket, self._p, adm._pid, IN_CORE, True, False, -1.0)
            if code == _core.ADMIT:
                return
            async with asyncio.timeout(self._timeout):
                await self._acquire(code)
        except TimeoutError:
            await self._leave(_core.TIMEOUT)
            raise AdmissionTimeout("no slot was granted within the timeout") from None
        except BaseException:  # CancelledError, QueueFull and friends (R-A4, R-A12)
            await self._leave(_core.CANCELLED)
            raise

    async def _acquire(self, code: int) -> None:
        adm, ticket, p = self._adm, self._ticket, self._p
        # The lock is busy or stalled: wait for it off the loop, in bounded turns, so that
        # the timeout or a cancellation lands within one turn even while the holder is
        # stopped (the thread of a turn cannot be interrupted, only waited for: R-A4).
        while code == _core.BUSY:
            code = await adm._off_loop(adm._arrive_code, ticket, p, True, LOCK_TURN_S)
        if code == _core.ADMIT:
            return
        if code == _core.FULL:
            raise adm._queue_full(p)
        loop = asyncio.get_running_loop()
        waiter = _Waiter(ticket, loop=loop, future=loop.create_future())
        adm._add_waiter(waiter)
        try:
            while True:
                assert waiter.future is not None
                await waiter.future
                waiter.future = loop.create_future()  # before looking, as above
                if adm._settled(waiter):
                    return
        finally:
            adm._forget(waiter)

    async def _leave(self, outcome: int) -> None:
        adm, ticket = self._adm, self._ticket
        if adm._leave(ticket, outcome, blocking=False) == -1:  # the lock is busy: not here
            await adm._off_loop(adm._leave, ticket, outcome, True)

    async def __aexit__(self, *exc_info: object) -> None:
        adm = self._adm
        if adm._closed:
            return  # close() released it already
        if adm._core.leave(self._ticket, _core.RELEASED, IN_CORE, False) == -1:
            await adm._off_loop(adm._leave, self._ticket, _core.RELEASED, True)
