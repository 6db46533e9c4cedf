"""Liveness is the kernel's word, never a pid (R-A5): paused and namespaced holders are
alive, dead ones are reclaimed within 2 s, with or without a sidecar."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from gwtest import ROOT, Agent, wait_until

from handler_shim import Admission, AdmissionTimeout
from shm_layout.view import read_view


def _running(segment: str) -> tuple[int, int]:
    """(running counted from live records, the stored counter)."""
    p1 = read_view(segment).provider("p1")
    assert p1 is not None
    return p1.running, p1.stored_running


def _cfg(write_config: Callable[..., Path], limit: int) -> Path:
    return write_config({"providers": [{"id": "p1", "maxConcurrent": limit}]})


def test_r_a5_a_holder_paused_longer_than_any_timeout_is_alive(
    lock_kind: str,
    segment_name: str,
    write_config: Callable[..., Path],
    agents: Callable[..., Agent],
) -> None:
    """SIGSTOP a holder for 8 s (longer than the sweep, the reclaim deadline and layout 1's
    5 s bound) while a process of the root namespace waits and sweeps: its slot stays
    its own. Killed, it is reclaimed within 2 s."""
    cfg = _cfg(write_config, 1)
    holder = agents("--segment", segment_name, "--config", str(cfg), "hold")
    holder.expect("admitted")
    os.kill(holder.pid, signal.SIGSTOP)
    adm = Admission.attach(config=cfg, segment=segment_name, generation="waiter")
    try:
        with pytest.raises(AdmissionTimeout), adm.slot_blocking("p1", timeout=8.0):
            pass  # never admitted: the paused holder is alive
        assert _running(segment_name) == (1, 1)
        holder.kill()
        killed = time.monotonic()
        with adm.slot_blocking("p1", timeout=10.0):
            reclaimed = time.monotonic() - killed
        assert reclaimed < 2.0, f"took {reclaimed:.2f}s"
    finally:
        adm.close()


UNSHARE = shutil.which("unshare")


@pytest.mark.skipif(UNSHARE is None, reason="unshare(1) is not installed")
@pytest.mark.skipif(os.geteuid() != 0, reason="a new PID namespace needs root here")
def test_r_a5_holders_in_another_pid_namespace_are_alive(
    lock_kind: str,
    segment_name: str,
    write_config: Callable[..., Path],
    tmp_path: Path,
) -> None:
    """A holder under ``unshare -p --fork --mount-proc`` takes 3 of 3 slots: a process of
    the root namespace must not reclaim them as dead (its pid means nothing there), or 6
    run against 3. Containers that share the host's /dev/shm are a real deployment."""
    assert UNSHARE is not None
    cfg = _cfg(write_config, 3)
    cmd = [
        UNSHARE,
        "-p",
        "--fork",
        "--mount-proc",
        sys.executable,
        str(ROOT / "tests" / "agent.py"),
    ]
    cmd += ["--segment", segment_name, "--config", str(cfg), "hold", "--threads", "3"]
    probe = subprocess.run([UNSHARE, "-p", "--fork", "--mount-proc", "true"], capture_output=True)
    if probe.returncode != 0:
        pytest.skip(f"cannot make a PID namespace here: {probe.stderr.decode().strip()}")
    inside = Agent.from_command(cmd)
    try:
        for _ in range(3):
            event = inside.expect("admitted")
        assert event["pid"] < 10  # it really runs in its own namespace
        adm = Admission.attach(config=cfg, segment=segment_name, generation="root-ns")
        try:
            with pytest.raises(AdmissionTimeout), adm.slot_blocking("p1", timeout=3.0):
                pass  # 3 of 3 are held by a live process: nothing to reclaim
            assert _running(segment_name) == (3, 3)
            inside.send("release")
            assert wait_until(lambda: _running(segment_name) == (0, 0))
            with adm.slot_blocking("p1", timeout=5.0):
                pass
        finally:
            adm.close()
    finally:
        inside.kill()
