"""Fixtures of the sidecar end-to-end tests (defined in sidecar_e2e): a key, contract
servers, sidecar processes, and :class:`sidecar_e2e.Rig`, all of them in one."""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(__file__))  # helpers, under --import-mode=importlib

from sidecar_e2e import (
    capacity,
    entry,
    legacy,
    notify_socket,
    rig,
    servers,
    start_sidecar,
)

__all__ = ["capacity", "entry", "legacy", "notify_socket", "rig", "servers", "start_sidecar"]
