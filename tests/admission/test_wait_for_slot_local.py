"""wait-for-slot local mode gates on this host's segment (R-W4), through the real CLI."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from gwtest import Agent, P1Segment, run_cli, wait_until


def _cli(*args: str) -> subprocess.Popen[str]:
    exe = Path(sys.executable).with_name("gateway-capacity")
    return subprocess.Popen(
        [str(exe), *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


def test_r_w4_local_mode_room_busy_and_wait_then_room(
    p1_segment: Callable[..., P1Segment],
) -> None:
    seg = p1_segment(2)
    first = seg.handler("hold")
    first.expect("admitted")
    local = ("wait-for-slot", "--segment", seg.name, "--provider", "p1", "--quiet")

    room = run_cli(*local, "--check")  # 1 running + 1 needed <= 2
    assert room.returncode == 0, room.stderr
    assert run_cli(*local, "--check", "--need", "2").returncode == 1  # 1 + 2 > 2

    second = seg.handler("hold")
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
    p1_segment: Callable[..., P1Segment],
) -> None:
    seg = p1_segment(1)
    segment_name = seg.name
    holder = seg.handler("hold", "--threads", "3")
    holder.expect("admitted")

    def sample() -> str:
        out = run_cli("wait-for-slot", "--segment", segment_name, "--provider", "p1", "--check")
        assert out.returncode == 1
        return out.stderr

    # the two queued behind the holder count against the room, as R-W4 says
    assert wait_until(lambda: "running 1 + waiting 2 + need 1 = 4 > limit 1" in sample())
    unknown = run_cli("wait-for-slot", "--segment", segment_name, "--provider", "p2", "--check")
    assert unknown.returncode == 2
    assert unknown.stderr.strip() == (
        f"gateway-capacity: provider 'p2' is not in segment {segment_name} (its providers: p1)"
    )
    holder.send("release")


def test_r_w4_a_need_above_what_the_limit_can_ever_reach_exits_2_at_once(
    segment_name: str, write_config: Callable[..., Path], agents: Callable[..., Agent]
) -> None:
    """A static limit of 2 never admits 3 at once: say so now instead of waiting
    --max-wait (600 s by default) for the impossible, as metrics mode does with --limit."""
    cfg = write_config(
        {
            "providers": [
                {"id": "p1", "maxConcurrent": 2},
                # discovery asked: its own maxConcurrent is the ceiling (R-L4)
                {"id": "p2", "maxConcurrent": 5, "capacityDiscovery": True},
            ]
        }
    )
    agents("--segment", segment_name, "--config", str(cfg), "hold").expect("admitted")
    local = ("wait-for-slot", "--segment", segment_name, "--interval", "0.1")
    began = time.monotonic()
    out = run_cli(*local, "--provider", "p1", "--need", "3")
    assert out.returncode == 2, out.stderr
    assert time.monotonic() - began < 10  # at once, not after --max-wait's 600 s
    assert out.stderr.strip() == (
        "gateway-capacity: --need 3 can never fit: provider p1's limit can be at most 2 "
        "(its static limit)"
    )
    capped = run_cli(*local, "--provider", "p2", "--need", "6", "--json")
    assert capped.returncode == 2
    assert "at most 5 (its maxConcurrent caps discovery)" in capped.stdout
    # at the ceiling it is a wait like any other (1 running + 2 > 2: no room)
    assert run_cli(*local, "--provider", "p1", "--need", "2", "--check").returncode == 1
