"""`make lint`: compile the admission core for macOS on a Linux machine (R-A10).

The core (shm_layout/_core.c) is compiled with zig (``ziglang`` from PyPI) for
``aarch64-macos`` and ``x86_64-macos`` against zig's copy of the macOS SDK headers, with
the flags setup.py builds it with and every warning an error, then linked as a macOS
shared object against zig's stubs of macOS's libSystem, with nothing left unresolved but
the Python C API (which the interpreter provides when it loads the module).

What that proves: every function, constant and type the core uses on macOS is declared
by macOS's headers with the types the code assumes (a Linux-only call that is not behind
its ``#if`` is an undeclared function: an error), the code has no warning there, and
every symbol it calls exists in macOS's libSystem for both architectures. What it does
not prove: anything at run time (that is `make mac-check` on a Mac, docs/macos.md); the
Python side is compiled against *this* host's headers with ``Py_LIMITED_API`` (no macOS
build of CPython's headers is reachable from here), whose ``pyconfig.h`` describes
Linux: the limited API's declarations are the same on every platform, but a pyconfig.h
setting that differs on macOS is not exercised.

Before it trusts a green answer, it checks that it can fail: a canary that calls
``posix_fallocate`` (glibc declares it; macOS does not) must not compile, and one that
declares ``sem_clockwait`` itself (glibc has it; libSystem does not) must not link.

    python scripts/macos_cross_check.py            # exit 0: both targets clean
"""

from __future__ import annotations

import ast
import contextlib
import re
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CORE = ROOT / "shm_layout" / "_core.c"
TARGETS = ("aarch64-macos", "x86_64-macos")
# The Python C API: resolved by the interpreter that imports the module, not by libSystem.
PYTHON_SYMBOL = re.compile(r"^_?_?Py")
UNDEFINED = re.compile(r"undefined symbol: (\S+)")

CANARY_UNDECLARED = """
#include <fcntl.h>
int canary(int fd) { return posix_fallocate(fd, 0, 4096); } /* glibc only */
"""
CANARY_UNLINKABLE = """
#include <semaphore.h>
#include <time.h>
int sem_clockwait(sem_t *, clockid_t, const struct timespec *); /* glibc only */
int canary(sem_t *s, const struct timespec *t) { return sem_clockwait(s, CLOCK_MONOTONIC, t); }
"""


def setup_flags() -> list[str]:
    """The compile flags and the limited-API define setup.py builds the core with."""
    tree = ast.parse((ROOT / "setup.py").read_text())
    values: dict[str, object] = {}
    flags: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name):
            with contextlib.suppress(ValueError):
                values[node.targets[0].id] = ast.literal_eval(node.value)
        if isinstance(node, ast.keyword) and node.arg == "extra_compile_args":
            flags = list(ast.literal_eval(node.value))
    if values.get("LIMITED_API"):
        flags.append(f"-DPy_LIMITED_API={values['LIMITED_API_HEX']}")
    return flags


def zig(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "ziglang", *args], cwd=cwd, capture_output=True, text=True
    )


def compile_and_link(source: Path, target: str, work: Path, flags: list[str]) -> list[str]:
    """Problems of ``source`` for ``target`` (empty: clean)."""
    include = sysconfig.get_paths()["include"]
    obj = work / f"{source.stem}-{target}.o"
    built = zig(
        "cc",
        "-target",
        target,
        "-c",
        "-o",
        str(obj),
        *flags,
        "-Werror",
        f"-I{include}",
        str(source),
        cwd=work,
    )
    if built.returncode != 0:
        return [f"compile: {line}" for line in built.stderr.splitlines() if "error" in line]
    linked = zig(
        "cc", "-target", target, "-shared", "-o", str(obj.with_suffix(".so")), str(obj), cwd=work
    )
    missing = sorted(set(UNDEFINED.findall(linked.stderr)))
    problems = [
        f"link: {s} is not in macOS's libSystem" for s in missing if not PYTHON_SYMBOL.match(s)
    ]
    if linked.returncode != 0 and not missing:
        problems.append(f"link failed: {linked.stderr.strip()}")
    return problems


def main() -> int:
    flags = setup_flags()
    failed = False
    with tempfile.TemporaryDirectory(prefix="gwcap-macos-") as tmp:
        work = Path(tmp)
        for name, text in (("undeclared", CANARY_UNDECLARED), ("unlinkable", CANARY_UNLINKABLE)):
            canary = work / f"canary_{name}.c"
            canary.write_text(text)
            if not compile_and_link(canary, TARGETS[0], work, flags):
                print(f"macos-cross-check: the {name} canary passed: this check cannot fail")
                return 2
        for target in TARGETS:
            problems = compile_and_link(CORE, target, work, flags)
            for problem in problems:
                print(f"macos-cross-check: {target}: {problem}")
            if problems:
                failed = True
            else:
                print(f"macos-cross-check: {target}: _core.c compiles (-Werror) and links")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
