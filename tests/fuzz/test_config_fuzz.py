"""Fuzzing the config loader (``sidecar/config.py``, SPEC section 2).

Whatever the file holds, ``parse_config`` returns a config or raises
``ConfigError`` with one line naming the file: never another exception (R-C3).
A usable top level never fails because of one provider entry: each entry is
either kept, with a status that says why discovery is off when it is, or
skipped with its reason, and the other entries are judged as if it were not
there (R-C3). Unknown fields change nothing (R-C1); valid entries round-trip
and the fallback follows R-C2.
"""

from __future__ import annotations

import json
from typing import Any

from hypothesis import given
from hypothesis import strategies as st
from json_strategies import json_values as json_value_strategy

from sidecar.config import (
    MAX_LIMIT,
    ConfigError,
    GatewayConfig,
    parse_config,
)
from sidecar.limits import DEFAULT_FALLBACK, fallback_for

SOURCE = "/etc/gateway/fuzz.json"
KNOWN_PROVIDER_FIELDS = {
    "id",
    "type",
    "baseUrl",
    "tailnet",
    "credentialFile",
    "capacityDiscovery",
    "maxConcurrent",
    "models",
}

json_values = json_value_strategy(4, 25)
limits = st.integers(0, MAX_LIMIT)
ids = st.text(
    st.characters(min_codepoint=0x20, exclude_categories=("Cs",)), min_size=1, max_size=16
).filter(lambda s: "\x7f" not in s)


@st.composite
def good_entries(draw: st.DrawFn, provider_id: str) -> dict[str, Any]:
    """A well-typed entry: loopback discovery, or static."""
    entry: dict[str, Any] = {"id": provider_id}
    if draw(st.booleans()):
        entry.update(
            {
                "type": "chat-completions-api",
                "baseUrl": f"http://127.0.0.1:{draw(st.integers(1, 65535))}/v1",
                "credentialFile": "/private/key",
                "capacityDiscovery": True,
                "models": {"alias": draw(st.text(min_size=1, max_size=10))},
            }
        )
    if draw(st.booleans()):
        entry["maxConcurrent"] = draw(limits)
    return entry


def parse_or_config_error(data: bytes) -> GatewayConfig | None:
    try:
        cfg = parse_config(data, SOURCE)
    except ConfigError as exc:
        message = str(exc)
        assert message and "\n" not in message and SOURCE in message, repr(message)
        return None
    for p in cfg.providers:
        assert p.id in cfg.statuses
        status = cfg.statuses[p.id]
        assert status.discovery_active <= status.discovery_requested
        assert status.reason
    return cfg


@given(st.binary(max_size=300))
def test_r_c3_arbitrary_bytes_load_or_raise_config_error_only(data: bytes) -> None:
    parse_or_config_error(data)


@given(json_values)
def test_r_c3_arbitrary_json_loads_or_raises_config_error_only(value: Any) -> None:
    parse_or_config_error(json.dumps(value).encode())


@given(st.one_of(st.none(), limits), st.lists(json_values, max_size=6))
def test_r_c3_arbitrary_provider_entries_never_fail_the_whole_file(
    gateway_max: int | None, entries: list[Any]
) -> None:
    doc = {"maxConcurrent": gateway_max, "providers": entries}
    cfg = parse_config(json.dumps(doc).encode(), SOURCE)  # must not raise
    assert len(cfg.providers) + len(cfg.skipped) == len(entries)
    for p in cfg.providers:
        status = cfg.statuses[p.id]
        if not status.discovery_active:
            assert status.reason.startswith(("not_requested", "config_invalid:", "opt_in_refused:"))


