"""The segment lock: free at once when its holder dies, never taken from a live one (R-A6).

Each test runs on Linux's path (robust mutex) and on the forced macOS path (lock file,
no semaphore timeouts): ``lock_kind``.
"""

from __future__ import annotations

import json
import os
import re
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path

from gwtest import P1Segment, run_cli

from shm_layout.layout import HEADER

MakeP1Segment = Callable[..., P1Segment]


def test_r_a6_lock_of_a_sigkilled_holder_is_free_at_once(
    lock_kind: str, p1_segment: MakeP1Segment
) -> None:
    seg = p1_segment()
    adm = seg.attach("contender")
    holder = seg.locker()
    entered = threading.Event()
    entered_at: list[float] = []

    def contend() -> None:
        with adm.slot_blocking("p1"):
            entered_at.append(time.monotonic())
            entered.set()

    contender = threading.Thread(target=contend)
    contender.start()
    try:
        assert not entered.wait(0.5)  # the holder has it
        killed = time.monotonic()
        holder.kill()
        assert entered.wait(10)
        recovered = entered_at[0] - killed
        assert recovered < 1.0, f"took {recovered:.2f}s"  # "free again at once" (R-A6)
        assert HEADER["repairs"].get(adm._buf) == 1  # died inside a section: repaired
    finally:
        contender.join(timeout=10)
        adm.close()


def test_r_a6_a_live_holder_is_never_robbed_however_long_it_is_stopped(
    lock_kind: str, p1_segment: MakeP1Segment
) -> None:
    """A holder SIGSTOPped inside the lock keeps it however long it is stopped (the lock
    has no timeout: 7 s here); readers still read; once it is really gone, the
    contender gets in."""
    seg = p1_segment()
    adm = seg.attach("contender")
    holder = seg.locker()
    os.kill(holder.pid, signal.SIGSTOP)
    got = threading.Event()

    def contend() -> None:
        with adm.slot_blocking("p1"):
            got.set()

    contender = threading.Thread(target=contend)
    contender.start()
    try:
        assert not got.wait(7.0)  # well past 5 s: still the stopped holder's
        doc = json.loads(run_cli("availability", "--segment", seg.name, "--json").stdout)
        assert doc["providers"][0]["id"] == "p1"  # lock-free readers are not stuck
        assert HEADER["repairs"].get(adm._buf) == 0
    finally:
        holder.kill()
        contender.join(timeout=10)
        adm.close()
    assert got.is_set()


def test_r_a6_counters_are_repaired_from_holder_records(
    lock_kind: str, p1_segment: MakeP1Segment
) -> None:
    seg = p1_segment(4)
    holder = seg.handler("hold", "--threads", "2")
    holder.expect("admitted")
    holder.expect("admitted")
    scribbler = seg.locker("scribble")  # running=999
    scribbler.kill()
    late = seg.handler("hold")
    late.expect("admitted", timeout=10)
    doc = json.loads(run_cli("inspect", "--segment", seg.name, "--json").stdout)
    p1 = doc["providers"][0]
    assert p1["stored_running"] == 3 == p1["running"]
    assert p1["stored_waiting"] == 0 == p1["waiting"]
    assert doc["header"]["lock_repairs"] == 1


GIL_HOG = r"""
import re, sys, threading, time
sys.path.insert(0, {tests!r})
from handler_shim import Admission
adm = Admission.attach(config={cfg!r}, segment={seg!r}, generation="hog")
stop = time.monotonic() + {seconds}
count = 0
def loop():
    global count
    while time.monotonic() < stop:
        with adm.slot_blocking("p1"):
            count += 1
t = threading.Thread(target=loop)
t.start()
time.sleep(0.2)
print("hogging", flush=True)
# one C call that holds the GIL for seconds: catastrophic backtracking
re.fullmatch(r"(a+)+$", "a" * {n} + "b")
print("done", flush=True)
t.join()
print("count", count, flush=True)
adm.close()
"""


def test_r_a11_a_gil_hog_in_a_holders_process_never_breaks_mutual_exclusion(
    lock_kind: str, p1_segment: MakeP1Segment, tmp_path: Path
) -> None:
    """Thread A loops on slot_blocking while thread B of the same process holds the GIL
    for seconds in one C call. The locked section runs in C without the GIL, so A never
    waits for the GIL while it holds the lock: the contender keeps entering, nothing is
    repaired, and no slot is ever above the limit."""
    import subprocess
    import sys

    # limit 2: the hog's own thread may be frozen holding one slot (a paused holder keeps
    # its slot); the other must keep flowing, which only a free lock allows
    seg = p1_segment(2)
    segment_name, cfg = seg.name, seg.config
    # calibrate the regex to hold the GIL for about 6 s on this machine
    n = 20
    while True:
        t0 = time.perf_counter()
        re.fullmatch(r"(a+)+$", "a" * n + "b")
        if time.perf_counter() - t0 > 0.1:
            break
        n += 1
    per = time.perf_counter() - t0
    while per < 6.0:
        n += 1
        per *= 2
    code = GIL_HOG.format(
        tests=str(Path(__file__).parent.parent.parent),
        cfg=str(cfg),
        seg=segment_name,
        seconds=1.0,
        n=n,
    )
    hog = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    adm = seg.attach("contender")
    try:
        assert hog.stdout is not None
        assert hog.stdout.readline().strip() == "hogging"
        entries = 0
        deadline = time.monotonic() + 4.0  # inside the hog's 6 s of holding the GIL
        while time.monotonic() < deadline:
            with adm.slot_blocking("p1", timeout=10.0):
                entries += 1
        # the hog's process never held the lock while its threads waited for the GIL
        assert entries > 100
        out, _ = hog.communicate(timeout=60)
        assert hog.returncode == 0, out
        assert HEADER["repairs"].get(adm._buf) == 0
        doc = json.loads(run_cli("inspect", "--segment", segment_name, "--json").stdout)
        p1 = doc["providers"][0]
        assert p1["counters"]["peak_running"] <= 2
        assert p1["stored_running"] == p1["running"] == 0
    finally:
        if hog.poll() is None:
            hog.kill()
        adm.close()
