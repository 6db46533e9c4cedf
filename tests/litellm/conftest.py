"""Fixtures of the LiteLLM tests (defined in litellm_support)."""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # litellm_support

from litellm_support import gateway_config, master_key, serve, upstream

__all__ = ["gateway_config", "master_key", "serve", "upstream"]
