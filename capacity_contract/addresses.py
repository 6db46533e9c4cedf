"""Which addresses a capacity probe, or a router's request to a worker, may go to (R-P1,
R-P3).

Three layers, each needed because the one before proves too little:

1. **Static** (:func:`static_opt_in`, pure): a provider without ``tailnet: true``
   must name its host as ``localhost`` or a loopback literal; a provider with it
   may name anything, because a name proves nothing until it is resolved.
2. **Ranges** (:func:`classify`, pure): every address the host resolves to must
   be loopback (127.0.0.0/8, ::1) or, for a tailnet provider, a Tailscale
   address (100.64.0.0/10 without the ChromeOS VM range 100.115.92.0/23 and
   Quad100; fd7a:115c:a1e0::/48 without the 4via6 range fd7a:115c:a1e0:b1a::/64
   and Quad100).
3. **Peers** (:func:`whois`): the CGNAT range is also used by ISPs, so an
   address must belong to a peer of this tailnet as the local Tailscale daemon
   says on its LocalAPI socket (404 = not a peer = refused). When the daemon
   cannot be asked (no socket, connection refused), the address is refused
   too (fail closed), unless the provider set ``tailnetCheck: "range-only"``:
   then the daemon is not asked, the range check alone decides and the verdict
   says so.

:func:`check_provider_addresses` runs all three for one provider: it resolves the
host once (in a thread, so a hung resolver cannot outlive the caller's deadline)
and returns the pinned addresses the probe may connect to, or why none.

The sidecar's probe and the router's workers keep one rule, so it lives below both.
Nothing here imports httpx at module level: ``sidecar.config`` uses the pure functions.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import ipaddress
import os
import re
import socket
import threading
from dataclasses import dataclass
from typing import Any, Final, Literal

from shm_layout.platform import is_darwin

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address

_LOOPBACK_V4: Final = ipaddress.ip_network("127.0.0.0/8")
_LOOPBACK_V6: Final = ipaddress.ip_address("::1")
_TAILSCALE_V4: Final = ipaddress.ip_network("100.64.0.0/10")
_CHROMEOS_VM_V4: Final = ipaddress.ip_network("100.115.92.0/23")
_TAILSCALE_V6: Final = ipaddress.ip_network("fd7a:115c:a1e0::/48")
_VIA_V6: Final = ipaddress.ip_network("fd7a:115c:a1e0:b1a::/64")
_QUAD100: Final = frozenset(
    {ipaddress.ip_address("100.100.100.100"), ipaddress.ip_address("fd7a:115c:a1e0::53")}
)

LOCALAPI_HOST: Final = "local-tailscaled.sock"
SOCKET_ENV: Final = "GATEWAY_CAPACITY_TAILSCALE_SOCKET"

AddressKind = Literal["loopback", "tailscale", "other"]


def default_tailscale_socket() -> str:
    """The LocalAPI socket of tailscaled: ``$GATEWAY_CAPACITY_TAILSCALE_SOCKET``, else
    the platform default (Linux ``/var/run/tailscale/tailscaled.sock``; macOS with the
    open-source ``tailscaled`` ``/var/run/tailscaled.socket``; the macOS GUI apps have
    no Unix socket: there a provider needs ``tailnetCheck: "range-only"``)."""
    configured = os.environ.get(SOCKET_ENV)
    if configured:
        return configured
    if is_darwin():
        return "/var/run/tailscaled.socket"
    return "/var/run/tailscale/tailscaled.sock"


def parse_ip(text: str) -> IPAddress | None:
    """An IP literal (brackets and a zone are not accepted), IPv4-mapped IPv6 unmapped."""
    if "%" in text:
        return None  # fe80::1%eth0: a zone names a link, not a host we can check
    try:
        ip = ipaddress.ip_address(text)
    except ValueError:
        return None
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        return ip.ipv4_mapped
    return ip


def is_loopback(ip: IPAddress) -> bool:
    if isinstance(ip, ipaddress.IPv4Address):
        return ip in _LOOPBACK_V4
    return ip == _LOOPBACK_V6


def is_tailscale(ip: IPAddress) -> bool:
    """A Tailscale node address (the ranges Tailscale assigns to nodes, nothing else)."""
    if ip in _QUAD100:
        return False
    if isinstance(ip, ipaddress.IPv4Address):
        return ip in _TAILSCALE_V4 and ip not in _CHROMEOS_VM_V4
    return ip in _TAILSCALE_V6 and ip not in _VIA_V6


def classify(ip: IPAddress) -> AddressKind:
    if is_loopback(ip):
        return "loopback"
    if is_tailscale(ip):
        return "tailscale"
    return "other"


_HOST_PORT = re.compile(r"\[([0-9A-Fa-f:.]+)\]:(\d{1,5})|([^:\[\]]*):(\d{1,5})")


def parse_host_port(text: str, *, empty_host: str | None = None) -> tuple[str, int]:
    """``HOST:PORT`` or ``[IPv6]:PORT`` for a listener; ``ValueError`` says what is wrong.

    An empty host (``:9464``) means ``empty_host``, and is refused when that is ``None``.
    """
    match = _HOST_PORT.fullmatch(text)
    host = None if match is None else match.group(1) or match.group(3) or empty_host
    if match is None or not host:
        raise ValueError(f"must be HOST:PORT or [IPv6]:PORT, not {text!r}")
    port = int(match.group(2) or match.group(4))
    if port > 65535:
        raise ValueError(f"port out of range: {port}")
    return host, port


def is_localhost_name(host: str) -> bool:
    return host.lower().rstrip(".") == "localhost"


# What an operator can do about a refused opt-in (R-P1): said wherever the refusal is.
OPT_IN_FIX: Final = (
    "the key goes only to this host or a Tailscale peer: run the router here (baseUrl "
    "http://127.0.0.1:PORT/v1), or reach it by its Tailscale address or MagicDNS name with "
    '"tailnet": true; else set "capacityDiscovery": false'
)


def static_opt_in(host: str, *, tailnet: bool) -> str | None:
    """``None`` when ``host`` may be probed once its addresses pass, else why not (R-P1).

    Only ``localhost`` and loopback literals qualify without ``tailnet: true``: any other
    name could resolve anywhere. With ``tailnet: true`` a literal must already be a
    Tailscale or loopback address; a name is decided after resolution.
    """
    ip = parse_ip(host)
    if ip is not None:
        kind = classify(ip)
        if kind == "loopback" or (kind == "tailscale" and tailnet):
            return None
        if kind == "tailscale":
            return (
                f"{host} is a Tailscale address but the provider does not set tailnet: true; "
                'add "tailnet": true to the provider'
            )
        return f"{host} is neither loopback nor a Tailscale address; {OPT_IN_FIX}"
    if is_localhost_name(host) or tailnet:
        return None
    return (
        f"host {host!r} is not localhost or a loopback address and the provider does not "
        f'set tailnet: true; if it is a MagicDNS name, add "tailnet": true; else {OPT_IN_FIX}'
    )


# --- resolution -------------------------------------------------------------


class ResolveError(Exception):
    """The host did not resolve. ``str()`` is a short reason."""


async def resolve(host: str, port: int) -> tuple[str, ...]:
    """All addresses of ``host`` for TCP, in resolver order, without duplicates.

    Runs the blocking resolver in the loop's executor, so the caller's
    ``asyncio.timeout`` bounds it even when the resolver hangs (the thread is
    abandoned, not the deadline).
    """
    literal = parse_ip(host)
    if literal is not None:
        return (str(literal),)
    try:
        # shield: a deadline abandons the wait, not the lookup, which the next
        # refresh joins instead of starting another one
        infos = await asyncio.shield(_lookup(host, port))
    except (socket.gaierror, UnicodeError) as exc:
        raise ResolveError(f"{host} did not resolve: {exc}") from None
    found: list[str] = []
    for family, _type, _proto, _canon, sockaddr in infos:
        if family not in (socket.AF_INET, socket.AF_INET6):
            continue
        raw = str(sockaddr[0])
        ip = parse_ip(raw)  # a scoped address (fe80::1%eth0) keeps its zone and is refused
        text = str(ip) if ip is not None else raw
        if text not in found:
            found.append(text)
    if not found:
        raise ResolveError(f"{host} resolved to no IPv4 or IPv6 address")
    return tuple(found)


# One lookup at a time per (host, port), each on a daemon thread of its own: a resolver
# that hangs for one provider's name holds one thread, not the loop's shared executor,
# so it cannot starve the other providers' lookups (R-P8), and being a daemon thread it
# cannot hold up the process's exit either. Later refreshes join the lookup in flight.
_in_flight: dict[tuple[str, int], asyncio.Future[list[Any]]] = {}


def _lookup(host: str, port: int) -> asyncio.Future[list[Any]]:
    key = (host, port)
    loop = asyncio.get_running_loop()
    pending = _in_flight.get(key)
    if pending is not None and not pending.done() and pending.get_loop() is loop:
        return pending
    future: asyncio.Future[list[Any]] = loop.create_future()
    _in_flight[key] = future
    future.add_done_callback(lambda done: _forget(key, done))

    def run() -> None:
        try:
            result: Any = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
            outcome = (True, result)
        except BaseException as exc:  # handed to the waiting coroutine
            outcome = (False, exc)
        with contextlib.suppress(RuntimeError):  # the loop may be closed by now
            loop.call_soon_threadsafe(_settle, future, outcome)

    threading.Thread(target=run, name=f"gwcap-resolve-{host}", daemon=True).start()
    return future


def _settle(future: asyncio.Future[list[Any]], outcome: tuple[bool, Any]) -> None:
    if future.done():
        return
    ok, value = outcome
    if ok:
        future.set_result(value)
    else:
        future.set_exception(value)


def _forget(key: tuple[str, int], done: asyncio.Future[list[Any]]) -> None:
    if _in_flight.get(key) is done:
        del _in_flight[key]
    if not done.cancelled():
        done.exception()  # retrieved, so an abandoned failure is not logged as unhandled


# --- Tailscale LocalAPI whois ----------------------------------------------

WhoisAnswer = Literal["peer", "not_peer", "unavailable"]


@dataclass(frozen=True, slots=True)
class WhoisResult:
    answer: WhoisAnswer
    detail: str  # peer name, or why the daemon could not say


async def whois(ip: str, socket_path: str, port: int = 0, client: Any | None = None) -> WhoisResult:
    """Ask tailscaled whether ``ip`` is a peer: ``GET /localapi/v0/whois?addr=IP:PORT``.

    ``addr`` carries a port because older tailscaled versions parse it as
    IP:port only (newer ones take both). 200 = peer, 404 = not a peer. No
    socket or a refused connection = ``unavailable`` (no daemon: the caller
    refuses, R-P1 fails closed). Any other answer (403 access denied, 5xx
    while the daemon is down) = ``not_peer``: a daemon that answers but cannot
    confirm a peer must not let the key through (R-P1). ``client`` is a
    long-lived ``httpx.AsyncClient`` on that socket (:func:`localapi_client`),
    else one is made for this call. The caller's deadline bounds the call.
    """
    import httpx  # here, not at the top: the handler side imports this module
    import msgspec

    addr = f"[{ip}]:{port}" if ":" in ip else f"{ip}:{port}"
    url = f"http://{LOCALAPI_HOST}/localapi/v0/whois"
    try:
        if client is not None:
            resp = await client.get(url, params={"addr": addr})
        else:
            async with localapi_client(socket_path) as own:
                resp = await own.get(url, params={"addr": addr})
    except (httpx.HTTPError, OSError) as exc:
        why = str(exc).strip() or type(exc).__name__
        return WhoisResult("unavailable", f"no tailscaled at {socket_path}: {why}")
    if resp.status_code == 404:
        return WhoisResult("not_peer", f"tailscaled says {ip} is not a peer of this tailnet")
    if resp.status_code != 200:
        return WhoisResult(
            "not_peer",
            f"tailscaled answered http_{resp.status_code} for {ip}: cannot confirm a peer",
        )
    name = ""
    try:
        body = msgspec.json.decode(resp.content)
        if isinstance(body, dict):
            node = body.get("Node")
            if isinstance(node, dict) and isinstance(node.get("Name"), str):
                name = node["Name"].rstrip(".")
    except msgspec.DecodeError:
        pass
    return WhoisResult("peer", f"tailnet peer {name}" if name else "tailnet peer")


def localapi_client(socket_path: str) -> Any:
    """An ``httpx.AsyncClient`` speaking to tailscaled's LocalAPI on ``socket_path``."""
    import httpx

    return httpx.AsyncClient(
        transport=httpx.AsyncHTTPTransport(uds=socket_path),
        trust_env=False,
        follow_redirects=False,
    )


