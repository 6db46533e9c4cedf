"""Observe the registered workers: every worker polled concurrently, each with
one short deadline, one round per interval (R-K5).

A round: re-read the registry if it changed, poll every unfenced worker
(fenced ones are drained and left alone), then :func:`aggregate` the results
into the snapshot that ``GET /v1/capacity`` serves until the next round.
``observed_at`` is the round's start, so a snapshot never claims to be newer
than the oldest answer in it. Nothing is cached between rounds: a worker's
changed slot setting shows in the next round.

Per URL: ``GET`` the kind's health path (its record in ``kinds.py``), which
must answer 200 (a bare ``{"fixed": N}``: any HTTP answer other than a 5xx;
501 "not implemented" counts as alive, and a 404 still proves the process is
up), then the kind's reader reads the slots and checks the served ids. A
reader that fails in a way nobody foresaw makes that worker unreadable, never
the round. When a worker has several URLs they are polled together and
the best answer wins (ok > unreadable > unhealthy > unreachable): it is one
worker.

Redirects are not followed, proxies from the environment are not used, and
bodies are read up to a bound. A worker with a ``keyFile`` gets
``Authorization: Bearer KEY`` on every request; no other credential is sent.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Literal
from urllib.parse import urlsplit, urlunsplit

import httpx

from capacity_contract import STALE_AFTER_S, CapacitySnapshot, listeners
from shm_layout.errors import GatewayCapacityError

from .aggregate import Observation, State, aggregate, is_fenced, within_contract
from .keyfile import KeyFile, KeyFileError
from .pinning import Route, route_of, url_port
from .reconcile import Reconciled, reconcile
from .registry import RegistryFile, RegistryWatcher, Worker
from .sockets import shared_sockets
from .sources import JSON_BODY_LIMIT, Fetch, Unhealthy, Unreadable, counted_anyway

log = logging.getLogger("capacity_router")

PROPS_BODY_LIMIT = JSON_BODY_LIMIT
DEFAULT_INTERVAL_S = 1.0
DEFAULT_TIMEOUT_S = 2.0
DEFAULT_MAX_CONCURRENCY = 32


class UnknownWorker(GatewayCapacityError, LookupError):
    """No registered worker has this id."""


class FencedInRegistry(GatewayCapacityError, ValueError):
    """The worker is fenced by the registry file; only an edit of the file restores it."""


_PREFERENCE: tuple[State, ...] = ("ok", "unreadable", "unhealthy", "unreachable")


# The router's own shortage, not the worker's: a round that meets one cannot read the
# worker, so the worker is unreadable (the snapshot incomplete), never "unreachable".
_LOCAL_SHORTAGE = frozenset(
    {errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM, errno.EADDRNOTAVAIL}
)


def local_shortage(exc: BaseException) -> OSError | None:
    """The router's own lack of a descriptor, socket or buffer behind ``exc``, if any."""
    seen: BaseException | None = exc
    for _ in range(8):
        if seen is None:
            return None
        if isinstance(seen, OSError) and seen.errno in _LOCAL_SHORTAGE:
            return seen
        seen = seen.__cause__ or seen.__context__
    return None


def _describe(exc: BaseException) -> str:
    if isinstance(exc, httpx.TimeoutException):
        return "timed out"
    if isinstance(exc, httpx.ConnectError):
        return "connection failed"
    if isinstance(exc, httpx.RemoteProtocolError):
        return "protocol error"
    return type(exc).__name__


_refused_said: dict[tuple[str, str], str] = {}


def say_refused(worker: Worker, url: str, refused: str | None) -> None:
    """Log a new reason not to contact ``worker`` at ``url`` once, as a WARNING, for the
    poll and the relay alike (and forget it when the URL passes again)."""
    mark = (worker.id, url)
    if refused is None:
        _refused_said.pop(mark, None)
    elif _refused_said.get(mark) != refused:
        _refused_said[mark] = refused
        log.warning(
            "worker %s: %s not contacted, neither its key nor a request goes there: %s",
            worker.id,
            url,
            refused,
        )


