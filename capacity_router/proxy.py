"""The router serves the farm: OpenAI-compatible requests relayed to one worker.

The capacity contract lives at ``{baseUrl}/capacity``, so a gateway's provider
``baseUrl`` is the router, and the gateway sends its inference there too. The
router relays ``POST /v1/chat/completions``, ``/v1/completions`` and
``/v1/embeddings`` (streaming included) to one worker and answers
``GET /v1/models`` itself.

Which worker: one that is registered, healthy with at least one slot in the
last round, unfenced now, and lists the request's ``model`` among its
``models``. Of those, the one with the most free slots, counted by the router
itself: the worker's observed slots minus the requests the router has in
flight there. A tie goes to the one with fewer in flight, then to registry
order. When every eligible worker is full the request still goes to the one
least over, where it waits for a slot as on any server: the gateway in front
admits only what ``/v1/capacity`` says, so that is a short overlap, not a
queue the router should hold.

A request the router estimates larger than a worker's ``max_request_tokens``
(R-K7) is not sent there: it goes to a worker that holds it, and when no
eligible worker of its model does (each states a smaller one), it is refused
at once with a 400 that names the numbers. The estimate is
:func:`request_tokens`: :mod:`capacity_contract.tokens`'s, the one the handlers'
middleware charges.

- A fence stops new requests at once; the ones running there finish (drain).
- A client that goes away closes its upstream request at once, so the worker
  frees the slot (a streamed answer stops at the next token).
- ``model`` unknown to the registry: 404; known but nothing eligible serves
  it now: 503 with ``Retry-After``. The bodies are OpenAI-style
  (``{"error": {"message", "type", "param", "code"}}``), which the SDKs read.
- A worker that refuses the connection (the request never left) is skipped
  for its next URL, then the next worker. A request whose bytes were written
  to a worker is never sent again, not even on a kept-alive connection the
  worker closed before answering (it may have read and run it): any failure
  is 502 before the answer started, and a cut connection after.

Authorization: the router's own bearer is required, as on ``/v1/capacity``.
Upstream goes the worker's own key when it has one (``worker_key``), else no
``Authorization`` at all: the client's router key never leaves the router.
Hop-by-hop headers (RFC 9110 7.6.1), ``Host``, ``Expect`` and
``Proxy-Authorization`` are dropped both ways, and the worker's ``Server``
and ``Date`` are not passed on. Bodies are relayed byte for byte
(``Content-Encoding`` included), the request body up to
:data:`MAX_REQUEST_BYTES`.
"""

from __future__ import annotations

import asyncio
import logging
import math
import ssl
import time
import urllib.parse
from collections.abc import Callable, Collection, Iterable, Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Protocol, cast

import msgspec

from capacity_contract.tokens import request_charge

from .poller import CapacityObserver, WorkerStatus, checked_route
from .registry import RegistryFile, RegistryWatcher, Worker
from .wire import (
    MAX_HEAD_BYTES,
    BadMessage,
    ChunkedScanner,
    Header,
    RequestHead,
    ResponseHead,
    connection_tokens,
    parse_response_head,
)

log = logging.getLogger("capacity_router")

RELAYED_PATHS = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings")
MAX_REQUEST_BYTES = 64 << 20  # a chat request with images inline, with room to spare
DEFAULT_CONNECT_TIMEOUT_S = 2.0
OWNED_BY = "gateway-capacity-router"

# RFC 9110 7.6.1, plus what this hop sets itself or must never pass on.
_DROPPED_REQUEST = frozenset(
    {
        b"connection",
        b"keep-alive",
        b"proxy-connection",
        b"proxy-authenticate",
        b"proxy-authorization",
        b"te",
        b"trailer",
        b"transfer-encoding",
        b"upgrade",
        b"host",
        b"content-length",
        b"expect",
        b"authorization",
    }
)
_DROPPED_RESPONSE = frozenset(
    {
        b"connection",
        b"keep-alive",
        b"proxy-connection",
        b"proxy-authenticate",
        b"te",
        b"trailer",
        b"transfer-encoding",
        b"upgrade",
        b"server",
        b"date",
    }
)
# Fields HTTP defines for every recipient (RFC 9110, 9111): a sender must never list
# them in ``Connection`` (RFC 9110 7.6.1), so one listed there is a sender's mistake and
# still goes on. Only the other names listed there are dropped.
END_TO_END = frozenset(
    {
        b"accept",
        b"accept-charset",
        b"accept-encoding",
        b"accept-language",
        b"accept-ranges",
        b"age",
        b"allow",
        b"cache-control",
        b"content-encoding",
        b"content-language",
        b"content-length",
        b"content-location",
        b"content-range",
        b"content-type",
        b"etag",
        b"expires",
        b"from",
        b"last-modified",
        b"location",
        b"pragma",
        b"range",
        b"referer",
        b"retry-after",
        b"user-agent",
        b"vary",
    }
)
REQUEST_ID_HEADER = b"x-router-request-id"

