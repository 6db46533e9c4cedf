"""Write a tiny random-weight Llama in Hugging Face layout (config.json, safetensors,
tokenizer), for the real vLLM, mlx_lm and ``transformers serve`` of tests/real.

Run with the server's own python (each server's venv has numpy, safetensors,
tokenizers and transformers); nothing is downloaded. The tokenizer is a byte-level BPE
trained here on a few sentences; the chat template is a plain one.

The weights are noise, but the end-of-sequence token is made unreachable: dimension 0
of the residual stream is a constant that no layer writes, and the output row of
``</s>`` reads only that dimension, negatively. So every answer runs to its
``max_tokens``, which is what the concurrency measurements need.

    python tiny_hf.py OUT_DIR [--layers N]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

HIDDEN = 128  # 4 heads of 32: vLLM's CPU attention needs a head dimension of 32 or more
HEADS = 4
INTERMEDIATE = 256
VOCAB = 384
SPECIALS = ["<unk>", "<s>", "</s>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>"
    "{% if m['content'] is string %}{{ m['content'] }}"
    "{% else %}{% for p in m['content'] %}{{ p['text'] }}{% endfor %}{% endif %}\n"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
CORPUS = [
    "the router reads how many requests each worker runs at once",
    "a gateway admits requests to a farm of inference workers",
    "hello world, how are you today? fine, thanks.",
    "0123456789 abcdefghijklmnopqrstuvwxyz ABCDEFGHIJKLMNOPQRSTUVWXYZ",
] * 20


def tokenizer(out: Path) -> None:
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>"
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(out))


def weights(layers: int, vocab: int, eos: int, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)

    def noise(*shape: int) -> np.ndarray:
        return (rng.standard_normal(shape) * 0.02).astype(np.float32)

    embed = noise(vocab, HIDDEN)
    embed[:, 0] = 4.0  # the constant dimension
    out: dict[str, np.ndarray] = {"model.embed_tokens.weight": embed}
    for i in range(layers):
        p = f"model.layers.{i}."
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            out[p + f"self_attn.{name}.weight"] = noise(HIDDEN, HIDDEN)
        out[p + "mlp.gate_proj.weight"] = noise(INTERMEDIATE, HIDDEN)
        out[p + "mlp.up_proj.weight"] = noise(INTERMEDIATE, HIDDEN)
        out[p + "mlp.down_proj.weight"] = noise(HIDDEN, INTERMEDIATE)
        out[p + "self_attn.o_proj.weight"][0, :] = 0.0  # nothing writes dimension 0
        out[p + "mlp.down_proj.weight"][0, :] = 0.0
        out[p + "input_layernorm.weight"] = np.ones(HIDDEN, np.float32)
        out[p + "post_attention_layernorm.weight"] = np.ones(HIDDEN, np.float32)
    out["model.norm.weight"] = np.ones(HIDDEN, np.float32)
    head = noise(vocab, HIDDEN)
    head[:, 0] = 0.0
    head[eos, :] = 0.0
    head[eos, 0] = -2.0  # </s> scores far below every other token, always
    out["lm_head.weight"] = head
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--layers", type=int, default=2)
    args = parser.parse_args()
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    tokenizer(out)
    vocab = json.loads((out / "tokenizer.json").read_text())["model"]["vocab"]
    size = max(len(vocab), max(vocab.values()) + 1)
    ids = {name: vocab[name] for name in SPECIALS}
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": HIDDEN,
        "intermediate_size": INTERMEDIATE,
        "num_hidden_layers": args.layers,
        "num_attention_heads": HEADS,
        "num_key_value_heads": HEADS,
        "head_dim": HIDDEN // HEADS,
        "hidden_act": "silu",
        "vocab_size": size,
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
        "attention_bias": False,
        "mlp_bias": False,
        "bos_token_id": ids["<s>"],
        "eos_token_id": ids["</s>"],
        "torch_dtype": "float32",
    }
    (out / "config.json").write_text(json.dumps(config, indent=1))
    (out / "generation_config.json").write_text(
        json.dumps({"bos_token_id": ids["<s>"], "eos_token_id": ids["</s>"], "do_sample": True})
    )
    save_file(
        weights(args.layers, size, ids["</s>"]),
        str(out / "model.safetensors"),
        metadata={"format": "pt"},
    )


if __name__ == "__main__":
    main()
