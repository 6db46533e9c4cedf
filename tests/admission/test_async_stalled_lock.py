"""An async slot() waiting for a stalled segment lock still keeps its timeout and can be
cancelled (R-A4, R-A11).

A lock holder that stops inside a section (SIGSTOP, a VM pause) keeps the lock for as
long as it is stopped: the kernel never takes it from a live process (R-A6). The wait
for it happens off the loop; it must not swallow the request's timeout or its
cancellation, or an async handler's request hangs for as long as the holder is stopped.
"""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import Callable

import pytest
from gwtest import Agent, P1Segment, wait_until

from handler_shim import Admission, AdmissionTimeout
from shm_layout.view import read_view

MARGIN_S = 10.0  # an honest bound on a shared machine; a hang is forever


def _stalled(seg: P1Segment) -> tuple[Admission, Agent]:
    """This process attached; a handler process stopped inside the segment lock."""
    adm = seg.attach("async")
    holder = seg.locker()
    os.kill(holder.pid, signal.SIGSTOP)
    return adm, holder


def _no_records_of_mine(segment: str) -> bool:
    return not [h for h in read_view(segment).holders if h.pid == os.getpid()]


def test_r_a4_async_timeout_is_kept_while_the_lock_is_stalled(
    lock_kind: str, p1_segment: Callable[..., P1Segment]
) -> None:
    seg = p1_segment(2)
    adm, holder = _stalled(seg)

    async def main() -> BaseException | None:
        async def take() -> None:
            async with adm.slot("p1", timeout=0.5):
                pass

        task = asyncio.create_task(take())
        await asyncio.wait([task], timeout=MARGIN_S)  # waits; never cancels
        if not task.done():
            holder.kill()  # let the hung wait end, then fail
            await asyncio.wait([task], timeout=MARGIN_S)
            return None
        return task.exception()

    try:
        outcome = asyncio.run(main())
        assert isinstance(outcome, AdmissionTimeout), (
            f"slot(timeout=0.5) did not time out within {MARGIN_S}s behind a stalled lock"
        )
        holder.kill()
        assert wait_until(lambda: _no_records_of_mine(seg.name), 5.0)
    finally:
        holder.kill()
        adm.close()


def test_r_a4_a_task_waiting_for_a_stalled_lock_can_be_cancelled(
    lock_kind: str, p1_segment: Callable[..., P1Segment]
) -> None:
    seg = p1_segment(2)
    adm, holder = _stalled(seg)

    async def main() -> bool:
        async def take() -> None:
            async with adm.slot("p1"):
                pass

        task = asyncio.create_task(take())
        await asyncio.sleep(0.3)  # it is waiting for the lock, off the loop
        task.cancel()
        await asyncio.wait([task], timeout=MARGIN_S)
        ended = task.done()
        if not ended:
            holder.kill()
            await asyncio.wait([task], timeout=MARGIN_S)
        with pytest.raises(asyncio.CancelledError):
            task.result()
        return ended

    try:
        assert asyncio.run(main()), f"cancel() did not end the task within {MARGIN_S}s"
        holder.kill()
        assert wait_until(lambda: _no_records_of_mine(seg.name), 5.0)
    finally:
        holder.kill()
        adm.close()