WorkerKey = Callable[[Worker], bytes | None]


def no_worker_key(worker: Worker) -> bytes | None:
    """No worker has a key: nothing goes upstream as ``Authorization``."""
    return None


# -- the choice (pure) -------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Candidate:
    """One worker that may take a request for a model, as the router counts it."""

    worker: Worker
    slots: int  # observed in the last round, >= 1
    in_flight: int  # requests this router has running there now

    @property
    def free(self) -> int:
        return self.slots - self.in_flight


def eligible(
    registry: RegistryFile, statuses: Iterable[WorkerStatus], fenced_now: Collection[str]
) -> list[tuple[Worker, int]]:
    """Registered, unfenced now, ``ok`` with at least one slot in the last round."""
    observed = {s.id: s for s in statuses}
    found: list[tuple[Worker, int]] = []
    for worker in registry.workers:
        status = observed.get(worker.id)
        if worker.fenced or worker.id in fenced_now or status is None or status.fenced:
            continue
        if status.state != "ok" or not status.slots:
            continue
        found.append((worker, status.slots))
    return found


def choose(candidates: Sequence[Candidate]) -> Candidate | None:
    """Most free slots; a tie goes to fewer in flight, then to the first listed."""
    best: Candidate | None = None
    for candidate in candidates:
        if best is None or (candidate.free, -candidate.in_flight) > (best.free, -best.in_flight):
            best = candidate
    return best


# -- errors ------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Answer:
    """A whole answer of the router's own (an error, a model list)."""

    status: int
    body: bytes
    headers: tuple[Header, ...] = ()
    content_type: bytes = b"application/json"


def openai_error(
    status: int,
    message: str,
    kind: str,
    code: str,
    param: str | None = None,
    headers: tuple[Header, ...] = (),
) -> Answer:
    body = {"error": {"message": message, "type": kind, "param": param, "code": code}}
    return Answer(status, msgspec.json.encode(body), headers)


def unauthorized() -> Answer:
    return openai_error(
        401,
        "missing or wrong bearer key for this router",
        "invalid_request_error",
        "invalid_api_key",
        headers=((b"www-authenticate", b"Bearer"),),
    )


def too_large() -> Answer:
    return openai_error(
        413,
        f"request body over {MAX_REQUEST_BYTES} bytes",
        "invalid_request_error",
        "request_too_large",
    )


def bad_gateway(message: str) -> Answer:
    return openai_error(502, message, "server_error", "upstream_error")


def request_tokens(doc: dict[str, object]) -> int:
    """The tokens a request may hold, estimated (:mod:`capacity_contract.tokens`): its
    prompt plus ``max_completion_tokens`` or ``max_tokens`` (none: the prompt alone, the
    server's default being its own)."""
    return request_charge(doc).tokens(None)


# -- what goes upstream and back ---------------------------------------------


def _named(headers: Iterable[Header]) -> frozenset[bytes]:
    """The hop-by-hop names a sender listed in ``Connection``, less the end-to-end ones."""
    return connection_tokens(headers) - END_TO_END


def upstream_headers(headers: list[Header], key: bytes | None) -> list[Header]:
    """The client's headers as the worker gets them (less ``Host`` and the framing)."""
    named = _named(headers)
    kept = [(n, v) for n, v in headers if n not in _DROPPED_REQUEST and n not in named]
    if not any(n == b"accept-encoding" for n, _ in kept):  # no compression on its behalf
        kept.append((b"accept-encoding", b"identity"))
    if key is not None:
        kept.append((b"authorization", b"Bearer " + key))
    return kept


