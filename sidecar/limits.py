"""The effective admission limit of one provider (REQUIREMENTS.md section 5), as one pure function.

Invariant: a provider's published limit is exactly one of

* its **fallback** ``provider.maxConcurrent ?? gateway.maxConcurrent ?? 4``
  (source ``provider``/``gateway``/``default``, no expiry), whenever discovery
  is off or refused (R-L1) or gave no usable answer this refresh (R-L5);
* a **discovered** value: at most 64, at most ``provider.maxConcurrent`` when
  set (R-L4), never more than the smallest complete fresh replica says
  (R-L2, R-L3) nor, from incomplete answers alone, more than its base (R-L6);
  it expires 30 s after the oldest snapshot it rests on, so
  ``expires_at == observed_at + 30`` always (R-L7);
* **0** with source ``legacy_drain`` while a legacy generation drains and
  discovery is active (R-G3).

Beside the limit, a discovered decision carries the provider's token budget (R-L10):
``token_limit`` (what all its running requests may hold together) and
``request_token_limit`` (the most one request may hold), each the minimum over the
complete replicas (R-L2) of the minimum over the upstream models (R-L3) of what the
rows state; 0 (no token budget, admission on slots alone) when any of those rows does
not state it. A fallback decision has neither (both 0): they lapse with the
discovered limit. An incomplete-only refresh (R-L6) may tighten the last discovered
budget, never loosen it (0 is the loosest: no budget).

``decide`` reads no clock and does no I/O: ``now`` is an argument, the probe
results and the previous decision are plain values. The daemon around it only
probes, times and publishes.

Field meanings worth knowing:

* ``LimitDecision.discovered`` is the value discovery puts in force *after*
  the caps (what ``effective_limit`` is, or would be during a legacy drain),
  ``None`` when discovery gave nothing. The uncapped value is in ``reason``.
* ``observed_at`` is the oldest ``observed_at`` among the snapshots the
  discovered value rests on. For an incomplete-only refresh (R-L6) whose base
  is the last discovered value, that value's snapshots count too, so its
  ``expires_at`` is ``min(base's expires_at, incomplete observed_at + 30)``.
* R-L6's base is ``previous.discovered`` while ``previous.expires_at > now``,
  else the fallback. Reading ``discovered`` rather than ``source`` keeps the
  base across a legacy drain.
* A ``legacy_drain`` decision carries the discovered fields as computed (so an
  operator sees what applies once the drain ends) and expires with them; with
  no discovered value it expires 30 s after ``now``. Either way a sidecar that
  dies mid-drain cannot leave the provider at 0 for ever.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Final

from capacity_contract import MAX_FUTURE_S, STALE_AFTER_S

# the fallback chain is the config's (handlers read it without the sidecar); named here too
from gateway_config import DEFAULT_FALLBACK as DEFAULT_FALLBACK
from gateway_config import FallbackSource as FallbackSource
from gateway_config import fallback_for as fallback_for
from shm_layout.layout import Source
from sidecar.replica import OK, ProviderProbe, ReplicaResult

if TYPE_CHECKING:  # attribute access only: importing limits pulls in no config machinery
    from shm_layout.view import ProviderView
    from sidecar.config import GatewayConfig

DISCOVERED_CAP: Final = 64  # R-L4
SNAPSHOT_TTL_S: Final = STALE_AFTER_S  # R-L7: a discovered limit lives 30 s past its snapshot

# Short names of shm_layout.layout.Source's members. SHARE is set by the daemon in share
# mode (sidecar.shares), never by decide.
DISCOVERED: Final = Source.DISCOVERED
LEGACY_DRAIN: Final = Source.LEGACY_DRAIN
SHARE: Final = Source.SHARE
SOURCES: Final = frozenset(Source)

_DETAIL_MAX = 80  # keep reasons short; a detail is a phrase, never a body
# probe refusals that mean "not opted in" (R-L1), as opposed to an opted-in provider
# whose probe failed (unreachable, timeout, credential_error, listener_refused: R-L5)
OPT_IN_REFUSED: Final = ("not_requested", "config_invalid", "opt_in_refused", "address_refused")
_OPT_IN_REFUSED = OPT_IN_REFUSED


@dataclass(frozen=True, slots=True)
class ProviderRules:
    """What section 5 needs from one provider's config entry.

    ``discovery_active`` is "opted in and the opt-in accepted";
    ``refused_reason`` says why not, when it is not.
    """

    provider_id: str
    discovery_active: bool
    provider_max: int | None
    gateway_max: int | None
    upstream_models: tuple[str, ...]
    refused_reason: str | None = None


@dataclass(frozen=True, slots=True)
class JudgedReplica:
    """One replica as an operator sees it (section 8 ``replicas``).

    ``ok`` means valid and fresh at ``now``; ``reason`` is the probe's closed
    name, re-checked against ``now`` (an "ok" answer that aged out reads
    "stale"). ``value`` is the snapshot's value for this provider (R-L3, R-L6)
    or ``None`` when it has none.
    """

    address: str
    ok: bool
    complete: bool
    value: int | None
    reason: str
    detail: str
    observed_at: float | None
    token_limit: int = 0  # what the answer states for the provider (R-L10), 0: nothing
    request_token_limit: int = 0


@dataclass(frozen=True, slots=True)
class LimitDecision:
    provider_id: str
    effective_limit: int
    source: Source
    reason: str
    discovered: int | None
    observed_at: float | None
    expires_at: float | None
    fallback_limit: int
    fallback_source: Source  # one of layout.FALLBACK_SOURCES
    replicas: tuple[JudgedReplica, ...] = ()
    # configured upstream models a complete answer did not report: a typo in ``models``
    # or a model the farm no longer serves; the limit is 0 (R-L3) and worth a WARNING
    missing_models: tuple[str, ...] = ()
    # ``expires_at`` on the host's deadline clock, fixed by the daemon when the decision
    # is made (R-L7: the wall clock is judged once, then a step of it moves nothing);
    # None: not yet anchored (a pure decision), or nothing expires
    expires_mono: float | None = None
    # the token budget (R-L10): 0 = none, admission on slots alone; only a discovered
    # (or drained) decision carries one, and it expires with the limit
    token_limit: int = 0
    request_token_limit: int = 0


def rules_from_config(config: GatewayConfig) -> tuple[ProviderRules, ...]:
    """One :class:`ProviderRules` per provider of a judged config, in file order."""
    rules = []
    for provider in config.providers:
        status = config.statuses.get(provider.id)
        active = status is not None and status.discovery_active
        refused = None
        if status is not None and status.discovery_requested and not active:
            refused = f"discovery refused: {status.reason}"
        rules.append(
            ProviderRules(
                provider_id=provider.id,
                discovery_active=active,
                provider_max=provider.max_concurrent,
                gateway_max=config.max_concurrent,
                upstream_models=tuple(sorted(provider.upstream_models)),
                refused_reason=refused,
            )
        )
    return tuple(rules)


def snapshot_value(
    models: Mapping[str, int], upstream_models: Iterable[str], *, complete: bool
) -> int | None:
    """A snapshot's value for a provider: the minimum over its upstream models.

    Complete (R-L3, R-L8): a missing model has 0 slots. Incomplete (R-L6): a
    missing model is unknown, so the minimum is over the models present, and
    ``None`` when none is.
    """
    wanted = tuple(upstream_models)
    if not wanted:
        return None
    if complete:
        return min(models.get(model, 0) for model in wanted)
    known = [models[model] for model in wanted if model in models]
    return min(known) if known else None


def token_value(stated: Mapping[str, int], upstream_models: Iterable[str]) -> int:
    """A snapshot's token value for a provider (R-L10): the minimum over its upstream
    models of what their rows state, 0 (no token budget) when any row does not state
    it (absent, or a model the answer does not list)."""
    wanted = tuple(upstream_models)
    if not wanted or any(model not in stated for model in wanted):
        return 0
    return min(stated[model] for model in wanted)


def tightest(values: Iterable[int]) -> int:
    """The tightest of several token budgets, 0 (none) counting as the loosest."""
    stated = [value for value in values if value > 0]
    return min(stated) if stated else 0


def view_replica(
    replica: ReplicaResult, upstream_models: Iterable[str], now: float
) -> JudgedReplica:
    reason, detail = _recheck(replica, now)
    ok = reason == OK
    wanted = tuple(upstream_models)
    value = snapshot_value(replica.models, wanted, complete=replica.complete) if ok else None
    if ok and not replica.complete:  # R-L6: an absent model is unknown, not "no budget"
        wanted = tuple(model for model in wanted if model in replica.models)
    return JudgedReplica(
        address=replica.address,
        ok=ok,
        complete=replica.complete,
        value=value,
        reason=reason,
        detail=detail,
        observed_at=replica.observed_at,
        token_limit=token_value(replica.running_tokens, wanted) if ok else 0,
        request_token_limit=token_value(replica.request_tokens, wanted) if ok else 0,
    )


def decide(
    rules: ProviderRules,
    probe: ProviderProbe | None,
    previous: LimitDecision | None,
    now: float,
    *,
    legacy_draining: bool = False,
) -> LimitDecision:
    """The effective limit of one provider for this refresh (section 5, R-G3).

    ``probe`` is this refresh's result (``None``: not probed yet);
    ``previous`` is the last decision published for this provider, if any.
    """
    if probe is not None and probe.provider_id != rules.provider_id:
        raise ValueError(f"probe for {probe.provider_id!r} given for {rules.provider_id!r}")
    if previous is not None and previous.provider_id != rules.provider_id:
        raise ValueError(f"previous for {previous.provider_id!r} given for {rules.provider_id!r}")

    fallback, fallback_source = fallback_for(rules.provider_max, rules.gateway_max)

    def static(reason: str, replicas: tuple[JudgedReplica, ...] = ()) -> LimitDecision:
        return LimitDecision(
            provider_id=rules.provider_id,
            effective_limit=fallback,
            source=fallback_source,
            reason=reason,
            discovered=None,
            observed_at=None,
            expires_at=None,
            fallback_limit=fallback,
            fallback_source=fallback_source,
            replicas=replicas,
        )

    # R-L1, R-C4: without discovery nothing else matters, not even a drain.
    if not rules.discovery_active:
        return static(rules.refused_reason or "capacityDiscovery off")

    pairs = [
        (replica, view_replica(replica, rules.upstream_models, now))
        for replica in (probe.replicas if probe is not None else ())
    ]
    views = tuple(view for _, view in pairs)
    if not rules.upstream_models:
        found: _Found | str = "no upstream models configured"
    elif probe is None:
        found = "no valid answer: not probed yet"
    elif probe.refused is not None:
        found = probe.refused
    else:
        found = _discover(rules, pairs, previous, now, fallback)

    if isinstance(found, str) and found.startswith(_OPT_IN_REFUSED):
        return static(found, views)  # R-L1: refused at probe time is not opted in, drain or not
    if isinstance(found, str):  # R-L5: fallback at once
        decision = static(found, views)
    else:
        decision = LimitDecision(
            provider_id=rules.provider_id,
            effective_limit=found.limit,
            source=DISCOVERED,
            reason=found.reason,
            discovered=found.limit,
            observed_at=found.observed_at,
            expires_at=found.observed_at + SNAPSHOT_TTL_S,
            fallback_limit=fallback,
            fallback_source=fallback_source,
            replicas=views,
            missing_models=_absent_models(pairs, rules.upstream_models),
            token_limit=found.token_limit,
            request_token_limit=found.request_token_limit,
        )
    return _drain(decision, now) if legacy_draining else decision  # R-G3


def decide_all(
    rules: Iterable[ProviderRules],
    probes: Mapping[str, ProviderProbe],
    previous: Mapping[str, LimitDecision],
    now: float,
    *,
    legacy_draining: bool = False,
) -> dict[str, LimitDecision]:
    """:func:`decide` for every provider, keyed by provider id."""
    return {
        r.provider_id: decide(
            r,
            probes.get(r.provider_id),
            previous.get(r.provider_id),
            now,
            legacy_draining=legacy_draining,
        )
        for r in rules
    }


# --- a decision read back from the segment -------------------------------

_KEPT_PREFIX: Final = "kept from the previous sidecar until the first probe: "


def previous_from_view(seen: ProviderView) -> LimitDecision | None:
    """The decision a segment's provider row records, as :func:`decide`'s ``previous``.

    ``None`` when the row records no discovered value (R-L6 then has no base but
    the fallback).
    """
    if seen.discovered is None:
        return None
    return _recorded(seen, seen.source, seen.reason, seen.discovered)


def inherited_from_view(seen: ProviderView, now: float) -> LimitDecision | None:
    """A discovered limit the previous sidecar left in force, unexpired at ``now`` (R-L7, R-G5).

    ``None`` when the row holds no such limit.
    """
    if seen.source != DISCOVERED or seen.expires_at is None or seen.expires_at <= now:
        return None
    reason = seen.reason if seen.reason.startswith(_KEPT_PREFIX) else _KEPT_PREFIX + seen.reason
    return _recorded(seen, DISCOVERED, reason, seen.effective_limit)


def _recorded(seen: ProviderView, source: Source, reason: str, discovered: int) -> LimitDecision:
    """The decision a provider row records: its limit, times and fallback, as they are,
    and the token budget published with it (R-L10), except a share's: that is this
    gateway's part of the pool, not what the farm stated."""
    tokens = source != SHARE
    return LimitDecision(
        provider_id=seen.id,
        effective_limit=seen.effective_limit,
        source=source,
        reason=reason,
        discovered=discovered,
        observed_at=seen.observed_at,
        expires_at=seen.expires_at,
        fallback_limit=seen.fallback_limit,
        fallback_source=seen.fallback_source,
        token_limit=(seen.token_limit or 0) if tokens else 0,
        request_token_limit=(seen.request_token_limit or 0) if tokens else 0,
    )


