"""GGUF checkpoints (llama.cpp's format), through the `gguf` package.

Architectures: `llama` (dense, or Mixtral-style MoE when `llama.expert_count` is set), `qwen3`,
`qwen3moe`, `gpt-oss`, `qwen3next`, `qwen35moe` (`models/gguf_archs.py`), `deepseek2`
(DeepSeek-V2/V3), `glm4moe` (GLM-4.5) and `minimax-m2` (MiniMax-M2; these three
`models/gguf_deepseek.py`). The config and the tokenizer come from the file's metadata (a file
without `tokenizer.*` metadata loads with a warning and serves token-id prompts, as a checkpoint
directory without tokenizer.json does). Tensor names are mapped to Hugging Face names;
llama.cpp's row permutation of the llama q and k projections is undone (for quantized weights by moving whole rows of blocks, which is exact: the
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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ftrs.errors import ModelLoadError
from ftrs.models.gguf_archs import (
    DELTANET,
    GPT_OSS_NAMES,
    QWEN3NEXT_BARE,
    QWEN3NEXT_NAMES,
    QWEN35MOE_NAMES,
    deltanet_config,
    qwen3next_to_hf,
    rope_scaling,
)
from ftrs.models.gguf_deepseek import (
    DEEPSEEK2_BARE,
    DEEPSEEK2_NAMES,
    GLM4MOE_NAMES,
    deepseek2_config,
    deepseek2_to_hf,
    deepseek2_yarn,
    glm4moe_config,
    minimax_m2_config,
)
from ftrs.models.gguf_file import (
    GGUFFile,
    LayoutError,
    Mapped,
    ShardError,
    file_offset,
    read_gguf_set,
    reader_metadata,
)
from ftrs.models.names import DOWN, GATE, UP
from ftrs.models.tokenizer import Tokenizer
from ftrs.quant.formats import GGUF_FORMATS, TAIL_BYTES, QuantTensor, tensor_bytes

log = logging.getLogger(__name__)

_TOP = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
        "output.weight": "lm_head.weight"}
_BLOCK = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
          "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
          "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm",
          "attn_k_norm": "self_attn.k_norm", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
          "ffn_down": "mlp.down_proj", "ffn_gate_inp": "mlp.gate"}
_EXPERTS = {"ffn_gate_exps": GATE, "ffn_up_exps": UP, "ffn_down_exps": DOWN}
_BIAS = 3  # the pool's tensor index of an expert's gate bias (up 4, down 5): `expert_shapes`
#: `blk.N.ffn_gate_up_exps` (the converter's `--fuse-gate-up-exps`): gate rows, then up rows
_GATE_UP = 10
_BLK = re.compile(r"^blk\.(\d+)\.([a-z0-9_]+)(?:\.(weight|bias))?$")  # ssm_a has no suffix
#: NVFP4 is left out: a GGUF file keeps its per-tensor scale outside the blocks, in a
#: convention this loader does not read, and NVFP4 without it is off by that factor
SUPPORTED_TYPES = tuple(t for t in GGUF_FORMATS if t not in TAIL_BYTES)
_ARCH_TYPE = {"llama": "llama", "qwen3": "qwen3", "qwen3moe": "qwen3_moe", "gpt-oss": "gpt_oss",
              "qwen3next": "qwen3_next", "qwen35moe": "qwen3_5_moe_text",
              "deepseek2": "deepseek_v3",  # or deepseek_v2: its gating says (`deepseek2_config`)
              "glm4moe": "glm4_moe", "minimax-m2": "minimax_m2"}
_SHARED_EXPERTS = (*DELTANET, "deepseek2", "glm4moe")  # architectures with ffn_*_shexp


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
    tokenizer: Tokenizer | None  # None: the file has no tokenizer.* metadata
    dense: dict[str, GGUFTensor]
    #: layer -> {GATE|UP|DOWN: (E, rows, cols)}, and gpt-oss's biases {3|4|5: (E, rows)}
    experts: dict[int, dict[int, GGUFTensor]]
    permuted: dict[str, int]  # HF name -> heads: rows llama.cpp permuted (undo with `unpermute`)
    shards: list[Mapped] = field(default_factory=list)  # the mapped file(s), a split one's all

    def file_offset(self, view: np.ndarray) -> tuple[Path, int] | None:
        """(file, offset) of a C-contiguous view of a mapped file (one expert of a tensor);
        None for anything else."""
        return file_offset(self.shards, view)


def _reader(path: Path) -> GGUFFile:
    if not path.is_file():
        raise ModelLoadError(str(path), "GGUF file not found")
    try:
        return read_gguf_set(path)
    except (ShardError, LayoutError) as e:
        raise ModelLoadError(str(path), str(e)) from e
    except Exception as e:  # a truncated file fails here: its tensors run past the end
        raise ModelLoadError(str(path), f"cannot read GGUF (truncated or corrupt?): {e}") from e


def gguf_metadata(reader: Any) -> dict[str, Any]:
    """Key -> value of a `GGUFFile` or a `gguf.GGUFReader` (fields it cannot render left out)."""
    return reader.metadata if isinstance(reader, GGUFFile) else reader_metadata(reader)


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

    def count(key: str, default: Any = None) -> int:
        """`get(key)` as an integer of at least 1 (a size, a count of heads or positions)."""
        n = int(get(key, default))
        if n < 1:
            raise ModelLoadError(source, f"GGUF metadata {arch}.{key} must be >= 1, got {n}")
        return n

    heads = count("attention.head_count")
    hidden = count("embedding_length")
    vocab = len(meta.get("tokenizer.ggml.tokens") or []) or count("vocab_size")
    head_dim = (count("attention.key_length") if meta.get(f"{arch}.attention.key_length")
                else count("rope.dimension_count", hidden // heads))
    cfg: dict[str, Any] = {
        "model_type": _ARCH_TYPE[arch],
        "vocab_size": vocab, "hidden_size": hidden,
        "num_hidden_layers": _layers(meta, arch, source), "num_attention_heads": heads,
        "num_key_value_heads": count("attention.head_count_kv", heads),
        "head_dim": head_dim,
        "rms_norm_eps": float(get("attention.layer_norm_rms_epsilon",
                                  1e-5 if arch == "llama" else 1e-6)),
        "rope_theta": float(get("rope.freq_base", 10000.0)),
        "max_position_embeddings": count("context_length", 2048),
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": meta.get("tokenizer.ggml.eos_token_id"),
        "hidden_act": "silu", "torch_dtype": "float32",
    }
    experts = int(meta.get(f"{arch}.expert_count") or 0)
    if arch == "qwen3moe" and experts < 1:
        raise ModelLoadError(source, "qwen3moe file without qwen3moe.expert_count")
    if arch not in _SHARED_EXPERTS and any(n.endswith("_shexp.weight") for n in tensor_names):
        raise ModelLoadError(source, "shared experts (ffn_*_shexp) are not supported")
    ff = meta.get(f"{arch}.feed_forward_length")
    if experts:
        cfg["num_experts_per_tok"] = int(get("expert_used_count"))
        moe_layers = {int(m.group(1)) for n in tensor_names
                      if (m := _BLK.match(n)) and m.group(2) == "ffn_gate_inp"
                      and int(m.group(1)) < cfg["num_hidden_layers"]}
        if arch in ("llama", "gpt-oss", "minimax-m2", *DELTANET) and \
                moe_layers != set(range(cfg["num_hidden_layers"])):
            raise ModelLoadError(source, f"{arch} MoE file: every layer needs a router "
                                 "(blk.N.ffn_gate_inp.weight)")
        if arch == "llama":
            cfg |= {"model_type": "mixtral", "num_local_experts": experts,
                    "intermediate_size": count("feed_forward_length")}
        elif arch in DELTANET:
            cfg |= deltanet_config(meta, arch, cfg, experts, source)
        elif arch == "deepseek2":
            cfg |= deepseek2_config(meta, cfg, experts, moe_layers, source)
        elif arch == "glm4moe":
            cfg |= glm4moe_config(meta, cfg, experts, moe_layers, tensor_names, source)
        elif arch == "minimax-m2":
            cfg |= minimax_m2_config(meta, cfg, experts, tensor_names, source)
        elif arch == "gpt-oss":
            layers = cfg["num_hidden_layers"]
            cfg |= {"num_local_experts": experts, "attention_bias": True, "swiglu_limit": 7.0,
                    "intermediate_size": count("expert_feed_forward_length"),
                    "sliding_window": int(get("attention.sliding_window")),
                    "layer_types": ["sliding_attention" if i % 2 == 0 else "full_attention"
                                    for i in range(layers)]}
        else:
            cfg |= {"num_experts": experts, "norm_topk_prob": True, "decoder_sparse_step": 1,
                    "moe_intermediate_size": count("expert_feed_forward_length"),
                    "intermediate_size": int(ff or 0),
                    "mlp_only_layers": sorted(set(range(cfg["num_hidden_layers"])) - moe_layers)}
    elif arch in ("gpt-oss", "minimax-m2", *_SHARED_EXPERTS):
        raise ModelLoadError(source, f"{arch} file without {arch}.expert_count")
    else:
        cfg["intermediate_size"] = count("feed_forward_length")
    scaling = rope_scaling(meta, arch, source)
    if scaling is not None:
        cfg["rope_scaling"] = scaling | ({"truncate": False} if arch == "gpt-oss" else {})
        if arch == "deepseek2":
            cfg["rope_scaling"] = deepseek2_yarn(meta, cfg["rope_scaling"])
    return cfg


def _layers(meta: dict[str, Any], arch: str, source: str) -> int:
    """The decoder's layers: `block_count` less the multi-token-prediction blocks the converter
    appends after them (`nextn_predict_layers`), which ftrs does not run."""
    blocks = meta.get(f"{arch}.block_count")
    if blocks is None:
        raise ModelLoadError(source, f"missing GGUF metadata {arch}.block_count")
    nextn = int(meta.get(f"{arch}.nextn_predict_layers") or 0)
    if int(blocks) - nextn < 1:
        less = f" less {arch}.nextn_predict_layers {nextn}" if nextn else ""
        raise ModelLoadError(source, f"GGUF metadata {arch}.block_count{less} must be >= 1, "
                             f"got {int(blocks) - nextn}")
    return int(blocks) - nextn


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
    if arch in DELTANET and (kind, suffix) in QWEN3NEXT_BARE:
        return f"model.layers.{layer}.{QWEN3NEXT_BARE[kind, suffix]}"
    if arch in ("deepseek2", "glm4moe", "minimax-m2") and (kind, suffix) in DEEPSEEK2_BARE:
        return f"model.layers.{layer}.{DEEPSEEK2_BARE[kind, suffix]}"
    block = _BLOCK | {"gpt-oss": GPT_OSS_NAMES, "qwen3next": QWEN3NEXT_NAMES, "qwen35moe": QWEN35MOE_NAMES,
                      "deepseek2": DEEPSEEK2_NAMES, "glm4moe": GLM4MOE_NAMES}.get(arch, {})
    if kind not in block or suffix is None:
        return None
    if kind == "attn_sinks":
        return f"model.layers.{layer}.{block[kind]}"
    return f"model.layers.{layer}.{block[kind]}.{suffix}"


def open_gguf(path: Path) -> GGUFCheckpoint:
    """Read and validate a GGUF file without copying any tensor."""
    reader = _reader(path)
    meta = reader.metadata
    src = str(path)
    names = {t.name for t in reader.tensors}
    cfg = gguf_config(meta, names, src)
    tokenizer = None
    if "tokenizer.ggml.model" in meta:
        tokenizer = Tokenizer.from_gguf_fields(meta, src)
    else:  # as a checkpoint directory without tokenizer.json: the model still serves
        log.warning("%s has no tokenizer (tokenizer.ggml.model missing): only token-id "
                    "prompts will work", src)
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
    n_exp = int(cfg.get("num_local_experts") or cfg.get("num_experts")
                or cfg.get("n_routed_experts") or 0)
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
    if arch in DELTANET:
        qwen3next_to_hf(dense, cfg)
    if arch == "deepseek2":
        deepseek2_to_hf(dense, cfg, src)
    permuted: dict[str, int] = {}
    if cfg["model_type"] in ("llama", "mixtral"):
        for layer in range(cfg["num_hidden_layers"]):
            p = f"model.layers.{layer}.self_attn."
            permuted[p + "q_proj.weight"] = cfg["num_attention_heads"]
            permuted[p + "k_proj.weight"] = cfg["num_key_value_heads"]
    return GGUFCheckpoint(path, cfg, tokenizer, dense, experts, permuted, reader.shards)


def unpermute_rows(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undo llama.cpp's q/k row permutation (interleaved rotary halves -> split halves). `w` is
    (rows, ...): fp values, or the (rows, row_bytes) bytes of a quantized matrix."""
    half = w.shape[0] // n_head // 2
    return w.reshape(n_head, half, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape).contiguous()


def read_gguf(path: Path, progress: bool = True
              ) -> tuple[dict[str, Any], dict[str, torch.Tensor], Tokenizer | None]:
    """(HF config, fp32 tensors under HF names, tokenizer: None where the file has none) of a
    dense GGUF file."""
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
