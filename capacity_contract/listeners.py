"""Who listens on a loopback address and port, before the key is sent there (R-P7).

On loopback any local user may listen on the router's port while the router is
down, and would then receive ``Authorization: Bearer <key>``. A provider that
names ``listenerOwner`` (a uid or user name) has the owner of the listening
socket checked before every probe that sends its key; without the setting, a
listener owned by neither the sidecar's user nor root is logged (the key is
still sent: the operator did not say who should listen).

The kernel gives a connection to ``A:P`` to a listener on ``A:P`` itself or
on a wildcard (``0.0.0.0:P``, ``[::]:P``, or ``[::ffff:A]:P`` for an IPv4
``A``). Every such candidate must belong to the expected owner: which one wins
is the kernel's business, so a foreign candidate refuses. Another user cannot
join the owner's listener (``SO_REUSEPORT`` groups need the same uid), so a
checked listener cannot be shared with a squatter while it lives.

Linux answers from the kernel: its ``sock_diag`` netlink interface asked for
listening TCP sockets only (:func:`read_netlink_table`), else its TCP socket tables
(the ``uid`` column of sockets in state LISTEN, ``0A``, read by
``shm_layout.platform.tcp_socket_tables``); a test may swap :data:`table_reader`.
Elsewhere (macOS has no ``/proc``) there is no table and the owner cannot be
checked, which refuses a provider that asked for the check (fail closed) and is
said once for one that did not.
"""

from __future__ import annotations

import ipaddress
import os
import pwd
import socket
import struct
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Final

from shm_layout.platform import tcp_socket_tables

LISTEN_STATE: Final = "0A"
TABLE_TTL_S: Final = 0.2  # providers probed in one cycle share one reading

# (local address as text, port) -> uids of the sockets listening there
ListenTable = dict[tuple[str, int], frozenset[int]]


def _hex_address(text: str) -> str:
    """``0100007F`` / 32 hex digits as the kernel prints them: 32-bit words in host order."""
    raw = b"".join(
        int(text[i : i + 8], 16).to_bytes(4, sys.byteorder) for i in range(0, len(text), 8)
    )
    family = socket.AF_INET if len(raw) == 4 else socket.AF_INET6
    return str(ipaddress.ip_address(socket.inet_ntop(family, raw)))


def parse_proc_net_tcp(text: str) -> ListenTable:
    """The LISTEN sockets of one ``/proc/net/tcp*`` file, by (address, port)."""
    found: dict[tuple[str, int], set[int]] = {}
    for line in text.splitlines()[1:]:
        fields = line.split()
        if len(fields) < 8 or fields[3] != LISTEN_STATE:
            continue
        address, _, port = fields[1].partition(":")
        try:
            key = (_hex_address(address), int(port, 16))
            uid = int(fields[7])
        except ValueError:
            continue
        found.setdefault(key, set()).add(uid)
    return {k: frozenset(v) for k, v in found.items()}


def read_proc_tables() -> ListenTable | None:
    """Every listening TCP socket and its owner; ``None`` where the platform has no such
    table (macOS, or a /proc that cannot be read)."""
    texts = tcp_socket_tables()
    if texts is None:
        return None
    table: ListenTable = {}
    for text in texts:
        for key, uids in parse_proc_net_tcp(text).items():
            table[key] = table.get(key, frozenset()) | uids
    return table


_NETLINK_INET_DIAG: Final = 4
_SOCK_DIAG_BY_FAMILY: Final = 20
_NLM_F_REQUEST_DUMP: Final = 0x301
_NLMSG_ERROR, _NLMSG_DONE = 2, 3
_TCP_LISTEN_BIT: Final = 1 << 10