def response_headers(head: ResponseHead) -> list[Header]:
    """The worker's headers as the client gets them (less the framing)."""
    named = _named(head.headers)
    return [
        (n, v)
        for n, v in head.headers
        if n not in _DROPPED_RESPONSE
        and n not in named
        and not (head.chunked and n == b"content-length")
        and n != REQUEST_ID_HEADER
    ]


@dataclass(frozen=True, slots=True)
class Target:
    """One worker URL, as the relay connects to it."""

    scheme: str
    host: str
    port: int
    prefix: str  # the URL's path, without its trailing slash
    host_header: bytes

    @property
    def pool_key(self) -> tuple[str, str, int]:
        return (self.scheme, self.host, self.port)


@lru_cache(maxsize=1024)
def target_of(url: str) -> Target:
    parts = urllib.parse.urlsplit(url)
    host = parts.hostname or ""
    port = parts.port or (443 if parts.scheme == "https" else 80)
    return Target(parts.scheme, host, port, parts.path.rstrip("/"), parts.netloc.encode("idna"))


# -- connections to the workers ------------------------------------------------


_ONE_WRITE_BODY = 64 << 10  # a body up to this is written with its head in one call
POOL_IDLE_S = 4.0  # under uvicorn's 5 s keep-alive (vLLM, SGLang): we close first
POOL_MAX_IDLE = 256  # per worker URL


class _Sink(Protocol):
    def upstream_data(self, data: bytes) -> None: ...
    def upstream_lost(self) -> None: ...