# --- the whole check for one provider --------------------------------------


@dataclass(frozen=True, slots=True)
class AddressVerdict:
    address: str
    allowed: bool
    detail: str  # "loopback", "tailnet peer NAME", "range-checked only (...)", or why not


@dataclass(frozen=True, slots=True)
class AddressCheck:
    """The outcome for one provider: ``refused`` is ``None`` when every address passed."""

    verdicts: tuple[AddressVerdict, ...]
    refused: str | None

    @property
    def addresses(self) -> tuple[str, ...]:
        return tuple(v.address for v in self.verdicts)


RANGE_ONLY_NOTE: Final = "range-checked only (tailnetCheck: range-only)"


async def check_address(
    address: str,
    *,
    tailnet: bool,
    socket_path: str,
    port: int = 0,
    range_only: bool = False,
    localapi: Any | None = None,
) -> AddressVerdict:
    ip = parse_ip(address)
    kind = classify(ip) if ip is not None else "other"
    if kind == "loopback":
        return AddressVerdict(address, True, "loopback")
    if kind == "tailscale" and tailnet:
        if range_only:  # the provider's explicit choice, said in every verdict
            return AddressVerdict(address, True, RANGE_ONLY_NOTE)
        answer = await whois(address, socket_path, port, localapi)
        if answer.answer == "peer":
            return AddressVerdict(address, True, answer.detail)
        if answer.answer == "not_peer":
            return AddressVerdict(address, False, answer.detail)
        # R-P1 fails closed: no daemon to vouch for the peer, no key
        return AddressVerdict(
            address,
            False,
            f"tailscaled cannot vouch for a peer ({answer.detail}); start tailscaled, point "
            'to its socket, or set "tailnetCheck": "range-only" on the provider',
        )
    if kind == "tailscale":
        return AddressVerdict(address, False, "Tailscale address but tailnet is not true")
    return AddressVerdict(address, False, NOT_ELIGIBLE)