def read_netlink_table() -> ListenTable | None:
    """Every listening TCP socket and its owner, from the kernel's ``sock_diag`` netlink
    interface (Linux): asked for listeners only, the kernel walks its listening table
    alone, where ``/proc/net/tcp`` walks every connection (2 ms against 60-100 ms on a
    busy host). ``None`` where netlink is not there (macOS) or refuses."""
    family_netlink = getattr(socket, "AF_NETLINK", None)
    if family_netlink is None:
        return None
    found: dict[tuple[str, int], set[int]] = {}
    try:
        for family in (socket.AF_INET, socket.AF_INET6):
            with socket.socket(family_netlink, socket.SOCK_RAW, _NETLINK_INET_DIAG) as sock:
                # inet_diag_req_v2: family, protocol, ext, pad, states; a zero socket id
                request = struct.pack("=BBBxI", family, socket.IPPROTO_TCP, 0, _TCP_LISTEN_BIT)
                request += bytes(48)
                header = struct.pack(
                    "=IHHII", 16 + len(request), _SOCK_DIAG_BY_FAMILY, _NLM_F_REQUEST_DUMP, 1, 0
                )
                sock.sendto(header + request, (0, 0))
                while not _read_diag(sock.recv(1 << 16), found):
                    pass
    except OSError:
        return None
    return {k: frozenset(v) for k, v in found.items()}


def _read_diag(data: bytes, found: dict[tuple[str, int], set[int]]) -> bool:
    """Add one netlink reply's inet_diag_msg records to ``found``; True at its end."""
    at = 0
    while at + 16 <= len(data):
        length, kind = struct.unpack_from("=IH", data, at)
        if kind == _NLMSG_DONE:
            return True
        if kind == _NLMSG_ERROR or length < 16:
            raise OSError("sock_diag refused the request")
        body = at + 16  # inet_diag_msg: family, state, timer, retrans, then the socket id
        family = data[body]
        port = struct.unpack_from("!H", data, body + 4)[0]
        size = 4 if family == socket.AF_INET else 16
        address = str(ipaddress.ip_address(data[body + 8 : body + 8 + size]))
        uid = struct.unpack_from("=I", data, body + 64)[0]  # after expires, rqueue, wqueue
        found.setdefault((address, port), set()).add(uid)
        at += (length + 3) & ~3
    return False


def read_listen_table() -> ListenTable | None:
    """Netlink where the kernel answers it, else ``/proc/net/tcp*``."""
    table = read_netlink_table()
    return table if table is not None else read_proc_tables()


# The way of listing listeners; a test may swap it.
table_reader: Callable[[], ListenTable | None] = read_listen_table

_cached: tuple[float, ListenTable | None] | None = None


def listen_table(*, fresh: bool = False) -> ListenTable | None:
    """:data:`table_reader`'s answer, read at most once per :data:`TABLE_TTL_S` unless
    ``fresh``."""
    global _cached
    now = time.monotonic()
    if fresh or _cached is None or now - _cached[0] > TABLE_TTL_S:
        _cached = (now, table_reader())
    return _cached[1]


def candidates(address: str, port: int) -> tuple[tuple[str, int], ...]:
    """Every (local address, port) whose listener may be handed a connection to
    ``address:port``: the address itself and the wildcards that cover it."""
    ip = ipaddress.ip_address(address)
    if isinstance(ip, ipaddress.IPv4Address):
        mapped = str(ipaddress.ip_address(f"::ffff:{address}"))  # as _hex_address spells it
        return ((str(ip), port), ("0.0.0.0", port), (mapped, port), ("::", port))
    return ((str(ip), port), ("::", port))


def listening_uids(address: str, port: int, *, fresh: bool = False) -> frozenset[int] | None:
    """The owners of every socket that could take a connection to ``address:port``;
    ``None`` when this platform cannot tell. ``fresh``: a reading of now, not one up to
    TABLE_TTL_S old."""
    table = listen_table(fresh=fresh)
    if table is None:
        return None
    uids = _owners(table, address, port)
    if not uids:
        # nobody in a reading up to TABLE_TTL_S old: a listener that came since is
        # exactly a squatter on a port its worker just left, so look again now
        table = listen_table(fresh=True)
        uids = frozenset() if table is None else _owners(table, address, port)
    return uids


