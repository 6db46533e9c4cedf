"""A full /dev/shm is a one-line error that says what to fix, never a crash.

Creating the segment gives it its memory at once (``posix_fallocate``), not only a size
(``ftruncate``): in a sparse object the first write of the header through the mapping
would find no page to back it, and the handler (or sidecar) would die of SIGBUS with no
word of why, and so would the next one.

The test mounts a 64 KiB tmpfs over /dev/shm in a private mount namespace of its own
(``unshare -m``, root only), fills it, and tries there; the machine's /dev/shm is not
touched.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from gwtest import ROOT

UNSHARE = shutil.which("unshare")

pytestmark = pytest.mark.skipif(
    UNSHARE is None or os.geteuid() != 0 or not sys.platform.startswith("linux"),
    reason="needs root and unshare(1) to mount a small private /dev/shm",
)

FILL = (
    "mount -t tmpfs -o size=64k tmpfs /dev/shm && "
    "dd if=/dev/zero of=/dev/shm/filler bs=4k count=100 2>/dev/null; "
)


def _in_a_full_dev_shm(command: str) -> subprocess.CompletedProcess[str]:
    assert UNSHARE is not None
    return subprocess.run(
        [UNSHARE, "-m", "--propagation", "private", "sh", "-c", FILL + command],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
    )


ATTACH = """
import sys
from handler_shim import Admission, SegmentError
try:
    Admission.attach(segment="/gwt-full", generation="x")
except SegmentError as exc:
    print(exc)
    sys.exit(1)
print("attached")
"""


def test_a_handler_attaching_on_a_full_dev_shm_gets_one_line_not_sigbus() -> None:
    out = _in_a_full_dev_shm(f"exec {sys.executable} -c '{ATTACH}'")
    assert out.returncode == 1, (out.returncode, out.stdout, out.stderr)  # -7 was SIGBUS
    line = out.stdout.strip()
    assert len(line.splitlines()) == 1, out.stdout
    assert "no room" in line and "/dev/shm" in line, line


def test_the_sidecar_on_a_full_dev_shm_says_what_to_fix(tmp_path: Path) -> None:
    cfg = tmp_path / "gateway.json"
    cfg.write_text('{"providers": [{"id": "p1", "maxConcurrent": 2}]}')
    exe = Path(sys.executable).with_name("gateway-capacity")
    out = _in_a_full_dev_shm(f"exec {exe} sidecar --config {cfg}")
    text = (out.stdout + out.stderr).strip()
    assert out.returncode not in (0, -7, 135), (out.returncode, text)
    assert "Traceback" not in text and len(text.splitlines()) == 1, text
    assert "no room" in text and "/dev/shm" in text, text
