"""The darwin test mode of the platform module (R-A10, docs/macos.md).

No macOS machine is reachable from this project's machines, so ``GATEWAY_CAPACITY_PLATFORM
=darwin`` makes ``shm_layout/platform.py`` answer as macOS does while running on Linux,
and raise :class:`NotOnThisPlatform` for the calls macOS does not have. It stands in for
the macOS kernel (the one mock of this suite, and only that): the calls both systems
have (``shm_open``, ``sem_open``, ``fcntl`` record locks, ``mmap``) run Linux's. These
tests check what the mode answers, that a real segment made in it takes macOS's road,
and that it catches a Linux-only call planted into shared code: the whole point of it.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path

import pytest
from gwtest import ROOT, run_cli

from handler_shim import Admission
from shm_layout import layout, lock, platform
from shm_layout.layout import HEADER
from shm_layout.segment import SegmentError


@pytest.fixture
def darwin(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(platform.PLATFORM_ENV, "darwin")
    monkeypatch.delenv(platform.LOCK_DIR_ENV, raising=False)


def test_r_a10_the_darwin_mode_answers_as_macos(darwin: None, tmp_path: Path) -> None:
    assert platform.name() == "darwin"
    assert platform.lock_file_forced()
    assert not platform.semaphore_timeouts()
    assert not platform.futex_waits()
    assert platform.core_flags() == (
        platform.CORE_NO_FUTEX | platform.CORE_NO_SEM_TIMEOUT | platform.CORE_NO_SEM_OWNER
    )
    assert platform.list_shared_memory() is None  # no /dev/shm to list
    assert platform.shared_memory_stat("/anything") is None
    assert platform.semaphore_owner("/gwcb-0000000000000001") is None
    assert not platform.has_proc()
    assert platform.proc_mount_options() is None
    assert platform.default_lock_dir() == "/var/tmp"  # never /tmp: the daily cleaner
    assert platform.shared_memory_identity(os.stat(tmp_path)) is None  # no device, inode
    with open(tmp_path / "object", "wb") as f:
        assert platform.reserve(f.fileno(), 4096) is False  # no posix_fallocate
        platform.size_object(f.fileno(), 4096)
        with pytest.raises(platform.NotOnThisPlatform, match="one ftruncate"):
            platform.size_object(f.fileno(), 8192)
        with pytest.raises(platform.NotOnThisPlatform, match="group"):
            platform.set_shared_memory_mode(f.fileno(), 0o660, os.getegid() + 1)
    for linux_only in (
        lambda: platform.proc_path("self", "stat"),
        lambda: platform.proc_start_ticks(os.getpid()),
        lambda: platform.semaphore_path("/gwcb-0000000000000001"),
    ):
        with pytest.raises(platform.NotOnThisPlatform, match="does not exist on macOS"):
            linux_only()


def test_r_a10_a_segment_made_in_darwin_mode_takes_the_macos_road(
    darwin: None, segment_name: str, write_config: Callable[..., Path]
) -> None:
    """The lock file in /var/tmp, no timed waits (a ticker thread posts the doorbell),
    waiting and admission across a real second process, the views without /proc."""
    config = write_config({"providers": [{"id": "p1", "maxConcurrent": 1}]})
    adm = Admission.attach(config=config, segment=segment_name, generation="mac")
    try:
        assert HEADER["lock_kind"].get(adm._buf) == layout.LOCK_FILE
        assert lock.lock_file_path(segment_name) == f"/var/tmp{segment_name}.lock"
        assert os.path.exists(lock.lock_file_path(segment_name))
        assert "gwcap-tick" in {t.name for t in adm._current.threads}
        assert adm._seg.identity[0] == "creation"  # told by its creation stamp
        assert adm._seg.still_named()
        with adm.slot_blocking("p1"):
            out = run_cli("availability", "--segment", segment_name, "--json")
            assert out.returncode == 0, out.stderr
            assert '"running": 1' in out.stdout
    finally:
        adm.close()


PLANT = '''
"""A Linux-only call put into shared code: a "small improvement" to the doorbell that
looks at the semaphore's file, which exists on Linux only (glibc keeps it in /dev/shm)."""
import os

from shm_layout import names, platform
from shm_layout.segment import Segment

_create = Segment.create_doorbell


def create_doorbell(self):
    bell = _create(self)
    os.lstat(platform.semaphore_path(names.doorbell_name(bell)))
    return bell


Segment.create_doorbell = create_doorbell
'''


def test_r_a10_the_darwin_mode_catches_a_linux_only_call_planted_in_shared_code(
    tmp_path: Path,
) -> None:
    """Run a real test of the suite with a Linux-only call planted into the shared code
    every handler runs: on Linux the plant is invisible (the test passes), in the darwin
    mode the suite fails, naming the call. Without the mode, only a Mac would know."""
    (tmp_path / "planted_linux_call.py").write_text(textwrap.dedent(PLANT))
    test = "tests/admission/test_admission_in_process.py::test_r_a4_timeout_leaves_the_queue_exact"

    def run(mode: str) -> subprocess.CompletedProcess[str]:
        env = {**os.environ, "PYTHONPATH": str(tmp_path), platform.PLATFORM_ENV: mode}
        return subprocess.run(
            [sys.executable, "-m", "pytest", "-p", "planted_linux_call", "-p", "no:cacheprovider",
             "-q", "-n", "0", test],
            cwd=ROOT, env=env, capture_output=True, text=True, timeout=120,
        )  # fmt: skip

    on_linux = run("linux")
    assert on_linux.returncode == 0, on_linux.stdout + on_linux.stderr
    in_darwin_mode = run("darwin")
    assert in_darwin_mode.returncode == 1, in_darwin_mode.stdout + in_darwin_mode.stderr
    assert "NotOnThisPlatform" in in_darwin_mode.stdout, in_darwin_mode.stdout
    assert "a named semaphore's file does not exist on macOS" in in_darwin_mode.stdout


def test_r_a10_a_group_macos_cannot_give_is_refused_at_creation_in_one_line(
    darwin: None, segment_name: str, write_config: Callable[..., Path]
) -> None:
    """macOS cannot chown a shared-memory object: a group-shared segment for another
    group than the creator's is refused, saying what to do, and nothing is left."""
    config = write_config({"providers": [{"id": "p1", "maxConcurrent": 1}]})
    other = os.getegid() + 4242
    with pytest.raises(SegmentError) as info:
        Admission.attach(
            config=config, segment=segment_name, generation="g", group_shared=True, group=other
        )
    assert "effective group" in str(info.value) and len(str(info.value).splitlines()) == 1
    assert run_cli("availability", "--segment", segment_name).returncode == 3  # nothing left
