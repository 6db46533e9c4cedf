"""Write a tiny random-weight llama GGUF for tests against a real llama-server.

The weights are noise (the answers are gibberish); what matters is that llama-server
loads it in well under a second on a CPU and serves its slots, health, props and
completions for real. The tokenizer is llama.cpp's own SentencePiece test vocabulary
(models/ggml-vocab-llama-spm.gguf, copied by scripts/build-llama-server), so prompts
tokenize as in a real llama model.

    python scripts/tiny_gguf.py VOCAB.gguf OUT.gguf [--name NAME]
"""

from __future__ import annotations

import argparse
import sys

import gguf
import numpy as np

N_EMBD = 64
N_HEAD = 4
N_LAYER = 2
N_FF = 128
N_CTX = 2048


def _copy_tokenizer(reader: gguf.GGUFReader, writer: gguf.GGUFWriter) -> int:
    """Copy every tokenizer.* key of the vocabulary file; returns the vocabulary size."""
    n_vocab = 0
    for name, field in reader.fields.items():
        if not name.startswith("tokenizer."):
            continue
        value = field.contents()
        kind = field.types[0]
        if kind == gguf.GGUFValueType.ARRAY:
            sub = field.types[-1]
            writer.add_key_value(name, value, kind, sub_type=sub)
            if name == "tokenizer.ggml.tokens":
                n_vocab = len(value)
        else:
            writer.add_key_value(name, value, kind)
    if not n_vocab:
        raise SystemExit("tiny_gguf: the vocabulary file has no tokenizer.ggml.tokens")
    return n_vocab


def write(vocab_path: str, out_path: str, name: str) -> None:
    reader = gguf.GGUFReader(vocab_path)
    writer = gguf.GGUFWriter(out_path, "llama")
    writer.add_name(name)
    writer.add_context_length(N_CTX)
    writer.add_embedding_length(N_EMBD)
    writer.add_block_count(N_LAYER)
    writer.add_feed_forward_length(N_FF)
    writer.add_head_count(N_HEAD)
    writer.add_head_count_kv(N_HEAD)
    writer.add_rope_dimension_count(N_EMBD // N_HEAD)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    n_vocab = _copy_tokenizer(reader, writer)
    rng = np.random.default_rng(0)

    def tensor(tname: str, *shape: int) -> None:
        writer.add_tensor(tname, (rng.standard_normal(shape) * 0.02).astype(np.float32))

    tensor("token_embd.weight", n_vocab, N_EMBD)
    writer.add_tensor("output_norm.weight", np.ones(N_EMBD, dtype=np.float32))
    tensor("output.weight", n_vocab, N_EMBD)
    for i in range(N_LAYER):
        writer.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(N_EMBD, dtype=np.float32))
        writer.add_tensor(f"blk.{i}.ffn_norm.weight", np.ones(N_EMBD, dtype=np.float32))
        for part in ("attn_q", "attn_k", "attn_v", "attn_output"):
            tensor(f"blk.{i}.{part}.weight", N_EMBD, N_EMBD)
        tensor(f"blk.{i}.ffn_gate.weight", N_FF, N_EMBD)
        tensor(f"blk.{i}.ffn_up.weight", N_FF, N_EMBD)
        tensor(f"blk.{i}.ffn_down.weight", N_EMBD, N_FF)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("vocab")
    parser.add_argument("out")
    parser.add_argument("--name", default="tiny-llama")
    args = parser.parse_args(argv)
    write(args.vocab, args.out, args.name)
    return 0


if __name__ == "__main__":
    sys.exit(main())
