"""The fast tier's tables (tests/conftest.py: SLOW and LONG) name tests that exist.

An entry that no longer matches (a test renamed or removed) would silently put its
successor back into `make check`, or keep a stale line in the table for good."""

from __future__ import annotations

import ast
import re
from pathlib import Path
from typing import Any

TESTS = Path(__file__).resolve().parents[1]
REPO = TESTS.parent


def _table(name: str) -> Any:
    """The literal assigned to ``name`` in tests/conftest.py (read, not imported: under
    xdist the module named ``conftest`` may be another folder's)."""
    tree = ast.parse((TESTS / "conftest.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.AnnAssign | ast.Assign) and node.value is not None:
            targets = [node.target] if isinstance(node, ast.AnnAssign) else node.targets
            if any(isinstance(t, ast.Name) and t.id == name for t in targets):
                return ast.literal_eval(node.value)
    raise AssertionError(f"tests/conftest.py assigns no {name}")


LONG: tuple[str, ...] = _table("LONG")
SLOW: dict[str, str] = _table("SLOW")


def _defined(path: Path, name: str, *, prefix: bool = False) -> bool:
    """Is ``name`` (or, with ``prefix``, a name it begins) a function defined in ``path``?"""
    end = "" if prefix else r"\("
    pattern = rf"^(?:async )?def {re.escape(name)}{end}"
    return re.search(pattern, path.read_text(), re.M) is not None


def test_every_long_entry_names_a_test_function_that_exists() -> None:
    missing = []
    for nodeid in LONG:
        file, _, name = nodeid.partition("::")
        path = REPO / file
        if not path.is_file() or not name or not _defined(path, name):
            missing.append(nodeid)
    assert not missing, f"LONG entries that name no test: {missing}"


def test_every_slow_entry_names_a_folder_file_or_test_that_exists() -> None:
    missing = []
    for prefix in SLOW:
        file, _, name = prefix.partition("::")
        path = REPO / file
        found = path.is_file() and (not name or _defined(path, name, prefix=True))
        if not found and not (path.is_dir() and not name):
            missing.append(prefix)
    assert not missing, f"SLOW entries that name nothing: {missing}"


def test_the_tables_do_not_name_a_test_twice() -> None:
    assert len(set(LONG)) == len(LONG)
    assert not [n for n in LONG if any(n.startswith(p) for p in SLOW)]
