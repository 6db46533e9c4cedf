"""R-K5 aggregation rules on the pure function: a table, then a property."""

from __future__ import annotations

import msgspec
from hypothesis import given, settings
from hypothesis import strategies as st

from capacity_contract import MAX_SLOTS, decode_snapshot, encode_snapshot
from capacity_router import Observation, Worker, aggregate

NOW = 1_800_000_000.25


def w(worker_id: str, *models: str, fenced: bool = False) -> Worker:
    return msgspec.convert(
        {
            "id": worker_id,
            "urls": [f"http://{worker_id}.example:8080"],
            "models": list(models),
            "slots": {"source": "props"},
            "fenced": fenced,
        },
        Worker,
    )


def ok(n: int) -> Observation:
    return Observation("ok", n, "props")


UNREADABLE = Observation("unreadable", reason="/props answered 500")
UNHEALTHY = Observation("unhealthy", reason="/health answered 503")
UNREACHABLE = Observation("unreachable", reason="connection failed")


def rows(snapshot: object) -> dict[str, int]:
    return {m.id: m.max_concurrent_requests for m in snapshot.models}  # type: ignore[attr-defined]


def test_r_k5_two_ten_slot_workers_advertise_twenty() -> None:
    snap = aggregate([w("a", "wh"), w("b", "wh")], set(), {"a": ok(10), "b": ok(10)}, NOW)
    assert rows(snap) == {"wh": 20}
    assert snap.complete is True
    assert snap.observed_at == NOW
    assert (snap.object, snap.version) == ("inference_capacity", 1)


def test_r_k5_a_worker_listed_twice_counts_once() -> None:
    snap = aggregate([w("a", "wh"), w("a", "wh")], set(), {"a": ok(10)}, NOW)
    assert rows(snap) == {"wh": 10}


def test_r_k5_aliases_share_the_scheduler_slots_count_once_per_model_id() -> None:
    snap = aggregate(
        [w("a", "wh", "wh-long", "wh"), w("b", "wh")], set(), {"a": ok(10), "b": ok(4)}, NOW
    )
    assert rows(snap) == {"wh": 14, "wh-long": 10}


def test_r_k5_per_model_counts_zero_for_an_id_the_worker_does_not_list() -> None:
    per_model = Observation("ok", 10, "vllm", per_model={"wh": 10}, unserved=("typo",))
    snap = aggregate(
        [w("a", "wh", "typo"), w("b", "typo")], set(), {"a": per_model, "b": ok(3)}, NOW
    )
    assert rows(snap) == {"typo": 3, "wh": 10}
    assert snap.complete is True


def test_r_k5_model_loading_on_a_multi_model_worker_is_unknown_alone() -> None:
    obs = Observation("ok", 4, "llama-server-router", per_model={"a": 4}, unknown=frozenset({"b"}))
    snap = aggregate([w("x", "a", "b")], set(), {"x": obs}, NOW)
    assert rows(snap) == {"a": 4}
    assert snap.complete is False


def test_r_k5_fenced_workers_do_not_count_in_file_or_by_admin() -> None:
    workers = [w("a", "wh", fenced=True), w("b", "wh"), w("c", "wh")]
    obs = {"a": ok(10), "b": ok(10), "c": ok(10)}
    assert rows(aggregate(workers, set(), obs, NOW)) == {"wh": 20}
    assert rows(aggregate(workers, {"b"}, obs, NOW)) == {"wh": 10}
    assert rows(aggregate(workers, {"b", "c"}, obs, NOW)) == {"wh": 0}


def test_r_k5_unhealthy_and_unreachable_workers_are_absent_not_incomplete() -> None:
    snap = aggregate(
        [w("a", "wh"), w("b", "wh"), w("c", "wh")],
        set(),
        {"a": ok(10), "b": UNHEALTHY, "c": UNREACHABLE},
        NOW,
    )
    assert rows(snap) == {"wh": 10}
    assert snap.complete is True


