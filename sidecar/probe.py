"""One capacity probe of one provider (R-P1..R-P8, R-K1..R-K4).

:func:`probe_provider` is the unit the daemon calls each refresh. In order:

1. the static opt-in of the entry (:func:`sidecar.config.check_provider`);
2. resolve the host once and check every address (:mod:`capacity_contract.addresses`):
   one refused address refuses the provider and nothing is sent;
3. read the key afresh (:mod:`sidecar.credential`), so rotation needs no restart;
4. on loopback, check who listens on each address and port (:mod:`capacity_contract.listeners`):
   a provider with ``listenerOwner`` is refused, and its key not sent, unless that
   user owns every listener that could take the connection;
5. ``GET {baseUrl}/capacity`` to every address concurrently, each connection
   pinned to its checked address, with the original Host header and, for
   https, certificate verification and SNI against the original host name.

Connections are kept alive between probes by :class:`ProbeClients` (one per
daemon): one ``httpx.AsyncClient`` per configured (scheme, host, port), whose
pool is keyed by the URL's origin, i.e. the pinned address. Every probe still
resolves and checks the host (R-P3); a request only ever goes to an address
checked by this probe, and a changed address gets a connection of its own. One
client per configured host, not one for all: a TLS connection verified for one
host name must never carry another host's request to the same address.

Everything, DNS and whois included, runs under one deadline (3 s) taken when
the probe starts: httpx timeouts are per operation, so a server dripping a byte
every half second would never trip them; ``asyncio.timeout_at`` does.

Each address is a replica with its own :class:`~sidecar.replica.ReplicaResult`
whose ``reason`` is from the closed set in :mod:`sidecar.replica`. No result,
error or log line contains the key: details are built from status codes,
exception type names and contract messages, and scrubbed of the key anyway.
"""

from __future__ import annotations

import asyncio
import logging
import ssl
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Final, TypedDict, Unpack

import httpx

# httpcore runs `import sniffio` inside every request and falls back to asyncio when it
# fails, rescanning sys.path each time (15-20 % of the sidecar's CPU). It is a
# declared dependency; importing it here makes a missing one an error at start, not a
# silent cost at every probe.
import sniffio  # noqa: F401

from capacity_contract import (
    ContractError,
    check_freshness,
    decode_snapshot,
    listeners,
    read_capped,
)
from capacity_contract.addresses import (
    AddressVerdict,
    ResolveError,
    check_provider_addresses,
    default_tailscale_socket,
    is_loopback,
    localapi_client,
    parse_ip,
)
from sidecar.config import RANGE_ONLY, Endpoint, ProviderConfig, check_provider, parse_base_url
from sidecar.credential import CredentialError, Secret, read_credential
from sidecar.replica import OK, ProviderProbe, ReplicaResult

DEADLINE_S: Final = 3.0  # R-P5
MAX_BODY_BYTES: Final = 64 * 1024  # R-P6
USER_AGENT: Final = "gateway-capacity-sidecar"
# An idle kept-alive connection is dropped after this long: below the idle timeouts of
# common servers (uvicorn 5 s, nginx 75 s), so that we close first rather than race a
# server's close with our next request. At a 15 s refresh each probe connects anew; at
# the short refreshes where the cost counts connections are reused.
KEEPALIVE_S: Final = 4.0
MAX_KEEPALIVE_PER_HOST: Final = 8  # a host's replicas (the segment shows 8)

log = logging.getLogger(__name__)

# httpx logs request URLs at INFO and httpcore logs headers at DEBUG: keep both quiet
# whatever the root level is, so a debug run cannot print the Authorization header.
for _name in ("httpx", "httpcore"):
    logging.getLogger(_name).setLevel(logging.WARNING)

_default_ssl_context: ssl.SSLContext | None = None


def default_ssl_context() -> ssl.SSLContext:
    """Certificate verification against the certifi bundle (httpx's default), built once.
    ``trust_env`` is off: SSL_CERT_FILE and friends do not change whom we trust."""
    global _default_ssl_context
    if _default_ssl_context is None:
        _default_ssl_context = httpx.create_ssl_context(trust_env=False)
    return _default_ssl_context


