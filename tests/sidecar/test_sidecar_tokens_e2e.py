"""The sidecar publishes the token budget the answer states, and it lapses with the limit.

A real sidecar process probes a loopback server speaking the capacity contract with the
optional token fields (R-K7); the test reads what an operator reads (``availability
--json``), where a handler's admission reads it: the segment (R-L10).
"""

from __future__ import annotations

import json
import time

from sidecar_e2e import Rig


def snapshot(**tokens: int) -> bytes:
    """The answer's body: workhorse with 20 slots and ``tokens``' fields, observed now."""
    row = {"id": "workhorse", "max_concurrent_requests": 20, **tokens}
    doc = {
        "object": "inference_capacity",
        "version": 1,
        "complete": True,
        "observed_at": time.time(),
        "models": [row],
    }
    return json.dumps(doc).encode()


def test_r_l10_the_token_budget_is_published_with_the_limit_and_lapses_with_it(rig: Rig) -> None:
    rig.capacity.set(body=snapshot(max_request_tokens=256, max_running_tokens=1536))
    rig.start(rig.config())
    p = rig.wait(
        "p1",
        lambda p: p["token_limit"] == 1536 and p["request_token_limit"] == 256,
        timeout=30,
        what="a budget of 1536 tokens, 256 a request",
    )
    assert p["effective_limit"] == 20 and p["source"] == "discovered"
    rig.capacity.set(body=None, status=503)
    p = rig.wait(
        "p1",
        lambda p: p["source"] != "discovered",
        timeout=60,  # at the latest when the last answer expires (R-L7)
        what="the limit falling back",
    )
    assert p["token_limit"] is None and p["request_token_limit"] is None


def test_r_l10_a_restarted_sidecar_keeps_the_token_budget_until_its_first_probe(
    rig: Rig,
) -> None:
    rig.capacity.set(body=snapshot(max_request_tokens=256, max_running_tokens=1536))
    config = rig.config()
    first = rig.start(config)
    rig.wait("p1", lambda p: p["token_limit"] == 1536, timeout=30, what="the budget published")
    first.kill()  # a crash; the limit and its budget stay in force until they expire
    rig.capacity.set(delay=30.0)  # the new sidecar's first probe hangs (3 s, then fails)
    second = rig.start(config)
    p = rig.wait(
        "p1",
        lambda p: (
            p["reason"].startswith("kept from the previous sidecar until the first probe")
            and rig.sidecar_doc()["pid"] == second.pid
        ),
        timeout=30,
        what="the new sidecar keeping the limit in force",
    )
    assert (p["effective_limit"], p["token_limit"], p["request_token_limit"]) == (20, 1536, 256)
