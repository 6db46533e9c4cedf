"""The router's HTTP face: ``GET /v1/capacity`` and the loopback admin (R-K5).

Two threads, two event loops. The poller (``CapacityObserver``, httpx) has its own
thread and loop, so no amount of relayed traffic can delay a round or time out a
healthy worker's poll: the snapshot is the farm's, not the relay's. The server
(``http1``: asyncio protocols, uvloop where installed) serves the endpoints below
and relays (``proxy``) on the other; it reads the poller's results as immutable
values swapped whole, and asks the poller's loop to fence, unfence or list.

Endpoints:

- ``GET /v1/capacity`` (bearer): the last snapshot, exactly the contract's
  fields (``capacity_contract``). Nothing else about workers is published: no
  URLs, ids, health, reasons, configuration or keys. 503 before the first
  round (the server only starts listening after it, so this is rare).
- ``GET /v1/load`` (bearer, read-only): the snapshot's rows, each with the
  requests this router relays to the workers serving that model now
  (``running``): what ``wait-for-slot --url ROUTER`` gates on. Model ids and
  counts only, as on ``/v1/capacity``.
- ``POST /admin/fence/{worker}`` and ``POST /admin/unfence/{worker}``
  (bearer, loopback peers only): drain or restore a worker, then run a round
  at once and answer with the new snapshot. 404 unknown worker (naming the
  registered ids), 409 for an unfence of a worker fenced in the registry file,
  403 non-loopback peer.
- ``GET /admin/workers`` (bearer, loopback peers only): the registered ids,
  what fences each (``registry``, ``admin`` or null) and the last round's
  view of it (``state``, ``slots``, ``reason``, the registered ids it does not
  serve, what it says it is doing), for ``router show``. Only the key holder
  on the router's own host sees these; no URL and never a key.
- ``GET /metrics`` (bearer, loopback peers only): the same view in Prometheus
  text (``metrics``): capacity per model, completeness, the round's time, and
  per worker its state, slots, what it says it runs and queues, and the
  requests relayed to it. It names workers, hence the admin's rule.
- The OpenAI-compatible paths (bearer): ``POST /v1/chat/completions``,
  ``/v1/completions``, ``/v1/embeddings`` relayed to a worker, ``GET
  /v1/models`` answered from the farm (``proxy``).

Every refusal is 401 with ``WWW-Authenticate: Bearer`` when the key is
missing or wrong; the compare is constant-time.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import hmac
import ipaddress
import logging
import os
import socket
import threading
from collections.abc import Awaitable, Callable, Coroutine, Iterable, Mapping
from types import TracebackType
from typing import Any, Protocol, TypeVar

import msgspec

from capacity_contract import CapacitySnapshot

from . import proxy as proxy_module
from .http1 import Connection, Connections, Handler, Throttled, connection_bounds
from .keyfile import KeyFile
from .metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from .metrics import exposition
from .pinning import http_url
from .poller import (
    DEFAULT_INTERVAL_S,
    DEFAULT_TIMEOUT_S,
    CapacityObserver,
    FencedInRegistry,
    UnknownWorker,
    WorkerStatus,
)
from .proxy import RELAYED_PATHS, Answer, FarmProxy, WorkerKey, unauthorized
from .registry import RegistryWatcher
from .wire import RequestHead

log = logging.getLogger("capacity_router")

T = TypeVar("T")


def _json(status: int, body: object, headers: tuple[tuple[bytes, bytes], ...] = ()) -> Answer:
    return Answer(status, msgspec.json.encode(body), headers)


def _not_observed_yet() -> Answer:
    """Before the first poll round: nothing to publish, ask again in a second."""
    return _json(503, {"error": "no observation yet"}, ((b"retry-after", b"1"),))


def _unauthorized_plain() -> Answer:
    return _json(401, {"error": "unauthorized"}, ((b"www-authenticate", b"Bearer"),))


def authorized(value: bytes | None, key: bytes) -> bool:
    """``Authorization: Bearer KEY`` (scheme in any case), compared in constant time."""
    if value is None:
        return False
    scheme, _, token = value.partition(b" ")
    if scheme.lower() != b"bearer":
        return False
    return hmac.compare_digest(token.strip(b" \t"), key)


def is_loopback(host: str | None) -> bool:
    if host is None:
        return False
    try:
        address = ipaddress.ip_address(host.split("%", 1)[0])
    except ValueError:
        return False
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return address.ipv4_mapped.is_loopback
    return address.is_loopback


def farm_load(
    snapshot: CapacitySnapshot,
    workers: Iterable[WorkerStatus],
    in_flight: Mapping[str, int],
    *,
    relays: bool,
) -> dict[str, object]:
    """``GET /v1/load``: per model, the farm's capacity and the requests this
    router has running on the workers that serve it (a worker serving several
    models counts its requests for each: the room is never overstated)."""
    running: dict[str, int] = {}
    for status in workers:
        for model in status.models:
            running[model] = running.get(model, 0) + in_flight.get(status.id, 0)
    return {
        "object": "inference_load",
        "complete": snapshot.complete,
        "observed_at": snapshot.observed_at,
        "relays": relays,
        "models": [
            {
                "id": row.id,
                "max_concurrent_requests": row.max_concurrent_requests,
                "running": running.get(row.id, 0),
            }
            for row in snapshot.models
        ],
    }


_GET = ("GET", "HEAD")
_ROUTES: dict[str, tuple[str, ...]] = {
    "/v1/capacity": _GET,
    "/v1/load": _GET,
    "/admin/workers": _GET,
    "/metrics": _GET,
    "/v1/models": _GET,
    **{path: ("POST",) for path in RELAYED_PATHS},
}
_ADMIN_ACTIONS = ("/admin/fence/", "/admin/unfence/")


class OnPoller(Protocol):
    """Runs a coroutine on the poller's loop; awaited on the server's."""

    def __call__(self, coro: Coroutine[Any, Any, T], /) -> Awaitable[T]: ...


class RouterApp(Handler):
    """The endpoints, on the server's loop; the poller's work goes to the poller's loop."""

    def __init__(
        self,
        observer: CapacityObserver,
        key: KeyFile,
        proxy: FarmProxy,
        poller: OnPoller,
    ) -> None:
        self._observer = observer
        self._key = key
        self._proxy = proxy
        self._on_poller = poller
        self._tasks: set[asyncio.Task[None]] = set()

    def _methods(self, path: str) -> tuple[str, ...] | None:
        if path in _ROUTES:
            return _ROUTES[path]
        if path.startswith("/v1/models/") and len(path) > len("/v1/models/"):
            return _GET
        for prefix in _ADMIN_ACTIONS:
            if path.startswith(prefix):
                rest = path[len(prefix) :]
                return ("POST",) if rest and "/" not in rest else None
        return None

    def on_head(self, conn: Connection, head: RequestHead) -> Answer | None:
        path = head.target.partition("?")[0]
        methods = self._methods(path)
        relayed = path in RELAYED_PATHS or path.startswith("/v1/models")
        if methods is None:
            return _json(404, {"error": "not found"})
        if head.method not in methods:
            return _json(
                405, {"error": "method not allowed"}, ((b"allow", ", ".join(methods).encode()),)
            )
        if (path.startswith("/admin/") or path == "/metrics") and not is_loopback(conn.peer):
            endpoint = "/metrics" if path == "/metrics" else "the admin endpoint"
            return _json(403, {"error": f"{endpoint} answers loopback clients only"})
        if not authorized(head.get(b"authorization"), self._key.key):
            return unauthorized() if relayed else _unauthorized_plain()
        conn.mark_authenticated()
        if head.length > proxy_module.MAX_REQUEST_BYTES:
            return proxy_module.too_large()
        return None

    def on_request(self, conn: Connection, head: RequestHead, body: bytes | bytearray) -> None:
        path = head.target.partition("?")[0]
        head_only = head.method == "HEAD"
        if path == "/v1/capacity":
            published = self._observer.published()
            if published is None:
                conn.respond(_not_observed_yet(), head_only=head_only)
            else:
                conn.respond(Answer(200, published[1]), head_only=head_only)
        elif path == "/v1/load":
            snapshot = self._observer.snapshot()
            if snapshot is None:
                conn.respond(_not_observed_yet(), head_only=head_only)
            else:
                load = farm_load(
                    snapshot, self._observer.workers(), self._proxy.in_flight(), relays=True
                )
                conn.respond(_json(200, load), head_only=head_only)
        elif path == "/metrics":
            text = exposition(
                self._observer.snapshot(), self._observer.workers(), self._proxy.in_flight()
            )
            conn.respond(
                Answer(200, text, content_type=METRICS_CONTENT_TYPE.encode()),
                head_only=head_only,
            )
        elif path == "/v1/models":
            conn.respond(self._proxy.models(), head_only=head_only)
        elif path.startswith("/v1/models/"):
            conn.respond(
                self._proxy.model(_unquote(path[len("/v1/models/") :])), head_only=head_only
            )
        elif path in RELAYED_PATHS:
            task = self._proxy.relay(conn, head, body)
            if task is not None:
                self._keep(task, conn.request_id)
        else:
            self._keep(
                asyncio.ensure_future(self._admin(conn, path, head_only=head_only)), conn.request_id
            )

    def _keep(self, task: asyncio.Task[None], request_id: str) -> None:
        self._tasks.add(task)

        def done(task: asyncio.Task[None]) -> None:
            self._tasks.discard(task)
            if not task.cancelled() and task.exception() is not None:
                error = task.exception()
                log.error("request %s failed: %r", request_id, error, exc_info=error)

        task.add_done_callback(done)

    async def in_flight_done(self, timeout: float) -> None:
        if self._tasks:
            await asyncio.wait(list(self._tasks), timeout=timeout)

    async def _admin(self, conn: Connection, path: str, *, head_only: bool) -> None:
        observer = self._observer
        if path == "/admin/workers":
            listed, warnings = await self._on_poller(_listed(observer))
            conn.respond(_json(200, {"workers": listed, "warnings": warnings}), head_only=head_only)
            return
        fence = path.startswith("/admin/fence/")
        worker = _unquote(path.rsplit("/", 1)[1])
        try:
            if fence:
                snapshot = await self._on_poller(observer.fence(worker))
            else:
                snapshot = await self._on_poller(observer.unfence(worker))
        except UnknownWorker:
            known = [worker_id for worker_id, _ in await self._on_poller(_fences(observer))]
            conn.respond(
                _json(
                    404,
                    {
                        "error": f"unknown worker {worker!r}; known: {', '.join(known) or 'none'}",
                        "known_workers": known,
                    },
                )
            )
            return
        except FencedInRegistry:
            conn.respond(
                _json(
                    409,
                    {
                        "error": f"worker {worker!r} is fenced in the registry file; "
                        "edit the file to restore it"
                    },
                )
            )
            return
        conn.respond(_json(200, {"worker": worker, "fenced": fence, "snapshot": snapshot}))


