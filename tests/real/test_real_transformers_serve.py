"""The router and the chain against a real ``transformers serve`` (torch on the CPU) (R-K5).

One server for the module, pinned to the tiny model (``transformers serve PATH``), behind
a real ``gateway-capacity router serve`` as ``{"source": "transformers", "fixed": 1}``;
the tests run in file order, the last one kills it.
Its streams end without ``data: [DONE]``: the relay and the openai SDK must still end
cleanly. It runs one request at a time unless started with ``--continuous-batching``.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from gwtest import free_port
from servers import (
    Chain,
    chat_through,
    kill_until_unreachable,
    real_marks,
    serve_chain,
    start_transformers,
    streams_alone,
    tiny_model,
    version_of,
)

pytestmark = real_marks("transformers")


@pytest.fixture(scope="module")
def chain(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Chain]:
    work = tmp_path_factory.mktemp("transformers")
    slots = {"source": "transformers", "fixed": 1}
    with serve_chain(work, "transformers", slots, start_transformers) as chain:
        yield chain


def test_r_k5_transformers_serve_is_unreachable_while_loading_then_up(
    chain: Chain, figures: list[str]
) -> None:
    router = chain.router
    router.wait(lambda: router.worker().get("state") == "ok", "up", timeout=30)
    states = [*chain.log.states(), router.worker()["state"]]
    listed = httpx.get(f"{chain.server.url}/v1/models", timeout=10).json()
    figures.append(
        f"transformers serve {version_of('transformers', 'transformers')}: healthy "
        f"{chain.startup_s:.0f} s after start; router "
        f"states: {' -> '.join(dict.fromkeys(states))}; /v1/models lists "
        f"{[m['id'] for m in listed['data']]}"
    )
    assert states[0] == "unreachable"  # the pinned model loads before the port opens
    assert [m["id"] for m in listed["data"]] == [chain.model]  # the path, as given
    assert router.rows() == {chain.model: 1}


def test_r_k5_a_transformers_stream_without_done_ends_cleanly_through_the_relay(
    chain: Chain,
) -> None:
    client = chat_through(chain.router, chain.model, max_tokens=12)
    with httpx.stream(
        "POST",
        f"{chain.router.url}/v1/chat/completions",
        headers=chain.router.headers,
        json={
            "model": chain.model,
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 4,
            "stream": True,
        },
        timeout=120,
    ) as raw:
        body = b"".join(raw.iter_raw())
    assert body.count(b"data: ") >= 2
    assert b"[DONE]" not in body  # as the server sent it: no terminator to wait for
    text = client.completions.create(model=chain.model, prompt="hello", max_tokens=4)
    assert text.choices[0].text is not None


def test_r_k5_transformers_serve_runs_one_at_a_time_as_the_router_reports(
    chain: Chain, figures: list[str]
) -> None:
    router = chain.router
    reported = router.rows()[chain.model]
    streams = chain.streams(3, max_tokens=40)
    assert streams.finish == ["length"] * 3
    figures.append(
        f"transformers serve (default): router reported {reported} (fixed); 3 streams "
        f"through it ran {streams.most_at_once()} at once"
    )
    assert reported == 1
    assert streams.most_at_once() == 1
    assert "w: in service, 1 slots (transformers)" in router.show()


def test_r_k5_transformers_serve_with_continuous_batching_runs_them_all_at_once(
    tmp_path: Path, figures: list[str]
) -> None:
    model = tiny_model("transformers", tmp_path)
    server = start_transformers(model, free_port(), tmp_path / "cb.log", continuous_batching=True)
    # batched, the tiny model is fast: long answers, so that each lasts seconds
    streams = streams_alone(server, model, 3, max_tokens=1500)
    figures.append(
        f"transformers serve --continuous-batching: 3 streams ran {streams.most_at_once()} "
        "at once (nothing over HTTP says how many it would take)"
    )
    assert streams.most_at_once() == 3


def test_r_k5_a_killed_transformers_serve_reads_unreachable(
    chain: Chain, figures: list[str]
) -> None:
    router = chain.router
    log, took = kill_until_unreachable(router, chain.server.kill)
    assert router.rows() == {chain.model: 0}
    figures.append(
        f"transformers serve SIGKILLed: router states {' -> '.join(log.states())}; 0 slots "
        f"{took:.1f} s after the kill"
    )
