"""Tiny Gated DeltaNet hybrids (qwen3_5_moe, qwen3_next) built with transformers, for tests.

The configs have odd sizes on purpose: head_dim != hidden / heads, partial rotary, top-3 of 7
experts, grouped value heads, and a layer pattern that starts with the rarer layer type. The
weights are redrawn from a seeded generator at scales that make every path matter (norm
weights around their neutral value, decays neither ~0 nor ~1), then saved by transformers'
own `save_pretrained`, with the byte-level tokenizer of `ftrs.models.tiny`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from ftrs.models.tiny import tiny_tokenizer

LAYERS = ["full_attention", "linear_attention", "linear_attention", "full_attention",
          "linear_attention"]
COMMON: dict[str, Any] = {
    "vocab_size": 512, "hidden_size": 48, "num_hidden_layers": len(LAYERS),
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 24,
    "linear_conv_kernel_dim": 4, "linear_key_head_dim": 12, "linear_value_head_dim": 10,
    "linear_num_key_heads": 2, "linear_num_value_heads": 4, "moe_intermediate_size": 24,
    "shared_expert_intermediate_size": 40, "num_experts": 7, "num_experts_per_tok": 3,
    "layer_types": LAYERS, "max_position_embeddings": 1024, "rms_norm_eps": 1e-6,
    "eos_token_id": 2, "bos_token_id": 1,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0,
                        "partial_rotary_factor": 0.25},
}


#: a model a GGUF file can describe: every layer MoE, normalised top-k weights, one full
#: attention layer every `full_attention_interval` (2); expert rows of whole 32-value blocks
GGUF_DELTANET = {"mlp_only_layers": [], "norm_topk_prob": True, "hidden_size": 64,
                  "moe_intermediate_size": 32,
                  "layer_types": ["linear_attention", "full_attention"] * 2 + ["linear_attention"]}


def hf_config(arch: str, **changes: Any) -> Any:
    import transformers

    if arch == "qwen3_5_moe":
        return transformers.Qwen3_5MoeTextConfig(**(COMMON | changes))
    if arch == "qwen3_next":  # a dense MLP layer too, and unnormalised top-k weights
        return transformers.Qwen3NextConfig(**(COMMON | {
            "intermediate_size": 56, "mlp_only_layers": [2], "norm_topk_prob": False} | changes))
    raise ValueError(arch)


def _redraw(model: torch.nn.Module, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            r = torch.randn(p.shape, generator=g)
            if name.endswith("A_log"):  # decay rates exp(A_log) in [0.5, 4]
                p.copy_(torch.log(0.5 + 3.5 * torch.rand(p.shape, generator=g)))
            elif name.endswith("dt_bias"):
                p.copy_(0.5 * r)
            elif name.endswith("linear_attn.norm.weight"):  # plain scale
                p.copy_(1.0 + 0.1 * r)
            elif p.dim() == 1:  # zero-centred norms: the scale is 1 + w
                p.copy_(0.1 * r)
            elif "conv1d" in name:
                p.copy_(0.3 * r)
            else:
                p.copy_(0.1 * r)


def build(arch: str, out_dir: Path, seed: int = 1,
          dtype: torch.dtype = torch.float32, **changes: Any) -> Path:
    """A tiny `arch` checkpoint written by transformers into `out_dir` (`changes` override the
    config); returns it."""
    import transformers

    cfg = hf_config(arch, **changes)
    model = transformers.AutoModelForCausalLM.from_config(cfg)
    _redraw(model, seed)
    model.to(dtype).save_pretrained(str(out_dir))
    tiny_tokenizer(cfg.vocab_size).save(out_dir)
    return out_dir


def hf_model(path: Path) -> Any:
    import transformers

    # the experts one by one, as the reference module writes them (the grouped-GEMM default sums
    # in another order: ~1e-4 apart on these weights, where fp32 itself is ~1e-4 from fp64)
    m = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32,
                                                          experts_implementation="eager")
    return m.eval()
