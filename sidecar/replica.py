"""What one probe of one replica found: the unit passed from the probe to the limit rules.

``reason`` is one of a closed set of names (:data:`REASONS`), so logs, the
segment and ``availability`` speak the same words. A reason never contains a
credential, a header or a body.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Final

# Closed set of per-replica outcomes. "ok" is the only success.
OK: Final = "ok"
REASONS: Final = frozenset(
    {
        OK,
        "unreachable",  # DNS, connect, TLS or read failure
        "timeout",  # the 3 s deadline (R-P5)
        "redirect_refused",  # any 3xx (R-P4)
        "auth_failed",  # 401 / 403
        "no_endpoint",  # 404
        "http_error",  # any other non-2xx; ``detail`` carries "http_<code>"
        "too_large",  # body over 64 KiB (R-P6)
        "invalid",  # not a valid snapshot (R-K1..R-K3); ``detail`` says why
        "stale",  # observed_at older than 30 s (R-K4)
        "future",  # observed_at more than 5 s ahead (R-K4)
        "address_refused",  # resolved address failed the opt-in check (R-P1, R-P3)
        "credential_error",  # the key file cannot be used (R-P7)
        "listener_refused",  # a loopback listener not owned by listenerOwner (R-P7)
    }
)


@dataclass(frozen=True, slots=True)
class ReplicaResult:
    """One replica (one resolved address of the provider's host) in one refresh.

    ``models`` maps upstream model id -> max_concurrent_requests and is only
    meaningful when ``reason == "ok"``; ``request_tokens`` and ``running_tokens`` map
    the ids whose row states ``max_request_tokens`` / ``max_running_tokens`` (R-K7) to
    them (an id absent there: unknown). ``detail`` is a short human phrase that
    never contains the key.
    """

    address: str
    reason: str
    detail: str = ""
    complete: bool = False
    observed_at: float | None = None
    models: dict[str, int] = field(default_factory=dict)
    request_tokens: dict[str, int] = field(default_factory=dict)
    running_tokens: dict[str, int] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return self.reason == OK

    def __post_init__(self) -> None:
        if self.reason not in REASONS:
            raise ValueError(f"unknown replica reason {self.reason!r}")


@dataclass(frozen=True, slots=True)
class ProviderProbe:
    """All replicas of one provider in one refresh, or why none was probed.

    ``refused`` is set (and ``replicas`` empty) when nothing was sent at all:
    the opt-in was refused, the host did not resolve, or the key is unusable.
    """

    provider_id: str
    replicas: tuple[ReplicaResult, ...] = ()
    refused: str | None = None
