"""What inference handlers import: one admission budget per provider, shared by every
process and generation on this host (REQUIREMENTS.md section 6).

    from handler_shim import Admission, QueueFull, AdmissionTimeout
    adm = Admission.attach(config="gateway.json", generation="handler-2.0")
    async with adm.slot("local-inference", timeout=30.0):
        ...

An ASGI app admits every HTTP request with ``handler_shim.asgi.AdmissionMiddleware``.
"""

from typing import TYPE_CHECKING, Any

from handler_shim.admission import (
    Admission,
    AdmissionError,
    AdmissionTimeout,
    QueueFull,
    UnknownProvider,
)
from shm_layout.segment import IncompatibleLayout, SegmentError

if TYPE_CHECKING:
    from handler_shim.asgi import AdmissionMiddleware

__all__ = [
    "Admission",
    "AdmissionError",
    "AdmissionMiddleware",
    "AdmissionTimeout",
    "IncompatibleLayout",
    "QueueFull",
    "SegmentError",
    "UnknownProvider",
]


def __getattr__(name: str) -> Any:
    # The ASGI middleware is imported on first use: ``import handler_shim`` stays light.
    if name == "AdmissionMiddleware":
        from handler_shim.asgi import AdmissionMiddleware

        return AdmissionMiddleware
    raise AttributeError(f"module 'handler_shim' has no attribute {name!r}")
