"""Comments and docstrings say what the code does now; its history lives in git.

CONTRIBUTING.md, "Where history lives": no issue numbers and no "before: ..." stories
in the comments and docstrings of the product's packages, its tests, benchmarks,
drill and scripts. A story of what used to happen belongs in the commit message and
CHANGELOG.md; the comment says what the code does and why.
"""

from __future__ import annotations

import ast
import io
import re
import subprocess
import tokenize
from collections.abc import Iterator
from pathlib import Path

from gwtest import INSTALLED_PACKAGES

ROOT = Path(__file__).resolve().parents[2]
SCANNED = (*INSTALLED_PACKAGES, "bench", "drill", "scripts", "tests", "setup.py")
# Whole files left out, each with its reason.
ALLOWED_FILES: dict[str, str] = {}
# Single hits kept on purpose: (path, the text of the hit) -> why it stays. An issue of
# another project cited as the source of a workaround belongs here, with its reason.
ALLOWED_HITS: dict[tuple[str, str], str] = {}

# "issue N", "issues N and M", "issue #N", "(#N)", N a number: a pointer into our tracker.
ISSUE = re.compile(r"(?P<hit>\bissues?\s*#?\d+\b|\(#\d+\))", re.IGNORECASE)
# The word "before" opening a text, a sentence or an aside, then a colon or a comma
# (an aside of its own may come between): a narrative of how the code behaved once.
# The word in the middle of a sentence ("nothing discovered before", then a colon) is
# no narrative and does not match.
BEFORE = re.compile(
    r"(?:^\s*|[.;:!?]\s+|\(\s*)(?P<hit>before(?:\s*\([^)]*\))?\s*[:,])",
    re.IGNORECASE | re.MULTILINE,
)
C_COMMENT = re.compile(r"/\*.*?\*/|//[^\n]*", re.DOTALL)
SHELL_COMMENT = re.compile(r"(?:^|\s)#(?!!)(.*)$", re.MULTILINE)


def _scanned_files() -> list[Path]:
    out = subprocess.run(
        ["git", "ls-files", "-co", "--exclude-standard", "--", *SCANNED],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    )
    return sorted(ROOT / name for name in out.stdout.splitlines() if (ROOT / name).is_file())


def python_texts(source: str) -> Iterator[tuple[int, str]]:
    """(line, text) of every comment and docstring of a Python source."""
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            yield tok.start[0], tok.string
    tree = ast.parse(source)
    for node in ast.walk(tree):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            doc = ast.get_docstring(node, clean=False)
            if doc is not None and node.body:
                yield node.body[0].lineno, doc


def c_texts(source: str) -> Iterator[tuple[int, str]]:
    """(line, text) of every comment of a C source or header."""
    for match in C_COMMENT.finditer(source):
        yield source.count("\n", 0, match.start()) + 1, match.group(0).strip("/*")


def shell_texts(source: str) -> Iterator[tuple[int, str]]:
    """(line, text) of every comment of a shell script (the shebang is none)."""
    for match in SHELL_COMMENT.finditer(source):
        yield source.count("\n", 0, match.start(1)) + 1, match.group(1)


def texts(path: Path) -> Iterator[tuple[int, str]]:
    source = path.read_text(errors="replace")
    if path.suffix == ".py":
        yield from python_texts(source)
    elif path.suffix in {".c", ".h"}:
        yield from c_texts(source)
    elif path.suffix in {".sh", ""} and "sh" in source.split("\n", 1)[0].partition("#!")[2]:
        yield from shell_texts(source)


def hits(line: int, text: str) -> Iterator[tuple[int, str]]:
    """Each issue pointer or "before:" narrative in one comment or docstring."""
    for pattern in (ISSUE, BEFORE):
        for match in pattern.finditer(text):
            yield line + text.count("\n", 0, match.start("hit")), match.group("hit")


def test_no_comment_or_docstring_names_our_issues_or_tells_a_before_story() -> None:
    scanned, found = 0, []
    for path in _scanned_files():
        rel = path.relative_to(ROOT).as_posix()
        if rel in ALLOWED_FILES:
            continue
        scanned += 1
        for line, text in texts(path):
            for at, hit in hits(line, text):
                if (rel, hit) not in ALLOWED_HITS:
                    found.append(f"{rel}:{at}: {hit!r}")
    assert scanned > 100, f"only {scanned} files scanned: is SCANNED right?"
    assert found == [], (
        "say what the code does now; history goes in git and CHANGELOG.md "
        "(CONTRIBUTING.md, 'Where history lives'):\n" + "\n".join(found)
    )


def test_the_scanner_finds_each_kind_of_history_and_passes_what_is_not() -> None:
    told = '''
"""Hold the lock (issue 17).

Before: the lock was dropped."""
x = 1  # see (#12); a queue (before, it was a list)
def f():
    """The rows added for issues 18 and 19."""
# nothing discovered before: the base is the fallback; HTTP 429 (R-A1); step #1
'''
    found = sorted(at_hit for line, text in python_texts(told) for at_hit in hits(line, text))
    assert found == [
        (2, "issue 17"),
        (4, "Before:"),
        (5, "(#12)"),
        (5, "before,"),
        (7, "issues 18"),
    ]
    c_source = "int x; /* before: a narrative */\n// issue 4: a pointer\n"
    assert [hit for line, text in c_texts(c_source) for _, hit in hits(line, text)] == [
        "before:",
        "issue 4",
    ]
    shell = "#!/usr/bin/env bash\n# what (issue 11)\necho $# done\n"
    assert [(n, hit) for line, text in shell_texts(shell) for n, hit in hits(line, text)] == [
        (2, "issue 11")
    ]


def test_every_allowed_file_still_exists() -> None:
    """An entry for a file that went away would hide the next file of that name."""
    gone = [name for name in ALLOWED_FILES if not (ROOT / name).is_file()]
    assert gone == [], gone
