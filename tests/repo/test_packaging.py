"""What an operator installs: runtime deps exactly as the code needs, a version, a license."""

from __future__ import annotations

import ast
import re
import sys
import tomllib
from pathlib import Path

from gwtest import run_cli

ROOT = Path(__file__).resolve().parents[2]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())


def _third_party_imports() -> set[str]:
    ours = set(PYPROJECT["tool"]["setuptools"]["packages"])
    found: set[str] = set()
    for package in ours:
        for path in (ROOT / package).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Import):
                    names = [alias.name for alias in node.names]
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    names = [node.module]
                else:
                    continue
                for name in names:
                    top = name.split(".")[0]
                    if top not in ours and top not in sys.stdlib_module_names:
                        found.add(top)
    return found


def _names(specs: list[str]) -> set[str]:
    return {
        re.split(r"[<>=!~\[; ]", spec, maxsplit=1)[0].lower().replace("-", "_") for spec in specs
    }


def test_core_dependencies_are_exactly_what_the_packages_import() -> None:
    """Every core dependency is imported, and every import is a core dependency, except
    the optional extras a package imports only when asked for (the demo's picture, the
    share mode's Redis client)."""
    declared = _names(PYPROJECT["project"]["dependencies"])
    extras = PYPROJECT["project"]["optional-dependencies"]
    optional = _names(extras["plot"]) | _names(extras["share"])
    found = _third_party_imports()
    assert declared <= found
    assert found - declared <= optional, found - declared


def test_version_comes_from_the_package_metadata() -> None:
    out = run_cli("--version")
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == f"gateway-capacity {PYPROJECT['project']['version']}"


def test_license_is_mit_and_the_changelog_has_the_released_version() -> None:
    license_text = (ROOT / "LICENSE").read_text()
    assert license_text.startswith("MIT License")
    assert "the gateway-capacity authors" in license_text
    changelog = (ROOT / "CHANGELOG.md").read_text()
    assert "## [Unreleased]" in changelog
    assert f"## [{PYPROJECT['project']['version']}]" in changelog
