"""The moments of change (R-A14, R-A15, R-A16, R-L7): an attachment closing
while others wait, an event loop closed with waiters, the segment removed or written
over by hand, a stepped wall clock.

Real processes (tests/agent.py), the real segment, real signals; both lock kinds where
the lock takes part (``lock_kind``: the Linux path and the macOS path forced on Linux).
"""

from __future__ import annotations

import asyncio
import logging
import os
import random
import shutil
import sys
import textwrap
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import posix_ipc
import pytest
from gwtest import AGENT, Agent, P1Segment, kill_under_faketime, run_cli, wait_until

from handler_shim import Admission, AdmissionError, AdmissionTimeout
from shm_layout import _core, layout, platform, writer
from shm_layout.layout import HOLDER, MEMBER, PROVIDER
from shm_layout.rows import holder_base, member_base, provider_base
from shm_layout.segment import Segment, unlink_segment
from shm_layout.view import read_view


@pytest.fixture
def config(write_config: Callable[..., Path]) -> Path:
    return write_config({"providers": [{"id": "p1", "maxConcurrent": 1}]})


def _counts(segment: str, provider: str = "p1") -> tuple[int, int]:
    p = read_view(segment).provider(provider)
    assert p is not None
    return p.running, p.waiting


def _mine(segment: str, pid: int) -> int:
    """Records (running or waiting) of process ``pid`` in the segment."""
    return sum(1 for h in read_view(segment).holders if h.pid == pid)


# --- 1. close() racing a waiting arrival; close() while bodies run (R-A14) ----------------
def test_r_a14_an_arrival_waiting_for_the_lock_when_close_runs_is_refused_never_admitted(
    lock_kind: str, segment_name: str, config: Path, agents: Callable[..., Agent]
) -> None:
    """An arrival that gets the lock after close() freed its registration is refused: it
    never writes a record under the freed registration and runs its body uncounted
    (2 running on a limit of 1)."""
    adm = Admission.attach(config=config, segment=segment_name, generation="closing")
    locker = agents("--segment", segment_name, "--config", str(config), "lock")
    locker.expect("locked")  # another process holds the segment lock
    outcome: list[object] = []

    def arrive() -> None:
        try:
            with adm.slot_blocking("p1", timeout=20):
                outcome.append("admitted")
                time.sleep(1.0)
        except AdmissionError as exc:
            outcome.append(exc)

    arriving = threading.Thread(target=arrive)
    arriving.start()
    time.sleep(0.3)  # the arrival waits for the lock
    closing = threading.Thread(target=adm.close, kwargs={"grace": 5.0})
    closing.start()
    time.sleep(0.3)  # close() waits for the lock too
    locker.kill()  # the lock comes free (the kernel releases it)
    arriving.join(10)
    closing.join(10)
    assert not arriving.is_alive() and not closing.is_alive()
    assert len(outcome) == 1 and isinstance(outcome[0], AdmissionError), outcome
    assert "closed" in str(outcome[0])
    assert _counts(segment_name) == (0, 0)
    # the one slot is free for the next process
    other = agents("--segment", segment_name, "--config", str(config), "hold", "--timeout", "5")
    other.expect("admitted")


def test_r_a14_close_waits_for_running_bodies_then_cuts_with_one_warning(
    lock_kind: str,
    segment_name: str,
    config: Path,
    agents: Callable[..., Agent],
    caplog: pytest.LogCaptureFixture,
) -> None:
    """close() keeps running slots counted until their bodies end (here 2 s more): no
    other process is admitted while they run."""
    adm = Admission.attach(config=config, segment=segment_name, generation="closing")
    body_ends = threading.Event()
    body_end: list[float] = []

    def body() -> None:
        with adm.slot_blocking("p1"):
            body_ends.wait(10)
            body_end.append(time.time())

    runner = threading.Thread(target=body)
    runner.start()
    assert wait_until(lambda: _counts(segment_name) == (1, 0))
    other = agents("--segment", segment_name, "--config", str(config), "hold", "--timeout", "20")
    other.expect("started")
    threading.Timer(1.0, body_ends.set).start()
    started = time.monotonic()
    adm.close(grace=10.0)
    took = time.monotonic() - started
    admitted = other.expect("admitted", timeout=10)
    assert admitted["t"] >= body_end[0]  # nobody was let in while the body ran
    assert 0.8 <= took < 5.0
    runner.join(5)
    other.send("release")
    other.expect("released")
    # a body that outlives the grace is cut, with one warning naming how many
    adm2 = Admission.attach(config=config, segment=segment_name, generation="closing-2")
    other.finish()
    stuck = threading.Event()
    runner2 = threading.Thread(target=lambda: _hold(adm2, stuck))
    runner2.start()
    assert wait_until(lambda: _counts(segment_name) == (1, 0))
    with caplog.at_level(logging.WARNING, logger="gateway_capacity.admission"):
        started = time.monotonic()
        adm2.close(grace=0.3)
        took = time.monotonic() - started
    assert took < 3.0
    cut = [r for r in caplog.records if "still held after a grace" in r.getMessage()]
    assert len(cut) == 1 and "1 running slot" in cut[0].getMessage()
    assert _counts(segment_name) == (0, 0)
    stuck.set()
    runner2.join(5)


