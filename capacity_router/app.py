"""The router's HTTP face: ``GET /v1/capacity`` and the loopback admin (R-K5).

Why starlette + uvicorn rather than the standard library: both are already
dependencies of the package, they are well kept, and they give us a
maintained HTTP/1.1 parser (h11) with request limits, keep-alive handling and
graceful shutdown, which ``http.server`` (documented as not for production)
would leave to us. The poller is asyncio (httpx) anyway, so handlers and
rounds share one event loop and need no locks between them.

Endpoints:

- ``GET /v1/capacity`` (bearer): the last snapshot, exactly the contract's
  fields (``sidecar.contract``). Nothing else about workers is published: no
  URLs, ids, health, reasons, configuration or keys. 503 before the first
  round (the server only starts listening after it, so this is rare).
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
- The OpenAI-compatible paths (bearer): ``POST /v1/chat/completions``,
  ``/v1/completions``, ``/v1/embeddings`` relayed to a worker, ``GET
  /v1/models`` answered from the farm (``proxy``).

Every refusal is 401 with ``WWW-Authenticate: Bearer`` when the key is
missing or wrong; the compare is constant-time.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import ipaddress
import logging
import os
import socket
import threading
from collections.abc import Awaitable, Callable
from types import TracebackType

import msgspec
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from sidecar.contract import CapacitySnapshot

from .keyfile import KeyFile
from .poller import (
    DEFAULT_INTERVAL_S,
    DEFAULT_TIMEOUT_S,
    CapacityObserver,
    FencedInRegistry,
    UnknownWorker,
    WorkerStatus,
)
from .proxy import FarmProxy, WorkerKey
from .proxy import routes as proxy_routes
from .registry import RegistryWatcher

log = logging.getLogger("capacity_router")

_NO_STORE = {"Cache-Control": "no-store"}
# Connections and tasks at once: every relayed request holds one for its whole answer.
MAX_CONCURRENCY = 1024


def _json(status: int, body: object, headers: dict[str, str] | None = None) -> Response:
    return Response(
        msgspec.json.encode(body),
        status_code=status,
        media_type="application/json",
        headers={**_NO_STORE, **(headers or {})},
    )


def _unauthorized() -> Response:
    return _json(401, {"error": "unauthorized"}, {"WWW-Authenticate": "Bearer"})


def _authorized(request: Request, key: bytes) -> bool:
    value = request.headers.get("authorization")
    if value is None:
        return False
    scheme, _, token = value.partition(" ")
    if scheme.lower() != "bearer":
        return False
    # Starlette decodes header bytes as latin-1, so this round-trips exactly.
    return hmac.compare_digest(token.strip(" \t").encode("latin-1"), key)


def _is_loopback_peer(request: Request) -> bool:
    if request.client is None:
        return False
    try:
        address = ipaddress.ip_address(request.client.host)
    except ValueError:
        return False
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return address.ipv4_mapped.is_loopback
    return address.is_loopback


def build_app(
    observer: CapacityObserver, key: KeyFile, proxy: FarmProxy | None = None
) -> Starlette:
    async def capacity(request: Request) -> Response:
        if not _authorized(request, key.key):
            return _unauthorized()
        published = observer.published()
        if published is None:
            return _json(503, {"error": "no observation yet"}, {"Retry-After": "1"})
        return Response(published[1], media_type="application/json", headers=_NO_STORE)

    def admin(
        action: Callable[[str], Awaitable[CapacitySnapshot]], *, fenced: bool
    ) -> Callable[[Request], Awaitable[Response]]:
        async def endpoint(request: Request) -> Response:
            if not _is_loopback_peer(request):
                return _json(403, {"error": "the admin endpoint answers loopback clients only"})
            if not _authorized(request, key.key):
                return _unauthorized()
            worker = request.path_params["worker"]
            try:
                snapshot = await action(worker)
            except UnknownWorker:
                known = [worker_id for worker_id, _ in observer.fences()]
                return _json(
                    404,
                    {
                        "error": f"unknown worker {worker!r}; known: {', '.join(known) or 'none'}",
                        "known_workers": known,
                    },
                )
            except FencedInRegistry:
                return _json(
                    409,
                    {
                        "error": f"worker {worker!r} is fenced in the registry file; "
                        "edit the file to restore it"
                    },
                )
            return _json(200, {"worker": worker, "fenced": fenced, "snapshot": snapshot})

        return endpoint

    async def workers(request: Request) -> Response:
        """Registered ids and their fences, for ``router show`` on this host only."""
        if not _is_loopback_peer(request):
            return _json(403, {"error": "the admin endpoint answers loopback clients only"})
        if not _authorized(request, key.key):
            return _unauthorized()
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
                )
            listed.append(entry)
        return _json(200, {"workers": listed})

    app = Starlette(
        routes=[
            Route("/v1/capacity", capacity, methods=["GET"]),
            Route("/admin/workers", workers, methods=["GET"]),
            Route("/admin/fence/{worker}", admin(observer.fence, fenced=True), methods=["POST"]),
            Route(
                "/admin/unfence/{worker}", admin(observer.unfence, fenced=False), methods=["POST"]
            ),
            *(() if proxy is None else proxy_routes(proxy, lambda r: _authorized(r, key.key))),
        ]
    )
    # Exact paths only: a redirect for "/v1/capacity/" would be a 3xx the probe refuses anyway.
    app.router.redirect_slashes = False
    return app


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
        sock.listen(128)
    except BaseException:
        sock.close()
        raise
    return sock


class RouterServer:
    """The whole router in a background thread: registry, poller, HTTP server.

    ``start()`` loads the registry and the key (raising
    :class:`~capacity_router.registry.RegistryError` or
    :class:`~capacity_router.keyfile.KeyFileError`), binds, runs the first
    round, starts serving and returns the bound port. ``fence``/``unfence``
    act like the admin endpoint and return the snapshot of the round they
    trigger. ``worker_key`` gives the key sent to a worker with a relayed
    request (by default the worker's registry ``keyFile``, else none). Usable as
    a context manager.
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
        self._server: uvicorn.Server | None = None
        self._sock: socket.socket | None = None
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._ready = threading.Event()
        self._error: BaseException | None = None

    def __repr__(self) -> str:
        return f"RouterServer(registry={self.registry_path!r}, url={self.url!r})"

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def start(self) -> int:
        if self._thread is not None:
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

        self._observer = CapacityObserver(
            registry,
            interval=self.poll_interval,
            timeout=self.poll_timeout,
            before_round=refresh_key,
        )
        self._proxy = FarmProxy(
            self._observer,
            registry,
            worker_key=self._worker_key or self._observer.key_for,
            connect_timeout=self.poll_timeout,
            retry_after_s=self.poll_interval,
        )
        self._sock = _bind(self.host, self.port)
        self.port = self._sock.getsockname()[1]
        config = uvicorn.Config(
            build_app(self._observer, key, self._proxy),
            lifespan="off",
            log_config=None,
            log_level="warning",
            access_log=False,
            server_header=False,
            http="h11",
            loop="asyncio",
            limit_concurrency=MAX_CONCURRENCY,
            timeout_graceful_shutdown=2,
        )
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(
            target=self._thread_main, name="capacity-router", daemon=True
        )
        self._thread.start()
        self._ready.wait()
        if self._error is not None:
            self.stop()
            raise RuntimeError(f"router failed to start: {self._error!r}") from self._error
        log.info(
            "serving %s/v1/capacity and the OpenAI-compatible paths (%d workers)",
            self.url,
            len(registry.current.workers),
        )
        return self.port

    def stop(self) -> None:
        if self._server is not None:
            self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout=15)
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
        self, action: Callable[[CapacityObserver], Awaitable[CapacitySnapshot]]
    ) -> CapacitySnapshot:
        observer, loop = self._observer, self._loop
        if observer is None or loop is None or not self.running:
            raise RuntimeError("RouterServer is not running")

        async def call() -> CapacitySnapshot:
            return await action(observer)

        future = asyncio.run_coroutine_threadsafe(call(), loop)
        return future.result(timeout=self.poll_timeout * 2 + 10)

    # -- the background thread ----------------------------------------------

    def _thread_main(self) -> None:
        try:
            asyncio.run(self._serve())
        except BaseException as exc:  # reported by start(); the thread must not die silently
            self._error = exc
            log.error("router stopped: %r", exc)
        finally:
            self._ready.set()

    async def _serve(self) -> None:
        observer, server, sock, proxy = self._observer, self._server, self._sock, self._proxy
        assert observer is not None and server is not None and sock is not None
        assert proxy is not None
        self._loop = asyncio.get_running_loop()
        poll: asyncio.Task[None] | None = None
        try:
            await observer.observe()
            poll = asyncio.create_task(observer.run())
            serve = asyncio.create_task(server.serve(sockets=[sock]))
            while not server.started and not serve.done():
                await asyncio.sleep(0.01)
            if not serve.done():
                self._ready.set()
            await serve
        finally:
            if poll is not None:
                poll.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await poll
            await proxy.aclose()
            await observer.aclose()
