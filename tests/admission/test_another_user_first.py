"""Another local user gets to every name first (R-G6).

The attacker is a real process of the user ``nobody`` (a forked child that drops to
nobody's uid: no special rights), and the victim is this test, as root, using the
product exactly as a handler or the sidecar would. Names in /dev/shm are predictable
(derived from the config path); what must decide is who owns what lies there.
"""

from __future__ import annotations

import contextlib
import json
import os
import pwd
import secrets
import stat
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import posix_ipc
import pytest
from gwtest import NobodyProcess, as_nobody, core_hooks, run_cli

from handler_shim import Admission, SegmentError
from shm_layout import _core, layout, lock, names, platform
from shm_layout.layout import HEADER, MEMBER
from shm_layout.owners import OwnerPolicy
from shm_layout.rows import member_base
from shm_layout.segment import ForeignSegment, Segment, unlink_segment

# Another user is a forked child that drops to nobody's uid (gwtest.as_nobody): that works
# on macOS too. The tests that look at a semaphore's owner or mode, which only Linux
# shows (a file in /dev/shm), say so (tests/conftest.py: the linux marker).


@pytest.fixture
def config(write_config: Callable[..., Path]) -> Path:
    return write_config({"providers": [{"id": "p1", "maxConcurrent": 2}]})


def _squat_segment(name: str, limit: int) -> int:
    """As nobody: create the segment under ``name`` with the project's own code, owner-only,
    and publish a limit of ``limit`` that never expires."""
    seg = Segment.open(name)
    from shm_layout import writer

    writer.ensure_provider(seg, "p1", limit, layout.Source.PROVIDER, discovery=False)
    seg.close()
    return 0


def test_r_g6_a_segment_another_user_made_first_is_refused_with_its_owner(
    segment_name: str, config: Path
) -> None:
    code, output = as_nobody(lambda: _squat_segment(segment_name, 0))
    assert code == 0, output
    started = time.monotonic()
    with pytest.raises(ForeignSegment) as info:
        Admission.attach(config=config, segment=segment_name, generation="root-handler")
    message = str(info.value)
    assert time.monotonic() - started < 2.0  # refused before anything is waited for
    uid = pwd.getpwnam("nobody").pw_uid  # 65534 on Linux, -2 (4294967294) on macOS
    assert "nobody" in message and f"uid {uid}" in message and "root (uid 0)" in message
    assert "--unlink --force" in message and len(message.splitlines()) == 1
    unlink_segment(segment_name)


def test_r_g6_a_squatter_holding_the_lock_inside_its_segment_hangs_nobody(
    segment_name: str, config: Path
) -> None:
    """nobody holds the robust mutex of its own segment forever: root's attach is refused
    as foreign at once, without ever waiting for that lock."""

    def squat_and_hold() -> None:
        seg = Segment.open(segment_name)
        core_hooks(seg.core).hold_lock(False)  # and never let go

    squatter = NobodyProcess(squat_and_hold)
    try:
        started = time.monotonic()
        with pytest.raises(ForeignSegment):
            Admission.attach(config=config, segment=segment_name, generation="root-handler")
        assert time.monotonic() - started < 2.0
    finally:
        squatter.stop()
        unlink_segment(segment_name)


def test_r_g6_a_zero_filled_squat_is_refused_at_once(segment_name: str, config: Path) -> None:
    """A zero-filled object of nobody's at the segment's name is refused as foreign at
    once, naming its owner, never 'could not be created or attached; try again' after a
    long wait."""

    def zeros() -> int:
        shm = posix_ipc.SharedMemory(segment_name, posix_ipc.O_CREX, 0o600, layout.TOTAL_SIZE)
        shm.close_fd()
        return 0

    assert as_nobody(zeros)[0] == 0
    started = time.monotonic()
    with pytest.raises(ForeignSegment) as info:
        Admission.attach(config=config, segment=segment_name, generation="root-handler")
    assert time.monotonic() - started < 2.0
    assert "nobody" in str(info.value)
    unlink_segment(segment_name)


