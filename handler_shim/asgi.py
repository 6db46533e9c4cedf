"""``AdmissionMiddleware``: one shared admission slot per HTTP request of an ASGI app.

    from handler_shim.asgi import AdmissionMiddleware, by_model
    app = AdmissionMiddleware(app, config="gateway.json", generation="gw-2.0",
                              provider=by_model, timeout=30.0)

Plain ASGI 3 (no web framework is imported), for any ASGI server: uvicorn, or
gunicorn with uvicorn workers, with or without ``--preload``.

* **Per worker process.** The ``Admission`` is attached in the process that
  serves, after the fork: at lifespan startup, or at the first request when
  the server sends no lifespan. It is closed at lifespan shutdown (else at
  interpreter exit). A startup that cannot attach (config unreadable, segment
  of another layout) fails the lifespan with a one-line message, so a server
  with lifespan on refuses to start instead of serving unadmitted (a gunicorn
  uvicorn worker then exits with gunicorn's worker boot error, 3, and the
  master stops with the reason instead of restarting it).
  ``generation`` may be a callable, evaluated at that attach: under
  gunicorn's ``HUP`` with ``--preload`` the app object is the old one, but
  new workers can still read a new label (from the environment, say).
* **Which provider.** ``provider=`` is a provider id, a function of the ASGI
  scope, or :data:`by_model`, which reads the request's model where the wrapped
  application reads it (a route table, LiteLLM's proxy by default: the path of its
  Azure- and engine-style routes or the query string, else the form or JSON body) and
  refuses an inference request whose model cannot be read (see :class:`ByModel`).
  None means "not admitted".
* **The slot** (SPEC R-A1..R-A4) is taken before the wrapped app runs and
  released when the last body message has been sent (streamed bodies and
  SSE included), or when the app returns or raises, whichever comes first.
  A client that goes away during the response ends the app's sends; an ASGI
  app (Starlette's streaming response does) then returns, and the slot goes.
* **Two paths.** When a slot is free at once (one try-lock step,
  ``Admission.try_acquire``), the app runs at once with the server's own
  ``receive``: no task, no future, no queue. Only a request that must wait
  gets a reader task, which reads the request's messages while it waits (so it
  sees ``http.disconnect``: a client that goes away while waiting leaves the
  queue at once, R-A4, and the app never runs) and hands the app what it read
  ahead, unchanged, before the server's ``receive`` takes over again.
* **The grant.** An admitted request's scope carries
  ``scope["gateway_capacity.grant"]``, a :class:`Grant` (provider, and the
  monotonic times the request arrived and was admitted), which an app that
  forwards the request may pass on (``Grant.header()``), so the upstream can
  judge each request against the limit in force when it was admitted.
* **Refusals.** ``QueueFull`` answers 429, ``AdmissionTimeout`` 503, any other
  admission error (unknown provider, attach failure) 503, each with
  ``Retry-After`` and an OpenAI-style JSON error body:
  ``{"error": {"message", "type", "param", "code"}}``. ``Retry-After`` is the
  provider's drain estimate (``Admission.retry_after``: mean hold time x queue
  ahead / limit, clamped to 1..60 s) unless ``retry_after=`` fixes it.
* **Tokens** (docs/DESIGN.md section 6c). A request whose JSON body :data:`by_model`
  read is charged its prompt's estimate (``capacity_contract.tokens``, the one the
  router's relay judges by too, with its stated margin: docs/router.md) plus
  its ``max_tokens`` (or ``max_completion_tokens``; none: the most one request of the
  provider may hold, when published). A request that no worker could hold is answered
  **400** ``context_length_exceeded`` naming the numbers, at once, never queued.
  ``charge_tokens=False`` admits on slots alone.
* **Which class.** ``admission_class=`` (docs/classes.md) is a class name, a function
  of the scope, or a :class:`ClassMap` (from a header, a path prefix or the caller's
  key); None, or a name the provider lacks, is the provider's default class.
* **Pass-through.** Requests for which the provider is None (health checks,
  model lists, models no provider names), websocket and other scopes go to the
  app untouched.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import time
from collections import deque
from collections.abc import Awaitable, Callable
from typing import Any, Final, NamedTuple

from capacity_contract.tokens import Charge
from handler_shim.admission import Admission, Ticket
from handler_shim.model_choice import (
    CHARGE_KEY,
    ByModel,
    Message,
    ModelMap,
    Receive,
    Refusal,
    Scope,
    by_model,
)
from shm_layout.errors import AdmissionError, AdmissionTimeout, QueueFull, RequestTooLarge

__all__ = [
    "GRANT_HEADER",
    "GRANT_KEY",
    "AdmissionMiddleware",
    "ByModel",
    "ClassMap",
    "Grant",
    "ModelMap",
    "ProviderChoice",
    "by_model",
]

log = logging.getLogger("gateway_capacity.asgi")

Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]
Generation = str | Callable[[], str]

GRANT_KEY: Final = "gateway_capacity.grant"  # the scope key of an admitted request's Grant
GRANT_HEADER: Final = "x-gateway-capacity-grant"

_forks = [0]  # forks seen by this process: a forked child must attach anew (cheaper than getpid)
os.register_at_fork(after_in_child=lambda: _forks.__setitem__(0, _forks[0] + 1))


class Grant(NamedTuple):
    """What an admitted request carries in its scope: the provider whose slot it holds and
    the host's monotonic clock (``time.monotonic()``, one clock for every process of the
    host) when the request arrived at the middleware and when it was admitted. The slot was
    granted at some instant of ``[asked, granted]``. Nothing secret."""

    provider: str
    asked: float
    granted: float

    def header(self) -> str:
        """The value of ``x-gateway-capacity-grant`` for an app to pass upstream."""
        return f"provider={self.provider}; asked={self.asked:.6f}; granted={self.granted:.6f}"

    @classmethod
    def parse(cls, value: str) -> Grant:
        """The inverse of :meth:`header` (for an upstream); ValueError when malformed."""
        fields = dict(part.strip().partition("=")[::2] for part in value.split(";"))
        return cls(fields["provider"], float(fields["asked"]), float(fields["granted"]))


ProviderChoice = str | Callable[[Scope], str | None] | ByModel | None


class ClassMap:
    """A request's admission class (docs/classes.md) from, in this order: the value of
    ``header`` (only behind a proxy that sets or strips it: a client could claim any
    class), the longest of ``paths`` that prefixes the request path, the caller's key
    (``Authorization: Bearer KEY`` or ``x-api-key``) in ``keys``; else None (the
    provider's default class). Keys are compared whole and never logged."""

    __slots__ = ("_header", "_keys", "_paths")

    def __init__(
        self,
        *,
        header: str | None = None,
        paths: dict[str, str] | None = None,
        keys: dict[str, str] | None = None,
    ) -> None:
        self._header = header.lower().encode("latin-1") if header else None
        self._paths = sorted((paths or {}).items(), key=lambda item: -len(item[0]))
        self._keys = dict(keys or {})

    def __repr__(self) -> str:
        return (
            f"ClassMap(header={self._header!r}, paths={len(self._paths)}, keys={len(self._keys)})"
        )

    def __call__(self, scope: Scope) -> str | None:
        key = None
        for name, value in scope.get("headers", ()):
            if self._header is not None and name == self._header:
                return str(value.decode("latin-1").strip())
            if name == b"authorization" and value[:7].lower() == b"bearer ":
                key = value[7:].decode("latin-1").strip()
            elif name == b"x-api-key" and key is None:
                key = value.decode("latin-1").strip()
        path = scope.get("path", "")
        for prefix, cls in self._paths:
            if path.startswith(prefix):
                return cls
        return self._keys.get(key) if key is not None else None


ClassChoice = str | Callable[[Scope], str | None] | None


class _StartupFailed(Exception):
    """Raised into the wrapped app's lifespan after startup failure was reported."""


class AdmissionMiddleware:
    """Admit each HTTP request of ``app`` through the shared segment (SPEC section 8)."""

    def __init__(
        self,
        app: ASGIApp,
        *,
        config: str | os.PathLike[str] | None = None,
        segment: str | None = None,
        generation: Generation = "asgi",
        provider: ProviderChoice,
        timeout: float | None = 30.0,
        retry_after: int | None = None,
        admission_class: ClassChoice = None,
        charge_tokens: bool = True,
    ) -> None:
        if config is None and segment is None and not os.environ.get("GATEWAY_CAPACITY_SEGMENT"):
            raise ValueError("AdmissionMiddleware needs config= or segment=")
        if retry_after is not None and retry_after < 0:
            raise ValueError("retry_after must be >= 0 seconds (or None: the drain estimate)")
        self.app = app
        self.config = config
        self.segment = segment
        self.generation = generation
        self.provider = provider
        self.timeout = timeout
        self.retry_after = retry_after
        self.admission_class = admission_class
        self.charge_tokens = charge_tokens
        self._models: ModelMap | None = None
        if isinstance(provider, ByModel):
            source = provider.config if provider.config is not None else config
            if source is None:
                raise ValueError("provider=by_model needs the gateway config (config=)")
            self._models = ModelMap(source)
        self._admission: Admission | None = None
        self._pid = 0  # the process _admission was attached in
        self._forks = -1  # _forks[0] when it was attached
        self._attaching: asyncio.Lock | None = None
        self._attach_lock_pid = 0
        self._logged: set[str] = set()

    # --- ASGI entry -------------------------------------------------------------------
    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        kind = scope["type"]
        if kind == "http":
            await self._http(scope, receive, send)
        elif kind == "lifespan":
            await self._lifespan(scope, receive, send)
        else:  # websocket, and anything newer: not admitted
            await self.app(scope, receive, send)

    # --- attach / detach, per process -------------------------------------------------
    @property
    def admission(self) -> Admission | None:
        """This process's attachment, or None before the first attach (or after a fork)."""
        if self._admission is not None and self._pid == os.getpid():
            return self._admission
        return None

    def _label(self) -> str:
        return self.generation() if callable(self.generation) else self.generation

    async def attach(self) -> Admission:
        """Attach in this process (once; a forked child attaches anew)."""
        current = self.admission
        if current is not None:
            return current
        pid = os.getpid()
        if self._attaching is None or self._attach_lock_pid != pid:
            self._attaching, self._attach_lock_pid = asyncio.Lock(), pid
        async with self._attaching:
            current = self.admission
            if current is not None:
                return current
            label = self._label()
            # Attaching takes the segment lock and starts threads: off the event loop.
            adm = await asyncio.to_thread(
                Admission.attach, config=self.config, generation=label, segment=self.segment
            )
            # A copy inherited over fork belongs to the parent: not ours to close.
            self._admission, self._pid, self._forks = adm, pid, _forks[0]
            log.info(
                "admission attached: segment %s, generation %s, pid %d",
                adm.segment_name,
                label,
                pid,
            )
            return adm

    async def detach(self) -> None:
        adm = self.admission
        self._admission = None
        if adm is not None:
            await asyncio.to_thread(adm.close)

    async def _lifespan(self, scope: Scope, receive: Receive, send: Send) -> None:
        attached_here = failed = False

        async def lifespan_receive() -> Message:
            nonlocal attached_here, failed
            message = await receive()
            if message["type"] == "lifespan.startup":
                try:
                    await self.attach()
                    attached_here = True
                except Exception as exc:
                    failed = True
                    await send({"type": "lifespan.startup.failed", "message": _attach_error(exc)})
                    raise _StartupFailed from None
            return message

        async def lifespan_send(message: Message) -> None:
            if failed:
                return  # the failure is reported; an app that reports its own is not heard
            if message["type"] in (
                "lifespan.startup.failed",
                "lifespan.shutdown.complete",
                "lifespan.shutdown.failed",
            ):
                await self.detach()
            await send(message)

        try:
            await self.app(scope, lifespan_receive, lifespan_send)
        except _StartupFailed:
            return
        finally:
            # An app whose lifespan ended early (or raised) leaves nothing attached by it;
            # requests attach again lazily if the server goes on serving.
            if attached_here:
                await self.detach()

    # --- HTTP -------------------------------------------------------------------------
    async def _http(self, scope: Scope, receive: Receive, send: Send) -> None:
        asked = time.monotonic()
        choice = self.provider
        if choice is None or isinstance(choice, str):
            provider = choice
        elif isinstance(choice, ByModel):
            try:
                assert self._models is not None
                chosen = await choice.choose(self._models, scope, receive)
            except Refusal as refusal:
                await _answer(send, refusal.status, refusal.code, str(refusal), None)
                return
            if chosen is None:
                return  # the client went away while its body was read: nothing was asked
            provider, receive = chosen
        else:
            provider = choice(scope)
        if provider is None:
            await self.app(scope, receive, send)
            return
        adm = self._admission
        if adm is None or self._forks != _forks[0]:
            try:
                adm = await self.attach()
            except Exception as exc:
                self._log_once(_attach_error(exc))
                await _answer(send, 503, "admission_unavailable", _attach_error(exc), self._hint())
                return
        waiting: _Waiting | None = None
        chooser = self.admission_class
        cls = chooser if chooser is None or isinstance(chooser, str) else chooser(scope)
        charge = scope.pop(CHARGE_KEY, None)
        try:
            try:
                tokens = self._tokens(adm, provider, charge)
                # the fast path: one try-lock step
                ticket = adm.try_acquire(provider, cls=cls, tokens=tokens)
                if ticket is None:  # it must wait: read the request meanwhile (R-A4)
                    waiting = _Waiting(receive)
                    ticket = await waiting.acquire(adm, provider, self.timeout, cls, tokens)
                    if ticket is None:
                        return  # the client went away while waiting: it left the queue
                    receive = waiting.receive
            except QueueFull as exc:
                await _answer(send, 429, "queue_full", str(exc), self._hint(adm, provider))
                return
            except RequestTooLarge as exc:  # no worker could hold it: retrying will not help
                await _answer(send, 400, "context_length_exceeded", str(exc), None)
                return
            except AdmissionTimeout:
                message = f"provider {provider}: no slot became free within {self.timeout:g} s"
                await _answer(send, 503, "admission_timeout", message, self._hint(adm, provider))
                return
            except AdmissionError as exc:
                self._log_once(f"admission failed for provider {provider}: {exc}")
                await _answer(send, 503, "admission_error", str(exc), self._hint(adm, provider))
                return
            scope[GRANT_KEY] = Grant(provider, asked, time.monotonic())
            await self._run_admitted(adm, ticket, scope, receive, send)
        finally:
            if waiting is not None:
                await waiting.stop()

    async def _run_admitted(
        self, adm: Admission, ticket: Ticket, scope: Scope, receive: Receive, send: Send
    ) -> None:
        async def admitted_send(message: Message) -> None:
            await send(message)
            if message["type"] == "http.response.body" and not message.get("more_body", False):
                adm.release(ticket)  # the response is fully sent: the slot goes now

        try:
            await self.app(scope, receive, admitted_send)
        finally:
            adm.release(ticket)  # idempotent

    def _tokens(self, adm: Admission, provider: str, charge: Charge | None) -> int:
        """What the request is charged in tokens (0: slots alone)."""
        if charge is None or not self.charge_tokens:
            return 0
        limit = adm.request_token_limit(provider) if charge.generated is None else None
        return charge.tokens(limit)

    def _hint(self, adm: Admission | None = None, provider: str | None = None) -> int:
        """Retry-After: fixed by ``retry_after=``, else the provider's drain estimate."""
        if self.retry_after is not None:
            return self.retry_after
        if adm is None or provider is None:
            return 1
        try:
            return adm.retry_after(provider)
        except AdmissionError:
            return 1

    def _log_once(self, text: str) -> None:
        if text not in self._logged:
            self._logged.add(text)
            log.error("%s", text)


async def _answer(send: Send, status: int, code: str, message: str, retry: int | None) -> None:
    """An OpenAI-style JSON error; ``Retry-After`` when ``retry`` is not None."""
    if status == 429:
        kind = "rate_limit_error"
    elif status >= 500:
        kind = "service_unavailable_error"
    else:
        kind = "invalid_request_error"
    body = json.dumps(
        {"error": {"message": message, "type": kind, "param": None, "code": code}}
    ).encode()
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
        (b"cache-control", b"no-store"),
    ]
    if retry is not None:
        headers.append((b"retry-after", str(retry).encode()))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})