NOT_ELIGIBLE: Final = "neither loopback nor a Tailscale address"


async def check_provider_addresses(
    host: str,
    port: int,
    *,
    tailnet: bool,
    socket_path: str | None = None,
    range_only: bool = False,
    localapi: Any | None = None,
) -> AddressCheck:
    """Resolve ``host`` once and check every address (R-P1, R-P3).

    Every address must pass: one bad address refuses the provider, because the
    gateway's own requests could go to any of them. Raises :class:`ResolveError`;
    the caller's ``asyncio.timeout`` bounds the whole call.
    """
    static = static_opt_in(host, tailnet=tailnet)
    if static is not None:
        return AddressCheck((), static)
    path = socket_path if socket_path is not None else default_tailscale_socket()
    addresses = await resolve(host, port)
    check = functools.partial(
        check_address,
        tailnet=tailnet,
        socket_path=path,
        port=port,
        range_only=range_only,
        localapi=localapi,
    )
    verdicts = tuple(await asyncio.gather(*(check(a) for a in addresses)))
    bad = [v for v in verdicts if not v.allowed]
    if bad:
        why = "; ".join(f"{v.address}: {v.detail}" for v in bad)
        fix = f"; {OPT_IN_FIX}" if any(v.detail == NOT_ELIGIBLE for v in bad) else ""
        return AddressCheck(verdicts, f"{host} resolves to a refused address ({why}){fix}")
    return AddressCheck(verdicts, None)
