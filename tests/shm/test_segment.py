"""The segment: create/attach, versions, permissions, names, removal (R-G2, R-G5, R-G6, R-A10).

Real POSIX shared memory and semaphores, real processes, the real CLI.
"""

from __future__ import annotations

import json
import os
import re
import stat
import time
from collections.abc import Callable
from pathlib import Path

import posix_ipc
import pytest
from gwtest import ROOT, Agent, P1Segment, run_cli, run_together

from shm_layout import layout, names
from shm_layout.layout import HEADER
from shm_layout.segment import (
    IncompatibleLayout,
    NotOurSegment,
    Segment,
    remove_doorbell,
    unlink_segment,
)

DEV_SHM = Path("/dev/shm")
needs_dev_shm = pytest.mark.skipif(not DEV_SHM.is_dir(), reason="Linux /dev/shm only")

# A racer: waits until the time in argv[2], opens the segment named argv[1] (as
# ``seg``), then prints one JSON line (what follows this preamble).
RACER = f"""
import json, sys, time
sys.path.insert(0, {str(ROOT)!r})
from shm_layout.segment import Segment
from shm_layout.layout import HEADER
go = float(sys.argv[2])
while time.time() < go:
    time.sleep(0.0005)
seg = Segment.open(sys.argv[1])
"""

RACE_SCRIPT = (
    RACER
    + """
print(json.dumps({"created": seg.created, "init": HEADER["init_complete"].get(seg.buf),
                  "creator": HEADER["creator_pid"].get(seg.buf)}))
"""
)


def test_r_g2_create_attach_race_between_many_processes_has_one_creator(
    segment_name: str,
) -> None:
    go = time.time() + 1.5
    results = run_together(RACE_SCRIPT, 12, segment_name, str(go))
    creators = [r for r in results if r["created"]]
    assert len(creators) == 1
    assert all(r["init"] == layout.INIT_MARK for r in results)
    assert len({r["creator"] for r in results}) == 1


def test_r_g2_other_major_is_refused_naming_both_versions(segment_name: str) -> None:
    seg = Segment.open(segment_name)
    HEADER["major"].put(seg.buf, layout.MAJOR + 1)
    HEADER["minor"].put(seg.buf, 3)
    seg.close()
    with pytest.raises(IncompatibleLayout) as info:
        Segment.open(segment_name)
    message = str(info.value)
    assert f"{layout.MAJOR + 1}.3" in message
    assert f"{layout.MAJOR}.{layout.MINOR}" in message
    out = run_cli("availability", "--segment", segment_name)
    assert out.returncode == 2
    assert "Traceback" not in out.stderr
    assert len(out.stderr.strip().splitlines()) == 1
    assert f"{layout.MAJOR + 1}.3" in out.stderr


def test_r_g2_newer_minor_of_the_same_major_attaches(segment_name: str) -> None:
    seg = Segment.open(segment_name)
    HEADER["minor"].put(seg.buf, layout.MINOR + 5)
    seg.close()
    again = Segment.open(segment_name)
    assert not again.created
    again.close()
    assert run_cli("availability", "--segment", segment_name).returncode == 0


def test_r_g2_an_object_that_is_not_ours_is_a_one_line_error(segment_name: str) -> None:
    shm = posix_ipc.SharedMemory(segment_name, posix_ipc.O_CREX, 0o600, 4096)
    os.write(shm.fd, b"not a gateway-capacity segment" * 10)
    shm.close_fd()
    with pytest.raises(NotOurSegment):
        Segment.open(segment_name)
    out = run_cli("inspect", "--segment", segment_name)
    assert out.returncode == 2
    assert "not a gateway-capacity segment" in out.stderr
    assert "Traceback" not in out.stderr
    as_json = run_cli("inspect", "--segment", segment_name, "--json")  # the error as JSON
    assert as_json.returncode == 2 and as_json.stderr == ""
    assert "not a gateway-capacity segment" in json.loads(as_json.stdout)["error"]


def test_r_g2_segment_abandoned_before_init_is_recreated(segment_name: str) -> None:
    # A creator that died after shm_open but before writing the init mark.
    shm = posix_ipc.SharedMemory(segment_name, posix_ipc.O_CREX, 0o600, layout.TOTAL_SIZE)
    shm.close_fd()
    seg = Segment.open(segment_name)
    assert seg.created
    assert HEADER["init_complete"].get(seg.buf) == layout.INIT_MARK
    seg.close()


