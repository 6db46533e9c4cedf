"""The segment: its versioned binary layout, create/attach, the lock, and the holder ledger.

Imports nothing of ours. The only package that knows byte offsets.
"""

from shm_layout.segment import (
    IncompatibleLayout,
    NotOurSegment,
    Segment,
    SegmentError,
    SegmentMissing,
    SegmentNotReady,
    unlink_segment,
)
from shm_layout.view import read_provider_load, read_view

__all__ = [
    "IncompatibleLayout",
    "NotOurSegment",
    "Segment",
    "SegmentError",
    "SegmentMissing",
    "SegmentNotReady",
    "read_provider_load",
    "read_view",
    "unlink_segment",
]
