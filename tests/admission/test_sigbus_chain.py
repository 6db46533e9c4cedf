"""The SIGBUS guard beside the process's own SIGBUS disposition (R-A15).

The core's handler mends a truncated segment's mapping; any other SIGBUS goes to the
disposition that was there before it, and the guard stays armed afterwards, for the
life of the mapping (``_guard.h``, docs/DESIGN.md). Each case is a real
process with that disposition set before it attaches: a ``kill -BUS`` from another
process (or a fault on the application's own mapping), then a real truncation of its
segment in /dev/shm, which it must survive.
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

from shm_layout import platform

pytestmark = [
    pytest.mark.skipif(sys.platform == "darwin", reason="macOS cannot resize a shm object"),
    pytest.mark.linux("macOS cannot resize a shm object once sized: no truncation there"),
]

# The application's own handlers, as a C library would install them: one sa_handler
# that counts, one SA_SIGINFO handler that mends its own file mapping (as ours does).
APP_HANDLERS = r"""
#include <signal.h>
#include <stdint.h>
#include <string.h>
#include <sys/mman.h>

static volatile sig_atomic_t calls;
static char *own;
static size_t own_len;

static void counting(int sig) { (void)sig; calls++; }

static void recovering(int sig, siginfo_t *info, void *ctx)
{
    (void)sig; (void)ctx;
    calls++;
    uintptr_t at = (uintptr_t)info->si_addr;
    if (info->si_code > 0 && own != NULL && at >= (uintptr_t)own
        && at < (uintptr_t)own + own_len) {
        mmap(own, own_len, PROT_READ | PROT_WRITE, MAP_FIXED | MAP_PRIVATE | MAP_ANONYMOUS,
             -1, 0);
        return;
    }
    if (info->si_code > 0)
        signal(SIGBUS, SIG_DFL); /* a fault that is not its own: die of it */
}

int install(int siginfo)
{
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    if (siginfo) {
        sa.sa_sigaction = recovering;
        sa.sa_flags = SA_SIGINFO;
    } else {
        sa.sa_handler = counting;
    }
    sigemptyset(&sa.sa_mask);
    return sigaction(SIGBUS, &sa, NULL);
}

int calls_so_far(void) { return calls; }

