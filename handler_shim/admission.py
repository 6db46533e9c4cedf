"""Shared admission for every handler process and generation (REQUIREMENTS.md section 6).

One running budget and one bounded FIFO queue per provider live in the
segment. Every step that changes them (arrive, leave, grant, sweep) is one call
into the compiled core (``shm_layout/_core.c``), which takes the segment lock,
does its few writes and lets the lock go without ever waiting for the GIL in
between (R-A11). ``shm_layout/ledger.py`` states the protocol and its
invariants.

This module is the handler's side of it:

* a slot is a :class:`~shm_layout._core.Ticket`, which is also the context
  manager: ``with``/``async with`` run the common case (admitted at once,
  released at once) in C, with no Python frame. The core fills the ticket in
  *before* it lets the lock go, so an exception landing anywhere after the call
  still finds the record, and a ticket dropped while its record lives frees
  the record itself (R-A12);
* a request that must wait is woken one of two ways. On Linux a blocking
  waiter sleeps on its record's state word itself (a futex, ``Core.wait``): one
  wake-up per hand-off. An async waiter (and every waiter on macOS) is woken by
  this process's *dispatcher* thread, which sleeps on the process's doorbell (a
  named semaphore with a random name, posted by the granting process) and
  resolves the waiter's future or releases its lock;
* whoever waits also keeps the host's sweep going: at least every 0.5 s some
  waiter (or the sidecar's heartbeat) reclaims dead holders' places, checks the
  counters against the records and applies expiries (R-A5, R-A16, R-L7) — once
  per host, not once per process. On macOS, where semaphores have no timed
  wait, a ticker posts the doorbell instead (R-A10);
* a waiter that times out or is cancelled frees its record; if a grant raced
  with it, freeing the RUNNING record hands the slot on (R-A4). A waiter whose
  event loop was closed under it is freed by the dispatcher within one sweep,
  and a grant never stays with it (R-A14);
* :meth:`Admission.close` refuses new arrivals, frees the waiting, waits a
  bounded grace for running slots, then cuts the rest with one warning, and
  always returns (R-A14);
* when the segment's name leads to another object than the one mapped (removed
  or replaced by hand), the handler says so once and moves its new arrivals,
  and its waiters, to what the name leads to now (R-A15).

Errors (all ``AdmissionError``, exported by ``handler_shim``)::

    AdmissionError
     +-- QueueFull          the provider's queue holds its bound already (R-A2)
     +-- AdmissionTimeout   no slot within the timeout (also a TimeoutError)
     +-- UnknownProvider    not in the segment (also a KeyError)
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import gc
import logging
import math
import os
import sys
import threading
import time
import weakref
from typing import TYPE_CHECKING

from handler_shim.entries import ProviderEntry, providers_from_config
from shm_layout import _core, layout, platform, rows
from shm_layout.errors import AdmissionError as AdmissionError
from shm_layout.errors import AdmissionTimeout as AdmissionTimeout
from shm_layout.errors import GatewayCapacityError, ProviderIdError, TableFull
from shm_layout.errors import QueueFull as QueueFull
from shm_layout.errors import RequestTooLarge as RequestTooLarge
from shm_layout.errors import UnknownProvider as UnknownProvider
from shm_layout.layout import HOLDER_RUNNING, HOLDER_WAITING
from shm_layout.liveness import process_start
from shm_layout.names import resolve_segment_name
from shm_layout.owners import OwnerPolicy
from shm_layout.segment import Segment, remove_doorbell

# What a handler's ``import handler_shim`` loads is what a slot needs; asyncio (with ssl
# and concurrent.futures), the model, the writer and the views load when used
# (tests/repo/test_packaging.py checks what it loads).
if TYPE_CHECKING:
    import asyncio
    from collections.abc import Callable, Coroutine
    from typing import Any, TypeVar

    _T = TypeVar("_T")

log = logging.getLogger("gateway_capacity.admission")

# the core's types, by names that Admission's ``_core`` property (kept for tests and
# tools) does not shadow in annotations
CoreTicket = _core.Ticket
CoreObject = _core.Core

SWEEP_S = layout.SWEEP_S  # the host's sweep, and the longest a waiter sleeps without looking
TICK_S = 0.25  # macOS only: the ticker's post, standing in for a timed wait (R-A10)
CLOSE_GRACE_S = 10.0  # close(): how long running slots may go on before they are cut
JOIN_S = 2.0  # close(): the longest wait for a thread of ours to end

IN_CORE = 0.0  # "now" for a core step: the core reads the clocks once it holds the lock
LOCK_TURN_S = 0.25  # longest wait for the lock in one off-loop turn of the async form
_fork_generation = 0


def _forked() -> None:
    global _fork_generation
    _fork_generation += 1


os.register_at_fork(after_in_child=_forked)


def _seconds(timeout: float | None) -> str:
    return "the timeout" if timeout is None else f"the timeout of {timeout:g} s"


CLASS_BASE = layout.CLASS_BASE
CLASS_ROW_SIZE = layout.CLASS_ROW_SIZE
CLASS_NAME_BYTES = layout.CLASS_NAME_BYTES
PROVIDERS_BASE = layout.PROVIDERS_BASE
PROVIDER_ROW_SIZE = layout.PROVIDER_ROW_SIZE


# --- waiters that the dispatcher wakes ---------------------------------------------------
class _Waiter:
    """A waiter woken by the dispatcher: an async task's future, or (macOS) a thread.

    A thread's wake-up is a plain lock used as a binary semaphore: unlike
    threading.Event, whose Condition can be left half-released by an exception a signal
    handler raises inside it ("release unlocked lock"), acquire() is one C call."""

    __slots__ = ("future", "gate", "loop", "ticket", "woken")

    def __init__(
        self,
        ticket: CoreTicket,
        *,
        loop: asyncio.AbstractEventLoop | None = None,
        future: asyncio.Future[None] | None = None,
        gate: threading.Lock | None = None,
    ) -> None:
        self.ticket = ticket
        self.loop = loop
        self.future = future
        self.gate = gate
        self.woken = False

    def wake(self) -> bool:
        """Tell the waiter to look. False when nobody is left to tell (its loop is gone)."""
        if self.gate is not None:
            if not self.woken:
                self.woken = True
                with contextlib.suppress(RuntimeError):
                    self.gate.release()
            return True
        assert self.loop is not None and self.future is not None
        if self.loop.is_closed():
            return False
        try:
            self.loop.call_soon_threadsafe(_resolve, self.future)
        except RuntimeError:  # closed between the look and the call
            return False
        return True

    def orphaned(self) -> bool:
        """An async waiter whose event loop is gone: nobody will ever take its grant."""
        return self.loop is not None and self.loop.is_closed()


def _resolve(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


# --- one registration in one segment instance ----------------------------------------------
class _Attachment:
    """This process's registration in one segment instance: the mapping, the core, the
    doorbell, the provider rows it found, and its dispatcher thread."""

    def __repr__(self) -> str:
        """The live state, read without a lock (a debugger or a signal handler may ask):
        ``<_Attachment /gwcap-x member 3 [current, waiting 2, wakeups 17] p1 2/4 +1>``,
        each provider as running/limit and +waiting."""
        state = "retired" if self.retired else "stopping" if self.stopping else "current"
        return (
            f"<_Attachment {self.seg.name} member {getattr(self, 'member', '-')} [{state}, "
            f"waiting {len(self.waiters)}, wakeups {self.wakeups}]{self._loads()}>"
        )

    def _loads(self) -> str:
        try:
            now = platform.deadline_now()
            loads = [(n, rows.provider_load(self.buf, p, now)) for n, p in self.index.items()]
        except (ValueError, IndexError):  # unmapped (closed) or written over
            return ""
        return "".join(f" {n} {x.running}/{x.limit} +{x.waiting}" for n, x in loads)

    def __init__(self, adm: Admission, seg: Segment) -> None:
        self.adm = adm
        self.seg = seg
        self.core = seg.core
        self.buf = seg.buf
        self.index: dict[str, int] = {}
        self.overflow: dict[str, str] = {}
        # (provider row, class name) -> (the name as its row holds it, the row)
        self.classes: dict[tuple[int, str], tuple[bytes, int]] = {}
        self.waiters: dict[CoreTicket, _Waiter] = {}
        self.guard = threading.Lock()  # protects waiters
        self.stopping = False
        self.retired = False
        self.wakeups = 0
        self.bell = seg.create_doorbell()
        try:
            member, _ = self.core.register(
                os.getpid(),
                process_start(os.getpid()) or 0.0,  # informational (inspect)
                layout.encode_text(adm.generation, layout.ID_BYTES),
                layout.MAJOR,
                layout.MINOR,
                IN_CORE,
                self.bell,
            )
        except BaseException:
            remove_doorbell(self.bell)
            raise
        if member < 0:
            remove_doorbell(self.bell)
            raise AdmissionError(
                f"segment {seg.name} already has {layout.MEMBER_COUNT} attached handler "
                "processes; stop some, or give this gateway its own segment"
            )
        self.member = member
        self.core.set_slow_paths(adm._enter_slow, adm._aenter_slow, adm._aexit_slow)
        self.threads = [threading.Thread(target=self._dispatch, name="gwcap-dispatch", daemon=True)]
        if not platform.semaphore_timeouts():  # macOS: no timed wait; a ticker posts
            self.threads.append(threading.Thread(target=self._tick, name="gwcap-tick", daemon=True))
        self._stop = threading.Event()
        for thread in self.threads:
            thread.start()

    # --- providers --------------------------------------------------------------------
    def ensure(self, entries: list[ProviderEntry]) -> None:
        """Rows for the config's providers (R-A8, R-A9): what a sidecar would write."""
        for e in entries:
            from shm_layout import writer

            try:
                # the creating shim writes the classes a sidecar would, with the row (R-A21)
                _, created = writer.ensure_provider(
                    self.seg,
                    e.provider_id,
                    e.fallback,
                    e.fallback_source,
                    discovery=e.discovery,
                    classes=e.classes,
                    default_class=e.default_class,
                )
            except TableFull as exc:
                self.overflow[e.provider_id] = str(exc)
                continue
            if created and e.fallback > layout.RUNNING_ROOM:
                log.warning(
                    "provider %s: maxConcurrent %d is above what the segment can hold; "
                    "admitting at most %d at once",
                    e.provider_id,
                    e.fallback,
                    layout.RUNNING_ROOM,
                )
        if self.overflow:
            log.warning(
                "segment %s holds at most %d providers; these have no budget and raise on use: %s",
                self.seg.name,
                layout.PROVIDER_COUNT,
                ", ".join(sorted(self.overflow)),
            )

    def provider(self, provider_id: str) -> int:
        p = self.index.get(provider_id)
        if p is None:
            p = rows.find_provider(self.buf, provider_id)
            if p is None:
                raise UnknownProvider(
                    self.adm._unknown_reason(self, provider_id), provider=provider_id
                )
            self.index[provider_id] = p
        return p

    def provider_name(self, p: int) -> str:
        for name, index in self.index.items():
            if index == p:
                return name
        return str(p)

    # --- waiters ------------------------------------------------------------------------
    def watch(self, waiter: _Waiter) -> None:
        with self.guard:
            self.waiters[waiter.ticket] = waiter
        self.core.post_own()  # the dispatcher looks at once: the grant may be in already

    def unwatch(self, waiter: _Waiter) -> None:
        with self.guard:
            self.waiters.pop(waiter.ticket, None)

    def _dispatch(self) -> None:
        """Sleep on the doorbell; wake the waiters whose records changed; keep the host's
        sweep going while someone here waits (R-A5); free the records of waiters whose
        event loop is gone (R-A14); notice a moved name (R-A15)."""
        last_check = 0.0
        while not self.stopping:
            with self.guard:
                watched = tuple(self.waiters)
            seen = set(watched)
            # back in Python every sweep while someone here waits or holds a slot taken in
            # an event loop (that loop may go away), or the attachment is retired; else
            # only when something happened
            period = SWEEP_S if (watched or self.retired or self.adm._loops) else -1.0
            try:
                changed, reclaimed, posts = self.core.dispatch(period, watched, self.retired)
            except _core.CoreError:
                if self.stopping or self.core.closing:
                    return
                self.adm._log_once("dispatch", "admission dispatcher: the core refused a turn")
                time.sleep(SWEEP_S)
                continue
            except Exception:  # this thread must outlive any one bad turn
                self.adm._log_once("dispatch", "admission dispatcher: unexpected error")
                time.sleep(SWEEP_S)
                continue
            if self.stopping:
                return
            self.wakeups += posts
            if reclaimed > 0:
                log.warning("reclaimed %d slot(s) of dead processes", reclaimed)
            with self.guard:
                woken = [self.waiters.get(t) for t in changed]
                late = [w for t, w in self.waiters.items() if t not in seen] if posts else []
            if late:
                # Watched after ``watched`` was taken: this turn drained the doorbell but
                # looked only at ``watched``, so a grant's one post may be spent already.
                # Look now, or the waiter sleeps until the next post or period (0.5 s).
                with contextlib.suppress(_core.CoreError):  # unsure: wake them all
                    late = [w for w in late if self.core.state(w.ticket) != HOLDER_WAITING]
                woken += late
            for waiter in woken:
                if waiter is not None and not waiter.wake():
                    self._free_orphan(waiter)
            now = time.monotonic()
            if now - last_check >= SWEEP_S:
                last_check = now
                self._periodic(watched)

    def _periodic(self, watched: tuple[CoreTicket, ...]) -> None:
        with self.guard:
            orphans = [w for w in self.waiters.values() if w.orphaned()]
        for waiter in orphans:
            self._free_orphan(waiter)
        self.adm._collect_closed_loops()
        self.adm._report_events(self)
        if self.core.moved and not self.retired and not self.core.closing:
            # say so now; arrivals (and waiters, woken by the core) move when they come
            self.adm._notice_moved(self)
        if self.retired and _running(self) == 0 and not self.adm._closing:
            self.adm._drop_retired(self)

    def _free_orphan(self, waiter: _Waiter) -> None:
        """A waiter whose event loop is gone: its record is freed here, so that neither a
        place in the queue nor a grant stays with a request nobody runs (R-A14)."""
        self.unwatch(waiter)
        if waiter.ticket.live:
            waiter.ticket.leave(_core.CANCELLED, blocking=True)
            self.adm._log_once(
                "orphan",
                "a request was waiting in an event loop that was closed; its place was freed",
            )

    def _tick(self) -> None:
        """macOS (no timed semaphore wait): post the doorbell every tick while this
        process waits, holds slots or is retired, as the dispatcher's period on Linux:
        its dispatcher keeps the host's sweep going (R-A5), collects closed event loops
        and drops a retired attachment. An idle process has nothing to look at."""
        while not self._stop.wait(TICK_S):
            if self.waiters or self.core.held or self.retired or self.adm._loops:
                self.core.post_own()

    # --- leaving ------------------------------------------------------------------------
    def stop_threads(self) -> bool:
        """End the dispatcher (and ticker); True when they ended in time."""
        self.stopping = True
        self._stop.set()
        with contextlib.suppress(_core.CoreError):
            self.core.post_own()
        ended = True
        deadline = time.monotonic() + JOIN_S
        for thread in self.threads:
            if thread is not threading.current_thread():
                thread.join(max(deadline - time.monotonic(), 0.0))
                ended = ended and not thread.is_alive()
        return ended

    def detach(self) -> int:
        """Unregister (every record of ours goes) and close; returns running slots cut."""
        ended = self.stop_threads()
        cut = 0
        with contextlib.suppress(_core.CoreError):
            cut = int(self.core.unregister(IN_CORE))
        remove_doorbell(self.bell)
        if ended:
            self.seg.close()
        return cut


