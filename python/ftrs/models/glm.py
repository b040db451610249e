"""GLM-4.5/4.6/4.7 (`glm4_moe`, and GLM-4.5-Air) as ArchSpec data for the one decoder.

Grouped-query attention with q/k/v biases (no output bias), optional q/k norms
(`use_qk_norm`), rotary on the leading `partial_rotary_factor` of each head (rotate-half); the
routing is DeepSeek-V3's (`noaux_tc`: sigmoid scores, the choice biased by
`e_score_correction_bias` within the best `topk_group` of `n_group` groups, weights
renormalised and scaled), with plain shared experts beside the routed ones and the first
`first_k_dense_replace` layers dense. The multi-token-prediction layer the checkpoints ship
after the last is skipped at load, as DeepSeek's.
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
        "qk_norm": bool(cfg.get("use_qk_norm", False)),
        "rotary_dim": 0 if rotary == head_dim else rotary,
    }
