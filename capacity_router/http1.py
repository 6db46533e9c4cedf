"""The router's HTTP/1.1 server connections: deadlines, bounds and one log line.

A connection reads a request head within :data:`HEAD_TIMEOUT_S` of opening (or of
its first byte after an idle keep-alive), a body within :data:`BODY_TIMEOUT_S`, and
then hands the request to the router (:class:`Handler`). Bounds, so that idle or slow
sockets cannot take the router from its key holder:

- at most ``max_connections`` at once (from the descriptor limit, see
  :func:`connection_bounds`); one more is closed at once;
- at most ``max_unauthenticated`` held by connections that have not yet sent a request
  with the router's key: the oldest idle one of them is closed to make room, so a flood
  of idle sockets pushes out only its own;
- what each deadline closes is logged once, then counted once a minute.
"""

from __future__ import annotations

import asyncio
import logging
import os
import resource
import select
import time
from collections.abc import Callable
from typing import Protocol, cast

import msgspec

from .proxy import Answer, Exchange
from .wire import MAX_HEAD_BYTES, BadMessage, RequestHead, parse_request_head

log = logging.getLogger("capacity_router")

HEAD_TIMEOUT_S = 10.0
BODY_TIMEOUT_S = 60.0
KEEPALIVE_IDLE_S = 75.0  # an authenticated connection between requests
LEAVING_CHECK_S = 0.25  # how often a connection paused for unread bytes looks for a close
MAX_CONNECTIONS = 4096
MAX_UNAUTHENTICATED = 256
RESERVED_DESCRIPTORS = 128  # the poller, the registry, key files, logs


