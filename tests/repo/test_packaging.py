"""What an operator installs: runtime deps exactly as the code needs, a version, a license."""

from __future__ import annotations

import ast
import json
import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from gwtest import run_cli

ROOT = Path(__file__).resolve().parents[2]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())


def _third_party_imports(packages: list[str]) -> set[str]:
    ours = set(PYPROJECT["tool"]["setuptools"]["packages"])
    found: set[str] = set()
    for package in packages:
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


EXTRAS = PYPROJECT["project"]["optional-dependencies"]
ROUTER_PACKAGES = ["capacity_router"]  # the reference router: the `router` extra's stack


def test_core_dependencies_are_exactly_what_the_packages_import() -> None:
    """Every core dependency is imported by a package other than the router, and every
    import of theirs is a core dependency, except the optional extras a package imports
    only when present (the demo's picture, share mode's Redis client; Starlette's form
    parser, which the ASGI middleware's ``by_model`` uses for a form body under a
    Starlette app and refuses the form without: the ``serve`` extra)."""
    declared = _names(PYPROJECT["project"]["dependencies"])
    core = [p for p in PYPROJECT["tool"]["setuptools"]["packages"] if p not in ROUTER_PACKAGES]
    found = _third_party_imports(core)
    assert declared <= found, declared - found
    optional = _names(EXTRAS["plot"]) | _names(EXTRAS["share"]) | {"starlette"}
    assert found - declared <= optional, found - declared
    assert "starlette" in _names(EXTRAS["serve"])


def test_the_router_extra_is_what_the_router_imports_beyond_the_core() -> None:
    declared = _names(PYPROJECT["project"]["dependencies"])
    found = _third_party_imports(ROUTER_PACKAGES)
    assert found - declared == _names(EXTRAS["router"])


HEAVY = ("starlette", "uvicorn", "httpx", "sidecar", "capacity_router", "msgspec")


def _loaded_after(code: str) -> list[str]:
    """Which of HEAVY's top-level modules a fresh interpreter holds after ``code``."""
    probe = (
        f"{code}\nimport sys\nprint(sorted(m for m in sys.modules if m.split('.')[0] in {HEAVY!r}))"
    )
    out = subprocess.run(
        [sys.executable, "-c", probe],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        cwd=ROOT,
    )
    assert out.returncode == 0, out.stderr
    loaded: list[str] = ast.literal_eval(out.stdout.strip())
    return loaded


def test_import_handler_shim_loads_no_sidecar_router_or_http_stack() -> None:
    assert _loaded_after("import handler_shim") == []


def test_a_handler_reads_its_config_without_the_sidecar() -> None:
    code = (
        "import json, tempfile\n"
        "from handler_shim.entries import providers_from_config\n"
        "with tempfile.NamedTemporaryFile('w', suffix='.json', delete=False) as f:\n"
        "    json.dump({'maxConcurrent': 3, 'providers': [{'id': 'a'}]}, f)\n"
        "entries = providers_from_config(f.name)\n"
        "assert [(e.provider_id, e.fallback, e.fallback_source) for e in entries] == "
        "[('a', 3, 'gateway')], entries\n"
    )
    loaded = _loaded_after(code)
    assert [m for m in loaded if m.split(".")[0] != "msgspec"] == [], loaded


def test_the_router_client_loads_no_http_server() -> None:
    """fence/unfence/show talk to a router with httpx: no starlette or uvicorn needed."""
    loaded = _loaded_after("import capacity_router.keyfile, capacity_router.registry")
    assert not [m for m in loaded if m.split(".")[0] in ("starlette", "uvicorn")], loaded


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


_HOOKS_OF = """
import importlib.machinery, importlib.util, json, sys
loader = importlib.machinery.ExtensionFileLoader("shm_layout._core", sys.argv[1])
spec = importlib.util.spec_from_loader("shm_layout._core", loader)
core = importlib.util.module_from_spec(spec)
loader.exec_module(core)
hooks = [n for n in ("hold_lock", "abandon", "die_in_section") if hasattr(core.Core, n)]
print(json.dumps({"flag": core.TEST_HOOKS, "hooks": hooks}))
"""


def _core_built(out: Path, hooks: str | None) -> dict[str, object]:
    env = {k: v for k, v in os.environ.items() if k != "GATEWAY_CAPACITY_TEST_HOOKS"}
    if hooks is not None:
        env["GATEWAY_CAPACITY_TEST_HOOKS"] = hooks
    build = subprocess.run(
        [
            sys.executable,
            "setup.py",
            "-q",
            "build_ext",
            "--build-lib",
            str(out),
            "--build-temp",
            str(out / "tmp"),
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert build.returncode == 0, build.stdout + build.stderr
    (so,) = (out / "shm_layout").glob("_core*.so")
    run = subprocess.run(
        [sys.executable, "-c", _HOOKS_OF, str(so)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert run.returncode == 0, run.stderr
    found: dict[str, object] = json.loads(run.stdout)
    return found


def test_only_a_test_build_of_the_core_has_its_test_entry_points(tmp_path: Path) -> None:
    """setup.py compiles _core.c section 9 in only when GATEWAY_CAPACITY_TEST_HOOKS=1 (the
    Makefile's install); what ``pip install .`` and ``make wheel`` build has none of it."""
    assert _core_built(tmp_path / "plain", None) == {"flag": 0, "hooks": []}
    assert _core_built(tmp_path / "other", "0") == {"flag": 0, "hooks": []}
    assert _core_built(tmp_path / "test", "1") == {
        "flag": 1,
        "hooks": ["hold_lock", "abandon", "die_in_section"],
    }
    makefile = (ROOT / "Makefile").read_text()
    install = next(
        line for line in makefile.splitlines() if "pip install --quiet -e '.[test," in line
    )
    assert "GATEWAY_CAPACITY_TEST_HOOKS=1" in install
    assert "env -u GATEWAY_CAPACITY_TEST_HOOKS" in (ROOT / "scripts" / "build-wheel").read_text()


def test_a_test_that_needs_the_hooks_says_so_on_a_build_without_them(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from gwtest import core_hooks

    from shm_layout import _core

    monkeypatch.setattr(_core, "TEST_HOOKS", 0)
    with pytest.raises(RuntimeError, match="GATEWAY_CAPACITY_TEST_HOOKS=1"):
        core_hooks(object())