def test_r_g6_a_named_owner_is_trusted(segment_name: str, config: Path) -> None:
    """Group-shared deployments name the other side's user: then its segment is used."""
    assert as_nobody(lambda: _squat_segment(segment_name, 2))[0] == 0
    adm = Admission.attach(config=config, segment=segment_name, generation="g", owner="nobody")
    try:
        with adm.slot_blocking("p1", timeout=2):
            pass
    finally:
        adm.close()
        unlink_segment(segment_name)


def test_r_g6_a_lock_file_another_user_made_first_is_refused_untouched(
    segment_name: str, config: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A lock file of nobody's, made first (or a symlink at its name), is refused in one line:
    root neither stamps it nor locks it, so nobody's lock on it cannot hang root."""
    monkeypatch.setenv(lock.FORCE_LOCK_FILE_ENV, "1")
    path = lock.lock_file_path(segment_name)

    def plant(mode: int) -> Callable[[], int]:
        def make() -> int:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, mode)
            os.fchmod(fd, mode)
            os.close(fd)
            return 0

        return make

    for mode in (0o600, 0o666):
        assert as_nobody(plant(mode))[0] == 0
        with pytest.raises(SegmentError) as info:
            Admission.attach(config=config, segment=segment_name, generation="root")
        message = str(info.value)
        assert "nobody" in message or "all users" in message, message
        assert len(message.splitlines()) == 1
        assert os.path.getsize(path) == 0  # nothing of root's was written into it
        os.unlink(path)
        assert platform.shared_memory_stat(segment_name) is None  # no half-made segment
    # a symlink planted under the lock file's name
    target = tmp_path / "elsewhere"
    target.write_text("")
    assert as_nobody(lambda: os.symlink(target, path) or 0)[0] == 0
    with pytest.raises(SegmentError) as info:
        Admission.attach(config=config, segment=segment_name, generation="root")
    assert "symbolic link" in str(info.value) and "Remove the link" in str(info.value)
    os.unlink(path)


def test_r_g6_doorbell_names_cannot_be_guessed_or_squatted(segment_name: str, config: Path) -> None:
    """Doorbells are named after 64 random bits written in the segment, which nobody
    cannot read, so nobody cannot pre-create them and take the posts meant for root's
    waiters; semaphores nobody made under predictable names (sem.<segment>.dN) are
    nothing to us."""

    def squat_old_names() -> int:
        for m in range(4):
            posix_ipc.Semaphore(f"{segment_name}.d{m}", posix_ipc.O_CREX, 0o666, 0).close()
        return 0

    assert as_nobody(squat_old_names)[0] == 0
    a = Admission.attach(config=config, segment=segment_name, generation="a")
    b = Admission.attach(config=config, segment=segment_name, generation="b")
    try:
        bells = {a._current.bell, b._current.bell}
        assert len(bells) == 2 and 0 not in bells
        for bell in bells:
            owner = platform.semaphore_owner(names.doorbell_name(bell))
            # macOS cannot show a semaphore's owner: there the name alone protects it
            assert owner == (None if platform.is_darwin() else (0, os.getegid()))
        with a.slot_blocking("p1"), a.slot_blocking("p1"):
            pass
        with b.slot_blocking("p1", timeout=2):
            pass
    finally:
        a.close()
        b.close()
        for m in range(4):
            posix_ipc.unlink_semaphore(f"{segment_name}.d{m}")
        unlink_segment(segment_name)


