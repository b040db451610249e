"""Grouped-query attention models routed as DeepSeek-V3 (sigmoid scores, the choice biased by
a correction bias), as ArchSpec data for the one decoder.

- `glm4_moe` (GLM-4.5, 4.6, 4.7, GLM-4.5-Air): q/k/v biases (no output bias), optional q/k
  norms (`use_qk_norm`), rotary on the leading `partial_rotary_factor` of each head
  (rotate-half); `noaux_tc` routing within the best `topk_group` of `n_group` groups, weights
  renormalised and scaled; plain shared experts beside the routed ones, the first
  `first_k_dense_replace` layers dense. The multi-token-prediction layer the checkpoints ship
  after the last is skipped at load, as DeepSeek's.
- `minimax_m2` (MiniMax-M2, M2.1): every layer routed, no groups, no shared expert, weights
  renormalised; q/k norms over all heads' channels at once (`qk_norm_full`: one RMSNorm of
  `heads x head_dim` weights, before the split into heads); rotary on the leading `rotary_dim`.
"""

from __future__ import annotations

from typing import Any

from ftrs.errors import ModelLoadError
from ftrs.layers.moe import GROUPED_SIGMOID


def glm4_moe_fields(cfg: dict[str, Any], layers: int, head_dim: int,
                    source: str) -> dict[str, Any]:
    """The `ArchSpec` fields of a glm4_moe config (shapes checked, names in the error)."""
    def need(key: str) -> int:
        v = cfg.get(key)
        if not isinstance(v, int) or v < 1:
            raise ModelLoadError(source, f"glm4_moe needs a positive {key!r}, got {v!r}")
        return v

    experts, top_k, moe_inter = (need(k) for k in ("n_routed_experts", "num_experts_per_tok",
                                                    "moe_intermediate_size"))
    n_group, topk_group = int(cfg.get("n_group") or 1), int(cfg.get("topk_group") or 1)
    if experts % n_group or not 1 <= topk_group <= n_group or top_k > experts \
            or experts // n_group < 2:
        raise ModelLoadError(source, f"bad glm4_moe routing: {experts} experts in {n_group} "
                             f"groups (two or more each), top-{topk_group} groups, "
                             f"top-{top_k} experts")
    params = cfg.get("rope_parameters") or {}
    factor = float(params.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 0.5)))
    rotary = int(head_dim * factor)
    if rotary < 2 or rotary % 2 or rotary > head_dim:
        raise ModelLoadError(source, f"partial_rotary_factor {factor} gives {rotary} rotary "
                             f"dims of {head_dim}")
    first_dense = int(cfg.get("first_k_dense_replace") or 0)
    return {
        "num_experts": experts, "top_k": top_k, "moe_intermediate_size": moe_inter,
        "moe_layers": tuple(range(first_dense, layers)),
        "norm_topk_prob": bool(cfg.get("norm_topk_prob", True)),
        "router": GROUPED_SIGMOID, "router_groups": (n_group, topk_group),
        "routed_scaling_factor": float(cfg.get("routed_scaling_factor", 1.0)),
        "shared_expert_intermediate_size": moe_inter * int(cfg.get("n_shared_experts") or 0),
        "qk_norm": bool(cfg.get("use_qk_norm", False)), "o_bias": False,
        "rotary_dim": 0 if rotary == head_dim else rotary,
    }


def minimax_m2_fields(cfg: dict[str, Any], head_dim: int, source: str) -> dict[str, Any]:
    """The `ArchSpec` fields of a minimax_m2 config (the expert fields are Mixtral's, read by
    `arch_from_config`)."""
    if cfg.get("scoring_func", "sigmoid") != "sigmoid" or not cfg.get("use_routing_bias", True):
        raise ModelLoadError(source, "minimax_m2 routes by sigmoid scores with a routing bias; "
                             f"got scoring_func={cfg.get('scoring_func')!r}, "
                             f"use_routing_bias={cfg.get('use_routing_bias')!r}")
    if cfg.get("shared_intermediate_size"):
        raise ModelLoadError(source, "minimax_m2 with a shared expert is not supported")
    if cfg.get("qk_norm_type", "per_layer") != "per_layer":
        raise ModelLoadError(source, f"minimax_m2 qk_norm_type {cfg['qk_norm_type']!r} is not "
                             "supported (per_layer)")
    params = cfg.get("rope_parameters") or {}
    factor = params.get("partial_rotary_factor", cfg.get("partial_rotary_factor"))
    rotary = int(cfg.get("rotary_dim") or head_dim * float(factor or 1.0))
    if rotary < 2 or rotary % 2 or rotary > head_dim:
        raise ModelLoadError(source, f"rotary_dim {rotary} of head_dim {head_dim}")
    norm = bool(cfg.get("use_qk_norm", True))
    return {"router": GROUPED_SIGMOID, "router_groups": (1, 1), "norm_topk_prob": True,
            "routed_scaling_factor": float(cfg.get("routed_scaling_factor", 1.0)),
            "qk_norm": False, "qk_norm_full": norm,
            "rotary_dim": 0 if rotary == head_dim else rotary}
