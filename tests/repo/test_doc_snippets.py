"""Every Python snippet in README.md, docs/*.md and examples/README.md runs as pasted.

Each ```python block is written to a file and run with this interpreter, in a fresh
directory holding a ``gateway.json`` of one provider, ``local-inference`` (the id the
snippets use), on a fresh segment (``$GATEWAY_CAPACITY_SEGMENT``): a snippet that
attaches takes real slots of a real segment. A block that cannot run here says so on
the line just before its fence, with the reason, and is only compiled::

    <!-- snippet: compile-only: REASON -->

Few blocks may carry it (``MAX_COMPILE_ONLY``): a snippet a reader cannot run is a
snippet nobody checks.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", ROOT / "examples" / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^(?P<indent> *)```(?P<lang>[\w+-]*)\s*$")
COMPILE_ONLY = re.compile(r"^\s*<!-- snippet: compile-only: (?P<reason>\S.*?) -->\s*$")
MAX_COMPILE_ONLY = 3
CONFIG = {"providers": [{"id": "local-inference", "maxConcurrent": 4}]}


@dataclass(frozen=True)
class Snippet:
    where: str  # file:line of the opening fence
    code: str
    compile_only: str | None  # the reason, when marked


def snippets() -> list[Snippet]:
    found = []
    for doc in DOCS:
        lines = doc.read_text().splitlines()
        i = 0
        while i < len(lines):
            opening = FENCE.match(lines[i])
            if not opening or not opening.group("lang"):
                i += 1
                continue
            indent, start = len(opening.group("indent")), i
            i += 1
            body = []
            while i < len(lines) and not FENCE.match(lines[i]):
                body.append(lines[i][indent:])
                i += 1
            i += 1
            if opening.group("lang") not in ("python", "py", "python3"):
                continue
            marker = COMPILE_ONLY.match(lines[start - 1]) if start else None
            found.append(
                Snippet(
                    f"{doc.relative_to(ROOT)}:{start + 1}",
                    "\n".join(body) + "\n",
                    marker.group("reason") if marker else None,
                )
            )
    return found


SNIPPETS = snippets()


def test_the_docs_have_python_snippets_and_few_are_compile_only() -> None:
    assert len(SNIPPETS) >= 8, [s.where for s in SNIPPETS]
    marked = [s.where for s in SNIPPETS if s.compile_only]
    assert len(marked) <= MAX_COMPILE_ONLY, marked


def test_every_compile_only_marker_stands_before_a_python_block() -> None:
    """A marker before a shell block, or a misspelt one, would silently run nothing."""
    stray = []
    for doc in DOCS:
        lines = doc.read_text().splitlines()
        for number, line in enumerate(lines):
            if not line.lstrip().startswith("<!-- snippet:"):
                continue
            following = lines[number + 1] if number + 1 < len(lines) else ""
            opening = FENCE.match(following)
            if not COMPILE_ONLY.match(line) or not opening or opening.group("lang") != "python":
                stray.append(f"{doc.relative_to(ROOT)}:{number + 1}: {line.strip()}")
    assert not stray, stray


@pytest.mark.parametrize("snippet", SNIPPETS, ids=[s.where for s in SNIPPETS])
def test_every_python_snippet_in_the_docs_runs_as_pasted(
    snippet: Snippet, tmp_path: Path, segment_name: str
) -> None:
    compile(snippet.code, snippet.where, "exec")  # a SyntaxError names the doc's line
    if snippet.compile_only:
        return
    (tmp_path / "gateway.json").write_text(json.dumps(CONFIG))
    script = tmp_path / "snippet.py"
    script.write_text(snippet.code)
    env = {k: v for k, v in os.environ.items() if not k.startswith("GATEWAY_")}
    env.update(GATEWAY_CAPACITY_SEGMENT=segment_name, GATEWAY_CONFIG="gateway.json")
    run = subprocess.run(
        [sys.executable, str(script)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert run.returncode == 0, f"{snippet.where}:\n{snippet.code}\n{run.stdout}{run.stderr}"
