"""Admission classes in the compiled core and its model, step by step (R-A17..R-A21):
reserves, caps, strict order below the sum of reserves, promotion after maxWait,
displacement from a full queue, and the classes suspended while a handler of the older
minor is registered. Each step runs on a real segment through ``_core`` and on a copy
through ``ledger.py``; the bytes must stay equal (the stateful test draws the same steps
at random: this file pins the cases that random steps reach seldom)."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import pytest
from core_twin import Twin

from shm_layout import _core, layout, rows
from shm_layout.layout import PROVIDER

INTERACTIVE, AGENT, BATCH = 0, 1, 2


@pytest.fixture
def twin() -> Iterator[Twin]:
    t = Twin(limit=4)
    yield t
    t.close()


def test_r_a18_a_reserve_is_never_taken_by_a_lower_class(twin: Twin) -> None:
    twin.classes([("interactive", 2, 0, 0), ("batch", 0, 0, 0)], BATCH - 1)
    batch = [twin.arrive(-1) for _ in range(4)]  # no class named: the default, batch
    assert [d for d, _, _ in batch] == ["admit", "admit", "wait", "wait"]
    assert [twin.arrive(INTERACTIVE)[0] for _ in range(2)] == ["admit", "admit"]
    assert twin.arrive(INTERACTIVE)[0] == "wait"
    twin.leave(batch[0])  # the freed slot goes to the interactive waiter, not the older batch
    assert twin.field("running") == 4 and twin.field("waiting") == 2


def test_r_a18_a_cap_bounds_a_class_even_with_room(twin: Twin) -> None:
    twin.classes([("interactive", 0, 0, 0), ("batch", 0, 1, 0)], 1)
    assert [twin.arrive(1)[0] for _ in range(2)] == ["admit", "wait"]
    assert twin.arrive(0)[0] == "admit"  # the capped class's waiter does not block it


def test_r_a18_below_the_sum_of_reserves_the_higher_reserve_is_whole_first(twin: Twin) -> None:
    twin.classes([("interactive", 2, 0, 0), ("agent", 2, 0, 0), ("batch", 0, 0, 0)], 2)
    twin.limit(3)
    assert twin.arrive(BATCH)[0] == "wait"  # 3 - 2 - 2 < 1: strict order, batch gets nothing
    assert twin.arrive(AGENT)[0] == "admit"  # 0 + 2 < 3: one slot beside interactive's two
    assert twin.arrive(AGENT)[0] == "wait"
    assert [twin.arrive(INTERACTIVE)[0] for _ in range(2)] == ["admit", "admit"]


def test_r_a19_a_waiter_past_its_max_wait_is_promoted(twin: Twin) -> None:
    twin.classes([("interactive", 2, 0, 0), ("batch", 0, 0, 5000)], 1)
    batch = [twin.arrive(BATCH) for _ in range(3)]
    assert [d for d, _, _ in batch] == ["admit", "admit", "wait"]
    twin.now += 4.9
    twin.sweep()
    assert twin.field("waiting") == 1  # not yet
    twin.now += 0.2
    twin.sweep()  # the host's sweep pumps: the batch waiter takes a reserved slot
    assert twin.field("waiting") == 0 and twin.field("promoted_total") == 1


def test_r_a20_a_full_queue_displaces_the_newest_lowest_waiter(twin: Twin) -> None:
    twin.classes([("interactive", 0, 0, 0), ("agent", 0, 0, 0), ("batch", 0, 0, 0)], 2)
    for _ in range(4):
        twin.arrive(INTERACTIVE)
    agents = [twin.arrive(AGENT) for _ in range(2)]
    batch = [twin.arrive(BATCH) for _ in range(30)]
    assert twin.field("waiting") == layout.QUEUE_BOUND
    decision, _, _ = twin.arrive(AGENT)
    assert decision == "wait" and twin.field("waiting") == layout.QUEUE_BOUND
    newest = batch[-1][1]
    assert twin.cores[0].displaced(newest) and not twin.cores[0].displaced(batch[0][1])
    assert twin.field("displaced_total") == 1 and twin.field("rejected_total") == 1
    assert twin.arrive(BATCH)[0] == "full"  # nobody below batch: refused
    assert not any(twin.cores[0].displaced(t) for _, t, _ in agents)


def test_r_a20_a_displaced_blocking_waiter_is_told_at_once(twin: Twin) -> None:
    twin.classes([("interactive", 0, 0, 0), ("batch", 0, 0, 0)], 1)
    for _ in range(4):
        twin.arrive(INTERACTIVE)
    core = twin.cores[0]
    tickets = []
    for _ in range(layout.QUEUE_BOUND):
        ticket = _core.Ticket()
        code = core.arrive(ticket, 0, 100, 0.0, may_wait=True, blocking=True, futex=True, cls=1)
        assert code == _core.WAIT
        tickets.append(ticket)
    result: list[int] = []
    waiter = threading.Thread(target=lambda: result.append(core.wait(tickets[-1], 10.0)[0]))
    waiter.start()
    assert (
        core.arrive(_core.Ticket(), 0, 100, 0.0, may_wait=True, blocking=True, cls=0) == _core.WAIT
    )
    waiter.join(5.0)
    assert result == [_core.W_DISPLACED]


def test_r_a21_classes_are_suspended_while_an_older_handler_is_registered(twin: Twin) -> None:
    twin.classes([("interactive", 2, 0, 0), ("batch", 0, 0, 0)], 1)
    older = twin.register(minor=0)  # layout 3.0: no classes
    assert layout.HEADER["older_members"].get(twin.seg.buf) == 1
    assert [twin.arrive(BATCH)[0] for _ in range(4)] == ["admit"] * 4  # one FIFO: no reserve
    twin.unregister(older)
    assert layout.HEADER["older_members"].get(twin.seg.buf) == 0
    assert twin.arrive(INTERACTIVE)[0] == "wait"  # the limit is full; classes hold again


def test_r_a17_no_classes_writes_what_one_fifo_writes(twin: Twin) -> None:
    """Without classes a class asked for changes nothing: the record's class byte is 0."""
    held = [twin.arrive(cls) for cls in (-1, 0, 3, 2, 1)]
    assert [d for d, _, _ in held] == ["admit"] * 4 + ["wait"]
    for _, ticket, _ in held:
        hb = rows.holder_base(0, ticket.holder)
        assert layout.HOLDER["cls"].get(twin.seg.buf, hb) == 0