def _hold(adm: Admission, until: threading.Event) -> None:
    with adm.slot_blocking("p1"):
        until.wait(10)


def test_r_a14_close_with_nothing_running_returns_at_once(segment_name: str, config: Path) -> None:
    adm = Admission.attach(config=config, segment=segment_name, generation="quick")
    with adm.slot_blocking("p1"):
        pass
    started = time.monotonic()
    adm.close()
    assert time.monotonic() - started < 1.0  # (bench measures it: <= 10 ms)


def test_r_a14_waiters_are_refused_when_close_begins(segment_name: str, config: Path) -> None:
    adm = Admission.attach(config=config, segment=segment_name, generation="w")
    errors: list[BaseException] = []

    def wait_blocking() -> None:
        try:
            with adm.slot_blocking("p1", timeout=20):
                pass
        except AdmissionError as exc:
            errors.append(exc)

    async def wait_async() -> None:
        try:
            async with adm.slot("p1", timeout=20):
                pass
        except AdmissionError as exc:
            errors.append(exc)

    holder = threading.Event()
    runner = threading.Thread(target=_hold, args=(adm, holder))
    runner.start()
    assert wait_until(lambda: _counts(segment_name) == (1, 0))
    threads = [threading.Thread(target=wait_blocking) for _ in range(2)]
    threads.append(threading.Thread(target=lambda: asyncio.run(wait_async())))
    for t in threads:
        t.start()
    assert wait_until(lambda: _counts(segment_name) == (1, 3))
    threading.Timer(0.5, holder.set).start()
    adm.close(grace=5.0)
    for t in threads:
        t.join(5)
    runner.join(5)
    assert len(errors) == 3 and all("closed" in str(e) for e in errors), errors
    assert _counts(segment_name) == (0, 0)


# --- 2. an event loop closed with waiters (R-A14, R-A12) ----------------------------------
def test_r_a14_waiters_of_a_closed_event_loop_are_freed_within_a_sweep_and_never_granted(
    lock_kind: str, segment_name: str, config: Path, agents: Callable[..., Agent]
) -> None:
    """loop.close() with tasks waiting: their records are freed within a sweep, and no
    grant goes to a dead task (a slot held by nobody)."""
    adm = Admission.attach(config=config, segment=segment_name, generation="loops")
    holder = agents("--segment", segment_name, "--config", str(config), "hold")
    holder.expect("admitted")
    loop = asyncio.new_event_loop()

    async def waiter() -> None:
        async with adm.slot("p1"):
            await asyncio.sleep(3600)

    tasks = []

    async def main() -> None:
        tasks.extend(loop.create_task(waiter()) for _ in range(3))
        await asyncio.sleep(0.3)
        assert _counts(segment_name) == (1, 3)
        raise RuntimeError("the program fails with tasks still waiting")

    with pytest.raises(RuntimeError):
        loop.run_until_complete(main())
    loop.close()  # three waiters of a loop that is gone
    gone = time.monotonic()
    assert wait_until(lambda: _mine(segment_name, os.getpid()) == 0, timeout=5)
    assert time.monotonic() - gone < 2.0  # within one sweep and a margin
    later = agents("--segment", segment_name, "--config", str(config), "hold", "--timeout", "10")
    later.expect("started")
    holder.send("release")
    later.expect("admitted")  # the grant went to a live process, not to a dead task
    adm.close()


