"""What llama.cpp's converter does per architecture to a GGUF file, and its undoing.

The reader's side (`models/gguf_loader.py`): gpt-oss's and the Gated DeltaNet hybrids' (qwen3next:
Qwen3-Next, qwen35moe: Qwen3.5) tensor names, their config from the metadata (`deltanet_config`,
YaRN's `rope_scaling`), and `qwen3next_to_hf`, which undoes the converter's changes to their
tensors. The writer's side (`models/gguf_write.py`, tests and fixtures): the same changes made
(`gpt_oss_tensors`, `qwen3next_tensors`, `llama3_rope_factors`) and, for gpt-oss, undone again
for the reference model (`gpt_oss_packed`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from ftrs.errors import ConfigError, ModelLoadError

if TYPE_CHECKING:
    from ftrs.models.gguf_loader import GGUFTensor

#: gpt-oss's own names where they differ (its sinks are a parameter, no `.weight` in HF)
GPT_OSS_NAMES = {"post_attention_norm": "post_attention_layernorm", "ffn_gate_inp": "mlp.router",
            "attn_sinks": "self_attn.sinks"}


#: qwen3next's own names (llama.cpp's converter): the DeltaNet inputs flat (q, k, v of every head
#: in `attn_qkv`, z in `attn_gate`), `ssm_ba` still grouped per key head as HF ships it
QWEN3NEXT_NAMES = {"post_attention_norm": "post_attention_layernorm",
              "attn_qkv": "linear_attn.in_proj_qkv", "attn_gate": "linear_attn.in_proj_z",
              "ssm_ba": "linear_attn.in_proj_ba", "ssm_conv1d": "linear_attn.conv1d",
              "ssm_norm": "linear_attn.norm", "ssm_out": "linear_attn.out_proj",
              "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
              "ffn_up_shexp": "mlp.shared_expert.up_proj",
              "ffn_down_shexp": "mlp.shared_expert.down_proj",
              "ffn_gate_inp_shexp": "mlp.shared_expert_gate"}


#: qwen3next tensors whose HF name has no `.weight`/`.bias` of its own
QWEN3NEXT_BARE = {("ssm_a", None): "linear_attn.A_log", ("ssm_dt", "bias"): "linear_attn.dt_bias"}


#: qwen35moe (Qwen3.5): qwen3next's names, with b and a apart
QWEN35MOE_NAMES = QWEN3NEXT_NAMES | {"ssm_beta": "linear_attn.in_proj_b", "ssm_alpha": "linear_attn.in_proj_a"}


DELTANET = ("qwen3next", "qwen35moe")


def deltanet_config(meta: dict[str, Any], arch: str, cfg: dict[str, Any], experts: int,
                     source: str) -> dict[str, Any]:
    """The MoE and Gated DeltaNet fields of qwen3_next / qwen3_5_moe from `{arch}.*` (the `ssm.*`
    keys as the converter fills them from HF's `linear_*`); every layer a MoE layer, one full
    attention layer every `full_attention_interval`. A Qwen3.5 file's value heads are in tiled
    order when there are more of them than key heads (`LinearAttnSpec.v_heads_tiled`)."""
    def get(key: str) -> Any:
        v = meta.get(f"{arch}.{key}")
        if v is None:
            raise ModelLoadError(source, f"missing GGUF metadata {arch}.{key}")
        return v

    layers, head_dim = cfg["num_hidden_layers"], cfg["head_dim"]
    v_heads = int(get("ssm.time_step_rank"))
    inner = int(get("ssm.inner_size"))
    if inner % v_heads:
        raise ModelLoadError(source, f"qwen3next.ssm.inner_size {inner} is not a multiple of "
                             f"{v_heads} value heads")
    every = int(get("full_attention_interval"))
    if every < 1:
        raise ModelLoadError(source, f"qwen3next.full_attention_interval {every} < 1")
    rotary = int(meta.get(f"{arch}.rope.dimension_count") or head_dim // 4)
    k_heads = int(get("ssm.group_count"))
    return {"num_experts": experts, "moe_intermediate_size": int(get("expert_feed_forward_length")),
            "shared_expert_intermediate_size": int(get("expert_shared_feed_forward_length")),
            "norm_topk_prob": bool(meta.get(f"{arch}.expert_weights_norm", True)),
            "_v_heads_tiled": arch == "qwen35moe" and v_heads != k_heads,
            "decoder_sparse_step": 1, "mlp_only_layers": [], "intermediate_size": 0,
            "linear_conv_kernel_dim": int(get("ssm.conv_kernel")),
            "linear_key_head_dim": int(get("ssm.state_size")),
            "linear_num_key_heads": k_heads,
            "linear_num_value_heads": v_heads, "linear_value_head_dim": inner // v_heads,
            "layer_types": ["full_attention" if (i + 1) % every == 0 else "linear_attention"
                            for i in range(layers)],
            "partial_rotary_factor": rotary / head_dim}


def rope_scaling(meta: dict[str, Any], arch: str, source: str) -> dict[str, Any] | None:
    """HF's `rope_scaling` from `{arch}.rope.scaling.*` (what llama.cpp's converter writes from
    it): none, or YaRN; another kind is refused rather than silently run unscaled."""
    kind = meta.get(f"{arch}.rope.scaling.type")
    if kind in (None, "none"):
        return None
    if kind != "yarn":
        raise ModelLoadError(source, f"unsupported GGUF rope scaling {kind!r} (supported: yarn)")
    key = f"{arch}.rope.scaling."
    if meta.get(key + "factor") is None or meta.get(key + "original_context_length") is None:
        raise ModelLoadError(source, f"yarn rope scaling without {key}factor and "
                             f"{key}original_context_length")
    if float(meta.get(key + "yarn_ext_factor", 1.0)) != 1.0:
        raise ModelLoadError(source, f"{key}yarn_ext_factor other than 1 is not supported")
    out: dict[str, Any] = {"rope_type": "yarn", "factor": float(meta[key + "factor"]),
                           "original_max_position_embeddings":
                               int(meta[key + "original_context_length"])}
    for field, name in (("yarn_beta_fast", "beta_fast"), ("yarn_beta_slow", "beta_slow"),
                        ("yarn_attn_factor", "attention_factor")):
        if meta.get(key + field) is not None:
            out[name] = float(meta[key + field])
    return out


ZERO_CENTRED = ("input_layernorm.weight", "post_attention_layernorm.weight",
                 "self_attn.q_norm.weight", "self_attn.k_norm.weight")


def qwen3next_to_hf(dense: dict[str, GGUFTensor], cfg: dict[str, Any]) -> None:
    """Undo, in place, what llama.cpp's converter changed in qwen3_next's and qwen3_5_moe's
    tensors (a Qwen3.5 file's tiled value heads are read as they are: `v_heads_tiled`): the
    zero-centred norms stored as 1 + w (w back exactly while 1 + w lies in [0.5, 2]), the
    decay as -exp(A_log) (A_log back within an ulp), the conv kernel squeezed; and cut the
    grouped `in_proj_ba` into the flat b and a rows the decoder reads (bytes of whole rows, any
    type)."""
    from ftrs.models.gguf_loader import GGUFTensor  # the runtime class (a cycle at import)

    def f32(gt: GGUFTensor, values: Any) -> GGUFTensor:
        return GGUFTensor(gt.name, "F32", gt.shape, np.ascontiguousarray(values, dtype=np.float32))

    k_heads = int(cfg["linear_num_key_heads"])
    per_k = int(cfg["linear_num_value_heads"]) // k_heads
    for name, gt in list(dense.items()):
        if name == "model.norm.weight" or name.endswith(ZERO_CENTRED):
            dense[name] = f32(gt, gt.to_float().numpy() - np.float32(1.0))
        elif name.endswith("linear_attn.A_log"):
            dense[name] = f32(gt, np.log(-gt.to_float().numpy()))
        elif name.endswith("linear_attn.conv1d.weight") and len(gt.shape) == 2:
            dense[name] = GGUFTensor(gt.name, gt.qtype, (gt.shape[0], 1, gt.shape[1]), gt.data)
        elif name.endswith("mlp.shared_expert_gate.weight") and len(gt.shape) == 1:
            dense[name] = GGUFTensor(gt.name, gt.qtype, (1, gt.shape[0]), gt.data)
        elif name.endswith("linear_attn.in_proj_ba.weight"):
            rows = np.arange(gt.shape[0]).reshape(k_heads, 2, per_k)  # per key head: b.., a..
            base = name.removesuffix("in_proj_ba.weight")
            del dense[name]
            for i, part in enumerate(("b", "a")):
                dense[f"{base}in_proj_{part}.weight"] = GGUFTensor(
                    gt.name, gt.qtype, (k_heads * per_k, gt.shape[1]),
                    np.ascontiguousarray(gt.data[rows[:, i].reshape(-1)]))


def llama3_rope_factors(cfg: dict[str, Any]) -> np.ndarray | None:
    """llama3 rope scaling as llama.cpp's converter stores it: per frequency, the divisor that
    the scaling applies to it (1 for short wavelengths, `factor` for long ones, blended between)."""
    scaling = cfg.get("rope_scaling") or cfg.get("rope_parameters") or {}
    if scaling.get("rope_type", scaling.get("type")) != "llama3":
        return None
    theta = float(scaling.get("rope_theta") or cfg.get("rope_theta") or 10000.0)
    heads = int(cfg["num_attention_heads"])
    dim = int(cfg.get("head_dim") or int(cfg["hidden_size"]) // heads)
    factor, old_len = float(scaling["factor"]), float(scaling["original_max_position_embeddings"])
    low, high = float(scaling.get("low_freq_factor", 1.0)), float(scaling.get("high_freq_factor", 4.0))
    out = []
    for i in range(0, dim, 2):
        wavelen = 2 * np.pi * theta ** (i / dim)
        if wavelen < old_len / high:
            out.append(1.0)
        elif wavelen > old_len / low:
            out.append(factor)
        else:
            smooth = (old_len / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


def gpt_oss_tensors(tensors: dict[str, torch.Tensor], layers: int
                     ) -> dict[str, tuple[str, np.ndarray]]:
    """gpt_oss's HF tensors as llama.cpp's converter writes them: GGUF name -> (the HF name of
    the unpacked part, values). Names through the `gguf` package's map for the architecture."""
    import gguf

    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.GPT_OSS, layers)
    parts: dict[str, np.ndarray] = {}
    for name, t in tensors.items():
        arr = t.detach().float().numpy()
        base = name.rsplit(".", 1)[0] + "."
        if name.endswith("mlp.experts.gate_up_proj"):  # (E, H, 2I), x @ W
            lin = arr.transpose(0, 2, 1)
            parts[base + "gate_proj.weight"], parts[base + "up_proj.weight"] = lin[:, 0::2], lin[:, 1::2]
        elif name.endswith("mlp.experts.gate_up_proj_bias"):
            parts[base + "gate_proj.bias"], parts[base + "up_proj.bias"] = arr[:, 0::2], arr[:, 1::2]
        elif name.endswith("mlp.experts.down_proj"):
            parts[base + "down_proj.weight"] = arr.transpose(0, 2, 1)
        elif name.endswith("mlp.experts.down_proj_bias"):
            parts[base + "down_proj.bias"] = arr
        elif name.endswith("self_attn.sinks"):
            parts[name + ".weight"] = arr
        else:
            parts[name] = arr
    out: dict[str, tuple[str, np.ndarray]] = {}
    for name, arr in parts.items():
        gname = names.get_name(name, try_suffixes=(".weight", ".bias"))
        if gname is None:
            raise ConfigError(f"write_gguf: unexpected tensor {name}")
        out[gname] = (name, np.ascontiguousarray(arr))
    return out


