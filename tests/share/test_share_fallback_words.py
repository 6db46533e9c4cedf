"""Share mode's fallback is its own rule, 0 whenever no share is in force (docs/share.md):
check-config and availability both say so, not a maxConcurrent the sidecar never uses."""

from __future__ import annotations

import subprocess
from pathlib import Path

from farm import Farm
from redis_rig import RedisServer
from share_rig import EXE, Gateway, wait_for


def test_share_mode_fallback_is_0_share_mode_in_check_config_and_availability(
    tmp_path: Path, farm: Farm, redis_server: RedisServer, key_file: Path
) -> None:
    redis_server.fresh()
    gw = Gateway("gw-a", tmp_path, farm, redis_server, key_file)  # maxConcurrent 4 on top
    try:
        checked = subprocess.run(
            [EXE, "check-config", "--config", str(gw.config)],
            capture_output=True,
            text=True,
            timeout=60,
        )
        head = next(x for x in checked.stdout.splitlines() if x.startswith("p1: "))
        assert head == "p1: discovery would be ACTIVE; fallback 0 share mode", checked.stdout
        gw.start_sidecar()
        wait_for("a share", lambda: gw.source() == "share")
        shown = gw._cli("availability", timeout=30)
        row = next(x for x in shown.stdout.splitlines() if x.startswith("p1 [discovery]"))
        assert row.endswith("fallback 0 (share mode)"), shown.stdout
    finally:
        gw.cleanup()


def test_a_fresh_share_table_says_it_is_being_rebuilt_and_for_how_long(
    tmp_path: Path, farm: Farm, redis_server: RedisServer, key_file: Path
) -> None:
    """A new table holds every gateway to what it runs for a lease and a half (docs/share.md):
    the reason says so, with the time left, instead of a bare ``share 0 of N``."""
    redis_server.fresh()
    gw = Gateway("gw-a", tmp_path, farm, redis_server, key_file)

    def reason() -> str:
        p = gw.provider()
        return "" if p is None else str(p["reason"])

    try:
        gw.start_sidecar()
        wait_for("the rebuild said", lambda: "the table is being rebuilt" in reason())
        said = reason()
        assert said.startswith("share 0 of ") and " s more: until then" in said, said
        wait_for("the rebuild over", lambda: gw.limit() > 0 and "rebuilt" not in reason())
    finally:
        gw.cleanup()