STORM = textwrap.dedent(
    """
    import asyncio, json, os, signal, sys, time
    sys.path.insert(0, sys.argv[3])
    from handler_shim import Admission, AdmissionError
    adm = Admission.attach(config=sys.argv[1], segment=sys.argv[2], generation="storm")

    class Storm(Exception):
        pass

    calm = False

    def raise_storm(*_):
        if not calm:
            raise Storm()

    async def one():
        try:
            async with adm.slot("p1", timeout=30):
                await asyncio.sleep(30)
        except AdmissionError:
            pass

    async def main():
        tasks = [asyncio.create_task(one()) for _ in range(34)]
        signal.signal(signal.SIGALRM, raise_storm)
        signal.setitimer(signal.ITIMER_REAL, 0.003, 0.003)
        await asyncio.gather(*tasks)

    try:
        asyncio.run(main())
    except BaseException:
        pass
    # a store runs no signal handler; signal.signal() runs the pending ones first, so
    # without this a tick that is already pending would raise out of the next line
    calm = True
    signal.setitimer(signal.ITIMER_REAL, 0, 0)
    signal.signal(signal.SIGALRM, signal.SIG_IGN)
    print(json.dumps({"event": "survived"}), flush=True)
    for line in sys.stdin:
        break
    started = time.monotonic()
    adm.close()
    print(json.dumps({"event": "closed", "close_s": time.monotonic() - started}), flush=True)
    time.sleep(30)
    """
)


def test_r_a14_a_signal_storm_through_asyncio_teardown_leaks_no_record(
    segment_name: str, config: Path, tmp_path: Path, agents: Callable[..., Agent]
) -> None:
    """A signal handler raising every few ms through asyncio's teardown leaves no record
    behind (left ones would hold slots and fill the queue for good, every other arrival
    getting QueueFull), and close() finishes."""
    script = tmp_path / "storm.py"
    script.write_text(STORM)
    root = str(Path(AGENT).parent.parent)
    proc = Agent.from_command([sys.executable, str(script), str(config), segment_name, root])
    try:
        proc.expect("survived", timeout=30)
        # whatever the storm left, it is gone within a sweep and a margin
        assert wait_until(lambda: _mine(segment_name, proc.pid) == 0, timeout=5)
        proc.send("close")
        assert proc.expect("closed", timeout=10)["close_s"] < 3.0
        # the provider works for everyone else
        other = agents("--segment", segment_name, "--config", str(config), "hold", "--timeout", "5")
        other.expect("admitted")
    finally:
        proc.kill()


def test_r_a12_a_signal_storm_lets_no_foreign_exception_out_of_slot_blocking(
    segment_name: str, config: Path
) -> None:
    """Python's own 'RuntimeError: release unlocked lock' (a threading.Event interrupted
    inside its Condition) never escapes slot_blocking during a storm of signals."""
    import signal

    adm = Admission.attach(config=config, segment=segment_name, generation="storm")

    class Storm(Exception):
        pass

    calm = [False]

    def raise_storm(*_: object) -> None:
        if not calm[0]:
            raise Storm()

    foreign: list[BaseException] = []
    holder = threading.Event()
    runner = threading.Thread(target=lambda: _cycle(adm, holder))
    runner.start()
    deadline = time.monotonic() + 4.0
    rounds = [0]

    def attempt() -> None:
        try:
            with adm.slot_blocking("p1", timeout=0.05):
                rounds[0] += 1
        except (Storm, AdmissionTimeout):
            pass
        except BaseException as exc:  # anything else is a failure
            foreign.append(exc)

    def storm_loop() -> None:
        # nested three deep, like tests/agent.py's interruptible handler: a Storm that
        # lands at a loop's back edge (where Python runs handlers) is caught one level up
        while time.monotonic() < deadline:
            try:
                while time.monotonic() < deadline:
                    try:
                        while time.monotonic() < deadline:
                            attempt()
                    except Storm:
                        pass
            except Storm:
                pass

    previous = signal.signal(signal.SIGALRM, raise_storm)
    signal.setitimer(signal.ITIMER_REAL, 0.0007, 0.0007)
    try:
        try:
            for _ in range(1000):
                try:
                    storm_loop()
                    break
                except Storm:
                    continue
        finally:
            # A store runs no signal handler, so from here on a tick raises nothing.
            # signal.signal() runs pending handlers before it changes one: called first,
            # it could raise and leave the timer storming the rest of the test run.
            calm[0] = True
            signal.setitimer(signal.ITIMER_REAL, 0, 0)
            signal.signal(signal.SIGALRM, previous)
    except Storm:
        pass  # a tick on a loop's back edge outside every handler: the storm is over now
    finally:
        holder.set()
        runner.join(5)
    assert rounds[0] > 0
    assert foreign == [], foreign[:3]
    assert wait_until(lambda: _mine(segment_name, os.getpid()) == 0, timeout=3)
    adm.close()


