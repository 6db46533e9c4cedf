"""Hypothesis properties of the section 5 rules (R-L2, R-L4, R-L5, R-L6, R-L7, R-G3)."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from sidecar.limits import DISCOVERED_CAP, LimitDecision, ProviderRules, decide
from sidecar.replica import OK, REASONS, ProviderProbe, ReplicaResult

NOW = 1_800_000_000.0
PID = "p"
MODELS = ("a", "b", "c")
FAILURES = sorted(REASONS - {OK})

maxima = st.none() | st.integers(0, 100)
counts = st.integers(0, 200)
# ages comfortably inside the freshness window (R-K4: -5 s .. 30 s), away from float edges
fresh_age = st.floats(-4.5, 29.5)
any_age = st.floats(-20.0, 60.0)
stale_age = st.floats(30.5, 60.0)
future_age = st.floats(-60.0, -5.5)


@st.composite
def rules_st(draw: st.DrawFn, *, active: bool | None = None) -> ProviderRules:
    models = draw(st.lists(st.sampled_from(MODELS), min_size=1, max_size=3, unique=True))
    return ProviderRules(
        PID,
        draw(st.booleans()) if active is None else active,
        draw(maxima),
        draw(maxima),
        tuple(models),
        None,
    )


def _snapshot_models(draw: st.DrawFn) -> dict[str, int]:
    return draw(st.dictionaries(st.sampled_from((*MODELS, "other")), counts, max_size=4))


@st.composite
def answer(
    draw: st.DrawFn, *, complete: bool | None = None, age: st.SearchStrategy[float] = any_age
) -> ReplicaResult:
    return ReplicaResult(
        f"10.0.0.{draw(st.integers(1, 250))}",
        OK,
        complete=draw(st.booleans()) if complete is None else complete,
        observed_at=NOW - draw(age),
        models=_snapshot_models(draw),
    )


failure = st.builds(
    ReplicaResult,
    st.sampled_from(["10.0.0.1", "10.0.0.2", "fd7a:115c:a1e0::1"]),
    st.sampled_from(FAILURES),
)
replica = answer() | failure


@st.composite
def previous_st(draw: st.DrawFn) -> LimitDecision | None:
    kind = draw(st.sampled_from(["none", "discovered", "fallback"]))
    if kind == "none":
        return None
    if kind == "fallback":
        return LimitDecision(PID, 4, "default", "x", None, None, None, 4, "default")
    limit = draw(st.integers(0, DISCOVERED_CAP))
    observed = NOW - draw(st.floats(0.0, 60.0))
    return LimitDecision(
        PID, limit, "discovered", "x", limit, observed, observed + 30, 4, "default"
    )


def probe_of(replicas: list[ReplicaResult]) -> ProviderProbe:
    return ProviderProbe(PID, tuple(replicas))


Decided = tuple[ProviderRules, LimitDecision]


@st.composite
def decided(draw: st.DrawFn, *, active: bool | None = None) -> Decided:
    """Any rules (``active``: discovery accepted or not), up to 4 replicas' answers or
    failures, any previous decision, a legacy drain or none: the rules and the decision
    they give at NOW."""
    r = draw(rules_st(active=active))
    reps = draw(st.lists(replica, max_size=4))
    prev = draw(previous_st())
    drain = draw(st.booleans())
    return r, decide(r, probe_of(reps), prev, NOW, legacy_draining=drain)


def fallback(r: ProviderRules) -> int:
    if r.provider_max is not None:
        return r.provider_max
    return r.gateway_max if r.gateway_max is not None else 4


def value_of(rep: ReplicaResult, models: tuple[str, ...]) -> int:
    """Oracle for R-L3 on a complete snapshot."""
    return min(rep.models.get(m, 0) for m in models)


def capped(value: int, r: ProviderRules) -> int:
    """Oracle for R-L4."""
    value = min(value, DISCOVERED_CAP)
    return value if r.provider_max is None else min(value, r.provider_max)


@given(decided())
def test_r_l4_discovered_limit_never_exceeds_64(case: Decided) -> None:
    _, got = case
    if got.source == "discovered":
        assert got.effective_limit <= DISCOVERED_CAP
    if got.discovered is not None:
        assert got.discovered <= DISCOVERED_CAP


@given(decided())
def test_r_l4_limit_never_exceeds_provider_max_when_set(case: Decided) -> None:
    r, got = case
    if r.provider_max is not None:
        assert got.effective_limit <= r.provider_max
        assert got.discovered is None or got.discovered <= r.provider_max


@given(
    rules_st(active=True),
    st.lists(answer(complete=False, age=fresh_age) | failure, min_size=1, max_size=4),
    previous_st(),
)
def test_r_l6_incomplete_answers_never_raise_above_base(
    r: ProviderRules, reps: list[ReplicaResult], prev: LimitDecision | None
) -> None:
    got = decide(r, probe_of(reps), prev, NOW)
    base, base_expires = fallback(r), None
    if prev is not None and prev.discovered is not None and (prev.expires_at or 0) > NOW:
        base, base_expires = prev.discovered, prev.expires_at  # last discovered, unexpired
    values = [rep.models[m] for rep in reps if rep.ok for m in r.upstream_models if m in rep.models]
    if values:  # R-L6: min(base, incomplete value), never more
        assert got.source == "discovered"
        assert got.effective_limit == capped(min(base, *values), r)
        assert got.effective_limit <= base
        # R-L7: what rests on the last discovered limit expires no later than it does
        assert got.expires_at is not None
        assert base_expires is None or got.expires_at <= base_expires
    else:  # R-L6 last sentence: counts as no answer
        assert (got.effective_limit, got.source) == (fallback(r), got.fallback_source)


@given(
    rules_st(active=True),
    st.lists(failure | answer(age=stale_age) | answer(age=future_age), max_size=4),
    previous_st(),
    st.sampled_from(["replicas", "refused", "not probed"]),
)
def test_r_l5_any_failure_gives_exactly_the_fallback(
    r: ProviderRules, reps: list[ReplicaResult], prev: LimitDecision | None, how: str
) -> None:
    p = {
        "replicas": probe_of(reps),
        "refused": ProviderProbe(PID, (), "host did not resolve"),
        "not probed": None,
    }[how]
    got = decide(r, p, prev, NOW)
    assert got.effective_limit == got.fallback_limit == fallback(r)
    assert got.source == got.fallback_source in {"provider", "gateway", "default"}
    assert (got.discovered, got.observed_at, got.expires_at) == (None, None, None)


@given(
    rules_st(active=True),
    st.lists(answer(complete=True, age=fresh_age), min_size=1, max_size=4),
    st.lists(answer(complete=False) | failure, max_size=3),
    previous_st(),
)
def test_r_l2_r_l7_replicas_give_the_minimum_never_the_sum_and_expire_from_the_oldest(
    r: ProviderRules,
    complete: list[ReplicaResult],
    others: list[ReplicaResult],
    prev: LimitDecision | None,
) -> None:
    got = decide(r, probe_of(complete + others), prev, NOW)
    assert got.source == "discovered"
    assert got.effective_limit == capped(min(value_of(c, r.upstream_models) for c in complete), r)
    # the same as the smallest replica alone: each extra replica can only lower it
    alone = [decide(r, probe_of([c]), None, NOW).effective_limit for c in complete]
    assert got.effective_limit == min(alone)
    oldest = min(c.observed_at for c in complete if c.observed_at is not None)
    assert got.observed_at == oldest
    assert got.expires_at == oldest + 30


@given(rules_st(), st.lists(replica, max_size=4), previous_st())
def test_r_g3_drain_is_0_for_opted_in_and_changes_nothing_else(
    r: ProviderRules, reps: list[ReplicaResult], prev: LimitDecision | None
) -> None:
    normal = decide(r, probe_of(reps), prev, NOW)
    drained = decide(r, probe_of(reps), prev, NOW, legacy_draining=True)
    if r.discovery_active:
        assert (drained.effective_limit, drained.source) == (0, "legacy_drain")
        assert drained.discovered == normal.discovered
        assert drained.expires_at is not None and drained.expires_at > NOW - 30.5
    else:
        assert drained == normal


@given(decided(active=False))
def test_r_l1_without_discovery_always_the_fallback(case: Decided) -> None:
    r, got = case
    assert (got.effective_limit, got.source) == (fallback(r), got.fallback_source)


@given(decided())
def test_r_l7_every_discovered_limit_expires_30s_after_its_oldest_snapshot(case: Decided) -> None:
    _, got = case
    if got.source == "legacy_drain":
        assert got.expires_at == NOW + 30  # asserted by the sidecar, not observed (R-G3)
    elif got.discovered is not None:
        assert got.observed_at is not None
        assert got.expires_at == got.observed_at + 30
    if got.source in {"provider", "gateway", "default"}:
        assert got.expires_at is None
