"""A real llama-server's context per slot, read by the router, kept by admission.

``-c 512 --parallel 2``: 256 tokens a slot (``/props`` and ``/slots`` say ``n_ctx: 256``).
Behind the reference router and the sidecar (token_load.Gateway), a request whose prompt
and ``max_tokens`` need more than that is refused by admission at once, with the numbers,
and never reaches the server; one that fits runs. Both are English prose, charged what
the middleware and the relay charge a body (capacity_contract.tokens), so the estimate
is what lets the 100-token one run in a slot of 256. With two workers of different
``-c`` behind one router, a request only the larger one holds is relayed to that one.
The prompts' token counts are the server's own (``POST /tokenize``).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from llama import LlamaServer, binary, tiny_model
from servers import ROUTER_KEY, Router
from token_corpus import ENGLISH
from token_load import Gateway, tokens_supported

import handler_shim
from capacity_contract.tokens import request_charge

pytestmark = [
    pytest.mark.timeout(300),
    pytest.mark.skipif(
        binary() is None,
        reason="no llama-server: `make real-workers` builds one and sets GWCAP_LLAMA_SERVER",
    ),
    pytest.mark.skipif(
        not tokens_supported(), reason="this checkout's admission takes no tokens (issue 47)"
    ),
]

SLOT_CONTEXT = 256  # -c 512 --parallel 2


@pytest.fixture
def start(tmp_path: Path) -> Iterator[Callable[..., LlamaServer]]:
    started: list[LlamaServer] = []

    def one(*args: str) -> LlamaServer:
        server = LlamaServer(
            ["-m", str(tiny_model(tmp_path)), "--alias", "tiny", "--metrics", *args],
            tmp_path / f"llama-{len(started)}.log",
        )
        started.append(server)
        server.wait_healthy()
        return server

    yield one
    for server in started:
        server.stop()


@pytest.fixture
def stopping() -> Iterator[list[Callable[[], object]]]:
    """What a test started, stopped afterwards in the reverse order."""
    stops: list[Callable[[], object]] = []
    yield stops
    for stop in reversed(stops):
        stop()


def worker(worker_id: str, server: LlamaServer) -> dict[str, Any]:
    return {
        "id": worker_id,
        "urls": [server.url],
        "models": ["tiny"],
        "slots": {"source": "llama-server"},
    }


def count(server: LlamaServer, text: str) -> int:
    """``text``'s tokens by the server's own tokenizer."""
    return len(httpx.post(f"{server.url}/tokenize", json={"content": text}).json()["tokens"])


def prompt_of(server: LlamaServer, tokens: int) -> str:
    """A text prompt of exactly ``tokens`` tokens by the server's own tokenizer."""
    text = ""
    word = 0
    while True:
        candidate = f"{text}w{word} "
        got = count(server, candidate)
        if got > tokens:
            break
        text, word = candidate, word + 1
        if got == tokens:
            return text
    # pad with single-token characters
    while True:
        got = count(server, text)
        if got >= tokens:
            return text
        text += "a"


def english_of(server: LlamaServer, tokens: int) -> str:
    """English prose of exactly ``tokens`` tokens by the server's own tokenizer: the most
    words of the corpus's paragraph (repeated) that stay within it, then single letters."""
    words = ((ENGLISH + " ") * 8).split()
    low, high = 0, len(words)  # the most words whose count is <= tokens, by bisection
    while low < high:
        mid = (low + high + 1) // 2
        if count(server, " ".join(words[:mid])) <= tokens:
            low = mid
        else:
            high = mid - 1
    text = " ".join(words[:low])
    while count(server, text) < tokens:
        text += " a"
    assert count(server, text) == tokens, (tokens, count(server, text))
    return text


def prompt_tokens_served(server: LlamaServer) -> float:
    from capacity_router.sources import gauge_sum

    body = httpx.get(f"{server.url}/metrics", timeout=10).content
    return float(gauge_sum(body, "llamacpp:prompt_tokens_total") or 0.0)


def complete(router: Router, prompt: str, max_tokens: int) -> httpx.Response:
    return httpx.post(
        f"{router.url}/v1/completions",
        headers={"Authorization": f"Bearer {ROUTER_KEY}"},
        json={"model": "tiny", "prompt": prompt, "max_tokens": max_tokens},
        timeout=120,
        trust_env=False,
    )


