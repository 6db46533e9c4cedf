"""Admission from one process: timeouts, cancellation, races, expiry (R-A1, R-A4, R-A7, R-L7).

The segment and semaphores are real; so are the dispatcher threads.
"""

from __future__ import annotations

import asyncio
import logging
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from gwtest import P1Segment, run_cli

from handler_shim import Admission, AdmissionTimeout, QueueFull, UnknownProvider
from shm_layout import _core, writer
from shm_layout.layout import HOLDER_RUNNING, HOLDER_WAITING
from shm_layout.view import read_view


def _publish(adm: Admission, limit: int, expires_in: float) -> None:
    """Publish ``limit`` for p1 as a sidecar would, expiring ``expires_in`` s from now."""
    seg = adm._seg
    epoch = writer.take_epoch(seg, os.getpid(), 0.0, time.time(), 1.0, "test")
    now = time.time()
    publication = writer.Publication(
        "p1",
        True,
        2,
        "provider",
        limit=limit,
        reason="published by the test",
        observed_at=now + expires_in - 30.0,
        expires_at=now + expires_in,
    )
    writer.publish(seg, epoch, 1, "ok", [publication], now)


def _p1(segment: str) -> tuple[int, int, int, int]:
    p = read_view(segment).provider("p1")
    assert p is not None
    return p.running, p.waiting, p.stored_running, p.stored_waiting


def test_r_a4_timeout_leaves_the_queue_exact(adm: Admission, segment_name: str) -> None:
    with adm.slot_blocking("p1"), adm.slot_blocking("p1"):
        started = time.monotonic()
        with pytest.raises(AdmissionTimeout), adm.slot_blocking("p1", timeout=0.3):
            pass
        assert time.monotonic() - started >= 0.3
        assert _p1(segment_name) == (2, 0, 2, 0)
    assert _p1(segment_name) == (0, 0, 0, 0)
    assert read_view(segment_name).provider("p1").counters["timeouts_total"] == 1  # type: ignore[union-attr]


def test_r_a4_async_cancellation_leaves_nothing_behind(adm: Admission, segment_name: str) -> None:
    async def scenario() -> None:
        async with adm.slot("p1"), adm.slot("p1"):
            waiting = [asyncio.create_task(_enter(adm)) for _ in range(5)]
            await asyncio.sleep(0.2)
            assert _p1(segment_name) == (2, 5, 2, 5)
            for task in waiting:
                task.cancel()
            results = await asyncio.gather(*waiting, return_exceptions=True)
            assert all(isinstance(r, asyncio.CancelledError) for r in results)
            assert _p1(segment_name) == (2, 0, 2, 0)

    asyncio.run(scenario())
    assert _p1(segment_name) == (0, 0, 0, 0)


async def _enter(adm: Admission) -> None:
    async with adm.slot("p1"):
        await asyncio.sleep(10)


def test_r_a4_async_timeout_raises_admission_timeout(adm: Admission, segment_name: str) -> None:
    async def scenario() -> None:
        async with adm.slot("p1"), adm.slot("p1"):
            with pytest.raises(AdmissionTimeout):
                async with adm.slot("p1", timeout=0.2):
                    pass
            assert isinstance(AdmissionTimeout(), TimeoutError)

    asyncio.run(scenario())
    assert _p1(segment_name) == (0, 0, 0, 0)


def test_r_a7_async_wait_does_not_block_the_event_loop(adm: Admission) -> None:
    async def scenario() -> int:
        ticks = 0

        async def heartbeat() -> None:
            nonlocal ticks
            while True:
                ticks += 1
                await asyncio.sleep(0.01)

        beat = asyncio.create_task(heartbeat())
        async with adm.slot("p1"), adm.slot("p1"):
            with pytest.raises(AdmissionTimeout):
                async with adm.slot("p1", timeout=0.5):
                    pass
        beat.cancel()
        return ticks

    assert asyncio.run(scenario()) >= 10  # ~50 if the loop ran freely; 1 or 2 if it was blocked