@pytest.mark.linux("the core checks a doorbell's owner, which only Linux shows (/dev/shm)")
def test_r_g6_a_doorbell_another_user_owns_is_never_posted(segment_name: str, config: Path) -> None:
    """A member row pointed at a semaphore of nobody's (a group member can write the
    segment): the core's grant does not post it (R-G6), and the row's owner still takes
    slots (its waiters see a grant at their next nap, R-A16)."""
    name = names.doorbell_name(names.new_bell())

    def plant() -> int:
        posix_ipc.Semaphore(name, posix_ipc.O_CREX, 0o600, 0).close()
        return 0

    assert as_nobody(plant)[0] == 0
    adm = Admission.attach(config=config, segment=segment_name, generation="root")
    other = Admission.attach(config=config, segment=segment_name, generation="other")
    try:
        held = [other.acquire_blocking("p1"), other.acquire_blocking("p1")]
        waiting = _core.Ticket()  # a waiter woken by its doorbell (as async waiters are)
        assert (
            adm._core.arrive(waiting, 0, os.getpid(), 0.0, may_wait=True, blocking=True)
            == _core.WAIT
        )
        m = adm._current.member
        MEMBER["bell"].put(adm._buf, int(name.rsplit("-", 1)[1], 16), member_base(m))
        other.release(held.pop())  # the grant goes to our waiting record
        assert adm._core.state(waiting) == layout.HOLDER_RUNNING
        sem = posix_ipc.Semaphore(name)
        try:
            assert sem.value == 0  # nobody's semaphore was not posted
        finally:
            sem.close()
        waiting.leave(_core.RELEASED, blocking=True)
        with adm.slot_blocking("p1", timeout=2):
            pass
        other.release(held.pop())
    finally:
        other.close()
        adm.close()
        posix_ipc.unlink_semaphore(name)


def test_r_g6_decoy_segments_cost_an_attach_almost_nothing(segment_name: str, config: Path) -> None:
    """Decoys (right magic and major, never initialised, a live pid of nobody's) cost a
    root attach almost nothing in the split-budget scan, not seconds each."""
    decoys = ["/gwcap1-" + secrets.token_hex(6) for _ in range(40)]

    def plant() -> None:
        for name in decoys:
            shm = posix_ipc.SharedMemory(name, posix_ipc.O_CREX, 0o600, layout.TOTAL_SIZE)
            import mmap

            buf = mmap.mmap(shm.fd, layout.TOTAL_SIZE)
            HEADER["magic"].put(buf, layout.MAGIC)
            HEADER["major"].put(buf, layout.MAJOR)
            HEADER["creator_pid"].put(buf, os.getpid())
            HEADER["sidecar_pid"].put(buf, os.getpid())
            buf.close()
            shm.close_fd()

    squatter = NobodyProcess(plant)
    try:
        started = time.monotonic()
        adm = Admission.attach(config=config, segment=segment_name, generation="root")
        took = time.monotonic() - started
        adm.close()
        assert took < 1.5, f"attach took {took:.1f}s beside {len(decoys)} decoys"
    finally:
        squatter.stop()
        for name in decoys:
            posix_ipc.unlink_shared_memory(name)
        unlink_segment(segment_name)