def test_r_k5_a_request_past_a_slot_is_refused_at_once_and_one_that_fits_runs(
    tmp_path: Path,
    start: Callable[..., LlamaServer],
    stopping: list[Callable[[], object]],
    figures: list[str],
) -> None:
    server = start("-c", "512", "--parallel", "2")
    slots = httpx.get(f"{server.url}/slots", timeout=10).json()
    assert [s["n_ctx"] for s in slots] == [SLOT_CONTEXT, SLOT_CONTEXT]
    router = Router(tmp_path, [worker("a", server)])
    stopping.append(router.stop)
    router.wait(lambda: router.rows() == {"tiny": 2}, "read")
    gateway = Gateway(tmp_path, router, {"tiny": "tiny"})
    stopping.append(gateway.stop)
    gateway.wait_published(
        lambda: gateway.request_token_limit() == SLOT_CONTEXT, f"{SLOT_CONTEXT} tokens a request"
    )
    adm = gateway.attach("llama-tokens")
    stopping.append(adm.close)
    large, small = english_of(server, 600), english_of(server, 100)
    large_charge = request_charge({"prompt": large, "max_tokens": 16}).tokens(None)
    small_charge = request_charge({"prompt": small, "max_tokens": 16}).tokens(None)
    served_before = prompt_tokens_served(server)
    asked = time.monotonic()
    with (
        pytest.raises(handler_shim.RequestTooLarge) as refused,
        adm.slot_blocking("farm", timeout=60, tokens=large_charge),
    ):
        pass
    took = time.monotonic() - asked
    assert took < 5.0  # at once, not after the 60 s timeout
    message = str(refused.value)
    assert str(large_charge) in message and str(SLOT_CONTEXT) in message, message
    assert prompt_tokens_served(server) == served_before  # it never reached the server
    direct = httpx.post(
        f"{server.url}/v1/completions",
        json={"model": "tiny", "prompt": large, "max_tokens": 16},
        timeout=60,
    )
    assert direct.status_code == 400, direct.text  # what it would have met there
    assert small_charge <= SLOT_CONTEXT  # the estimate lets it in
    with adm.slot_blocking("farm", timeout=60, tokens=small_charge):
        answer = complete(router, small, 16)
    assert answer.status_code == 200, answer.text
    usage = answer.json()["usage"]
    assert usage["prompt_tokens"] in (100, 101)  # BOS where the server adds one
    figures.append(
        f"llama-server -c 512 --parallel 2 ({SLOT_CONTEXT} tokens a slot): English of 600 "
        f"tokens + 16, charged {large_charge} by the estimate, refused by admission in "
        f"{took * 1000:.1f} ms ({message}); 100 + 16, charged {small_charge}, ran (usage "
        f"{usage})"
    )


def test_r_k5_a_request_only_the_larger_worker_holds_is_relayed_to_it(
    tmp_path: Path,
    start: Callable[..., LlamaServer],
    stopping: list[Callable[[], object]],
    figures: list[str],
) -> None:
    small_ctx = start("-c", "512", "--parallel", "2")
    large_ctx = start("-c", "2048", "--parallel", "2")
    router = Router(tmp_path, [worker("a", small_ctx), worker("b", large_ctx)])
    stopping.append(router.stop)
    router.wait(lambda: router.rows() == {"tiny": 4}, "read")
    prompt = prompt_of(small_ctx, 600)
    before = prompt_tokens_served(small_ctx), prompt_tokens_served(large_ctx)
    answers = [complete(router, prompt, 16) for _ in range(4)]
    assert [a.status_code for a in answers] == [200] * 4, [a.text for a in answers]
    after = prompt_tokens_served(small_ctx), prompt_tokens_served(large_ctx)
    assert after[0] == before[0]  # the 256-token slots never saw it
    assert after[1] - before[1] >= 600  # prompt tokens served (a cached prefix counts once)
    figures.append(
        "llama-server workers -c 512 and -c 2048 (--parallel 2) behind one router: a "
        f"600-token prompt x4 went to the -c 2048 one every time (its prompt tokens "
        f"+{after[1] - before[1]:g}, the other's +{after[0] - before[0]:g})"
    )
