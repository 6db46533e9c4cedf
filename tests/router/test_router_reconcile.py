"""Reconciliation of a worker's stated token pool with its preemptions (R-K7), one row a step.

The rule is pure (``capacity_router/reconcile.py``); the last test runs it through a
router polling a scripted vLLM whose preemption counter rises, then stays.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
from router_support import Router, ScriptedServer, worker

from capacity_router import RouterServer
from capacity_router.reconcile import CALM_POLLS, Reconciled, reconcile

S = 1600  # the stated pool


def steps(counters: list[float | None], stated: int | None = S) -> list[Reconciled | None]:
    got: list[Reconciled | None] = []
    now: Reconciled | None = None
    for counter in counters:
        now = reconcile(now, stated, counter)
        got.append(now)
    return got


def reported(counters: list[float | None], stated: int | None = S) -> list[int | None]:
    return [None if r is None else r.reported for r in steps(counters, stated)]


# fmt: off
ROWS: dict[str, tuple[list[float | None], list[int | None]]] = {
    "no_preemption_reports_the_stated_pool": ([0, 0, 0], [S, S, S]),
    "a_preemption_lowers_by_a_quarter": ([0, 2], [S, 1200]),
    "preempting_polls_lower_again_each": ([0, 1, 2, 3], [S, 1200, 900, 675]),
    "never_below_a_quarter_of_the_stated": (
        [0, *range(1, 12)], [S, 1200, 900, 675, 507] + [400] * 7,
    ),
    "a_counter_present_at_start_is_not_a_preemption": ([7, 7], [S, S]),
    "a_counter_that_fell_is_a_restart_and_starts_over": ([0, 3, 1], [S, 1200, S]),
    "no_counter_reports_the_stated_pool": ([None, None], [S, S]),
    "a_counter_not_read_keeps_what_is_reported": ([0, 2, None, None], [S, 1200, 1200, 1200]),
    "a_counter_read_again_goes_on_from_there": ([0, 2, None, 2], [S, 1200, 1200, 1200]),
    "recovers_a_tenth_after_calm_polls": (
        [0, 1] + [1] * CALM_POLLS, [S, 1200] + [1200] * (CALM_POLLS - 1) + [1360],
    ),
    "back_to_the_stated_pool_step_by_step": (
        [0, 1] + [1] * (3 * CALM_POLLS),
        [S, 1200] + ([1200] * (CALM_POLLS - 1) + [1360]) + ([1360] * (CALM_POLLS - 1) + [1520])
        + ([1520] * (CALM_POLLS - 1) + [S]),
    ),
    "a_preemption_while_recovering_lowers_again": (
        [0, 1] + [1] * CALM_POLLS + [2], [S, 1200] + [1200] * (CALM_POLLS - 1) + [1360, 1020],
    ),
}
# fmt: on


@pytest.mark.parametrize(("counters", "expected"), list(ROWS.values()), ids=list(ROWS))
def test_r_k7_reconciliation_table(counters: list[float | None], expected: list[int]) -> None:
    assert reported(counters) == expected


def test_r_k7_no_stated_pool_is_nothing_to_reconcile() -> None:
    assert reported([0, 5], stated=None) == [None, None]
    assert reported([0, 5], stated=0) == [None, None]


def test_r_k7_a_changed_stated_pool_starts_over() -> None:
    lowered = steps([0, 4])[-1]
    assert lowered is not None and lowered.reported == 1200
    again = reconcile(lowered, 3000, 9)
    assert again == Reconciled(3000, 3000, 9)


def test_r_k7_the_reason_names_the_numbers_and_clears_when_back() -> None:
    got = steps([0, 2, *([2] * (4 * CALM_POLLS))])
    assert got[0] is not None and got[0].reason == ""
    assert got[1] is not None
    assert got[1].reason == "lowered to 1200 of the 1600 stated: 2 preemptions in the last poll"
    assert got[2] is not None and "no preemption for 1 poll" in got[2].reason
    assert got[-1] is not None and (got[-1].reported, got[-1].reason) == (S, "")


METRICS = """# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{block_size="128",engine="0",num_gpu_blocks="12"} 1.0
vllm:num_requests_running{engine="0",model_name="tiny"} 8.0
vllm:num_requests_waiting{engine="0",model_name="tiny"} 0.0
vllm:kv_cache_usage_perc{engine="0",model_name="tiny"} 0.99
vllm:num_preemptions_total{engine="0",model_name="tiny"} %d.0
"""


def _vllm_behind_a_router(
    scripted: Callable[[], ScriptedServer], router: Router
) -> tuple[ScriptedServer, RouterServer]:
    """A scripted vLLM (one model, 512 tokens a request, no preemption yet) behind a
    router that polls once at its start, then only when a test asks (``observe``)."""
    server = scripted()
    server.route("/health", 200, "")
    server.route("/v1/models", 200, '{"data": [{"id": "tiny", "max_model_len": 512}]}')
    server.route("/metrics", 200, METRICS % 0)
    r = router(
        [worker("v", [server.url], ["tiny"], {"source": "vllm", "fixed": 8})],
        poll_interval=3600.0,
    )
    return server, r


def test_r_k7_a_preempting_vllm_is_reported_lower_with_the_reason(
    scripted: Callable[[], ScriptedServer], router: Router, caplog: pytest.LogCaptureFixture
) -> None:
    server, r = _vllm_behind_a_router(scripted, router)
    snap = r.observe()
    # 12 blocks of 128 less the null block, for 8 requests in whole blocks: one of 512
    assert [(m.request_tokens, m.running_tokens) for m in snap.models] == [(512, 512)]
    server.route("/metrics", 200, METRICS % 4)  # it preempted four times since
    with caplog.at_level("WARNING", logger="capacity_router"):
        snap = r.observe()
    assert [(m.request_tokens, m.running_tokens) for m in snap.models] == [(512, 384)]
    status = r.workers()[0]
    assert status.running_tokens == 384
    assert "lowered to 384 of the 512 stated: 4 preemptions" in status.tokens_from
    assert any("token pool lowered to 384" in rec.getMessage() for rec in caplog.records)
    for _ in range(CALM_POLLS):  # no new preemption: one step back up
        snap = r.observe()
    assert [m.running_tokens for m in snap.models] == [384 + 51]


def test_r_k7_a_round_whose_metrics_failed_keeps_the_pool_the_worker_stated(
    scripted: Callable[[], ScriptedServer], router: Router, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A busy vLLM that misses one /metrics read keeps its pool in the snapshot (a row
    without it would drop the gateways' token budget to none for a round), for at most
    TOKENS_CARRIED_S since it last stated it."""
    from capacity_router import poller

    server, r = _vllm_behind_a_router(scripted, router)
    assert [(m.request_tokens, m.running_tokens) for m in r.observe().models] == [(512, 512)]
    server.route("/metrics", 500, "busy")
    assert [(m.request_tokens, m.running_tokens) for m in r.observe().models] == [(512, 512)]
    assert "the pool as stated" in r.workers()[0].tokens_from
    monkeypatch.setattr(poller, "TOKENS_CARRIED_S", 0.0)  # past the carry: the field goes
    assert [(m.request_tokens, m.running_tokens) for m in r.observe().models] == [(512, None)]
    server.route("/metrics", 200, METRICS % 0)
    assert [(m.request_tokens, m.running_tokens) for m in r.observe().models] == [(512, 512)]
