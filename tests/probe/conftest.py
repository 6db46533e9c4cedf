"""Fixtures for the probe tests: a key file and provider entries pointing at loopback."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, os.path.dirname(__file__))  # probe_servers, under --import-mode=importlib

from sidecar.config import ProviderConfig


@pytest.fixture
def no_tailscaled(tmp_path: Path) -> str:
    """A LocalAPI socket path where nothing listens."""
    return str(tmp_path / "absent-tailscaled.sock")


@pytest.fixture
def make_provider(key_file: Path) -> Callable[..., ProviderConfig]:
    def make(base_url: str, **fields: Any) -> ProviderConfig:
        values: dict[str, Any] = {
            "id": "local-inference",
            "base_url": base_url,
            "credential_file": str(key_file),
            "capacity_discovery": True,
            "models": {"local-workhorse": "workhorse"},
        }
        values.update(fields)
        return ProviderConfig(**values)

    return make