def test_r_k5_only_registered_workers_count() -> None:
    snap = aggregate([w("a", "wh")], set(), {"a": ok(10), "stranger": ok(50)}, NOW)
    assert rows(snap) == {"wh": 10}


def test_r_k5_unreadable_answering_worker_makes_the_snapshot_incomplete() -> None:
    snap = aggregate([w("a", "wh"), w("b", "wh")], set(), {"a": ok(10), "b": UNREADABLE}, NOW)
    assert snap.complete is False
    assert rows(snap) == {"wh": 10}  # a lower bound: incomplete snapshots cannot raise (R-L6)


def test_r_k5_model_known_only_through_an_unreadable_worker_has_no_row() -> None:
    # In an incomplete snapshot a missing row is "unknown" (R-L6); a 0 would drain it.
    snap = aggregate([w("a", "wh"), w("b", "other")], set(), {"a": ok(10), "b": UNREADABLE}, NOW)
    assert snap.complete is False
    assert rows(snap) == {"wh": 10}


def test_r_k5_fenced_unreadable_worker_does_not_spoil_completeness() -> None:
    snap = aggregate([w("a", "wh"), w("b", "wh")], {"b"}, {"a": ok(10), "b": UNREADABLE}, NOW)
    assert snap.complete is True


def test_r_k5_model_with_no_live_worker_is_a_zero_row_in_a_complete_snapshot() -> None:
    snap = aggregate([w("a", "wh"), w("b", "other")], set(), {"a": ok(10), "b": UNREACHABLE}, NOW)
    assert rows(snap) == {"wh": 10, "other": 0}
    assert snap.complete is True


def test_r_k3_sums_are_capped_at_the_contract_maximum() -> None:
    snap = aggregate(
        [w("a", "wh"), w("b", "wh")], set(), {"a": ok(MAX_SLOTS), "b": ok(MAX_SLOTS)}, NOW
    )
    assert rows(snap) == {"wh": MAX_SLOTS}
    decode_snapshot(encode_snapshot(snap))


def test_rows_are_sorted_by_model_id() -> None:
    snap = aggregate([w("a", "zeta", "alpha", "mid")], set(), {"a": ok(1)}, NOW)
    assert [m.id for m in snap.models] == ["alpha", "mid", "zeta"]


_ids = st.sampled_from(["a", "b", "c", "d"])
_models = st.sampled_from(["m1", "m2", "m3"])
_obs = st.one_of(
    st.integers(0, MAX_SLOTS).map(ok), st.sampled_from([UNREADABLE, UNHEALTHY, UNREACHABLE])
)


@settings(deadline=None)  # a shared, noisy machine: no per-example timing
@given(
    workers=st.lists(
        st.tuples(_ids, st.lists(_models, min_size=1, max_size=4), st.booleans()), max_size=6
    ),
    admin=st.sets(_ids),
    observations=st.dictionaries(_ids, _obs),
)
def test_r_k5_property_each_row_is_the_capped_sum_over_distinct_counted_workers(
    workers: list[tuple[str, list[str], bool]],
    admin: set[str],
    observations: dict[str, Observation],
) -> None:
    registered = [w(i, *models, fenced=fenced) for i, models, fenced in workers]
    snap = aggregate(registered, admin, observations, NOW)
    decode_snapshot(encode_snapshot(snap))  # always a valid contract body

    first: dict[str, Worker] = {}
    for worker in registered:
        first.setdefault(worker.id, worker)
    counted = {i: x for i, x in first.items() if not (x.fenced or i in admin) and i in observations}
    unreadable = {i for i, x in counted.items() if observations[i].state == "unreadable"}
    assert snap.complete is (not unreadable)
    for model, value in rows(snap).items():
        expected = sum(
            observations[i].slots or 0
            for i, x in counted.items()
            if model in x.models and observations[i].state == "ok"
        )
        assert value == min(expected, MAX_SLOTS)
    every_model = {m for x in first.values() for m in x.models}
    unknown = {
        m
        for m in every_model
        if any(m in counted[i].models for i in unreadable)
        and not any(m in x.models and observations[i].state == "ok" for i, x in counted.items())
    }
    assert set(rows(snap)) == every_model - unknown