class ProbeClients:
    """Long-lived HTTP clients for probes, kept alive between refreshes.

    One ``httpx.AsyncClient`` per configured (scheme, host, port), created on first
    use; its connection pool is keyed by the pinned address the request URL names.
    One client for tailscaled's LocalAPI per socket path. Belongs to one event
    loop; :meth:`aclose` closes every connection.
    """

    def __init__(self, ssl_context: ssl.SSLContext | None = None) -> None:
        self._context = ssl_context  # built when an https host first needs it
        self._clients: dict[tuple[str, str, int], httpx.AsyncClient] = {}
        self._localapi: dict[str, httpx.AsyncClient] = {}

    def tls_context(self) -> ssl.SSLContext:
        """Certificate verification for https hosts (the certifi bundle, ~2 MiB: loaded
        only once an https provider exists; the daemon asks before its first probe)."""
        if self._context is None:
            self._context = default_ssl_context()
        return self._context

    def client_for(self, endpoint: Endpoint) -> httpx.AsyncClient:
        key = (endpoint.scheme, endpoint.host, endpoint.port)
        client = self._clients.get(key)
        if client is None:
            context = self.tls_context() if endpoint.scheme == "https" else _no_tls_context()
            client = self._clients[key] = _new_client(context)
        return client

    def localapi(self, socket_path: str) -> httpx.AsyncClient:
        client = self._localapi.get(socket_path)
        if client is None:
            client = self._localapi[socket_path] = localapi_client(socket_path)
        return client

    async def retain(self, endpoints: Iterable[Endpoint]) -> None:
        """Close the clients of hosts no longer configured."""
        keep = {(e.scheme, e.host, e.port) for e in endpoints}
        for key in [k for k in self._clients if k not in keep]:
            await self._clients.pop(key).aclose()

    async def aclose(self) -> None:
        clients = [*self._clients.values(), *self._localapi.values()]
        self._clients.clear()
        self._localapi.clear()
        for client in clients:
            await client.aclose()


_no_tls: ssl.SSLContext | None = None


def _no_tls_context() -> ssl.SSLContext:
    """For a plain-http host's client, which never speaks TLS: verification on and no
    CA at all, so a TLS handshake through it could only fail (httpx would otherwise
    load the certifi bundle for every client it builds)."""
    global _no_tls
    if _no_tls is None:
        _no_tls = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    return _no_tls


def _new_client(context: ssl.SSLContext) -> httpx.AsyncClient:
    return httpx.AsyncClient(
        trust_env=False,  # no proxy variable may bypass the pinned address (R-P3)
        follow_redirects=False,  # R-P4
        verify=context,
        headers={"User-Agent": USER_AGENT},
        limits=httpx.Limits(
            max_connections=None,
            max_keepalive_connections=MAX_KEEPALIVE_PER_HOST,
            keepalive_expiry=KEEPALIVE_S,
        ),
    )


_warned_listeners: set[tuple[str, str, int, int]] = set()
# Without listenerOwner the check only feeds a warning: look at most this often per
# address (listing listeners costs ~10 ms on Linux, /proc/net/tcp being generated whole).
UNSET_OWNER_CHECK_S: Final = 60.0
_last_unset_check: dict[tuple[str, str, int], float] = {}


def listener_refusal(provider: ProviderConfig, port: int, addresses: Iterable[str]) -> str | None:
    """R-P7's optional listener check on every loopback address; None when the key may go.

    Without ``listenerOwner``, a listener owned by neither this user nor root is
    logged once per provider, address and owner, and the key still goes.
    """
    for address in addresses:
        ip = parse_ip(address)
        if ip is None or not is_loopback(ip):
            continue
        if provider.listener_owner is None:
            where = (provider.id, address, port)
            now = time.monotonic()
            if now - _last_unset_check.get(where, -UNSET_OWNER_CHECK_S) < UNSET_OWNER_CHECK_S:
                continue
            _last_unset_check[where] = now
        check = listeners.check_listener(address, port, provider.listener_owner)
        if check.refused is not None:
            return check.refused
        for uid in check.foreign:
            mark = (provider.id, address, port, uid)
            if mark not in _warned_listeners:
                _warned_listeners.add(mark)
                log.warning(
                    "provider %s: %s:%d is listened on by %s, neither this sidecar's user "
                    "nor root; the key is sent to it. Set listenerOwner on the provider to "
                    "have the owner checked",
                    provider.id,
                    address,
                    port,
                    listeners.user_name(uid),
                )
    return None


