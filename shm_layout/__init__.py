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

__all__ = [
    "IncompatibleLayout",
    "NotOurSegment",
    "Segment",
    "SegmentError",
    "SegmentMissing",
    "SegmentNotReady",
    "unlink_segment",
]
