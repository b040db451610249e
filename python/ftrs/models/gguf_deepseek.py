"""DeepSeek-V2/V3 GGUF files (llama.cpp's `deepseek2`), GLM-4.5's (`glm4moe`) and MiniMax-M2's
(`minimax-m2`: every layer routed by sigmoid scores, the rotary width in `rope.dimension_count`,
q/k norms over all heads where the file has them), both ways.

GLM-4.5 routes as DeepSeek-V3 and its file says so in the same `expert_*` fields; its attention
is plain grouped-query attention (rotate-half rotary, so no rows move), with the rotary width in
`rope.dimension_count` (a part of `attention.key_length`), q/k/v biases and q/k norms where the
file has those tensors, and the second norm named `post_attention_norm`; the converter appends
the MTP layer (`nextn_predict_layers`), which is left out.

What llama.cpp's converter does to a deepseek_v2 / deepseek_v3 checkpoint: MLA written as MQA
with one wide head (`attention.head_count_kv` 1, `key_length` = kv_lora_rank + rope dims,
`value_length` = kv_lora_rank; the real head sizes in `key_length_mla` / `value_length_mla`);
`kv_b_proj` cut per head into `attn_k_b` (the key rows, transposed: heads x kv_lora_rank x
nope) and `attn_v_b` (heads x v_head_dim x kv_lora_rank) for its absorbed attention (files from
before that change keep one `attn_kv_b`); the router's correction bias as `exp_probs_b.bias`;
routing as `expert_gating_func` (1 softmax, 2 sigmoid; absent in V2 files: softmax),
`expert_group_count` / `expert_group_used_count`, `expert_weights_scale`,
`expert_weights_norm`; YaRN's `mscale_all_dim` as `rope.scaling.yarn_log_multiplier` (0.1 x
it); the multi-token-prediction layer left out. The rotary pairs stay interleaved, as the
checkpoint has them (llama.cpp's "normal" rope), so no rows move.

The reader (`deepseek2_config`, `deepseek2_to_hf`) rebuilds the HF config and `kv_b_proj`; the
writer (`deepseek2_metadata`, `deepseek2_tensors`) makes the converter's changes for fixtures.
What the file cannot say is taken as the HF checkpoints have it: `mscale` equal to
`mscale_all_dim` (V2 and V3 ship them equal), a softmax file with groups routed as V2's
`group_limited_greedy` (a group scored by its best expert, as transformers does; llama.cpp
scores every file's groups by their top two).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from ftrs.errors import ConfigError, ModelLoadError

if TYPE_CHECKING:
    from ftrs.models.gguf_loader import GGUFTensor

#: deepseek2's own block names (the common ones are `gguf_loader._BLOCK`'s)
DEEPSEEK2_NAMES = {"attn_q_a": "self_attn.q_a_proj", "attn_q_a_norm": "self_attn.q_a_layernorm",
                   "attn_q_b": "self_attn.q_b_proj", "attn_kv_a_mqa": "self_attn.kv_a_proj_with_mqa",
                   "attn_kv_a_norm": "self_attn.kv_a_layernorm", "attn_kv_b": "self_attn.kv_b_proj",
                   "attn_k_b": "self_attn.k_b_proj", "attn_v_b": "self_attn.v_b_proj",
                   "ffn_gate_shexp": "mlp.shared_experts.gate_proj",
                   "ffn_up_shexp": "mlp.shared_experts.up_proj",
                   "ffn_down_shexp": "mlp.shared_experts.down_proj"}
#: glm4moe's own block names
GLM4MOE_NAMES = {"post_attention_norm": "post_attention_layernorm",
                 **{k: v for k, v in DEEPSEEK2_NAMES.items() if "shexp" in k}}
#: deepseek2 and glm4moe tensors whose HF name has no `.weight`/`.bias` of its own
DEEPSEEK2_BARE = {("exp_probs_b", "bias"): "mlp.gate.e_score_correction_bias"}
_SOFTMAX, _SIGMOID = 1, 2
_LOG_MUL = 0.1  # the converter's yarn_log_multiplier per unit of mscale_all_dim


def _getter(meta: dict[str, Any], arch: str, source: str) -> Callable[..., Any]:
    """`get(key, default=None)`: the file's `{arch}.{key}`, the default when absent, an error
    naming the key when neither is there."""
    def get(key: str, default: Any = None) -> Any:
        v = meta.get(f"{arch}.{key}", default)
        if v is None:
            raise ModelLoadError(source, f"missing GGUF metadata {arch}.{key}")
        return v
    return get


def deepseek2_config(meta: dict[str, Any], cfg: dict[str, Any], experts: int,
                     moe_layers: set[int], source: str) -> dict[str, Any]:
    """The deepseek_v3 (sigmoid gating) or deepseek_v2 (softmax) fields of a `deepseek2` file."""
    get = _getter(meta, "deepseek2", source)

    if experts < 1:
        raise ModelLoadError(source, "deepseek2 file without deepseek2.expert_count")
    rope = int(get("rope.dimension_count"))
    kv_rank = int(get("attention.kv_lora_rank"))
    if meta.get("deepseek2.attention.key_length_mla") is not None:  # MQA-shaped (2025 on)
        key, value = int(get("attention.key_length_mla")), int(get("attention.value_length_mla"))
    else:  # before the converter split kv_b: the real head sizes
        key, value = int(get("attention.key_length")), int(get("attention.value_length"))
    if key <= rope:
        raise ModelLoadError(source, f"deepseek2 key length {key} is not more than its "
                             f"{rope} rotary dims")
    gating = int(get("expert_gating_func", _SOFTMAX))
    if gating not in (_SOFTMAX, _SIGMOID):
        raise ModelLoadError(source, f"deepseek2.expert_gating_func {gating} is not supported "
                             "(1 softmax, 2 sigmoid)")
    groups = int(get("expert_group_count", 1))
    layers = cfg["num_hidden_layers"]
    first_dense = int(get("leading_dense_block_count", 0))
    if moe_layers != set(range(first_dense, layers)):
        raise ModelLoadError(source, f"deepseek2: routers (blk.N.ffn_gate_inp.weight) in layers "
                             f"{sorted(moe_layers)}, expected {first_dense}..{layers - 1}")
    sigmoid = gating == _SIGMOID
    heads = cfg["num_attention_heads"]
    out = {"model_type": "deepseek_v3" if sigmoid else "deepseek_v2",
           "num_key_value_heads": heads, "head_dim": rope,
           "q_lora_rank": int(meta.get("deepseek2.attention.q_lora_rank") or 0) or None,
           "kv_lora_rank": kv_rank, "qk_nope_head_dim": key - rope, "qk_rope_head_dim": rope,
           "v_head_dim": value, "rope_interleave": True,
           "n_routed_experts": experts, "n_shared_experts": int(get("expert_shared_count", 0)),
           "moe_intermediate_size": int(get("expert_feed_forward_length")),
           "intermediate_size": int(get("feed_forward_length", 0)),
           "first_k_dense_replace": first_dense, "moe_layer_freq": 1,
           "norm_topk_prob": bool(get("expert_weights_norm", False)),
           "routed_scaling_factor": float(get("expert_weights_scale", 1.0)),
           "n_group": groups, "topk_group": int(get("expert_group_used_count", groups)),
           "scoring_func": "sigmoid" if sigmoid else "softmax",
           "topk_method": "noaux_tc" if sigmoid else
                          "group_limited_greedy" if groups > 1 else "greedy"}
    return out


def glm4moe_config(meta: dict[str, Any], cfg: dict[str, Any], experts: int,
                   moe_layers: set[int], tensor_names: set[str], source: str) -> dict[str, Any]:
    """The glm4_moe fields of a `glm4moe` file."""
    get = _getter(meta, "glm4moe", source)

    if experts < 1:
        raise ModelLoadError(source, "glm4moe file without glm4moe.expert_count")
    if int(get("expert_gating_func", _SIGMOID)) != _SIGMOID:
        raise ModelLoadError(source, "glm4moe.expert_gating_func must be 2 (sigmoid)")
    layers, first_dense = cfg["num_hidden_layers"], int(get("leading_dense_block_count", 0))
    if moe_layers != set(range(first_dense, layers)):
        raise ModelLoadError(source, f"glm4moe: routers (blk.N.ffn_gate_inp.weight) in layers "
                             f"{sorted(moe_layers)}, expected {first_dense}..{layers - 1}")
    groups = int(get("expert_group_count", 1))
    return {"model_type": "glm4_moe", "n_routed_experts": experts,
            "n_shared_experts": int(get("expert_shared_count", 0)),
            "moe_intermediate_size": int(get("expert_feed_forward_length")),
            "intermediate_size": int(get("feed_forward_length", 0)),
            "first_k_dense_replace": first_dense,
            "norm_topk_prob": bool(get("expert_weights_norm", False)),
            "routed_scaling_factor": float(get("expert_weights_scale", 1.0)),
            "n_group": groups, "topk_group": int(get("expert_group_used_count", groups)),
            "partial_rotary_factor": int(get("rope.dimension_count")) / cfg["head_dim"],
            "use_qk_norm": "blk.0.attn_q_norm.weight" in tensor_names,
            "attention_bias": "blk.0.attn_q.bias" in tensor_names}


def minimax_m2_config(meta: dict[str, Any], cfg: dict[str, Any], experts: int,
                      tensor_names: set[str], source: str) -> dict[str, Any]:
    """The minimax_m2 fields of a `minimax-m2` file (every layer routed, checked by the
    caller; its q/k norms span all heads, read from the tensors present)."""
    get = _getter(meta, "minimax-m2", source)
    gating = int(get("expert_gating_func", _SIGMOID))
    return {"model_type": "minimax_m2", "num_local_experts": experts,
            "intermediate_size": int(get("expert_feed_forward_length")),
            "rotary_dim": int(get("rope.dimension_count")),
            "scoring_func": "sigmoid" if gating == _SIGMOID else f"gating {gating}",
            "use_qk_norm": "blk.0.attn_q_norm.weight" in tensor_names}


def minimax_m2_metadata(cfg: dict[str, Any]) -> dict[str, Any]:
    """The `minimax-m2.*` fields the converter writes beyond the common ones (no prefix)."""
    return {"expert_count": int(cfg["num_local_experts"]),
            "expert_used_count": int(cfg["num_experts_per_tok"]),
            "expert_feed_forward_length": int(cfg["intermediate_size"]),
            "expert_gating_func": _SIGMOID, "rope.dimension_count": int(cfg["rotary_dim"])}


def deepseek2_yarn(meta: dict[str, Any], scaling: dict[str, Any]) -> dict[str, Any]:
    """HF's YaRN fields for a deepseek2 file: `mscale_all_dim` back from the log multiplier
    (rounded to the float32 it was written from), `mscale` equal to it."""
    mul = meta.get("deepseek2.rope.scaling.yarn_log_multiplier")
    if mul is None:
        return scaling
    m = float(np.float32(float(mul) / _LOG_MUL))
    return scaling | {"mscale": m, "mscale_all_dim": m}


def deepseek2_to_hf(dense: dict[str, GGUFTensor], cfg: dict[str, Any], source: str) -> None:
    """`kv_b_proj` back, in place, from a file's `attn_k_b` and `attn_v_b` (fp32: k_b is stored
    transposed, so its blocks do not survive; MLA reads kv_b as fp32 values anyway)."""
    from ftrs.models.gguf_loader import GGUFTensor  # the runtime class (a cycle at import)

    heads, nope = cfg["num_attention_heads"], cfg["qk_nope_head_dim"]
    vdim, rank = cfg["v_head_dim"], cfg["kv_lora_rank"]
    for name in [n for n in dense if n.endswith("self_attn.k_b_proj.weight")]:
        base = name.removesuffix("k_b_proj.weight")
        k_b, v_b = dense.pop(name), dense.pop(base + "v_b_proj.weight", None)
        if v_b is None:
            raise ModelLoadError(source, f"{k_b.name} without its attn_v_b")
        for gt, want in ((k_b, (heads, rank, nope)), (v_b, (heads, vdim, rank))):
            if gt.shape != want:
                raise ModelLoadError(source, f"tensor {gt.name} has shape {list(gt.shape)}, "
                                     f"expected {list(want)}")
        kv = torch.cat([k_b.to_float().transpose(1, 2), v_b.to_float()], dim=1)
        values = np.ascontiguousarray(kv.reshape(heads * (nope + vdim), rank).numpy())
        dense[base + "kv_b_proj.weight"] = GGUFTensor(k_b.name, "F32", values.shape, values)
    if any(n.endswith(".v_b_proj.weight") for n in dense):
        raise ModelLoadError(source, "attn_v_b without its attn_k_b")


def deepseek2_metadata(cfg: dict[str, Any]) -> dict[str, Any]:
    """The `deepseek2.*` fields the converter writes beyond the common ones (no prefix)."""
    rank, rope = int(cfg["kv_lora_rank"]), int(cfg["qk_rope_head_dim"])
    v3 = cfg["model_type"] != "deepseek_v2"  # deepseek_v3, glm4_moe_lite
    m: dict[str, Any] = {
        "attention.head_count_kv": 1, "attention.kv_lora_rank": rank,
        "attention.key_length": rank + rope, "attention.value_length": rank,
        "attention.key_length_mla": int(cfg["qk_nope_head_dim"]) + rope,
        "attention.value_length_mla": int(cfg["v_head_dim"]), "rope.dimension_count": rope,
        "leading_dense_block_count": _leading_dense(cfg),
        "expert_count": int(cfg["n_routed_experts"]),
        "expert_used_count": int(cfg["num_experts_per_tok"]),
        "expert_feed_forward_length": int(cfg["moe_intermediate_size"]),
        "expert_shared_count": int(cfg.get("n_shared_experts") or 0),
        "expert_weights_scale": float(cfg.get("routed_scaling_factor", 1.0)),
        "expert_gating_func": _SIGMOID if cfg.get("scoring_func", "sigmoid" if v3 else "softmax")
                              == "sigmoid" else _SOFTMAX,
    }
    if cfg.get("q_lora_rank"):
        m["attention.q_lora_rank"] = int(cfg["q_lora_rank"])
    if cfg.get("norm_topk_prob"):  # the converter writes it only when true
        m["expert_weights_norm"] = True
    if cfg.get("n_group") is not None:
        m["expert_group_count"] = int(cfg["n_group"])
    if cfg.get("topk_group") is not None:
        m["expert_group_used_count"] = int(cfg["topk_group"])
    scaling = cfg.get("rope_scaling") or cfg.get("rope_parameters") or {}
    if scaling.get("mscale_all_dim") is not None:
        m["rope.scaling.yarn_log_multiplier"] = _LOG_MUL * float(scaling["mscale_all_dim"])
    return m


def _leading_dense(cfg: dict[str, Any]) -> int:
    """The dense layers before the first MoE one (glm4_moe_lite lists them in
    `mlp_layer_types`)."""
    kinds = cfg.get("mlp_layer_types")
    if isinstance(kinds, list) and "sparse" in kinds:
        return kinds.index("sparse")
    return int(cfg.get("first_k_dense_replace") or 0)


def glm4moe_metadata(cfg: dict[str, Any]) -> dict[str, Any]:
    """The `glm4moe.*` fields the converter writes beyond the common ones (no prefix; the MTP
    layer is not written, as with the converter's `--no-mtp`)."""
    head_dim = int(cfg.get("head_dim") or int(cfg["hidden_size"]) // int(cfg["num_attention_heads"]))
    params = cfg.get("rope_parameters") or {}
    factor = float(params.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 0.5)))
    m: dict[str, Any] = {
        "rope.dimension_count": int(head_dim * factor),
        "leading_dense_block_count": int(cfg.get("first_k_dense_replace") or 0),
        "expert_count": int(cfg["n_routed_experts"]),
        "expert_used_count": int(cfg["num_experts_per_tok"]),
        "expert_feed_forward_length": int(cfg["moe_intermediate_size"]),
        "expert_shared_count": int(cfg.get("n_shared_experts") or 0),
        "expert_gating_func": _SIGMOID,
        "expert_weights_scale": float(cfg.get("routed_scaling_factor", 1.0)),
        "expert_weights_norm": bool(cfg.get("norm_topk_prob", True)),
    }
    if cfg.get("n_group") is not None:
        m |= {"expert_group_count": int(cfg["n_group"]),
              "expert_group_used_count": int(cfg.get("topk_group") or 1)}
    return m


