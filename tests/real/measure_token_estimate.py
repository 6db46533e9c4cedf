"""The token estimate (capacity_contract/tokens.py) against real models' tokenizers, offline.

Run with a python that has ``transformers``, ``tokenizers`` and ``gguf`` (the vLLM venv
of scripts/install-real-server, with ``gguf`` on ``PYTHONPATH``): each of llama.cpp's test
vocabularies (``models/ggml-vocab-*.gguf``, the real models' tokenizers that
scripts/build-llama-server copies into its cache) is converted by transformers' own GGUF
reader into a Hugging Face tokenizer (kept in OUT_DIR), and every text of token_corpus.py
is counted by it (no special tokens) and by ``text_tokens``. One line a tokenizer: the
ratios, estimate over tokens, the lowest first. test_real_token_estimate.py holds the same
texts against real servers' ``usage.prompt_tokens``.

    python tests/real/measure_token_estimate.py VOCAB_DIR OUT_DIR [NAME...]
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from token_corpus import CORPUS  # noqa: E402

# encoders (WordPiece), not the tokenizer of a model that serves completions
NOT_GENERATIVE = ("bert-bge", "nomic-bert-moe")


def _estimate_module():  # type: ignore[no-untyped-def]
    """capacity_contract/tokens.py by its path: this python need not have the product."""
    path = HERE.parents[1] / "capacity_contract" / "tokens.py"
    spec = importlib.util.spec_from_file_location("token_estimate", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["token_estimate"] = module
    spec.loader.exec_module(module)
    return module


def main(argv: list[str]) -> int:
    from tokenizers import Tokenizer
    from transformers import AutoTokenizer

    vocab_dir, out_dir, *names = argv
    estimate = _estimate_module()
    if not names:
        names = sorted(
            p.stem.removeprefix("ggml-vocab-") for p in Path(vocab_dir).glob("ggml-vocab-*.gguf")
        )
    for name in names:
        if name in NOT_GENERATIVE:
            continue
        converted = Path(out_dir) / name / "tokenizer.json"
        if not converted.exists():
            try:
                fast = AutoTokenizer.from_pretrained(vocab_dir, gguf_file=f"ggml-vocab-{name}.gguf")
            except Exception as exc:  # a vocabulary transformers cannot convert: said, skipped
                print(f"{name}: not converted ({type(exc).__name__}: {str(exc)[:120]})")
                continue
            fast.save_pretrained(str(converted.parent))
        tokenizer = Tokenizer.from_file(str(converted))
        counted = {
            text_name: (
                estimate.text_tokens(text),
                len(tokenizer.encode(text, add_special_tokens=False).ids),
            )
            for text_name, text in CORPUS.items()
        }
        shown = sorted(counted.items(), key=lambda kv: kv[1][0] / kv[1][1])
        print(
            f"{name} ({tokenizer.get_vocab_size()} tokens): "
            + ", ".join(f"{k} {e}/{n}={e / n:.2f}" for k, (e, n) in shown),
            flush=True,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
