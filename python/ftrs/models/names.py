"""Map checkpoint tensor names onto the decoder's own names.

Dense tensors get a short key (`"3.q"`, `"embed"`); routed-expert tensors get an
`ExpertKey(layer, expert, tensor)` with tensor 0 = gate, 1 = up, 2 = down (3, 4, 5: their biases,
where an architecture has them), which is the order of the host expert pool's layout.

gpt_oss ships each layer's experts as a few tensors holding every expert (`mlp.experts.gate_up_proj`
and its bias, `down_proj` and its bias, or the MXFP4 `*_blocks` and `*_scales`): those map to a
`PackedExperts(layer, part)`, which `models.packed_experts` cuts into the per-expert tensors.
"""

from __future__ import annotations

import re
from typing import NamedTuple

import torch

GATE, UP, DOWN = 0, 1, 2
GATE_BIAS, UP_BIAS, DOWN_BIAS = 3, 4, 5
#: Dense projections (key suffixes) a quantized checkpoint keeps quantized on the CPU: the
#: decoder computes them through `layers.linear`; the token embedding stays quantized too (the
#: decoder decodes the rows it looks up, and a tied LM head reads the blocks). Norms and routers
#: are dequantized.
PROJECTIONS = ("q", "k", "v", "o", "gate", "up", "down", "lm_head", "embed", "lin_qkv", "lin_z",
               "lin_out", "shared_gate", "shared_up", "shared_down", "q_a", "q_b", "kv_a",
               "kv_b")  # kv_b: read as a matrix by MLA (`models.mla`), dequantized there once


def keeps_quantized(key: str, device_type: str) -> bool:
    """Whether dense weight `key` of a quantized file stays quantized on `device_type`."""
    return device_type == "cpu" and key.rpartition(".")[2] in PROJECTIONS


class ExpertKey(NamedTuple):
    layer: int
    expert: int
    tensor: int


class PackedExperts(NamedTuple):
    """One tensor holding a part of every expert of a layer (gpt_oss)."""

    layer: int
    part: str  # gate_up_proj, gate_up_proj_bias, down_proj, down_proj_bias, *_blocks, *_scales


PACKED_PARTS = ("gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias",
                "gate_up_proj_blocks", "gate_up_proj_scales", "down_proj_blocks",
                "down_proj_scales")