def _cycle(adm: Admission, stop: threading.Event) -> None:
    while not stop.is_set():
        with adm.slot_blocking("p1"):
            time.sleep(0.01)


def test_r_a14_running_slots_of_a_closed_event_loop_are_freed_within_a_sweep(
    lock_kind: str, segment_name: str, config: Path, agents: Callable[..., Agent]
) -> None:
    """A process whose only async slots were admitted at once (no waiter) still collects
    a closed loop's tasks within a sweep: a dispatcher that slept until something posted
    it would hold the slot of a task that will never run again for the life of the
    process, and another process would wait on a limit of 1 for good."""
    adm = Admission.attach(config=config, segment=segment_name, generation="loops")
    loop = asyncio.new_event_loop()

    async def body() -> None:
        async with adm.slot("p1"):
            await asyncio.sleep(3600)

    async def main() -> None:
        loop.create_task(body())  # noqa: RUF006 (a kept reference would keep it alive)
        await asyncio.sleep(0.3)
        assert _counts(segment_name) == (1, 0)  # admitted at once: nothing waited
        raise RuntimeError("the program fails with a slot still running")

    with pytest.raises(RuntimeError):
        loop.run_until_complete(main())
    later = agents("--segment", segment_name, "--config", str(config), "hold", "--timeout", "20")
    later.expect("started")
    loop.close()  # the task holding the slot will never run again
    gone = time.monotonic()
    admitted = later.expect("admitted", timeout=15)
    assert admitted["t"] - time.time() + time.monotonic() - gone < 2.0  # a sweep and a margin
    assert _mine(segment_name, os.getpid()) == 0
    later.send("release")
    later.expect("released")
    adm.close()


# --- 3. the segment removed or replaced by hand (R-A15) -----------------------------------
@pytest.mark.parametrize("how", ["rm", "unlink --force"])
def test_r_a15_a_segment_removed_by_hand_never_splits_the_budget(
    lock_kind: str,
    how: str,
    p1_segment: Callable[..., P1Segment],
    caplog: pytest.LogCaptureFixture,
) -> None:
    """After `rm /dev/shm/<segment>` the old and the new handlers do not split the budget
    without a word (4 running on a limit of 2), and close() does not hang."""
    caplog.set_level(logging.ERROR, logger="gateway_capacity.admission")
    seg = p1_segment(2)
    segment_name = seg.name
    adm = seg.attach("old")
    old_bell = adm._current.bell
    stop = threading.Event()
    runner = threading.Thread(target=_hold, args=(adm, stop))
    runner.start()
    assert wait_until(lambda: _counts(segment_name) == (1, 0))
    if how == "rm":  # what `rm /dev/shm/<segment>` does, by its portable name (macOS too)
        posix_ipc.unlink_shared_memory(segment_name)
    else:
        out = run_cli("inspect", "--segment", segment_name, "--unlink", "--force")
        assert out.returncode == 0, out.stderr
    newcomer = seg.handler("hold", "--threads", "2")
    newcomer.expect("admitted")
    newcomer.expect("admitted")  # 2 of 2 on the new segment
    time.sleep(0.6)  # one sweep
    with pytest.raises(AdmissionTimeout), adm.slot_blocking("p1", timeout=0.5):
        pass  # our arrival goes to the new segment, where the budget is spent
    with pytest.raises(AdmissionTimeout), adm.slot_blocking("p1", timeout=0.2):
        pass
    said = [r for r in caplog.records if "removed or replaced" in r.getMessage()]
    assert len(said) == 1, [r.getMessage() for r in caplog.records]
    assert adm._current.bell != old_bell  # a doorbell of the new instance's own
    members = {m.pid for m in read_view(segment_name).members}
    assert os.getpid() in members  # we are registered where the name leads now
    newcomer.send("release")
    newcomer.expect("released")
    newcomer.expect("released")
    with adm.slot_blocking("p1", timeout=5):
        assert _counts(segment_name)[0] == 1
    stop.set()
    runner.join(5)
    started = time.monotonic()
    adm.close()
    assert time.monotonic() - started < 3.0  # bounded, always