async def probe_provider(
    provider: ProviderConfig,
    *,
    now_fn: Callable[[], float] = time.time,
    deadline_s: float = DEADLINE_S,
    tailscale_socket: str | None = None,
    ssl_context: ssl.SSLContext | None = None,
    credentials_directory: str | None = None,
    clients: ProbeClients | None = None,
) -> ProviderProbe:
    """Probe every replica of ``provider`` once; never raises for a provider's fault.

    ``now_fn`` is the sidecar's clock for freshness (R-K4). ``tailscale_socket``
    defaults to :func:`capacity_contract.addresses.default_tailscale_socket`; ``ssl_context``
    to :func:`default_ssl_context`; ``credentials_directory`` to
    ``$CREDENTIALS_DIRECTORY``. ``clients`` keeps connections alive across calls
    (the daemon's); without it, this call makes its own and closes them. When
    ``refused`` is set on the result, nothing was sent to the provider; its form
    is ``<reason>:<detail>`` with reason one of ``not_requested``,
    ``config_invalid``, ``opt_in_refused``, ``address_refused``,
    ``listener_refused``, ``unreachable`` (did not resolve), ``timeout``,
    ``credential_error``.
    """
    if clients is None:
        own = ProbeClients(ssl_context)
        try:
            return await probe_provider(
                provider,
                now_fn=now_fn,
                deadline_s=deadline_s,
                tailscale_socket=tailscale_socket,
                credentials_directory=credentials_directory,
                clients=own,
            )
        finally:
            await own.aclose()
    status = check_provider(provider)
    if not status.discovery_active:
        return ProviderProbe(provider.id, refused=status.reason)
    assert provider.base_url is not None and provider.credential_file is not None
    endpoint = parse_base_url(provider.base_url)
    deadline = asyncio.get_running_loop().time() + deadline_s

    socket_path = tailscale_socket if tailscale_socket is not None else default_tailscale_socket()
    try:
        async with asyncio.timeout_at(deadline):
            check = await check_provider_addresses(
                endpoint.host,
                endpoint.port,
                tailnet=provider.tailnet,
                socket_path=socket_path,
                range_only=provider.tailnet_check == RANGE_ONLY,
                localapi=clients.localapi(socket_path) if provider.tailnet else None,
            )
    except TimeoutError:
        return ProviderProbe(
            provider.id,
            refused=f"timeout:resolving and checking {endpoint.host} took over {deadline_s:g} s",
        )
    except ResolveError as exc:
        return ProviderProbe(provider.id, refused=f"unreachable:{exc}")
    if check.refused is not None:
        return ProviderProbe(provider.id, refused=f"address_refused:{check.refused}")

    refusal = listener_refusal(provider, endpoint.port, check.addresses)
    if refusal is not None:
        return ProviderProbe(provider.id, refused=f"listener_refused:{refusal}")

    try:
        key = read_credential(provider.credential_file, credentials_directory=credentials_directory)
    except CredentialError as exc:
        return ProviderProbe(provider.id, refused=f"credential_error:{exc}")

    client = clients.client_for(endpoint)
    results = await asyncio.gather(
        *(
            _probe_replica(client, endpoint, verdict, key, deadline, deadline_s, now_fn)
            for verdict in check.verdicts
        )
    )
    return ProviderProbe(provider.id, tuple(results))


class ProbeOptions(TypedDict, total=False):
    """:func:`probe_provider`'s keywords but ``clients``, which the functions below pass
    on to it (mypy checks them against its signature)."""

    now_fn: Callable[[], float]
    deadline_s: float
    tailscale_socket: str | None
    ssl_context: ssl.SSLContext | None
    credentials_directory: str | None


def probe_provider_sync(provider: ProviderConfig, **options: Unpack[ProbeOptions]) -> ProviderProbe:
    """:func:`probe_provider` from synchronous code (tests, scripts; ``verify`` uses
    :func:`probe_providers`)."""
    return asyncio.run(probe_provider(provider, **options))


async def probe_providers(
    providers: Iterable[ProviderConfig], **options: Unpack[ProbeOptions]
) -> Mapping[str, ProviderProbe]:
    """Probe several providers concurrently and independently (R-P8), by provider id,
    over one :class:`ProbeClients` (built with ``ssl_context``)."""
    todo = list(providers)
    clients = ProbeClients(options.pop("ssl_context", None))
    try:
        probes = await asyncio.gather(
            *(probe_provider(p, **options, clients=clients) for p in todo)
        )
    finally:
        await clients.aclose()
    return {p.id: probe for p, probe in zip(todo, probes, strict=True)}


