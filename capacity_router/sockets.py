"""Two registered workers that reach one server: a warning, never a refusal.

Worker ids are opaque by design (R-K5): the registry cannot know that
``http://127.0.0.1:8080`` under ``a`` and ``http://localhost:8080`` under ``b`` are one
llama-server, whose slots would then count twice. What it can see is that both URLs
resolve to one socket address (with the same path): ``router check`` and ``router show``
say so, and the router logs it once, so an operator can list both URLs under one id.
"""

from __future__ import annotations

import ipaddress
import socket
from collections.abc import Callable, Iterable
from urllib.parse import urlsplit

from .registry import Worker

Resolver = Callable[[str, int], Iterable[tuple[str, int]]]


def resolve(host: str, port: int) -> list[tuple[str, int]]:
    """``host``'s TCP socket addresses on ``port`` (none when it does not resolve)."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError):
        return []
    return [(_plain(str(info[4][0])), int(info[4][1])) for info in infos]


def _plain(ip: str) -> str:
    """An IPv4-mapped IPv6 address (``::ffff:127.0.0.1``) as the IPv4 address it
    reaches: a dual-stack socket connects to the IPv4 listener."""
    try:
        mapped = ipaddress.IPv6Address(ip.split("%", 1)[0]).ipv4_mapped
    except ValueError:
        return ip
    return str(mapped) if mapped is not None else ip


def _address(ip: str, port: int) -> str:
    return f"[{ip}]:{port}" if ":" in ip else f"{ip}:{port}"


def shared_sockets(workers: Iterable[Worker], resolver: Resolver = resolve) -> list[str]:
    """One warning for each two workers whose URLs resolve to one socket address."""
    owners: dict[tuple[str, int, str], tuple[str, str]] = {}
    warned: set[tuple[str, str]] = set()
    warnings: list[str] = []
    for worker in workers:
        for url in worker.urls:
            parts = urlsplit(url)
            if parts.hostname is None:
                continue
            port = parts.port or (443 if parts.scheme == "https" else 80)
            path = parts.path.rstrip("/")
            for ip, at in dict.fromkeys(resolver(parts.hostname, port)):
                first = owners.setdefault((ip, at, path), (worker.id, url))
                pair = (first[0], worker.id)
                if first[0] == worker.id or pair in warned:
                    continue
                warned.add(pair)
                warnings.append(
                    f"workers {first[0]!r} ({first[1]}) and {worker.id!r} ({url}) resolve to "
                    f"one socket address {_address(ip, at)}{path}: if they are one server, its "
                    "slots count twice; list both URLs under one id"
                )
    return warnings
