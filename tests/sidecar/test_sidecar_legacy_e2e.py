"""Upgrade from a handler generation that cannot share counters (R-G3)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
from sidecar_e2e import STATIC, Rig, cli_json, cli_providers, discovered


@pytest.mark.parametrize("how", ["pid", "pidfile"])
def test_r_g3_legacy_drain_holds_new_work_until_the_legacy_process_exits(
    how: str, legacy: subprocess.Popen[bytes], rig: Rig, tmp_path: Path
) -> None:
    target = str(legacy.pid)
    if how == "pidfile":
        pidfile = tmp_path / "legacy-handler.pid"
        pidfile.write_text(f"{legacy.pid}\n")
        target = str(pidfile)
    rig.start(rig.config(STATIC), "--await-legacy", target)

    p = rig.wait("p1", lambda p: p["source"] == "legacy_drain", what="legacy_drain")
    assert p["effective_limit"] == 0 and "legacy" in p["reason"]
    doc = cli_json("availability", "--segment", rig.segment)
    assert doc["sidecar"]["legacy_alive"] == 1
    shown = {p["id"]: p for p in doc["providers"]}
    assert (shown["static"]["effective_limit"], shown["static"]["source"]) == (3, "provider")

    # a new handler on the opted-in provider queues; the static provider is unaffected
    waiter = rig.handler("hold")
    waiter.expect("started")
    other = rig.handler("hold", provider="static")
    other.expect("admitted")
    rig.wait("p1", lambda p: (p["running"], p["waiting"]) == (0, 1))
    p = rig.wait("p1", lambda p: p["discovered"] == 20, what="discovered")
    assert p["source"] == "legacy_drain" and p["effective_limit"] == 0  # still draining

    legacy.kill()
    legacy.wait()
    # the discovered budget applies at once: the housekeeping tick notices within 0.5 s
    rig.wait("p1", discovered(20), timeout=5, what="drain over")
    waiter.expect("admitted", timeout=5)
    shown = cli_providers(rig.segment)
    assert (shown["p1"]["running"], shown["p1"]["waiting"]) == (1, 0)
    assert shown["static"]["effective_limit"] == 3
    assert rig.sidecar_doc()["legacy_alive"] == 0
