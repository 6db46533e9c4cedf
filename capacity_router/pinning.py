"""Where a worker URL may be contacted: the sidecar probe's rule for the router's workers.

A worker gets its key (``keyFile``) and its users' prompts, so the router contacts a
worker URL only on addresses it has checked, and connects to exactly those (pinned from
resolution to connection; the Host header and the TLS name stay the URL's):

- a **loopback** host (``localhost``, 127.0.0.0/8, ``::1``): while every socket that
  could take the connection belongs to the worker's ``listenerOwner`` or, without one,
  to root or the router's user (:func:`capacity_contract.listeners.worker_refusal`);
- **any other** host is resolved once per check, and every address it resolves to must
  be loopback (with the listener rule above) or a Tailscale address of a peer of this
  tailnet as the local tailscaled says on its LocalAPI socket (``whois``; the socket is
  ``$GATEWAY_CAPACITY_TAILSCALE_SOCKET`` or the platform's default), or, for a worker
  with ``"tailnetCheck": "range-only"``, a Tailscale address on its range alone. One
  refused address refuses the URL: the router's own connection could go to any of them.
  No daemon to ask refuses too (fail closed).

The same rules as :mod:`capacity_contract.addresses` (R-P1, R-P3) and
:mod:`capacity_contract.listeners` (R-P7) keep for the probe's hop.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Final
from urllib.parse import urlsplit

from capacity_contract import addresses, listeners

RANGE_ONLY: Final = "range-only"


@dataclass(frozen=True, slots=True)
class Route:
    """``addresses``: where the URL may be contacted, each checked (a loopback host
    stands as itself); ``refused``: why nowhere (a WARNING, nothing sent);
    ``unresolved``: the name did not resolve (the worker is unreachable, not refused)."""

    addresses: tuple[str, ...] = ()
    refused: str | None = None
    unresolved: str | None = None


def http_url(host: str, port: int) -> str:
    """``http://host:port``, an IPv6 address in brackets (RFC 3986 3.2.2)."""
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def url_port(url: str) -> tuple[str, int]:
    parts = urlsplit(url)
    return parts.hostname or "", parts.port or (443 if parts.scheme == "https" else 80)


async def route_of(
    url: str,
    owner: int | str | None,
    tailnet_check: str | None = None,
    *,
    socket_path: str | None = None,
    in_thread: bool = True,
) -> Route:
    """Check ``url``'s host now (see the module's docstring); the caller's deadline bounds
    it (resolution runs on a thread of its own). A loopback host's listener table is read
    on a thread of the loop's executor, or with ``in_thread=False`` right here (a loop of
    its own, as the poller's, may wait the millisecond or so it takes)."""
    host, port = url_port(url)
    if listeners.loopback_addresses(host):
        if in_thread:
            refused = await asyncio.to_thread(listeners.worker_refusal, host, port, owner)
        else:
            refused = listeners.worker_refusal(host, port, owner)
        return Route(refused=refused) if refused is not None else Route((host,))
    try:
        found = await addresses.resolve(host, port)
    except addresses.ResolveError as exc:
        return Route(unresolved=str(exc))
    path = socket_path if socket_path is not None else addresses.default_tailscale_socket()
    verdicts = await asyncio.gather(
        *(
            addresses.check_address(
                a,
                tailnet=True,
                socket_path=path,
                port=port,
                range_only=tailnet_check == RANGE_ONLY,
            )
            for a in found
        )
    )
    bad = [f"{v.address}: {v.detail}" for v in verdicts if not v.allowed]
    for verdict in verdicts:
        if verdict.allowed and verdict.detail == "loopback":
            why = await asyncio.to_thread(listeners.worker_refusal, verdict.address, port, owner)
            if why is not None:
                bad.append(f"{verdict.address}: {why}")
    if bad:
        return Route(
            refused=f"{host} resolves to a refused address ({'; '.join(bad)}): the router "
            "contacts a worker only on loopback or a peer of this tailnet"
        )
    return Route(found)
