"""Admission in tokens keeps a real vLLM from preempting; admission in requests does not.

One stack for the module (token_load.py: vLLM with a KV pool the router states as POOL and
``--max-num-seqs 8``, the router, the sidecar, three handler processes admitting through
the segment), one load with requests alone, then the same load with each request charged
its tokens, in file order, so both figures come from one run of one server. Throughput and
time to first token are printed side by side, never asserted (timings on a shared machine).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from servers import python, real_marks
from token_load import (
    GPU_BLOCKS,
    HANDLERS,
    MAX_NUM_SEQS,
    POOL,
    REQUESTS,
    THREADS,
    TokenStack,
    token_stack,
    tokens_supported,
)

pytestmark = real_marks("vllm")


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TokenStack]:
    assert python("vllm") is not None
    with token_stack(tmp_path_factory.mktemp("vllm-tokens")) as stack:
        yield stack


def test_r_k5_admission_in_requests_alone_lets_vllm_preempt(
    stack: TokenStack, figures: list[str]
) -> None:
    result = stack.run(charge=False)
    assert not result.errors, result.errors
    assert result.completed == len(result.requests)
    # the premise: MAX_NUM_SEQS admitted at once want more blocks than the pool holds
    assert result.most_tokens_admitted() > POOL
    assert result.preemptions > 0, result.line()
    figures.append(
        f"vLLM --max-num-seqs {MAX_NUM_SEQS} --max-model-len 512 --num-gpu-blocks-override "
        f"{GPU_BLOCKS} ({POOL} tokens), {REQUESTS} requests (long 256+128 tokens and short "
        f"100+28 in turn) from {HANDLERS} handler processes x {THREADS} threads, "
        f"{result.line()}"
    )


@pytest.mark.skipif(
    not tokens_supported(), reason="this checkout's admission takes no tokens (issue 47)"
)
def test_r_k5_admission_in_tokens_keeps_vllm_preemptions_at_0(
    stack: TokenStack, figures: list[str]
) -> None:
    result = stack.run(charge=True)
    assert not result.errors, result.errors
    assert result.completed == len(result.requests)
    assert result.most_tokens_admitted() <= POOL
    assert result.preemptions == 0, result.line()
    figures.append(f"vLLM, the same load in the same run, {result.line()}")