MOVER = textwrap.dedent(
    """
    import json, sys, threading
    sys.path.insert(0, sys.argv[3])
    from handler_shim import Admission
    adm = Admission.attach(config=sys.argv[1], segment=sys.argv[2], generation="mover")
    held = adm.acquire_blocking("p1")  # a body that runs on the old segment throughout
    print(json.dumps({"event": "admitted"}), flush=True)
    sys.stdin.readline()  # the test removed the segment by hand
    second = adm.acquire_blocking("p1", timeout=10)  # moves: creates what the name leads to
    print(json.dumps({"event": "moved"}), flush=True)
    sys.stdin.readline()
    adm.release(second)
    adm.release(held)
    adm.close()
    print(json.dumps({"event": "closed"}), flush=True)
    """
)


def test_r_a15_r_a5_the_first_to_arrive_after_a_segment_removed_by_hand_keeps_its_old_slots_alive(
    lock_kind: str, segment_name: str, config: Path, tmp_path: Path
) -> None:
    """Lock-file kind: the handler that recreates the segment must not take over the old
    lock file (stamp it and close its descriptor): closing it would drop every record
    lock its process holds on that file, its member lock in the old segment with them,
    and another process still on the old segment would reap the slot its body runs on
    (and the old and the new segment would share one lock file, lock bytes and all)."""
    script = tmp_path / "mover.py"
    script.write_text(MOVER)
    root = str(Path(AGENT).parent.parent)
    mover = Agent.from_command([sys.executable, str(script), str(config), segment_name, root])
    try:
        mover.expect("admitted")
        old = Admission.attach(config=config, segment=segment_name, generation="old")
        assert old._core.sweep(0.0) == 0
        os.unlink("/dev/shm" + segment_name)  # by hand, as an operator's rm would
        mover.send("go")
        mover.expect("moved")  # its arrival created the new segment and was admitted there
        # a process still on the old segment sweeps it: the mover lives, so does its slot
        assert old._core.sweep(0.0) == 0
        assert old._core.sweep(0.0) == 0
        mover.send("done")
        mover.expect("closed")
        assert old._core.sweep(0.0) == 0  # closed, not dead: it freed its own records
        old.close(grace=0)
    finally:
        mover.kill()


