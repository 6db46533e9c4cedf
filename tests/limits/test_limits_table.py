"""REQUIREMENTS.md section 5 (R-L1..R-L9) and R-G3, one row per behaviour, named by R-id."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import pytest

from sidecar.limits import (
    DISCOVERED_CAP,
    LimitDecision,
    ProviderRules,
    decide,
    decide_all,
    fallback_for,
    keep_inherited,
    snapshot_value,
)
from sidecar.replica import ProviderProbe, ReplicaResult

NOW = 1_800_000_000.0
PID = "local-inference"


def rules(
    *,
    provider_max: int | None = None,
    gateway_max: int | None = None,
    models: tuple[str, ...] = ("workhorse",),
    active: bool = True,
    refused: str | None = None,
) -> ProviderRules:
    return ProviderRules(PID, active, provider_max, gateway_max, models, refused)


def ok(
    address: str, models: dict[str, int], *, complete: bool = True, age: float = 1.0
) -> ReplicaResult:
    return ReplicaResult(address, "ok", complete=complete, observed_at=NOW - age, models=models)


def fail(address: str, reason: str, detail: str = "") -> ReplicaResult:
    return ReplicaResult(address, reason, detail=detail)


def probe(*replicas: ReplicaResult, refused: str | None = None) -> ProviderProbe:
    return ProviderProbe(PID, tuple(replicas), refused)


def prev_discovered(limit: int, *, age: float) -> LimitDecision:
    """A discovered decision published earlier whose snapshot is ``age`` s old now."""
    observed = NOW - age
    return LimitDecision(
        PID, limit, "discovered", "earlier", limit, observed, observed + 30, 8, "gateway"
    )


A, B = "10.0.0.1", "10.0.0.2"
W = "workhorse"


@dataclass
class Row:
    rules: ProviderRules
    probe: ProviderProbe | None
    limit: int
    source: str
    reason_has: tuple[str, ...] = ()
    previous: LimitDecision | None = None
    draining: bool = False
    fields: dict[str, Any] = field(default_factory=dict)


# A table: one row a case reads better than ruff format's one field a line.
# fmt: off
ROWS: dict[str, Row] = {
    # --- R-L1: no discovery -> fallback, with the fallback's source name
    "r_l1_not_opted_in_uses_provider_max": Row(
        rules(provider_max=12, gateway_max=8, active=False), None, 12, "provider",
        ("capacityDiscovery off",), fields={"discovered": None, "expires_at": None},
    ),
    "r_l1_not_opted_in_uses_gateway_max": Row(
        rules(gateway_max=8, active=False), None, 8, "gateway"
    ),
    "r_l1_not_opted_in_without_any_max_uses_4": Row(rules(active=False), None, 4, "default"),
    "r_l1_provider_max_0_is_a_setting_not_unset": Row(
        rules(provider_max=0, gateway_max=8, active=False), None, 0, "provider"
    ),
    "r_l1_refused_opt_in_says_why": Row(
        rules(gateway_max=8, active=False, refused="opt-in refused: 203.0.113.5 is not loopback"),
        None, 8, "gateway", ("203.0.113.5 is not loopback",),
    ),
    "r_l1_r_c4_discovery_off_ignores_a_valid_answer": Row(
        rules(gateway_max=8, active=False), probe(ok(A, {W: 20})), 8, "gateway",
    ),
    # --- R-L2: replicas of one farm -> minimum, never the sum
    "r_l2_two_complete_replicas_give_the_minimum_not_the_sum": Row(
        rules(gateway_max=8), probe(ok(A, {W: 20}), ok(B, {W: 10})), 10, "discovered",
        ("discovered 10", "minimum of 2 complete replicas"),
    ),
    "r_l2_failed_replica_is_skipped": Row(
        rules(gateway_max=8), probe(ok(A, {W: 20}), fail(B, "timeout")), 20, "discovered",
    ),
    "r_l2_invalid_replica_is_skipped": Row(
        rules(gateway_max=8), probe(fail(A, "invalid", "duplicate id"), ok(B, {W: 20})), 20,
        "discovered",
    ),
    "r_l2_replica_stale_by_our_clock_is_skipped": Row(
        rules(gateway_max=8), probe(ok(A, {W: 2}, age=31.0), ok(B, {W: 20})), 20, "discovered",
    ),
    # --- R-L3: minimum over the provider's upstream models
    "r_l3_minimum_over_configured_models": Row(
        rules(models=(W, "coder")), probe(ok(A, {W: 20, "coder": 6, "other": 1})), 6,
        "discovered",
    ),
    "r_l3_rows_for_other_models_are_ignored": Row(
        rules(), probe(ok(A, {W: 20, "other": 1})), 20, "discovered",
    ),
    "r_l3_r_l8_model_missing_from_complete_snapshot_counts_0": Row(
        rules(models=(W, "coder"), gateway_max=8), probe(ok(A, {W: 20})), 0, "discovered",
        ("upstream model coder missing from 10.0.0.1",),
        fields={"missing_models": ("coder",)},
    ),
    "r_l3_every_model_present_names_none_missing": Row(
        rules(models=(W, "coder")), probe(ok(A, {W: 20, "coder": 6})), 6, "discovered",
        fields={"missing_models": ()},
    ),
    # --- R-L4: caps
    "r_l4_capped_at_64": Row(
        rules(), probe(ok(A, {W: 100})), 64, "discovered", ("discovered 100", "capped at 64"),
    ),
    "r_l4_capped_by_provider_max": Row(
        rules(provider_max=12), probe(ok(A, {W: 20})), 12, "discovered",
        ("discovered 20", "capped by provider maxConcurrent 12"),
    ),
    "r_l4_provider_max_above_64_still_capped_at_64": Row(
        rules(provider_max=80), probe(ok(A, {W: 100})), 64, "discovered", ("capped at 64",),
    ),
    "r_l4_provider_max_never_raises": Row(
        rules(provider_max=12), probe(ok(A, {W: 5})), 5, "discovered",
    ),
    "r_l4_gateway_max_is_not_a_ceiling": Row(
        rules(gateway_max=8), probe(ok(A, {W: 20})), 20, "discovered",
    ),
    # --- R-L5: no valid answer -> fallback at once, naming the failures
    "r_l5_every_replica_failed_names_each_failure": Row(
        rules(gateway_max=8), probe(fail(A, "timeout"), fail(B, "auth_failed")), 8, "gateway",
        ("no valid answer: 10.0.0.1 timeout; 10.0.0.2 auth_failed",),
        fields={"discovered": None, "observed_at": None, "expires_at": None},
    ),
    "r_l5_http_error_detail_is_shown": Row(
        rules(provider_max=12), probe(fail(A, "http_error", "http_503")), 12, "provider",
        ("10.0.0.1 http_error (http_503)",),
    ),
    "r_l5_not_probed_yet": Row(rules(gateway_max=8), None, 8, "gateway", ("not probed yet",)),
    "r_l5_refused_probe_gives_its_reason": Row(
        rules(), probe(refused="host did not resolve"), 4, "default", ("host did not resolve",),
    ),
    "r_l5_no_replicas": Row(rules(), probe(), 4, "default", ("no valid answer",)),
    "r_l5_stale_by_our_clock": Row(
        rules(gateway_max=8), probe(ok(A, {W: 20}, age=30.5)), 8, "gateway", ("10.0.0.1 stale",),
    ),
    "r_l5_future_by_our_clock": Row(
        rules(gateway_max=8), probe(ok(A, {W: 20}, age=-5.5)), 8, "gateway", ("10.0.0.1 future",),
    ),
    "r_l5_ok_without_observed_at_is_invalid": Row(
        rules(gateway_max=8),
        probe(ReplicaResult(A, "ok", complete=True, observed_at=None, models={W: 20})),
        8, "gateway", ("10.0.0.1 invalid",),
    ),
    "r_l5_ok_with_nan_observed_at_is_invalid": Row(
        rules(gateway_max=8),
        probe(ReplicaResult(A, "ok", complete=True, observed_at=math.nan, models={W: 20})),
        8, "gateway", ("10.0.0.1 invalid",),
    ),
    "r_l5_failure_drops_an_unexpired_discovered_limit_at_once": Row(
        rules(gateway_max=8), probe(fail(A, "unreachable")), 8, "gateway",
        previous=prev_discovered(20, age=2.0),
    ),
    # --- R-L6: incomplete answers may lower, never raise
    "r_l6_complete_replica_wins_incomplete_is_ignored": Row(
        rules(gateway_max=8), probe(ok(A, {W: 20}), ok(B, {W: 5}, complete=False)), 20,
        "discovered", ("ignored incomplete 10.0.0.2",),
    ),
    "r_l6_incomplete_lowers_last_discovered": Row(
        rules(gateway_max=8), probe(ok(A, {W: 5}, complete=False)), 5, "discovered",
        ("only incomplete answer (10.0.0.1 5)", "last discovered 20"),
        previous=prev_discovered(20, age=10.0),
    ),
    "r_l6_incomplete_cannot_raise_last_discovered": Row(
        rules(gateway_max=8), probe(ok(A, {W: 30}, complete=False)), 20, "discovered",
        ("cannot raise last discovered 20",), previous=prev_discovered(20, age=10.0),
        # the base's snapshot (10 s old) is older than the incomplete one (1 s old)
        fields={"observed_at": NOW - 10.0, "expires_at": NOW + 20.0, "discovered": 20},
    ),
    "r_l6_expired_last_discovered_falls_back_to_fallback_base": Row(
        rules(gateway_max=8), probe(ok(A, {W: 30}, complete=False)), 8, "discovered",
        ("cannot raise fallback 8",), previous=prev_discovered(20, age=30.0),
        fields={"observed_at": NOW - 1.0, "expires_at": NOW + 29.0},
    ),
    "r_l6_without_previous_base_is_fallback": Row(
        rules(provider_max=12), probe(ok(A, {W: 30}, complete=False)), 12, "discovered",
        ("incomplete", "fallback 12"),
    ),
    "r_l6_previous_fallback_decision_is_not_a_discovered_base": Row(
        rules(gateway_max=8), probe(ok(A, {W: 30}, complete=False)), 8, "discovered",
        ("fallback 8",),
        previous=LimitDecision(PID, 8, "gateway", "x", None, None, None, 8, "gateway"),
    ),
    "r_l6_missing_model_in_incomplete_snapshot_is_unknown_not_0": Row(
        rules(models=(W, "coder"), gateway_max=8), probe(ok(A, {W: 6}, complete=False)), 6,
        "discovered",
    ),
    "r_l6_several_incomplete_give_their_minimum": Row(
        rules(gateway_max=8), probe(ok(A, {W: 7}, complete=False), ok(B, {W: 3}, complete=False)),
        3, "discovered", ("only incomplete answers",),
    ),
    "r_l6_incomplete_without_the_providers_models_is_no_answer": Row(
        rules(gateway_max=8), probe(ok(A, {"other": 3}, complete=False)), 8, "gateway",
        ("no valid answer: 10.0.0.1 incomplete",), previous=prev_discovered(20, age=5.0),
    ),
    "r_l6_r_l4_incomplete_result_is_still_capped_at_64": Row(
        rules(gateway_max=100), probe(ok(A, {W: 80}, complete=False)), 64, "discovered",
        ("capped at 64",),
    ),
    "r_l6_r_l4_incomplete_result_is_capped_by_a_lower_provider_max": Row(
        rules(provider_max=10), probe(ok(A, {W: 30}, complete=False)), 10, "discovered",
        previous=prev_discovered(20, age=5.0),
    ),
    # --- R-L7: expiry from the oldest snapshot used
    "r_l7_expires_30s_after_the_oldest_snapshot_used": Row(
        rules(), probe(ok(A, {W: 20}, age=2.0), ok(B, {W: 30}, age=7.0)), 20, "discovered",
        fields={"observed_at": NOW - 7.0, "expires_at": NOW + 23.0, "discovered": 20},
    ),
    "r_l7_ignored_replicas_do_not_count_for_expiry": Row(
        rules(), probe(ok(A, {W: 20}, age=2.0), ok(B, {W: 5}, age=20.0, complete=False)), 20,
        "discovered", fields={"observed_at": NOW - 2.0, "expires_at": NOW + 28.0},
    ),
    # --- R-L8: 0 is a valid limit
    "r_l8_zero_slots_gives_limit_0": Row(
        rules(gateway_max=8), probe(ok(A, {W: 0})), 0, "discovered", ("discovered 0",),
        fields={"discovered": 0},
    ),
    # --- R-G3: legacy drain
    "r_g3_drain_holds_opted_in_provider_at_0": Row(
        rules(gateway_max=8), probe(ok(A, {W: 20}, age=4.0)), 0, "legacy_drain",
        ("legacy", "then discovered 20"), draining=True,
        # the drain is asserted, not observed: it holds 30 s from now (the sidecar
        # re-asserts it), whatever the age of the snapshot behind "then"
        fields={"discovered": 20, "expires_at": NOW + 30.0, "fallback_limit": 8},
    ),
    "r_g3_r_l1_drain_leaves_a_provider_refused_at_probe_time_on_its_fallback": Row(
        rules(gateway_max=8), ProviderProbe(PID, refused="address_refused:10.0.0.9: public"),
        8, "gateway", ("address_refused",), draining=True,
    ),
    "r_g3_drain_applies_even_when_the_probe_failed": Row(
        rules(gateway_max=8), probe(fail(A, "timeout")), 0, "legacy_drain", ("then fallback 8",),
        draining=True, fields={"discovered": None, "expires_at": NOW + 30.0},
    ),
    "r_g3_drain_leaves_providers_without_discovery_alone": Row(
        rules(provider_max=12, active=False), None, 12, "provider", draining=True,
    ),
}
# fmt: on


@pytest.mark.parametrize("row", list(ROWS.values()), ids=list(ROWS))
def test_section_5_rule_table(row: Row) -> None:
    got = decide(row.rules, row.probe, row.previous, NOW, legacy_draining=row.draining)
    assert (got.effective_limit, got.source) == (row.limit, row.source), got.reason
    for text in row.reason_has:
        assert text in got.reason
    for name, value in row.fields.items():
        assert getattr(got, name) == value, name
    # R-L9 and R-L7 hold for every row
    assert got.source in {"discovered", "provider", "gateway", "default", "legacy_drain"}
    assert got.reason
    if got.source == "discovered":
        assert got.discovered == got.effective_limit <= DISCOVERED_CAP
        assert got.observed_at is not None
        assert got.expires_at == got.observed_at + 30
    elif got.source != "legacy_drain":
        assert (got.effective_limit, got.source) == (got.fallback_limit, got.fallback_source)
        assert got.expires_at is None


def test_r_l2_r_l6_twenty_ten_twenty_follows_the_router_at_once() -> None:
    r = rules(provider_max=None, gateway_max=8)
    seen = []
    previous = None
    for step, value in enumerate([20, 10, 20]):
        now = NOW + 15 * step
        p = ProviderProbe(
            PID, (ReplicaResult(A, "ok", complete=True, observed_at=now - 1, models={W: value}),)
        )
        previous = decide(r, p, previous, now)
        seen.append((previous.effective_limit, previous.source))
    assert seen == [(20, "discovered"), (10, "discovered"), (20, "discovered")]


def test_r_l9_replicas_are_reported_with_value_and_reason() -> None:
    got = decide(
        rules(models=(W, "coder")),
        probe(
            ok(A, {W: 20}),
            ok(B, {W: 4}, complete=False),
            fail("10.0.0.3", "too_large"),
            ok("10.0.0.4", {W: 9}, age=40.0),
        ),
        None,
        NOW,
    )
    view = {v.address: (v.ok, v.complete, v.value, v.reason) for v in got.replicas}
    assert view == {
        A: (True, True, 0, "ok"),
        B: (True, False, 4, "ok"),
        "10.0.0.3": (False, False, None, "too_large"),
        "10.0.0.4": (False, True, None, "stale"),
    }


def test_r_l5_long_detail_is_shortened_in_the_reason() -> None:
    got = decide(rules(), probe(fail(A, "invalid", "x" * 500)), None, NOW)
    assert got.source == "default"
    assert len(got.reason) < 200


def test_fallback_for_prefers_provider_then_gateway_then_4() -> None:
    assert fallback_for(12, 8) == (12, "provider")
    assert fallback_for(None, 8) == (8, "gateway")
    assert fallback_for(None, 0) == (0, "gateway")
    assert fallback_for(None, None) == (4, "default")


def test_snapshot_value_complete_counts_missing_as_0_incomplete_as_unknown() -> None:
    assert snapshot_value({W: 5}, (W, "coder"), complete=True) == 0
    assert snapshot_value({W: 5}, (W, "coder"), complete=False) == 5
    assert snapshot_value({"other": 5}, (W,), complete=False) is None
    assert snapshot_value({W: 5}, (), complete=True) is None


def test_no_upstream_models_is_a_clear_fallback() -> None:
    got = decide(rules(models=(), gateway_max=8), probe(ok(A, {W: 20})), None, NOW)
    assert (got.effective_limit, got.source) == (8, "gateway")
    assert "no upstream models" in got.reason


def test_mismatched_provider_ids_are_a_caller_error() -> None:
    with pytest.raises(ValueError, match="probe for 'other'"):
        decide(rules(), ProviderProbe("other"), None, NOW)
    other_prev = LimitDecision("other", 4, "default", "x", None, None, None, 4, "default")
    with pytest.raises(ValueError, match="previous for 'other'"):
        decide(rules(), None, other_prev, NOW)


def test_decide_all_keys_by_provider_and_drains_only_opted_in() -> None:
    on = rules(gateway_max=8)
    off = ProviderRules("static", False, 3, 8, (W,), None)
    got = decide_all([on, off], {PID: probe(ok(A, {W: 20}))}, {}, NOW, legacy_draining=True)
    assert {k: (d.effective_limit, d.source) for k, d in got.items()} == {
        PID: (0, "legacy_drain"),
        "static": (3, "provider"),
    }


def test_r_c2_r_c3_rules_from_a_real_config() -> None:
    from sidecar.config import parse_config
    from sidecar.limits import rules_from_config

    doc = b"""{"maxConcurrent": 8, "providers": [
      {"id": "local-inference", "baseUrl": "http://127.0.0.1:9/v1", "capacityDiscovery": true,
       "credentialFile": "/private/local.key", "maxConcurrent": 12,
       "models": {"local-workhorse": "workhorse", "fast": "coder"}},
      {"id": "static", "baseUrl": "http://127.0.0.1:9/v1"},
      {"id": "remote", "baseUrl": "http://203.0.113.5/v1", "capacityDiscovery": true,
       "credentialFile": "/private/remote.key", "models": {"m": "m"}}
    ]}"""
    got = {r.provider_id: r for r in rules_from_config(parse_config(doc))}
    assert got["local-inference"] == ProviderRules(
        "local-inference", True, 12, 8, ("coder", "workhorse"), None
    )
    assert got["static"] == ProviderRules("static", False, None, 8, (), None)
    remote = got["remote"]
    assert not remote.discovery_active
    # 203.0.113.5 is neither loopback nor tailnet (R-P1)
    assert remote.refused_reason is not None
    assert remote.refused_reason.startswith("discovery refused: ")
    # and the refusal reaches the decision (R-L1)
    decision = decide(remote, None, None, NOW)
    assert (decision.effective_limit, decision.source) == (8, "gateway")
    assert decision.reason == remote.refused_reason


# --- an inherited limit until the first probe (R-L7, R-G5, R-L4) ------------------------


def test_r_g5_inherited_limit_stays_until_first_probe_under_the_new_cap() -> None:
    fallback = decide(rules(provider_max=12), None, None, NOW)
    kept = prev_discovered(40, age=5)
    held = keep_inherited(fallback, kept, rules(provider_max=12), NOW)
    assert held is not None
    assert (held.effective_limit, held.discovered, held.source) == (12, 12, "discovered")
    assert (held.fallback_limit, held.fallback_source) == (12, "provider")
    assert held.expires_at == kept.expires_at


def test_r_l7_expired_inherited_limit_is_not_kept() -> None:
    fallback = decide(rules(), None, None, NOW)
    assert keep_inherited(fallback, prev_discovered(20, age=31), rules(), NOW) is None


def test_r_g3_inherited_limit_does_not_override_a_legacy_drain() -> None:
    drain = decide(rules(), None, None, NOW, legacy_draining=True)
    assert drain.source == "legacy_drain"
    assert keep_inherited(drain, prev_discovered(20, age=1), rules(), NOW) is None
