"""Tiny quantized GGUF checkpoints for tests, with the dequantized HF checkpoint as oracle.

Each model is a tiny random transformers checkpoint written as GGUF by `gguf_write` (the `gguf`
package's own quantizers for Q8_0/Q4_0/Q4_1/Q5_0/Q5_1, random blocks with finite scales for the
K-quants); `build` also writes the weights the file holds, dequantized with the `gguf` package's
reference, as an HF checkpoint for transformers. `write_nvfp4_checkpoint`: a ModelOpt NVFP4
safetensors checkpoint, quantized here as ModelOpt lays it out, beside the fp32 values it holds.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from ftrs.models.gguf_write import Quantizer, gguf_quantizer, write_gguf
from ftrs.models.tiny import tiny_config, tiny_tensors, tiny_tokenizer
from ftrs.quant.fixtures import random_blocks


def quant_config(arch: str) -> dict[str, Any]:
    """The tiny config with every matrix width a multiple of 256 (K-quant rows)."""
    cfg = tiny_config(arch)
    cfg |= {"hidden_size": 256, "intermediate_size": 256, "head_dim": 64}
    if arch == "qwen3_moe":
        cfg["moe_intermediate_size"] = 256
    return cfg


def _mixed(spec: dict[str, str], seed: int) -> Quantizer:
    """Types by name fragment (first match); K- and IQ-quants get random blocks, the rest
    gguf's own."""
    rng = np.random.default_rng(seed)

    def q(name: str, w: np.ndarray) -> tuple[str, np.ndarray]:
        qtype = next((t for frag, t in spec.items() if frag in name), "F32")
        if w.ndim < 2 or qtype == "F32":
            return "F32", np.ascontiguousarray(w, dtype=np.float32)
        if qtype == "F16":
            return "F16", w.astype(np.float16)
        if qtype == "BF16":
            return "BF16", (torch.from_numpy(w).bfloat16().view(torch.int16).numpy())
        if qtype.endswith("_K") or qtype.startswith("IQ"):  # no gguf quantizer for these
            rows = int(np.prod(w.shape[:-1]))
            return qtype, random_blocks(qtype, rows, w.shape[-1], rng).reshape(
                *w.shape[:-1], -1)
        return gguf_quantizer(qtype)(name, w)
    return q


QWEN3MOE_TYPES = {  # every type ftrs keeps, one place each; expert down differs per layer
    "layers.0.mlp.experts.0.down": "Q6_K", "layers.2.mlp.experts.0.down": "Q4_K",
    "experts.0.gate": "Q4_K", "experts.0.up": "Q5_K",
    "q_proj": "Q8_0", "k_proj": "Q4_0", "v_proj": "Q4_1", "o_proj": "Q5_0",
    "mlp.gate_proj": "Q5_1", "mlp.up_proj": "Q2_K", "mlp.down_proj": "Q3_K",
    "embed_tokens": "F16", "lm_head": "BF16",
}
#: an IQ4_XS file's mix: IQ4_XS experts (IQ4_NL down), IQ4_NL attention
IQ4_TYPES = {"experts.0.down": "IQ4_NL", "experts": "IQ4_XS", "q_proj": "IQ4_NL",
             "o_proj": "IQ4_XS", "embed_tokens": "Q8_0"}
#: the i-quants of three bits and less, as unsloth's dynamic and llama.cpp's IQ2/IQ3 files mix
#: them: a type per MoE layer for the experts (down differs), and the attention (every layer
#: MoE: `LOW_IQ_CONFIG`, as llama.cpp's qwen3moe requires)
LOW_IQ_TYPES = {
    "layers.0.mlp.experts.0.down": "IQ3_S", "layers.0.mlp.experts": "IQ2_XXS",
    "layers.1.mlp.experts.0.down": "IQ3_XXS", "layers.1.mlp.experts": "IQ2_XS",
    "experts.0.down": "IQ2_S", "experts": "IQ1_S", "q_proj": "IQ1_M", "o_proj": "IQ3_S",
    "embed_tokens": "Q8_0"}
LOW_IQ_CONFIG = {"mlp_only_layers": []}
MIXTRAL_TYPES = {"experts": "Q4_0", "self_attn": "Q8_0", "embed_tokens": "Q8_0",
                 "lm_head": "Q6_K"}


