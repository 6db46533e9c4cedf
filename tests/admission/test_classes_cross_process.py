"""Admission classes across real processes and generations (R-A18..R-A21): a batch flood
from 8 processes of two generations leaves the interactive reserve free, a full queue
displaces batch waiters for interactive ones, and a SIGKILLed holder of a reserved slot
gives it back to its class, never to a lower one."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from gwtest import Agent, run_cli

from shm_layout import layout
from shm_layout.errors import SegmentMissing
from shm_layout.view import read_view

CLASSES = [{"name": "interactive", "reserve": 2}, {"name": "batch"}]


@pytest.fixture
def classed(
    segment_name: str, write_config: Callable[..., Path], agents: Callable[..., Agent]
) -> Callable[..., Agent]:
    """``classed(gen, cls, threads)``: a handler process holding ``threads`` slots of class
    ``cls`` on provider p1 (limit 4, interactive reserving 2, batch the default)."""
    config = write_config({"providers": [{"id": "p1", "maxConcurrent": 4, "classes": CLASSES}]})

    def start(gen: str, cls: str, threads: int) -> Agent:
        agent = agents(
            "--segment",
            segment_name,
            "--config",
            str(config),
            "--gen",
            gen,
            "--cls",
            cls,
            "hold",
            "--threads",
            str(threads),
        )
        return agent

    return start


def _classes(segment: str) -> dict[str, tuple[int, int]]:
    """(running, waiting) by class, as availability reads them; {} before the segment."""
    try:
        p1 = read_view(segment).provider("p1")
    except SegmentMissing:
        return {}
    return {} if p1 is None else {c.name: (c.running, c.waiting) for c in p1.classes}


def _until(check: Callable[[], Any], timeout: float = 10.0) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value or time.monotonic() > deadline:
            return value
        time.sleep(0.02)


def test_r_a18_r_a21_a_batch_flood_from_8_processes_of_two_generations_leaves_the_reserve(
    segment_name: str, classed: Callable[..., Agent]
) -> None:
    batch = [classed(("old", "new")[i % 2], "batch", 4) for i in range(8)]
    # 32 places for 30 more batch requests: every one queued, none refused
    assert _until(lambda: _classes(segment_name).get("batch") == (2, 30)), _classes(segment_name)
    interactive = classed("new", "interactive", 2)
    interactive.expect("admitted", timeout=5.0)
    interactive.expect("admitted", timeout=5.0)  # at once, beside a queue of 30
    assert _classes(segment_name) == {"interactive": (2, 0), "batch": (2, 30)}
    # two more interactive requests fill the queue; two after them displace the two
    # newest batch waiters
    classed("old", "interactive", 4)
    refused: list[dict[str, Any]] = []
    assert _until(lambda: len(refused.__iadd__([e for a in batch for e in _drain(a)])) >= 2), (
        _classes(segment_name),
        [a.seen[-3:] for a in batch],
    )
    assert [e["event"] for e in refused] == ["queue_full"] * 2  # told QueueFull (R-A20)
    assert _classes(segment_name) == {"interactive": (2, 4), "batch": (2, 28)}
    p1 = read_view(segment_name).provider("p1")
    assert p1 is not None and p1.displaced_total == 2 and p1.waiting == layout.QUEUE_BOUND


def _drain(agent: Agent) -> list[dict[str, Any]]:
    """The refusals and timeouts that have arrived so far (never waits)."""
    found = []
    while not agent.events.empty():
        ev = agent.events.get_nowait()
        agent.seen.append(ev)
        if ev["event"] in ("queue_full", "timeout"):
            found.append(ev)
    return found


def test_r_a5_r_a18_a_sigkilled_holder_of_a_reserved_slot_gives_it_to_its_class(
    segment_name: str, classed: Callable[..., Agent]
) -> None:
    classed("old", "batch", 4)
    assert _until(lambda: _classes(segment_name).get("batch") == (2, 2))
    holder = classed("new", "interactive", 2)
    assert _until(lambda: _classes(segment_name).get("interactive") == (2, 0))
    waiter = classed("new", "interactive", 1)
    assert _until(lambda: _classes(segment_name) == {"interactive": (2, 1), "batch": (2, 2)})
    os.kill(holder.pid, signal.SIGKILL)
    holder.proc.wait(timeout=10)
    waiter.expect("admitted", timeout=5.0)  # reclaimed within the sweep (R-A5)
    time.sleep(0.6)  # another sweep: the freed reserved slot stays the interactive class's
    assert _classes(segment_name) == {"interactive": (1, 0), "batch": (2, 2)}


def test_r_a22_wait_for_slot_computes_room_as_the_class_sees_it(
    segment_name: str, classed: Callable[..., Agent]
) -> None:
    classed("old", "batch", 2)
    assert _until(lambda: _classes(segment_name).get("batch") == (2, 0))
    local = ("wait-for-slot", "--segment", segment_name, "--provider", "p1", "--quiet")
    assert run_cli(*local, "--check", "--class", "batch").returncode == 1  # 2 of 4 reserved
    assert run_cli(*local, "--check", "--class", "interactive", "--need", "2").returncode == 0
    assert run_cli(*local, "--check").returncode == 0  # the provider as a whole has room
    unknown = run_cli(*local, "--check", "--class", "bulk")
    assert unknown.returncode == 2 and "no admission class 'bulk'" in unknown.stderr


def test_r_a22_a_longer_name_is_no_class_of_16_bytes_and_is_said_once(
    segment_name: str, write_config: Callable[..., Path], agents: Callable[..., Agent]
) -> None:
    """A class name is matched whole: 'Interactive.v2_0-premium' is not the 16-byte class
    'Interactive.v2_0' cut short, so its requests count in the default class (batch: 2
    of 4 beside interactive's reserve of 2), and the handler says so once."""
    classes = [{"name": "Interactive.v2_0", "reserve": 2}, {"name": "batch"}]
    config = write_config({"providers": [{"id": "p1", "maxConcurrent": 4, "classes": classes}]})
    longer = agents(
        "--segment", segment_name, "--config", str(config),
        "--cls", "Interactive.v2_0-premium", "hold", "--threads", "3",
    )  # fmt: skip
    longer.expect("admitted")
    longer.expect("admitted")
    time.sleep(1.0)  # the third may not run: batch is at L - R
    assert not longer.has_seen("timeout")
    assert _classes(segment_name) == {"Interactive.v2_0": (0, 0), "batch": (2, 1)}
    assert [e["event"] for e in longer.seen].count("admitted") == 2
    assert longer.finish() == 0
    assert longer.proc.stderr is not None
    said = [line for line in longer.proc.stderr.read().splitlines() if "no admission class" in line]
    assert len(said) == 1 and "'Interactive.v2_0-premium'" in said[0], said
