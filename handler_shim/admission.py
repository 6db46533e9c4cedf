"""Shared admission for every handler process and generation (SPEC section 6).

One running budget and one bounded FIFO queue per provider live in the
segment (``shm_layout.ledger`` holds the protocol and its invariants). This
module is the handler's side of it:

* the fast path takes the segment lock for a few microseconds, admits, and
  returns; nothing else runs;
* a request that must wait gets a holder record with a ticket, then waits on
  an in-process event. One *dispatcher* thread per process waits on this
  process's doorbell semaphore, which the granting process posts, and wakes
  the local waiters whose records became RUNNING;
* while this process waits or holds slots, a *ticker* posts the doorbell
  every ``TICK_S`` so the dispatcher also notices what nobody announces: a
  published limit that expired, or a holder or waiter that died (swept once a
  second, R-A5). The ticker uses ``time.sleep`` only: no semaphore timeouts
  anywhere (R-A10);
* a waiter that times out or is cancelled frees its record under the lock;
  if a grant raced with it, freeing the RUNNING record hands the slot on
  (R-A4).
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import logging
import os
import threading
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass, field

from handler_shim import siblings
from shm_layout import ipc, ledger
from shm_layout.layout import HOLDER_RUNNING, HOLDER_WAITING, RUNNING_ROOM
from shm_layout.ledger import Ticket
from shm_layout.liveness import LivenessCache, my_identity
from shm_layout.names import resolve_segment_name
from shm_layout.segment import Segment

log = logging.getLogger("gateway_capacity.admission")

TICK_S = 0.25  # a waiting process looks around 4 times a second (R-A7 allows 10)
SWEEP_S = 1.0  # and checks holders' liveness once a second (R-A5: reclaim within 2 s)


class AdmissionError(Exception):
    """Base of the admission errors."""


class QueueFull(AdmissionError):
    """The provider's queue already holds its bound of waiters (R-A2)."""


class AdmissionTimeout(AdmissionError, TimeoutError):
    """No slot was granted within the timeout; nothing is left queued (R-A4)."""


class UnknownProvider(AdmissionError, KeyError):
    def __str__(self) -> str:
        return str(self.args[0])


@dataclass(eq=False)
class _Waiter:
    ticket: Ticket
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
    from sidecar.config import fallback_limit, load_config  # config only: no httpx

    cfg = load_config(path)
    out = []
    for provider in cfg.providers:
        limit, source = fallback_limit(provider, cfg)
        out.append(ProviderEntry(provider.id, limit, source, provider.capacity_discovery))
    return out