def build(arch: str, types: dict[str, str], root: Path, seed: int = 1,
          config: dict[str, Any] | None = None) -> tuple[Path, Path]:
    """(GGUF file, HF checkpoint dir holding the file's dequantized weights); `config` updates
    the tiny config."""
    cfg = quant_config(arch) | (config or {})
    tensors = tiny_tensors(cfg, seed)
    gguf_path = root / f"{arch}.gguf"
    held = write_gguf(gguf_path, cfg, tensors, _mixed(types, seed),
                      tiny_tokenizer(cfg["vocab_size"]))
    ref_dir = root / f"{arch}-dequantized"
    ref_dir.mkdir()
    save_file({k: v.contiguous() for k, v in held.items()}, str(ref_dir / "model.safetensors"))
    (ref_dir / "config.json").write_text(json.dumps(cfg))
    return gguf_path, ref_dir


def spy_kernel_types(monkeypatch: Any) -> list[str]:
    """The types `quant.matmul` hands to the Rust kernels from now on, in call order
    (`monkeypatch`: pytest's fixture)."""
    import importlib

    quant_matmul = importlib.import_module("ftrs.quant.matmul")  # the module, not the function
    kernel_matmul = quant_matmul._kernel_matmul
    seen: list[str] = []

    def spy(x: torch.Tensor, w: Any) -> torch.Tensor:
        seen.append(w.qtype)
        return kernel_matmul(x, w)

    core = quant_matmul._core_module()
    kernel_matmuls = core.quant_matmuls

    def spy_many(x: Any, calls: list[tuple[Any, ...]], cols: int) -> None:  # q, k, v in one
        seen.extend(c[0] for c in calls)
        kernel_matmuls(x, calls, cols)

    monkeypatch.setattr(quant_matmul, "_kernel_matmul", spy)
    monkeypatch.setattr(core, "quant_matmuls", spy_many)
    return seen


def strategy_logits_equal_resident(model_dir: Path, strategy: str, ids: list[int]) -> bool:
    """Whether `strategy` (offload, hybrid) at a quarter of the experts cached gives the
    resident strategy's logits of `ids`, bit for bit (fp32)."""
    from ftrs.llm import LLM

    opts: dict[str, Any] = {"kv_tokens": 1024, "dtype": "float32"}
    ref = LLM(str(model_dir), moe_strategy="resident", **opts).logits(ids)
    llm = LLM(str(model_dir), moe_strategy=strategy, moe_cache_rate=0.25, **opts)
    try:
        return torch.equal(llm.logits(ids), ref)
    finally:
        llm.close()


#: the weights ModelOpt and llm-compressor quantize (router, norms, embeddings, LM head: plain)
NVFP4_QUANTIZED = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
E2M1_VALUES = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
NVFP4_QC = {"quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": 16,
            "kv_cache_quant_algo": None, "exclude_modules": ["lm_head", "model.layers.*.mlp.gate"]}
_CT_SCHEME = {"num_bits": 4, "type": "float", "strategy": "tensor_group", "group_size": 16,
              "symmetric": True, "dynamic": False, "actorder": None, "block_structure": None,
              "observer": "minmax", "observer_kwargs": {}}
#: llm-compressor's NVFP4 preset as its checkpoints' config.json says it
CT_NVFP4_QC = {
    "quant_method": "compressed-tensors", "format": "nvfp4-pack-quantized",
    "quantization_status": "compressed", "sparsity_config": {}, "transform_config": {},
    "kv_cache_scheme": None, "global_compression_ratio": None, "version": "0.12.2",
    "ignore": ["lm_head", "re:.*mlp.gate$"],
    "config_groups": {"group_0": {
        "format": "nvfp4-pack-quantized", "targets": ["Linear"], "output_activations": None,
        "weights": _CT_SCHEME, "input_activations": _CT_SCHEME | {"dynamic": "local"}}},
}


