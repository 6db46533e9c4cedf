"""tests/real: the chain against real inference servers (``make real-workers``)."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # llama.py, under importlib mode

FIGURES: list[str] = []
"""What the router reported against what each real server ran, printed at the end."""


@pytest.fixture(scope="session")
def figures() -> list[str]:
    return FIGURES


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if not FIGURES:
        return
    terminalreporter.write_sep("-", "real servers: what the router reported, what they ran")
    for line in FIGURES:
        terminalreporter.write_line(line)
    out = os.environ.get("GWCAP_REAL_FIGURES")
    if out:
        Path(out).write_text("\n".join(FIGURES) + "\n")