def connection_bounds() -> tuple[int, int]:
    """(connections, unauthenticated connections) this process can hold.

    The soft descriptor limit is raised to the hard one first (as Go does at start);
    each relayed request holds two descriptors (client and worker), and
    :data:`RESERVED_DESCRIPTORS` stay for the poller.
    """
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or hard > soft:
        wanted = 65536 if hard == resource.RLIM_INFINITY else min(hard, 65536)
        if wanted > soft:
            try:
                resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))
                soft = wanted
            except (ValueError, OSError):
                pass
    total = max(8, min(MAX_CONNECTIONS, (soft - RESERVED_DESCRIPTORS) // 2))
    return total, max(4, min(MAX_UNAUTHENTICATED, total // 4))


class Handler(Protocol):
    def on_head(self, conn: Connection, head: RequestHead) -> Answer | None:
        """An answer that ends the request before its body is read, or None."""

    def on_request(self, conn: Connection, head: RequestHead, body: bytes | bytearray) -> None:
        """Answer the request (now or later) through ``conn``."""


class Throttled:
    """A condition logged the first time, then as a count at most once a minute."""

    def __init__(self, message: str, every_s: float = 60.0) -> None:
        self._message = message
        self._every = every_s
        self._last: float | None = None
        self._count = 0

    def __call__(self) -> None:
        now = time.monotonic()
        self._count += 1
        if self._last is None:
            log.warning("%s (said once; then counted each minute)", self._message)
            self._last, self._count = now, 0
        elif now - self._last >= self._every:
            log.warning(
                "%s: %d times in the last %.0f s", self._message, self._count, now - self._last
            )
            self._last, self._count = now, 0


class Connections:
    """Every open server connection of one router, with its bounds."""

    def __init__(self, handler: Handler, max_connections: int, max_unauthenticated: int) -> None:
        self.handler = handler
        self.max_connections = max_connections
        self.max_unauthenticated = max_unauthenticated
        self.loop = asyncio.get_running_loop()  # made on it; saves a getpid() a timer
        self.open: set[Connection] = set()
        self.unauthenticated: dict[Connection, None] = {}  # oldest first
        self.over_limit = Throttled("connections over the router's limit closed at once")
        self.evicted = Throttled(
            "idle connections without the router's key closed to make room for others"
        )
        self.timed_out = Throttled(
            f"connections closed for sending no complete request within {HEAD_TIMEOUT_S:.0f} s"
        )
        self.slow_body = Throttled(
            f"connections closed for sending no complete body within {BODY_TIMEOUT_S:.0f} s"
        )

    def request_id(self) -> str:
        """16 random hex digits: nothing of the router's pid or its traffic."""
        return os.urandom(8).hex()

    def factory(self) -> Connection:
        return Connection(self)

    def close_all(self) -> None:
        for conn in list(self.open):
            conn.close()


_HEAD, _BODY, _BUSY, _CLOSED = range(4)


class Connection(asyncio.Protocol):
    """One client connection: reads requests one after the other, answers in order."""

    def __init__(self, owner: Connections) -> None:
        self._owner = owner
        self.transport: asyncio.Transport | None = None
        self.peer: str | None = None
        self.authenticated = False
        self.request_id = ""
        self.http10 = False
        self.exchange: Exchange | None = None
        self._state = _HEAD
        self._buf = bytearray()  # appended in place: a body costs its size, not its square
        self._scanned = 0  # bytes of ``_buf`` already searched for a head's end
        self._head: RequestHead | None = None
        self._keep_alive = True
        self._timer: asyncio.TimerHandle | None = None
        self._paused = False  # reading paused: pipelined bytes wait unread in the kernel
        self._blocked = False  # writing paused: the client does not read its answers
        self._watch: asyncio.TimerHandle | None = None
        self._advancing = False  # inside _advance: an answer given at once returns there

    @property
    def keep_alive(self) -> bool:
        """Whether the client keeps this connection for another request."""
        return self._keep_alive

    # -- asyncio callbacks -----------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)
        peer = transport.get_extra_info("peername")
        self.peer = peer[0] if isinstance(peer, tuple) else None
        owner = self._owner
        if len(owner.open) >= owner.max_connections:
            owner.over_limit()
            self._state = _CLOSED
            self.transport.abort()
            return
        owner.open.add(self)
        owner.unauthenticated[self] = None
        if len(owner.unauthenticated) > owner.max_unauthenticated:
            for victim in owner.unauthenticated:
                if victim._state == _HEAD and victim is not self:
                    owner.evicted()
                    victim.close()
                    break
        self._arm(HEAD_TIMEOUT_S, self._head_timeout)

    def data_received(self, data: bytes) -> None:
        if self._state == _CLOSED:
            return
        if self._state == _BUSY:  # pipelined: read when this answer ends
            self._buf += data
            if len(self._buf) > MAX_HEAD_BYTES:
                self._pause_reading()
            return
        if self._blocked:  # read before the pause took: kept for when the client reads
            self._buf += data
            self._pause_reading()
            return
        idle = self._state == _HEAD and not self._buf and self.authenticated
        self._buf += data
        self._advance()
        if idle and self._state == _HEAD and self._buf:  # idle ends: the head's deadline
            self._arm(HEAD_TIMEOUT_S, self._head_timeout)

    def eof_received(self) -> bool:
        return False  # a client that closes its side has left: close ours (frees its worker)

    def connection_lost(self, exc: Exception | None) -> None:
        self._state = _CLOSED
        self._disarm()
        if self._watch is not None:
            self._watch.cancel()
            self._watch = None
        self._owner.open.discard(self)
        self._owner.unauthenticated.pop(self, None)
        exchange, self.exchange = self.exchange, None
        if exchange is not None:
            exchange.client_lost()

    def pause_writing(self) -> None:
        self._blocked = True
        if self.exchange is not None:
            self.exchange.client_paused(paused=True)

    def resume_writing(self) -> None:
        self._blocked = False
        if self.exchange is not None:
            self.exchange.client_paused(paused=False)
        elif self._state == _HEAD:  # answers queued unread held the next requests back
            self._resume_reading()
            if self._buf:
                self._advance()

    # -- reading ---------------------------------------------------------------

    def _advance(self) -> None:
        """Take every whole request buffered, one after the other, in this loop: an
        answer given at once comes back through :meth:`answer_done`, which does not call
        here again (no recursion however many were pipelined). While the client reads no
        answers, nothing more is taken or read."""
        if self._advancing:
            return
        self._advancing = True
        try:
            self._take()
        finally:
            self._advancing = False
        if self._state == _HEAD and self._blocked:
            self._pause_reading()

    def _take(self) -> None:
        while self._state in (_HEAD, _BODY) and not self._blocked:
            if self._state == _HEAD:
                end = self._buf.find(b"\r\n\r\n", self._scanned, MAX_HEAD_BYTES + 4)
                if end < 0:
                    if len(self._buf) > MAX_HEAD_BYTES:
                        self._refuse(BadMessage("a request head over 64 KiB", 431))
                        return
                    self._scanned = max(0, len(self._buf) - 3)
                    return
                self._scanned = 0
                try:
                    head = parse_request_head(bytes(self._buf[:end]))
                except BadMessage as exc:
                    self._refuse(exc)
                    return
                del self._buf[: end + 4]
                self._head = head
                self.http10 = head.version == b"1.0"
                self._keep_alive = head.keep_alive
                self.request_id = self._owner.request_id()
                early = self._owner.handler.on_head(self, head)
                if early is not None:
                    self._keep_alive = False  # the body is not read: the framing is lost
                    self._state = _BUSY
                    self.respond(early)
                    return
                if head.get(b"expect") == b"100-continue" and head.length:
                    self._write(b"HTTP/1.1 100 Continue\r\n\r\n")
                self._state = _BODY
                if len(self._buf) < head.length:
                    self._arm(BODY_TIMEOUT_S, self._body_timeout)
            if self._head is None or len(self._buf) < self._head.length:
                return
            current = self._head
            assert current is not None
            body: bytes | bytearray
            if len(self._buf) == current.length:  # the usual case: handed over, no copy
                body, self._buf = self._buf, bytearray()
            else:
                body = bytes(self._buf[: current.length])
                del self._buf[: current.length]
            self._state = _BUSY
            self._disarm()
            self._owner.handler.on_request(self, current, body)

    def _refuse(self, exc: BadMessage) -> None:
        self.request_id = self.request_id or self._owner.request_id()
        self._keep_alive = False
        self._state = _BUSY
        self.respond(Answer(exc.status, msgspec.json.encode({"error": str(exc)})))

    # -- deadlines ---------------------------------------------------------------

    def _arm(self, seconds: float, then: Callable[[], None]) -> None:
        self._disarm()
        self._timer = self._owner.loop.call_later(seconds, then)

    def _disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _head_timeout(self) -> None:
        self._timer = None
        if self._state != _HEAD:
            return
        if not self._buf and self.authenticated:
            self.close()  # an idle keep-alive that ran out: nothing to say
            return
        self._owner.timed_out()
        self.close()

    def _idle_timeout(self) -> None:
        self._timer = None
        if self._state == _HEAD and not self._buf:
            self.close()

    def _body_timeout(self) -> None:
        self._timer = None
        if self._state == _BODY:
            self._owner.slow_body()
            self.close()

    # -- writing -------------------------------------------------------------------

    def mark_authenticated(self) -> None:
        if not self.authenticated:
            self.authenticated = True
            self._owner.unauthenticated.pop(self, None)

    def write(self, data: bytes) -> None:
        if self.transport is not None and self._state != _CLOSED:
            self.transport.write(data)

    _write = write

    def respond(self, answer: Answer, *, head_only: bool = False) -> None:
        """A whole answer of the router's own, then the next request."""
        headers = [
            b"HTTP/1.1 %d %s\r\n" % (answer.status, _REASONS.get(answer.status, b"Status")),
            b"content-type: " + answer.content_type + b"\r\n",
            b"content-length: %d\r\n" % len(answer.body),
            b"cache-control: no-store\r\n",
            b"x-router-request-id: " + self.request_id.encode() + b"\r\n",
        ]
        headers.extend(n + b": " + v + b"\r\n" for n, v in answer.headers)
        if not self._keep_alive:
            headers.append(b"connection: close\r\n")
        headers.append(b"\r\n")
        if not head_only:
            headers.append(answer.body)
        self._write(b"".join(headers))
        self.answer_done(keep_alive=True)

    def answer_done(self, *, keep_alive: bool) -> None:
        """The answer is written: read the next request, or close."""
        if self._state == _CLOSED:
            return
        if not (keep_alive and self._keep_alive):
            self._state = _CLOSED
            self._disarm()
            assert self.transport is not None
            self.transport.close()  # after what is buffered
            return
        self._state = _HEAD
        self._head = None
        if self.authenticated:
            self._arm(KEEPALIVE_IDLE_S, self._idle_timeout)
        else:
            self._arm(HEAD_TIMEOUT_S, self._head_timeout)
        if self._blocked:
            # The client does not read what it asked for: nothing more is read or
            # answered until it does (``resume_writing``), so unread answers cannot pile up.
            self._pause_reading()
            return
        self._resume_reading()
        if self._buf and not self._advancing:  # the next pipelined request, from the loop
            self._owner.loop.call_soon(self._advance_later)

    def cut(self) -> None:
        """End an answer that cannot finish: the client sees it cut, not complete."""
        self.close()

    def close(self) -> None:
        self._state = _CLOSED
        self._disarm()
        if self.transport is not None:
            self.transport.abort()

    def _advance_later(self) -> None:
        if self._state == _HEAD and not self._blocked:
            self._advance()

    def _pause_reading(self) -> None:
        if not self._paused and self.transport is not None:
            self._paused = True
            self.transport.pause_reading()
            self._watch_for_leaving()

    def _resume_reading(self) -> None:
        if self._paused and self.transport is not None:
            self._paused = False
            self.transport.resume_reading()

    def _watch_for_leaving(self) -> None:
        """While reading is paused the event loop cannot see the client leave (its close
        waits behind the unread bytes): ask the kernel, every :data:`LEAVING_CHECK_S`, so
        that a client gone with a request in flight frees its worker's slot."""
        self._watch = None
        if not self._paused or self._state == _CLOSED or self.transport is None:
            return
        if _peer_left(self.transport):
            self.close()  # connection_lost follows: the exchange is told, its worker freed
            return
        self._watch = self._owner.loop.call_later(LEAVING_CHECK_S, self._watch_for_leaving)


_LEFT = getattr(select, "POLLRDHUP", 0) | select.POLLHUP | select.POLLERR


def _peer_left(transport: asyncio.Transport) -> bool:
    """Whether the peer closed or reset the connection (Linux: ``POLLRDHUP``, seen
    before the unread bytes; elsewhere only a reset or a full hang-up)."""
    sock = transport.get_extra_info("socket")
    if sock is None:
        return False
    poller = select.poll()
    try:
        poller.register(sock.fileno(), _LEFT)
    except (OSError, ValueError):
        return True
    return bool(poller.poll(0))


_REASONS = {
    200: b"OK",
    400: b"Bad Request",
    401: b"Unauthorized",
    403: b"Forbidden",
    404: b"Not Found",
    405: b"Method Not Allowed",
    408: b"Request Timeout",
    409: b"Conflict",
    411: b"Length Required",
    413: b"Content Too Large",
    431: b"Request Header Fields Too Large",
    500: b"Internal Server Error",
    502: b"Bad Gateway",
    503: b"Service Unavailable",
    505: b"HTTP Version Not Supported",
}