def converter_tensors(tensors: dict[str, torch.Tensor], cfg: dict[str, Any], arch: str
                      ) -> tuple[dict[str, tuple[str, np.ndarray]], dict[str, torch.Tensor]]:
    """A deepseek_v2/v3, glm4_moe or minimax_m2 checkpoint's tensors as the converter writes
    them for `arch` (deepseek2, glm4moe, minimax-m2; GGUF name -> (HF name, values)), names through the `gguf` package's
    map: kv_b cut into k_b (transposed) and v_b, the correction bias as `exp_probs_b.bias`,
    layers past `num_hidden_layers` (the multi-token-prediction block) left out. The routed
    experts are returned apart."""
    import gguf

    layers = int(cfg["num_hidden_layers"])
    model_arch = {"deepseek2": gguf.MODEL_ARCH.DEEPSEEK2, "glm4moe": gguf.MODEL_ARCH.GLM4_MOE,
                  "minimax-m2": gguf.MODEL_ARCH.MINIMAXM2}
    names = gguf.get_tensor_name_map(model_arch[arch], layers)
    heads = int(cfg["num_attention_heads"])
    nope, vdim = int(cfg.get("qk_nope_head_dim") or 0), int(cfg.get("v_head_dim") or 0)
    plain: dict[str, tuple[str, np.ndarray]] = {}
    experts: dict[str, torch.Tensor] = {}

    def put(hf: str, arr: np.ndarray, as_name: str | None = None) -> None:
        gname = names.get_name(as_name or hf, try_suffixes=(".weight", ".bias"))
        if gname is None:
            raise ConfigError(f"write_gguf: unexpected tensor {hf}")
        plain[gname] = (hf, np.ascontiguousarray(arr, dtype=np.float32))

    for name, t in tensors.items():
        if name.startswith("model.layers.") and int(name.split(".")[2]) >= layers:
            continue
        arr = t.detach().float().numpy()
        if ".mlp.experts." in name or ".block_sparse_moe.experts." in name:
            experts[name] = t
        elif name.endswith("kv_b_proj.weight"):
            kv = arr.reshape(heads, nope + vdim, arr.shape[1])
            put(name, kv[:, :nope].transpose(0, 2, 1), name.replace("kv_b_proj", "k_b_proj"))
            put(name, kv[:, nope:], name.replace("kv_b_proj", "v_b_proj"))
        elif name.endswith("e_score_correction_bias"):
            put(name, arr, name.replace("e_score_correction_bias", "e_score_correction.bias"))
        else:
            put(name, arr)
    return plain, experts

