"""`ftrs models make-tiny`: small random checkpoints in the Hugging Face format, for fast tests.

Weights are drawn from N(0, 0.1²) with a seeded generator: a range wide enough that the logits of
the top two tokens are far apart, so greedy argmax is stable under float reordering. Each
checkpoint comes with a byte-level tokenizer and a ChatML template, so it can be served.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from tokenizers import AddedToken, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

from ftrs.errors import ConfigError
from ftrs.models.out_dir import made_for, writing_into
from ftrs.models.tokenizer import Tokenizer

ARCHS = ("llama", "qwen3", "mixtral", "qwen3_moe")
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
          "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
INIT_STD = 0.1
SEEDS = (-(2**63), 2**64 - 1)  # what `torch.Generator.manual_seed` takes


def check_seed(seed: int, command: str) -> None:
    """ConfigError unless torch's generator takes `seed` (a 64-bit integer, signed or not):
    a bigger one would end in torch's `ValueError` traceback."""
    if not SEEDS[0] <= seed <= SEEDS[1]:
        raise ConfigError(f"{command}: --seed {seed} is out of range: give an integer from "
                          f"{SEEDS[0]} to {SEEDS[1]}")


def tiny_config(arch: str) -> dict[str, Any]:
    if arch not in ARCHS:
        raise ConfigError(f"make-tiny: unknown arch {arch!r} (one of {', '.join(ARCHS)})")
    cfg: dict[str, Any] = {
        "model_type": arch, "vocab_size": 512, "hidden_size": 64, "num_hidden_layers": 3,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
        "intermediate_size": 96, "rms_norm_eps": 1e-6, "max_position_embeddings": 2048,
        "tie_word_embeddings": arch == "qwen3", "hidden_act": "silu", "bos_token_id": 1,
        "eos_token_id": 2, "initializer_range": INIT_STD, "torch_dtype": "float32",
        "attention_bias": False, "attention_dropout": 0.0,
    }
    if arch in ("llama", "mixtral"):
        cfg["rope_theta"] = 10000.0
    else:  # the newer spelling, so both are exercised
        cfg["rope_parameters"] = {"rope_type": "default", "rope_theta": 1000000.0}
    if arch == "mixtral":
        cfg |= {"num_local_experts": 8, "num_experts_per_tok": 2}
    if arch == "qwen3_moe":
        cfg |= {"num_experts": 8, "num_experts_per_tok": 4, "moe_intermediate_size": 48,
                "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": [1]}
    return cfg


def tiny_tokenizer(vocab_size: int, specials: Sequence[str] = ()) -> Tokenizer:
    """A byte-level tokenizer of `vocab_size` ids; ids past the bytes are special tokens, the
    first of them `specials` (a tool format's tags, say), the rest reserved."""
    byte_chars = sorted(pre_tokenizers.ByteLevel.alphabet())
    chatml = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    vocab = {t: i for i, t in enumerate(chatml)}
    for ch in byte_chars:
        vocab[ch] = len(vocab)
    tk = HFTokenizer(models.BPE(vocab, [], fuse_unk=False))
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tk.decoder = decoders.ByteLevel()
    named = [t for t in specials if t not in vocab]
    reserved = [f"<|reserved_{i}|>" for i in range(vocab_size - len(vocab) - len(named))]
    tk.add_special_tokens([AddedToken(t, special=True, normalized=False)
                           for t in chatml + named + reserved])
    return Tokenizer(tk, CHATML, "<|im_start|>", "<|im_end|>", [2], add_bos=False)


def tiny_tensors(cfg: dict[str, Any], seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * INIT_STD

    def norm(n: int) -> torch.Tensor:
        return 1.0 + 0.1 * torch.randn(n, generator=g)

    arch, h, v = cfg["model_type"], cfg["hidden_size"], cfg["vocab_size"]
    nh, nkv, hd = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    t: dict[str, torch.Tensor] = {"model.embed_tokens.weight": rnd(v, h), "model.norm.weight": norm(h)}
    if not cfg["tie_word_embeddings"]:
        t["lm_head.weight"] = rnd(v, h)
    for layer in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{layer}."
        t |= {p + "input_layernorm.weight": norm(h), p + "post_attention_layernorm.weight": norm(h),
              p + "self_attn.q_proj.weight": rnd(nh * hd, h),
              p + "self_attn.k_proj.weight": rnd(nkv * hd, h),
              p + "self_attn.v_proj.weight": rnd(nkv * hd, h),
              p + "self_attn.o_proj.weight": rnd(h, nh * hd)}
        if arch in ("qwen3", "qwen3_moe"):
            t |= {p + "self_attn.q_norm.weight": norm(hd), p + "self_attn.k_norm.weight": norm(hd)}
        moe = arch == "mixtral" or (arch == "qwen3_moe" and layer not in cfg["mlp_only_layers"])
        if not moe:
            i = cfg["intermediate_size"]
            t |= {p + "mlp.gate_proj.weight": rnd(i, h), p + "mlp.up_proj.weight": rnd(i, h),
                  p + "mlp.down_proj.weight": rnd(h, i)}
        elif arch == "mixtral":
            i = cfg["intermediate_size"]
            t[p + "block_sparse_moe.gate.weight"] = rnd(cfg["num_local_experts"], h)
            for e in range(cfg["num_local_experts"]):
                q = f"{p}block_sparse_moe.experts.{e}."
                t |= {q + "w1.weight": rnd(i, h), q + "w3.weight": rnd(i, h), q + "w2.weight": rnd(h, i)}
        else:
            i = cfg["moe_intermediate_size"]
            t[p + "mlp.gate.weight"] = rnd(cfg["num_experts"], h)
            for e in range(cfg["num_experts"]):
                q = f"{p}mlp.experts.{e}."
                t |= {q + "gate_proj.weight": rnd(i, h), q + "up_proj.weight": rnd(i, h),
                      q + "down_proj.weight": rnd(h, i)}
    return t


def make_tiny(arch: str, out_dir: Path, seed: int = 0, dtype: torch.dtype = torch.float32,
              specials: Sequence[str] = ()) -> Path:
    """Write config.json, model.safetensors and a tokenizer (`specials` among its special
    tokens, see `tiny_tokenizer`) to `out_dir`, a new or empty directory; returns it. Raises
    ConfigError where `out_dir` is a file, holds anything (another model's files would be
    loaded with the new ones), cannot be made or cannot be written (`out_dir.prepare_out_dir`)."""
    cfg = tiny_config(arch)
    check_seed(seed, "make-tiny")
    cfg["torch_dtype"] = str(dtype).removeprefix("torch.")
    with made_for(out_dir, "make-tiny", "--out", must_be_empty=True):
        tensors = {k: v.to(dtype).contiguous() for k, v in tiny_tensors(cfg, seed).items()}
        with writing_into(out_dir, "make-tiny", "--out"):
            save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
            (out_dir / "config.json").write_text(json.dumps(cfg, indent=2))
            tiny_tokenizer(cfg["vocab_size"], specials).save(out_dir)
    return out_dir