# --- 4. damage (R-A16) ---------------------------------------------------------------------
def test_r_a16_a_bad_write_to_the_counters_is_never_obeyed(
    lock_kind: str,
    segment_name: str,
    write_config: Callable[..., Path],
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A bad write to a provider's counters: running := 0 while 3 of 3 run lets nobody
    more in (not 6 running); running := 0xFFFFFFFF is no permanent AdmissionTimeout;
    garbage in `waiting` does not wedge the provider."""
    caplog.set_level(logging.ERROR, logger="gateway_capacity.admission")
    config = write_config({"providers": [{"id": "p1", "maxConcurrent": 3}]})
    adm = Admission.attach(config=config, segment=segment_name, generation="d")
    base = provider_base(0)
    try:
        held = [adm.acquire_blocking("p1") for _ in range(3)]
        for field, value in (("running", 0), ("running", 0xFFFFFFFF), ("waiting", 32)):
            PROVIDER[field].put(adm._buf, value, base)  # one bad write, by someone else
            with pytest.raises(AdmissionTimeout), adm.slot_blocking("p1", timeout=0.2):
                pass  # never a fourth: the counters were recounted before use
            assert (
                PROVIDER["running"].get(adm._buf, base),
                PROVIDER["waiting"].get(adm._buf, base),
            ) == (3, 0)
        for ticket in held:
            adm.release(ticket)
        with adm.slot_blocking("p1", timeout=1):
            pass  # and nothing is wedged
    finally:
        adm.close()
    view = read_view(segment_name)
    assert view.damage_repairs >= 3 and "written over" in view.damage_note  # counted
    said = [r for r in caplog.records if "damage found and repaired" in r.getMessage()]
    assert len(said) == 1  # and said once
    check = run_cli("availability", "--segment", segment_name, "--check")
    assert check.returncode == 1 and "damage repaired" in check.stdout


def test_r_a16_a_bad_write_to_an_in_use_word_never_refuses_new_handlers(
    lock_kind: str, segment_name: str, config: Path, agents: Callable[..., Agent]
) -> None:
    """One bad write to a live idle handler's member row (in_use := 2), to a provider
    row's in_use, or to a free record's state does not make new attaches refuse the
    segment as damaged ("remove it") until somebody sweeps it: on a host without a
    sidecar that would be for good (a new generation could not start)."""
    idle = agents("--segment", segment_name, "--config", str(config), "hold")
    idle.expect("admitted")
    idle.send("release")
    idle.expect("released")  # alive, registered, holding nothing: nobody sweeps
    seg = Segment.open(segment_name)
    try:
        m = next(x.index for x in read_view(segment_name).members if x.pid == idle.pid)
        writes = [
            lambda: MEMBER["in_use"].put(seg.buf, 2, member_base(m)),
            lambda: PROVIDER["in_use"].put(seg.buf, 3, provider_base(0)),
            lambda: HOLDER["state"].put(seg.buf, 7, holder_base(0, 77)),
        ]
        for write in writes:
            write()  # one bad write, by someone else
            time.sleep(0.6)  # a sweep's time: nobody sweeps an idle host
            newcomer = agents("--segment", segment_name, "--config", str(config), "hold")
            newcomer.expect("admitted", timeout=10)  # attached, and admitted
            newcomer.send("release")
            newcomer.expect("released")
            assert newcomer.finish() == 0
        # and the segment is as a writer of ours would leave it (nothing left to refuse)
        assert MEMBER["in_use"].get(seg.buf, member_base(m)) == 1
        assert PROVIDER["in_use"].get(seg.buf, provider_base(0)) == 1
        assert HOLDER["state"].get(seg.buf, holder_base(0, 77)) == 0
        assert read_view(segment_name).damage_repairs >= 3
    finally:
        seg.close()
    idle.send("release")
    assert idle.finish() == 0


def test_r_a16_a_published_limit_with_a_deadline_too_far_ahead_is_never_obeyed(
    lock_kind: str, segment_name: str, config: Path
) -> None:
    """A published limit of 96 with a deadline an hour ahead (no publication sets one
    more than DEADLINE_SLACK_S ahead) is out of range: the fallback (1) applies, the
    sweep clears it as damage, and both check views fail naming it and the recovery."""
    adm = Admission.attach(config=config, segment=segment_name, generation="d")
    base = provider_base(0)
    try:
        held = adm.acquire_blocking("p1")
        PROVIDER["expires_mono"].put(adm._buf, platform.deadline_now() + 3600.0, base)
        PROVIDER["published_limit"].put(adm._buf, 96, base)  # one bad write
        with pytest.raises(AdmissionTimeout), adm.slot_blocking("p1", timeout=0.6):
            pass  # never a second on a fallback of 1
        adm._core.sweep(0.0)
        assert PROVIDER["published_limit"].get(adm._buf, base) == -1
        adm.release(held)
    finally:
        adm.close()
    for command in ("inspect", "availability"):
        check = run_cli(command, "--segment", segment_name, "--check")
        assert check.returncode == 1, (command, check.stdout)
        assert "deadline lies too far ahead" in check.stdout, (command, check.stdout)
        assert "--unlink --force" in check.stdout, (command, check.stdout)


def test_r_a16_random_bytes_over_the_admission_area_raise_only_the_products_errors(
    lock_kind: str,
    segment_name: str,
    write_config: Callable[..., Path],
    agents: Callable[..., Agent],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Accidental damage (R-A16): random bytes written again and again over the provider,
    record and member tables while handlers cycle slots and another process holds one,
    until a sweep has found damage. Every call ends (a bounded wait: nothing hangs), only
    GatewayCapacityError comes out of the product, close() returns, and both check views
    then fail naming damage and the recovery."""
    from handler_shim import GatewayCapacityError

    config = write_config({"providers": [{"id": "p1", "maxConcurrent": 2}]})
    holder = agents("--segment", segment_name, "--config", str(config), "hold")
    holder.expect("admitted")
    adm = Admission.attach(config=config, segment=segment_name, generation="d")
    seg = Segment.open(segment_name)
    stop = threading.Event()
    foreign: list[BaseException | None] = []
    ours = [0]
    # the product's own threads (the dispatcher) must not die of it either
    monkeypatch.setattr(threading, "excepthook", lambda args: foreign.append(args.exc_value))

    def cycle() -> None:
        while not stop.is_set():
            try:
                with adm.slot_blocking("p1", timeout=0.2):
                    time.sleep(0.005)
            except GatewayCapacityError:
                ours[0] += 1
            except BaseException as exc:  # anything else escaped the product
                foreign.append(exc)
                return

    def scribble() -> None:
        rng = random.Random(28)
        start, end = layout.PROVIDERS_BASE, layout.TOTAL_SIZE
        while not stop.is_set():
            at = rng.randrange(start, end - 16)
            n = rng.randint(1, 16)
            seg.buf[at : at + n] = rng.randbytes(n)
            time.sleep(0.002)

    workers = [threading.Thread(target=cycle, daemon=True) for _ in range(3)]
    scribbler = threading.Thread(target=scribble, daemon=True)
    try:
        for t in [*workers, scribbler]:
            t.start()
        # Scribble until a sweep has found damage (and at least a second): under load
        # the threads may get few turns in any fixed time.
        start = time.monotonic()
        while time.monotonic() < start + 1.0 or not layout.HEADER["damage_repairs"].get(seg.buf):
            assert time.monotonic() < start + 60.0, "no sweep found the damage in 60 s"
            time.sleep(0.05)
        stop.set()
        for t in [*workers, scribbler]:
            t.join(20)  # each slot wait is bounded by its timeout plus one section
        assert not any(t.is_alive() for t in workers), "a slot call never returned"
        assert foreign == [], foreign
        closer = threading.Thread(target=lambda: adm.close(grace=1.0), daemon=True)
        closer.start()
        closer.join(20)
        assert not closer.is_alive(), "close() never returned"
    finally:
        stop.set()
        seg.close()
    for command in ("inspect", "availability"):
        check = run_cli(command, "--segment", segment_name, "--check")
        assert check.returncode != 0, (command, check.stdout)
        said = (check.stdout + check.stderr).lower()
        assert "damage" in said and "--unlink --force" in said, (command, said)


def test_r_a16_a_bad_write_to_a_live_members_serial_frees_none_of_its_slots(
    lock_kind: str, segment_name: str, config: Path, agents: Callable[..., Agent]
) -> None:
    """Adding 1 to a live member's serial does not let the sweep reclaim its slots while
    they run (6 running on a limit of 3)."""
    holder = agents("--segment", segment_name, "--config", str(config), "hold")
    holder.expect("admitted")
    adm = Admission.attach(config=config, segment=segment_name, generation="sweeper")
    m = next(x.index for x in read_view(segment_name).members if x.pid == holder.pid)
    serial = MEMBER["serial"].get(adm._buf, member_base(m))
    MEMBER["serial"].put(adm._buf, serial + 1, member_base(m))
    with pytest.raises(AdmissionTimeout), adm.slot_blocking("p1", timeout=1.5):
        pass  # waits through sweeps: nothing of the holder's is freed
    assert adm._core.sweep(0.0) == 0
    assert _counts(segment_name) == (1, 0)
    holder.send("release")
    holder.expect("released")
    adm.close()


@pytest.mark.linux("damages the robust mutex, which only Linux has")
def test_r_a16_a_damaged_lock_word_is_one_line_never_an_abort(
    segment_name: str, config: Path, agents: Callable[..., Agent]
) -> None:
    """Garbage in the mutex bytes is one line inside the product's error tree: handlers
    neither die of SIGABRT/SIGILL in glibc nor hang nor raise outside the tree; a new
    attach fails naming the lock word, and ``inspect --check`` says how to recover."""
    from handler_shim import GatewayCapacityError

    if not _core.HAVE_ROBUST:
        pytest.skip("the robust mutex is Linux's")
    adm = Admission.attach(config=config, segment=segment_name, generation="d")
    adm._buf[layout.MUTEX_OFFSET : layout.MUTEX_OFFSET + 40] = bytes(range(7, 47))
    with pytest.raises(GatewayCapacityError) as info, adm.slot_blocking("p1", timeout=1):
        pass
    assert "lock word is damaged" in str(info.value) and "--unlink --force" in str(info.value)
    assert isinstance(info.value, _core.DamagedLock)
    # a new attach refuses it by name; the check views say so with the recovery
    other = agents("--segment", segment_name, "--config", str(config), "hold")
    assert other.finish() != 0
    assert "lock word" in other.proc.stderr.read() if other.proc.stderr else True
    check = run_cli("inspect", "--segment", segment_name, "--check")
    assert check.returncode == 1 and "lock word" in check.stdout and "--unlink" in check.stdout
    adm.close(grace=0)


# --- 5. a stepped wall clock (R-L7) -----------------------------------------------------------
def _faketime() -> str:
    exe = shutil.which("faketime")
    if exe is None:
        pytest.skip("faketime is not installed (scripts/ensure-tools installs it)")
    return exe


@pytest.mark.parametrize("step", ["-1h", "+1h"])
def test_r_l7_a_stepped_wall_clock_neither_extends_nor_cuts_a_published_limit(
    step: str, segment_name: str, write_config: Callable[..., Path]
) -> None:
    """With its clock 1 h back a handler does not keep an expired limit of 1 for an hour;
    1 h forward, it does not ignore a fresh publication. The handler here runs under
    faketime (its wall clock stepped; the monotonic clock is the host's)."""
    faketime = _faketime()
    config = write_config({"providers": [{"id": "p1", "maxConcurrent": 3}]})
    seg_owner = Admission.attach(config=config, segment=segment_name, generation="publisher")
    seg = seg_owner._seg
    epoch = writer.take_epoch(seg, os.getpid(), 0.0, time.time(), 1.0, "test")
    deadline = platform.deadline_now() + 3.0  # a limit of 1 for 3 s, judged by the sidecar
    writer.publish(
        seg,
        epoch,
        1,
        "ok",
        [
            writer.Publication(
                "p1",
                True,
                3,
                "provider",
                limit=1,
                reason="published by the test",
                observed_at=time.time() - 27.0,
                expires_at=time.time() + 3.0,
                expires_mono=deadline,
            )
        ],
        time.time(),
    )
    env = dict(os.environ, FAKETIME_DONT_FAKE_MONOTONIC="1")
    command = [
        faketime,
        "-f",
        step,
        sys.executable,
        str(AGENT),
        "--segment",
        segment_name,
        "--config",
        str(config),
        "hold",
        "--threads",
        "3",
    ]
    handler = Agent([], env=env, command=command)
    try:
        handler.expect("admitted", timeout=10)  # one, under the published limit
        with pytest.raises(AssertionError):
            handler.expect("admitted", timeout=1.0)
        assert platform.deadline_now() < deadline
        # after the deadline (and a sweep), the fallback of 3: not an hour later
        handler.expect("admitted", timeout=5)
        handler.expect("admitted", timeout=5)
    finally:
        kill_under_faketime(handler.proc)
        seg_owner.close()


@pytest.fixture(autouse=True)
def _no_leftover(segment_name: str) -> Iterator[None]:
    yield
    unlink_segment(segment_name)


def test_r_a4_a_wait_for_a_busy_lock_counts_against_the_timeout(
    lock_kind: str, segment_name: str, config: Path, agents: Callable[..., Agent]
) -> None:
    """The wait for a stopped lock holder and the wait for the grant share one timeout:
    a blocking slot never takes twice its timeout."""
    holder = agents("--segment", segment_name, "--config", str(config), "hold")
    holder.expect("admitted")  # the limit of 1 is spent: whoever comes next must wait
    adm = Admission.attach(config=config, segment=segment_name, generation="t")
    locker = agents("--segment", segment_name, "--config", str(config), "lock")
    locker.expect("locked")
    threading.Timer(0.6, locker.kill).start()  # the lock comes free after 0.6 s
    started = time.monotonic()
    with pytest.raises(AdmissionTimeout), adm.slot_blocking("p1", timeout=1.0):
        pass
    took = time.monotonic() - started
    assert 0.9 <= took < 1.5, took  # one timeout, not 0.6 s of lock plus 1 s of waiting
    adm.close()


def test_r_a14_a_second_close_returns_only_once_the_first_has_finished(
    segment_name: str, config: Path
) -> None:
    adm = Admission.attach(config=config, segment=segment_name, generation="c")
    body_ends = threading.Event()
    runner = threading.Thread(target=_hold, args=(adm, body_ends))
    runner.start()
    assert wait_until(lambda: _counts(segment_name) == (1, 0))
    first = threading.Thread(target=adm.close, kwargs={"grace": 5.0})
    first.start()
    time.sleep(0.2)
    threading.Timer(0.5, body_ends.set).start()
    adm.close()  # returns when the first close() has (the body ended, it unregistered)
    assert not first.is_alive() or first.join(1) is None
    assert _counts(segment_name) == (0, 0) and read_view(segment_name).members == ()
    runner.join(5)
