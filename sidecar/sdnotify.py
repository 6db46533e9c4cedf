"""systemd readiness and watchdog notifications (``sd_notify(3)``), standard library only.

Under a ``Type=notify`` unit the service manager passes ``$NOTIFY_SOCKET``: a
Unix datagram socket, either a file system path or an abstract name written
with a leading ``@``. One datagram carries newline-separated ``VAR=VALUE``
assignments. Outside systemd (no ``$NOTIFY_SOCKET``) every call does nothing
and returns ``False``, so the daemon calls these unconditionally, and a failed
notification never raises: it must not take the daemon down.

Only fixed assignments and ``STATUS=`` text go out. The daemon composes that
text from provider ids, limits and reason names; a key never reaches this
module (R-P7).
"""

from __future__ import annotations

import os
import socket
from collections.abc import Callable, Mapping

# sd_notify blocks until the manager reads the datagram; bound that wait so a
# wedged manager cannot stall the daemon's reaping loop.
_SEND_TIMEOUT_S = 2.0


def _socket_address(value: str) -> str | None:
    if value.startswith("/"):
        return value
    if value.startswith("@") and len(value) > 1:
        return "\0" + value[1:]  # abstract namespace
    return None  # e.g. "vsock:…": not used for host services, and AF_VSOCK is not allowed


def notify(state: str, environ: Mapping[str, str] | None = None) -> bool:
    """Send ``state`` (``"READY=1"``, ``"WATCHDOG=1"`` …) to ``$NOTIFY_SOCKET``.

    True when the datagram was sent; False when not under systemd, when the
    socket address is unusable or when sending failed.
    """
    env = os.environ if environ is None else environ
    address = _socket_address(env.get("NOTIFY_SOCKET", ""))
    if address is None or not state:
        return False
    data = state.encode("utf-8")
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
            sock.settimeout(_SEND_TIMEOUT_S)
            return sock.sendto(data, address) == len(data)
    except OSError:
        return False


def ready() -> bool:
    """Start-up is complete (``READY=1``): systemd marks the unit active."""
    return notify("READY=1")


def stopping() -> bool:
    """Shutdown has begun (``STOPPING=1``)."""
    return notify("STOPPING=1")


def status(text: str) -> bool:
    """One line for ``systemctl status``. Line breaks become spaces so the text
    can never smuggle in another assignment such as ``READY=1``."""
    one_line = " ".join(text.splitlines())
    return notify("STATUS=" + one_line)


def watchdog_interval(environ: Mapping[str, str] | None = None) -> float | None:
    """Seconds within which systemd expects ``WATCHDOG=1``, or None when the
    watchdog is off for this process.

    Same rules as ``sd_watchdog_enabled(3)``: ``$WATCHDOG_USEC`` must be a
    positive integer, and when ``$WATCHDOG_PID`` is set it must be our pid (the
    variables may have been inherited by a child that is not the main process).
    """
    env = os.environ if environ is None else environ
    usec = _unsigned(env.get("WATCHDOG_USEC"))
    if usec is None or not 0 < usec < _USEC_INFINITY:
        return None
    if "WATCHDOG_PID" in env and _unsigned(env["WATCHDOG_PID"]) != os.getpid():
        return None
    return usec / 1_000_000


_USEC_INFINITY = 2**64 - 1  # systemd's "no limit"


def _unsigned(text: str | None) -> int | None:
    if not text or not (text.isascii() and text.isdigit()):
        return None
    return int(text)


class Watchdog:
    """Keeps systemd's watchdog fed from the daemon's own loop.

    Pings at half the interval, as ``sd_watchdog_enabled(3)`` recommends, so
    one late loop turn is not fatal. Because the ping comes from the loop that
    also reaps and publishes, a wedged loop stops the pings and systemd
    restarts the sidecar (``WatchdogSec=`` with ``Restart=on-failure``).
    ``now`` is any monotonic clock (``time.monotonic()``).
    """

    def __init__(self, interval: float | None, send: Callable[[str], bool] = notify) -> None:
        self.period: float | None = interval / 2 if interval else None
        self._send = send
        self._last: float | None = None

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> Watchdog:
        return cls(watchdog_interval(environ))

    @property
    def enabled(self) -> bool:
        return self.period is not None

    def due_in(self, now: float) -> float | None:
        """Seconds until the next ping is due (0 when due now), None when disabled."""
        if self.period is None:
            return None
        if self._last is None:
            return 0.0
        return max(0.0, self._last + self.period - now)

    def maybe_ping(self, now: float) -> bool:
        """Send ``WATCHDOG=1`` if half the interval has passed since the last
        ping (or none was sent yet). True when a ping was sent now."""
        if self.period is None:
            return False
        if self._last is not None and self._last <= now < self._last + self.period:
            return False
        # A failed send is retried a period later, not on every loop turn; the
        # other half of the interval is the margin for that retry.
        self._last = now
        return self._send("WATCHDOG=1")
