"""Linux-only names appear in shm_layout/platform.py and nowhere else (R-A10).

One module owns every difference between the hosts (``shm_layout/platform.py``); the
darwin test mode makes it answer as macOS and raise where macOS has no such call. That
catches a Linux-only call only when it goes through the platform module: a call written
straight into shared code (``os.posix_fallocate(...)``, ``open("/proc/...")``) would
work on Linux in the darwin test mode and break only on a Mac. This check finds those
by their names, in the code (docstrings and comments are prose), of every package that
runs on a Mac.

The list, and why each is Linux-only:

- ``posix_fallocate``, ``posix_fadvise``: not in macOS's libc (Python has no
  ``os.posix_fallocate`` there);
- ``sched_getaffinity``, ``sched_setaffinity``: Linux's CPU affinity;
- ``prctl``, ``PR_SET_PDEATHSIG``: Linux's process controls (a parent-death signal);
- ``pidfd_open``, ``P_PIDFD`` and every ``pidfd`` name: Linux's process descriptors;
- ``F_OFD_*``: open-file-description locks. Recent macOS headers declare them, but the
  product's kernel-held liveness on them (an OFD lock on a shm descriptor) is Linux's;
- ``CLOCK_BOOTTIME``: Linux's clock; ``platform.deadline_now`` picks the clock;
- ``memfd_create``, ``eventfd``, ``splice``, ``O_PATH``, ``O_TMPFILE``, ``SO_PEERCRED``,
  ``epoll``, ``inotify``, ``getxattr``/``setxattr``/``listxattr``/``removexattr``
  (Python's are Linux's): Linux facilities with no macOS counterpart of that name;
- ``SEMAPHORE_TIMEOUT_SUPPORTED``: posix_ipc's word on timed semaphore waits, which
  macOS lacks (posix_ipc then waits for ever); only the platform module may decide;
- ``sys.platform``: the platform is asked through the platform module, so that the
  darwin test mode answers everywhere;
- string constants that are paths under ``/proc``, ``/dev/shm`` (also its listing) or
  ``/sys/``: Linux's pseudo file systems.

Exceptions, each with its reason, are in ``ALLOWED``: none today outside the platform
module. (systemd's notify socket in ``sidecar/sdnotify.py`` uses Linux's abstract socket
names, but only when systemd set ``$NOTIFY_SOCKET``, which never happens on a Mac; it
contains none of the names above.)
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

from gwtest import INSTALLED_PACKAGES

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = INSTALLED_PACKAGES  # every one runs on a Mac
ALSO = ("examples", "drill")  # run on a Mac too: the example gateway, `make mac-check`'s drill
PLATFORM_MODULE = "shm_layout/platform.py"

LINUX_NAMES = re.compile(
    r"^(posix_fallocate|posix_fadvise|sched_getaffinity|sched_setaffinity|prctl|"
    r"PR_SET_PDEATHSIG|.*pidfd.*|P_PIDFD|F_OFD_\w+|CLOCK_BOOTTIME|memfd_create|eventfd|"
    r"splice|O_PATH|O_TMPFILE|SO_PEERCRED|epoll|inotify|getxattr|setxattr|listxattr|"
    r"removexattr|SEMAPHORE_TIMEOUT_SUPPORTED)$"
)
LINUX_PATHS = re.compile(r"^(/proc(/|$)|/dev/shm(/|$)|/sys/)")

# (file, name) -> why it may stay. Keep it short and every line justified.
ALLOWED: dict[tuple[str, str], str] = {}


def _docstrings(tree: ast.AST) -> set[int]:
    """ids of the string constants that are docstrings (prose, not code)."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                out.add(id(body[0].value))
    return out


def linux_only_uses(source: str) -> list[tuple[int, str]]:
    """(line, what) of every Linux-only name or path in ``source``."""
    tree = ast.parse(source)
    prose = _docstrings(tree)
    found = []
    for node in ast.walk(tree):
        name = None
        if isinstance(node, ast.Name):
            name = node.id
        elif isinstance(node, ast.Attribute):
            name = node.attr
            if node.attr == "platform" and isinstance(node.value, ast.Name):
                if node.value.id == "sys":
                    found.append((node.lineno, "sys.platform"))
                continue
        elif isinstance(node, ast.alias):
            name = node.name.rsplit(".", 1)[-1]
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            # (an f-string's parts are constants too: f"/proc/{pid}" starts with one)
            if id(node) not in prose and LINUX_PATHS.match(node.value):
                found.append((node.lineno, repr(node.value)))
            # getattr(os, "posix_fallocate") is the same call by another road
            if id(node) not in prose and LINUX_NAMES.match(node.value):
                found.append((node.lineno, repr(node.value)))
            continue
        if name is not None and LINUX_NAMES.match(name):
            found.append((getattr(node, "lineno", 0), name))
    return sorted(set(found))


def python_files() -> list[Path]:
    files = []
    for top in (*PACKAGES, *ALSO):
        files += sorted((ROOT / top).rglob("*.py"))
    return [f for f in files if f.relative_to(ROOT).as_posix() != PLATFORM_MODULE]


def test_r_a10_linux_only_names_appear_only_in_the_platform_module() -> None:
    offenders = []
    for path in python_files():
        rel = path.relative_to(ROOT).as_posix()
        for line, what in linux_only_uses(path.read_text()):
            if (rel, what) not in ALLOWED:
                offenders.append(f"{rel}:{line}: {what}")
    assert offenders == [], (
        "Linux-only names outside shm_layout/platform.py (add the difference to the "
        "platform module, whose darwin test mode then raises for it):\n" + "\n".join(offenders)
    )


def test_the_check_finds_what_it_is_for() -> None:
    """The checker itself: each kind of Linux-only use in shared code is found, and prose
    about them is not."""
    planted = '''
"""Docstrings may say /proc and /dev/shm and posix_fallocate."""
import os, sys, time
from os import sched_getaffinity
def reserve(fd):
    """Prose: /proc/self."""
    os.posix_fallocate(fd, 0, 4096)
    getattr(os, "posix_fallocate")
    open(f"/proc/{os.getpid()}/stat")
    os.listdir("/dev/shm")
    time.clock_gettime(time.CLOCK_BOOTTIME)
    if sys.platform == "linux":
        pass
    return "free space in /dev/shm"  # a message, not a path
'''
    found = {what for _, what in linux_only_uses(planted)}
    assert found == {
        "sched_getaffinity",
        "posix_fallocate",
        "'posix_fallocate'",
        "'/proc/'",  # the f-string's first part
        "'/dev/shm'",
        "CLOCK_BOOTTIME",
        "sys.platform",
    }, found
