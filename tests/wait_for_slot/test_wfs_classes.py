"""wait-for-slot's local mode on a provider with admission classes, against a real
segment held by a real handler process: it judges a request as admission will place it."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from gwtest import Agent, run_cli

from shm_layout.errors import SegmentMissing
from shm_layout.view import read_view

CLASSES = [{"name": "interactive", "reserve": 2}, {"name": "batch", "cap": 3}]


def _batch_running(segment: str) -> int:
    try:
        p1 = read_view(segment).provider("p1")
    except SegmentMissing:
        return -1
    return -1 if p1 is None else next(c.running for c in p1.classes if c.name == "batch")


def _until(check: Callable[[], Any], timeout: float = 10.0) -> Any:
    deadline = time.monotonic() + timeout
    while not (value := check()) and time.monotonic() < deadline:
        time.sleep(0.02)
    return value


def test_r_a22_without_class_it_gates_as_the_default_class_and_a_need_over_a_cap_is_refused(
    segment_name: str, write_config: Callable[..., Path], agents: Callable[..., Agent]
) -> None:
    config = write_config({"providers": [{"id": "p1", "maxConcurrent": 8, "classes": CLASSES}]})
    holder = agents(
        "--segment", segment_name, "--config", str(config), "--gen", "g", "--cls", "batch",
        "hold", "--threads", "3",
    )  # fmt: skip
    assert _until(lambda: _batch_running(segment_name) == 3)
    local = ("wait-for-slot", "--segment", segment_name, "--provider", "p1")
    # 3 of 8 run: the provider has room, but batch (the default class) is at its cap 3
    plain = run_cli(*local, "--check")
    assert plain.returncode == 1, plain.stdout + plain.stderr
    assert "limit 3" in plain.stderr, plain.stderr
    assert run_cli(*local, "--check", "--class", "interactive").returncode == 0
    started = time.monotonic()
    never = run_cli(*local, "--class", "batch", "--need", "4", "--max-wait", "60")
    assert never.returncode == 2, never.stdout + never.stderr  # at once, not after 60 s
    assert time.monotonic() - started < 30
    assert "--need 4 can never fit: class batch of provider p1 runs at most 3" in never.stderr
    default = run_cli(*local, "--need", "4", "--max-wait", "60")
    assert default.returncode == 2 and "class batch" in default.stderr
    holder.kill()
