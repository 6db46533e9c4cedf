"""Fuzzing the capacity-contract decoder (``capacity_contract/__init__.py``, SPEC section 4).

Whatever a router sends, ``decode_snapshot`` either returns a snapshot that
keeps every limit of R-K1..R-K4 or raises ``ContractError`` with a one-line
reason: never another exception. Valid documents round-trip, and unknown fields
are ignored (R-K6).
"""

from __future__ import annotations

import json
import math
from typing import Any

import msgspec
import pytest
from hypothesis import assume, given
from hypothesis import strategies as st
from json_strategies import json_values as json_value_strategy

from capacity_contract import (
    MAX_FUTURE_S,
    MAX_MODELS,
    MAX_SLOTS,
    MAX_TOKENS,
    STALE_AFTER_S,
    CapacitySnapshot,
    ContractError,
    ModelCapacity,
    check_freshness,
    decode_snapshot,
    encode_snapshot,
    worst_case_snapshot_bytes,
)

json_values = json_value_strategy(5, 30)
TOKEN_FIELDS = ("max_request_tokens", "max_running_tokens")
ROW_FIELDS = {"id", "max_concurrent_requests", *TOKEN_FIELDS}
model_ids = st.text(min_size=1, max_size=16) | st.text(min_size=250, max_size=256)
slot_counts = st.integers(0, MAX_SLOTS)
token_counts = st.integers(0, MAX_TOKENS) | st.sampled_from([0, MAX_TOKENS])
finite_times = st.floats(0, 4e9, allow_nan=False, allow_infinity=False)
unknown_fields = st.dictionaries(
    st.text(max_size=12).filter(
        lambda k: k not in {"object", "version", "complete", "observed_at", "models"}
    ),
    json_values,
    max_size=3,
)


@st.composite
def valid_docs(draw: st.DrawFn) -> dict[str, Any]:
    # up to 128 rows (R-K2) now and then; a handful usually, to keep the run brief
    size = draw(st.sampled_from([3, 3, 3, MAX_MODELS]))
    ids = draw(st.lists(model_ids, max_size=size, unique=True))
    rows = []
    for model in ids:
        row: dict[str, Any] = {"id": model, "max_concurrent_requests": draw(slot_counts)}
        for name in TOKEN_FIELDS:  # R-K7: each optional
            if draw(st.booleans()):
                row[name] = draw(token_counts)
        row.update(
            draw(
                st.dictionaries(
                    st.text(max_size=8).filter(lambda k: k not in ROW_FIELDS),
                    json_values,
                    max_size=2,
                )
            )
        )
        rows.append(row)
    doc: dict[str, Any] = {
        "object": "inference_capacity",
        "version": 1,
        "complete": draw(st.booleans()),
        "observed_at": draw(finite_times | st.integers(0, 4_000_000_000)),
        "models": rows,
    }
    doc.update(draw(unknown_fields))
    return doc


def decode_or_contract_error(body: bytes) -> CapacitySnapshot | None:
    """The decoder's only two outcomes; anything else fails the test."""
    try:
        snap = decode_snapshot(body)
    except ContractError as exc:
        reason = str(exc)
        assert reason and "\n" not in reason, repr(reason)
        return None
    assert_within_limits(snap)
    return snap


def assert_within_limits(snap: CapacitySnapshot) -> None:
    assert snap.object == "inference_capacity" and snap.version == 1  # R-K1
    assert isinstance(snap.complete, bool)
    assert isinstance(snap.observed_at, float) and math.isfinite(snap.observed_at)  # R-K4
    assert len(snap.models) <= MAX_MODELS  # R-K2
    assert len({m.id for m in snap.models}) == len(snap.models)
    for m in snap.models:  # R-K3
        assert type(m.max_concurrent_requests) is int
        assert 0 <= m.max_concurrent_requests <= MAX_SLOTS
        for value in (m.request_tokens, m.running_tokens):  # R-K7
            assert value is None or (type(value) is int and 0 <= value <= MAX_TOKENS)