def keep_inherited(
    decision: LimitDecision, kept: LimitDecision, rules: ProviderRules, now: float
) -> LimitDecision | None:
    """The inherited limit in place of ``decision`` until the first probe, or ``None``.

    A restart does not undo a limit in force (R-L7, R-G5): until a provider's
    first probe, an unexpired inherited limit stays, under this config's caps
    (R-L4). ``None`` when it does not apply: ``decision`` is not a fallback (a
    legacy drain, say) or ``kept`` has expired.
    """
    if decision.source != decision.fallback_source:
        return None
    if kept.expires_at is None or kept.expires_at <= now:
        return None
    limit, _ = _cap(kept.effective_limit, rules.provider_max)
    return replace(
        kept,
        effective_limit=limit,
        discovered=limit,
        fallback_limit=decision.fallback_limit,
        fallback_source=decision.fallback_source,
    )


# --- the discovered value -------------------------------------------------


@dataclass(frozen=True, slots=True)
class _Found:
    limit: int  # after the caps
    reason: str
    observed_at: float  # oldest snapshot it rests on
    token_limit: int = 0  # R-L10
    request_token_limit: int = 0


def _discover(
    rules: ProviderRules,
    pairs: list[tuple[ReplicaResult, JudgedReplica]],
    previous: LimitDecision | None,
    now: float,
    fallback: int,
) -> _Found | str:
    """The discovered value, or the reason there is none (R-L2..R-L6)."""
    answers = [(r, v, v.value) for r, v in pairs if v.ok and v.value is not None]
    complete = [(r, v, value) for r, v, value in answers if v.complete]
    incomplete = [(v, value) for _, v, value in answers if not v.complete]

    if complete:  # R-L2: the minimum over complete replicas; incomplete ones are ignored
        raw = min(value for _, _, value in complete)
        limit, cap_text = _cap(raw, rules.provider_max)
        parts = [f"discovered {raw}"]
        if len(complete) > 1:
            parts.append(f"minimum of {len(complete)} complete replicas")
        missing = _missing_models(complete, rules.upstream_models, raw)
        if missing:
            parts.append(missing)
        if cap_text:
            parts.append(cap_text)
        if incomplete:
            parts.append("ignored incomplete " + ", ".join(v.address for v, _ in incomplete))
        observed = min(_observed(v) for _, v, _ in complete)
        # R-L2 for tokens: the minimum, and one replica that does not say means none
        tokens = min(v.token_limit for _, v, _ in complete)
        request_tokens = min(v.request_token_limit for _, v, _ in complete)
        if tokens:
            parts.append(f"{tokens} tokens running, {request_tokens or 'unknown'} a request")
        return _Found(limit, ", ".join(parts), observed, tokens, request_tokens)

    if incomplete:  # R-L6: only incomplete answers; they may lower, never raise
        raw = min(value for _, value in incomplete)
        observed = min(_observed(v) for v, _ in incomplete)
        base, base_name = fallback, "fallback"
        base_tokens = base_request_tokens = 0
        if (
            previous is not None
            and previous.discovered is not None
            and previous.observed_at is not None
            and previous.expires_at is not None
            and previous.expires_at > now
        ):
            base, base_name = previous.discovered, "last discovered"
            base_tokens, base_request_tokens = previous.token_limit, previous.request_token_limit
            observed = min(observed, previous.observed_at)
        limit, cap_text = _cap(min(raw, base), rules.provider_max)
        answers_text = ", ".join(f"{v.address} {value}" for v, value in incomplete)
        plural = "s" if len(incomplete) > 1 else ""
        reason = f"only incomplete answer{plural} ({answers_text}), cannot raise {base_name} {base}"
        if cap_text:
            reason += f", {cap_text}"
        views = [v for v, _ in incomplete]
        # R-L6 for tokens: tighten the base's budget, never loosen it
        tokens = tightest([base_tokens, *(v.token_limit for v in views)])
        request_tokens = tightest([base_request_tokens, *(v.request_token_limit for v in views)])
        return _Found(limit, reason, observed, tokens, request_tokens)

    return "no valid answer: " + (
        "; ".join(_failure_text(v) for _, v in pairs) if pairs else "no replica answered"
    )


