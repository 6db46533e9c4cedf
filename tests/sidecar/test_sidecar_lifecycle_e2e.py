"""Start, stop, crash, restart and hand-over of the sidecar (R-G4, R-G5, R-L7, R-A5, R-A9)."""

from __future__ import annotations

import re
import signal
import subprocess
import time
from pathlib import Path

import pytest
from sidecar_e2e import Rig, cli_json, cli_provider, cli_providers, discovered, wait_doc


def test_r_g4_a_second_sidecar_fences_the_first_which_exits_0_and_never_writes_again(
    rig: Rig,
) -> None:
    old_router, new_router = rig.servers(), rig.servers()
    old_config = rig.write_config(
        {
            "maxConcurrent": 8,
            "providers": [rig.entry(old_router), rig.entry(old_router, "old-only")],
        },
        name="old.json",
    )
    new_config = rig.write_config(
        {"maxConcurrent": 8, "providers": [rig.entry(new_router, maxConcurrent=15)]},
        name="new.json",
    )
    first = rig.start_discovered(old_config)
    first_epoch = rig.sidecar_doc()["writer_epoch"]

    second = rig.start(new_config)
    assert first.wait(10) == 0  # retired, not failed: Restart=on-failure leaves it down
    rig.wait("p1", discovered(15), what="the new sidecar's limit")
    now = rig.sidecar_doc()
    assert now["pid"] == second.pid and now["alive"] and now["state"] == "running"
    assert now["writer_epoch"] == first_epoch + 1

    log = first.log_text()
    match = re.search(r"superseded.*epoch (\d+)\b.*epoch (\d+)", log)
    assert match, log
    assert (int(match.group(1)), int(match.group(2))) == (first_epoch, first_epoch + 1)
    # and the new one says whom it fenced, on its own side too
    assert (
        f"fenced the running sidecar pid {first.pid} (writer epoch {first_epoch}): "
        "it stops writing and exits 0"
    ) in second.log_text()

    # what the first sidecar published is gone and stays gone: the new config rules
    asked = old_router.requests
    time.sleep(1.0)
    shown = cli_providers(rig.segment)
    assert shown["p1"]["effective_limit"] == 15 and "maxConcurrent 15" in shown["p1"]["reason"]
    assert shown["old-only"]["configured"] is False
    assert old_router.requests == asked  # the retired sidecar stopped polling
    assert second.poll() is None


def test_r_l7_r_a9_after_sigkill_handlers_keep_the_discovered_limit_until_expiry_then_fallback(
    rig: Rig,
) -> None:
    # snapshots 27 s old: each discovered limit expires 3 s after its probe
    rig.capacity.set(observed_offset=-27.0)
    sidecar = rig.start_discovered(rig.config(max_concurrent=2))
    first = rig.handler("hold", "--threads", "3")
    for _ in range(3):
        first.expect("admitted")  # 3 > fallback 2: the discovered limit is in force

    sidecar.kill()  # SIGKILL: no goodbye written
    p = rig.provider()
    read_by = time.time()
    expires_at = p["expires_at"]
    assert expires_at is not None
    if read_by < expires_at:  # normally ~2 s to spare; skip only on a badly stalled machine
        assert (p["effective_limit"], p["source"]) == (20, "discovered"), p
    assert rig.sidecar_doc()["alive"] is False

    # after expiry the handlers apply the stored fallback on their own
    p = rig.wait("p1", lambda p: p["source"] == "gateway", timeout=15, what="expired")
    assert time.time() >= expires_at
    p = rig.provider()
    assert p["effective_limit"] == 2 and "expired" in p["reason"], p
    assert p["running"] == 3  # nothing running was cancelled (R-A1)

    late = rig.handler("hold", "--timeout", "1")
    late.expect("timeout")  # 3 running >= 2: no new admission
    first.send("release")
    for _ in range(3):
        first.expect("released")
    up_to = rig.handler("hold", "--threads", "3", "--timeout", "1.5")
    up_to.expect("admitted")
    up_to.expect("admitted")
    up_to.expect("timeout")  # exactly the fallback's 2, with no sidecar at all
    assert len([e for e in up_to.seen if e["event"] == "admitted"]) == 2