@given(st.data(), st.lists(ids, min_size=2, max_size=5, unique=True), json_values)
def test_r_c3_a_bad_entry_leaves_every_other_entry_judged_the_same(
    data: st.DataObject, provider_ids: list[str], junk: Any
) -> None:
    good = [data.draw(good_entries(pid)) for pid in provider_ids]
    alone = parse_config(json.dumps({"providers": good}).encode(), SOURCE)
    victim = data.draw(st.integers(0, len(good) - 1))
    field = data.draw(st.sampled_from(sorted(KNOWN_PROVIDER_FIELDS - {"id"})))
    spoiled = [dict(e) for e in good]
    spoiled[victim][field] = junk
    mixed = parse_config(json.dumps({"providers": spoiled}).encode(), SOURCE)
    for i, pid in enumerate(provider_ids):
        if i != victim:
            assert mixed.statuses[pid] == alone.statuses[pid]
            assert mixed.provider(pid) == alone.provider(pid)
    # the spoiled entry is still there for static admission (R-A8), judged on its own
    assert mixed.provider(provider_ids[victim]) is not None


@given(
    st.lists(ids, max_size=4, unique=True),
    st.data(),
    st.dictionaries(
        st.text(max_size=10).filter(lambda k: k not in {"maxConcurrent", "providers"}),
        json_values,
        max_size=3,
    ),
)
def test_r_c1_unknown_fields_anywhere_change_nothing(
    provider_ids: list[str], data: st.DataObject, top_extra: dict[str, Any]
) -> None:
    entries = [data.draw(good_entries(pid)) for pid in provider_ids]
    plain = parse_config(json.dumps({"maxConcurrent": 5, "providers": entries}).encode(), SOURCE)
    decorated = []
    for e in entries:
        extra = data.draw(
            st.dictionaries(
                st.text(max_size=10).filter(lambda k: k not in KNOWN_PROVIDER_FIELDS),
                json_values,
                max_size=3,
            )
        )
        decorated.append({**extra, **e})
    doc = {**top_extra, "maxConcurrent": 5, "providers": decorated}
    noisy = parse_config(json.dumps(doc).encode(), SOURCE)
    assert noisy.providers == plain.providers
    assert noisy.statuses == plain.statuses
    assert noisy.max_concurrent == plain.max_concurrent


@given(st.one_of(st.none(), limits), st.lists(ids, max_size=4, unique=True), st.data())
def test_r_c2_valid_entries_round_trip_and_fall_back_in_order(
    gateway_max: int | None, provider_ids: list[str], data: st.DataObject
) -> None:
    entries = [data.draw(good_entries(pid)) for pid in provider_ids]
    doc: dict[str, Any] = {"providers": entries}
    if gateway_max is not None:
        doc["maxConcurrent"] = gateway_max
    cfg = parse_config(json.dumps(doc).encode(), SOURCE)
    assert cfg.skipped == ()
    assert [p.id for p in cfg.providers] == provider_ids
    for e, p in zip(entries, cfg.providers, strict=True):
        assert p.base_url == e.get("baseUrl")
        assert p.capacity_discovery is e.get("capacityDiscovery", False)
        assert p.max_concurrent == e.get("maxConcurrent")
        assert dict(p.models) == e.get("models", {})
        expected = e.get("maxConcurrent", gateway_max)
        limit, source = fallback_for(p.max_concurrent, cfg.max_concurrent)
        assert limit == (DEFAULT_FALLBACK if expected is None else expected)
        assert source == (
            "provider"
            if "maxConcurrent" in e
            else "gateway"
            if gateway_max is not None
            else "default"
        )
        assert cfg.statuses[p.id].discovery_active is e.get("capacityDiscovery", False)


@given(
    st.one_of(
        st.integers(max_value=-1),
        st.integers(min_value=MAX_LIMIT + 1),
        st.floats(),
        st.text(max_size=4),
        st.booleans(),
    )
)
def test_r_c3_a_bad_top_level_limit_is_one_config_error(bad: Any) -> None:
    body = json.dumps({"maxConcurrent": bad, "providers": []}).encode()
    assert parse_or_config_error(body) is None
