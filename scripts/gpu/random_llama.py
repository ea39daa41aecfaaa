#!/usr/bin/env python3
"""Writes a Llama-3-8B-shaped model with random weights in the Hugging Face layout (config.json,
model-*.safetensors in bf16, a word-level tokenizer.json of the same vocabulary) for
`kvq bench --device cuda`: the shapes and bytes of the real model, no download.

    python3 scripts/gpu/random_llama.py OUT_DIR [--layers 32]
"""
import argparse
import json
import os

import torch
from safetensors.torch import save_file


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--context", type=int, default=40960)
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    hidden, inter, heads, kv, vocab = 4096, 14336, 32, 8, 128256
    hd = hidden // heads
    cfg = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden,
        "intermediate_size": inter,
        "num_hidden_layers": a.layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv,
        "head_dim": hd,
        "vocab_size": vocab,
        "max_position_embeddings": a.context,
        "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0,
        "tie_word_embeddings": False,
        "bos_token_id": 0,
        "eos_token_id": 1,
        "torch_dtype": "bfloat16",
    }
    with open(os.path.join(a.out, "config.json"), "w") as f:
        json.dump(cfg, f, indent=1)
    vocab_map = {"<unk>": 0}
    vocab_map.update({f"t{i}": i for i in range(1, vocab)})
    tok = {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": [],
        "normalizer": None,
        "pre_tokenizer": {"type": "WhitespaceSplit"},
        "post_processor": None,
        "decoder": None,
        "model": {"type": "WordLevel", "vocab": vocab_map, "unk_token": "<unk>"},
    }
    with open(os.path.join(a.out, "tokenizer.json"), "w") as f:
        json.dump(tok, f)
    g = torch.Generator(device="cuda").manual_seed(0)

    def rnd(*shape, std=0.02):
        return (torch.randn(*shape, generator=g, device="cuda") * std).to(torch.bfloat16).cpu()

    def ones(n):
        return torch.ones(n, dtype=torch.bfloat16)

    shard = {
        "model.embed_tokens.weight": rnd(vocab, hidden),
        "model.norm.weight": ones(hidden),
        "lm_head.weight": rnd(vocab, hidden),
    }
    save_file(shard, os.path.join(a.out, "model-00000.safetensors"))
    for i in range(a.layers):
        p = f"model.layers.{i}."
        shard = {
            p + "input_layernorm.weight": ones(hidden),
            p + "post_attention_layernorm.weight": ones(hidden),
            p + "self_attn.q_proj.weight": rnd(hidden, hidden),
            p + "self_attn.k_proj.weight": rnd(kv * hd, hidden),
            p + "self_attn.v_proj.weight": rnd(kv * hd, hidden),
            p + "self_attn.o_proj.weight": rnd(hidden, hidden),
            p + "mlp.gate_proj.weight": rnd(inter, hidden),
            p + "mlp.up_proj.weight": rnd(inter, hidden),
            p + "mlp.down_proj.weight": rnd(hidden, inter),
        }
        save_file(shard, os.path.join(a.out, f"model-{i + 1:05d}.safetensors"))
    print(f"wrote {a.layers} layers to {a.out}")


if __name__ == "__main__":
    main()