def _modes_made_under(umask: int, segment: str, lock_kind: str, **options: bool) -> dict[Path, int]:
    """Open (create) the segment with ``options`` and make a doorbell, under ``umask``: the
    permission bits of each object made in /dev/shm (on the macOS path, the lock file too)."""
    old = os.umask(umask)
    try:
        seg = Segment.open(segment, **options)
        bell = seg.create_doorbell()
    finally:
        os.umask(old)
    seg.close()
    base = segment.lstrip("/")
    paths = [DEV_SHM / base, DEV_SHM / f"sem.{names.doorbell_name(bell).lstrip('/')}"]
    if lock_kind == "lock-file":
        paths.append(DEV_SHM / f"{base}.lock")  # the lock file beside the segment
    try:
        return {path: stat.S_IMODE(path.stat().st_mode) for path in paths}
    finally:
        remove_doorbell(bell)


@needs_dev_shm
def test_r_g6_segment_and_semaphores_are_owner_only_by_default(
    lock_kind: str, segment_name: str
) -> None:
    modes = _modes_made_under(0, segment_name, lock_kind)  # a permissive umask widens nothing
    assert set(modes.values()) == {0o600}, modes


@needs_dev_shm
def test_r_g6_group_shared_is_0660_even_under_a_strict_umask(
    lock_kind: str, segment_name: str
) -> None:
    modes = _modes_made_under(0o077, segment_name, lock_kind, group_shared=True)
    assert set(modes.values()) == {0o660}, modes


def test_r_g6_a_world_accessible_segment_is_refused(segment_name: str) -> None:
    seg = Segment.open(segment_name)
    seg.close()
    shm = posix_ipc.SharedMemory(segment_name)
    os.fchmod(shm.fd, 0o666)
    shm.close_fd()
    out = run_cli("availability", "--segment", segment_name)
    assert out.returncode == 2
    assert "accessible to all users" in out.stderr


def test_r_a10_names_over_the_macos_limit_are_refused(tmp_path: Path) -> None:
    long_name = "/" + "x" * 31  # 32 bytes: one more than macOS allows
    with pytest.raises(names.BadSegmentName) as info:
        names.check_segment_name(long_name)
    assert "at most" in str(info.value)
    out = run_cli("availability", "--segment", long_name)
    assert out.returncode == 2
    assert "bytes" in out.stderr and "Traceback" not in out.stderr
    # every derived name fits in 31 bytes, doorbells included
    derived = names.segment_name_for_config(tmp_path / "gateway.json")
    assert len(derived) == len("/gwcap1-") + 12
    longest = names.doorbell_name(2**64 - 1)
    assert len(longest.encode()) <= names.MAX_NAME_BYTES
    names.check_segment_name("/" + "x" * 30)  # 31 bytes: the most a segment name may have


