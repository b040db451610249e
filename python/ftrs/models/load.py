"""Resolve a model name to files and load it: ArchSpec, dense weights, expert pool, tokenizer."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from ftrs.errors import ModelLoadError
from ftrs.models.arch import ArchSpec, arch_from_config, load_arch
from ftrs.models.experts import ExpertFormat, HostExperts, TensorFormat
from ftrs.models.gguf_file import SHARD_NAME
from ftrs.models.gguf_loader import GGUFCheckpoint, GGUFTensor, open_gguf, unpermute_rows
from ftrs.models.names import keeps_quantized, map_hf_name
from ftrs.models.safetensors_loader import expected_dense_shapes, load_safetensors
from ftrs.models.tokenizer import Tokenizer
from ftrs.quant.formats import FLOAT_TYPES
from ftrs.quant.matmul import Weight

log = logging.getLogger(__name__)


@dataclass
class LoadedModel:
    """A checkpoint in memory: what the decoder and the MoE strategies are built from."""

    name: str
    path: Path
    spec: ArchSpec
    dense: dict[str, Weight]  # projections of a quantized file on the CPU stay QuantTensors
    experts: HostExperts | None
    tokenizer: Tokenizer | None


def resolve_model(model: str) -> Path:
    """`demo` -> the demo checkpoint (built on first use); anything else must exist on disk
    (a shard of a split GGUF: its first file, so every shard names the model alike)."""
    if model == "demo":
        from ftrs.models.demo import ensure_demo

        return ensure_demo()
    path = Path(model).expanduser()
    if not path.exists():
        raise ModelLoadError(str(path), "no such file or directory")
    m = SHARD_NAME.match(path.name) if path.is_file() else None
    if m is not None:  # a shard of a split GGUF names the set by its first file
        first = path.with_name(f"{m['stem']}-00001-of-{m['count']}.gguf")
        return first if first.is_file() else path
    return path


def _gguf_dense(ck: GGUFCheckpoint, spec: ArchSpec, dtype: torch.dtype,
                device: torch.device) -> dict[str, Weight]:
    want = expected_dense_shapes(spec, flat_linear=True)
    src = str(ck.path)
    chosen: dict[str, tuple[str, str]] = {}  # key -> (HF name, GGUF name)
    for name, gt in ck.dense.items():
        key = map_hf_name(name)
        if not isinstance(key, str) or key not in want:
            continue
        if gt.shape != want[key]:
            raise ModelLoadError(src, f"tensor {gt.name} has shape {list(gt.shape)}, "
                                 f"expected {list(want[key])}")
        chosen[key] = (name, gt.name)
    missing = sorted(set(want) - set(chosen))
    if missing:
        raise ModelLoadError(src, f"missing tensors: {', '.join(missing[:5])}")
    dense: dict[str, Weight] = {}
    for key, (name, _) in chosen.items():
        gt = ck.dense[name]
        keep = gt.qtype not in FLOAT_TYPES and keeps_quantized(key, device.type)
        if keep:
            qt = gt.quant()
            if name in ck.permuted:
                rows = unpermute_rows(qt.rows_view(), ck.permuted[name])
                qt = type(qt)(qt.qtype, qt.shape, rows.reshape(-1))
            dense[key] = qt
        else:
            t = gt.to_float()
            if name in ck.permuted:
                t = unpermute_rows(t, ck.permuted[name])
            dense[key] = t.to(device=device, dtype=dtype)
    return dense


def _gguf_experts(ck: GGUFCheckpoint, spec: ArchSpec, dtype: torch.dtype,
                  check_only: bool = False, progress: bool = False) -> HostExperts | None:
    """The expert pool filled from the file; with `check_only`, validate and return None.
    `progress`: a bar of the bytes filled (one fill call per layer and file)."""
    src = str(ck.path)
    if not spec.is_moe:
        if ck.experts:
            raise ModelLoadError(src, "expert tensors in a dense model")
        return None
    formats: dict[int, ExpertFormat] = {}
    for layer in spec.moe_layers:
        group = ck.experts.get(layer, {})
        n = len(spec.expert_shapes)
        if sorted(group) != list(range(n)):
            what = "weight" if n == 3 else "{weight,bias}"
            raise ModelLoadError(src, f"layer {layer}: found {len(group)} of {n} expert tensors "
                                 f"(blk.N.ffn_{{gate,up,down}}_exps.{what})")
        for t, gt in group.items():
            shape = spec.expert_shapes[t]  # a bias row (1, n) is (experts, n) in the file
            want = (spec.num_experts, *shape) if t < 3 else (spec.num_experts, shape[1])
            if gt.shape != want:
                raise ModelLoadError(src, f"tensor {gt.name} has shape {list(gt.shape)}, "
                                     f"expected {list(want)}")
            if t >= 3 and gt.qtype not in FLOAT_TYPES:
                raise ModelLoadError(src, f"tensor {gt.name}: expert biases must be a float "
                                     f"type, not {gt.qtype}")
        formats[layer] = tuple(
            TensorFormat(None if group[t].qtype in FLOAT_TYPES else group[t].qtype)
            for t in range(n))
    extra = sorted(set(ck.experts) - set(spec.moe_layers))
    if extra:
        raise ModelLoadError(src, f"expert tensors in layer {extra[0]}, which has no router")
    if check_only:
        return None
    experts = HostExperts(spec, dtype, formats)
    log.info("filling the expert pool: %.1f MiB", experts.pool.nbytes / 2**20)
    # by (file, layer): experts kept in the file's encoding, copied from it by Rust threads
    ranges: dict[tuple[Path, int], list[tuple[int, int, int, int, int]]] = {}
    for layer in spec.moe_layers:
        for t, gt in ck.experts[layer].items():
            for e in range(spec.num_experts):
                if formats[layer][t].qtype is None:
                    one = GGUFTensor(gt.name, gt.qtype, gt.shape[1:],
                                     np.array(gt.data[e], copy=True))
                    experts.write(layer, e, t,
                                  one.to_float().to(dtype).contiguous().view(torch.uint8).numpy())
                    continue
                at = ck.file_offset(gt.data[e])
                if at is None:  # not one run of the file's bytes
                    experts.write(layer, e, t, np.ascontiguousarray(gt.data[e]).reshape(-1))
                else:
                    ranges.setdefault((at[0], layer), []).append(
                        (at[1], int(gt.data[e].nbytes), layer, e, t))
    total = sum(r[1] for part in ranges.values() for r in part)
    with tqdm(total=total, desc="filling the expert pool", unit="B", unit_scale=True,
              disable=not progress, leave=False) as bar:
        for (path, _), part in ranges.items():
            experts.fill_from_file(path, part)
            bar.update(sum(r[1] for r in part))
    return experts


def _load_gguf(model: str, path: Path, dtype: torch.dtype, device: torch.device,
               progress: bool) -> LoadedModel:
    ck = open_gguf(path)
    spec = arch_from_config(ck.config, str(path))
    experts = _gguf_experts(ck, spec, dtype, check_only=True)
    dense = _gguf_dense(ck, spec, dtype, device)
    experts = _gguf_experts(ck, spec, dtype, progress=progress)
    return LoadedModel(model, path, spec, dense, experts, ck.tokenizer)


def load_model(model: str, device: torch.device, dtype: torch.dtype,
               progress: bool = True) -> LoadedModel:
    path = resolve_model(model)
    if path.is_file():
        if path.suffix != ".gguf":
            raise ModelLoadError(str(path), "a model is a checkpoint directory or a .gguf file")
        return _load_gguf(model, path, dtype, device, progress)
    if not path.is_dir():
        raise ModelLoadError(str(path), "not a directory")
    spec = load_arch(path)
    st_dense, experts = load_safetensors(path, spec, dtype, device, progress=progress)
    dense: dict[str, Weight] = dict(st_dense)
    tok: Tokenizer | None = None
    if (path / "tokenizer.json").is_file():
        tok = Tokenizer.from_dir(path)
    elif (path / "tiktoken.model").is_file():  # Kimi-K2's, Moonlight's
        try:
            tok = Tokenizer.from_dir(path)
        except ModelLoadError as e:  # a split pattern ftrs does not know: the model still serves
            log.warning("%s; only token-id prompts will work", e)
    else:
        log.warning("%s has no tokenizer.json: only token-id prompts will work", path)
    return LoadedModel(model, path, spec, dense, experts, tok)