def _cap(value: int, provider_max: int | None) -> tuple[int, str]:
    """R-L4: at most 64 and at most provider.maxConcurrent; the text names what bit."""
    if provider_max is not None and provider_max <= DISCOVERED_CAP and value > provider_max:
        return provider_max, f"capped by provider maxConcurrent {provider_max}"
    if value > DISCOVERED_CAP:
        return DISCOVERED_CAP, f"capped at {DISCOVERED_CAP}"
    return value, ""


def _drain(then: LimitDecision, now: float) -> LimitDecision:
    """0 while a legacy generation drains, carrying ``then``, the decision that applies
    once it ends (its discovered value, snapshots and replicas, or its fallback)."""
    reason = "legacy handler generation draining: new admissions wait"
    if then.source == DISCOVERED:
        reason += f"; then discovered {then.discovered}"
    else:
        reason += f"; then fallback {then.fallback_limit} ({then.reason})"
    # The drain is this sidecar's own assertion, not an observation: it holds for
    # SNAPSHOT_TTL_S from now (the daemon re-asserts it well before that), so it never
    # lapses between refreshes and lapses soon after a sidecar that died mid-drain.
    return replace(
        then,
        effective_limit=0,
        source=LEGACY_DRAIN,
        reason=reason,
        expires_at=now + SNAPSHOT_TTL_S,
        missing_models=(),
    )