def test_r_a4_a_grant_that_races_with_a_cancel_is_handed_on(
    adm: Admission, segment_name: str
) -> None:
    """Drive the race deterministically in the core: grant, then the cancel arrives."""
    core, me, now = adm._core, os.getpid(), time.time()
    a, b, first, second = (_core.Ticket() for _ in range(4))
    for t in (a, b, first, second):
        assert core.arrive(t, 0, me, now, may_wait=True, blocking=True) in (_core.ADMIT, _core.WAIT)
    assert core.state(first) == HOLDER_WAITING
    assert core.leave(a, _core.RELEASED, now, blocking=True) == 1  # grants `first`
    assert core.state(first) == HOLDER_RUNNING
    assert core.leave(first, _core.CANCELLED, now, blocking=True) == 1  # its cancel lands late
    assert core.state(second) == HOLDER_RUNNING  # handed on
    core.leave(b, _core.RELEASED, now, blocking=True)
    core.leave(second, _core.RELEASED, now, blocking=True)
    assert _p1(segment_name) == (0, 0, 0, 0)


def test_the_core_steps_take_their_flags_by_name_only(adm: Admission) -> None:
    """``arrive(t, p, pid, now, True, True, -1.0)`` reads as nothing: the flags of the core's
    steps are keyword-only, and the two that decide what a step does must be named."""
    core, me, t = adm._core, os.getpid(), _core.Ticket()
    with pytest.raises(TypeError):
        core.arrive(t, 0, me, 0.0, True, True, -1.0)
    with pytest.raises(TypeError, match="may_wait"):
        core.arrive(t, 0, me, 0.0, blocking=True)
    with pytest.raises(TypeError, match="blocking"):
        core.arrive(t, 0, me, 0.0, may_wait=True)
    with pytest.raises(TypeError):
        core.leave(t, _core.RELEASED, 0.0, True)
    with pytest.raises(TypeError, match="blocking"):
        t.leave(_core.RELEASED)
    with pytest.raises(TypeError):
        core.sweep(0.0, False)
    assert core.arrive(t, 0, me, 0.0, may_wait=False, blocking=True) == _core.ADMIT
    assert t.leave(_core.RELEASED, blocking=True) == 1


def test_double_release_and_foreign_release_are_harmless(
    adm: Admission, segment_name: str, write_config: Callable[..., Path]
) -> None:
    other = Admission.attach(segment=segment_name, generation="other")
    try:
        t = _core.Ticket()
        code = adm._core.arrive(t, 0, os.getpid(), time.time(), may_wait=True, blocking=True)
        assert code == _core.ADMIT
        # another registration (even in this process) cannot free it
        assert other._core.leave(t, _core.RELEASED, time.time(), blocking=True) == 0
        assert _p1(segment_name) == (1, 0, 1, 0)
        assert adm._core.leave(t, _core.RELEASED, time.time(), blocking=True) == 1
        assert adm._core.leave(t, _core.RELEASED, time.time(), blocking=True) == 0  # twice: a no-op
        assert _p1(segment_name) == (0, 0, 0, 0)
    finally:
        other.close()


def test_r_a1_lowering_the_limit_never_cancels_running_work(
    adm: Admission, segment_name: str
) -> None:
    with adm.slot_blocking("p1"), adm.slot_blocking("p1"):
        _publish(adm, limit=0, expires_in=30.0)
        p = read_view(segment_name).provider("p1")
        assert p is not None and (p.effective_limit, p.running) == (0, 2)
        with pytest.raises(AdmissionTimeout), adm.slot_blocking("p1", timeout=0.2):
            pass


def test_r_l7_r_a9_an_expired_limit_falls_back_without_any_sidecar(
    adm: Admission, segment_name: str
) -> None:
    """A discovered 0 that expires lets waiters in on the stored fallback, on their own."""
    _publish(adm, limit=0, expires_in=1.2)
    assert read_view(segment_name).provider("p1").source == "discovered"  # type: ignore[union-attr]
    started = time.monotonic()
    with adm.slot_blocking("p1", timeout=10):
        waited = time.monotonic() - started
        p = read_view(segment_name).provider("p1")
        assert p is not None and p.source == "provider" and "expired" in p.reason
    assert 1.0 <= waited < 5.0


def test_r_a2_queue_full_in_one_process(
    segment_name: str, write_config: Callable[..., Path]
) -> None:
    cfg = write_config({"providers": [{"id": "p1", "maxConcurrent": 1}]})
    adm = Admission.attach(config=cfg, segment=segment_name)
    release = threading.Event()
    try:

        def wait_one() -> None:
            with adm.slot_blocking("p1", timeout=30):
                release.wait()

        with adm.slot_blocking("p1"):
            threads = [threading.Thread(target=wait_one) for _ in range(32)]
            for t in threads:
                t.start()
            deadline = time.monotonic() + 10
            while _p1(segment_name)[1] < 32 and time.monotonic() < deadline:
                time.sleep(0.02)
            with pytest.raises(QueueFull), adm.slot_blocking("p1", timeout=30):
                pass
            release.set()
        for t in threads:
            t.join(timeout=30)
        assert _p1(segment_name) == (0, 0, 0, 0)
    finally:
        release.set()
        adm.close()