def test_r_p6_a_snapshot_over_64_kib_is_served_incomplete_without_the_longest_rows() -> None:
    from capacity_contract import (
        MAX_SNAPSHOT_BYTES,
        CapacitySnapshot,
        ModelCapacity,
        decode_snapshot,
    )
    from capacity_router.aggregate import within_contract

    rows = [
        ModelCapacity(id=f"{i:03d}" + "é" * (230 + i % 23), max_concurrent_requests=7)
        for i in range(128)
    ]
    big = CapacitySnapshot(
        object="inference_capacity", version=1, complete=True, observed_at=1.5, models=rows
    )
    served, body, why = within_contract(big)
    assert len(body) <= MAX_SNAPSHOT_BYTES and why is not None and "over the contract's" in why
    assert served.complete is False and decode_snapshot(body) == served
    kept = {r.id for r in served.models}
    assert 0 < len(kept) < 128 and served.models == sorted(served.models, key=lambda r: r.id)
    assert max(len(i) for i in kept) <= min(len(r.id) for r in rows if r.id not in kept)
    small = CapacitySnapshot(
        object="inference_capacity", version=1, complete=True, observed_at=1.5, models=rows[:3]
    )
    assert within_contract(small)[0] is small and within_contract(small)[2] is None


# --- R-K7: the token fields of a row ------------------------------------------------------


def tok(n: int, request: int | None, running: int | None) -> Observation:
    return Observation("ok", n, "vllm", request_tokens=request, running_tokens=running)


def tokens(snapshot: object) -> dict[str, tuple[int | None, int | None]]:
    return {
        m.id: (m.request_tokens, m.running_tokens)
        for m in snapshot.models  # type: ignore[attr-defined]
    }


def test_r_k7_the_largest_request_bound_and_the_sum_of_the_pools() -> None:
    snap = aggregate(
        [w("a", "m"), w("b", "m")],
        (),
        {"a": tok(2, 256, 512), "b": tok(4, 4096, 8192)},
        0.0,
    )
    assert tokens(snap) == {"m": (4096, 8704)}


def test_r_k7_one_counted_worker_that_does_not_state_a_field_leaves_it_out() -> None:
    snap = aggregate(
        [w("a", "m"), w("b", "m"), w("c", "m")],
        (),
        {"a": tok(2, 256, 512), "b": tok(2, None, 1024), "c": tok(2, 512, 512)},
        0.0,
    )
    assert tokens(snap) == {"m": (None, 2048)}
    row = next(iter(snap.models))
    assert "max_request_tokens" not in msgspec.json.decode(msgspec.json.encode(row))


def test_r_k7_only_counted_workers_decide_the_fields() -> None:
    """A worker fenced, unhealthy, or with no slot for the model says nothing of it."""
    observations = {
        "a": tok(2, 256, 512),
        "b": ok(4),  # fenced: slots only, but it does not count
        "c": UNHEALTHY,
        "d": Observation("ok", 3, "vllm", per_model={}),  # lists nothing: 0 for m
    }
    workers = [w("a", "m"), w("b", "m", fenced=True), w("c", "m"), w("d", "m")]
    assert tokens(aggregate(workers, (), observations, 0.0)) == {"m": (256, 512)}


def test_r_k7_a_model_nothing_serves_has_no_token_fields() -> None:
    snap = aggregate([w("a", "m")], (), {"a": UNREACHABLE}, 0.0)
    assert tokens(snap) == {"m": (None, None)}


def test_r_k7_the_pool_sum_is_capped_at_the_contract_bound() -> None:
    big = 2**31 - 1
    snap = aggregate(
        [w("a", "m"), w("b", "m")], (), {"a": tok(1, 10, big), "b": tok(1, 10, big)}, 0.0
    )
    assert tokens(snap) == {"m": (10, big)}
    assert decode_snapshot(encode_snapshot(snap)) == snap
