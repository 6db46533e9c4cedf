"""Fixtures for the systemd unit and sd_notify tests.

``systemd-analyze`` is a system tool, not a Python package: ``make test``
installs it (``scripts/ensure-tools``). Under CI (``CI=true``) its absence is a
failure; elsewhere the unit tests skip and say why. The sd_notify tests need
nothing but a Unix socket.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import NoReturn

import pytest

sys.path.insert(0, os.path.dirname(__file__))  # sdunit_helpers, under --import-mode=importlib

from sdunit_helpers import INSTANCE, MIN_SYSTEMD, UNIT_TEMPLATE, installable_unit


def _unavailable(reason: str) -> NoReturn:
    if os.environ.get("CI") == "true":
        pytest.fail(f"{reason} (CI=true: make test must provide it via scripts/ensure-tools)")
    pytest.skip(reason)


@pytest.fixture(scope="session")
def systemd_analyze() -> str:
    path = shutil.which("systemd-analyze")
    if path is None:
        _unavailable("systemd-analyze is not installed")
    out = subprocess.run([path, "--version"], capture_output=True, text=True, check=True).stdout
    match = re.match(r"systemd (\d+)", out)
    assert match, f"unexpected systemd-analyze --version output: {out!r}"
    if int(match.group(1)) < MIN_SYSTEMD:
        _unavailable(f"systemd-analyze {match.group(1)} is older than {MIN_SYSTEMD}")
    return path


@pytest.fixture(scope="session")
def venv_executable() -> str:
    """The real ``gateway-capacity`` console script of the running interpreter's environment."""
    exe = Path(sys.executable).parent / "gateway-capacity"
    assert os.access(exe, os.X_OK), f"{exe} missing: is the project installed in this venv?"
    return str(exe)


@pytest.fixture
def unit_copy(tmp_path: Path, venv_executable: str) -> Path:
    """A copy of the template, ready to verify, as the path of the demo instance."""
    (tmp_path / UNIT_TEMPLATE.name).write_text(
        installable_unit(UNIT_TEMPLATE.read_text(), venv_executable)
    )
    return tmp_path / INSTANCE
