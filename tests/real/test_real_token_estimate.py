"""The token estimate (capacity_contract/tokens.py) against real servers' own counts.

Every text of token_corpus.py is sent as a completion's prompt (``max_tokens: 1``) and
the server's ``usage.prompt_tokens`` is what the estimate is held to: the charge the
middleware and the relay compute for that body (``prompt_tokens``, the template's
overheads included) is never below ``(1 - MARGIN)`` times it (R-T1, R-K7).

* **llama-server**, one a vocabulary: the tiny random-weight model of scripts/tiny_gguf.py
  carries a real model's tokenizer, copied from llama.cpp's own test vocabularies
  (``models/ggml-vocab-*.gguf``, which scripts/build-llama-server copies into the cache:
  Llama 2's SentencePiece, Llama 3's BPE, Qwen 2 and 3.5, Gemma 4, Phi-3, GPT-2,
  DeepSeek, Falcon, StarCoder, Command R...). So the counts are those real models'
  tokenizers, counted by a real server; the weights, and so the answers, are noise.
* **vLLM**, with tests/real/tiny_hf.py's model, whose tokenizer is a byte-level BPE of
  384 tokens trained on four sentences: a toy that spends about a token a byte on any
  text it was not trained on. Its counts show the byte ceiling (the most a tokenizer
  with byte fallback may spend: never exceeded) and how far a toy vocabulary falls
  outside the margin, not what a real model spends.

Each ratio (the estimate over the server's count) prints in the figures, one line a
server, lowest first.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from gwtest import free_port
from llama import LlamaServer, binary
from servers import STARTUP_S, python, start_vllm, tiny_model
from token_corpus import CORPUS

from capacity_contract.tokens import MARGIN, REQUEST_OVERHEAD, prompt_tokens, text_bytes

pytestmark = pytest.mark.timeout(STARTUP_S["vllm"] + 900)

# encoders (WordPiece), not the tokenizer of a model that serves completions
NOT_GENERATIVE = ("bert-bge", "nomic-bert-moe")


def vocabularies() -> list[Path]:
    server = binary()
    if server is None:
        return []
    models = server.parent.parent / "models"
    return sorted(
        p
        for p in models.glob("ggml-vocab-*.gguf")
        if p.stem.removeprefix("ggml-vocab-") not in NOT_GENERATIVE
    )


def served_tokens(url: str, text: str) -> int:
    answer = httpx.post(
        f"{url}/v1/completions",
        json={"model": "tiny", "prompt": text, "max_tokens": 1},
        timeout=120,
        trust_env=False,
    )
    assert answer.status_code == 200, answer.text[:500]
    return int(answer.json()["usage"]["prompt_tokens"])


def ratios(url: str) -> dict[str, tuple[int, int]]:
    """Each corpus text: (the estimate charged for it, the server's prompt_tokens)."""
    return {
        name: (prompt_tokens({"prompt": text}), served_tokens(url, text))
        for name, text in CORPUS.items()
    }


def line(server: str, counted: dict[str, tuple[int, int]]) -> str:
    shown = sorted(counted.items(), key=lambda kv: kv[1][0] / kv[1][1])
    parts = [f"{name} {e}/{u}={e / u:.2f}" for name, (e, u) in shown]
    return f"{server}: estimate/prompt_tokens " + ", ".join(parts)


@pytest.fixture
def vocab_server(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[LlamaServer]:
    import subprocess
    import sys

    vocab: Path = request.param
    model = tmp_path / f"tiny-{vocab.stem}.gguf"
    root = Path(__file__).resolve().parents[2]
    subprocess.run(
        [sys.executable, str(root / "scripts" / "tiny_gguf.py"), str(vocab), str(model)],
        check=True,
        capture_output=True,
    )
    server = LlamaServer(
        ["-m", str(model), "--alias", "tiny", "-c", "2048", "--parallel", "1"],
        tmp_path / "llama.log",
    )
    try:
        server.wait_healthy()
        yield server
    finally:
        server.stop()


@pytest.mark.skipif(
    not vocabularies(),
    reason="no llama-server: `make real-workers` builds one and sets GWCAP_LLAMA_SERVER",
)
@pytest.mark.parametrize(
    "vocab_server",
    vocabularies(),
    ids=lambda p: p.stem.removeprefix("ggml-vocab-"),
    indirect=True,
)
def test_r_t1_the_estimate_holds_real_tokenizers_within_its_margin(
    vocab_server: LlamaServer, request: pytest.FixtureRequest, figures: list[str]
) -> None:
    name = request.node.callspec.id
    counted = ratios(vocab_server.url)
    figures.append(line(f"llama-server, {name} vocabulary", counted))
    under = {k: (e, u) for k, (e, u) in counted.items() if e < (1 - MARGIN) * u}
    assert under == {}, f"{name}: under-counted past the margin of {MARGIN:.0%}: {under}"


@pytest.mark.skipif(python("vllm") is None, reason="no vLLM venv (make real-workers)")
def test_r_t1_on_vllms_toy_tokenizer_the_byte_ceiling_holds(
    tmp_path: Path, figures: list[str]
) -> None:
    port = free_port()
    server = start_vllm(
        tiny_model("vllm", tmp_path), port, tmp_path / "vllm.log", max_model_len=4096
    )
    try:
        server.wait_healthy(STARTUP_S["vllm"])
        counted = ratios(server.url)
    finally:
        server.stop()
    figures.append(line("vLLM, tiny_hf.py's 384-token toy vocabulary", counted))
    for name, (_, used) in counted.items():
        ceiling = text_bytes(CORPUS[name]) + REQUEST_OVERHEAD
        assert used <= ceiling, (name, used, ceiling)