def test_r_a23_reserves_apply_to_the_published_share(twin: Twin) -> None:
    """In share mode the sidecar publishes this gateway's share (source ``share``) as the
    limit: the classes divide that share, as any limit in force."""
    twin.classes([("interactive", 1, 0, 0), ("batch", 0, 0, 0)], 1)
    base = rows.provider_base(0)
    writes = [
        (base + PROVIDER[f].offset, PROVIDER[f].codec.pack(v))
        for f, v in (
            ("published_source", layout.SOURCE_CODES["share"]),
            ("expires_mono", twin.now + 20.0),
            ("published_limit", 2),
        )
    ]
    twin.commit(writes)
    assert rows.effective_limit(twin.seg.buf, 0, twin.now).source == "share"
    assert [twin.arrive(BATCH)[0] for _ in range(2)] == ["admit", "wait"]  # 2 - 1 reserved
    assert twin.arrive(INTERACTIVE)[0] == "admit"


def _class_names(twin: Twin, held: list[tuple[str, Any, Any]]) -> list[str]:
    """The class each held request counts in now, by name."""
    out = []
    for _, ticket, _ in held:
        cls = layout.HOLDER["cls"].get(twin.seg.buf, rows.holder_base(0, ticket.holder))
        k = rows.resolve_class(twin.seg.buf, 0, cls - 1)
        out.append(
            layout.decode_text(layout.CLASS["name"].get(twin.seg.buf, rows.class_base(0, k)))
        )
    return out


def test_r_a18_a_class_added_above_running_requests_keeps_them_and_the_reserves(
    twin: Twin,
) -> None:
    """Two batch requests run; a class is added above the others: they stay batch, so a
    third batch arrival waits (L - (1 + 1) = 2) and an interactive one runs."""
    twin.classes([("interactive", 1, 0, 0), ("batch", 0, 0, 0)], 1)
    running = [twin.arrive(1) for _ in range(2)]
    assert [d for d, _, _ in running] == ["admit", "admit"]
    twin.classes([("vip", 1, 0, 0), ("interactive", 1, 0, 0), ("batch", 0, 0, 0)], 2)
    assert _class_names(twin, running) == ["batch", "batch"]
    assert twin.arrive(2)[0] == "wait"
    assert twin.arrive(1)[0] == "admit"


def test_r_a18_reordered_renamed_and_removed_classes_keep_requests_in_flight(
    twin: Twin,
) -> None:
    """Every edit keeps a running or waiting request in its own class by name; a request
    whose class is gone counts in the default class, and the reserves hold through it."""
    twin.classes([("interactive", 1, 0, 0), ("agent", 0, 0, 0), ("batch", 0, 0, 0)], 2)
    held = [twin.arrive(0), twin.arrive(1), twin.arrive(2), twin.arrive(-1)]
    assert [d for d, _, _ in held] == ["admit"] * 4
    waiting = [twin.arrive(2), twin.arrive(1)]
    assert [d for d, _, _ in waiting] == ["wait", "wait"]
    names = ["interactive", "agent", "batch", "batch", "batch", "agent"]
    assert _class_names(twin, held + waiting) == names
    twin.classes([("batch", 0, 0, 0), ("agent", 0, 0, 0), ("interactive", 1, 0, 0)], 0)
    assert _class_names(twin, held + waiting) == names  # reordered: each by its name
    twin.classes([("interactive", 1, 0, 0), ("agents", 0, 0, 0), ("batch", 0, 0, 0)], 2)
    renamed = ["interactive", "batch", "batch", "batch", "batch", "batch"]
    assert _class_names(twin, held + waiting) == renamed  # agent is gone: the default
    twin.classes([("interactive", 1, 0, 0)], 0)
    assert _class_names(twin, held + waiting) == ["interactive"] * 6  # one class left
    twin.classes([("interactive", 1, 0, 0), ("batch", 0, 0, 0)], 1)
    assert _class_names(twin, held + waiting)[0] == "interactive"
    twin.leave(held[0])  # interactive's reserve is free again: no batch waiter takes it
    assert twin.field("running") == 3 and twin.field("waiting") == 2
