"""How the sidecar refuses to start: :class:`StartupError`, exit 2."""

from __future__ import annotations

from shm_layout.errors import GatewayCapacityError


class StartupError(GatewayCapacityError):
    """Exit 2: the sidecar cannot start (config unreadable, bad option)."""