def _unquote(text: str) -> str:
    from urllib.parse import unquote

    return unquote(text)


async def _fences(observer: CapacityObserver) -> list[tuple[str, Any]]:
    return observer.fences()


async def _listed(observer: CapacityObserver) -> tuple[list[dict[str, object]], list[str]]:
    """Registered ids and their fences, and the registry's warnings, for ``router show``
    on this host only."""
    seen = {s.id: s for s in observer.workers()}
    listed: list[dict[str, object]] = []
    for worker_id, by in observer.fences():
        entry: dict[str, object] = {"id": worker_id, "fenced_by": by}
        status = seen.get(worker_id)
        if status is not None and status.state is not None:
            entry.update(
                state=status.state,
                slots=status.slots,
                reason=status.reason,
                unserved=list(status.unserved),
                activity=status.activity,
                unlisted=list(status.unlisted),
                request_tokens=status.request_tokens,
                running_tokens=status.running_tokens,
                tokens_from=status.tokens_from,
            )
        listed.append(entry)
    return listed, list(observer.warnings())


def _bind(host: str, port: int) -> socket.socket:
    family, kind, proto, _, address = socket.getaddrinfo(
        host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
    )[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        # Listen now: clients that connect during the first round wait in the
        # backlog instead of being refused.
        sock.listen(1024)
    except BaseException:
        sock.close()
        raise
    return sock


def _new_loop() -> asyncio.AbstractEventLoop:
    """uvloop where installed (about half the relay's CPU a request), else asyncio's."""
    try:
        import uvloop
    except ImportError:
        return asyncio.new_event_loop()
    return uvloop.new_event_loop()


def _quiet_loop_errors(loop: asyncio.AbstractEventLoop) -> None:
    """Each kind of loop error logged once, then counted (an accept() that fails for
    want of a descriptor would otherwise write a traceback a second)."""
    seen: dict[str, Throttled] = {}

    def handler(loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        message = str(context.get("message", "event loop error"))
        exc = context.get("exception")
        text = message if exc is None else f"{message}: {exc!r}"
        if message not in seen:
            seen[message] = Throttled(text)
        seen[message]()

    loop.set_exception_handler(handler)


class _LoopThread:
    """A thread running one event loop until :meth:`stop`."""

    def __init__(self, name: str, loop_factory: Callable[[], asyncio.AbstractEventLoop]) -> None:
        self.loop = loop_factory()
        _quiet_loop_errors(self.loop)
        self._thread = threading.Thread(target=self._main, name=name, daemon=True)

    def _main(self) -> None:
        asyncio.set_event_loop(self.loop)
        try:
            self.loop.run_forever()
        finally:
            self.loop.close()

    def start(self) -> None:
        self._thread.start()

    def call(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def stop(self, timeout: float = 15) -> None:
        if self._thread.is_alive():
            with _suppress():
                self.call(_cancel_the_rest()).result(timeout=timeout)
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(timeout=timeout)


async def _cancel_the_rest() -> None:
    """Every other task of this loop cancelled and awaited: a clean stop, no warnings."""
    others = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
    for task in others:
        task.cancel()
    await asyncio.gather(*others, return_exceptions=True)


class RouterServer:
    """The whole router in two background threads: the poller, and the server.

    ``start()`` loads the registry and the key (raising
    :class:`~capacity_router.registry.RegistryError` or
    :class:`~capacity_router.keyfile.KeyFileError`), runs the first round, binds,
    starts serving and returns the bound port. ``fence``/``unfence`` act like the admin
    endpoint and return the snapshot of the round they trigger. ``worker_key`` gives
    the key sent to a worker with a relayed request (by default the worker's registry
    ``keyFile``, else none). Usable as a context manager.
    """

    def __init__(
        self,
        registry_path: str | os.PathLike[str],
        key_file: str | os.PathLike[str],
        host: str = "127.0.0.1",
        port: int = 0,
        poll_interval: float = DEFAULT_INTERVAL_S,
        poll_timeout: float = DEFAULT_TIMEOUT_S,
        worker_key: WorkerKey | None = None,
    ) -> None:
        self.registry_path = os.fspath(registry_path)
        self.key_file = os.fspath(key_file)
        self.host = host
        self.port = port
        self.poll_interval = poll_interval
        self.poll_timeout = poll_timeout
        self._worker_key = worker_key
        self._observer: CapacityObserver | None = None
        self._proxy: FarmProxy | None = None
        self._app: RouterApp | None = None
        self._sock: socket.socket | None = None
        self._poller: _LoopThread | None = None
        self._server: _LoopThread | None = None
        self._poll_task: concurrent.futures.Future[None] | None = None
        self._listener: asyncio.AbstractServer | None = None
        self._connections: Connections | None = None

    def __repr__(self) -> str:
        return f"RouterServer(registry={self.registry_path!r}, url={self.url!r})"

    @property
    def url(self) -> str:
        return http_url(self.host, self.port)

    @property
    def running(self) -> bool:
        return (
            self._server is not None
            and self._server.alive
            and self._poller is not None
            and self._poller.alive
        )

    def start(self) -> int:
        if self._poller is not None:
            raise RuntimeError("RouterServer already started")
        registry = RegistryWatcher(self.registry_path)
        key = KeyFile(self.key_file)
        logged_key_error: str | None = None

        def refresh_key() -> None:  # key rotation without a restart
            nonlocal logged_key_error
            if key.refresh():
                log.info("key file re-read: new key in use")
            if key.last_error != logged_key_error:
                if key.last_error is not None:
                    log.warning("key file not re-read, keeping the current key: %s", key.last_error)
                logged_key_error = key.last_error

        observer = self._observer = CapacityObserver(
            registry,
            interval=self.poll_interval,
            timeout=self.poll_timeout,
            before_round=refresh_key,
        )
        proxy = self._proxy = FarmProxy(
            observer,
            registry,
            worker_key=self._worker_key or observer.key_for,
            connect_timeout=self.poll_timeout,
            retry_after_s=self.poll_interval,
        )
        self._poller = _LoopThread("capacity-router-poller", asyncio.new_event_loop)
        self._poller.start()
        self._server = _LoopThread("capacity-router-server", _new_loop)
        self._server.start()
        poller = self._poller

        async def on_poller(coro: Coroutine[Any, Any, T]) -> T:
            return await asyncio.wrap_future(poller.call(coro))

        self._app = RouterApp(observer, key, proxy, on_poller)
        try:
            poller.call(observer.observe()).result(timeout=self.poll_timeout * 2 + 10)
            self._poll_task = poller.call(observer.run())
        except BaseException as exc:
            self.stop()
            raise RuntimeError(f"router failed to start: {exc!r}") from exc
        try:
            self._sock = _bind(self.host, self.port)
        except OSError:  # in use, or not this host's: the caller says it in one line
            self.stop()
            raise
        try:
            self.port = self._sock.getsockname()[1]
            self._server.call(self._listen()).result(timeout=10)
        except BaseException as exc:
            self.stop()
            raise RuntimeError(f"router failed to start: {exc!r}") from exc
        log.info(
            "serving %s/v1/capacity and the OpenAI-compatible paths (%d workers)",
            self.url,
            len(registry.current.workers),
        )
        return self.port

    async def _listen(self) -> None:
        assert self._app is not None and self._sock is not None
        total, unauthenticated = connection_bounds()
        self._connections = Connections(self._app, total, unauthenticated)
        self._listener = await asyncio.get_running_loop().create_server(
            self._connections.factory, sock=self._sock, backlog=1024
        )

    async def _shutdown(self) -> None:
        if self._listener is not None:
            self._listener.close()
        if self._app is not None:
            await self._app.in_flight_done(timeout=2)
        if self._connections is not None:
            self._connections.close_all()
        if self._proxy is not None:
            self._proxy.close()
        await asyncio.sleep(0)

    async def _stop_polling(self) -> None:
        if self._observer is not None:
            await self._observer.aclose()

    def stop(self) -> None:
        if self._server is not None and self._server.alive:
            with _suppress():
                self._server.call(self._shutdown()).result(timeout=10)
            self._server.stop()
        if self._poller is not None and self._poller.alive:
            if self._poll_task is not None:
                self._poll_task.cancel()
            with _suppress():
                self._poller.call(self._stop_polling()).result(timeout=10)
            self._poller.stop()
        if self._sock is not None:
            self._sock.close()

    def __enter__(self) -> RouterServer:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    # -- Python API ---------------------------------------------------------

    def snapshot(self) -> CapacitySnapshot | None:
        """The snapshot ``GET /v1/capacity`` serves now."""
        return None if self._observer is None else self._observer.snapshot()

    def workers(self) -> tuple[WorkerStatus, ...]:
        """Per-worker local status of the last round (not published over HTTP)."""
        return () if self._observer is None else self._observer.workers()

    def in_flight(self) -> dict[str, int]:
        """Relayed requests running on each worker now (a worker absent has none)."""
        return {} if self._proxy is None else self._proxy.in_flight()

    def observe(self) -> CapacitySnapshot:
        """Run a round now and return its snapshot."""
        return self._call(lambda o: o.observe())

    def fence(self, worker_id: str) -> CapacitySnapshot:
        """Drain a worker (raises :class:`UnknownWorker`); returns the new snapshot."""
        return self._call(lambda o: o.fence(worker_id))

    def unfence(self, worker_id: str) -> CapacitySnapshot:
        """Restore a worker (raises :class:`UnknownWorker`, :class:`FencedInRegistry`)."""
        return self._call(lambda o: o.unfence(worker_id))

    def _call(
        self, action: Callable[[CapacityObserver], Coroutine[Any, Any, CapacitySnapshot]]
    ) -> CapacitySnapshot:
        observer, poller = self._observer, self._poller
        if observer is None or poller is None or not self.running:
            raise RuntimeError("RouterServer is not running")
        return poller.call(action(observer)).result(timeout=self.poll_timeout * 2 + 10)


class _suppress:
    """Stopping goes on whatever a step raised."""

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> bool:
        return True
