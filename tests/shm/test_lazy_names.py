"""Every name ``shm_layout`` exports resolves, though each loads on first use.

``shm_layout/__init__.py`` maps its names to their modules lazily (so that ``import
handler_shim`` stays light); a name missing from the map would fail only when first
used, as ``unlink_segment`` would in ``make bench``, which imports it first of all.
"""

from __future__ import annotations

import shm_layout


def test_every_exported_name_resolves() -> None:
    for name in shm_layout.__all__:
        assert getattr(shm_layout, name) is not None, name