async def checked_route(worker: Worker, url: str, *, in_thread: bool = True) -> Route:
    """Where ``worker`` may be contacted at ``url`` now (:func:`pinning.route_of`: its
    loopback listener's owner, or every address a peer of this tailnet); a refusal is
    said once (:func:`say_refused`)."""
    route = await route_of(url, worker.listener_owner, worker.tailnet_check, in_thread=in_thread)
    if route.unresolved is None:
        say_refused(worker, url, route.refused)
    return route


def pinned_url(url: str, address: str) -> str:
    """``url`` with its host replaced by the checked ``address`` (itself when the host is
    that address or a loopback name)."""
    parts = urlsplit(url)
    if address == parts.hostname:
        return url
    _, port = url_port(url)
    shown = f"[{address}]" if ":" in address else address
    return urlunsplit(parts._replace(netloc=f"{shown}:{port}"))


async def poll_url(
    client: httpx.AsyncClient,
    worker: Worker,
    url: str,
    timeout: float,
    key: bytes | None = None,
) -> Observation:
    """Observe one worker through one of its URLs, within ``timeout`` seconds."""
    slots = worker.slots
    kind = slots.server_kind
    headers = {"Authorization": "Bearer " + key.decode("ascii")} if key is not None else {}
    fetch = Fetch(client, url, headers)
    health_stage = True
    # A loopback URL's listener is read here, before the poll's deadline starts, as it
    # always was (a millisecond); a name's resolution and whois run under the deadline.
    route: Route | None = None
    if listeners.loopback_addresses(url_port(url)[0]):
        route = await checked_route(worker, url, in_thread=False)
    try:
        async with asyncio.timeout(timeout):
            if route is None:
                route = await checked_route(worker, url)
            if route.refused is not None:
                return Observation("unreachable", reason=f"not contacted: {route.refused}")
            if route.unresolved is not None:
                return Observation("unreachable", reason=route.unresolved)
            pinned = pinned_url(url, route.addresses[0])
            if pinned != url:  # to the checked address, as the URL's host
                host = urlsplit(url)
                headers["Host"] = host.netloc
                sni = {"sni_hostname": host.hostname or ""} if host.scheme == "https" else {}
                fetch = Fetch(client, pinned, headers, extensions=sni)
            status = await fetch.status(kind.health)
            if status == 404 and kind.health_fallback:
                status = await fetch.status(kind.health_fallback)
            if kind.health_any_answer:
                if status >= 500 and status != 501:
                    return Observation("unhealthy", reason=f"{fetch.stage} answered {status}")
            elif status != 200:
                if status in (401, 403):
                    return Observation(
                        "unreadable",
                        reason=f"{fetch.stage} answered {status} (the worker wants a key: keyFile)",
                    )
                return Observation("unhealthy", reason=f"{fetch.stage} answered {status}")
            health_stage = False
            reading = await kind.read(fetch, worker.models, slots.fixed)
            if kind.ignores_model:
                reading = counted_anyway(reading)
    except TimeoutError:
        if health_stage:
            return Observation("unreachable", reason="timed out")
        return Observation("unreadable", reason=f"{fetch.stage} timed out")
    except Unhealthy as exc:
        return Observation("unhealthy", reason=str(exc))
    except Unreadable as exc:
        return Observation("unreadable", reason=str(exc))
    except (httpx.HTTPError, OSError) as exc:
        shortage = local_shortage(exc)
        if shortage is not None:
            return Observation(
                "unreadable",
                reason=f"the router itself is out of {os.strerror(shortage.errno or 0)}",
            )
        if health_stage:
            return Observation("unreachable", reason=_describe(exc))
        return Observation("unreadable", reason=f"{fetch.stage}: {_describe(exc)}")
    except Exception as exc:  # a reader's bug: this worker unreadable, the round goes on
        log.exception("reading worker %s at %s failed", worker.id, url)
        failed = f"{fetch.stage}: reader failed ({type(exc).__name__})"
        return Observation("unreadable", reason=failed)
    return Observation(
        "ok",
        reading.slots,
        kind.name,
        per_model=reading.per_model,
        unknown=reading.unknown,
        unserved=reading.unserved,
        activity=reading.activity,
        unlisted=reading.unlisted,
        running=reading.running,
        waiting=reading.waiting,
        request_tokens=reading.request_tokens,
        running_tokens=reading.running_tokens,
        tokens_from=reading.tokens_from,
        preemptions=reading.preemptions,
        kv_usage=reading.kv_usage,
    )