def test_r_a7_a_waiting_process_wakes_at_most_10_times_a_second(adm: Admission) -> None:
    with adm.slot_blocking("p1"), adm.slot_blocking("p1"):
        before = adm.wakeups
        with pytest.raises(AdmissionTimeout), adm.slot_blocking("p1", timeout=2.0):
            pass
        assert adm.wakeups - before <= 2.0 * 10 + 2  # the arrival's own post and the exit


def test_unknown_provider_says_what_to_check(adm: Admission) -> None:
    with pytest.raises(UnknownProvider) as info, adm.slot_blocking("nope"):
        pass
    assert "nope" in str(info.value) and "config" in str(info.value)


def test_slots_held_at_close_are_released(
    segment_name: str, write_config: Callable[..., Path]
) -> None:
    cfg = write_config({"providers": [{"id": "p1", "maxConcurrent": 2}]})
    adm = Admission.attach(config=cfg, segment=segment_name)
    cm = adm.slot_blocking("p1")
    cm.__enter__()
    adm.close()
    assert _p1(segment_name) == (0, 0, 0, 0)
    cm.__exit__(None, None, None)  # harmless after close


def test_a_static_limit_above_the_segments_room_is_clamped_with_a_warning(
    segment_name: str, write_config: Callable[..., Path], caplog: pytest.LogCaptureFixture
) -> None:
    from gwtest import run_cli

    from shm_layout.layout import RUNNING_ROOM

    cfg = write_config({"providers": [{"id": "p1", "maxConcurrent": 500}]})
    caplog.set_level(logging.WARNING)
    adm = Admission.attach(config=cfg, segment=segment_name)
    try:
        assert f"admitting at most {RUNNING_ROOM}" in caplog.text
        import json

        doc = json.loads(run_cli("inspect", "--segment", segment_name, "--json").stdout)
        p1 = doc["providers"][0]
        assert p1["effective_limit"] == p1["fallback_limit"] == RUNNING_ROOM
        assert p1["clamped"] is True
    finally:
        adm.close()


