"""The segment: its versioned binary layout, create/attach, the lock, and the holder ledger.

Imports nothing of ours. The only package that knows byte offsets. Its names are
loaded on first use, so that a handler's ``import handler_shim`` pulls in only what a
slot needs (the views, the model and the writer load when something uses them).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
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

_FROM = {name: "shm_layout.segment" for name in __all__ if not name.startswith("read_")}
_FROM.update({"read_provider_load": "shm_layout.view", "read_view": "shm_layout.view"})


def __getattr__(name: str) -> Any:
    module = _FROM.get(name)
    if module is None:
        raise AttributeError(f"module 'shm_layout' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module), name)