async def poll_worker(
    client: httpx.AsyncClient, worker: Worker, timeout: float, key: bytes | None = None
) -> Observation:
    """One worker, all its URLs at once; the best answer stands for the worker."""
    results = await asyncio.gather(
        *(poll_url(client, worker, url, timeout, key) for url in worker.urls)
    )
    for state in _PREFERENCE:
        for result in results:
            if result.state == state:
                return result
    raise AssertionError("unreachable: a worker has at least one URL")


@dataclass(frozen=True, slots=True)
class WorkerStatus:
    """Local view of one worker for the Python API and logs (never published)."""

    id: str
    models: tuple[str, ...]
    fenced_by: Literal["registry", "admin"] | None
    state: State | None  # None: fenced, not polled
    slots: int | None
    reason: str
    unserved: tuple[str, ...] = ()
    activity: str = ""
    unlisted: tuple[str, ...] = ()
    running: float | None = None  # what the server says it runs and queues, where it says
    waiting: float | None = None
    request_tokens: int | None = None  # its token capacity (R-K7), where it states it
    running_tokens: int | None = None  # as reported: lowered while it preempts
    tokens_from: str = ""

    @property
    def fenced(self) -> bool:
        return self.fenced_by is not None


# how long a worker's last stated token capacity stands in for a read that failed: a
# snapshot's own freshness bound (R-K4)
TOKENS_CARRIED_S = STALE_AFTER_S


@dataclass(frozen=True, slots=True)
class _Stated:
    """A worker's token capacity as it last stated it, and when (the monotonic clock)."""

    request: int | None
    running: int | None
    tokens_from: str
    at: float


def new_client(timeout: float) -> httpx.AsyncClient:
    return httpx.AsyncClient(
        follow_redirects=False,
        trust_env=False,  # never route worker polls through an environment proxy
        timeout=httpx.Timeout(timeout),
        headers={"Accept-Encoding": "identity", "User-Agent": "gateway-capacity-router"},
        limits=httpx.Limits(max_connections=256, max_keepalive_connections=64),
    )


