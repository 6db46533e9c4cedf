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

- A fence stops new requests at once; the ones running there finish (drain).
- A client that goes away closes its upstream request at once, so the worker
  frees the slot (a streamed answer stops at the next token).
- ``model`` unknown to the registry: 404; known but nothing eligible serves
  it now: 503 with ``Retry-After``. The bodies are OpenAI-style
  (``{"error": {"message", "type", "param", "code"}}``), which the SDKs read.
- A worker that refuses the connection (the request never left) is skipped
  for its next URL, then the next worker; any other failure is 502 before
  the answer started, and a cut connection after.

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
import contextlib
import logging
import math
from collections.abc import Awaitable, Callable, Collection, Iterable, Sequence
from dataclasses import dataclass

import httpx
import msgspec
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response
from starlette.routing import Route
from starlette.types import Message, Receive, Scope, Send

from .poller import CapacityObserver, WorkerStatus
from .registry import RegistryFile, RegistryWatcher, Worker, endpoint

log = logging.getLogger("capacity_router")

RELAYED_PATHS = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings")
MAX_REQUEST_BYTES = 64 << 20  # a chat request with images inline, with room to spare
DEFAULT_CONNECT_TIMEOUT_S = 2.0
OWNED_BY = "gateway-capacity-router"

# RFC 9110 7.6.1, plus what this hop sets itself or must never pass on.
_DROPPED_REQUEST = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-connection",
        "proxy-authenticate",
        "proxy-authorization",
        "te",
        "trailer",
        "transfer-encoding",
        "upgrade",
        "host",
        "content-length",
        "expect",
        "authorization",
    }
)
_DROPPED_RESPONSE = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-connection",
        "proxy-authenticate",
        "te",
        "trailer",
        "transfer-encoding",
        "upgrade",
        "server",
        "date",
    }
)

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


def openai_error(
    status: int,
    message: str,
    kind: str,
    code: str,
    param: str | None = None,
    headers: dict[str, str] | None = None,
) -> Response:
    body = {"error": {"message": message, "type": kind, "param": param, "code": code}}
    return Response(
        msgspec.json.encode(body),
        status_code=status,
        media_type="application/json",
        headers={"Cache-Control": "no-store", **(headers or {})},
    )


def unauthorized() -> Response:
    return openai_error(
        401,
        "missing or wrong bearer key for this router",
        "invalid_request_error",
        "invalid_api_key",
        headers={"WWW-Authenticate": "Bearer"},
    )


class _ModelField(msgspec.Struct):
    model: str


_model_decoder = msgspec.json.Decoder(_ModelField)


class _TooLarge(Exception):
    pass


async def _read_body(request: Request) -> bytes:
    chunks: list[bytes] = []
    total = 0
    async for chunk in request.stream():
        total += len(chunk)
        if total > MAX_REQUEST_BYTES:
            raise _TooLarge
        chunks.append(chunk)
    return b"".join(chunks)


def _upstream_headers(request: Request, key: bytes | None) -> list[tuple[bytes, bytes]]:
    named = {
        token.strip().lower()
        for token in request.headers.get("connection", "").split(",")
        if token.strip()
    }
    headers = [
        (name, value)
        for name, value in request.headers.raw
        if name.decode("latin-1").lower() not in _DROPPED_REQUEST
        and name.decode("latin-1").lower() not in named
    ]
    if "accept-encoding" not in request.headers:  # or httpx would ask for gzip on its behalf
        headers.append((b"accept-encoding", b"identity"))
    if key is not None:
        headers.append((b"authorization", b"Bearer " + key))
    return headers


def _response_headers(upstream: httpx.Response) -> list[tuple[bytes, bytes]]:
    named = {
        token.strip().lower()
        for token in upstream.headers.get("connection", "").split(",")
        if token.strip()
    }
    return [
        (name.lower(), value)
        for name, value in upstream.headers.raw
        if name.decode("latin-1").lower() not in _DROPPED_RESPONSE
        and name.decode("latin-1").lower() not in named
    ]


