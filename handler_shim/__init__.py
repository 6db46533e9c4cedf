"""What inference handlers import: one admission budget per provider, shared by every
process and generation on this host (REQUIREMENTS.md section 6).

    from handler_shim import Admission, QueueFull, AdmissionTimeout
    adm = Admission.attach(config="gateway.json", generation="handler-2.0")
    async with adm.slot("local-inference", timeout=30.0):
        ...
"""

from handler_shim.admission import (
    Admission,
    AdmissionError,
    AdmissionTimeout,
    QueueFull,
    UnknownProvider,
)
from shm_layout.segment import IncompatibleLayout, SegmentError

__all__ = [
    "Admission",
    "AdmissionError",
    "AdmissionTimeout",
    "IncompatibleLayout",
    "QueueFull",
    "SegmentError",
    "UnknownProvider",
]
