"""wait-for-slot local mode gates on this host's segment (R-W4), through the real CLI."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from gwtest import Agent, run_cli, wait_until


def _cli(*args: str) -> subprocess.Popen[str]:
    exe = Path(sys.executable).with_name("gateway-capacity")
    return subprocess.Popen(
        [str(exe), *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


def test_r_w4_local_mode_room_busy_and_wait_then_room(
    segment_name: str, write_config: Callable[..., Path], agents: Callable[..., Agent]
) -> None:
    cfg = write_config({"providers": [{"id": "p1", "maxConcurrent": 2}]})
    base = ("--segment", segment_name, "--config", str(cfg))
    first = agents(*base, "hold")
    first.expect("admitted")
    local = ("wait-for-slot", "--segment", segment_name, "--provider", "p1", "--quiet")

    room = run_cli(*local, "--check")  # 1 running + 1 needed <= 2
    assert room.returncode == 0, room.stderr
    assert run_cli(*local, "--check", "--need", "2").returncode == 1  # 1 + 2 > 2

    second = agents(*base, "hold")
    second.expect("admitted")
    assert run_cli(*local, "--check").returncode == 1  # 2 running + 1 > 2

    waiting = _cli(*local, "--interval", "0.2", "--max-wait", "30")
    time.sleep(0.5)
    assert waiting.poll() is None  # still waiting for room
    second.send("release")
    second.expect("released")
    assert waiting.wait(timeout=15) == 0

    gave_up = run_cli(*local, "--interval", "0.1", "--max-wait", "0.3", "--need", "2")
    assert gave_up.returncode == 1


def test_r_w4_local_mode_counts_waiters_and_unknown_provider_exits_2(
    segment_name: str, write_config: Callable[..., Path], agents: Callable[..., Agent]
) -> None:
    cfg = write_config({"providers": [{"id": "p1", "maxConcurrent": 1}]})
    holder = agents("--segment", segment_name, "--config", str(cfg), "hold", "--threads", "3")
    holder.expect("admitted")

    def sample() -> str:
        out = run_cli("wait-for-slot", "--segment", segment_name, "--provider", "p1", "--check")
        assert out.returncode == 1
        return out.stderr

    # the two queued behind the holder count against the room, as R-W4 says
    assert wait_until(lambda: "running 1 + waiting 2 + need 1 = 4 > limit 1" in sample())
    unknown = run_cli("wait-for-slot", "--segment", segment_name, "--provider", "nope", "--check")
    assert unknown.returncode == 2
    assert "nope" in unknown.stderr and "Traceback" not in unknown.stderr
    holder.send("release")
