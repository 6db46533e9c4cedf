"""A provider row is never admissible before its classes are in it (R-A18, R-A21): the
writer that claims a row (a handler creating the segment, the sidecar's publication)
writes its class table in the same locked step. Real processes; the window made certain:
the writer stops itself (SIGSTOP, tests/stop_at_claim.py) the moment its row exists, and
another handler admits batch requests there meanwhile."""

from __future__ import annotations

import os
import signal
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from gwtest import ROOT, Agent, stopped_at_exit, wait_until

from shm_layout.errors import SegmentMissing
from shm_layout.view import read_view

STOP_AT_CLAIM = str(ROOT / "tests" / "stop_at_claim.py")
# L = 4, interactive reserves 2: batch (the default) may run 2
CLASSES = [{"name": "interactive", "reserve": 2}, {"name": "batch"}]


def _stopped(pid: int) -> bool:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0] == "T"


@pytest.fixture
def config(write_config: Callable[..., Path]) -> Path:
    return write_config({"providers": [{"id": "p1", "maxConcurrent": 4, "classes": CLASSES}]})


@pytest.fixture
def frozen() -> Iterator[Callable[[Agent], Agent]]:
    """Resume a process stopped at its claim and kill it afterwards, however the test ends."""

    def stop(agent: Agent) -> None:
        os.kill(agent.pid, signal.SIGCONT)
        agent.kill()

    with stopped_at_exit(stop) as keep:
        yield keep


def _batch_admitted(segment: str, config: Path, agents: Callable[..., Agent]) -> int:
    """A second handler asks for 4 batch slots on the row as it stands: how many it got."""
    batch = agents(
        "--segment", segment, "--config", str(config), "--cls", "batch", "hold", "--threads", "4"
    )
    batch.expect("admitted", timeout=10.0)
    time.sleep(1.0)  # every arrival that may run has run by now
    batch.has_seen("started")  # takes in every event so far
    got = sum(1 for e in batch.seen if e["event"] == "admitted")
    p1 = read_view(segment).provider("p1")
    assert p1 is not None and p1.running == got
    return got


def _wait_stopped(proc: Agent) -> None:
    assert wait_until(lambda: _stopped(proc.pid), timeout=20.0), "never reached its claim"


def test_r_a18_a_handler_that_creates_the_segment_claims_its_row_with_the_classes_in_it(
    segment_name: str, config: Path, agents: Callable[..., Agent], frozen: Callable[..., Agent]
) -> None:
    creator = frozen(
        Agent.from_command(
            [
                sys.executable,
                STOP_AT_CLAIM,
                "agent",
                "--segment",
                segment_name,
                "--config",
                str(config),
                "--cls",
                "interactive",
                "hold",
            ]
        )
    )
    _wait_stopped(creator)
    assert _batch_admitted(segment_name, config, agents) == 2  # L - R, never L


def test_r_a18_the_sidecar_claims_a_row_with_the_classes_in_it(
    segment_name: str, config: Path, agents: Callable[..., Agent], frozen: Callable[..., Agent]
) -> None:
    sidecar = frozen(
        Agent.from_command(
            [
                sys.executable,
                STOP_AT_CLAIM,
                "cli",
                "sidecar",
                "--config",
                str(config),
                "--segment",
                segment_name,
                "--refresh",
                "0.3",
            ]
        )
    )
    _wait_stopped(sidecar)
    try:
        p1 = read_view(segment_name).provider("p1")
    except SegmentMissing:
        p1 = None
    assert p1 is not None, "the sidecar stopped before its row was in the segment"
    assert _batch_admitted(segment_name, config, agents) == 2
