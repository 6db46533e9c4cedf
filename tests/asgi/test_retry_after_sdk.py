"""Retry-After from the drain estimate, as the official ``openai`` SDK acts on it
(SPEC section 8, R-A2).

The example gateway (limit 4) in front of a slow fake upstream (``SimWorker(openai=True)``,
0.5 s a completion); 80 concurrent completions from ``openai.AsyncOpenAI`` with its default
retries (2, honouring ``Retry-After``). 36 fit (4 run, 32 wait; the upstream pauses while
they arrive, so the queue is full on any machine); the other 44 are answered 429. With
``Retry-After`` = the time the queue ahead needs to drain, their retries mostly find room;
with a fixed 1 s most retries meet the same full queue again. The figures of both are
``make bench``'s ``retry`` section (docs/benchmarks.md); here only what must hold.
"""

from __future__ import annotations

import asyncio
import importlib.util
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from asgi_support import example_gateway
from gwtest import availability, wait_until

from capacity_router import SimWorker

if importlib.util.find_spec("openai") is None:
    pytest.skip(
        "the openai SDK is not installed (make test installs it with the litellm extra)",
        allow_module_level=True,
    )


def waiting(segment: str) -> int:
    return int(availability(segment)["providers"][0]["waiting"])


@pytest.fixture
def upstream() -> Iterator[SimWorker]:
    worker = SimWorker(slots=64, openai=True, delay=0.5, model="workhorse")
    worker.start()
    yield worker
    worker.set_slots(64)
    worker.stop()


@pytest.fixture
def gateway(tmp_path: Path, segment_name: str, upstream: SimWorker) -> Iterator[str]:
    provider = {
        "id": "local-inference",
        "baseUrl": f"{upstream.url}/v1",
        "maxConcurrent": 4,
        "models": {"local-workhorse": "workhorse"},
    }
    with example_gateway(tmp_path, segment_name, provider, "--no-access-log") as served:
        yield served.base


def test_r_a2_openai_sdk_retries_after_the_estimated_retry_after_mostly_succeed(
    gateway: str, segment_name: str, upstream: SimWorker
) -> None:
    import openai

    refusals: list[tuple[int, int]] = []  # (the SDK's retry number, Retry-After) per 429

    async def record(response: httpx.Response) -> None:
        if response.status_code == 429:
            retry = int(response.request.headers.get("x-stainless-retry-count", "0"))
            refusals.append((retry, int(response.headers["retry-after"])))

    async def scenario() -> list[bool]:
        http = httpx.AsyncClient(
            event_hooks={"response": [record]}, limits=httpx.Limits(max_connections=200)
        )
        client = openai.AsyncOpenAI(base_url=f"{gateway}/v1", api_key="unused", http_client=http)
        assert client.max_retries == 2  # the SDK's default
        messages = [{"role": "user", "content": "hi"}]

        async def one() -> bool:
            try:
                await client.chat.completions.create(model="local-workhorse", messages=messages)  # type: ignore[arg-type]
                return True
            except openai.RateLimitError as exc:
                assert exc.body is not None and exc.code == "queue_full"
                return False

        # A gateway that has served a while knows its hold times.
        assert all(await asyncio.gather(*(one() for _ in range(4))))
        # The upstream pauses (however loaded this machine, the queue fills): 36 take the 4
        # slots and the queue of 32, then 44 more arrive at the full queue; then it resumes.
        upstream.set_slots(0)
        queued = [asyncio.create_task(one()) for _ in range(36)]
        seen: list[int] = []

        def filled() -> bool:
            seen.append(waiting(segment_name))
            return seen[-1] == 32

        full = await asyncio.to_thread(wait_until, filled, 60, 0.05)
        assert full, f"the queue never filled: {seen[-5:]}"
        refused = [asyncio.create_task(one()) for _ in range(44)]
        deadline = time.monotonic() + 60
        refused_at_once = lambda: sum(1 for retry, _ in refusals if retry == 0)  # noqa: E731
        while refused_at_once() < 44 and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        upstream.set_slots(64)
        results = await asyncio.gather(*queued, *refused)
        await client.close()
        return results

    results = asyncio.run(scenario())
    first = [ra for retry, ra in refusals if retry == 0]
    later = [ra for retry, ra in refusals if retry > 0]
    assert len(first) == 44  # the queue was full: refused at once
    # the hint is the queue's drain time (0.5 s x 33 / 4 -> 5 s), not a fixed second
    assert min(first) >= 2, sorted(set(first))
    # so the SDK's retries mostly find room: far fewer 429s the second time, few give up
    assert len(later) < len(first) / 2, (len(first), len(later))
    assert sum(results) >= 72, f"{sum(results)} of 80 succeeded"