async def _probe_replica(
    client: httpx.AsyncClient,
    endpoint: Endpoint,
    verdict: AddressVerdict,
    key: Secret,
    deadline: float,
    deadline_s: float,
    now_fn: Callable[[], float],
) -> ReplicaResult:
    address = verdict.address
    try:
        async with asyncio.timeout_at(deadline):
            result = await _fetch(
                client, endpoint, address, key, now_fn, verdict.detail, deadline_s
            )
    except TimeoutError:
        result = ReplicaResult(address, "timeout", f"no complete answer within {deadline_s:g} s")
    except httpx.TimeoutException as exc:
        result = ReplicaResult(address, "timeout", type(exc).__name__)
    except httpx.HTTPError as exc:  # the URL says which port it could not reach
        result = ReplicaResult(
            address, "unreachable", f"{endpoint.url_for(address)}: {_describe(exc)}"
        )
    except Exception as exc:  # a provider's fault must never break the refresh (R-P8)
        log.warning(
            "probe of %s at %s failed unexpectedly: %s", endpoint.host, address, type(exc).__name__
        )
        result = ReplicaResult(address, "unreachable", f"unexpected {type(exc).__name__}")
    return _scrubbed(result, key)


async def _fetch(
    client: httpx.AsyncClient,
    endpoint: Endpoint,
    address: str,
    key: Secret,
    now_fn: Callable[[], float],
    address_note: str,
    deadline_s: float,
) -> ReplicaResult:
    headers = {
        "Host": endpoint.host_header,
        "Authorization": f"Bearer {key.reveal()}",
        "Accept": "application/json",
        "Accept-Encoding": "identity",
    }
    # The URL names the pinned address; TLS still verifies (and sends SNI for) the
    # configured host name, which httpcore takes from this request extension.
    extensions = {"sni_hostname": endpoint.host} if endpoint.scheme == "https" else {}
    async with client.stream(
        "GET",
        endpoint.url_for(address),
        headers=headers,
        extensions=extensions,
        timeout=deadline_s,
    ) as resp:
        code = resp.status_code
        if 300 <= code < 400:
            return ReplicaResult(address, "redirect_refused", f"http_{code}")
        if code in (401, 403):
            return ReplicaResult(address, "auth_failed", f"http_{code}")
        if code == 404:
            return ReplicaResult(address, "no_endpoint", "http_404")
        if not 200 <= code < 300:
            return ReplicaResult(address, "http_error", f"http_{code}")
        coding = resp.headers.get("content-encoding", "identity").strip().lower()
        if coding not in ("", "identity"):
            return ReplicaResult(address, "invalid", "compressed body refused")
        declared = resp.headers.get("content-length")
        if declared is not None and declared.strip().isdigit() and int(declared) > MAX_BODY_BYTES:
            return ReplicaResult(
                address, "too_large", f"Content-Length {int(declared)} > {MAX_BODY_BYTES}"
            )
        body = await read_capped(resp.aiter_raw(), MAX_BODY_BYTES)
        if body is None:
            # leaving the block closes the connection: nothing more is read
            return ReplicaResult(address, "too_large", f"body over {MAX_BODY_BYTES} bytes")
    try:
        snap = decode_snapshot(body)
    except ContractError as exc:
        return ReplicaResult(address, "invalid", str(exc))
    stale = check_freshness(snap, now_fn())
    if stale is not None:
        return ReplicaResult(
            address, stale, f"observed_at {snap.observed_at}", snap.complete, snap.observed_at
        )
    return ReplicaResult(
        address,
        OK,
        address_note,
        complete=snap.complete,
        observed_at=snap.observed_at,
        models={row.id: row.max_concurrent_requests for row in snap.models},
        request_tokens={
            row.id: row.request_tokens for row in snap.models if row.request_tokens is not None
        },
        running_tokens={
            row.id: row.running_tokens for row in snap.models if row.running_tokens is not None
        },
    )


def _describe(exc: BaseException) -> str:
    """Exception type and the first line of its message, short (no headers are in it)."""
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    return f"{type(exc).__name__}: {text[:160]}" if text else type(exc).__name__


def _scrubbed(result: ReplicaResult, key: Secret) -> ReplicaResult:
    """Belt and braces: a server echoing the key into a model id must not get it into logs."""
    secret = key.reveal()
    if secret not in result.detail and secret not in result.models:
        return result
    return ReplicaResult(
        result.address,
        result.reason,
        result.detail.replace(secret, "****"),
        result.complete,
        result.observed_at,
        {k.replace(secret, "****"): v for k, v in result.models.items()},
    )