def _attach_error(exc: BaseException) -> str:
    text = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    return f"gateway-capacity: cannot attach admission: {text}"


class _Waiting:
    """A request that must wait for its slot: its messages are read ahead meanwhile.

    One task reads the server's ``receive`` while the request waits, so that an
    ``http.disconnect`` is seen at once. Messages are never dropped: the task is not
    cancelled while it may hold a message (a task cancelled just after its ``receive()``
    completed would lose it); once the request is admitted it finishes the read in
    progress and stops, and :meth:`receive` hands the app what was read ahead, then the
    server's ``receive`` directly.
    """

    def __init__(self, receive: Receive) -> None:
        self._receive = receive
        self._read: deque[Message] = deque()
        self._reading = True
        loop = asyncio.get_running_loop()
        self._gone: asyncio.Future[None] = loop.create_future()
        self._task: asyncio.Task[None] | None = loop.create_task(self._run())

    async def _run(self) -> None:
        while self._reading:
            message = await self._receive()
            self._read.append(message)
            if message["type"] == "http.disconnect":
                if not self._gone.done():
                    self._gone.set_result(None)
                return

    async def acquire(
        self,
        adm: Admission,
        provider: str,
        timeout: float | None,
        cls: str | None = None,
        tokens: int = 0,
    ) -> Ticket | None:
        """Queue for a slot unless the client goes away first: the ticket, or None when it
        went away (its place freed, R-A4). Raises what ``acquire`` raises."""
        acquiring = asyncio.ensure_future(adm.acquire(provider, timeout, cls=cls, tokens=tokens))
        race: set[asyncio.Future[Any]] = {acquiring, self._gone}
        try:
            await asyncio.wait(race, return_when=asyncio.FIRST_COMPLETED)
        except BaseException:  # we are cancelled ourselves: the wait must not outlive us
            acquiring.cancel()
            with contextlib.suppress(BaseException):
                adm.release(await acquiring)
            raise
        if acquiring.done():
            self._reading = False  # the read in progress is the last one
            return acquiring.result()
        # Gone while waiting: cancelling the wait frees the record (R-A4).
        acquiring.cancel()
        try:
            ticket = await acquiring
        except (asyncio.CancelledError, AdmissionError):
            return None
        adm.release(ticket)  # the grant came before the cancel could land: hand it back
        return None

    async def receive(self) -> Message:
        while True:
            if self._read:
                return self._read.popleft()
            task = self._task
            if task is None:
                return await self._receive()
            if not task.done():
                # Shielded: a cancelled receive() must not cancel a read that may complete.
                await asyncio.wait({task})
                continue
            self._task = None
            failure = None if task.cancelled() else task.exception()
            if failure is not None:
                raise failure

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None and not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