int map_own(int fd, long len)
{
    own = mmap(NULL, (size_t)len, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    own_len = (size_t)len;
    return own == MAP_FAILED ? -1 : 0;
}

int touch_own(void) { return ((volatile char *)own)[own_len - 1]; }
"""

CHILD = textwrap.dedent(
    """
    import ctypes, json, mmap, os, signal, sys
    from shm_layout import layout, platform
    from shm_layout.segment import Segment

    mode, name, lib_path, own_path = sys.argv[1:5]
    lib = ctypes.CDLL(lib_path)
    handled = []
    if mode == "ignore":
        signal.signal(signal.SIGBUS, signal.SIG_IGN)
    elif mode == "python":
        signal.signal(signal.SIGBUS, lambda signum, frame: handled.append(signum))
    elif mode == "c-handler":
        assert lib.install(0) == 0
    elif mode == "c-sigaction":
        assert lib.install(1) == 0
    seg = Segment.open(name)  # the guard is installed here, after the application's
    if mode == "c-sigaction":  # a fault on the application's own mapping, mended by it
        with open(own_path, "wb") as f:
            f.write(bytes(mmap.PAGESIZE * 2))
        fd = os.open(own_path, os.O_RDWR)
        assert lib.map_own(fd, mmap.PAGESIZE * 2) == 0
        os.truncate(own_path, 0)
        lib.touch_own()
    print("ready", flush=True)
    sys.stdin.readline()  # the parent sends SIGBUS (or not), truncates, then writes
    zeros = seg.buf[layout.TOTAL_SIZE - 1] == 0 and seg.buf[mmap.PAGESIZE] == 0
    print(json.dumps({"zeros": zeros, "damaged": seg.buf.damaged,
                      "calls": lib.calls_so_far(), "handled": handled}), flush=True)
    """
)


@pytest.fixture(scope="module")
def app_handlers(tmp_path_factory: pytest.TempPathFactory) -> Path:
    where = tmp_path_factory.mktemp("sigbus-app")
    (where / "app.c").write_text(APP_HANDLERS)
    lib = where / "libapp.so"
    subprocess.run(
        ["cc", "-shared", "-fPIC", "-O1", "-o", str(lib), str(where / "app.c")],
        check=True,
        timeout=60,
    )
    return lib


@pytest.fixture
def segment_name() -> Iterator[str]:
    name = "/gwt-chain-" + secrets.token_hex(4)
    yield name
    from shm_layout.segment import unlink_segment

    unlink_segment(name)


def _run(mode: str, name: str, lib: Path, tmp: Path, send_sigbus: bool) -> tuple[int, str]:
    """The child's exit code and what it printed after the truncation."""
    proc = subprocess.Popen(
        [sys.executable, "-c", CHILD, mode, name, str(lib), str(tmp / "own")],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None and proc.stdin is not None
    try:
        assert proc.stdout.readline().strip() == "ready", proc.stderr
        if send_sigbus:  # a foreign SIGBUS, sent by another process
            subprocess.run(["kill", "-BUS", str(proc.pid)], check=True, timeout=10)
        os.truncate(platform.SHM_DIR + name, 0)
        try:
            proc.stdin.write("go\n")
            proc.stdin.flush()
        except BrokenPipeError:
            pass  # it died of the signal (the default disposition)
        out, err = proc.communicate(timeout=20)  # a disarmed guard hangs or dies here
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return proc.returncode, out + err


@pytest.mark.parametrize(
    ("mode", "send_sigbus", "calls", "handled"),
    [
        ("ignore", True, 0, []),
        ("python", True, 0, [signal.SIGBUS]),
        ("c-handler", True, 1, []),
        ("c-sigaction", False, 1, []),  # its own fault, mended by its own handler
    ],
)
def test_r_a15_the_guard_stays_armed_after_a_sigbus_it_passed_on(
    mode: str,
    send_sigbus: bool,
    calls: int,
    handled: list[int],
    app_handlers: Path,
    segment_name: str,
    tmp_path: Path,
) -> None:
    code, out = _run(mode, segment_name, app_handlers, tmp_path, send_sigbus)
    assert code == 0, f"exit {code} (SIGBUS is {-signal.SIGBUS}): {out}"
    got = json.loads(out.splitlines()[-1])
    assert got == {"zeros": True, "damaged": True, "calls": calls, "handled": handled}


def test_r_a15_a_sigbus_sent_under_the_default_disposition_still_kills(
    app_handlers: Path, segment_name: str, tmp_path: Path
) -> None:
    code, out = _run("default", segment_name, app_handlers, tmp_path, True)
    assert code == -signal.SIGBUS, out


def test_r_a15_a_sigbus_handler_set_between_two_attaches_is_a_warning(
    segment_name: str,
) -> None:
    """A disposition set after the first attach replaces the guard (docs/DESIGN.md): a
    truncation would then hang this process in its fault. The next attach says so."""
    second = segment_name + "-b"
    child = textwrap.dedent(
        """
        import signal, sys
        from shm_layout.segment import Segment
        first = Segment.open(sys.argv[1])
        second = Segment.open(sys.argv[2])  # the guard is ours: no word
        signal.signal(signal.SIGBUS, lambda signum, frame: None)
        third = Segment.open(sys.argv[1])
        """
    )
    try:
        done = subprocess.run(
            [sys.executable, "-c", child, segment_name, second],
            capture_output=True,
            text=True,
            timeout=60,
        )
    finally:
        from shm_layout.segment import unlink_segment

        unlink_segment(second)
    assert done.returncode == 0, done.stderr
    said = [line for line in done.stderr.splitlines() if "SIGBUS" in line]
    assert len(said) == 1 and "before the first attach" in said[0], done.stderr