def test_segment_name_precedence_flag_then_env_then_config(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cfg = tmp_path / "g.json"
    monkeypatch.delenv(names.ENV_VAR, raising=False)
    assert names.resolve_segment_name(None, cfg) == names.segment_name_for_config(cfg)
    monkeypatch.setenv(names.ENV_VAR, "/from-env")
    assert names.resolve_segment_name(None, cfg) == "/from-env"
    assert names.resolve_segment_name("/from-flag", cfg) == "/from-flag"


def test_availability_without_a_segment_exits_3_with_one_line(segment_name: str) -> None:
    out = run_cli("availability", "--segment", segment_name)
    assert out.returncode == 3
    assert len(out.stderr.strip().splitlines()) == 1
    assert out.stdout == ""
    as_json = run_cli("availability", "--segment", segment_name, "--json")
    assert as_json.returncode == 3 and as_json.stderr == ""
    assert json.loads(as_json.stdout)["error"].startswith(f"no segment {segment_name}")


def test_r_g5_segment_outlives_its_processes_and_unlink_refuses_while_live(
    segment_name: str,
    write_config: Callable[..., Path],
    agents: Callable[..., Agent],
) -> None:
    cfg = write_config({"providers": [{"id": "p1", "maxConcurrent": 2}]})
    holder = agents("--segment", segment_name, "--config", str(cfg), "hold")
    holder.expect("admitted")
    refused = run_cli("inspect", "--segment", segment_name, "--unlink")
    assert refused.returncode == 1
    assert "refusing" in refused.stderr and str(holder.pid) in refused.stderr
    assert run_cli("availability", "--segment", segment_name).returncode == 0

    holder.send("release")
    holder.expect("released")
    assert holder.finish() == 0
    # R-G5: nothing is removed when the last process leaves
    doc = json.loads(run_cli("inspect", "--segment", segment_name, "--json").stdout)
    assert doc["providers"][0]["id"] == "p1"
    assert doc["holders"] == []

    removed = run_cli("inspect", "--segment", segment_name, "--unlink")
    assert removed.returncode == 0, removed.stderr
    assert run_cli("availability", "--segment", segment_name).returncode == 3
    if DEV_SHM.is_dir():
        assert not list(DEV_SHM.glob(f"sem.{segment_name.lstrip('/')}.*"))


def test_r_g5_unlink_force_removes_a_segment_in_use(
    segment_name: str, write_config: Callable[..., Path], agents: Callable[..., Agent]
) -> None:
    cfg = write_config({"providers": [{"id": "p1"}]})
    holder = agents("--segment", segment_name, "--config", str(cfg), "hold")
    holder.expect("admitted")
    forced = run_cli("inspect", "--segment", segment_name, "--unlink", "--force")
    assert forced.returncode == 0, forced.stderr
    assert run_cli("availability", "--segment", segment_name).returncode == 3
    holder.send("release")
    holder.expect("released")  # the old mapping stays usable for who has it


def test_readers_report_a_torn_picture_instead_of_hanging(segment_name: str) -> None:
    seg = Segment.open(segment_name)
    HEADER["change_seq"].put(seg.buf, 7)  # a writer that died mid-write leaves it odd
    seg.close()
    out = run_cli("availability", "--segment", segment_name, "--json")
    assert out.returncode == 0
    assert json.loads(out.stdout)["consistent"] is False


def test_unlink_segment_removes_every_semaphore(p1_segment: Callable[..., P1Segment]) -> None:
    seg = p1_segment(2)
    segment_name = seg.name
    holder = seg.handler("--gen", "x", "hold")
    holder.expect("admitted")
    bells = [m for m in _member_bells(segment_name)]
    assert bells and all(_doorbell_exists(b) for b in bells)
    holder.kill()  # died without unregistering: its doorbell is left behind
    assert unlink_segment(segment_name)
    assert not unlink_segment(segment_name)
    assert not any(_doorbell_exists(b) for b in bells)


def _member_bells(segment: str) -> list[int]:
    from shm_layout.rows import member_base
    from shm_layout.segment import map_readonly

    buf = map_readonly(segment)
    try:
        return [
            layout.MEMBER["bell"].get(buf, member_base(m))
            for m in range(layout.MEMBER_COUNT)
            if layout.MEMBER["in_use"].get(buf, member_base(m))
        ]
    finally:
        buf.close()


def _doorbell_exists(bell: int) -> bool:
    try:
        posix_ipc.Semaphore(names.doorbell_name(bell)).close()
    except posix_ipc.ExistentialError:
        return False
    return True


def test_watch_refreshes_the_availability_view(p1_segment: Callable[..., P1Segment]) -> None:
    seg = p1_segment(2)
    adm = seg.attach("watched")
    try:
        before = time.time()
        out = run_cli("watch", "--segment", seg.name, "--count", "2", "--interval", "0.1")
        after = time.time()
        assert out.returncode == 0, out.stderr
        assert out.stdout.count("p1 [static]  limit 2 (provider)") == 2
        frames = [f for f in out.stdout.split("---\n") if f.strip()]
        stamps = [re.match(r"at (\S+ \S+) \S+, every 0.1 s\n", f) for f in frames]
        assert all(stamps) and len(stamps) == 2, out.stdout  # each frame says when it is
        times = [
            time.mktime(time.strptime(m[1].partition(".")[0], "%Y-%m-%d %H:%M:%S"))
            for m in stamps
            if m is not None
        ]
        assert int(before) - 1 <= times[0] <= times[1] <= after + 1, (before, times, after)
        assert "watched (1 process)" in out.stdout
    finally:
        adm.close()
    assert run_cli("watch", "--segment", "/gwt-nowhere", "--count", "1").returncode == 3


ABANDONED_RACE = (
    RACER
    + """
created = HEADER["created_at"].get(seg.buf)
doc = {"created_at": created, "creator": HEADER["creator_pid"].get(seg.buf)}
print(json.dumps(doc))
"""
)


def test_r_g2_processes_that_find_an_abandoned_segment_together_end_on_one(
    segment_name: str,
) -> None:
    """R-G2: attachers that judge a never-initialised object abandoned together unlink
    only that object, never the segment another has just created in its place: all of
    them end on one segment with one budget."""
    shm = posix_ipc.SharedMemory(segment_name, posix_ipc.O_CREX, 0o600, layout.TOTAL_SIZE)
    shm.close_fd()  # a creator that died before its init mark
    go = time.time() + 1.0
    docs = run_together(ABANDONED_RACE, 6, segment_name, str(go))
    seen = {(doc["creator"], doc["created_at"]) for doc in docs}
    assert len(seen) == 1  # every process is on the same, initialised segment


def test_r_a10_a_size_rounded_up_to_a_page_is_still_ours() -> None:
    """macOS reports a shm object's size rounded up to its page size."""
    from shm_layout.segment import _our_size

    rounded = (layout.TOTAL_SIZE + 16383) // 16384 * 16384
    assert _our_size(layout.TOTAL_SIZE) and _our_size(rounded)
    assert not _our_size(4096) and not _our_size(layout.TOTAL_SIZE - 1)
