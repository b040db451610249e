"""Load an HF checkpoint directory: single-file or sharded safetensors, fp32/bf16/fp16 on disk.

Dense tensors are read through safetensors' mmap and cast to the model dtype; routed experts go
straight from the files into the host expert pool by Rust (`ExpertPool.fill_from_safetensors`),
in parallel, converting dtype on the way. Shapes and dtypes are checked before any byte is
copied (shapes against the ArchSpec; dtypes a float type, or one a quantized format the config
names keeps), so a bad file fails with its name and the tensor at fault.

FP8 checkpoints (`quantization_config.quant_method == "fp8"`: `float8_e4m3fn` weights, each with
a `weight_scale_inv` per `weight_block_size` tile) stay FP8: each weight and its scales become
one `FP8_BLOCK` byte buffer (`ftrs.quant`), in the expert pool for experts, a `QuantTensor` for
dense projections on the CPU (dequantized once at load on a GPU). ModelOpt NVFP4 checkpoints
(`quant_method == "modelopt"`, `quant_algo == "NVFP4"`, in config.json or hf_quant_config.json:
uint8 weights with `weight_scale` and `weight_scale_2`) stay NVFP4 the same way
(`quant.nvfp4.from_modelopt`); the modules the export left out are plain tensors. So do
compressed-tensors NVFP4 checkpoints (llm-compressor's `nvfp4-pack-quantized`: `weight_packed`
in ModelOpt's nibble order, `weight_scale`, and `weight_global_scale`, the inverse of ModelOpt's
tensor scale: its reciprocal becomes the tensor scale, one fp32 rounding).

gpt_oss packs each layer's experts into a few tensors (MXFP4 `*_blocks` + `*_scales`, or plain)
with biases: `models.packed_experts` checks them here and cuts them into the pool.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch
from tqdm import tqdm

from ftrs.errors import ModelLoadError
from ftrs.layers.moe import GROUPED_SIGMOID
from ftrs.models.arch import LINEAR_ATTENTION, ArchSpec
from ftrs.models.experts import ExpertFormat, HostExperts, TensorFormat
from ftrs.models.mla import mla_shapes
from ftrs.models.names import (
    ExpertKey,
    PackedExperts,
    keeps_quantized,
    map_hf_name,
    split_grouped_qkvz,
)
from ftrs.models.packed_experts import (
    Sources,
    check_part,
    open_safetensors,
    packed_formats,
    sources_in,
    write_packed,
)
from ftrs.quant.dequant import dequantize
from ftrs.quant.formats import FP8_BLOCK, QuantTensor, fp8_scale_grid
from ftrs.quant.matmul import Weight
from ftrs.quant.nvfp4 import from_modelopt

log = logging.getLogger(__name__)


def checkpoint_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (OSError, json.JSONDecodeError, KeyError) as e:
            raise ModelLoadError(str(index), f"bad shard index: {e}") from e
        files = sorted({model_dir / f for f in weight_map.values()})
    else:
        files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(str(model_dir), "no *.safetensors files")
    for f in files:
        if not f.is_file():
            raise ModelLoadError(str(f), "shard named in the index is missing")
    return files


def expected_dense_shapes(spec: ArchSpec, flat_linear: bool = False) -> dict[str, tuple[int, ...]]:
    """Every dense tensor's shape by decoder key; `flat_linear`: qwen3_next's DeltaNet inputs
    come flat (a GGUF file), not grouped per key head."""
    s = spec
    q_out, kv_out = s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim
    shapes: dict[str, tuple[int, ...]] = {"embed": (s.vocab_size, s.hidden_size),
                                          "norm": (s.hidden_size,)}
    if not s.tie_word_embeddings:
        shapes["lm_head"] = (s.vocab_size, s.hidden_size)
    h = s.hidden_size
    for layer in range(s.num_layers):
        p = f"{layer}."
        shapes |= {p + "input_norm": (h,), p + "post_norm": (h,)}
        if s.layer_type(layer) == LINEAR_ATTENTION:
            shapes |= _linear_attn_shapes(s, p, flat_linear)
        elif s.mla is not None:
            shapes |= mla_shapes(s, p)
        else:
            shapes |= {p + "q": (q_out * (2 if s.attn_output_gate else 1), h),
                       p + "k": (kv_out, h), p + "v": (kv_out, h), p + "o": (h, q_out)}
            if s.qk_norm:
                shapes |= {p + "q_norm": (s.head_dim,), p + "k_norm": (s.head_dim,)}
            if s.qk_norm_full:
                shapes |= {p + "q_norm": (q_out,), p + "k_norm": (kv_out,)}
            if s.attention_bias:
                shapes |= {p + "q_bias": (q_out,), p + "k_bias": (kv_out,),
                           p + "v_bias": (kv_out,)}
            if s.o_bias:
                shapes[p + "o_bias"] = (h,)
            if s.attention_sinks:
                shapes[p + "sinks"] = (s.num_heads,)
        if s.is_moe_layer(layer):
            shapes[p + "router"] = (s.num_experts, h)
            if s.router == "topk_softmax":
                shapes[p + "router_bias"] = (s.num_experts,)
            if s.router == GROUPED_SIGMOID:
                shapes[p + "router_correction"] = (s.num_experts,)
            si = s.shared_expert_intermediate_size
            if si:
                shapes |= {p + "shared_gate": (si, h), p + "shared_up": (si, h),
                           p + "shared_down": (h, si)}
                if s.linear is not None:  # the hybrids' shared expert is sigmoid-gated
                    shapes[p + "shared_expert_gate"] = (1, h)
        else:
            i = s.intermediate_size
            shapes |= {p + "gate": (i, s.hidden_size), p + "up": (i, s.hidden_size),
                       p + "down": (s.hidden_size, i)}
    return shapes


def _linear_attn_shapes(s: ArchSpec, p: str, flat: bool) -> dict[str, tuple[int, ...]]:
    """A Gated DeltaNet layer's tensors; qwen3_next ships its input projections grouped per
    key head (`lin_qkvz`, `lin_ba`), split after loading (`names.split_grouped_qkvz`)."""
    lin, h = s.linear, s.hidden_size
    assert lin is not None  # invariant: a spec with linear layers has their shapes
    out: dict[str, tuple[int, ...]] = {
        p + "lin_conv": (lin.conv_dim, 1, lin.conv_kernel), p + "lin_dt_bias": (lin.num_v_heads,),
        p + "lin_a_log": (lin.num_v_heads,), p + "lin_norm": (lin.v_head_dim,),
        p + "lin_out": (h, lin.value_dim)}
    if s.arch == "qwen3_next" and not flat:
        return out | {p + "lin_qkvz": (2 * lin.key_dim + 2 * lin.value_dim, h),
                      p + "lin_ba": (2 * lin.num_v_heads, h)}
    return out | {p + "lin_qkv": (lin.conv_dim, h), p + "lin_z": (lin.value_dim, h),
                  p + "lin_b": (lin.num_v_heads, h), p + "lin_a": (lin.num_v_heads, h)}


SCALE_SUFFIX = ".weight_scale_inv"
#: NVFP4's side tensors by checkpoint layout (`ArchSpec.nvfp4`): per 16 values, per tensor
NVFP4_SUFFIXES = {"modelopt": (".weight_scale", ".weight_scale_2"),
                  "compressed-tensors": (".weight_scale", ".weight_global_scale")}
CT_PACKED = ".weight_packed"  # compressed-tensors' name for the packed codes


def _weight_name(name: str, spec: ArchSpec) -> str:
    """A tensor's name as `map_hf_name` reads it: compressed-tensors' `weight_packed` is the
    weight."""
    if spec.nvfp4 == "compressed-tensors" and name.endswith(CT_PACKED):
        return name[:-len(CT_PACKED)] + ".weight"
    return name


def _past_the_last_layer(key: str | ExpertKey | PackedExperts, spec: ArchSpec) -> bool:
    """A layer past `num_hidden_layers`: DeepSeek-V3's multi-token-prediction block (its
    `num_nextn_predict_layers`), shipped as the next layer; not read."""
    if isinstance(key, str):
        layer, _, rest = key.partition(".")
        return bool(rest) and layer.isdigit() and int(layer) >= spec.num_layers
    return key.layer >= spec.num_layers


def _quantized(dtype: str, spec: ArchSpec) -> str | None:
    """The `ftrs.quant` type a tensor of safetensors dtype `dtype` is kept in, None if plain."""
    if dtype == "F8_E4M3" and spec.fp8_block:
        return FP8_BLOCK
    if dtype == "U8" and spec.nvfp4:
        return "NVFP4"
    return None


def _quant_formats(files: list[Path], spec: ArchSpec) -> dict[int, ExpertFormat]:
    """Per MoE layer, which expert tensors the files hold quantized (header reads only)."""
    found: dict[tuple[int, int], str] = {}
    for path in files:
        with open_safetensors(path) as f:
            for name in f.keys():
                key = map_hf_name(_weight_name(name, spec))
                qtype = _quantized(f.get_slice(name).get_dtype(), spec)
                if isinstance(key, ExpertKey) and qtype:
                    found[(key.layer, key.tensor)] = qtype
    return {la: tuple(TensorFormat(found[(la, t)], spec.fp8_block if found[(la, t)] == FP8_BLOCK
                                   else None) if (la, t) in found else TensorFormat()
                      for t in range(3)) for la in spec.moe_layers}


def _expert_sources(model_dir: Path, spec: ArchSpec, files: list[Path] | None = None
                    ) -> tuple[dict[int, ExpertFormat] | None, Sources]:
    """(per MoE layer, the formats the pool stores the routed experts in, None when all are in
    the compute dtype; gpt_oss' packed parts by layer and the file holding each), from the
    headers of `files` (default: the directory's) only; none is opened when the config says
    every expert is plain."""
    if not spec.is_moe or not (spec.expert_bias or spec.fp8_block or spec.nvfp4):
        return None, {}
    files = files or checkpoint_files(model_dir)
    if not spec.expert_bias:
        return _quant_formats(files, spec), {}
    packed: Sources = {}
    for src, _, pkey in sources_in(files):
        packed.setdefault(pkey.layer, {})[pkey.part] = src
    return packed_formats(packed, spec, str(model_dir)), packed


def expert_formats(model_dir: Path, spec: ArchSpec) -> dict[int, ExpertFormat] | None:
    """Per MoE layer, the formats the expert pool will store a checkpoint directory's routed
    experts in (the files' encodings, as `load_safetensors` stores them; None: the compute
    dtype), read from the safetensors headers without any weight data."""
    return _expert_sources(model_dir, spec)[0]


#: the dtypes a plain (unquantized) tensor may have, cast to the model's dtype at load (the
#: expert pool's Rust reader converts these three)
FLOAT_DTYPES = ("F32", "F16", "BF16")


def _check_dtype(st_dtype: str, qtype: str | None, key: str | ExpertKey | PackedExperts,
                 source: str, name: str) -> None:
    """ModelLoadError unless a tensor's safetensors dtype is a float type, or one a format the
    config names keeps (FP8 E4M3 weights, NVFP4's uint8 codes, gpt_oss' MXFP4 blocks and scales)."""
    if qtype or st_dtype in FLOAT_DTYPES:
        return
    if st_dtype == "F8_E4M3":
        raise ModelLoadError(source, f"tensor {name} is FP8 but config.json has no fp8 "
                             "quantization_config")
    if isinstance(key, PackedExperts) and key.part.endswith(("_blocks", "_scales")):
        return  # MXFP4 codes and exponents: bytes (`packed_experts` checks their shapes)
    if st_dtype == "U8" and not isinstance(key, PackedExperts):
        raise ModelLoadError(source, f"tensor {name} is uint8 (packed FP4?) but the config "
                             "names no NVFP4 quantization (modelopt or compressed-tensors)")
    raise ModelLoadError(source, f"tensor {name} has dtype {st_dtype}, expected a float type "
                         "(F32, F16, BF16, or the quantized formats' own dtypes: FP8 E4M3 "
                         "weights, U8/I8 blocks and scales where a format uses them)")


def fp8_bytes(weight: torch.Tensor, scale: torch.Tensor | None, name: str, source: str,
              block: tuple[int, int]) -> torch.Tensor:
    """The FP8_BLOCK bytes of one weight: its fp8 bytes, then its scales as fp32."""
    if scale is None:
        raise ModelLoadError(source, f"FP8 weight {name} has no {name[:-7]}{SCALE_SUFFIX}")
    grid = fp8_scale_grid(weight.shape[0], weight.shape[1], block)
    if tuple(scale.shape) != grid:
        raise ModelLoadError(source, f"{name[:-7]}{SCALE_SUFFIX} has shape {list(scale.shape)}, "
                             f"expected {list(grid)} for blocks of {list(block)}")
    return torch.cat([weight.contiguous().view(torch.uint8).reshape(-1),
                      scale.float().contiguous().view(torch.uint8).reshape(-1)])


def _quant_bytes(qtype: str, weight: torch.Tensor, sides: dict[str, torch.Tensor], name: str,
                 source: str, spec: ArchSpec) -> tuple[torch.Tensor, tuple[int, int]]:
    """One quantized weight's bytes as `ftrs.quant` keeps them, and its (rows, cols)."""
    stem = name[:-len(".weight")]
    if qtype == FP8_BLOCK:
        assert spec.fp8_block is not None  # invariant: `_quantized` says FP8 only with a block
        data = fp8_bytes(weight, sides.get(stem + SCALE_SUFFIX), name, source, spec.fp8_block)
        return data, (int(weight.shape[0]), int(weight.shape[1]))
    suffixes = NVFP4_SUFFIXES[spec.nvfp4]
    missing = [stem + s for s in suffixes if stem + s not in sides]
    if missing:
        raise ModelLoadError(source, f"NVFP4 weight {name} has no {' or '.join(missing)}")
    scale, tensor_scale = (sides[stem + s] for s in suffixes)
    if spec.nvfp4 == "compressed-tensors":  # the global scale divides: its reciprocal, once
        tensor_scale = 1.0 / tensor_scale.float()
    try:
        data = from_modelopt(weight, scale, tensor_scale)
    except ValueError as e:
        raise ModelLoadError(source, f"{name}: {e}") from e
    return data, (int(weight.shape[0]), 2 * int(weight.shape[1]))


def load_safetensors(model_dir: Path, spec: ArchSpec, dtype: torch.dtype, device: torch.device,
                     progress: bool = True) -> tuple[dict[str, Weight], HostExperts | None]:
    files = checkpoint_files(model_dir)
    want = expected_dense_shapes(spec)
    optional = {f"{la}.{b}" for la in range(spec.num_layers) for b in ("q_bias", "k_bias", "v_bias")}
    if spec.tie_word_embeddings:
        optional.add("lm_head")
    dense: dict[str, Weight] = {}
    entries: list[tuple[str, str, int, int, int]] = []
    seen_experts: set[ExpertKey] = set()
    block = spec.fp8_block
    sides_named = (SCALE_SUFFIX,) if block else NVFP4_SUFFIXES[spec.nvfp4] if spec.nvfp4 else ()
    formats, packed = _expert_sources(model_dir, spec, files)
    experts = HostExperts(spec, dtype, formats) if spec.is_moe else None
    # quantized weight name -> (file, type, the file's tensor); their scale tensors by name
    quant: dict[str, tuple[str, str, torch.Tensor]] = {}
    sides: dict[str, torch.Tensor] = {}
    layer_index = experts.layer_index if experts else {}
    # a `with`: the bar is closed (its line cleared) before an error in the files propagates,
    # which would otherwise print after the unfinished bar on the same terminal line
    with tqdm(total=len(files), desc="loading weights", unit="file", disable=not progress,
              leave=False) as bar:
        for path in files:
            with open_safetensors(path) as f:
                for file_name in f.keys():
                    if file_name.endswith(sides_named):
                        sides[file_name] = f.get_tensor(file_name)
                        continue
                    name = _weight_name(file_name, spec)
                    key = map_hf_name(name)
                    if key is None or _past_the_last_layer(key, spec):
                        continue
                    shape = tuple(f.get_slice(file_name).get_shape())
                    st_dtype = f.get_slice(file_name).get_dtype()
                    qtype = _quantized(st_dtype, spec)
                    _check_dtype(st_dtype, qtype, key, str(path), file_name)
                    if qtype == "NVFP4" and len(shape) == 2:
                        shape = (shape[0], 2 * shape[1])  # two values a byte
                    if isinstance(key, PackedExperts):
                        check_part(key, shape, spec, str(path), file_name)
                        continue
                    if isinstance(key, ExpertKey):
                        if experts is None or key.layer not in layer_index or not 0 <= key.expert < spec.num_experts:
                            raise ModelLoadError(str(path), f"unexpected expert tensor {file_name}")
                        if shape != spec.expert_shapes[key.tensor]:
                            raise ModelLoadError(str(path), f"tensor {file_name} has shape "
                                                 f"{list(shape)}, "
                                                 f"expected {list(spec.expert_shapes[key.tensor])}")
                        if qtype:
                            quant[name] = (str(path), qtype, f.get_tensor(file_name))
                        else:
                            entries.append((str(path), file_name, layer_index[key.layer], key.expert,
                                            key.tensor))
                        seen_experts.add(key)
                        continue
                    if key not in want and key not in optional:
                        raise ModelLoadError(str(path), f"unexpected tensor {file_name} for {spec.arch}")
                    if key in want and shape != want[key]:
                        raise ModelLoadError(str(path), f"tensor {file_name} has shape "
                                             f"{list(shape)}, "
                                             f"expected {list(want[key])}")
                    if qtype:
                        quant[name] = (str(path), qtype, f.get_tensor(file_name))
                        dense[key] = torch.empty(0)  # placed below, once its scales are read
                        continue
                    try:
                        # copy=True: never leave a weight backed by the file's pages, which the
                        # kernel may drop under memory pressure and fault back in on every step
                        dense[key] = f.get_tensor(file_name).to(device=device, dtype=dtype, copy=True)
                    except Exception as e:
                        raise ModelLoadError(str(path), f"cannot read tensor {file_name}: {e}") from e
            bar.update(1)
    missing = sorted(set(want) - set(dense))
    if missing:
        raise ModelLoadError(str(model_dir), f"missing tensors: {', '.join(missing[:5])}"
                             + (" ..." if len(missing) > 5 else ""))
    if experts is not None and packed:
        log.info("filling the expert pool from packed experts: %.1f MiB",
                 experts.pool.nbytes / 2**20)
        write_packed(experts, packed, dtype)
    elif experts is not None:
        need = len(spec.moe_layers) * spec.num_experts * 3
        if len(seen_experts) != need:
            raise ModelLoadError(str(model_dir),
                                 f"found {len(seen_experts)} of {need} routed-expert tensors")
        log.info("filling the expert pool: %d tensors, %.1f MiB", len(entries),
                 experts.pool.nbytes / 2**20)
        experts.pool.fill_from_safetensors(entries)
    for name, (src, qtype, w) in quant.items():
        data, shape = _quant_bytes(qtype, w, sides, name, src, spec)
        key = map_hf_name(name)
        if isinstance(key, ExpertKey):
            assert experts is not None
            experts.write(key.layer, key.expert, key.tensor, data.numpy())
            continue
        assert isinstance(key, str)
        qt = QuantTensor(qtype, shape, data, block if qtype == FP8_BLOCK else None)
        dense[key] = qt if keeps_quantized(key, device.type) else dequantize(qt.to(device), dtype)
    if spec.arch == "qwen3_next":
        _split_grouped(spec, dense)
    return dense, experts


def _split_grouped(spec: ArchSpec, dense: dict[str, Weight]) -> None:
    """qwen3_next's grouped DeltaNet projections -> the flat keys the decoder reads."""
    lin = spec.linear
    assert lin is not None
    for layer in spec.layers_of(LINEAR_ATTENTION):
        p = f"{layer}."
        qkvz, ba = dense.pop(p + "lin_qkvz"), dense.pop(p + "lin_ba")
        assert isinstance(qkvz, torch.Tensor) and isinstance(ba, torch.Tensor)  # dequantized
        parts = split_grouped_qkvz(qkvz, ba, lin.num_k_heads, lin.k_head_dim, lin.v_head_dim,
                                   lin.num_v_heads // lin.num_k_heads)
        dense |= {p + k: v for k, v in parts.items()}
