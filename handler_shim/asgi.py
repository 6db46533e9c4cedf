"""``AdmissionMiddleware``: one shared admission slot per HTTP request of an ASGI app.

    from handler_shim.asgi import AdmissionMiddleware
    app = AdmissionMiddleware(app, config="gateway.json", generation="gw-2.0",
                              provider="local-inference", timeout=30.0)

Plain ASGI 3 (no web framework is imported), for any ASGI server: uvicorn, or
gunicorn with uvicorn workers, with or without ``--preload``.

* **Per worker process.** The ``Admission`` is attached in the process that
  serves, after the fork: at lifespan startup, or at the first request when
  the server sends no lifespan. It is closed at lifespan shutdown (else at
  interpreter exit). A startup that cannot attach (config unreadable, segment
  of another layout) fails the lifespan with a one-line message, so a server
  with lifespan on refuses to start instead of serving unadmitted.
  ``generation`` may be a callable, evaluated at that attach: under
  gunicorn's ``HUP`` with ``--preload`` the app object is the old one, but
  new workers can still read a new label (from the environment, say).
* **The slot** (SPEC R-A1..R-A4) is taken before the wrapped app runs and
  released when the last body message has been sent (streamed bodies and
  SSE included), or when the app returns or raises, whichever comes first.
  A client that goes away during the response ends the app's sends; an ASGI
  app (Starlette's streaming response does) then returns, and the slot goes.
* **Waiting.** While the request waits for a slot, the middleware reads the
  request messages itself (buffering the body, which it hands to the app
  unchanged), so it sees ``http.disconnect``: a client that goes away while
  waiting leaves the queue at once (R-A4) and the app never runs.
* **Refusals.** ``QueueFull`` answers 429, ``AdmissionTimeout`` 503, any other
  admission error (unknown provider, attach failure) 503, each with
  ``Retry-After`` and an OpenAI-style JSON error body:
  ``{"error": {"message", "type", "param", "code"}}``.
* **Pass-through.** Requests for which ``provider(scope)`` returns None
  (health checks, model lists), websocket and other scopes go to the app
  untouched.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
from collections.abc import Awaitable, Callable, MutableMapping
from contextlib import AbstractAsyncContextManager
from typing import Any

from handler_shim.admission import Admission, AdmissionError, AdmissionTimeout, QueueFull

log = logging.getLogger("gateway_capacity.asgi")

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]
ProviderChoice = str | Callable[[Scope], str | None] | None
Generation = str | Callable[[], str]


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
        retry_after: int = 1,
    ) -> None:
        if config is None and segment is None and not os.environ.get("GATEWAY_CAPACITY_SEGMENT"):
            raise ValueError("AdmissionMiddleware needs config= or segment=")
        if retry_after < 0:
            raise ValueError("retry_after must be >= 0 seconds")
        self.app = app
        self.config = config
        self.segment = segment
        self.generation = generation
        self.provider = provider
        self.timeout = timeout
        self.retry_after = retry_after
        self._admission: Admission | None = None
        self._pid = 0  # the process _admission was attached in
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
            self._admission, self._pid = adm, pid
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
    def _provider_for(self, scope: Scope) -> str | None:
        if self.provider is None or isinstance(self.provider, str):
            return self.provider
        return self.provider(scope)

    async def _http(self, scope: Scope, receive: Receive, send: Send) -> None:
        provider = self._provider_for(scope)
        if provider is None:
            await self.app(scope, receive, send)
            return
        try:
            adm = await self.attach()
        except Exception as exc:
            self._log_once(_attach_error(exc))
            await self._refuse(send, 503, "admission_unavailable", _attach_error(exc))
            return
        pump = _RequestPump(receive)
        pump.start()
        try:
            slot = adm.slot(provider, timeout=self.timeout)
            try:
                admitted = await pump.acquire_unless_gone(slot)
            except QueueFull as exc:
                await self._refuse(send, 429, "queue_full", str(exc))
                return
            except AdmissionTimeout:
                await self._refuse(
                    send,
                    503,
                    "admission_timeout",
                    f"provider {provider}: no slot became free within {self.timeout:g} s",
                )
                return
            except AdmissionError as exc:
                self._log_once(f"admission failed for provider {provider}: {exc}")
                await self._refuse(send, 503, "admission_error", str(exc))
                return
            if not admitted:
                return  # the client went away while waiting: it left the queue (R-A4)
            await self._run_admitted(scope, pump, send, slot)
        finally:
            await pump.stop()

    async def _run_admitted(
        self, scope: Scope, pump: _RequestPump, send: Send, slot: AbstractAsyncContextManager[None]
    ) -> None:
        released = False

        async def release() -> None:
            nonlocal released
            if not released:
                released = True
                await slot.__aexit__(None, None, None)

        async def admitted_send(message: Message) -> None:
            await send(message)
            if message["type"] == "http.response.body" and not message.get("more_body", False):
                await release()  # the response is fully sent: the slot goes now

        try:
            await self.app(scope, pump.receive, admitted_send)
        finally:
            await release()

    async def _refuse(self, send: Send, status: int, code: str, message: str) -> None:
        kind = "rate_limit_error" if status == 429 else "service_unavailable_error"
        body = json.dumps(
            {"error": {"message": message, "type": kind, "param": None, "code": code}}
        ).encode()
        await send(
            {
                "type": "http.response.start",
                "status": status,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(body)).encode()),
                    (b"retry-after", str(self.retry_after).encode()),
                    (b"cache-control", b"no-store"),
                ],
            }
        )
        await send({"type": "http.response.body", "body": body, "more_body": False})

    def _log_once(self, text: str) -> None:
        if text not in self._logged:
            self._logged.add(text)
            log.error("%s", text)


def _attach_error(exc: BaseException) -> str:
    text = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    return f"gateway-capacity: cannot attach admission: {text}"


class _RequestPump:
    """The only reader of the server's ``receive``: it forwards every message to the app.

    Reading ahead lets the middleware see ``http.disconnect`` while the request
    waits for a slot. Messages are never dropped: a task that is cancelled just
    after its ``receive()`` completed would lose that message, so this task is
    not cancelled while the request lives; it ends by itself after the
    disconnect (the last message of a request) and is only cancelled at stop().
    """

    def __init__(self, receive: Receive) -> None:
        self._receive = receive
        self._queue: asyncio.Queue[Message] = asyncio.Queue()
        self.disconnected = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def _run(self) -> None:
        while True:
            message = await self._receive()
            self._queue.put_nowait(message)
            if message["type"] == "http.disconnect":
                self.disconnected.set()
                return

    async def receive(self) -> Message:
        if self._task is not None and self._task.done() and self._queue.empty():
            exc = None if self._task.cancelled() else self._task.exception()
            if exc is not None:
                raise exc
            return {"type": "http.disconnect"}  # nothing follows a disconnect
        return await self._queue.get()

    async def acquire_unless_gone(self, slot: AbstractAsyncContextManager[None]) -> bool:
        """Enter ``slot`` unless the client goes away first: True when the slot is held.

        Raises what entering raises (``QueueFull``, ``AdmissionTimeout``...).
        """
        acquiring = asyncio.ensure_future(slot.__aenter__())
        gone = asyncio.ensure_future(self.disconnected.wait())
        try:
            await asyncio.wait({acquiring, gone}, return_when=asyncio.FIRST_COMPLETED)
        except BaseException:  # we are cancelled ourselves: the wait must not outlive us
            acquiring.cancel()
            with contextlib.suppress(BaseException):
                await acquiring
                await slot.__aexit__(None, None, None)
            raise
        finally:
            gone.cancel()
        if acquiring.done():
            acquiring.result()
            return True
        # Gone while waiting: cancelling the wait frees the record (R-A4).
        acquiring.cancel()
        try:
            await acquiring
        except (asyncio.CancelledError, AdmissionError):
            return False
        # The grant came before the cancel could land: the slot is ours; hand it back.
        await slot.__aexit__(None, None, None)
        return False

    async def stop(self) -> None:
        if self._task is not None and not self._task.done():
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task
