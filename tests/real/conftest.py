"""tests/real: the chain against real inference servers (``make real-workers``)."""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # llama.py, under importlib mode