def test_r_g5_a_restarted_sidecar_reattaches_without_resetting_running_or_waiting(
    rig: Rig,
) -> None:
    rig.capacity.set(models={"workhorse": 2})
    config = rig.config()
    first = rig.start(config)
    rig.wait("p1", discovered(2))
    holder = rig.handler("hold", "--threads", "4")
    holder.expect("admitted")
    holder.expect("admitted")
    rig.wait("p1", lambda p: (p["running"], p["waiting"]) == (2, 2))
    epoch = rig.sidecar_doc()["writer_epoch"]

    first.kill()  # a crash; systemd's Restart=on-failure starts a new one
    second = rig.start(config)
    wait_doc(
        rig.segment,
        lambda d: d["sidecar"]["pid"] == second.pid and d["sidecar"]["writer_epoch"] == epoch + 1,
    )
    rig.wait("p1", lambda p: p["reason"] == "discovered 2", what="the first probe")
    time.sleep(0.7)  # a few refreshes and heartbeats of the new sidecar
    p = rig.provider()
    # counters kept, and the restart did not let the waiters in on the fallback (8)
    assert (p["running"], p["waiting"]) == (2, 2), p
    inspected = cli_json("inspect", "--segment", rig.segment)["providers"][0]
    assert (inspected["stored_running"], inspected["stored_waiting"]) == (2, 2)
    # because before its first answer the limit in force stayed in force (R-L7)
    [first_word] = [line for line in second.log_lines() if "provider p1: limit" in line][:1]
    assert "limit 2 (discovered): kept from the previous sidecar" in first_word, first_word

    rig.capacity.set(models={"workhorse": 4})  # the waiters it kept are the ones admitted
    holder.expect("admitted", timeout=5)
    holder.expect("admitted", timeout=5)
    rig.wait("p1", lambda p: (p["running"], p["waiting"]) == (4, 0))


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_stop_signal_exits_0_leaves_the_segment_and_handlers_keep_working(
    sig: signal.Signals, rig: Rig
) -> None:
    sidecar = rig.start_discovered(rig.config())
    sidecar.signal(sig)
    assert sidecar.wait(10) == 0
    assert sig.name in sidecar.log_text()

    doc = cli_json("availability", "--segment", rig.segment)  # the segment is still there
    assert doc["sidecar"]["alive"] is False and doc["sidecar"]["state"] == "stopped"
    assert doc["providers"][0]["id"] == "p1"
    handler = rig.handler("cycle", "3")
    handler.expect("done")
    assert handler.finish() == 0


def test_parent_pid_the_sidecar_exits_0_when_its_parent_exits(rig: Rig) -> None:
    parent = subprocess.Popen(["sleep", "60"])
    try:
        sidecar = rig.start_discovered(rig.config(), "--parent-pid", str(parent.pid))
        time.sleep(0.6)
        assert sidecar.poll() is None  # alive while the parent lives
        parent.kill()  # not reaped yet: a zombie parent has exited too
        assert sidecar.wait(10) == 0
        assert f"parent process {parent.pid} exited" in sidecar.log_text()
    finally:
        parent.kill()
        parent.wait()
    assert cli_json("availability", "--segment", rig.segment)["sidecar"]["alive"] is False


def test_r_a5_the_sidecar_reclaims_a_sigkilled_holders_slot_within_2s(rig: Rig) -> None:
    sidecar = rig.start_discovered(rig.config())
    holder = rig.handler("hold")
    holder.expect("admitted")
    assert cli_provider(rig.segment, "p1")["running"] == 1

    holder.kill()  # SIGKILL; nobody else waits or arrives: only the sidecar can reap
    killed_at = time.monotonic()

    def reclaimed() -> bool:
        return "reclaimed 1 slot" in sidecar.log_text()

    deadline = killed_at + 2.0 + 1.5  # the 2 s of R-A5, plus room for a busy host
    while not reclaimed() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert reclaimed(), sidecar.log_text()
    p = cli_json("inspect", "--segment", rig.segment)["providers"][0]
    assert (p["stored_running"], p["running"]) == (0, 0), p
    assert p["counters"]["reclaimed_total"] == 1


@pytest.mark.parametrize("shared", [False, True], ids=["owner-only", "group-shared"])
def test_r_g6_the_sidecar_creates_the_segment_owner_only_unless_group_shared(
    shared: bool, rig: Rig
) -> None:
    shm = Path("/dev/shm")
    if not shm.is_dir():
        pytest.skip("no /dev/shm to look at on this system")
    rig.start_discovered(rig.config(), *(["--group-shared"] if shared else []))
    name = rig.segment.lstrip("/")
    objects = [shm / name]  # (the robust-mutex lock lives inside it: nothing else to check)
    expected = 0o660 if shared else 0o600
    for path in objects:
        assert path.exists(), path
        assert path.stat().st_mode & 0o777 == expected, (path, oct(path.stat().st_mode))
    assert cli_json("inspect", "--segment", rig.segment)["header"]["group_shared"] is shared


def test_parent_pid_that_is_not_running_is_exit_2_before_taking_the_epoch(rig: Rig) -> None:
    gone = subprocess.Popen(["true"])
    gone.wait()  # reaped: its pid names no process now
    sidecar = rig.start(rig.config(), "--parent-pid", str(gone.pid))
    assert sidecar.wait(10) == 2
    assert f"--parent-pid {gone.pid}: no such process" in sidecar.log_text()
