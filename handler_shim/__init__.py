"""What inference handlers import: one admission budget per provider, shared by every
process and generation on this host (REQUIREMENTS.md section 6).

    from handler_shim import Admission, QueueFull, AdmissionTimeout
    adm = Admission.attach(config="gateway.json", generation="handler-2.0")
    async with adm.slot("local-inference", timeout=30.0):
        ...
    ticket = await adm.acquire("local-inference")   # taken in one callback,
    adm.release(ticket)                              # given back in another

An ASGI app admits every HTTP request with ``handler_shim.asgi.AdmissionMiddleware``.

The errors, all exported here (catch the one you mean; ``str()`` is one line that
says what to fix), are defined in ``shm_layout.errors``, whose docstring draws the tree.
"""

from typing import TYPE_CHECKING, Any

from handler_shim.admission import Admission, Ticket
from shm_layout.errors import (
    AdmissionError,
    AdmissionTimeout,
    BadSegmentName,
    ConfigError,
    CoreError,
    DamagedLock,
    DamagedSegment,
    ForeignObject,
    ForeignSegment,
    GatewayCapacityError,
    IncompatibleLayout,
    NotOnThisPlatform,
    NotOurSegment,
    OwnerError,
    ProviderIdError,
    QueueFull,
    RequestTooLarge,
    SegmentError,
    SegmentMissing,
    SegmentNotReady,
    TableFull,
    UnknownProvider,
    UnsafePermissions,
)

if TYPE_CHECKING:
    from handler_shim.asgi import AdmissionMiddleware

__all__ = [
    "Admission",
    "AdmissionError",
    "AdmissionMiddleware",
    "AdmissionTimeout",
    "BadSegmentName",
    "ConfigError",
    "CoreError",
    "DamagedLock",
    "DamagedSegment",
    "ForeignObject",
    "ForeignSegment",
    "GatewayCapacityError",
    "IncompatibleLayout",
    "NotOnThisPlatform",
    "NotOurSegment",
    "OwnerError",
    "ProviderIdError",
    "QueueFull",
    "RequestTooLarge",
    "SegmentError",
    "SegmentMissing",
    "SegmentNotReady",
    "TableFull",
    "Ticket",
    "UnknownProvider",
    "UnsafePermissions",
]


def __getattr__(name: str) -> Any:
    # Imported on first use: ``import handler_shim`` stays light (no ASGI, no msgspec).
    if name == "AdmissionMiddleware":
        from handler_shim.asgi import AdmissionMiddleware

        return AdmissionMiddleware
    raise AttributeError(f"module 'handler_shim' has no attribute {name!r}")
