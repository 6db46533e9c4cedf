"""``gateway-capacity verify`` compares a probe made now with the segment (section 8)."""

from __future__ import annotations

import json
import secrets
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from gwtest import run_cli
from sidecar_e2e import STATIC, Rig


def _li(rig: Rig, upstream_model: str = "workhorse") -> dict[str, Any]:
    """Provider li, opted in against ``rig.capacity``; its alias w names ``upstream_model``."""
    return rig.entry(rig.capacity, "li", models={"w": upstream_model})


def _made_by_a_handler(cfg: Path, segment: str) -> None:
    """The segment as a handler leaves it: created, attached once, closed; no sidecar."""
    subprocess.run(
        [sys.executable, "-c",
         "import sys; from handler_shim import Admission; "
         "Admission.attach(config=sys.argv[1], segment=sys.argv[2]).close()",
         str(cfg), segment],
        check=True, timeout=60,
    )  # fmt: skip


def test_verify_agrees_then_differs_and_never_shows_the_key(rig: Rig, key_file: Path) -> None:
    key, segment_name = rig.key, rig.segment
    key_file.write_text(key + "\r\n")
    cfg = rig.write_config({"maxConcurrent": 4, "providers": [_li(rig), STATIC]})
    sidecar = rig.start(cfg)
    rig.wait("li", lambda p: p["effective_limit"] == 20)
    ok = run_cli("verify", "--config", str(cfg), "--segment", segment_name, "--json")
    assert ok.returncode == 0, ok.stdout + ok.stderr
    doc = json.loads(ok.stdout)
    rows = {r["id"]: r for r in doc["providers"]}
    assert rows["li"]["rules_limit"] == rows["li"]["segment_limit"] == 20
    assert rows["static"]["rules_limit"] == rows["static"]["segment_limit"] == 3
    assert key not in ok.stdout + ok.stderr

    sidecar.signal(signal.SIGTERM)
    assert sidecar.wait(timeout=10) == 0
    rig.capacity.set(models={"workhorse": 10})  # the farm changed; nobody published it
    differs = run_cli("verify", "--config", str(cfg), "--segment", segment_name)
    assert differs.returncode == 1
    assert "DIFFERS li: rules 10 (discovered), segment 20 (discovered)" in differs.stdout
    said = differs.stdout.splitlines()[0]  # first: the sidecar stopped, and when
    assert said.startswith(f"sidecar pid {sidecar.pid} stopped, last heartbeat "), said
    assert "the segment holds what it last published" in said
    assert key not in differs.stdout + differs.stderr
    assert key not in sidecar.log_text()


def test_verify_without_a_segment_exits_3(
    segment_name: str, write_config: Callable[..., Path]
) -> None:
    cfg = write_config({"providers": [{"id": "p"}]})
    out = run_cli("verify", "--config", str(cfg), "--segment", segment_name)
    assert out.returncode == 3 and "Traceback" not in out.stderr


def test_r_l3_a_model_typo_is_a_sidecar_warning_and_verify_exits_1(rig: Rig) -> None:
    key, segment_name = rig.key, rig.segment
    # the router serves "workhorse"; the config asks for "workhors"
    cfg = rig.write_config({"maxConcurrent": 4, "providers": [_li(rig, "workhors")]})
    sidecar = rig.start(cfg)
    doc = rig.wait("li", lambda p: "workhors " in p["reason"], timeout=30)
    assert doc["effective_limit"] == 0 and doc["source"] == "discovered"
    out = run_cli("verify", "--config", str(cfg), "--segment", segment_name)
    assert out.returncode == 1, out.stdout + out.stderr
    assert "MISSING MODEL li" in out.stdout
    assert "the router does not report workhors" in out.stdout
    doc = json.loads(
        run_cli("verify", "--config", str(cfg), "--segment", segment_name, "--json").stdout
    )
    assert doc["ok"] is False and doc["providers"][0]["missing_models"] == ["workhors"]
    check = run_cli("availability", "--segment", segment_name, "--check", "--json")
    assert check.returncode == 1, check.stdout + check.stderr
    (problem,) = json.loads(check.stdout)["problems"]
    assert problem.startswith("provider li: held at limit 0 (discovered): discovered 0, ")
    assert "upstream model workhors missing from 127.0.0.1" in problem
    assert "every request waits, then times out" in problem and "verify" in problem
    sidecar.signal(signal.SIGTERM)
    sidecar.wait(timeout=20)
    log = sidecar.log_text()
    warnings = [line for line in log.splitlines() if " WARNING " in line and "workhors " in line]
    assert warnings, log
    assert "upstream model workhors missing from 127.0.0.1" in warnings[0]
    assert key not in log


