"""A boolean parameter is keyword-only in the installed packages: ``f(x, True)`` says
nothing at the call. ruff's FBT001/FBT002 find one (pyproject.toml selects them for
``make lint``); this runs them so that the test suite holds it too."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from gwtest import INSTALLED_PACKAGES

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = [*INSTALLED_PACKAGES, "examples", "drill"]


def _ruff(*paths: str) -> subprocess.CompletedProcess[str]:
    ruff = shutil.which("ruff", path=str(Path(sys.executable).parent))
    if ruff is None:
        pytest.skip("ruff is not installed in this environment (the dev extra has it)")
    command = [ruff, "check", "--no-cache", "--select", "FBT001,FBT002", "--output-format"]
    return subprocess.run(
        [*command, "concise", *paths], cwd=ROOT, capture_output=True, text=True, timeout=60
    )


def test_no_boolean_parameter_of_ours_is_positional() -> None:
    run = _ruff(*PACKAGES)
    assert run.returncode == 0, run.stdout + run.stderr


def test_the_check_finds_a_positional_boolean(tmp_path: Path) -> None:
    planted = tmp_path / "planted.py"
    planted.write_text("def publish(limit: int, discovery: bool) -> None: ...\n")
    run = _ruff(str(planted))
    assert run.returncode == 1 and "FBT001" in run.stdout, run.stdout + run.stderr
