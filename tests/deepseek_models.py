"""Tiny deepseek_v3 and deepseek_v2 checkpoints (MLA, grouped routing, shared experts), and
glm4_moe and minimax_m2 ones (V3's routing beside grouped-query attention), built with
transformers, for tests.

Odd sizes on purpose: qk_head_dim 20 against hidden / heads = 12, kv_lora_rank 16, v_head_dim
10, six routed experts (not a power of two) in three groups of which two are kept, top-3, one
shared expert, the first layer dense (the pattern starts with the rarer kind). The weights are
redrawn from a seeded generator at scales that make every path matter, the router's correction
bias included (it decides the choice, not the weights), then saved by transformers'
`save_pretrained`, with the byte-level tokenizer of `ftrs.models.tiny`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from ftrs.models.tiny import tiny_tokenizer

CONFIG: dict[str, Any] = {
    "vocab_size": 512, "hidden_size": 48, "intermediate_size": 56, "moe_intermediate_size": 24,
    "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 4,
    "n_shared_experts": 1, "n_routed_experts": 6, "num_experts_per_tok": 3, "n_group": 3,
    "topk_group": 2, "first_k_dense_replace": 1, "q_lora_rank": 20, "kv_lora_rank": 16,
    "qk_nope_head_dim": 12, "qk_rope_head_dim": 8, "v_head_dim": 10,
    "routed_scaling_factor": 2.5, "norm_topk_prob": True, "max_position_embeddings": 1024,
    "rms_norm_eps": 1e-6, "bos_token_id": 1, "eos_token_id": 2,
}
#: YaRN as DeepSeek-V3 ships it (mscale and mscale_all_dim: the softmax scale changes too)
YARN = {"rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                            "original_max_position_embeddings": 256, "beta_fast": 32.0,
                            "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0}}


#: deepseek_v2 (V2-Lite's design: no q_lora, softmax routing, two shared experts), and V2's
#: own group-limited routing (groups scored by their best expert, weights scaled)
V2_LITE = {"arch": "deepseek_v2", "q_lora_rank": None, "n_shared_experts": 2, "n_group": None,
           "topk_group": None, "topk_method": "greedy", "routed_scaling_factor": 1.0,
           "norm_topk_prob": False}
V2_GROUPED = {"arch": "deepseek_v2", "n_group": 3, "topk_group": 2,
              "topk_method": "group_limited_greedy", "routed_scaling_factor": 16.0,
              "norm_topk_prob": False}


#: glm4_moe (GLM-4.5): DeepSeek-V3's routing and shared experts beside grouped-query attention
#: with q/k/v biases, q/k norms and rotary on half of each head
GLM: dict[str, Any] = {
    "vocab_size": 512, "hidden_size": 48, "intermediate_size": 56, "moe_intermediate_size": 24,
    "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
    "n_shared_experts": 1, "n_routed_experts": 6, "num_experts_per_tok": 3, "n_group": 3,
    "topk_group": 2, "first_k_dense_replace": 1, "routed_scaling_factor": 2.5,
    "norm_topk_prob": True, "use_qk_norm": True, "attention_bias": True,
    "partial_rotary_factor": 0.5, "max_position_embeddings": 1024, "rms_norm_eps": 1e-5,
    "bos_token_id": 1, "eos_token_id": 2,
}


#: minimax_m2 (MiniMax-M2): every layer routed by V3's sigmoid scores with a correction bias (no
#: groups, no shared expert), q/k norms over all heads' channels, rotary on 8 of 16 channels
MINIMAX: dict[str, Any] = {
    "vocab_size": 512, "hidden_size": 48, "intermediate_size": 24, "num_hidden_layers": 3,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "num_local_experts": 6,
    "num_experts_per_tok": 3, "rotary_dim": 8, "max_position_embeddings": 1024,
    "bos_token_id": 1, "eos_token_id": 2,
}
_BASE = {"glm4_moe": GLM, "minimax_m2": MINIMAX}


def build(out_dir: Path, seed: int = 1, dtype: torch.dtype = torch.float32,
          arch: str = "deepseek_v3", **changes: Any) -> Path:
    """A tiny `arch` (deepseek_v3, deepseek_v2, glm4_moe, glm4_moe_lite: GLM-4.7-Flash, V3's
    design, its dense layers in `mlp_layer_types`, or minimax_m2) checkpoint written by
    transformers into `out_dir` (`changes` override the config); returns it."""
    import transformers

    make = {"deepseek_v3": transformers.DeepseekV3Config,
            "deepseek_v2": transformers.DeepseekV2Config,
            "glm4_moe": transformers.Glm4MoeConfig,
            "glm4_moe_lite": transformers.Glm4MoeLiteConfig,
            "minimax_m2": transformers.MiniMaxM2Config}[arch]
    cfg = make(**(_BASE.get(arch, CONFIG) | changes))
    model = transformers.AutoModelForCausalLM.from_config(cfg)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, p in sorted(model.named_parameters()):
            r = torch.randn(p.shape, generator=g)
            p.copy_(1.0 + 0.1 * r if p.dim() == 1 else 0.1 * r)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.3 * torch.randn(b.shape, generator=g))
    model.to(dtype).save_pretrained(str(out_dir))
    tiny_tokenizer(CONFIG["vocab_size"]).save(out_dir)
    return out_dir


def hf_model(path: Path, dtype: torch.dtype = torch.float32) -> Any:
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(
        str(path), dtype=dtype, experts_implementation="eager").eval()


def with_mtp_layer(src: Path, dst: Path) -> Path:
    """`src` copied to `dst` with a multi-token-prediction layer after its last, as DeepSeek-V3
    and GLM-4.5 ship theirs (layer num_hidden_layers: a copy of the last layer, experts
    included, and a tensor of its own)."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    d = shutil.copytree(src, dst)
    last = json.loads((d / "config.json").read_text())["num_hidden_layers"] - 1
    t = load_file(str(d / "model.safetensors"))
    t |= {k.replace(f"layers.{last}.", f"layers.{last + 1}."): v.clone()
          for k, v in t.items() if f".layers.{last}." in k}
    t[f"model.layers.{last + 1}.eh_proj.weight"] = torch.zeros(48, 96)
    save_file(t, str(d / "model.safetensors"))
    return d
