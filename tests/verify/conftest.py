"""The verify tests run a real sidecar against a real contract server: the sidecar
end-to-end fixtures (tests/sidecar/sidecar_e2e.py), :class:`sidecar_e2e.Rig` first."""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "sidecar"))

from sidecar_e2e import capacity, entry, rig, servers, start_sidecar

__all__ = ["capacity", "entry", "rig", "servers", "start_sidecar"]
