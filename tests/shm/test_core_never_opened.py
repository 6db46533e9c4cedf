"""A Core made without __init__ is refused, and dropping it touches no one's lock target.

``Core.__new__`` zero-fills the object, so its target index is 0: the first lock target
of the process, which a live Core uses. Were it not refused, any call would lock through
that descriptor and write through a NULL base (SIGSEGV), and dropping it would release
target 0 (with the lock-file kind, closing that descriptor drops every record lock of
the process).
Run in a child process, so a crash is a failure rather than the end of the test run.
"""

from __future__ import annotations

import subprocess
import sys

from gwtest import LOCK_FILE_ENV, ROOT

CHILD = """
import os, sys
from handler_shim import Admission
from shm_layout import _core
seg = sys.argv[1]
adm = Admission.attach(segment=seg, generation="a")
refused = 0
for _ in range(3):
    c = _core.Core.__new__(_core.Core)
    try:
        c.snapshot()
    except _core.CoreError:
        refused += 1
    del c
import psutil  # this process's open files, on Linux and macOS
lock_fds = [f for f in psutil.Process().open_files() if f.path.endswith(seg[1:] + ".lock")]
adm.close()
print(refused, len(lock_fds))
"""


def test_a_core_never_opened_is_refused_and_releases_nothing(segment_name: str) -> None:
    env = {"PATH": "/usr/bin:/bin", LOCK_FILE_ENV: "1", "PYTHONPATH": str(ROOT)}
    out = subprocess.run(
        [sys.executable, "-c", CHILD, segment_name],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
        cwd=ROOT,
    )
    assert out.returncode == 0, (out.returncode, out.stderr[-2000:])  # -11 was SIGSEGV
    assert out.stdout.split() == ["3", "1"], out.stdout  # refused thrice; lock file still open