def tiled_v_heads(arr: np.ndarray, axis: int, k_heads: int, per_k: int, width: int) -> np.ndarray:
    """Value heads from HF's grouped order (by key head) to llama.cpp's tiled one along `axis`."""
    a = np.moveaxis(arr, axis, 0)
    rest = a.shape[1:]
    a = a.reshape(k_heads, per_k, width, *rest).swapaxes(0, 1).reshape(-1, *rest)
    return np.ascontiguousarray(np.moveaxis(a, 0, axis))


def qwen3next_tensors(tensors: dict[str, torch.Tensor], cfg: dict[str, Any]
                       ) -> tuple[dict[str, tuple[str, np.ndarray]], dict[str, torch.Tensor]]:
    """qwen3_next's or qwen3_5_moe's tensors as llama.cpp's converter writes them (GGUF name ->
    (HF name, values)), names through the `gguf` package's map: zero-centred norms as 1 + w,
    A_log as -exp(A_log), dt_bias as `ssm_dt.bias`, the conv kernel squeezed; qwen3_next's
    `in_proj_qkvz` regrouped from per key head to flat (q, k, v of every head in `attn_qkv`, z in
    `attn_gate`); qwen3_5_moe's value heads, wherever they appear, from grouped to tiled order
    when there are more of them than key heads. The routed experts are returned apart, for the
    common stacking."""
    import gguf

    qwen35 = cfg["model_type"] == "qwen3_5_moe"
    arch = gguf.MODEL_ARCH.QWEN35MOE if qwen35 else gguf.MODEL_ARCH.QWEN3NEXT
    names = gguf.get_tensor_name_map(arch, int(cfg["num_hidden_layers"]))
    kh, k_dim = int(cfg["linear_num_key_heads"]), int(cfg["linear_key_head_dim"])
    per_k, v_dim = int(cfg["linear_num_value_heads"]) // kh, int(cfg["linear_value_head_dim"])
    vz = per_k * v_dim
    plain: dict[str, tuple[str, np.ndarray]] = {}
    experts: dict[str, torch.Tensor] = {}

    def tile(name: str, arr: np.ndarray) -> np.ndarray:
        if not qwen35 or per_k == 1 or ".linear_attn." not in name:
            return arr
        if name.endswith(("in_proj_qkv.weight", "conv1d.weight")):
            qk = 2 * kh * k_dim
            return np.concatenate([arr[:qk], tiled_v_heads(arr[qk:], 0, kh, per_k, v_dim)])
        if name.endswith("in_proj_z.weight"):
            return tiled_v_heads(arr, 0, kh, per_k, v_dim)
        if name.endswith(("in_proj_a.weight", "in_proj_b.weight", "A_log", "dt_bias")):
            return tiled_v_heads(arr, 0, kh, per_k, 1)
        if name.endswith("out_proj.weight"):
            return tiled_v_heads(arr, 1, kh, per_k, v_dim)
        return arr

    def put(hf: str, arr: np.ndarray) -> None:
        gname = names.get_name(hf, try_suffixes=(".weight", ".bias"))
        if gname is None:
            raise ConfigError(f"write_gguf: unexpected tensor {hf}")
        plain[gname] = (hf, np.ascontiguousarray(arr, dtype=np.float32))

    for name, t in tensors.items():
        arr = tile(name, t.detach().float().numpy())
        if ".mlp.experts." in name:
            experts[name] = t
        elif name.endswith("norm.weight") and not name.endswith("linear_attn.norm.weight"):
            put(name, arr + np.float32(1.0))
        elif name.endswith(".A_log"):
            put(name, -np.exp(arr))
        elif name.endswith(".dt_bias"):
            put(name.removesuffix("dt_bias") + "dt_proj.bias", arr)
        elif "conv1d" in name:
            put(name, arr.squeeze())
        elif name.endswith("in_proj_qkvz.weight"):
            hidden = arr.shape[1]
            g = arr.reshape(kh, 2 * k_dim + 2 * vz, hidden)
            q, k, v, z = np.split(g, np.cumsum([k_dim, k_dim, vz]), axis=1)
            gname = names.get_name(name, try_suffixes=(".weight",)) or ""
            qkv = np.concatenate([x.reshape(-1, hidden) for x in (q, k, v)])
            plain[gname.replace("ssm_in", "attn_qkv")] = (name.replace("qkvz", "qkv"), qkv)
            plain[gname.replace("ssm_in", "attn_gate")] = (name.replace("qkvz", "z"),
                                                          np.ascontiguousarray(z.reshape(-1, hidden)))
        else:
            put(name, arr)
    return plain, experts


def gpt_oss_packed(held: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The HF tensors back from the unpacked parts `gpt_oss_tensors` named (HF name -> values):
    gate and up interleaved again, the matrices transposed back to `x @ W`."""
    out: dict[str, torch.Tensor] = {}
    for name, t in held.items():
        if ".mlp.experts." not in name:
            out[name.removesuffix(".weight") if name.endswith("sinks.weight") else name] = t
            continue
        base = name.split(".mlp.experts.")[0] + ".mlp.experts."
        if name.endswith("gate_proj.weight"):
            gate, up = t, held[base + "up_proj.weight"]  # (E, I, H)
            out[base + "gate_up_proj"] = torch.stack([gate, up], dim=2).flatten(1, 2).transpose(1, 2)
        elif name.endswith("gate_proj.bias"):
            out[base + "gate_up_proj_bias"] = torch.stack(
                [t, held[base + "up_proj.bias"]], dim=2).flatten(1, 2)
        elif name.endswith("down_proj.weight"):
            out[base + "down_proj"] = t.transpose(1, 2)
        elif name.endswith("down_proj.bias"):
            out[base + "down_proj_bias"] = t
    return {k: v.contiguous() for k, v in out.items()}
