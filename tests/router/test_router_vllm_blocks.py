"""vLLM gives each request whole KV blocks and keeps one block aside: the pool the router
reports for admission in tokens is what any ``--max-num-seqs`` requests can hold in
whole blocks (``sources.admissible_tokens``; DESIGN.md section 6c)."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from capacity_router.sources import admissible_tokens


def blocks_held(charges: list[int], block_size: int) -> int:
    """vLLM's allocation: ``cdiv(tokens, block_size)`` blocks a request."""
    return sum(-(-c // block_size) for c in charges)


@given(
    blocks=st.integers(2, 4096),
    block_size=st.sampled_from([1, 16, 32, 128]),
    seqs=st.integers(1, 64),
    data=st.data(),
)
def test_requests_within_the_admissible_pool_fit_in_whole_blocks(
    blocks: int, block_size: int, seqs: int, data: st.DataObject
) -> None:
    pool = admissible_tokens(((blocks, block_size),), seqs, None)
    bound = (blocks - 1) * block_size - seqs * (block_size - 1)
    if bound < block_size:
        return  # the one-block floor: a pool too small for its seqs (the next test)
    charges = data.draw(st.lists(st.integers(1, max(1, pool)), min_size=1, max_size=seqs))
    total = 0
    admitted = []
    for c in charges:  # what admission in tokens lets run together
        if total + c <= pool:
            admitted.append(c)
            total += c
    assert blocks_held(admitted, block_size) <= blocks - 1  # never a preemption


def test_the_pool_never_refuses_a_request_vllm_holds_alone() -> None:
    # --max-num-seqs 8, --max-model-len 512, 12 blocks of 128 (the CPU backend's size):
    # 8 requests of 129 tokens would take 16 blocks, so the bound is below one request;
    # one request of 512 in whole blocks is what admission may grant then
    assert admissible_tokens(((12, 128),), 8, 512) == 512
    assert admissible_tokens(((12, 128),), 2, 512) == 11 * 128 - 2 * 127
    # a GPU's usual sizes lose little: 4096 blocks of 16 for 256 sequences
    assert admissible_tokens(((4096, 16),), 256, 8192) == 4095 * 16 - 256 * 15
    # engines add up (data parallel)
    assert admissible_tokens(((12, 128), (12, 128)), 2, 512) == 2 * (11 * 128 - 2 * 127)


def test_a_stated_pool_in_whole_blocks_without_rounding_would_overcommit() -> None:
    """The counter-example the rule exists for: 12 blocks of 128 stated as 1536 tokens, 8
    requests of 129 tokens (1032 in all, within 1536) take 16 blocks."""
    assert 8 * 129 <= 12 * 128 and blocks_held([129] * 8, 128) > 12 - 1
    assert admissible_tokens(((12, 128),), 8, 512) < 8 * 129