def to_nvfp4(w: torch.Tensor, layout: str = "modelopt") -> tuple[dict[str, torch.Tensor],
                                                                 torch.Tensor]:
    """The checkpoint's tensors for `w` (by suffix) and the fp32 weight they hold by the
    layout's definition: ModelOpt `e2m1 * weight_scale * weight_scale_2`, compressed-tensors
    `e2m1 * (weight_scale / weight_global_scale)` (its global scale divides)."""
    rows, cols = w.shape
    ts = w.abs().max() / (6.0 * 448.0)
    groups = w.view(rows, cols // 16, 16)
    scale = (groups.abs().amax(-1) / 6.0 / ts).to(torch.float8_e4m3fn)
    step = scale.float() * ts  # what one e2m1 unit is worth in each group
    r = groups / step[..., None]
    mag = (r.abs()[..., None] - E2M1_VALUES).abs().argmin(-1)  # nearest magnitude
    codes = mag | ((r < 0).long() << 3)
    pairs = codes.view(rows, cols // 2, 2)
    packed = (pairs[..., 0] | (pairs[..., 1] << 4)).to(torch.uint8)
    values = torch.where(codes >= 8, -E2M1_VALUES[mag], E2M1_VALUES[mag])
    if layout == "compressed-tensors":
        gs = (1.0 / ts).reshape(1)
        deq = (values * (scale.float() / gs)[..., None]).view(rows, cols)
        return {".weight_packed": packed, ".weight_scale": scale, ".weight_global_scale": gs,
                ".input_global_scale": torch.tensor([100.0])}, deq
    deq = ((values * scale.float()[..., None]) * ts).view(rows, cols)
    return {".weight": packed, ".weight_scale": scale, ".weight_scale_2": ts.reshape(()),
            ".input_scale": torch.tensor(0.01)}, deq


def write_nvfp4_checkpoint(root: Path, hf_quant_config: bool = False,
                           layout: str = "modelopt") -> tuple[Path, Path]:
    """(NVFP4 qwen3_moe checkpoint in `layout`, "modelopt" or "compressed-tensors"; HF
    checkpoint of the values it holds in fp32)."""
    cfg = quant_config("qwen3_moe")
    tensors = tiny_tensors(cfg, 5)
    nv_dir, ref_dir = root / "nvfp4", root / "ref"
    nv: dict[str, torch.Tensor] = {}
    ref: dict[str, torch.Tensor] = {}
    for name, w in tensors.items():
        if name.endswith(".weight") and name.split(".")[-2] in NVFP4_QUANTIZED:
            parts, ref[name] = to_nvfp4(w, layout)
            nv |= {name[:-7] + suffix: t for suffix, t in parts.items()}
        else:
            nv[name] = ref[name] = w
    for d, t in ((nv_dir, nv), (ref_dir, ref)):
        d.mkdir(parents=True)
        save_file({k: v.contiguous() for k, v in t.items()}, str(d / "model.safetensors"))
        tiny_tokenizer(cfg["vocab_size"]).save(d)
    (ref_dir / "config.json").write_text(json.dumps(cfg))
    qc = CT_NVFP4_QC if layout == "compressed-tensors" else NVFP4_QC
    if hf_quant_config:  # ModelOpt's older exports: config.json says nothing
        (nv_dir / "config.json").write_text(json.dumps(cfg))
        (nv_dir / "hf_quant_config.json").write_text(json.dumps(
            {"producer": {"name": "modelopt"},
             "quantization": {k: v for k, v in NVFP4_QC.items() if k != "quant_method"}}))
    else:
        (nv_dir / "config.json").write_text(json.dumps(cfg | {"quantization_config": qc}))
    return nv_dir, ref_dir


def to_fp8(w: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor,
                                                            torch.Tensor]:
    """(fp8 weight, fp32 scale per `block` tile, the dequantized fp32 weight), as block-scaled
    FP8 checkpoints (Qwen3-FP8, DeepSeek-V3) hold a weight: w = fp8 * scale of its tile."""
    rows, cols = w.shape
    gr, gc = -(-rows // block[0]), -(-cols // block[1])
    scale = torch.empty(gr, gc)
    for i in range(gr):
        for j in range(gc):
            tile = w[i * block[0]:(i + 1) * block[0], j * block[1]:(j + 1) * block[1]]
            scale[i, j] = tile.abs().max() / 448.0
    full = scale.repeat_interleave(block[0], 0)[:rows].repeat_interleave(block[1], 1)[:, :cols]
    w8 = (w / full).to(torch.float8_e4m3fn)
    return w8, scale, w8.float() * full


def write_fp8_checkpoint(src: Path, fp8_dir: Path, ref_dir: Path, block: tuple[int, int],
                         quantized: Callable[[str], bool]) -> None:
    """Copies of the checkpoint at `src` into `fp8_dir` and `ref_dir` (both existing
    checkpoint directories, tokenizer included): the weights `quantized(name)` says as
    block-scaled FP8 (`weight_scale_inv` per `block` tile, the fp8 config) in `fp8_dir`, and
    the values they hold, dequantized to fp32, in `ref_dir`."""
    fp8: dict[str, torch.Tensor] = {}
    ref: dict[str, torch.Tensor] = {}
    for name, w in load_file(str(src / "model.safetensors")).items():
        if quantized(name):
            w8, s, ref[name] = to_fp8(w, block)
            fp8[name], fp8[name[:-7] + ".weight_scale_inv"] = w8, s
        else:
            fp8[name] = ref[name] = w
    save_file(fp8, str(fp8_dir / "model.safetensors"))
    save_file(ref, str(ref_dir / "model.safetensors"))
    cfg = json.loads((src / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3",
                                  "activation_scheme": "dynamic", "weight_block_size": list(block)}
    (fp8_dir / "config.json").write_text(json.dumps(cfg))