def _owners(table: ListenTable, address: str, port: int) -> frozenset[int]:
    uids: frozenset[int] = frozenset()
    for key in candidates(address, port):
        uids |= table.get(key, frozenset())
    return uids


def resolve_owner(owner: int | str) -> int:
    """A ``listenerOwner`` setting as a uid; ``KeyError`` for an unknown user name."""
    if isinstance(owner, int):
        return owner
    return pwd.getpwnam(owner).pw_uid


def user_name(uid: int) -> str:
    try:
        return f"uid {uid} ({pwd.getpwuid(uid).pw_name})"
    except KeyError:
        return f"uid {uid}"


@dataclass(frozen=True, slots=True)
class ListenerCheck:
    """``refused`` is why the key must not go to ``address:port`` (None: it may);
    ``foreign`` lists listener owners that are neither this user nor root, for the
    warning given when no owner was configured."""

    refused: str | None
    foreign: frozenset[int] = frozenset()


def check_listener(
    address: str, port: int, owner: int | str | None, *, fresh: bool = False
) -> ListenerCheck:
    """Check the listener(s) of a loopback ``address:port`` against ``owner``."""
    uids = listening_uids(address, port, fresh=fresh)
    shown = f"[{address}]:{port}" if ":" in address else f"{address}:{port}"
    if owner is None:
        if uids is None:
            return ListenerCheck(None)
        return ListenerCheck(None, frozenset(u for u in uids if u not in (0, os.geteuid())))
    try:
        expected = resolve_owner(owner)
    except KeyError:
        return ListenerCheck(f"listenerOwner {owner!r} is not a user of this host")
    if uids is None:
        return ListenerCheck(
            f"listenerOwner is set but this platform cannot tell who listens on {shown}"
        )
    if not uids:
        return ListenerCheck(f"nothing listens on {shown}")
    others = sorted(u for u in uids if u != expected)
    if others:
        return ListenerCheck(
            f"{shown} is listened on by {', '.join(user_name(u) for u in others)}, "
            f"not listenerOwner {owner!r}"
        )
    return ListenerCheck(None)


def loopback_addresses(host: str) -> tuple[str, ...]:
    """The loopback addresses a URL's host reaches (``localhost``: both); ``()`` for a
    host that is not loopback."""
    if host.lower() in ("localhost", "localhost."):
        return ("127.0.0.1", "::1")
    try:
        ip = ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        return ()
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return (str(ip),) if ip.is_loopback else ()


def worker_refusal(host: str, port: int, owner: int | str | None) -> str | None:
    """Why a router must not contact a worker at ``host:port`` (None: it may).

    A loopback worker is contacted only while every socket that could take the
    connection belongs to ``owner`` (its ``listenerOwner``) or, without one, to root or
    the router's own user: a down worker's port is anyone's to listen on, and whoever
    does would get the worker's key and its users' prompts. Where the platform cannot
    tell, a worker with ``listenerOwner`` is refused and one without is contacted.

    Always on a fresh reading (a netlink dump, about a millisecond): a cached one could
    still show the worker's own listener when it died and a squatter took its port since,
    and the router asks this before every poll and every new relay connection."""
    for address in loopback_addresses(host):
        if owner is not None:
            refused = check_listener(address, port, owner, fresh=True).refused
            if refused is not None and not refused.startswith("nothing listens"):
                return refused
            continue
        check = check_listener(address, port, None, fresh=True)
        if check.foreign:
            shown = f"[{address}]:{port}" if ":" in address else f"{address}:{port}"
            return (
                f"{shown} is listened on by "
                f"{', '.join(user_name(u) for u in sorted(check.foreign))}, neither root nor "
                "the router's user: set listenerOwner on the worker if that user runs it"
            )
    return None
