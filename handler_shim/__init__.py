"""What inference handlers import: one admission budget per provider, shared by every
process and generation on this host (REQUIREMENTS.md section 6).

    from handler_shim import Admission, QueueFull, AdmissionTimeout
    adm = Admission.attach(config="gateway.json", generation="handler-2.0")
    async with adm.slot("local-inference", timeout=30.0):
        ...
    ticket = await adm.acquire("local-inference")   # taken in one callback,
    adm.release(ticket)                              # given back in another

An ASGI app admits every HTTP request with ``handler_shim.asgi.AdmissionMiddleware``.

The errors, all exported here; catch the one you mean (``str()`` is one line
that says what to fix)::

    GatewayCapacityError               anything gateway-capacity refused
    ├── BadSegmentName (ValueError)    attach: the segment name cannot be used
    ├── OwnerError (ValueError)        attach(owner=..., group=...): no such user or group
    ├── ForeignObject                  attach: the lock file or its directory is not ours
    ├── NotOnThisPlatform              a call this platform does not have
    ├── ConfigError                    attach(config=...): the file cannot be read or parsed
    ├── ProviderIdError (ValueError)   a provider id the segment cannot store
    ├── TableFull                      the segment has no row left for another provider
    ├── CoreError (OSError)            the admission core refused a call (a stale ticket)
    │   └── DamagedLock                the segment's lock word holds what no lock writes
    ├── SegmentError                   attach: the shared segment cannot be used
    │   ├── SegmentMissing
    │   ├── SegmentNotReady            its creator never finished initialising it
    │   ├── UnsafePermissions
    │   ├── IncompatibleLayout         another major layout version (R-G2)
    │   └── NotOurSegment
    │       ├── ForeignSegment         another user owns it: --group-shared and owner=
    │       └── DamagedSegment         ours by its header, values no writer produces
    └── AdmissionError                 attach: no member row left; use after close()
        ├── QueueFull                  the provider's queue is at its bound (R-A2)
        ├── AdmissionTimeout (TimeoutError)  no slot within the timeout (R-A4)
        └── UnknownProvider (KeyError) not in the segment, or no row for it (R-A13)
"""

from typing import TYPE_CHECKING, Any

from handler_shim.admission import (
    Admission,
    AdmissionError,
    AdmissionTimeout,
    QueueFull,
    Ticket,
    UnknownProvider,
)
from shm_layout._core import CoreError, DamagedLock
from shm_layout.errors import GatewayCapacityError
from shm_layout.ledger import ProviderIdError
from shm_layout.names import BadSegmentName
from shm_layout.owners import ForeignObject, OwnerError
from shm_layout.platform import NotOnThisPlatform
from shm_layout.segment import (
    DamagedSegment,
    ForeignSegment,
    IncompatibleLayout,
    NotOurSegment,
    SegmentError,
    SegmentMissing,
    SegmentNotReady,
    UnsafePermissions,
)
from shm_layout.writer import TableFull

if TYPE_CHECKING:
    from gateway_config import ConfigError
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
    if name == "ConfigError":
        from gateway_config import ConfigError

        return ConfigError
    raise AttributeError(f"module 'handler_shim' has no attribute {name!r}")