class CapacityObserver:
    """Owns the rounds, the admin fences and the published snapshot.

    Lives on one event loop. Readers in other threads may use
    :meth:`published`, :meth:`snapshot` and :meth:`workers`: each is one
    attribute read of an immutable value, swapped whole at the end of a round.
    Rounds never overlap (a lock), so a round started after a fence change
    always sees it.
    """

    def __init__(
        self,
        registry: RegistryWatcher,
        *,
        interval: float = DEFAULT_INTERVAL_S,
        timeout: float = DEFAULT_TIMEOUT_S,
        max_concurrency: int = DEFAULT_MAX_CONCURRENCY,
        before_round: Callable[[], None] | None = None,
    ) -> None:
        if interval <= 0 or timeout <= 0 or max_concurrency < 1:
            raise ValueError("interval and timeout must be positive, max_concurrency >= 1")
        self._registry = registry
        self.interval = interval
        self.timeout = timeout
        self._max_concurrency = max_concurrency
        self._before_round = before_round
        self._admin_fenced: set[str] = set()
        self._admin_fenced_view: frozenset[str] = frozenset()
        self._published: tuple[CapacitySnapshot, bytes] | None = None
        self._workers: tuple[WorkerStatus, ...] = ()
        self._lock: asyncio.Lock | None = None
        self._client: httpx.AsyncClient | None = None
        self._logged: dict[str, tuple[object, ...]] = {}
        self._logged_registry_error: str | None = None
        self._logged_oversize: str | None = None
        self._sockets_of: RegistryFile | None = None
        self._sockets_task: asyncio.Task[None] | None = None
        self._socket_warnings: tuple[str, ...] = ()
        self._keys: dict[str, KeyFile] = {}
        self._key_errors: dict[str, str | None] = {}
        self._reconciled: dict[str, Reconciled] = {}
        # each worker's token capacity as last stated: (request, running, from, when)
        self._stated: dict[str, _Stated] = {}

    # -- read side (any thread) ------------------------------------------

    def published(self) -> tuple[CapacitySnapshot, bytes] | None:
        """The last snapshot and its encoded body, or None before the first round."""
        return self._published

    def snapshot(self) -> CapacitySnapshot | None:
        published = self._published
        return None if published is None else published[0]

    def workers(self) -> tuple[WorkerStatus, ...]:
        return self._workers

    def warnings(self) -> tuple[str, ...]:
        """Registered workers that resolve to one socket address (``sockets.py``)."""
        return self._socket_warnings

    def admin_fenced(self) -> frozenset[str]:
        """The ids fenced by the admin endpoint now (from the moment it is asked)."""
        return self._admin_fenced_view

    # -- rounds (event loop) -----------------------------------------------

    async def observe(self) -> CapacitySnapshot:
        """Run one full round now (after any round in progress) and publish it."""
        if self._lock is None:
            self._lock = asyncio.Lock()
        async with self._lock:
            return await self._round()

    async def run(self) -> None:
        """Observe every ``interval`` seconds until cancelled."""
        loop = asyncio.get_running_loop()
        while True:
            started = loop.time()
            try:
                await self.observe()
            except Exception:  # a bug must not silently freeze the snapshot's age
                log.exception("observation round failed")
            await asyncio.sleep(max(0.0, started + self.interval - loop.time()))

    async def aclose(self) -> None:
        if self._sockets_task is not None:
            self._sockets_task.cancel()  # its resolver thread ends by itself
        if self._client is not None:
            await self._client.aclose()
            self._client = None

    def fences(self) -> list[tuple[str, Literal["registry", "admin"] | None]]:
        """Every registered worker id with what fences it, if anything (for the admin)."""
        self._registry_refresh()
        return [
            (
                w.id,
                "registry" if w.fenced else "admin" if w.id in self._admin_fenced else None,
            )
            for w in self._registry.current.workers
        ]

    async def fence(self, worker_id: str) -> CapacitySnapshot:
        """Drain a worker: its slots leave the snapshot of the round run now."""
        self._registry_refresh()
        if self._registry.current.find(worker_id) is None:
            raise UnknownWorker(worker_id)
        if worker_id not in self._admin_fenced:
            self._admin_fenced.add(worker_id)
            self._admin_fenced_view = frozenset(self._admin_fenced)
            log.info("worker %s fenced by the admin endpoint", worker_id)
        return await self.observe()

    async def unfence(self, worker_id: str) -> CapacitySnapshot:
        """Restore a worker fenced by :meth:`fence`; its slots return in the round run now."""
        self._registry_refresh()
        worker = self._registry.current.find(worker_id)
        if worker is None:
            raise UnknownWorker(worker_id)
        if worker.fenced:
            raise FencedInRegistry(worker_id)
        if worker_id in self._admin_fenced:
            self._admin_fenced.discard(worker_id)
            self._admin_fenced_view = frozenset(self._admin_fenced)
            log.info("worker %s unfenced by the admin endpoint", worker_id)
        return await self.observe()

    def _registry_refresh(self) -> None:
        if self._registry.refresh():
            log.info("registry reloaded: %d workers", len(self._registry.current.workers))
        error = self._registry.last_error
        if error != self._logged_registry_error:
            if error is not None:
                log.warning("registry not reloaded, keeping the last good one: %s", error)
            self._logged_registry_error = error

    async def _round(self) -> CapacitySnapshot:
        if self._before_round is not None:
            self._before_round()
        self._registry_refresh()
        registry = self._registry.current
        if registry is not self._sockets_of:  # resolved aside: a slow DNS never holds a round
            self._sockets_of = registry
            self._sockets_task = asyncio.create_task(self._check_sockets(registry))
        admin_fenced = frozenset(self._admin_fenced)
        shortage = ""
        if self._client is None:
            try:
                self._client = new_client(self.timeout)
            except OSError as exc:  # no descriptor even for the CA file: nothing is read
                shortage = f"the router itself is out of {os.strerror(exc.errno or 0)}"
        client = self._client
        semaphore = asyncio.Semaphore(self._max_concurrency)

        async def bounded(worker: Worker) -> Observation:
            if client is None:
                return Observation("unreadable", reason=shortage)
            key: bytes | None = None
            if worker.key_file is not None:
                key, error = self._worker_key(self._key_path(worker.key_file))
                if key is None:
                    return Observation("unreadable", reason=f"keyFile: {error}")
            async with semaphore:
                try:
                    return await poll_worker(client, worker, self.timeout, key)
                except Exception as exc:  # a round must publish, whatever one worker did
                    log.debug("worker %s: poll failed", worker.id, exc_info=True)
                    return Observation("unreadable", reason=f"poll failed: {_describe(exc)}")

        observed_at = time.time()
        active = [w for w in registry.workers if not is_fenced(w, admin_fenced)]
        results = await asyncio.gather(*(bounded(w) for w in active))
        observations = self._reconcile({w.id: obs for w, obs in zip(active, results, strict=True)})
        snapshot, body, oversize = within_contract(
            aggregate(registry.workers, admin_fenced, observations, observed_at)
        )
        if (oversize is None) != (self._logged_oversize is None):
            if oversize is not None:
                log.warning("%s", oversize)
            self._logged_oversize = oversize
        statuses = tuple(_status(w, admin_fenced, observations.get(w.id)) for w in registry.workers)
        self._log_changes(statuses)
        self._workers = statuses
        self._published = (snapshot, body)
        return snapshot

    def _carry(self, worker_id: str, obs: Observation, mono: float) -> Observation:
        """``obs`` with the token capacity the worker last stated in place of a field it
        did not state this round (a read that failed or timed out: vLLM's pool comes from
        ``/metrics``, which a busy server may not answer in time), for at most
        ``TOKENS_CARRIED_S`` since it last stated it. A server's token capacity is fixed
        for the life of its process, and a field that blinks out of the snapshot would
        drop the gateways' token budget to none (slots alone) for a round."""
        last = self._stated.get(worker_id)
        request, running = obs.request_tokens, obs.running_tokens
        if request is not None or running is not None:
            stated = _Stated(request, running, obs.tokens_from, mono)
            if last is not None and mono - last.at <= TOKENS_CARRIED_S:
                stated = _Stated(
                    request if request is not None else last.request,
                    running if running is not None else last.running,
                    obs.tokens_from,
                    mono if request is not None and running is not None else last.at,
                )
            self._stated[worker_id] = stated
        if last is None or mono - last.at > TOKENS_CARRIED_S:
            return obs
        carried = []
        if request is None and last.request is not None:
            request = last.request
            carried.append("max_request_tokens")
        if running is None and last.running is not None:
            running = last.running
            carried.append("the pool")
        if not carried:
            return obs
        note = f"{last.tokens_from}; {' and '.join(carried)} as stated {mono - last.at:.0f} s ago"
        return replace(obs, request_tokens=request, running_tokens=running, tokens_from=note)

    def _reconcile(self, observations: dict[str, Observation]) -> dict[str, Observation]:
        """Each worker's stated token pool (carried over a round it was not read,
        ``_carry``), lowered while it preempts (``reconcile.py``); a worker not read this
        round starts over when it is read again."""
        kept: dict[str, Reconciled] = {}
        mono = time.monotonic()
        for worker_id, obs in observations.items():
            if obs.state != "ok":
                self._stated.pop(worker_id, None)
                continue
            obs = observations[worker_id] = self._carry(worker_id, obs, mono)
            previous = self._reconciled.get(worker_id)
            now = reconcile(previous, obs.running_tokens, obs.preemptions)
            if now is None:
                continue
            kept[worker_id] = now
            if now.reason and (previous is None or previous.reported != now.reported):
                log.warning("worker %s: token pool %s", worker_id, now.reason)
            elif previous is not None and previous.reported < now.reported == now.stated:
                log.info("worker %s: token pool back to the %d stated", worker_id, now.stated)
            if now.reported != obs.running_tokens or now.reason:
                note = "; ".join(part for part in (obs.tokens_from, now.reason) if part)
                observations[worker_id] = replace(
                    obs, running_tokens=now.reported, tokens_from=note
                )
        self._reconciled = kept
        return observations

    async def _check_sockets(self, registry: RegistryFile) -> None:
        warnings = tuple(await asyncio.to_thread(shared_sockets, registry.workers))
        if registry is not self._sockets_of:
            return  # a newer registry is being checked
        for warning in warnings:
            if warning not in self._socket_warnings:
                log.warning("%s", warning)
        self._socket_warnings = warnings

    def _key_path(self, key_file: str) -> str:
        return os.path.join(os.path.dirname(self._registry.path), key_file)

    def key_for(self, worker: Worker) -> bytes | None:
        """The bearer key a worker wants (its registry ``keyFile``), or None."""
        if worker.key_file is None:
            return None
        return self._worker_key(self._key_path(worker.key_file))[0]

    def _worker_key(self, path: str) -> tuple[bytes | None, str | None]:
        """A worker's bearer key from its key file (re-read on change), or the reason not."""
        holder = self._keys.get(path)
        error: str | None
        if holder is None:
            try:
                holder = KeyFile(path)
            except KeyFileError as exc:
                error = str(exc)
                self._log_key_error(path, error)
                return None, error
            self._keys[path] = holder
        holder.refresh()
        error = holder.last_error
        self._log_key_error(path, error)
        return holder.key, error

    def _log_key_error(self, path: str, error: str | None) -> None:
        if self._key_errors.get(path) == error:
            return
        self._key_errors[path] = error
        if error is not None:
            log.warning("worker key file: %s", error)

    def _log_changes(self, statuses: tuple[WorkerStatus, ...]) -> None:
        current: dict[str, tuple[object, ...]] = {}
        for s in statuses:
            key = (s.fenced_by, s.state, s.slots, s.reason, s.unserved, s.unlisted)
            current[s.id] = key
            previous = self._logged.get(s.id)
            if previous == key:
                continue
            if s.unserved and (previous is None or previous[4] != s.unserved):
                log.warning(
                    "worker %s does not serve %s: counted 0 for it",
                    s.id,
                    ", ".join(s.unserved),
                )
            if s.unlisted and (previous is None or previous[5] != s.unlisted):
                log.warning(
                    "worker %s does not list %s but serves any model: counted all the "
                    "same (start it with --alias so its id is the one registered)",
                    s.id,
                    ", ".join(s.unlisted),
                )
            if s.fenced_by is not None:
                log.info("worker %s: fenced (%s)", s.id, s.fenced_by)
            elif s.state == "ok":
                log.info("worker %s: ok, %d slots (%s)", s.id, s.slots, s.reason)
            else:
                log.info("worker %s: %s (%s)", s.id, s.state, s.reason)
        for gone in self._logged.keys() - current.keys():
            log.info("worker %s: no longer registered", gone)
        self._logged = current


def _status(worker: Worker, admin_fenced: frozenset[str], obs: Observation | None) -> WorkerStatus:
    fenced_by: Literal["registry", "admin"] | None = (
        "registry" if worker.fenced else "admin" if worker.id in admin_fenced else None
    )
    return WorkerStatus(
        id=worker.id,
        models=tuple(dict.fromkeys(worker.models)),
        fenced_by=fenced_by,
        state=None if obs is None else obs.state,
        slots=None if obs is None else obs.slots,
        reason="" if obs is None else obs.reason,
        unserved=() if obs is None else obs.unserved,
        activity="" if obs is None else obs.activity,
        unlisted=() if obs is None else obs.unlisted,
        running=None if obs is None else obs.running,
        waiting=None if obs is None else obs.waiting,
        request_tokens=None if obs is None else obs.request_tokens,
        running_tokens=None if obs is None else obs.running_tokens,
        tokens_from="" if obs is None else obs.tokens_from,
    )