_TOP = {
    "model.embed_tokens.weight": "embed",
    "model.norm.weight": "norm",
    "lm_head.weight": "lm_head",
}
_LAYER = re.compile(r"^model\.(?:language_model\.)?layers\.(\d+)\.(.+)$")
_EXPERT = re.compile(
    r"^(?:mlp|block_sparse_moe)\.experts\.(\d+)\.(gate_proj|up_proj|down_proj|w1|w2|w3)\.weight$"
)
_EXPERT_TENSOR = {"gate_proj": GATE, "w1": GATE, "up_proj": UP, "w3": UP, "down_proj": DOWN, "w2": DOWN}
_LAYER_DENSE = {
    "input_layernorm.weight": "input_norm",
    "post_attention_layernorm.weight": "post_norm",
    "self_attn.q_proj.weight": "q",
    "self_attn.k_proj.weight": "k",
    "self_attn.v_proj.weight": "v",
    "self_attn.o_proj.weight": "o",
    "self_attn.q_proj.bias": "q_bias",
    "self_attn.k_proj.bias": "k_bias",
    "self_attn.v_proj.bias": "v_bias",
    "self_attn.o_proj.bias": "o_bias",
    "self_attn.sinks": "sinks",
    "self_attn.q_norm.weight": "q_norm",
    "self_attn.k_norm.weight": "k_norm",
    "mlp.gate_proj.weight": "gate",
    "mlp.up_proj.weight": "up",
    "mlp.down_proj.weight": "down",
    "mlp.gate.weight": "router",
    "block_sparse_moe.gate.weight": "router",
    "mlp.shared_expert.gate_proj.weight": "shared_gate",
    "mlp.shared_expert.up_proj.weight": "shared_up",
    "mlp.shared_expert.down_proj.weight": "shared_down",
    "mlp.shared_expert_gate.weight": "shared_expert_gate",
    # deepseek_v3: MLA, plain shared experts, the router's correction bias
    "self_attn.q_a_proj.weight": "q_a",
    "self_attn.q_a_layernorm.weight": "q_a_norm",
    "self_attn.q_b_proj.weight": "q_b",
    "self_attn.kv_a_proj_with_mqa.weight": "kv_a",
    "self_attn.kv_a_layernorm.weight": "kv_a_norm",
    "self_attn.kv_b_proj.weight": "kv_b",
    "mlp.shared_experts.gate_proj.weight": "shared_gate",
    "mlp.shared_experts.up_proj.weight": "shared_up",
    "mlp.shared_experts.down_proj.weight": "shared_down",
    "mlp.gate.e_score_correction_bias": "router_correction",
    "block_sparse_moe.e_score_correction_bias": "router_correction",  # minimax_m2
    # Gated DeltaNet (linear attention) layers
    "linear_attn.in_proj_qkv.weight": "lin_qkv",
    "linear_attn.in_proj_z.weight": "lin_z",
    "linear_attn.in_proj_b.weight": "lin_b",
    "linear_attn.in_proj_a.weight": "lin_a",
    "linear_attn.in_proj_qkvz.weight": "lin_qkvz",  # qwen3_next: grouped by key head
    "linear_attn.in_proj_ba.weight": "lin_ba",
    "linear_attn.conv1d.weight": "lin_conv",
    "linear_attn.dt_bias": "lin_dt_bias",
    "linear_attn.A_log": "lin_a_log",
    "linear_attn.norm.weight": "lin_norm",
    "linear_attn.out_proj.weight": "lin_out",
    "mlp.router.weight": "router",
    "mlp.router.bias": "router_bias",
}


def map_hf_name(name: str) -> str | ExpertKey | PackedExperts | None:
    """The decoder's key for an HF tensor name, or None for tensors the decoder does not use
    (a multimodal checkpoint's vision tower, multi-token-prediction heads)."""
    if name.startswith("model.language_model."):
        name = "model." + name.removeprefix("model.language_model.")
    if name in _TOP:
        return _TOP[name]
    m = _LAYER.match(name)
    if not m:
        return None
    layer, rest = int(m.group(1)), m.group(2)
    e = _EXPERT.match(rest)
    if e:
        return ExpertKey(layer, int(e.group(1)), _EXPERT_TENSOR[e.group(2)])
    part = rest.removeprefix("mlp.experts.")
    if part != rest and part in PACKED_PARTS:
        return PackedExperts(layer, part)
    short = _LAYER_DENSE.get(rest)
    return f"{layer}.{short}" if short else None


def split_grouped_qkvz(qkvz: torch.Tensor, ba: torch.Tensor, num_k_heads: int, k_dim: int,
                       v_dim: int, v_per_k: int) -> dict[str, torch.Tensor]:
    """qwen3_next's DeltaNet input projections, grouped per key head ([q, k, v.., z..] and
    [b.., a..] per head), as the flat rows of qwen3_5_moe's: q of every head, then k, then v
    (`lin_qkv`), z, b and a. A permutation of rows: exact in any dtype."""
    hidden = qkvz.shape[1]
    g = qkvz.view(num_k_heads, 2 * k_dim + 2 * v_per_k * v_dim, hidden)
    q, k, v, z = g.split([k_dim, k_dim, v_per_k * v_dim, v_per_k * v_dim], dim=1)
    b, a = ba.view(num_k_heads, 2 * v_per_k, hidden).split([v_per_k, v_per_k], dim=1)
    flat = [t.reshape(-1, hidden) for t in (q, k, v)]
    return {"lin_qkv": torch.cat(flat).contiguous(), "lin_z": z.reshape(-1, hidden).contiguous(),
            "lin_b": b.reshape(-1, hidden).contiguous(), "lin_a": a.reshape(-1, hidden).contiguous()}