class Admission:
    """A handler process's attachment to the shared admission state."""

    def __init__(self, segment: Segment, generation: str) -> None:
        self._seg = segment
        self._buf = segment.buf
        self._pid, self._start = my_identity()
        self.generation = generation
        self._index: dict[str, int] = {}
        self._waiters: dict[Ticket, _Waiter] = {}
        self._guard = threading.Lock()  # protects _waiters and thread start
        self._closed = False
        self._holding: dict[int, int] = {}  # provider -> running slots this process holds
        self.wakeups = 0  # dispatcher wake-ups, for R-A7's "at most 10 a second"
        with segment.lock:
            self._member = ledger.register_member(self._buf, self._pid, self._start, generation)
        self._doorbell = segment.doorbell(self._member)
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
        """
        name = resolve_segment_name(segment, config)
        entries = providers_from_config(config) if config is not None else []
        seg = Segment.open(name, create=True, group_shared=group_shared)
        try:
            siblings.warn_if_split_budget(name, [e.provider_id for e in entries])
            with seg.lock:
                for e in entries:
                    _, created = ledger.ensure_provider(
                        seg.buf, e.provider_id, e.fallback, e.fallback_source, e.discovery
                    )
                    if created and e.fallback > RUNNING_ROOM:
                        log.warning(
                            "provider %s: maxConcurrent %d is above what the segment can hold; "
                            "admitting at most %d at once",
                            e.provider_id,
                            e.fallback,
                            RUNNING_ROOM,
                        )
            return cls(seg, generation)
        except BaseException:
            seg.close()
            raise

    # --- the public API -----------------------------------------------------------------
    @contextmanager
    def slot_blocking(self, provider: str, timeout: float | None = None) -> Iterator[None]:
        """Hold one running slot of ``provider`` for the body of the ``with``."""
        ticket = self._acquire_blocking(self._provider(provider), timeout)
        try:
            self._hold(ticket.provider, +1)
            yield
        finally:
            self._release(ticket)

    @asynccontextmanager
    async def slot(self, provider: str, timeout: float | None = None) -> AsyncIterator[None]:
        """``async with`` form of :meth:`slot_blocking`; never blocks the event loop on a wait."""
        ticket = await self._acquire_async(self._provider(provider), timeout)
        try:
            self._hold(ticket.provider, +1)
            yield
        finally:
            self._release(ticket)

    def close(self) -> None:
        """Deregister; slots still held by this Admission are released."""
        if os.getpid() != self._pid:
            # A forked child inherited this object (and its atexit hook): the records
            # and the member row are the parent's, not ours to free. Checked before
            # taking any lock: a lock held by a parent thread at fork stays held here.
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
        with self._seg.lock:
            rings = ledger.release_all_of(self._buf, self._pid, self._member, time.time())
            ledger.unregister_member(self._buf, self._member, self._pid)
        self._seg.ring(rings)
        self._seg.close()

    def __enter__(self) -> Admission:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- arrival --------------------------------------------------------------------------
    def _provider(self, provider_id: str) -> int:
        if self._closed:
            raise AdmissionError("this Admission is closed")
        if os.getpid() != self._pid:
            raise AdmissionError(
                f"Admission was attached in pid {self._pid}; call Admission.attach again in "
                "the forked child"
            )
        p = self._index.get(provider_id)
        if p is None:
            p = ledger.find_provider(self._buf, provider_id)
            if p is None:
                raise UnknownProvider(
                    f"provider {provider_id!r} is not in segment {self._seg.name}: is it in the "
                    "gateway config the sidecar (or the first handler) read?"
                )
            self._index[provider_id] = p
        return p

    def _arrive(self, p: int) -> Ticket | None:
        """Admitted: a RUNNING ticket. Queued: a WAITING ticket. Full: QueueFull."""
        now = time.time()
        with self._seg.lock:
            decision, ticket = ledger.arrive(
                self._buf, p, self._pid, self._start, self._member, now
            )
            if decision == "full":
                # Dead processes may be holding places: sweep before refusing anyone.
                _, rings = ledger.reap(self._buf, now)
                decision, ticket = ledger.arrive(
                    self._buf, p, self._pid, self._start, self._member, now
                )
                if decision == "full":
                    ledger.count_rejection(self._buf, p)
            else:
                rings = set()
        self._seg.ring(rings)
        if decision == "full":
            raise QueueFull(
                f"provider {self._provider_name(p)}: {ledger.queue_bound(self._buf, p)} requests "
                "are already waiting"
            )
        return ticket

    def _provider_name(self, p: int) -> str:
        for name, index in self._index.items():
            if index == p:
                return name
        return str(p)

    def _acquire_blocking(self, p: int, timeout: float | None) -> Ticket:
        ticket = self._arrive(p)
        assert ticket is not None
        if ledger.holder_state(self._buf, ticket) == HOLDER_RUNNING:
            return ticket
        waiter = _Waiter(ticket, event=threading.Event())
        self._add_waiter(waiter)
        deadline = None if timeout is None else time.monotonic() + timeout
        assert waiter.event is not None
        try:
            while True:
                remaining = None if deadline is None else max(deadline - time.monotonic(), 0.0)
                if not waiter.event.wait(remaining):
                    return self._after_wait(waiter, granted=False)
                waiter.event.clear()  # before looking: a grant after the look sets it again
                settled = self._settled(waiter)
                if settled is not None:
                    return settled
        except BaseException:
            self._give_up(waiter, "cancelled")
            raise

    async def _acquire_async(self, p: int, timeout: float | None) -> Ticket:
        ticket = self._arrive(p)
        assert ticket is not None
        if ledger.holder_state(self._buf, ticket) == HOLDER_RUNNING:
            return ticket
        loop = asyncio.get_running_loop()
        waiter = _Waiter(ticket, loop=loop, future=loop.create_future())
        self._add_waiter(waiter)
        try:
            async with asyncio.timeout(timeout):
                while True:
                    assert waiter.future is not None
                    await waiter.future
                    waiter.future = loop.create_future()  # before looking, as above
                    settled = self._settled(waiter)
                    if settled is not None:
                        return settled
        except TimeoutError:
            return self._after_wait(waiter, granted=False)
        except BaseException:  # CancelledError and friends
            self._give_up(waiter, "cancelled")
            raise

    def _settled(self, waiter: _Waiter) -> Ticket | None:
        """After a wake-up: the ticket when granted, None when still waiting.

        The dispatcher reads records without the lock, and CPython's struct
        pack_into zero-fills a field before writing it, so a lock-free read can
        catch a state half written (0 on its way from WAITING to RUNNING). The
        verdict is therefore read under the segment lock, where writes are whole;
        a wake-up that read a half-written value just goes back to waiting.
        """
        if self._closed:
            self._forget(waiter)
            raise AdmissionError("this Admission was closed while waiting")
        with self._seg.lock:
            state = ledger.holder_state(self._buf, waiter.ticket)
        if state == HOLDER_RUNNING:
            self._forget(waiter)
            return waiter.ticket
        if state == HOLDER_WAITING:
            return None
        self._forget(waiter)
        raise AdmissionError("the admission record was removed while waiting (reclaimed?)")

    def _after_wait(self, waiter: _Waiter, granted: bool) -> Ticket:
        """The wait timed out: leave the queue; a grant that raced with us is handed on."""
        assert not granted
        self._give_up(waiter, "timeout")
        raise AdmissionTimeout("no slot was granted within the timeout")

    def _give_up(self, waiter: _Waiter, outcome: ledger.Outcome) -> None:
        self._forget(waiter)
        if self._closed:
            return
        with self._seg.lock:
            was, rings = ledger.leave(self._buf, waiter.ticket, self._pid, outcome, time.time())
        self._seg.ring(rings)  # a grant that raced with us is handed on (R-A4)
        if was == "running":
            log.debug("a grant raced with %s; handed on", outcome)

    def _hold(self, p: int, delta: int) -> None:
        with self._guard:
            count = self._holding.get(p, 0) + delta
            if count > 0:
                self._holding[p] = count
            else:
                self._holding.pop(p, None)

    def _release(self, ticket: Ticket) -> None:
        self._hold(ticket.provider, -1)
        if self._closed:
            return  # close() released it already
        with self._seg.lock:
            was, rings = ledger.leave(self._buf, ticket, self._pid, "released", time.time())
        self._seg.ring(rings)
        if was == "stale":
            log.warning(
                "release of a slot this process no longer holds (released twice, or reclaimed)"
            )

    # --- waiting: dispatcher and ticker threads ---------------------------------------
    def _add_waiter(self, waiter: _Waiter) -> None:
        with self._guard:
            if self._closed:
                raise AdmissionError("this Admission is closed")
            self._waiters[waiter.ticket] = waiter
        # The grant may have happened between arrive() and now: look once more.
        self._doorbell.release()

    def _forget(self, waiter: _Waiter) -> None:
        with self._guard:
            self._waiters.pop(waiter.ticket, None)

    def _tick(self) -> None:
        while not self._closed:
            time.sleep(TICK_S)
            if (self._waiters or self._holding) and not self._closed:
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
                interested = {w.ticket.provider for w in waiters} | set(self._holding)
            try:
                for w in waiters:
                    state = ledger.holder_state(self._buf, w.ticket)
                    if state != HOLDER_WAITING:
                        w.wake()
                now = time.monotonic()
                if interested and now - last_sweep >= SWEEP_S:
                    last_sweep = now
                    self._sweep(interested)
            except Exception:  # this thread must outlive any one bad turn
                log.exception("admission dispatcher: unexpected error; continuing")

    def _sweep(self, providers: set[int]) -> None:
        """Reclaim dead holders and apply limit changes nobody announced (R-A5, R-L7)."""
        cache = LivenessCache()
        now = time.time()
        stuck = any(ledger.grantable(self._buf, p, now) for p in providers)
        if not stuck and not ledger.dead_holders(self._buf, sorted(providers), cache):
            return
        with self._seg.lock:
            reclaimed, rings = ledger.reap(self._buf, now, cache)
        if reclaimed:
            log.warning("reclaimed %d slot(s) of dead processes", reclaimed)
        self._seg.ring(rings)