@given(st.binary(max_size=400))
def test_r_k1_arbitrary_bytes_decode_or_raise_contract_error_only(body: bytes) -> None:
    decode_or_contract_error(body)


@given(json_values)
def test_r_k1_arbitrary_json_decodes_or_raises_contract_error_only(value: Any) -> None:
    decode_or_contract_error(json.dumps(value).encode())


@given(valid_docs(), st.data())
def test_r_k1_r_k3_mutated_valid_documents_never_escape_the_limits(
    doc: dict[str, Any], data: st.DataObject
) -> None:
    # Replace one value somewhere in a valid document by an arbitrary JSON value.
    target: Any = doc
    if doc["models"] and data.draw(st.booleans()):
        target = data.draw(st.sampled_from(doc["models"]))
    key = data.draw(st.sampled_from(sorted(target)))
    target[key] = data.draw(json_values)
    decode_or_contract_error(json.dumps(doc).encode())


@given(valid_docs())
def test_r_k6_valid_documents_decode_with_unknown_fields_ignored_and_round_trip(
    doc: dict[str, Any],
) -> None:
    body = json.dumps(doc).encode()
    snap = decode_snapshot(body)
    assert snap.complete is doc["complete"]
    assert snap.observed_at == float(doc["observed_at"])
    assert [(m.id, m.max_concurrent_requests) for m in snap.models] == [
        (r["id"], r["max_concurrent_requests"]) for r in doc["models"]
    ]
    assert [(m.request_tokens, m.running_tokens) for m in snap.models] == [
        (r.get("max_request_tokens"), r.get("max_running_tokens")) for r in doc["models"]
    ]
    assert decode_snapshot(encode_snapshot(snap)) == snap
    assert len(encode_snapshot(snap)) <= worst_case_snapshot_bytes(m.id for m in snap.models)


@given(valid_docs(), st.integers(1, 3))
def test_r_k2_more_than_128_rows_or_a_duplicate_id_is_invalid(
    doc: dict[str, Any], extra: int
) -> None:
    if doc["models"]:
        doc["models"].append(dict(doc["models"][0]))  # a duplicate id
    else:
        doc["models"] = [
            {"id": f"m{i}", "max_concurrent_requests": 1} for i in range(MAX_MODELS + extra)
        ]
    with pytest.raises(ContractError):
        decode_snapshot(json.dumps(doc).encode())


bad_counts = (
    st.integers(max_value=-1)
    | st.integers(min_value=MAX_SLOTS + 1)
    | st.booleans()
    | st.floats()
    | st.text(max_size=5)
    | st.none()
)


@given(valid_docs(), bad_counts)
def test_r_k3_a_count_that_is_not_an_integer_0_to_4096_makes_the_snapshot_invalid(
    doc: dict[str, Any], bad: Any
) -> None:
    assume(doc["models"])
    doc["models"][-1]["max_concurrent_requests"] = bad
    body = json.dumps(doc).encode()  # floats nan/inf become NaN/Infinity tokens
    with pytest.raises(ContractError):
        decode_snapshot(body)


@given(valid_docs(), st.sampled_from(["NaN", "Infinity", "-Infinity", "1e400", "-1e400"]))
def test_r_k4_observed_at_must_be_finite(doc: dict[str, Any], token: str) -> None:
    doc["observed_at"] = 0.5
    body = json.dumps(doc).replace('"observed_at": 0.5', f'"observed_at": {token}').encode()
    with pytest.raises(ContractError):
        decode_snapshot(body)


@given(
    valid_docs(),
    st.sampled_from(["object", "version", "complete", "observed_at", "models"]),
    st.booleans(),
)
def test_r_k1_a_missing_or_wrong_required_field_is_invalid(
    doc: dict[str, Any], field: str, remove: bool
) -> None:
    wrong = {
        "object": "capacity",
        "version": 2,
        "complete": "true",
        "observed_at": "now",
        "models": {},
    }
    if remove:
        del doc[field]
    else:
        doc[field] = wrong[field]
    with pytest.raises(ContractError):
        decode_snapshot(json.dumps(doc).encode())


