"""The drill's load: clients streaming completions through the gateway, and what came back.

Each client loops on one request at a time (a streamed completion of ``lo..hi``
chunks, each on a connection of its own) until its stop event is set, and waits the
``Retry-After`` of a 429 before the next. Every answer is tallied in
``Drill.outcomes`` (:class:`Outcomes`): a whole stream, a 429 with ``Retry-After``
and an OpenAI error body, a 503, or a failure, which the checks count as lost.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import random
import threading
from collections import Counter
from typing import TYPE_CHECKING

import httpx

if TYPE_CHECKING:
    from drill_rig import Drill

RELOAD_DROPS = frozenset({"ReadError", "RemoteProtocolError"})  # no answer at all
RELOAD_PHASE = "HUP -> gen-B"  # the phase whose reload may drop unread connections


def clients(
    drill: Drill, n: int, url: str, prefix: str, lo: int, hi: int, stop: threading.Event
) -> threading.Thread:
    """``n`` clients of ``url`` (``prefix`` "legacy": the legacy generation's), in a
    thread of their own, until ``stop`` is set; join the thread to wait for their end."""

    async def many() -> None:
        await asyncio.gather(*(_client_loop(drill, url, prefix, lo, hi, stop, i) for i in range(n)))

    thread = threading.Thread(target=lambda: asyncio.run(many()), daemon=True)
    thread.start()
    return thread


BURST_WAVES = 4  # at most this many waves of a burst
BURST_WAVE_S = 2.0  # how long a wave is given to be answered 429 before the next


def burst(drill: Drill, url: str, count: int) -> None:
    """``count`` requests at once: the overflow, those beyond the queue answered 429.

    On a loaded machine one wave may reach the gateway spread over seconds, the queue
    draining as fast as it arrives, and nothing overflows: that judges the machine, not
    the gateway. So the burst waits on the effect it is for: while none of its requests
    has been answered 429, another wave of ``count`` follows every ``BURST_WAVE_S``, at
    most ``BURST_WAVES`` in all (then the final check reports that no overflow was
    provoked). Every answer is tallied like the clients'."""

    async def waves() -> tuple[list[str], int]:
        async with _client() as c:
            sent: list[asyncio.Task[str]] = []
            for wave in range(BURST_WAVES):
                sent += [
                    asyncio.create_task(_one(drill, c, url, f"burst-{wave}-{i}", 3))
                    for i in range(count)
                ]
                for _ in range(int(BURST_WAVE_S / 0.05)):
                    if any(t.done() and t.result() == "429" for t in sent):
                        return list(await asyncio.gather(*sent)), wave + 1
                    await asyncio.sleep(0.05)
            return list(await asyncio.gather(*sent)), BURST_WAVES

    outcomes, sent_waves = asyncio.run(waves())
    for outcome in outcomes:
        _tally(drill, outcome, legacy=False)
    drill.figures["burst"] = dict(Counter(outcomes))
    drill.figures["burst_waves"] = sent_waves


def _client() -> httpx.AsyncClient:
    # No keep-alive: each request on its own connection, so a gunicorn reload never
    # races an idle pooled connection (that would be the client's loss, not ours).
    return httpx.AsyncClient(
        trust_env=False, timeout=120, limits=httpx.Limits(max_keepalive_connections=0)
    )


async def _client_loop(
    drill: Drill, url: str, prefix: str, lo: int, hi: int, stop: threading.Event, seed: int
) -> None:
    rng = random.Random(seed)
    async with _client() as c:
        for n in itertools.count():
            if stop.is_set():
                return
            if prefix == "legacy":
                drill.legacy_sent += 1
            outcome = await _one(drill, c, url, f"{prefix}-{seed}-{n}", rng.randint(lo, hi))
            _tally(drill, outcome, legacy=prefix == "legacy")
            if outcome == "429":
                await asyncio.sleep(1.0)  # Retry-After: 1


async def _one(drill: Drill, client: httpx.AsyncClient, url: str, rid: str, chunks: int) -> str:
    body = {
        "model": drill.model_alias,
        "stream": True,
        "max_tokens": chunks,
        "messages": [{"role": "user", "content": "drill"}],
    }
    try:
        async with client.stream(
            "POST", f"{url}/v1/chat/completions", json=body, headers={"x-request-id": rid}
        ) as answer:
            data = await answer.aread()
            if answer.status_code == 200:
                if data.endswith(b"data: [DONE]\n\n") and data.count(b"data: ") == chunks + 1:
                    return "ok"
                return "truncated"
            if answer.status_code == 429:
                error = json.loads(data).get("error", {})
                good = answer.headers.get("retry-after") and error.get("code") == "queue_full"
                return "429" if good else "bad-429"
            if answer.status_code == 503:
                return "503"
            return f"http-{answer.status_code}"
    except httpx.HTTPError as exc:
        return type(exc).__name__


def _tally(drill: Drill, outcome: str, *, legacy: bool) -> None:
    o = drill.outcomes
    if outcome == "ok":
        if legacy:
            o.legacy_ok += 1
        else:
            o.ok += 1
    elif outcome == "429" and not legacy:
        o.rejected += 1
    elif outcome == "503" and not legacy:
        o.timed_out += 1
        o.errors["503"] += 1
    elif outcome == "bad-429":
        o.bad_429 += 1
        o.errors[outcome] += 1
    elif outcome in RELOAD_DROPS and not legacy and drill.phase == RELOAD_PHASE:
        o.dropped_by_reload[outcome] += 1
    else:
        o.errors[f"{'legacy ' if legacy else ''}{outcome}"] += 1
