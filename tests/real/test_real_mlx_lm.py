"""The router and the chain against a real mlx_lm.server (``mlx[cpu]``) (R-K5).

One server for the module, ``--decode-concurrency 2 --prompt-concurrency 2``, behind a
real ``gateway-capacity router serve``; the tests run in file order, the last one kills
it. mlx_lm serves the model under its absolute path (no alias option) and routes each
request by its ``model``; it has no key option. On a machine without
``~/.cache/huggingface/hub`` its ``/v1/models`` answers 200 with an empty body: the first
test starts one that way.
"""

from __future__ import annotations

from collections.abc import Iterator
from functools import partial
from pathlib import Path

import httpx
import pytest
from gwtest import free_port
from servers import (
    STARTUP_S,
    Chain,
    Router,
    StateLog,
    chat_through,
    kill_until_unreachable,
    real_marks,
    serve_chain,
    start_mlx,
    streams_alone,
    tiny_model,
    version_of,
    worker_entry,
)

pytestmark = real_marks("mlx-lm")

DECODE_CONCURRENCY = 2
LAYERS = 24  # tokens slow enough (~20 ms) that sending them never lags behind decoding


SLOTS = {"source": "mlx", "fixed": DECODE_CONCURRENCY}


@pytest.fixture(scope="module")
def chain(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Chain]:
    start = partial(
        start_mlx, decode_concurrency=DECODE_CONCURRENCY, prompt_concurrency=DECODE_CONCURRENCY
    )
    work = tmp_path_factory.mktemp("mlx")
    with serve_chain(work, "mlx-lm", SLOTS, start, also=("typo-model",), layers=LAYERS) as chain:
        yield chain


def test_r_k5_mlx_lm_on_a_machine_without_a_hub_cache_is_read(
    tmp_path: Path, figures: list[str]
) -> None:
    model = tiny_model("mlx-lm", tmp_path)
    port = free_port()
    router = Router(tmp_path, [worker_entry(port, [str(model)], SLOTS)])
    log = StateLog(router).start()
    server = start_mlx(model, port, tmp_path / "mlx.log", hub_cache=False)
    try:
        server.wait_healthy(STARTUP_S["mlx-lm"])
        listed = httpx.get(f"{server.url}/v1/models", timeout=10)
        try:
            router.wait(lambda: router.worker().get("state") == "ok", "read", timeout=30)
        finally:
            log.stop()
            figures.append(
                f"mlx_lm {version_of('mlx-lm', 'mlx-lm')}"
                " without a hub cache: GET /v1/models answered "
                f"{listed.status_code} with {len(listed.content)} bytes; router states: "
                f"{' -> '.join(log.states())} (last: {log.seen[-1][2]!r})"
            )
        assert router.rows() == {str(model): DECODE_CONCURRENCY}
    finally:
        router.stop()
        server.stop()


def test_r_k5_mlx_lm_is_unreachable_while_starting_then_read(
    chain: Chain, figures: list[str]
) -> None:
    router = chain.router
    router.wait(lambda: router.worker().get("state") == "ok", "read", timeout=30)
    figures.append(
        f"mlx_lm {version_of('mlx-lm', 'mlx-lm')}: healthy {chain.startup_s:.0f} s after start; "
        "router states: "
        f"{' -> '.join(chain.log.states())}"
    )
    assert chain.log.states()[0] == "unreachable"
    entry = router.worker()
    assert entry["slots"] == DECODE_CONCURRENCY
    assert entry["unserved"] == ["typo-model"]
    assert router.rows() == {chain.model: DECODE_CONCURRENCY, "typo-model": 0}
    assert router.capacity()["complete"] is True


def test_r_k5_mlx_lm_streams_through_the_router_with_the_openai_sdk(chain: Chain) -> None:
    client = chat_through(chain.router, chain.model, max_tokens=24)
    text = client.completions.create(model=chain.model, prompt="hello", max_tokens=8)
    assert text.choices[0].text


def test_r_k5_mlx_lm_decodes_its_batch_size_at_once_but_one_with_a_seed(
    chain: Chain, figures: list[str]
) -> None:
    router = chain.router
    reported = router.rows()[chain.model]
    batched = chain.streams(4, max_tokens=120)
    seeded = chain.streams(3, max_tokens=120, seed=7)
    figures.append(
        f"mlx_lm --decode-concurrency {DECODE_CONCURRENCY} --prompt-concurrency "
        f"{DECODE_CONCURRENCY}: router reported {reported} (fixed); 4 streams through it ran "
        f"{batched.most_at_once()} at once; 3 streams with a seed (unbatchable) ran "
        f"{seeded.most_at_once()} at once"
    )
    assert reported == DECODE_CONCURRENCY
    assert batched.most_at_once() == DECODE_CONCURRENCY
    assert seeded.most_at_once() == 1
    shown = router.show()
    assert f"w: in service, {DECODE_CONCURRENCY} slots" in shown
    assert "does not serve typo-model" in shown


def test_r_k5_mlx_lm_batch_is_the_larger_of_decode_and_prompt_concurrency(
    tmp_path: Path, figures: list[str]
) -> None:
    """BatchGenerator's completion batch is max(--decode-concurrency, --prompt-concurrency)
    (mlx_lm/generate.py), and --prompt-concurrency defaults to 8."""
    model = tiny_model("mlx-lm", tmp_path, layers=LAYERS)
    server = start_mlx(model, free_port(), tmp_path / "mlx.log", decode_concurrency=2)
    streams = streams_alone(server, model, 4, max_tokens=120)
    figures.append(
        "mlx_lm --decode-concurrency 2 (--prompt-concurrency left at 8): 4 streams ran "
        f"{streams.most_at_once()} at once"
    )
    assert streams.most_at_once() == 4


def test_r_k5_a_killed_mlx_lm_reads_unreachable(chain: Chain, figures: list[str]) -> None:
    router = chain.router
    log, took = kill_until_unreachable(router, chain.server.kill)
    assert router.rows() == {chain.model: 0, "typo-model": 0}
    figures.append(
        f"mlx_lm SIGKILLed: router states {' -> '.join(log.states())}; 0 slots "
        f"{took:.1f} s after the kill"
    )