# --- small helpers --------------------------------------------------------


def _recheck(replica: ReplicaResult, now: float) -> tuple[str, str]:
    """The probe already judged freshness; judge it again against our ``now`` (R-K4)."""
    if not replica.ok:
        return replica.reason, replica.detail
    observed = replica.observed_at
    if observed is None or not math.isfinite(observed):
        return "invalid", "observed_at missing or not finite"
    if observed > now + MAX_FUTURE_S:
        return "future", f"observed_at {observed - now:.1f}s ahead"
    if now - observed > STALE_AFTER_S:
        return "stale", f"observed_at {now - observed:.1f}s old"
    return OK, replica.detail


def _observed(view: JudgedReplica) -> float:
    assert view.observed_at is not None  # an ok view always has one (_recheck)
    return view.observed_at


def _absent_models(
    pairs: list[tuple[ReplicaResult, JudgedReplica]], upstream_models: tuple[str, ...]
) -> tuple[str, ...]:
    """Configured upstream models that some valid, complete answer does not list."""
    absent = {
        m
        for replica, view in pairs
        if view.ok and view.complete
        for m in upstream_models
        if m not in replica.models
    }
    return tuple(sorted(absent))


def _missing_models(
    complete: list[tuple[ReplicaResult, JudgedReplica, int]],
    upstream_models: tuple[str, ...],
    raw: int,
) -> str:
    """R-L8: when a missing model is why the value is 0, say which one and where."""
    if raw != 0:
        return ""
    for replica, view, _ in complete:
        absent = [m for m in upstream_models if m not in replica.models]
        if absent:
            plural = "s" if len(absent) > 1 else ""
            return (
                f"upstream model{plural} {', '.join(absent)} missing from {view.address} "
                "(check models in the config)"
            )
    return ""


def _failure_text(view: JudgedReplica) -> str:
    if view.ok:  # valid but incomplete and without any of the provider's models
        return f"{view.address} incomplete without the provider's models"
    detail = view.detail
    if len(detail) > _DETAIL_MAX:
        detail = detail[: _DETAIL_MAX - 1] + "…"
    return f"{view.address} {view.reason}" + (f" ({detail})" if detail else "")