@pytest.mark.linux("reads the segment's and a semaphore's mode from their files in /dev/shm")
def test_r_g6_group_shared_mode_never_touches_the_process_umask(
    segment_name: str, config: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Group-shared mode never sets the process-wide umask, not even for a moment: files
    other threads made in that moment would come out 0660."""

    def no_umask(mask: int) -> int:
        raise AssertionError("the process umask was changed")

    monkeypatch.setattr(os, "umask", no_umask)
    adm = Admission.attach(config=config, segment=segment_name, generation="g", group_shared=True)
    try:
        info = os.stat("/dev/shm" + segment_name)
        assert stat.S_IMODE(info.st_mode) == 0o660
        bell = names.doorbell_name(adm._current.bell)
        assert stat.S_IMODE(os.stat(platform.semaphore_path(bell)).st_mode) == 0o660
    finally:
        adm.close()
        unlink_segment(segment_name)


def test_r_g6_an_unknown_owner_setting_is_one_clear_error() -> None:
    with pytest.raises(ValueError) as info:
        OwnerPolicy.for_process("no-such-user-here")
    assert "no user of this host" in str(info.value)


def test_r_g6_the_cli_refuses_another_users_segment_in_one_line(
    segment_name: str, config: Path
) -> None:
    assert as_nobody(lambda: _squat_segment(segment_name, 0))[0] == 0
    try:
        out = run_cli(
            "sidecar", "--config", str(config), "--segment", segment_name, "--refresh", "1"
        )
        assert out.returncode != 0
        text = (out.stderr + out.stdout).strip()
        assert "Traceback" not in text and "nobody" in text, text
        # the operator's views still read it, and say whose it is
        doc = json.loads(run_cli("availability", "--segment", segment_name, "--json").stdout)
        assert doc["owner"].startswith("nobody")
    finally:
        unlink_segment(segment_name)


@pytest.fixture
def planted_link(segment_name: str) -> Iterator[str]:
    """As nobody: a file of nobody's in /dev/shm, and a symbolic link to it under the
    segment's name (what a local user can make before the gateway starts); the file's
    path. Both are removed afterwards (whatever then stands at the name too)."""
    target = platform.SHM_DIR + segment_name + "-target"

    def plant() -> int:
        with open(target, "w") as f:
            f.write("nobody's own bytes")
        os.symlink(target, platform.SHM_DIR + segment_name)
        return 0

    code, output = as_nobody(plant)
    assert code == 0, output
    yield target
    with contextlib.suppress(FileNotFoundError):
        os.unlink(platform.SHM_DIR + segment_name)
    os.unlink(target)


def _refuses_the_link(message: str, segment_name: str) -> None:
    assert len(message.splitlines()) == 1, message
    assert "symbolic link" in message and "nobody (uid 65534)" in message, message
    assert "root (uid 0)" in message and "--unlink --force" in message, message
    assert segment_name in message


@pytest.mark.linux("a symbolic link in /dev/shm: macOS has no shm directory to plant one in")
def test_r_g6_a_symbolic_link_at_the_segments_name_is_refused_in_one_line(
    segment_name: str, config: Path, planted_link: str
) -> None:
    with pytest.raises(ForeignSegment) as info:
        Admission.attach(config=config, segment=segment_name, generation="root-handler")
    _refuses_the_link(str(info.value), segment_name)
    with pytest.raises(ForeignSegment):
        Segment.open(segment_name, create=False)
    assert Path(planted_link).read_text() == "nobody's own bytes"  # never followed, never written


@pytest.mark.linux("a symbolic link in /dev/shm: macOS has no shm directory to plant one in")
def test_r_g6_every_view_and_the_sidecar_refuse_a_symbolic_link_without_a_traceback(
    segment_name: str, config: Path, planted_link: str
) -> None:
    views = [
        ("availability", "--segment", segment_name),
        ("availability", "--segment", segment_name, "--json"),
        ("availability", "--segment", segment_name, "--check"),
        ("inspect", "--segment", segment_name),
        ("inspect", "--segment", segment_name, "--check"),
        ("watch", "--segment", segment_name, "--count", "1"),
        ("inspect", "--segment", segment_name, "--unlink"),  # no --force: refused
        ("sidecar", "--config", str(config), "--segment", segment_name, "--refresh", "1"),
    ]
    for args in views:
        out = run_cli(*args)
        text = (out.stderr + out.stdout).strip()
        assert out.returncode != 0, (args, text)
        assert "Traceback" not in text, (args, text)
        if "--json" in args:
            text = json.loads(out.stdout)["error"]
        else:
            text = text.splitlines()[-1]
        assert "symbolic link" in text and "nobody" in text, (args, text)
    assert os.path.islink(platform.SHM_DIR + segment_name)  # --unlink alone left it
    # --force removes the link itself, never what it points at
    out = run_cli("inspect", "--segment", segment_name, "--unlink", "--force")
    assert out.returncode == 0, out.stderr
    assert "Traceback" not in out.stdout + out.stderr
    assert "symbolic link" in out.stdout
    assert not os.path.lexists(platform.SHM_DIR + segment_name)
    assert Path(planted_link).read_text() == "nobody's own bytes"
    # and the name is free for the gateway again
    adm = Admission.attach(config=config, segment=segment_name, generation="root-handler")
    try:
        with adm.slot_blocking("p1", timeout=2):
            pass
    finally:
        adm.close()


@pytest.fixture(autouse=True)
def _no_leftover(segment_name: str) -> Iterator[None]:
    yield
    unlink_segment(segment_name)