def test_a_forked_child_never_frees_its_parents_slots(adm: Admission, segment_name: str) -> None:
    """gunicorn-style preload: a child that inherits an attached Admission must attach
    again; using or closing the inherited one leaves the parent's records alone."""
    with adm.slot_blocking("p1"):
        child = os.fork()
        if child == 0:  # pragma: no cover - runs in the child
            code = 0
            try:
                with adm.slot_blocking("p1"):
                    code = 3  # must not get here
            except Exception as exc:
                code = 0 if "attach again" in str(exc) else 4
            adm.close()  # what its atexit hook would do
            os._exit(code)
        _, status = os.waitpid(child, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        view = read_view(segment_name)
        assert _p1(segment_name) == (1, 0, 1, 0)  # the parent's slot is still held
        assert [m.pid for m in view.members] == [os.getpid()]


RAW_FORK_CHILD = """
import ctypes, os, sys
import shm_layout._core  # loaded in the parent, as in a preloading server
from handler_shim import Admission
from shm_layout.view import read_view

fork = getattr(ctypes.CDLL(None), "_Fork", None)
if fork is None:
    sys.exit(77)
child = fork()
if child == 0:  # no pthread_atfork handler ran in here
    adm = Admission.attach(config=sys.argv[1], segment=sys.argv[2], generation="raw")
    with adm.slot_blocking("p1"):
        pids = [h.pid for h in read_view(sys.argv[2]).holders]
    adm.close()
    os._exit(0 if pids == [os.getpid()] else 5)
_, status = os.waitpid(child, 0)
sys.exit(os.waitstatus_to_exitcode(status))
"""


def test_a_childs_records_carry_its_own_pid_even_when_no_fork_hook_ran(
    p1_segment: Callable[..., P1Segment],
) -> None:
    """A child made by glibc's ``_Fork()`` (which runs no fork hooks) writes its own pid
    into its records, not its parent's cached one, so ``inspect`` names the right
    process: a record carries the pid its registration was made with."""
    seg = p1_segment(2)
    done = subprocess.run(
        [sys.executable, "-c", RAW_FORK_CHILD, str(seg.config), seg.name], timeout=60
    )
    if done.returncode == 77:
        pytest.skip("this libc has no _Fork() (glibc 2.34 and later have it)")
    assert done.returncode == 0, "a holder record named another pid than its process's"


def test_r_a7_a_handled_signal_neither_kills_the_dispatcher_nor_loses_a_grant(
    adm: Admission,
) -> None:
    """A signal handler that runs during a wait ends neither the dispatcher thread (that
    would lose every later grant) nor the wait: the dispatcher (doorbell) and a waiting
    thread (its record's futex) both go on waiting, and the handler runs."""
    import signal

    previous = signal.signal(signal.SIGUSR1, lambda *_: None)  # a gateway's reload handler
    try:
        dispatcher = next(t for t in adm._current.threads if t.name == "gwcap-dispatch")
        time.sleep(0.1)  # let it block in sem_wait
        assert dispatcher.ident is not None
        signal.pthread_kill(dispatcher.ident, signal.SIGUSR1)
        time.sleep(0.2)
        assert dispatcher.is_alive()

        release = threading.Event()

        def hold_both() -> None:
            with adm.slot_blocking("p1"), adm.slot_blocking("p1"):
                release.wait(5)

        holder = threading.Thread(target=hold_both)
        holder.start()
        time.sleep(0.1)
        threading.Timer(0.15, os.kill, (os.getpid(), signal.SIGUSR1)).start()  # while we wait
        threading.Timer(0.3, release.set).start()
        with adm.slot_blocking("p1", timeout=5):  # the grant still reaches us
            pass
        holder.join()
        assert dispatcher.is_alive()
    finally:
        signal.signal(signal.SIGUSR1, previous)


def test_r_a1_closing_one_attachment_leaves_another_in_the_same_process_alone(
    segment_name: str, write_config: Callable[..., Path]
) -> None:
    cfg = write_config({"providers": [{"id": "p1", "maxConcurrent": 1}]})
    a = Admission.attach(config=cfg, segment=segment_name, generation="lib-a")
    b = Admission.attach(config=cfg, segment=segment_name, generation="lib-b")
    try:
        with b.slot_blocking("p1"):
            a.close()
            assert _p1(segment_name) == (1, 0, 1, 0)  # b's slot is still counted
            with pytest.raises(AdmissionTimeout), b.slot_blocking("p1", timeout=0.2):
                pass  # and the limit of 1 still holds
    finally:
        b.close()


def test_availability_escapes_a_reason_scribbled_with_terminal_escapes(
    adm: Admission, segment_name: str
) -> None:
    """Whoever may write the segment may write a reason: the views print it escaped, so
    it can forge no line and send no escape to the operator's terminal."""
    seg = adm._seg
    epoch = writer.take_epoch(seg, os.getpid(), 0.0, time.time(), 1.0, "test")
    now = time.time()
    forged = "ok\nprovider p2 [static]  limit 99\x1b[2J\u202e"
    publication = writer.Publication(
        "p1", True, 2, "provider", limit=2, reason=forged, observed_at=now, expires_at=now + 30
    )
    writer.publish(seg, epoch, 1, "ok", [publication], now)
    out = run_cli("availability", "--segment", segment_name)
    assert out.returncode == 0, out.stderr
    assert "\x1b" not in out.stdout and "\u202e" not in out.stdout
    assert "  reason: ok\\nprovider p2 [static] limit 99\\x1b[2J\\u202e" in out.stdout


def test_availability_check_escapes_a_scribbled_reason_in_its_problems_and_warnings(
    adm: Admission, segment_name: str
) -> None:
    """``availability --check`` quotes a provider's reason in each problem and warning
    it prints: escaped there too, whether the reason names a missing model or not."""
    seg = adm._seg
    epoch = writer.take_epoch(seg, os.getpid(), 0.0, time.time(), 1.0, "test")
    for seq, forged in enumerate(
        ("x missing from y\nprovider p2: ok\x1b[2J\u202e", "held\nprovider p2: ok\x1b[2J"), 1
    ):
        now = time.time()
        publication = writer.Publication(
            "p1", True, 0, "provider", limit=0, reason=forged, observed_at=now, expires_at=now + 30
        )
        writer.publish(seg, epoch, seq, "ok", [publication], now)
        out = run_cli("availability", "--check", "--segment", segment_name)
        said = out.stdout + out.stderr
        assert "p1" in said and "\x1b" not in said and "\u202e" not in said, said
        assert not any(line.startswith("provider p2") for line in said.splitlines()), said