@given(valid_docs(), st.sampled_from(["", "x" * 257]))
def test_r_k2_a_model_id_that_is_empty_or_over_256_characters_is_invalid(
    doc: dict[str, Any], model: str
) -> None:
    doc["models"].append({"id": model, "max_concurrent_requests": 1})
    with pytest.raises(ContractError):
        decode_snapshot(json.dumps(doc).encode())


@given(finite_times, st.floats(-1e6, 1e6, allow_nan=False))
def test_r_k4_freshness_is_stale_after_30s_and_future_beyond_5s(now: float, age: float) -> None:
    snap = CapacitySnapshot("inference_capacity", 1, True, now - age, [])
    verdict = check_freshness(snap, now)
    if snap.observed_at > now + MAX_FUTURE_S:
        assert verdict == "future"
    elif now - snap.observed_at > STALE_AFTER_S:
        assert verdict == "stale"
    else:
        assert verdict is None


bad_tokens = (
    st.integers(max_value=-1)
    | st.integers(min_value=MAX_TOKENS + 1)
    | st.booleans()
    | st.floats()
    | st.text(max_size=5)
    | st.none()
)


@given(valid_docs(), st.sampled_from(TOKEN_FIELDS), bad_tokens)
def test_r_k7_a_token_field_that_is_not_an_integer_0_to_2_31_makes_the_snapshot_invalid(
    doc: dict[str, Any], name: str, bad: Any
) -> None:
    assume(doc["models"])
    doc["models"][-1][name] = bad  # null too: absent is the only way to say "unknown"
    with pytest.raises(ContractError):
        decode_snapshot(json.dumps(doc).encode())


class _FirstRow(msgspec.Struct):
    """A row as the first contract's decoder knew it (before R-K7), unknown fields ignored."""

    id: str
    max_concurrent_requests: int


class _FirstSnapshot(msgspec.Struct):
    object: str
    version: int
    complete: bool
    observed_at: float
    models: list[_FirstRow]


_first_decoder = msgspec.json.Decoder(_FirstSnapshot, strict=True)


@given(valid_docs())
def test_r_k6_r_k7_a_reader_without_the_token_fields_reads_a_snapshot_with_them(
    doc: dict[str, Any],
) -> None:
    old = _first_decoder.decode(encode_snapshot(decode_snapshot(json.dumps(doc).encode())))
    assert [(m.id, m.max_concurrent_requests) for m in old.models] == [
        (r["id"], r["max_concurrent_requests"]) for r in doc["models"]
    ]


@given(valid_docs())
def test_r_k7_a_snapshot_without_the_token_fields_reads_as_unknown(doc: dict[str, Any]) -> None:
    for row in doc["models"]:
        for name in TOKEN_FIELDS:
            row.pop(name, None)
    snap = decode_snapshot(json.dumps(doc).encode())
    assert all(m.request_tokens is None and m.running_tokens is None for m in snap.models)
    rows = json.loads(encode_snapshot(snap))["models"]
    assert all(set(row) == {"id", "max_concurrent_requests"} for row in rows)


def test_r_k7_unknown_token_fields_are_left_out_of_the_body_not_written_null() -> None:
    row = ModelCapacity(id="m", max_concurrent_requests=2)
    assert msgspec.json.encode(row) == b'{"id":"m","max_concurrent_requests":2}'
    row.max_running_tokens = 1536
    assert msgspec.json.encode(row) == (
        b'{"id":"m","max_concurrent_requests":2,"max_running_tokens":1536}'
    )


def test_r_k7_the_worst_case_counts_both_token_fields_at_their_bound() -> None:
    ids = ["a", "\u202e" * 10, "x" * 256]
    snap = CapacitySnapshot(
        "inference_capacity",
        1,
        False,
        -2.2250738585072014e-308,
        [
            ModelCapacity(
                id=m,
                max_concurrent_requests=MAX_SLOTS,
                max_request_tokens=MAX_TOKENS,
                max_running_tokens=MAX_TOKENS,
            )
            for m in ids
        ],
    )
    assert len(encode_snapshot(snap)) == worst_case_snapshot_bytes(ids)