# -- the proxy ---------------------------------------------------------------


class FarmProxy:
    """Relays requests to the farm; lives on the router's event loop.

    ``in_flight()`` may be read from any thread (a copy of one dict).
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
        self._connect_timeout = connect_timeout
        self._retry_after = str(max(1, math.ceil(retry_after_s)))
        self._in_flight: dict[str, int] = {}
        self._client: httpx.AsyncClient | None = None

    def in_flight(self) -> dict[str, int]:
        """Requests this router has running on each worker now (absent: none)."""
        return dict(self._in_flight)

    async def aclose(self) -> None:
        if self._client is not None:
            await self._client.aclose()
            self._client = None

    def _http(self) -> httpx.AsyncClient:
        if self._client is None:
            self._client = httpx.AsyncClient(
                follow_redirects=False,
                trust_env=False,  # never through an environment proxy
                # No read deadline: a long prompt may take minutes to its first
                # token. The client's own timeout, when it leaves, frees it.
                timeout=httpx.Timeout(
                    connect=self._connect_timeout, read=None, write=60.0, pool=None
                ),
                limits=httpx.Limits(max_connections=None, max_keepalive_connections=64),
            )
        return self._client

    def _eligible(self) -> list[tuple[Worker, int]]:
        fenced_now = {worker_id for worker_id, by in self._observer.fences() if by is not None}
        return eligible(self._registry.current, self._observer.workers(), fenced_now)

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

    def _no_worker(self, model: str) -> Response:
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
            headers={"Retry-After": self._retry_after},
        )

    def _acquire(self, worker_id: str) -> None:
        self._in_flight[worker_id] = self._in_flight.get(worker_id, 0) + 1

    def _release(self, worker_id: str) -> None:
        left = self._in_flight.get(worker_id, 0) - 1
        if left > 0:
            self._in_flight[worker_id] = left
        else:
            self._in_flight.pop(worker_id, None)

    # -- endpoints -----------------------------------------------------------

    async def models(self, request: Request) -> Response:
        data = [
            {"id": m, "object": "model", "created": 0, "owned_by": OWNED_BY} for m in self.serving()
        ]
        return Response(
            msgspec.json.encode({"object": "list", "data": data}),
            media_type="application/json",
            headers={"Cache-Control": "no-store"},
        )

    async def model(self, request: Request) -> Response:
        name = request.path_params["model"]
        if name not in self.serving():
            return self._no_worker(name)
        body = {"id": name, "object": "model", "created": 0, "owned_by": OWNED_BY}
        return Response(
            msgspec.json.encode(body),
            media_type="application/json",
            headers={"Cache-Control": "no-store"},
        )

    async def relay(self, request: Request) -> Response:
        try:
            body = await _read_body(request)
        except _TooLarge:
            return openai_error(
                413,
                f"request body over {MAX_REQUEST_BYTES} bytes",
                "invalid_request_error",
                "request_too_large",
            )
        except ClientDisconnect:
            return Response(status_code=400)  # nobody is left to read it
        try:
            model = _model_decoder.decode(body).model
        except msgspec.DecodeError:
            return openai_error(
                400,
                "the body must be a JSON object with a string 'model'",
                "invalid_request_error",
                "invalid_request",
                param="model",
            )
        return _Relay(self, request, model, body)  # 404 and 503 come from its first choice


class _UpstreamFailed(Exception):
    """The worker took the request but gave no answer (the request may have run)."""


class _Relay(Response):
    """The ASGI answer of one relayed request: pick, send upstream, relay back.

    The whole exchange runs beside a watch on the client's connection: when
    the client goes away the exchange is cancelled, which closes the
    upstream response (and so the worker's request) and releases the
    worker's count.
    """

    def __init__(self, proxy: FarmProxy, request: Request, model: str, body: bytes) -> None:
        super().__init__()
        self._proxy = proxy
        self._request = request
        self._model = model
        self._body = body

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        exchange = asyncio.ensure_future(self._exchange(scope, send))
        watch = asyncio.ensure_future(_disconnected(receive))
        try:
            await asyncio.wait((exchange, watch), return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (exchange, watch):
                task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await watch
            with contextlib.suppress(asyncio.CancelledError):
                await exchange  # an exchange's own failure is raised here

    async def _exchange(self, scope: Scope, send: Send) -> None:
        proxy = self._proxy
        tried: set[str] = set()
        while True:
            chosen = choose(proxy.candidates(self._model, exclude=tried))
            if chosen is None:
                answer = (
                    _bad_gateway("no worker for this model took the connection")
                    if tried
                    else proxy._no_worker(self._model)
                )
                await answer(scope, _no_receive, send)
                return
            worker = chosen.worker
            tried.add(worker.id)
            proxy._acquire(worker.id)
            try:
                try:
                    upstream = await self._open(worker)
                except _UpstreamFailed as exc:
                    await _bad_gateway(str(exc))(scope, _no_receive, send)
                    return
                if upstream is not None:
                    await _relay_response(upstream, send, worker.id)
                    return
            finally:
                proxy._release(worker.id)

    async def _open(self, worker: Worker) -> httpx.Response | None:
        """The worker's answer (headers read), or None when no URL of it took the
        connection (so the request never left and another worker may take it)."""
        proxy = self._proxy
        client = proxy._http()
        headers = _upstream_headers(self._request, proxy._worker_key(worker))
        query = self._request.url.query
        path = self._request.url.path.lstrip("/") + (f"?{query}" if query else "")
        for url in worker.urls:
            upstream_request = client.build_request(
                self._request.method, endpoint(url, path), headers=headers, content=self._body
            )
            try:
                return await client.send(upstream_request, stream=True)
            except (httpx.ConnectError, httpx.ConnectTimeout) as exc:
                log.debug("worker %s: %s: no connection (%s)", worker.id, url, exc)
            except httpx.HTTPError as exc:
                log.warning("worker %s: %s: no answer (%s)", worker.id, url, type(exc).__name__)
                raise _UpstreamFailed(f"the worker gave no answer ({type(exc).__name__})") from None
        return None


def _bad_gateway(message: str) -> Response:
    return openai_error(502, message, "server_error", "upstream_error")


async def _relay_response(upstream: httpx.Response, send: Send, worker_id: str) -> None:
    try:
        await send(
            {
                "type": "http.response.start",
                "status": upstream.status_code,
                "headers": _response_headers(upstream),
            }
        )
        try:
            async for chunk in upstream.aiter_raw():
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
        except httpx.HTTPError as exc:
            # The answer has started: the client must see it cut, not complete.
            log.warning("worker %s: answer cut: %s", worker_id, type(exc).__name__)
            return
        await send({"type": "http.response.body", "body": b"", "more_body": False})
    finally:
        await upstream.aclose()


async def _disconnected(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


async def _no_receive() -> Message:
    return {"type": "http.disconnect"}


def routes(proxy: FarmProxy, authorized: Callable[[Request], bool]) -> list[Route]:
    """The OpenAI-compatible routes, each behind the router's bearer."""

    def guarded(
        endpoint: Callable[[Request], Awaitable[Response]],
    ) -> Callable[[Request], Awaitable[Response]]:
        async def checked(request: Request) -> Response:
            if not authorized(request):
                return unauthorized()
            return await endpoint(request)

        return checked

    return [
        Route("/v1/models", guarded(proxy.models), methods=["GET"]),
        Route("/v1/models/{model:path}", guarded(proxy.model), methods=["GET"]),
        *(Route(path, guarded(proxy.relay), methods=["POST"]) for path in RELAYED_PATHS),
    ]
