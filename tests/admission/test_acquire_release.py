"""acquire()/release(): a slot taken in one callback and given back in another
(REQUIREMENTS section 8), and the Retry-After estimate the refusals carry.

Real segment, real core, real threads and event loops.
"""

from __future__ import annotations

import asyncio
import gc
import threading
from collections.abc import Callable

import pytest
from gwtest import P1Segment

from handler_shim import Admission, AdmissionTimeout, QueueFull, Ticket, UnknownProvider
from handler_shim.admission import retry_after_seconds
from shm_layout.view import read_view


def _running_waiting(segment: str) -> tuple[int, int]:
    p = read_view(segment).provider("p1")
    assert p is not None
    return p.running, p.waiting


def test_acquire_in_one_task_release_in_another(adm: Admission, segment_name: str) -> None:
    async def scenario() -> None:
        ticket = await adm.acquire("p1")
        assert isinstance(ticket, Ticket) and not ticket.released
        assert _running_waiting(segment_name) == (1, 0)

        async def other() -> None:
            adm.release(ticket)

        await asyncio.create_task(other())
        assert ticket.released
        assert _running_waiting(segment_name) == (0, 0)

    asyncio.run(scenario())


def test_release_is_idempotent_and_thread_safe(adm: Admission, segment_name: str) -> None:
    ticket = adm.acquire_blocking("p1")
    second = adm.acquire_blocking("p1")
    threads = [threading.Thread(target=adm.release, args=(ticket,)) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    adm.release(ticket)
    # exactly one slot went back: the other ticket still holds its slot
    assert _running_waiting(segment_name) == (1, 0)
    adm.release(second)
    assert _running_waiting(segment_name) == (0, 0)


def test_acquire_has_the_same_errors_as_slot_with_their_context_as_attributes(
    adm: Admission,
) -> None:
    a, b = adm.acquire_blocking("p1"), adm.acquire_blocking("p1")
    with pytest.raises(AdmissionTimeout) as timed_out:
        adm.acquire_blocking("p1", timeout=0.2)
    e = timed_out.value
    assert (e.provider, e.limit, e.running, e.waiting, e.timeout) == ("p1", 2, 2, 1, 0.2)
    with pytest.raises(UnknownProvider) as unknown:
        adm.acquire_blocking("nope")
    assert unknown.value.provider == "nope"

    async def full() -> None:
        waiting = [asyncio.create_task(adm.acquire("p1")) for _ in range(32)]
        await asyncio.sleep(0.3)
        with pytest.raises(QueueFull) as refused:
            await adm.acquire("p1")
        assert (refused.value.provider, refused.value.waiting) == ("p1", 32)
        for task in waiting:
            task.cancel()
        await asyncio.gather(*waiting, return_exceptions=True)

    asyncio.run(full())
    adm.release(a)
    adm.release(b)


def test_release_after_close_is_a_no_op(adm: Admission, segment_name: str) -> None:
    ticket = adm.acquire_blocking("p1")
    adm.close()
    adm.release(ticket)  # close() released it; nothing to do, nothing raised
    assert _running_waiting(segment_name) == (0, 0)


def test_r_a12_a_dropped_ticket_frees_its_slot(adm: Admission, segment_name: str) -> None:
    ticket = adm.acquire_blocking("p1")
    assert _running_waiting(segment_name) == (1, 0)
    del ticket
    gc.collect()
    assert _running_waiting(segment_name) == (0, 0)


def test_release_refuses_what_is_not_a_ticket(adm: Admission) -> None:
    with pytest.raises(TypeError):
        adm.release("p1")  # type: ignore[arg-type]


def test_retry_after_follows_the_measured_hold_time(adm: Admission) -> None:
    assert adm.retry_after("p1") == 1  # nothing held yet: no estimate
    for _ in range(3):
        with adm.slot_blocking("p1"):
            threading.Event().wait(0.4)
    # mean hold ~0.4 s, nobody waiting, limit 2: 0.4 * 1 / 2 -> at least 1
    assert adm.retry_after("p1") == 1
    assert retry_after_seconds(4.0, 31, 2) == 60
    assert retry_after_seconds(3.0, 3, 2) == 6
    assert retry_after_seconds(float("nan"), 3, 2) == 1
    assert retry_after_seconds(2.0, 0, 0) == 2


def test_try_acquire_takes_a_free_slot_and_never_queues(adm: Admission, segment_name: str) -> None:
    """The middleware's fast path: one try-lock step; None instead of waiting,
    with nothing recorded; QueueFull when the queue is full; FIFO kept (a free slot is
    not taken past someone who waits)."""
    a, b = adm.try_acquire("p1"), adm.try_acquire("p1")
    assert isinstance(a, Ticket) and isinstance(b, Ticket)
    assert _running_waiting(segment_name) == (2, 0)
    assert adm.try_acquire("p1") is None  # would wait: not queued, nothing recorded
    assert _running_waiting(segment_name) == (2, 0)

    async def scenario() -> None:
        waiter = asyncio.create_task(adm.acquire("p1"))
        await asyncio.sleep(0.2)
        assert _running_waiting(segment_name) == (2, 1)
        adm.release(a)
        granted = await waiter  # the freed slot went to the one who waited
        assert adm.try_acquire("p1") is None
        adm.release(granted)
        waiting = [asyncio.create_task(adm.acquire("p1")) for _ in range(33)]
        await asyncio.sleep(0.3)
        assert _running_waiting(segment_name) == (2, 32)
        with pytest.raises(QueueFull):
            adm.try_acquire("p1")
        for task in waiting:
            task.cancel()
        results = await asyncio.gather(*waiting, return_exceptions=True)
        for r in results:
            if isinstance(r, Ticket):
                adm.release(r)

    asyncio.run(scenario())
    adm.release(b)
    assert _running_waiting(segment_name) == (0, 0)


def test_the_repr_of_an_admission_shows_its_live_state(
    p1_segment: Callable[..., P1Segment], segment_name: str
) -> None:
    """As asyncio's locks do: open or closed, and each provider's running/limit +waiting."""
    a = p1_segment(2).attach("gw-2")
    ticket = a.acquire_blocking("p1")
    text = repr(a)
    assert text.startswith("<Admission generation='gw-2' open <_Attachment "), text
    assert segment_name in text and "[current, waiting 0," in text and " p1 1/2 +0>" in text
    a.release(ticket)
    assert " p1 0/2 +0>" in repr(a)
    a.close()
    assert repr(a).startswith("<Admission generation='gw-2' closed "), repr(a)
