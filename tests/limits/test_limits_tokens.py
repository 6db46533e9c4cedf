"""A provider's token budget (R-L10, with R-L2, R-L3, R-L5, R-L6, R-G3), one row a behaviour.

``token_limit`` is what all the provider's running requests may hold together,
``request_token_limit`` the most one request may hold; 0 means no token budget
(admission on slots alone).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import pytest

from sidecar.limits import LimitDecision, ProviderRules, decide, tightest, token_value
from sidecar.replica import ProviderProbe, ReplicaResult

NOW = 1_800_000_000.0
PID = "local-inference"
A, B = "10.0.0.1", "10.0.0.2"
W, C = "workhorse", "coder"


def rules(models: tuple[str, ...] = (W,), provider_max: int | None = None) -> ProviderRules:
    return ProviderRules(PID, True, provider_max, 8, models, None)


def ok(
    address: str,
    slots: dict[str, int],
    running: dict[str, int] | None = None,
    request: dict[str, int] | None = None,
    *,
    complete: bool = True,
    age: float = 1.0,
) -> ReplicaResult:
    return ReplicaResult(
        address,
        "ok",
        complete=complete,
        observed_at=NOW - age,
        models=slots,
        running_tokens=running or {},
        request_tokens=request or {},
    )


def probe(*replicas: ReplicaResult) -> ProviderProbe:
    return ProviderProbe(PID, tuple(replicas))


def earlier(limit: int, tokens: int, request: int, *, age: float = 5.0) -> LimitDecision:
    observed = NOW - age
    return LimitDecision(
        PID,
        limit,
        "discovered",
        "earlier",
        limit,
        observed,
        observed + 30,
        8,
        "gateway",
        token_limit=tokens,
        request_token_limit=request,
    )


@dataclass
class Row:
    rules: ProviderRules
    probe: ProviderProbe | None
    tokens: int  # token_limit
    request: int  # request_token_limit
    previous: LimitDecision | None = None
    draining: bool = False


# fmt: off
ROWS: dict[str, Row] = {
    "r_l10_one_complete_replica_states_both": Row(
        rules(), probe(ok(A, {W: 8}, {W: 1536}, {W: 512})), 1536, 512,
    ),
    "r_l10_a_row_without_the_fields_is_no_budget": Row(
        rules(), probe(ok(A, {W: 8})), 0, 0,
    ),
    "r_l10_running_stated_request_not": Row(
        rules(), probe(ok(A, {W: 8}, {W: 1536})), 1536, 0,
    ),
    "r_l10_r_l3_minimum_over_upstream_models": Row(
        rules((W, C)), probe(ok(A, {W: 8, C: 2}, {W: 4000, C: 900}, {W: 512, C: 2048})), 900, 512,
    ),
    "r_l10_r_l3_one_model_without_the_field_is_no_budget": Row(
        rules((W, C)), probe(ok(A, {W: 8, C: 2}, {W: 4000}, {W: 512})), 0, 0,
    ),
    "r_l10_r_l3_rows_of_other_models_do_not_count": Row(
        rules(), probe(ok(A, {W: 8, C: 1}, {W: 4000, C: 10}, {W: 512, C: 5})), 4000, 512,
    ),
    "r_l10_r_l2_minimum_over_complete_replicas": Row(
        rules(), probe(ok(A, {W: 8}, {W: 4000}, {W: 512}), ok(B, {W: 8}, {W: 3000}, {W: 1024})),
        3000, 512,
    ),
    "r_l10_r_l2_one_complete_replica_without_is_no_budget": Row(
        rules(), probe(ok(A, {W: 8}, {W: 4000}, {W: 512}), ok(B, {W: 8})), 0, 0,
    ),
    "r_l10_r_l2_a_stale_replica_does_not_count": Row(
        rules(), probe(ok(A, {W: 8}, {W: 10}, {W: 5}, age=31), ok(B, {W: 8}, {W: 3000}, {W: 512})),
        3000, 512,
    ),
    "r_l10_r_l2_incomplete_ignored_beside_a_complete_one": Row(
        rules(),
        probe(ok(A, {W: 8}, {W: 4000}, {W: 512}), ok(B, {W: 8}, {W: 10}, {W: 5}, complete=False)),
        4000, 512,
    ),
    "r_l10_r_l4_not_capped_with_the_slots": Row(
        rules(provider_max=2), probe(ok(A, {W: 8}, {W: 4000}, {W: 512})), 4000, 512,
    ),
    "r_l10_r_l5_no_answer_falls_back_without_a_budget": Row(
        rules(), probe(ReplicaResult(A, "timeout")), 0, 0, previous=earlier(8, 4000, 512),
    ),
    "r_l10_r_l6_incomplete_only_tightens_the_last_budget": Row(
        rules(), probe(ok(A, {W: 8}, {W: 3000}, {W: 1024}, complete=False)), 3000, 512,
        previous=earlier(8, 4000, 512),
    ),
    "r_l10_r_l6_incomplete_only_never_loosens_it": Row(
        rules(), probe(ok(A, {W: 8}, complete=False)), 4000, 512, previous=earlier(8, 4000, 512),
    ),
    "r_l10_r_l6_an_absent_model_is_unknown_not_no_budget": Row(
        rules((W, C)), probe(ok(A, {W: 8}, {W: 3000}, {W: 512}, complete=False)), 3000, 512,
    ),
    "r_l10_r_l6_an_expired_base_gives_no_budget_of_its_own": Row(
        rules(), probe(ok(A, {W: 8}, complete=False)), 0, 0, previous=earlier(8, 4000, 512, age=40),
    ),
    "r_l10_r_g3_a_drain_carries_the_budget_that_follows_it": Row(
        rules(), probe(ok(A, {W: 8}, {W: 4000}, {W: 512})), 4000, 512, draining=True,
    ),
}
# fmt: on


@pytest.mark.parametrize("row", list(ROWS.values()), ids=list(ROWS))
def test_r_l10_token_budget_table(row: Row) -> None:
    got = decide(row.rules, row.probe, row.previous, NOW, legacy_draining=row.draining)
    assert (got.token_limit, got.request_token_limit) == (row.tokens, row.request)
    if got.source not in ("discovered", "legacy_drain"):
        assert (got.token_limit, got.request_token_limit) == (0, 0)


def test_r_l10_the_slot_limit_is_what_it_was_without_the_fields() -> None:
    with_tokens = probe(ok(A, {W: 8}, {W: 4000}, {W: 512}), ok(B, {W: 6}, {W: 3000}, {W: 512}))
    without = probe(ok(A, {W: 8}), ok(B, {W: 6}))
    a, b = decide(rules(), with_tokens, None, NOW), decide(rules(), without, None, NOW)
    assert (a.effective_limit, a.source, a.expires_at) == (
        b.effective_limit,
        b.source,
        b.expires_at,
    )
    assert "3000 tokens running, 512 a request" in a.reason


def test_r_l10_replicas_show_what_each_states() -> None:
    got = decide(rules(), probe(ok(A, {W: 8}, {W: 4000}, {W: 512}), ok(B, {W: 6})), None, NOW)
    assert [(v.address, v.token_limit, v.request_token_limit) for v in got.replicas] == [
        (A, 4000, 512),
        (B, 0, 0),
    ]


def test_r_l10_budget_lapses_with_the_limit_on_the_next_refresh() -> None:
    first = decide(rules(), probe(ok(A, {W: 8}, {W: 4000}, {W: 512})), None, NOW)
    later = replace(first, expires_at=NOW - 1)
    gone = decide(rules(), probe(ReplicaResult(A, "unreachable")), later, NOW)
    assert (gone.source, gone.token_limit, gone.request_token_limit) == ("gateway", 0, 0)


def test_token_value_and_tightest() -> None:
    assert token_value({W: 5, C: 3}, (W, C)) == 3
    assert token_value({W: 5}, (W, C)) == 0
    assert token_value({W: 5}, ()) == 0
    assert tightest([0, 0]) == 0
    assert tightest([0, 7, 3]) == 3