@pytest.mark.parametrize("failure", ["router_down", "404"])
def test_verify_that_could_not_compare_exits_2_never_ok(failure: str, rig: Rig) -> None:
    key, segment_name, server = rig.key, rig.segment, rig.capacity
    cfg = rig.write_config({"maxConcurrent": 4, "providers": [_li(rig)]})
    # a segment as a handler leaves it (no sidecar): fallback 4, which is also what the
    # rules give when nothing answers, so a naive comparison would say "ok"
    attach = run_cli("availability", "--segment", segment_name)
    assert attach.returncode == 3
    _made_by_a_handler(cfg, segment_name)
    if failure == "router_down":
        server.stop()
    else:
        server.set(status=404)
    out = run_cli("verify", "--config", str(cfg), "--segment", segment_name)
    assert out.returncode == 2, out.stdout + out.stderr
    assert "NO ANSWER li" in out.stdout and "could not compare" in out.stdout
    assert not out.stdout.startswith("ok")
    assert key not in out.stdout + out.stderr


def test_an_unreachable_router_is_named_by_its_url_with_the_port_and_a_missing_value_is_a_dash(
    rig: Rig,
) -> None:
    """An unreachable router is named with its URL and port, not a bare "127.0.0.1
    unreachable", and a missing value prints ``value -`` as availability does, never
    ``value None``."""
    segment_name, server = rig.segment, rig.capacity
    cfg = rig.write_config({"providers": [_li(rig)]})
    _made_by_a_handler(cfg, segment_name)
    server.stop()  # nothing listens on its port now
    out = run_cli("verify", "--config", str(cfg), "--segment", segment_name)
    assert out.returncode == 2
    url = f"{server.base_url}/capacity"
    assert f"127.0.0.1 unreachable ({url}: ConnectError" in out.stdout
    assert "replica 127.0.0.1: unreachable value -" in out.stdout
    assert "None" not in out.stdout
    doc = json.loads(
        run_cli("verify", "--config", str(cfg), "--segment", segment_name, "--json").stdout
    )
    assert doc["schema_version"] == 1 and doc["providers"][0]["replicas"][0]["value"] is None
    assert url in doc["providers"][0]["rules_reason"]


def test_verify_and_check_config_with_a_segment_alone_use_the_config_it_was_made_for(
    rig: Rig,
) -> None:
    """README: every command takes --config PATH or --segment NAME; the segment records
    the config path its sidecar was started with."""
    cfg = rig.write_config({"providers": [_li(rig)]})
    rig.start(cfg)
    rig.wait("li", lambda p: p["source"] == "discovered")
    short = rig.segment.removeprefix("/")  # as `ls /dev/shm` lists it
    verified = run_cli("verify", "--segment", short)
    assert verified.returncode == 0, verified.stdout + verified.stderr
    assert verified.stdout.startswith("ok  li: rules 20 (discovered)")
    checked = run_cli("check-config", "--segment", short, "--json")
    assert checked.returncode == 0, checked.stderr
    report = json.loads(checked.stdout)
    assert report["config"] == str(cfg) and report["segment_from"] == "--segment"
    assert report["providers"][0]["discovery_active"] is True
    nothing = run_cli("check-config", "--segment", "/gwt-none-" + secrets.token_hex(4))
    assert nothing.returncode == 3 and "Traceback" not in nothing.stderr


def test_r_l10_verify_compares_the_token_budget_with_the_router(rig: Rig) -> None:
    rig.capacity.set(tokens={"workhorse": (256, 1536)})
    cfg = rig.write_config({"maxConcurrent": 4, "providers": [_li(rig)]})
    sidecar = rig.start(cfg)
    rig.wait("li", lambda p: p["token_limit"] == 1536, timeout=30, what="the budget published")
    ok = run_cli("verify", "--config", str(cfg), "--segment", rig.segment, "--json")
    assert ok.returncode == 0, ok.stdout + ok.stderr
    [row] = json.loads(ok.stdout)["providers"]
    assert (row["segment_token_limit"], row["segment_request_token_limit"]) == (1536, 256)
    assert row["tokens_agree"] is True

    sidecar.signal(signal.SIGTERM)
    assert sidecar.wait(timeout=10) == 0
    rig.capacity.set(tokens={"workhorse": (256, 1024)})  # the pool shrank; nobody published it
    differs = run_cli("verify", "--config", str(cfg), "--segment", rig.segment)
    assert differs.returncode == 1, differs.stdout + differs.stderr
    assert "DIFFERS li: rules 20 (discovered), segment 20 (discovered)" in differs.stdout
    assert (
        "tokens by the rules: 1024 running, 256 a request; segment: 1536 running, "
        "256 a request (DIFFERS)"
    ) in differs.stdout, differs.stdout