class _Upstream(asyncio.Protocol):
    """One connection to a worker; carries one exchange at a time."""

    __slots__ = ("closed", "idle_since", "sink", "transport")

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.sink: _Sink | None = None
        self.closed = False
        self.idle_since = 0.0

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        if self.sink is not None:
            self.sink.upstream_data(data)
        else:  # bytes nobody asked for: this connection's framing cannot be trusted
            self.close()

    def eof_received(self) -> bool:
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        sink, self.sink = self.sink, None
        if sink is not None:
            sink.upstream_lost()

    def close(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.abort()


class UpstreamPool:
    """Kept-alive connections to the workers, per URL; lives on the relay's loop."""

    def __init__(self, connect_timeout: float) -> None:
        self._idle: dict[tuple[str, str, int], list[_Upstream]] = {}
        self._connect_timeout = connect_timeout
        self._tls: ssl.SSLContext | None = None

    def take(self, target: Target) -> _Upstream | None:
        idle = self._idle.get(target.pool_key)
        now = time.monotonic()
        while idle:
            conn = idle.pop()
            transport = conn.transport
            if (
                not conn.closed
                and transport is not None
                and not transport.is_closing()
                and now - conn.idle_since < POOL_IDLE_S
            ):
                return conn
            conn.close()
        return None

    @property
    def connect_timeout(self) -> float:
        return self._connect_timeout

    async def connect(self, target: Target, addresses: Sequence[str]) -> _Upstream:
        """A connection to ``target`` at the first of its checked ``addresses`` that
        takes one (the TLS name stays the URL's host)."""
        loop = asyncio.get_running_loop()
        tls: ssl.SSLContext | None = None
        if target.scheme == "https":
            if self._tls is None:
                self._tls = ssl.create_default_context()
            tls = self._tls
        failed: OSError | None = None
        async with asyncio.timeout(self._connect_timeout):
            for address in addresses:
                try:
                    _, conn = await loop.create_connection(
                        _Upstream,
                        address,
                        target.port,
                        ssl=tls,
                        server_hostname=target.host if tls else None,
                    )
                except OSError as exc:
                    failed = exc
                    continue
                return conn
        raise failed if failed is not None else OSError("no address to connect to")

    def give_back(self, target: Target, conn: _Upstream) -> None:
        idle = self._idle.setdefault(target.pool_key, [])
        if conn.closed or len(idle) >= POOL_MAX_IDLE:
            conn.close()
            return
        conn.idle_since = time.monotonic()
        idle.append(conn)

    def close(self) -> None:
        for idle in self._idle.values():
            for conn in idle:
                conn.close()
        self._idle.clear()


# -- the relay -----------------------------------------------------------------


class ClientSide(Protocol):
    """What an exchange needs of the client's connection (``capacity_router.http1``)."""

    request_id: str
    http10: bool
    exchange: Exchange | None

    @property
    def keep_alive(self) -> bool: ...

    def write(self, data: bytes) -> None: ...
    def respond(self, answer: Answer) -> None: ...
    def answer_done(self, *, keep_alive: bool) -> None: ...
    def cut(self) -> None: ...


class FarmProxy:
    """Chooses a worker for each relayed request and counts what runs where.

    Lives on the relay's event loop; ``in_flight()`` may be read from any thread (a copy
    of one dict). What it reads of the poller (the last round's statuses, the admin
    fences, the registry) are immutable values swapped whole by the poller's thread.
    """

    def __init__(
        self,
        observer: CapacityObserver,
        registry: RegistryWatcher,
        *,
        worker_key: WorkerKey = no_worker_key,
        connect_timeout: float = DEFAULT_CONNECT_TIMEOUT_S,
        retry_after_s: float = 1.0,
    ) -> None:
        self._observer = observer
        self._registry = registry
        self._worker_key = worker_key
        self.retry_after = str(max(1, math.ceil(retry_after_s))).encode()
        self._in_flight: dict[str, int] = {}
        self.pool = UpstreamPool(connect_timeout)
        self._seen: tuple[object, object, object] | None = None
        self._eligible_now: list[tuple[Worker, int]] = []
        self._tokens_of: object = None
        self._tokens_by_worker: dict[str, int | None] = {}

    def in_flight(self) -> dict[str, int]:
        """Requests this router has running on each worker now (absent: none)."""
        return dict(self._in_flight)

    def close(self) -> None:
        self.pool.close()

    def _eligible(self) -> list[tuple[Worker, int]]:
        registry = self._registry.current
        statuses = self._observer.workers()
        fenced = self._observer.admin_fenced()
        seen = self._seen
        if (
            seen is None
            or seen[0] is not registry
            or seen[1] is not statuses
            or seen[2] is not fenced
        ):
            self._eligible_now = eligible(registry, statuses, fenced)
            self._seen = (registry, statuses, fenced)
        return self._eligible_now

    def serving(self) -> list[str]:
        """The models some eligible worker serves now, sorted."""
        return sorted({model for worker, _ in self._eligible() for model in worker.models})

    def candidates(self, model: str, exclude: Collection[str] = ()) -> list[Candidate]:
        return [
            Candidate(worker, slots, self._in_flight.get(worker.id, 0))
            for worker, slots in self._eligible()
            if model in worker.models and worker.id not in exclude
        ]

    def _known(self, model: str) -> bool:
        return any(model in worker.models for worker in self._registry.current.workers)

    def no_worker(self, model: str) -> Answer:
        shown = repr(model if len(model) <= 256 else model[:256] + "...")  # the client's text
        if not self._known(model):
            return openai_error(
                404,
                f"The model {shown} does not exist on this router",
                "invalid_request_error",
                "model_not_found",
                param="model",
            )
        return openai_error(
            503,
            f"no healthy worker serves the model {shown} now",
            "server_error",
            "no_healthy_worker",
            headers=((b"retry-after", self.retry_after),),
        )

    def holds(self, worker_id: str, tokens: int) -> bool:
        """Whether a request of ``tokens`` fits the worker's ``max_request_tokens``
        (a worker that does not state one holds any)."""
        stated = self._request_tokens().get(worker_id)
        return stated is None or tokens <= stated

    def _request_tokens(self) -> dict[str, int | None]:
        statuses = self._observer.workers()
        if self._tokens_of is not statuses:
            self._tokens_by_worker = {s.id: s.request_tokens for s in statuses}
            self._tokens_of = statuses
        return self._tokens_by_worker

    def too_long(self, model: str, tokens: int, found: Sequence[Candidate]) -> Answer:
        """400: no eligible worker of ``model`` holds a request of ``tokens``."""
        stated = self._request_tokens()
        largest = max((stated.get(c.worker.id) or 0) for c in found)
        shown = repr(model if len(model) <= 256 else model[:256] + "...")
        return openai_error(
            400,
            f"this request needs about {tokens} tokens (its prompt estimated from its "
            f"text, plus the tokens it asks to generate); the workers of the model {shown} "
            f"hold at most {largest} a request",
            "invalid_request_error",
            "context_length_exceeded",
        )

    def acquire(self, worker_id: str) -> None:
        self._in_flight[worker_id] = self._in_flight.get(worker_id, 0) + 1

    def release(self, worker_id: str) -> None:
        left = self._in_flight.get(worker_id, 0) - 1
        if left > 0:
            self._in_flight[worker_id] = left
        else:
            self._in_flight.pop(worker_id, None)

    # -- endpoints -----------------------------------------------------------

    def models(self) -> Answer:
        data = [
            {"id": m, "object": "model", "created": 0, "owned_by": OWNED_BY} for m in self.serving()
        ]
        return Answer(200, msgspec.json.encode({"object": "list", "data": data}))

    def model(self, name: str) -> Answer:
        if name not in self.serving():
            return self.no_worker(name)
        body = {"id": name, "object": "model", "created": 0, "owned_by": OWNED_BY}
        return Answer(200, msgspec.json.encode(body))

    def relay(
        self, client: ClientSide, head: RequestHead, body: bytes | bytearray
    ) -> asyncio.Task[None] | None:
        """Relay one request; answers at once (400) or returns the exchange's task."""
        try:
            doc = msgspec.json.decode(body)
        except msgspec.DecodeError:
            doc = None
        model = doc.get("model") if isinstance(doc, dict) else None
        if not isinstance(model, str):
            client.respond(
                openai_error(
                    400,
                    "the body must be a JSON object with a string 'model'",
                    "invalid_request_error",
                    "invalid_request",
                    param="model",
                )
            )
            return None
        exchange = Exchange(self, client, head, body, model, request_tokens(doc))
        client.exchange = exchange
        return exchange.start()


_DONE, _NO_CONNECTION = "done", "no connection"


class Exchange:
    """One relayed request: pick, send upstream, pass the answer back as it came.

    The worker's bytes are written to the client from the upstream connection's
    callback, with no task between (``upstream_data``): only the head is parsed, and
    the body scanned for its end. A client that goes away (``client_lost``) closes the
    upstream connection at once, which frees the worker's slot, and releases the
    worker's count. A worker's redirect is never passed on (502): the client would
    follow it into the router itself.
    """

    def __init__(
        self,
        proxy: FarmProxy,
        client: ClientSide,
        head: RequestHead,
        body: bytes | bytearray,
        model: str,
        tokens: int = 0,
    ) -> None:
        self._proxy = proxy
        self._client = client
        self._head = head
        self._body = body
        self._model = model
        self._tokens = tokens
        self._worker_id = ""
        self._conn: _Upstream | None = None
        self._target: Target | None = None
        self._waiter: asyncio.Future[str] | None = None
        self._pending = False
        self._fast_worker: Worker | None = None
        self._tried: set[str] = set()
        self._buf = b""
        self._response: ResponseHead | None = None
        self._left = 0
        self._scanner: ChunkedScanner | None = None
        self._gone = False
        self._close_client = False
        self._pending_head = b""

    # -- the choice and the attempts ----------------------------------------

    def start(self) -> asyncio.Task[None] | None:
        """Send the request now when a kept-alive connection to the chosen worker is
        pooled (no task: the answer's callbacks end the exchange); else a task that
        connects, and tries the next URL or worker when one refuses."""
        worker = self._pick()
        if worker is None:
            self._detach()
            return None
        target = target_of(worker.urls[0])
        conn = self._proxy.pool.take(target)
        if conn is None:
            return asyncio.ensure_future(self._run(worker))
        self._fast_worker = worker
        headers = upstream_headers(self._head.headers, self._proxy._worker_key(worker))
        self._send_now(conn, target, self._request_head(target, headers))
        return None

    def _pick(self) -> Worker | None:
        proxy = self._proxy
        found = proxy.candidates(self._model, exclude=self._tried)
        fitting = [c for c in found if proxy.holds(c.worker.id, self._tokens)]
        if found and not fitting and not self._tried:
            self._client.respond(proxy.too_long(self._model, self._tokens, found))
            return None
        chosen = choose(fitting)
        if chosen is None:
            self._client.respond(
                bad_gateway("no worker for this model took the connection")
                if self._tried
                else proxy.no_worker(self._model)
            )
            return None
        worker = chosen.worker
        self._tried.add(worker.id)
        self._worker_id = worker.id
        proxy.acquire(worker.id)
        return worker

    async def _run(self, worker: Worker | None) -> None:
        try:
            while worker is not None and not self._gone:
                try:
                    if await self._to_worker(worker) != _NO_CONNECTION:
                        return
                finally:
                    self._proxy.release(worker.id)
                worker = self._pick()
        finally:
            self._detach()

    async def _to_worker(self, worker: Worker) -> str:
        key = self._proxy._worker_key(worker)
        headers = upstream_headers(self._head.headers, key)
        for url in worker.urls:
            target = target_of(url)
            request = self._request_head(target, headers)
            conn = self._proxy.pool.take(target)
            if conn is None:
                # A stranger may listen on a loopback worker's port since the last round,
                # a name may resolve elsewhere: checked now (the kernel's socket table and
                # the resolver off this loop), and the connection goes where was checked.
                try:
                    async with asyncio.timeout(self._proxy.pool.connect_timeout):
                        route = await checked_route(worker, url)
                except TimeoutError:
                    continue
                if not route.addresses:
                    continue
                try:
                    conn = await self._proxy.pool.connect(target, route.addresses)
                except (OSError, TimeoutError) as exc:
                    log.debug(
                        "request %s: worker %s: %s: no connection (%s)",
                        self._client.request_id,
                        worker.id,
                        url,
                        exc,
                    )
                    continue
                if self._gone:
                    conn.close()
                    return _DONE
                return await self._send(conn, target, request)
        return _NO_CONNECTION

    def _request_head(self, target: Target, headers: list[Header]) -> bytes:
        head = self._head
        lines = [
            f"{head.method} {target.prefix}{head.target} HTTP/1.1\r\n".encode("latin-1"),
            b"host: " + target.host_header + b"\r\n",
            b"content-length: " + str(len(self._body)).encode() + b"\r\n",
        ]
        lines.extend(n + b": " + v + b"\r\n" for n, v in headers)
        lines.append(b"\r\n")
        return b"".join(lines)  # the head: the body is written after it, not copied in

    def _send_now(self, conn: _Upstream, target: Target, request: bytes) -> None:
        self._conn, self._target = conn, target
        self._buf, self._response = b"", None
        self._pending = True
        conn.sink = self
        assert conn.transport is not None
        if len(self._body) <= _ONE_WRITE_BODY:
            # one writev, so one segment on the wire and one wake-up of the worker
            conn.transport.writelines((request, self._body))
        else:  # a large body is not copied into one buffer with its head
            conn.transport.write(request)
            conn.transport.write(self._body)

    async def _send(self, conn: _Upstream, target: Target, request: bytes) -> str:
        self._waiter = asyncio.get_running_loop().create_future()
        self._send_now(conn, target, request)
        try:
            return await self._waiter
        except asyncio.CancelledError:
            self._drop_upstream()
            raise
        finally:
            self._waiter = None

    def _finish(self, outcome: str) -> None:
        """The attempt in flight has ended with ``outcome``."""
        if not self._pending:
            return
        self._pending = False
        waiter = self._waiter
        if waiter is not None:
            if not waiter.done():
                waiter.set_result(outcome)
            return
        worker, self._fast_worker = self._fast_worker, None  # the task-free attempt
        if worker is None:
            return
        self._proxy.release(worker.id)
        self._detach()

    def _detach(self) -> None:
        if self._client.exchange is self:
            self._client.exchange = None

    def _drop_upstream(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            conn.sink = None
            conn.close()

    # -- callbacks from the client's connection ------------------------------

    def client_lost(self) -> None:
        self._gone = True
        self._drop_upstream()
        self._finish(_DONE)

    def client_paused(self, *, paused: bool) -> None:
        conn = self._conn
        if conn is not None and conn.transport is not None and not conn.closed:
            if paused:
                conn.transport.pause_reading()
            else:
                conn.transport.resume_reading()

    # -- callbacks from the worker's connection ------------------------------

    def upstream_data(self, data: bytes) -> None:
        try:
            if self._response is None:
                data = self._read_head(data)
                if self._response is None:
                    return
            self._body_bytes(data)
        except BadMessage as exc:
            self._fail(f"the worker's answer is not HTTP/1.1: {exc}")

    def _read_head(self, data: bytes) -> bytes:
        buf = self._buf + data
        while True:
            end = buf.find(b"\r\n\r\n", 0, MAX_HEAD_BYTES + 4)
            if end < 0:
                if len(buf) > MAX_HEAD_BYTES:
                    raise BadMessage("a head over 64 KiB")
                self._buf = buf
                return b""
            head = parse_response_head(buf[:end])
            buf = buf[end + 4 :]
            if not 100 <= head.status < 200:
                break
        self._buf = b""
        if 300 <= head.status < 400:
            log.warning(
                "request %s: worker %s answered a redirect (%d): refused with 502",
                self._client.request_id,
                self._worker_id,
                head.status,
            )
            self._fail(f"the worker answered a redirect ({head.status}), which is not passed on")
            return b""
        self._response = head
        client = self._client
        headers = response_headers(head)
        close = not head.keep_alive and not head.chunked and head.length is None
        if client.http10 or not client.keep_alive:
            close = True
        lines = [b"HTTP/1.1 %d %s\r\n" % (head.status, head.reason)]
        lines.extend(n + b": " + v + b"\r\n" for n, v in headers)
        if head.chunked:
            self._scanner = ChunkedScanner()
            if not client.http10:
                lines.append(b"transfer-encoding: chunked\r\n")
        else:
            self._scanner = None
            self._left = -1 if head.length is None else head.length
        if close:
            lines.append(b"connection: close\r\n")
        lines.append(REQUEST_ID_HEADER + b": " + client.request_id.encode() + b"\r\n\r\n")
        self._close_client = close
        self._pending_head = b"".join(lines)  # written with the first body bytes: one send
        return buf

    def _body_bytes(self, data: bytes) -> None:
        head = self._pending_head
        scanner, client = self._scanner, self._client
        if scanner is not None:
            # Scanned before anything is written: a lie in the first bytes is still a 502.
            used = scanner.feed(data, keep_data=client.http10)
            self._pending_head = b""
            if client.http10:
                client.write(head + scanner.data())
            else:
                client.write(head + (data if used == len(data) else data[:used]))
            if scanner.done:
                self._complete(reuse=used == len(data) and self._response_keeps())
            return
        self._pending_head = b""
        if self._left < 0:  # until the worker closes
            if data or head:
                client.write(head + data)
            return
        take = data if len(data) <= self._left else data[: self._left]
        if take or head:
            client.write(head + take)
        self._left -= len(take)
        if self._left == 0:
            self._complete(reuse=len(take) == len(data) and self._response_keeps())

    def _response_keeps(self) -> bool:
        return self._response is not None and self._response.keep_alive

    def _complete(self, *, reuse: bool) -> None:
        conn, target = self._conn, self._target
        self._conn = None
        if conn is not None:
            conn.sink = None
            if reuse and target is not None:
                self._proxy.pool.give_back(target, conn)
            else:
                conn.close()
        self._finish(_DONE)
        self._client.answer_done(keep_alive=not self._close_client)

    def upstream_lost(self) -> None:
        if not self._pending:
            return
        self._conn = None
        if self._response is None:  # written, so perhaps read and run: never sent again
            self._fail("the worker gave no answer (it closed the connection)", conn_gone=True)
            return
        if self._scanner is None and self._left < 0:  # the close ends this body
            self._client.answer_done(keep_alive=False)
            self._finish(_DONE)
            return
        # The answer has started: the client must see it cut, not complete.
        log.warning(
            "request %s: worker %s: answer cut (the worker closed the connection)",
            self._client.request_id,
            self._worker_id,
        )
        self._client.cut()
        self._finish(_DONE)

    def _fail(self, message: str, *, conn_gone: bool = False) -> None:
        if not conn_gone:
            self._drop_upstream()
        if self._response is None or self._pending_head:  # nothing of it written yet
            self._pending_head = b""
            if conn_gone:
                log.warning(
                    "request %s: worker %s: %s", self._client.request_id, self._worker_id, message
                )
            self._client.respond(bad_gateway(message))
        else:
            self._client.cut()
        self._finish(_DONE)
