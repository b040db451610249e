"""GGUF checkpoints (llama.cpp's format), through the `gguf` package.

Architectures: `llama` (dense, or Mixtral-style MoE when `llama.expert_count` is set), `qwen3`,
`qwen3moe` and `gpt-oss`. The config and the tokenizer come from the file's metadata. Tensor
names are mapped to Hugging Face names; llama.cpp's row permutation of the llama q and k
projections is undone (for quantized weights by moving whole rows of blocks, which is exact: the
permutation is over rows); llama3's rope scaling, stored as `rope_freqs.weight` (one divisor per
frequency), is applied as it is. Routed experts come as 3-D tensors `blk.N.ffn_{gate,up,down}_exps.weight`
(experts, rows, cols) beside the router `blk.N.ffn_gate_inp.weight`, gate and up possibly fused
in one `blk.N.ffn_gate_up_exps.weight` (gate rows first), cut apart as rows of bytes.

gpt-oss as llama.cpp's converter writes it: gate and up already split out of the interleaved
`gate_up_proj` (MXFP4 experts in ggml's block layout, which the pool keeps as they are), expert
biases `blk.N.ffn_{gate,up,down}_exps.bias` (experts, rows), the router's bias, attention sinks
`blk.N.attn_sinks.weight` and the second norm as `blk.N.post_attention_norm`. What the format
does not say is what llama.cpp fixes for the architecture, and the config says the same: even
layers slide (`gpt-oss.attention.sliding_window`), odd ones see everything; the SwiGLU clamp is
7; YaRN's ramp is not truncated (`truncate: false`, as gpt-oss's own config sets).

`open_gguf` validates every tensor (its type is one ftrs keeps, its bytes match its type and
shape) before anything is copied, and hands back the raw bytes, still in the file's encoding;
`models/load.py` decides what stays quantized. `read_gguf` dequantizes everything to fp32 (the
upcycler and tests use it).
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ftrs.errors import ModelLoadError
from ftrs.models.names import DOWN, GATE, UP
from ftrs.models.tokenizer import Tokenizer
from ftrs.quant.formats import GGUF_FORMATS, QuantTensor, tensor_bytes

log = logging.getLogger(__name__)

_TOP = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
        "output.weight": "lm_head.weight"}
_BLOCK = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
          "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
          "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm",
          "attn_k_norm": "self_attn.k_norm", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
          "ffn_down": "mlp.down_proj", "ffn_gate_inp": "mlp.gate"}
_EXPERTS = {"ffn_gate_exps": GATE, "ffn_up_exps": UP, "ffn_down_exps": DOWN}
#: gpt-oss's own names where they differ (its sinks are a parameter, no `.weight` in HF)
_GPT_OSS = {"post_attention_norm": "post_attention_layernorm", "ffn_gate_inp": "mlp.router",
            "attn_sinks": "self_attn.sinks"}
_BIAS = 3  # the pool's tensor index of an expert's gate bias (up 4, down 5): `expert_shapes`
#: `blk.N.ffn_gate_up_exps` (the converter's `--fuse-gate-up-exps`): gate rows, then up rows
_GATE_UP = 10
_BLK = re.compile(r"^blk\.(\d+)\.([a-z0-9_]+)(?:\.(weight|bias))?$")  # ssm_a has no suffix
#: qwen3next's own names (llama.cpp's converter): the DeltaNet inputs flat (q, k, v of every head
#: in `attn_qkv`, z in `attn_gate`), `ssm_ba` still grouped per key head as HF ships it
_QWEN3NEXT = {"post_attention_norm": "post_attention_layernorm",
              "attn_qkv": "linear_attn.in_proj_qkv", "attn_gate": "linear_attn.in_proj_z",
              "ssm_ba": "linear_attn.in_proj_ba", "ssm_conv1d": "linear_attn.conv1d",
              "ssm_norm": "linear_attn.norm", "ssm_out": "linear_attn.out_proj",
              "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
              "ffn_up_shexp": "mlp.shared_expert.up_proj",
              "ffn_down_shexp": "mlp.shared_expert.down_proj",
              "ffn_gate_inp_shexp": "mlp.shared_expert_gate"}
#: qwen3next tensors whose HF name has no `.weight`/`.bias` of its own
_QWEN3NEXT_BARE = {("ssm_a", None): "linear_attn.A_log", ("ssm_dt", "bias"): "linear_attn.dt_bias"}
#: qwen35moe (Qwen3.5): qwen3next's names, with b and a apart
_QWEN35MOE = _QWEN3NEXT | {"ssm_beta": "linear_attn.in_proj_b", "ssm_alpha": "linear_attn.in_proj_a"}
SUPPORTED_TYPES = tuple(GGUF_FORMATS)
_ARCH_TYPE = {"llama": "llama", "qwen3": "qwen3", "qwen3moe": "qwen3_moe", "gpt-oss": "gpt_oss",
              "qwen3next": "qwen3_next", "qwen35moe": "qwen3_5_moe_text"}
_DELTANET = ("qwen3next", "qwen35moe")


@dataclass
class GGUFTensor:
    """One tensor of the file, still in its encoding. `shape` is torch order: (rows, cols) or
    (experts, rows, cols); `data` is the file's memory (a read-only memmap view): quantized types
    as uint8 (..., row_bytes), float types as their numpy dtype (bf16 as uint8 pairs)."""

    name: str
    qtype: str
    shape: tuple[int, ...]
    data: np.ndarray

    def raw(self) -> np.ndarray:
        return self.data.view(np.uint8).reshape(-1)

    def to_float(self) -> torch.Tensor:
        """The values as fp32 (every type, through the reference dequantizer)."""
        if self.qtype == "F32":
            arr = self.raw().view(np.float32)
        elif self.qtype == "F16":
            arr = self.raw().view(np.float16).astype(np.float32)
        elif self.qtype == "BF16":
            arr = (self.raw().view(np.uint16).astype(np.uint32) << 16).view(np.float32)
        else:
            import gguf

            arr = gguf.quants.dequantize(self.data, gguf.GGMLQuantizationType[self.qtype])
        return torch.from_numpy(np.array(arr, dtype=np.float32, copy=True)).view(*self.shape)

    def quant(self, index: int | None = None) -> QuantTensor:
        """A `QuantTensor` owning a copy of the bytes (of one expert when `index` is given)."""
        rows, cols = self.shape[-2:]
        raw = self.data if index is None else self.data[index]
        data = torch.from_numpy(np.array(raw, copy=True).view(np.uint8).reshape(-1))
        return QuantTensor(self.qtype, (rows, cols), data)


@dataclass
class GGUFCheckpoint:
    """A validated GGUF file: HF config, dense tensors under HF names, experts by layer."""

    path: Path
    config: dict[str, Any]
    tokenizer: Tokenizer
    dense: dict[str, GGUFTensor]
    #: layer -> {GATE|UP|DOWN: (E, rows, cols)}, and gpt-oss's biases {3|4|5: (E, rows)}
    experts: dict[int, dict[int, GGUFTensor]]
    permuted: dict[str, int]  # HF name -> heads: rows llama.cpp permuted (undo with `unpermute`)


def _reader(path: Path) -> Any:
    import gguf

    if not path.is_file():
        raise ModelLoadError(str(path), "GGUF file not found")
    try:
        return gguf.GGUFReader(str(path))
    except Exception as e:  # a truncated file fails here: its tensors run past the end
        raise ModelLoadError(str(path), f"cannot read GGUF (truncated or corrupt?): {e}") from e


def gguf_metadata(reader: Any) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, field in reader.fields.items():
        try:
            out[key] = field.contents()
        except Exception:  # a field type the package cannot render: not one we use
            continue
    return out


def gguf_config(meta: dict[str, Any], tensor_names: set[str], source: str) -> dict[str, Any]:
    """The Hugging Face config of a GGUF file, from its metadata and tensor names."""
    arch = meta.get("general.architecture")
    if arch not in _ARCH_TYPE:
        raise ModelLoadError(source, f"unsupported GGUF architecture {arch!r} "
                             f"(supported: {', '.join(_ARCH_TYPE)})")

    def get(key: str, default: Any = None) -> Any:
        v = meta.get(f"{arch}.{key}", default)
        if v is None:
            raise ModelLoadError(source, f"missing GGUF metadata {arch}.{key}")
        return v

    heads = int(get("attention.head_count"))
    hidden = int(get("embedding_length"))
    vocab = len(meta.get("tokenizer.ggml.tokens") or []) or int(get("vocab_size"))
    head_dim = int(meta.get(f"{arch}.attention.key_length")
                   or get("rope.dimension_count", hidden // heads))
    cfg: dict[str, Any] = {
        "model_type": _ARCH_TYPE[arch],
        "vocab_size": vocab, "hidden_size": hidden,
        "num_hidden_layers": _layers(meta, arch, source), "num_attention_heads": heads,
        "num_key_value_heads": int(get("attention.head_count_kv", heads)),
        "head_dim": head_dim,
        "rms_norm_eps": float(get("attention.layer_norm_rms_epsilon",
                                  1e-5 if arch == "llama" else 1e-6)),
        "rope_theta": float(get("rope.freq_base", 10000.0)),
        "max_position_embeddings": int(get("context_length", 2048)),
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": meta.get("tokenizer.ggml.eos_token_id"),
        "hidden_act": "silu", "torch_dtype": "float32",
    }
    experts = int(meta.get(f"{arch}.expert_count") or 0)
    if arch == "qwen3moe" and experts < 1:
        raise ModelLoadError(source, "qwen3moe file without qwen3moe.expert_count")
    if arch not in _DELTANET and any(n.endswith("_shexp.weight") for n in tensor_names):
        raise ModelLoadError(source, "shared experts (ffn_*_shexp) are not supported")
    ff = meta.get(f"{arch}.feed_forward_length")
    if experts:
        cfg["num_experts_per_tok"] = int(get("expert_used_count"))
        moe_layers = {int(m.group(1)) for n in tensor_names
                      if (m := _BLK.match(n)) and m.group(2) == "ffn_gate_inp"
                      and int(m.group(1)) < cfg["num_hidden_layers"]}
        if arch in ("llama", "gpt-oss", *_DELTANET) and moe_layers != set(range(cfg["num_hidden_layers"])):
            raise ModelLoadError(source, f"{arch} MoE file: every layer needs a router "
                                 "(blk.N.ffn_gate_inp.weight)")
        if arch == "llama":
            cfg |= {"model_type": "mixtral", "num_local_experts": experts,
                    "intermediate_size": int(get("feed_forward_length"))}
        elif arch in _DELTANET:
            cfg |= _deltanet_config(meta, arch, cfg, experts, source)
        elif arch == "gpt-oss":
            layers = cfg["num_hidden_layers"]
            cfg |= {"num_local_experts": experts, "attention_bias": True, "swiglu_limit": 7.0,
                    "intermediate_size": int(get("expert_feed_forward_length")),
                    "sliding_window": int(get("attention.sliding_window")),
                    "layer_types": ["sliding_attention" if i % 2 == 0 else "full_attention"
                                    for i in range(layers)]}
        else:
            cfg |= {"num_experts": experts, "norm_topk_prob": True, "decoder_sparse_step": 1,
                    "moe_intermediate_size": int(get("expert_feed_forward_length")),
                    "intermediate_size": int(ff or 0),
                    "mlp_only_layers": sorted(set(range(cfg["num_hidden_layers"])) - moe_layers)}
    elif arch in ("gpt-oss", *_DELTANET):
        raise ModelLoadError(source, f"{arch} file without {arch}.expert_count")
    else:
        cfg["intermediate_size"] = int(get("feed_forward_length"))
    scaling = _rope_scaling(meta, arch, source)
    if scaling is not None:
        cfg["rope_scaling"] = scaling | ({"truncate": False} if arch == "gpt-oss" else {})
    return cfg


def _layers(meta: dict[str, Any], arch: str, source: str) -> int:
    """The decoder's layers: `block_count` less the multi-token-prediction blocks the converter
    appends after them (`nextn_predict_layers`), which ftrs does not run."""
    blocks = meta.get(f"{arch}.block_count")
    if blocks is None:
        raise ModelLoadError(source, f"missing GGUF metadata {arch}.block_count")
    return int(blocks) - int(meta.get(f"{arch}.nextn_predict_layers") or 0)


def _deltanet_config(meta: dict[str, Any], arch: str, cfg: dict[str, Any], experts: int,
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


def _rope_scaling(meta: dict[str, Any], arch: str, source: str) -> dict[str, Any] | None:
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


def _hf_name(name: str, arch: str) -> str | tuple[int, int] | None:
    """HF name of a dense tensor, (layer, pool tensor index) of an expert tensor (GATE, UP,
    DOWN; gpt-oss's biases 3, 4, 5), None if unused."""
    if name in _TOP:
        return _TOP[name]
    m = _BLK.match(name)
    if not m:
        return None
    layer, kind, suffix = int(m.group(1)), m.group(2), m.group(3)
    if kind in _EXPERTS or kind == "ffn_gate_up_exps":
        which = _EXPERTS.get(kind, _GATE_UP)
        if suffix == "weight":
            return layer, which
        return (layer, _BIAS + which) if arch == "gpt-oss" else None
    if arch in _DELTANET and (kind, suffix) in _QWEN3NEXT_BARE:
        return f"model.layers.{layer}.{_QWEN3NEXT_BARE[kind, suffix]}"
    block = _BLOCK | {"gpt-oss": _GPT_OSS, "qwen3next": _QWEN3NEXT, "qwen35moe": _QWEN35MOE}.get(arch, {})
    if kind not in block or suffix is None:
        return None
    if kind == "attn_sinks":
        return f"model.layers.{layer}.{block[kind]}"
    return f"model.layers.{layer}.{block[kind]}.{suffix}"


def open_gguf(path: Path) -> GGUFCheckpoint:
    """Read and validate a GGUF file without copying any tensor."""
    reader = _reader(path)
    meta = gguf_metadata(reader)
    src = str(path)
    names = {t.name for t in reader.tensors}
    cfg = gguf_config(meta, names, src)
    tokenizer = Tokenizer.from_gguf_fields(meta, src)
    freqs = next((t for t in reader.tensors if t.name == "rope_freqs.weight"), None)
    if freqs is not None:  # llama3-style scaling: llama.cpp divides each frequency by its factor
        if freqs.tensor_type.name != "F32" or "rope_scaling" in cfg:
            raise ModelLoadError(src, "rope_freqs.weight must be F32 and the only rope scaling")
        cfg["rope_scaling"] = {"rope_type": "freq_factors",
                               "factors": np.asarray(freqs.data, dtype=np.float32).tolist()}
    dense: dict[str, GGUFTensor] = {}
    experts: dict[int, dict[int, GGUFTensor]] = {}
    arch = meta["general.architecture"]
    layers = cfg["num_hidden_layers"]
    for t in reader.tensors:
        m = _BLK.match(t.name)
        if m and int(m.group(1)) >= layers:  # a multi-token-prediction block
            continue
        target = _hf_name(t.name, arch)
        if target is None:
            log.debug("skipping GGUF tensor %s", t.name)
            continue
        qtype = t.tensor_type.name
        if qtype not in SUPPORTED_TYPES:
            raise ModelLoadError(src, f"tensor {t.name} uses unsupported quantization {qtype} "
                                 f"(supported: {', '.join(SUPPORTED_TYPES)})")
        shape = tuple(int(d) for d in reversed(t.shape.tolist()))
        rows = int(np.prod(shape[:-1])) if len(shape) > 1 else 1
        try:
            want = tensor_bytes(qtype, rows, shape[-1])
        except ValueError as e:
            raise ModelLoadError(src, f"tensor {t.name}: {e}") from e
        if t.data.nbytes != want:
            raise ModelLoadError(src, f"tensor {t.name} ({qtype} {list(shape)}) has "
                                 f"{t.data.nbytes} bytes, expected {want}")
        gt = GGUFTensor(t.name, qtype, shape, t.data)
        if isinstance(target, tuple):
            layer, which = target
            want_dims = 2 if which in (GATE + _BIAS, UP + _BIAS, DOWN + _BIAS, _GATE_UP + _BIAS) else 3
            if len(shape) != want_dims:
                dims = "(experts, rows)" if want_dims == 2 else "(experts, rows, cols)"
                raise ModelLoadError(src, f"expert tensor {t.name} has shape {list(shape)}, "
                                     f"expected {dims}")
            if which in (_GATE_UP, _GATE_UP + _BIAS):  # cut into gate and up as rows of bytes
                half = shape[1] // 2
                if shape[1] % 2:
                    raise ModelLoadError(src, f"{t.name} has an odd number of rows {shape[1]}")
                base = which - _GATE_UP
                for part, span in ((GATE, slice(0, half)), (UP, slice(half, None))):
                    experts.setdefault(layer, {})[base + part] = GGUFTensor(
                        t.name, qtype, (shape[0], half, *shape[2:]), t.data[:, span])
                continue
            experts.setdefault(layer, {})[which] = gt
        else:
            dense[target] = gt
    n_exp = int(cfg.get("num_local_experts") or cfg.get("num_experts") or 0)
    for layer, group in experts.items():
        for gt in group.values():
            if gt.shape[0] != n_exp:
                raise ModelLoadError(src, f"tensor {gt.name} holds {gt.shape[0]} experts, "
                                     f"metadata says expert_count = {n_exp}")
        router = (dense.get(f"model.layers.{layer}.mlp.gate.weight")
                  or dense.get(f"model.layers.{layer}.mlp.router.weight"))
        if router is not None and router.shape[0] != n_exp:
            raise ModelLoadError(src, f"router of layer {layer} has {router.shape[0]} rows, "
                                 f"metadata says expert_count = {n_exp}")
    if arch in _DELTANET:
        _qwen3next_to_hf(dense, cfg)
    permuted: dict[str, int] = {}
    if cfg["model_type"] in ("llama", "mixtral"):
        for layer in range(cfg["num_hidden_layers"]):
            p = f"model.layers.{layer}.self_attn."
            permuted[p + "q_proj.weight"] = cfg["num_attention_heads"]
            permuted[p + "k_proj.weight"] = cfg["num_key_value_heads"]
    return GGUFCheckpoint(path, cfg, tokenizer, dense, experts, permuted)


_ZERO_CENTRED = ("input_layernorm.weight", "post_attention_layernorm.weight",
                 "self_attn.q_norm.weight", "self_attn.k_norm.weight")


def _qwen3next_to_hf(dense: dict[str, GGUFTensor], cfg: dict[str, Any]) -> None:
    """Undo, in place, what llama.cpp's converter changed in qwen3_next's and qwen3_5_moe's
    tensors (a Qwen3.5 file's tiled value heads are read as they are: `v_heads_tiled`): the
    zero-centred norms stored as 1 + w (w back exactly while 1 + w lies in [0.5, 2]), the
    decay as -exp(A_log) (A_log back within an ulp), the conv kernel squeezed; and cut the
    grouped `in_proj_ba` into the flat b and a rows the decoder reads (bytes of whole rows, any
    type)."""
    def f32(gt: GGUFTensor, values: Any) -> GGUFTensor:
        return GGUFTensor(gt.name, "F32", gt.shape, np.ascontiguousarray(values, dtype=np.float32))

    k_heads = int(cfg["linear_num_key_heads"])
    per_k = int(cfg["linear_num_value_heads"]) // k_heads
    for name, gt in list(dense.items()):
        if name == "model.norm.weight" or name.endswith(_ZERO_CENTRED):
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


def unpermute_rows(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undo llama.cpp's q/k row permutation (interleaved rotary halves -> split halves). `w` is
    (rows, ...): fp values, or the (rows, row_bytes) bytes of a quantized matrix."""
    half = w.shape[0] // n_head // 2
    return w.reshape(n_head, half, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape).contiguous()


def read_gguf(path: Path, progress: bool = True
              ) -> tuple[dict[str, Any], dict[str, torch.Tensor], Tokenizer]:
    """(HF config, fp32 tensors under HF names, tokenizer) of a dense GGUF file."""
    ck = open_gguf(path)
    if ck.experts:
        raise ModelLoadError(str(path), "read_gguf dequantizes dense checkpoints only")
    tensors: dict[str, torch.Tensor] = {}
    for hf, gt in ck.dense.items():
        t = gt.to_float()
        if hf in ck.permuted:
            t = unpermute_rows(t, ck.permuted[hf])
        tensors[hf] = t
    return ck.config, tensors, ck.tokenizer


def gguf_fetch_model(path: Path) -> Any:
    """The guard's `FetchModel` of a GGUF MoE from its header: the real bytes of one expert
    block in the pool (the file's encoding, aligned as `ftrs._core.ExpertLayout` aligns; the
    mean over layers when layers store their experts in different types), read without loading
    any weight."""
    from ftrs import _core
    from ftrs.guard.fetch import FetchModel
    from ftrs.models.arch import arch_from_config

    ck = open_gguf(path)
    spec = arch_from_config(ck.config, str(path))
    if not spec.is_moe:
        return FetchModel(path.name, 0, 0, 0, 0, "gguf")
    sizes = [[tensor_bytes(g.qtype, *g.shape[1:]) if len(g.shape) == 3
              else tensor_bytes(g.qtype, 1, g.shape[1])
              for g in (ck.experts[la][t] for t in range(len(spec.expert_shapes)))]
             for la in spec.moe_layers]
    layout = _core.ExpertLayout(len(spec.moe_layers), spec.num_experts, sizes)
    qtypes = sorted({g.qtype for grp in ck.experts.values() for g in grp.values()})
    blocks = len(spec.moe_layers) * spec.num_experts
    return FetchModel(path.name, -(-int(layout.total_bytes) // blocks), len(spec.moe_layers),
                      spec.num_experts, spec.top_k, "+".join(qtypes))
