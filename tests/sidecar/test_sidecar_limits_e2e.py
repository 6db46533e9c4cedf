"""The published limit follows the router, with the caps and every fallback reason (section 5).

A real sidecar process probes real loopback servers speaking the capacity
contract; the test reads what an operator reads (``availability --json``) and
what a handler gets (admission through ``tests/agent.py``).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from capacity_server import CapacityServer
from gwtest import free_port
from sidecar_e2e import Rig, cli_providers, discovered


def test_r_l2_r_l4_limit_follows_the_router_20_10_20_and_handlers_follow_it(rig: Rig) -> None:
    capacity = rig.capacity
    rig.start(rig.config())

    # 20 although the gateway-wide maxConcurrent is 8: it is a fallback, not a ceiling (R-L4)
    rig.wait("p1", discovered(20), what="discovered 20")
    p = rig.provider()
    assert p["capacity_discovery"] is True
    assert p["fallback_limit"] == 8 and p["fallback_source"] == "gateway"
    assert p["discovered"] == 20
    assert p["expires_at"] == p["observed_at"] + 30  # R-L7
    assert abs(p["observed_at"] - time.time()) < 10
    [replica] = p["replicas"]
    assert replica["address"] == "127.0.0.1"
    assert replica["ok"] and replica["complete"] and replica["value"] == 20
    assert capacity.auth_headers and set(capacity.auth_headers) == {f"Bearer {rig.key}"}  # R-P2

    capacity.set(models={"workhorse": 10})
    rig.wait("p1", discovered(10), what="discovered 10")

    # a handler gets exactly 10 slots; two more wait (R-A1)
    holder = rig.handler("hold", "--threads", "12")
    for _ in range(10):
        holder.expect("admitted")
    rig.wait("p1", lambda p: p["running"] == 10 and p["waiting"] == 2)

    capacity.set(models={"workhorse": 20})
    rig.wait("p1", discovered(20), what="discovered 20 again")
    for _ in range(2):
        holder.expect("admitted", timeout=5)
    p = rig.provider()
    assert (p["running"], p["waiting"], p["effective_limit"]) == (12, 0, 20)
    holder.send("release")
    assert holder.finish() == 0


def test_r_l4_r_l9_discovered_limit_is_capped_and_the_reason_says_what_capped_it(
    rig: Rig,
) -> None:
    twenty = rig.servers(models={"workhorse": 20})
    hundred = rig.servers(models={"workhorse": 100})
    config = rig.write_config(
        {
            "maxConcurrent": 8,
            "providers": [
                rig.entry(twenty, "ceiling", maxConcurrent=12),
                rig.entry(hundred, "big"),
                rig.entry(hundred, "big-ceiling", maxConcurrent=40),
            ],
        }
    )
    rig.start(config)
    rig.wait("ceiling", discovered(12), what="capped at 12")
    rig.wait("big", discovered(64), what="capped at 64")
    rig.wait("big-ceiling", discovered(40), what="capped at 40")

    ceiling = rig.provider("ceiling")
    assert ceiling["source"] == "discovered"  # a cap keeps the source (R-L9)
    assert "discovered 20" in ceiling["reason"]
    assert "provider maxConcurrent 12" in ceiling["reason"]
    assert ceiling["fallback_limit"] == 12 and ceiling["fallback_source"] == "provider"
    assert ceiling["replicas"][0]["value"] == 20  # what the router said, before the cap

    big = rig.provider("big")
    assert "discovered 100" in big["reason"] and "64" in big["reason"]
    assert big["discovered"] == 64

    both = rig.provider("big-ceiling")
    assert "provider maxConcurrent 40" in both["reason"]


def _unused_url() -> str:
    return f"http://127.0.0.1:{free_port()}/v1"


def test_r_l5_every_failure_reason_reaches_availability_with_the_fallback(
    rig: Rig, tmp_path: Path
) -> None:
    elsewhere = rig.servers()  # a redirect's target: must never be asked (R-P4)
    wrong_key = tmp_path / "wrong.key"
    wrong_key.write_text("sk-not-the-routers-key\n")
    wrong_key.chmod(0o600)
    cases: dict[str, tuple[str, dict[str, Any], dict[str, Any]]] = {
        # provider id: (replica reason, server settings, extra entry fields)
        "wrong-key": ("auth_failed", {}, {"credentialFile": str(wrong_key)}),
        "forbidden": ("auth_failed", {"status": 403}, {}),
        "not-found": ("no_endpoint", {"status": 404}, {}),
        "server-error": ("http_error", {"status": 500}, {}),
        "unavailable": ("http_error", {"status": 503}, {"maxConcurrent": 5}),
        "redirect": (
            "redirect_refused",
            {"status": 302, "headers": {"Location": elsewhere.base_url + "/capacity"}},
            {},
        ),
        "wrong-version": (
            "invalid",
            {"body": b'{"object": "inference_capacity", "version": 2}'},
            {},
        ),
        "not-json": ("invalid", {"body": b"<html>hello</html>"}, {}),
        "float-count": (
            "invalid",
            {
                "body": b'{"object": "inference_capacity", "version": 1, "complete": true,'
                b' "observed_at": 1e9, "models": [{"id": "workhorse",'
                b' "max_concurrent_requests": 2.5}]}'
            },
            {},
        ),
        "too-large": ("too_large", {"body": b" " * (70 * 1024)}, {}),
        "stale": ("stale", {"observed_offset": -60.0}, {}),
        "future": ("future", {"observed_offset": 30.0}, {}),
        "hangs": ("timeout", {"delay": 30.0}, {}),
    }
    providers = []
    by_id: dict[str, CapacityServer] = {}
    for pid, (_, settings, fields) in cases.items():
        by_id[pid] = rig.servers(**settings)
        providers.append(rig.entry(by_id[pid], pid, **fields))
    providers.append(rig.entry(_unused_url(), "refused-port"))
    cases["refused-port"] = ("unreachable", {}, {})
    sidecar = rig.start(rig.write_config({"maxConcurrent": 8, "providers": providers}))

    def failed_with(reason: str) -> Callable[[dict[str, Any]], bool]:
        return lambda p: bool(p["replicas"]) and p["replicas"][0]["reason"].startswith(reason)

    for pid, (reason, _, _) in cases.items():
        # one deadline (3 s) plus generous room for a loaded machine (R-P5)
        rig.wait(pid, failed_with(reason), timeout=15, what=reason)

    # the hanging router did not hold up the others (R-P8): they kept being refreshed
    # every 0.3 s while its single probe waited out the 3 s deadline
    assert by_id["not-found"].requests >= 3, by_id["not-found"].requests

    shown = cli_providers(rig.segment)
    for pid, (reason, _, _) in cases.items():
        p = shown[pid]
        expected = (5, "provider") if pid == "unavailable" else (8, "gateway")
        assert (p["effective_limit"], p["source"]) == expected, (pid, p)  # R-L5
        assert p["fallback_limit"] == expected[0]
        assert p["discovered"] is None and p["expires_at"] is None, (pid, p)
        [replica] = p["replicas"]
        assert replica["ok"] is False and replica["value"] is None, (pid, p)
        assert replica["reason"].startswith(reason), (pid, p)
        assert reason in p["reason"] and p["reason"].startswith("no valid answer"), (pid, p)
    assert elsewhere.requests == 0  # the redirect was not followed

    # R-P9: a failure repeated at every refresh is logged once, not every 0.3 s
    lines = sidecar.log_lines()
    for pid, (reason, _, _) in cases.items():
        logged = [line for line in lines if f"{pid}: limit " in line and f"1 {reason}" in line]
        assert len(logged) == 1, (pid, logged)
        assert " WARNING " in logged[0], logged  # discovery failing is worth a warning


def test_r_l6_incomplete_answers_can_lower_but_never_raise_the_limit(rig: Rig) -> None:
    capacity = rig.capacity
    capacity.set(complete=False, models={"workhorse": 20})
    sidecar = rig.start(rig.config())

    # incomplete only, nothing discovered before: the base is the fallback. From the
    # next refresh on, the 8 this round discovered is the base ("last discovered 8"), so
    # the first round is judged by what the sidecar logged of it, not by a later reading
    p = rig.wait("p1", discovered(8), what="incomplete 20 held to 8")
    assert "incomplete" in p["reason"] and "cannot raise" in p["reason"]
    first = [line for line in sidecar.log_lines() if "p1: limit " in line and "incomplete" in line]
    assert first and "cannot raise fallback 8" in first[0], first
    assert p["replicas"][0]["complete"] is False and p["replicas"][0]["value"] == 20

    capacity.set(models={"workhorse": 3})  # lowering is allowed
    rig.wait("p1", discovered(3), what="incomplete 3 lowers")

    # an incomplete snapshot without the provider's models is no answer (R-L5)
    capacity.set(models={"other-model": 3})
    p = rig.wait("p1", lambda p: p["source"] == "gateway", what="no answer -> fallback")
    assert p["effective_limit"] == 8 and p["expires_at"] is None

    capacity.set(complete=True, models={"workhorse": 20})
    rig.wait("p1", discovered(20), what="complete 20")

    capacity.set(complete=False, models={"workhorse": 30})
    rig.wait("p1", lambda p: "incomplete" in p["reason"], what="incomplete 30")
    time.sleep(0.6)  # a few more refreshes of incomplete 30: still no raise
    p = rig.provider()
    assert p["effective_limit"] == 20 and p["source"] == "discovered", p
    assert "incomplete" in p["reason"] and "last discovered 20" in p["reason"], p


def test_r_l8_complete_snapshot_without_the_model_gives_zero_and_new_work_waits(
    rig: Rig,
) -> None:
    rig.start_discovered(rig.config())
    running = rig.handler("hold")
    running.expect("admitted")

    rig.capacity.set(models={"another-model": 4})
    p = rig.wait("p1", discovered(0), what="discovered 0")
    assert "workhorse" in p["reason"] and "missing" in p["reason"], p
    assert p["expires_at"] is not None

    # lowering never cancels the running request (R-A1); new work waits, then times out
    waiter = rig.handler("hold", "--timeout", "2.5")
    waiter.expect("started")
    rig.wait("p1", lambda p: p["waiting"] == 1 and p["running"] == 1)
    waiter.expect("timeout", timeout=10)
    assert not [e for e in waiter.seen if e["event"] == "admitted"]
    p = rig.provider()
    assert (p["effective_limit"], p["running"], p["waiting"]) == (0, 1, 0), p

    # slots come back: a waiting handler is admitted
    late = rig.handler("hold", "--timeout", "20")
    late.expect("started")
    rig.wait("p1", lambda p: p["waiting"] == 1)
    rig.capacity.set(models={"workhorse": 2})
    late.expect("admitted", timeout=10)


def test_r_l10_the_token_budget_follows_the_router_and_lapses_with_the_limit(rig: Rig) -> None:
    """What the router states of its tokens reaches the segment with the limit; a row
    without them, or no answer, leaves admission on slots alone."""
    capacity = rig.capacity
    capacity.set(tokens={"workhorse": (512, 1536)})
    rig.start(rig.config())
    rig.wait(
        "p1",
        lambda p: (
            p["source"] == "discovered"
            and (p["token_limit"], p["request_token_limit"]) == (1536, 512)
        ),
        what="the token budget published",
    )
    assert "1536 tokens running, 512 a request" in rig.provider()["reason"]
    capacity.set(tokens={"workhorse": (512, None)})  # the pool no longer stated
    rig.wait(
        "p1",
        lambda p: (p["token_limit"], p["request_token_limit"]) == (None, 512),
        what="no running-token budget",
    )
    capacity.set(tokens={"workhorse": (512, 1536)})
    rig.wait("p1", lambda p: p["token_limit"] == 1536, what="the budget again")
    capacity.set(status=503)  # no valid answer: the fallback, and no budget with it
    rig.wait(
        "p1",
        lambda p: (
            p["source"] != "discovered"
            and (p["token_limit"], p["request_token_limit"]) == (None, None)
        ),
        what="the budget lapsed with the limit",
    )