class Admission:
    """A handler process's attachment to the shared admission state."""

    def __init__(
        self,
        name: str,
        generation: str,
        entries: list[ProviderEntry],
        policy: OwnerPolicy,
        *,
        group_shared: bool,
    ) -> None:
        self.generation = generation
        self._name = name
        self._entries = entries
        self._policy = policy
        self._group_shared = group_shared
        self._pid = os.getpid()
        self._fork_generation = _fork_generation
        # attachments: current, retired, closing. Reentrant: close() may be called from a
        # signal handler that lands while this thread holds it
        self._lock = threading.RLock()
        self._closed_event = threading.Event()
        self._closing = False
        self._closed = False
        self._logged: set[str] = set()
        self._move_failure: str | None = None
        self._move_tried = 0.0
        # event loops slots were taken in: when one closes with slots of its tasks still
        # held, those tasks are gone; their tickets are collected, freeing the records
        self._loops: list[weakref.ref[asyncio.AbstractEventLoop]] = []
        self._last_loop: asyncio.AbstractEventLoop | None = None
        self._retired: list[_Attachment] = []
        seg = Segment.open(name, create=True, group_shared=group_shared, policy=policy)
        try:
            from handler_shim import siblings

            siblings.warn_if_split_budget(name, [e.provider_id for e in entries], policy)
            att = _Attachment(self, seg)
        except BaseException:
            seg.close()
            raise
        try:
            att.ensure(entries)
        except BaseException:
            att.detach()
            raise
        self._current = att
        atexit.register(self._close_at_exit)

    def __repr__(self) -> str:
        """``<Admission generation='gw-2' open <_Attachment ...>, 1 retired>``: the state and
        the live attachment's (read without a lock)."""
        state = "closed" if self._closed else "closing" if self._closing else "open"
        current = getattr(self, "_current", None)
        retired = f", {len(self._retired)} retired" if self._retired else ""
        return f"<Admission generation={self.generation!r} {state} {current!r}{retired}>"

    @classmethod
    def attach(
        cls,
        config: str | os.PathLike[str] | None = None,
        generation: str = "unknown",
        *,
        segment: str | None = None,
        group_shared: bool = False,
        owner: str | int | None = None,
        group: str | int | None = None,
    ) -> Admission:
        """Attach to (or create) the segment for ``config`` (or ``segment``) and register.

        With ``config``, providers missing from the segment are added with their
        static fallback (R-A8, R-A9), so handlers work before any sidecar runs.
        A provider that does not fit the segment's table is named in a warning and
        raises on use; the others work (R-A13). ``owner``: the other user a segment
        may belong to (the sidecar's, in group-shared mode); ``group``: the group it
        must have in group-shared mode (default: this process's). Objects of anyone
        else are refused (R-G6).
        """
        name = resolve_segment_name(segment, config)
        entries = providers_from_config(config) if config is not None else []
        policy = OwnerPolicy.for_process(owner, group_shared=group_shared, group=group)
        return cls(name, generation, entries, policy, group_shared=group_shared)

    # --- what the tests and tools look at ---------------------------------------------
    @property
    def segment_name(self) -> str:
        return self._name

    @property
    def _seg(self) -> Segment:
        return self._current.seg

    @property
    def _core(self) -> CoreObject:
        return self._current.core

    @property
    def _buf(self) -> Any:
        return self._current.buf

    @property
    def wakeups(self) -> int:
        """Doorbell wake-ups of this process's dispatchers (R-A7's "at most 10 a second")."""
        return self._current.wakeups + sum(a.wakeups for a in self._retired)

    # --- the public API -----------------------------------------------------------------
    def slot_blocking(
        self,
        provider: str,
        timeout: float | None = None,
        *,
        cls: str | None = None,
        tokens: int = 0,
    ) -> CoreTicket:
        """``with adm.slot_blocking(provider, timeout):`` one running slot for the body.
        ``cls``: the admission class (docs/classes.md); None or a name the provider does
        not have: its default class (R-A22). ``tokens``: what the request may hold,
        prompt and generated (docs/DESIGN.md section 6c); 0 slots only. A request no
        worker could hold raises :class:`RequestTooLarge` at once (R-T2)."""
        att = self._usable()
        p = att.index.get(provider)
        if p is None:
            att, p = self._look_up(att, provider)
        if tokens:
            return self._charged(att, p, timeout, cls, tokens)
        if cls is None:
            return _core.Ticket(att.core, p, timeout)
        return _core.Ticket(att.core, p, timeout, cls=self._class_index(att, p, cls))

    def _charged(
        self, att: _Attachment, p: int, timeout: float | None, cls: str | None, tokens: int
    ) -> CoreTicket:
        """A ticket charged ``tokens`` (the core checks them against the budget)."""
        if not isinstance(tokens, int) or tokens < 0:
            raise ValueError(f"tokens must be a whole number of tokens >= 0, not {tokens!r}")
        if tokens > layout.MAX_CHARGE:
            raise self._too_large(att, p, tokens)
        index = -1 if cls is None else self._class_index(att, p, cls)
        return _core.Ticket(att.core, p, timeout, cls=index, tokens=tokens)

    def _too_large(self, att: _Attachment, p: int, tokens: int) -> RequestTooLarge:
        """The refusal of a request charged more tokens than any worker can hold, with the
        numbers as published (a lock-free look at the provider's row)."""
        name = att.provider_name(p)
        budget = rows.token_budget(att.buf, p, platform.deadline_now())
        per_request, total = budget.request_limit or None, budget.limit or None
        if tokens > layout.MAX_CHARGE:
            why = f"the most one request may be charged is {layout.MAX_CHARGE}"
        elif per_request is not None and tokens > per_request:
            why = f"the most one request of it may hold is {per_request} tokens"
        elif total is not None:
            why = f"all its running requests together may hold {total} tokens"
        else:
            why = "its token budget changed meanwhile"
        return RequestTooLarge(
            f"provider {name}: this request needs {tokens} tokens (prompt and max_tokens), "
            f"and {why}: shorten it or lower max_tokens",
            provider=name,
            tokens=tokens,
            request_token_limit=per_request,
            token_limit=total,
        )

    def slot(
        self,
        provider: str,
        timeout: float | None = None,
        *,
        cls: str | None = None,
        tokens: int = 0,
    ) -> CoreTicket:
        """``async with adm.slot(provider, timeout):`` the same; never blocks the event loop
        on a wait (R-A11)."""
        att = self._usable()
        events = sys.modules.get("asyncio.events")  # loaded: a caller of slot() runs a loop
        loop = events._get_running_loop() if events is not None else None
        if loop is not self._last_loop and loop is not None:
            self._note_loop(loop)
        p = att.index.get(provider)
        if p is None:
            att, p = self._look_up(att, provider)
        if tokens:
            return self._charged(att, p, timeout, cls, tokens)
        if cls is None:
            return _core.Ticket(att.core, p, timeout)
        return _core.Ticket(att.core, p, timeout, cls=self._class_index(att, p, cls))

    def _class_index(self, att: _Attachment, p: int, cls: str) -> int:
        """The row of class ``cls`` of provider row ``p`` (lock-free: a class table being
        rewritten may be read half old; the core then counts the request in the default
        class), -1 when the provider has no such class (said once). A row found is
        remembered while its name is still there: one 16-byte compare."""
        known = att.classes.get((p, cls))
        if known is not None:
            start = PROVIDERS_BASE + p * PROVIDER_ROW_SIZE + CLASS_BASE + known[1] * CLASS_ROW_SIZE
            if att.buf[start : start + CLASS_NAME_BYTES] == known[0]:
                return known[1]
        from shm_layout import view

        index = view.class_index(att.buf, p, cls)
        name = view.class_name_bytes(cls)
        if index >= 0 and name is not None:
            att.classes[(p, cls)] = (name, index)
        if index < 0:
            self._log_once(
                f"class:{p}:{cls}",
                f"provider {att.provider_name(p)} has no admission class {cls!r}: its requests "
                "count in the provider's default class",
            )
        return index

    async def acquire(
        self,
        provider: str,
        timeout: float | None = None,
        *,
        cls: str | None = None,
        tokens: int = 0,
    ) -> Ticket:
        """Take one running slot of ``provider`` and return its :class:`Ticket`, for code
        that takes and gives back the slot in different callbacks (a LiteLLM hook, say).
        The same waiting and errors as :meth:`slot`; give it back with :meth:`release`."""
        ticket = self.slot(provider, timeout, cls=cls, tokens=tokens)
        await ticket.__aenter__()
        return Ticket(provider, ticket)

    def try_acquire(
        self, provider: str, *, cls: str | None = None, tokens: int = 0
    ) -> Ticket | None:
        """A slot of ``provider`` only if one is free at once: one try-lock step, never
        queued, never waiting, safe on an event loop. None when the request would have to
        wait (or the lock is busy): then call :meth:`acquire`, which queues it. Raises
        ``QueueFull`` as :meth:`acquire` does. Give the ticket back with :meth:`release`."""
        ticket = self.slot(provider, cls=cls, tokens=tokens)
        core = _core_of(ticket)
        code = core.arrive(
            ticket, ticket.provider, os.getpid(), IN_CORE, may_wait=False, blocking=False
        )
        if code == _core.ADMIT:
            return Ticket(provider, ticket)
        if code in (_core.FULL, _core.CLOSED, _core.TOO_LARGE):
            raise self._refusal(ticket, code)
        if code == _core.MOVED:
            self._moved_ticket(ticket)  # the name leads elsewhere: arrivals go there now
        return None  # would wait (nothing recorded), the lock is busy, or it just moved

    def acquire_blocking(
        self,
        provider: str,
        timeout: float | None = None,
        *,
        cls: str | None = None,
        tokens: int = 0,
    ) -> Ticket:
        """The blocking form of :meth:`acquire`."""
        ticket = self.slot_blocking(provider, timeout, cls=cls, tokens=tokens)
        ticket.__enter__()
        return Ticket(provider, ticket)

    def release(self, ticket: Ticket) -> None:
        """Give back ``ticket``'s slot. Idempotent; callable from any task or thread;
        a no-op after :meth:`close` (which released it). Never blocks an event loop:
        when the segment lock is busy, the release finishes in a thread of its own."""
        if not isinstance(ticket, Ticket):
            raise TypeError(f"release() takes a Ticket from acquire(), not {type(ticket).__name__}")
        core_ticket = ticket._take()
        if core_ticket is None or not core_ticket.live:
            return
        if core_ticket.leave(_core.RELEASED, blocking=False) == -1:
            threading.Thread(
                target=core_ticket.leave,
                args=(_core.RELEASED,),
                kwargs={"blocking": True},
                name="gwcap-release",
                daemon=True,
            ).start()

    def retry_after(self, provider: str) -> int:
        """Seconds a refused client should wait before trying again: the provider's mean
        slot hold time x the queue ahead / the limit, clamped to [1, 60] (1 while no slot
        has been held yet). Lock-free; never raises for a known provider."""
        att = self._usable()
        load = rows.provider_load(att.buf, att.provider(provider), platform.deadline_now())
        return retry_after_seconds(load.hold_mean_s, load.waiting, load.limit)

    def request_token_limit(self, provider: str) -> int | None:
        """The most tokens one request of ``provider`` may hold, as published and in force
        (docs/DESIGN.md section 6c); None unknown. Lock-free."""
        att = self._usable()
        budget = rows.token_budget(att.buf, att.provider(provider), platform.deadline_now())
        return budget.request_limit or None

    def close(self, grace: float = CLOSE_GRACE_S) -> None:
        """Deregister, safely (R-A14): new arrivals are refused from now on; waiting
        requests are refused (their places freed); running slots get ``grace`` seconds to
        end; what still runs then is released with one warning. Always returns."""
        if self._fork_generation != _fork_generation:
            # A forked child inherited this object (and its atexit hook): the records
            # and the member row are the parent's, not ours to free.
            self._closed = True
            return
        with self._lock:
            if self._closing:
                first = False
            else:
                first = self._closing = True
                attachments = [self._current, *self._retired]
        if not first:  # another close() is at it: wait for it (bounded), like it
            self._closed_event.wait(max(grace, 0.0) + 2 * JOIN_S + 1.0)
            return
        atexit.unregister(self._close_at_exit)
        for att in attachments:
            with contextlib.suppress(_core.CoreError):
                att.core.begin_close(IN_CORE)
            with att.guard:
                waiters = list(att.waiters.values())
            for w in waiters:
                w.wake()  # they find the record gone and raise
        deadline = time.monotonic() + max(grace, 0.0)
        while any(_running(a) for a in attachments) and time.monotonic() < deadline:
            time.sleep(0.002)
        cut = 0
        for att in attachments:
            cut += att.detach()
        self._closed = True
        self._closed_event.set()
        if cut:
            log.warning(
                "closed with %d running slot(s) still held after a grace of %gs; released "
                "them (those requests go on without a place in the shared budget)",
                cut,
                grace,
            )

    def _close_at_exit(self) -> None:
        # the interpreter is ending: the other threads' bodies end with it
        self.close(grace=0.0)

    def __enter__(self) -> Admission:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- arrival ----------------------------------------------------------------------
    def _usable(self) -> _Attachment:
        if self._closing:
            raise AdmissionError("this Admission is closed")
        if self._fork_generation != _fork_generation:
            raise AdmissionError(
                f"Admission was attached in pid {self._pid}; call Admission.attach again in "
                "the forked child"
            )
        return self._current

    def _look_up(self, att: _Attachment, provider_id: str) -> tuple[_Attachment, int]:
        """The row of a provider not looked up on ``att`` yet. On a segment truncated
        under us the look read zeros: it is made where arrivals go now (R-A15)."""
        try:
            if not att.core.lost:
                return att, att.provider(provider_id)
        except UnknownProvider:
            if not att.core.lost:
                raise
        att = self._move(att)
        return att, att.provider(provider_id)

    def _unknown_reason(self, att: _Attachment, provider_id: str) -> str:
        if provider_id in att.overflow:
            return f"provider {provider_id!r} has no budget: {att.overflow[provider_id]}"
        try:
            rows.encode_provider_id(provider_id)
        except ProviderIdError as exc:
            return str(exc)
        from gateway_config import known_providers

        known = known_providers(provider_id, rows.provider_ids(att.buf))
        return (
            f"provider {provider_id!r} is not in segment {self._name}{known}: is it in the "
            "gateway config the sidecar (or the first handler) read?"
        )

    def _attachment_of(self, core: CoreObject) -> _Attachment:
        with self._lock:
            for att in (self._current, *self._retired):
                if att.core is core:
                    return att
        raise AdmissionError("this slot belongs to a segment this Admission has left")

    def _refusal(self, ticket: CoreTicket, code: int) -> AdmissionError:
        att = self._attachment_of(_core_of(ticket))
        name = att.provider_name(ticket.provider)
        if code == _core.FULL:
            return QueueFull(
                f"provider {name}: {layout.QUEUE_BOUND} requests are already waiting",
                provider=name,
                waiting=layout.QUEUE_BOUND,
                timeout=ticket.timeout,
            )
        if code == _core.BUSY:  # the lock stayed busy for the whole timeout
            return AdmissionTimeout(
                f"provider {name}: the segment lock stayed busy for the whole timeout "
                f"({_seconds(ticket.timeout)})",
                provider=name,
                timeout=ticket.timeout,
            )
        if code == _core.CLOSED:
            return AdmissionError("this Admission was closed")
        if code == _core.TOO_LARGE:
            return self._too_large(att, ticket.provider, ticket.tokens)
        return AdmissionError(f"admission refused (code {code})")

    def _displaced(self, ticket: CoreTicket) -> QueueFull:
        """A waiter displaced from a full queue by a higher class (R-A20): the refusal a
        request arriving to a full queue gets."""
        try:
            name = self._attachment_of(_core_of(ticket)).provider_name(ticket.provider)
        except AdmissionError:
            name = "?"
        return QueueFull(
            f"provider {name}: {layout.QUEUE_BOUND} requests were waiting and one of a higher "
            "admission class took this request's place",
            provider=name,
            waiting=layout.QUEUE_BOUND,
        )

    def _timed_out(self, ticket: CoreTicket) -> AdmissionTimeout:
        """The provider, the timeout, and what was ahead of the request when it ran out (a
        lock-free look at the provider's row), in words and attributes."""
        timeout = ticket.timeout
        try:
            att = self._attachment_of(_core_of(ticket))
            name = att.provider_name(ticket.provider)
        except AdmissionError:
            text = f"no slot was granted within the timeout ({_seconds(timeout)})"
            return AdmissionTimeout(text, timeout=timeout)
        text = f"provider {name}: no slot was granted within {_seconds(timeout)}"
        p = ticket.provider
        try:
            limit = rows.effective_limit(att.buf, p, platform.deadline_now())
            load = rows.provider_load(att.buf, p, platform.deadline_now())
            ahead = rows.waiting_ahead(att.buf, p, ticket.holder) if ticket.live else None
        except (ValueError, IndexError):  # a segment written over: the plain words
            return AdmissionTimeout(text, provider=name, timeout=timeout)
        text += f": {load.running} running on a limit of {limit.value} ({limit.source})"
        if ahead is not None:
            text += f", {ahead} waiting ahead of it in the queue"
        return AdmissionTimeout(
            text,
            provider=name,
            limit=limit.value,
            running=load.running,
            waiting=load.waiting,
            timeout=timeout,
        )

    def _moved_ticket(self, ticket: CoreTicket) -> CoreTicket:
        """The name leads elsewhere: move, and point ``ticket`` (not live) at the
        attachment arrivals go to now, with the same provider by id (R-A15)."""
        old = self._attachment_of(_core_of(ticket))
        name = old.provider_name(ticket.provider)
        att = self._move(old)
        ticket.rebind(att.core, att.provider(name))
        return ticket

    # --- the slow paths of the slot context managers (called by the core) --------------
    def _enter_slow(self, ticket: CoreTicket, code: int) -> None:
        """``with`` when the arrival did not admit at once: wait, move, or refuse."""
        # the timeout counts from the slot's entry, the wait for a busy lock included
        timeout = ticket.timeout
        deadline = None if timeout is None else ticket.started + timeout
        try:
            while True:
                if code == _core.MOVED:
                    ticket = self._moved_ticket(ticket)
                    code = self._arrive_again(ticket, deadline)
                    continue
                if code == _core.ADMIT:
                    return
                if code != _core.WAIT:
                    raise self._refusal(ticket, code)
                result = self._wait_blocking(ticket, deadline)
                if result == _core.W_GRANTED:
                    return
                if result == _core.W_MOVED:
                    ticket.leave(_core.CANCELLED, blocking=True)
                    code = _core.MOVED
                    continue
                if result == _core.W_TIMEOUT:
                    timed_out = self._timed_out(ticket)  # while the record holds its ticket
                    ticket.leave(_core.TIMEOUT, blocking=True)  # a grant that raced is handed on
                    raise timed_out
                if result == _core.W_DISPLACED:
                    raise self._displaced(ticket)
                if result == _core.W_CLOSED or self._closing:
                    raise AdmissionError("this Admission was closed while waiting")
                raise AdmissionError("the admission record was removed while waiting")
        except BaseException:
            # Whatever landed (a timeout, a KeyboardInterrupt, an exception from a signal
            # handler): leave nothing behind (R-A12). Should this line itself be skipped,
            # the ticket frees its record when it is dropped.
            ticket.leave(_core.CANCELLED, blocking=True)
            raise

    def _arrive_again(self, ticket: CoreTicket, deadline: float | None) -> int:
        remaining = -1.0 if deadline is None else max(deadline - platform.deadline_now(), 0.0)
        code: int = _core_of(ticket).arrive(
            ticket,
            ticket.provider,
            os.getpid(),
            IN_CORE,
            may_wait=True,
            blocking=True,
            timeout=remaining,
            futex=True,
        )
        return code

    def _wait_blocking(self, ticket: CoreTicket, deadline: float | None) -> int:
        """Wait for the grant until ``deadline`` (deadline clock); a W_* result."""
        if ticket.futex:  # Linux: the thread sleeps on its record itself (one wake-up)
            remaining = -1.0 if deadline is None else max(deadline - platform.deadline_now(), 0.0)
            result, reclaimed = _core_of(ticket).wait(ticket, remaining)
            if reclaimed:
                log.warning("reclaimed %d slot(s) of dead processes", reclaimed)
            with contextlib.suppress(AdmissionError, _core.CoreError):
                self._report_events(self._attachment_of(_core_of(ticket)))
            return int(result)
        att = self._attachment_of(_core_of(ticket))  # macOS: the dispatcher wakes us
        gate = threading.Lock()
        gate.acquire()
        waiter = _Waiter(ticket, gate=gate)
        att.watch(waiter)
        try:
            while True:
                state = att.core.state(ticket)
                if state == HOLDER_RUNNING:
                    return _core.W_GRANTED
                if state != HOLDER_WAITING:
                    if att.core.displaced(ticket):
                        return _core.W_DISPLACED
                    return _core.W_CLOSED if att.core.closing else _core.W_GONE
                if att.core.closing:
                    return _core.W_CLOSED
                if att.core.moved:
                    return _core.W_MOVED
                if deadline is None:
                    gate.acquire()
                else:
                    remaining = deadline - platform.deadline_now()
                    if remaining <= 0 or not gate.acquire(timeout=remaining):
                        if att.core.state(ticket) == HOLDER_RUNNING:
                            return _core.W_GRANTED
                        return _core.W_TIMEOUT
                waiter.woken = False
        finally:
            att.unwatch(waiter)

    def _aenter_slow(self, ticket: CoreTicket, code: int) -> Coroutine[Any, Any, None]:
        return self._aenter(ticket, code)

    async def _aenter(self, ticket: CoreTicket, code: int) -> None:
        """``async with`` when the try-lock arrival did not admit at once."""
        import asyncio

        try:
            async with asyncio.timeout(ticket.timeout):
                await self._acquire(ticket, code)
        except TimeoutError:
            timed_out = self._timed_out(ticket)  # while the record still holds its ticket
            await self._leave_async(ticket, _core.TIMEOUT)
            raise timed_out from None
        except BaseException:  # CancelledError, QueueFull and friends (R-A4, R-A12)
            await self._leave_async(ticket, _core.CANCELLED)
            raise

    async def _acquire(self, ticket: CoreTicket, code: int) -> None:
        while True:
            # The lock is busy or stalled: wait for it off the loop, in bounded turns, so
            # that the timeout or a cancellation lands within one turn even while the
            # holder is stopped (the thread of a turn cannot be interrupted, only waited
            # for: R-A4).
            while code == _core.BUSY:
                code = await self._off_loop(
                    functools.partial(
                        _core_of(ticket).arrive, may_wait=True, blocking=True, timeout=LOCK_TURN_S
                    ),
                    ticket,
                    ticket.provider,
                    os.getpid(),
                    IN_CORE,
                )
            if code == _core.MOVED:
                ticket = self._moved_ticket(ticket)
                code = _core.BUSY  # arrive again, off the loop
                continue
            if code == _core.ADMIT:
                return
            if code != _core.WAIT:
                raise self._refusal(ticket, code)
            result = await self._wait_async(ticket)
            if result == _core.W_GRANTED:
                return
            if result == _core.W_DISPLACED:
                raise self._displaced(ticket)
            if _core_of(ticket).moved and not _core_of(ticket).closing:
                await self._leave_async(ticket, _core.CANCELLED)
                code = _core.MOVED
                continue
            if _core_of(ticket).closing or self._closing:
                raise AdmissionError("this Admission was closed while waiting")
            raise AdmissionError("the admission record was removed while waiting")

    async def _wait_async(self, ticket: CoreTicket) -> int:
        import asyncio

        att = self._attachment_of(_core_of(ticket))
        loop = asyncio.get_running_loop()
        waiter = _Waiter(ticket, loop=loop, future=loop.create_future())
        att.watch(waiter)
        try:
            while True:
                assert waiter.future is not None
                await waiter.future
                waiter.future = loop.create_future()  # before looking: a wake after it lands
                state = att.core.state(ticket) if not att.core.closing else 0
                if state == HOLDER_RUNNING:
                    return _core.W_GRANTED
                if state != HOLDER_WAITING and att.core.displaced(ticket):
                    return _core.W_DISPLACED
                if state != HOLDER_WAITING or att.core.closing:
                    return _core.W_GONE
                if att.core.moved:
                    return _core.W_MOVED
        finally:
            att.unwatch(waiter)

    async def _leave_async(self, ticket: CoreTicket, outcome: int) -> None:
        if ticket.leave(outcome, blocking=False) == -1:  # the lock is busy: not on the loop
            await self._off_loop(functools.partial(ticket.leave, blocking=True), outcome)

    def _aexit_slow(self, ticket: CoreTicket) -> Coroutine[Any, Any, None]:
        return self._leave_async(ticket, _core.RELEASED)

    async def _off_loop(self, fn: Callable[..., _T], *args: object) -> _T:
        """Run a core call that may wait for the lock in a worker thread (R-A11).

        If the awaiting task is cancelled, the call still completes in its thread;
        the caller's cleanup sees its result on the ticket.
        """
        import asyncio

        loop = asyncio.get_running_loop()
        future = loop.run_in_executor(None, fn, *args)
        try:
            return await asyncio.shield(future)
        except BaseException:
            # Let the thread finish what it started before anyone looks at the ticket.
            await _finish_quietly(future)
            raise

    # --- event loops that go away with slots held (R-A14) ----------------------------------
    def _note_loop(self, loop: asyncio.AbstractEventLoop) -> None:
        self._last_loop = loop
        with self._lock:
            known = [ref() for ref in self._loops]
            if loop in known:
                return
            self._loops.append(weakref.ref(loop))
        # The dispatcher may sleep with nothing to look at (no waiter ever came): wake it
        # so that it looks for closed loops every sweep from now on, also when every slot
        # taken in this loop was admitted at once (R-A14).
        with contextlib.suppress(_core.CoreError):
            self._current.core.post_own()

    def _collect_closed_loops(self) -> None:
        """A loop that closed while its tasks held or waited for slots: those tasks will
        never run again, and their tickets are freed when they are collected. Collect
        them now rather than whenever the garbage collector gets round to it."""
        with self._lock:
            closed = [r for r in self._loops if (r() is None or r().is_closed())]  # type: ignore[union-attr]
            if not closed:
                return
            self._loops = [r for r in self._loops if r not in closed]
            if self._last_loop is not None and self._last_loop.is_closed():
                self._last_loop = None
        if any(a.core.held for a in (self._current, *self._retired)):
            gc.collect()

    # --- a name that leads elsewhere (R-A15) ----------------------------------------------
    def _move(self, old: _Attachment) -> _Attachment:
        """The segment's name leads to another object than ``old``'s: say so once, attach
        to what it leads to now (creating it if there is none: R-A9), and send arrivals
        and ``old``'s waiters there. Raises, naming why, when that cannot be done."""
        with self._lock:
            if old is not self._current:
                return self._current
            if self._closing:
                raise AdmissionError("this Admission is closed")
            if self._move_failure and time.monotonic() - self._move_tried < SWEEP_S:
                raise AdmissionError(self._move_failure)
            self._move_tried = time.monotonic()
            self._notice_moved(old)
            try:
                seg = Segment.open(
                    self._name, create=True, group_shared=self._group_shared, policy=self._policy
                )
                try:
                    att = _Attachment(self, seg)
                except BaseException:
                    seg.close()
                    raise
                att.ensure(self._entries)
            except GatewayCapacityError as exc:
                failure = (
                    f"segment {self._name} was {_what_happened(old)}, and what its name leads "
                    f"to now cannot be used: {exc}"
                )
                if failure != self._move_failure:  # said once; arrivals are refused with it
                    log.error("%s", failure)
                self._move_failure = failure
                raise AdmissionError(self._move_failure) from None
            self._move_failure = None
            self._current = att
            old.retired = True
            self._retired.append(old)
        old.core.retire()  # its waiters wake, leave and arrive again here
        return att

    def _notice_moved(self, att: _Attachment) -> None:
        """Say once (per segment instance) that the name leads elsewhere now (R-A15)."""
        key = f"moved:{att.seg.identity}"
        if key in self._logged:
            return
        self._logged.add(key)
        if att.core.lost:
            log.error(
                "segment %s was truncated while this process used it (by hand, or by a member "
                "of its group, who may write it): it is treated as removed. New requests go to "
                "what the name leads to now, and the %d running here end without it. Never "
                "shrink a segment; 'gateway-capacity inspect --check' names one",
                self._name,
                _running(att),
            )
            return
        log.error(
            "segment %s was removed or replaced while this process used it; new requests go "
            "to what the name leads to now, and the %d running here finish on the old one. "
            "Never remove a segment while handlers run ('gateway-capacity inspect --unlink' "
            "refuses while live holders exist)",
            self._name,
            _running(att),
        )

    def _drop_retired(self, att: _Attachment) -> None:
        """A retired attachment with nothing left running: unregister and close it (from
        its own dispatcher thread, which ends with it)."""
        with self._lock:
            if att not in self._retired or self._closing:
                return
            self._retired.remove(att)
        att.stopping = True
        with contextlib.suppress(_core.CoreError):
            att.core.unregister(IN_CORE)
        remove_doorbell(att.bell)
        att.seg.close()

    # --- reporting ------------------------------------------------------------------------
    def _report_events(self, att: _Attachment) -> None:
        repaired, damage, note = att.core.take_events()
        if repaired:
            log.warning(
                "a process died holding the segment lock; counters were repaired from the "
                "holder records"
            )
        if damage:
            self._log_once(
                f"damage:{note}",
                f"segment {self._name}: damage found and repaired ({note}); something wrote "
                "into the segment that no gateway-capacity process writes (see inspect)",
            )

    def _log_once(self, key: str, message: str) -> None:
        if key in self._logged:
            return
        self._logged.add(key)
        log.error("%s", message)


def _what_happened(att: _Attachment) -> str:
    return "truncated under this process" if att.core.lost else "removed or replaced"


def _core_of(ticket: CoreTicket) -> CoreObject:
    """The core a ticket of a slot path belongs to (always set once it arrived)."""
    core = ticket.core
    if core is None:
        raise AdmissionError("a slot without a segment")
    return core


def _running(att: _Attachment) -> int:
    """Running records of ``att``'s registration, by the segment's word."""
    try:
        running, _ = att.core.own_records()
    except _core.CoreError:
        return 0
    return int(running)


async def _finish_quietly(future: asyncio.Future[_T]) -> None:
    import asyncio

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

    __slots__ = ("_guard", "_ticket", "provider")

    def __init__(self, provider: str, ticket: CoreTicket) -> None:
        self.provider = provider
        self._ticket: CoreTicket | None = ticket
        self._guard = threading.Lock()

    @property
    def released(self) -> bool:
        return self._ticket is None or not self._ticket.live

    def _take(self) -> CoreTicket | None:
        with self._guard:
            ticket, self._ticket = self._ticket, None
            return ticket

    def __repr__(self) -> str:
        state = "released" if self.released else "held"
        return f"<Ticket provider={self.provider!r} {state}>"
