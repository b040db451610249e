"""Resolve a model name to files and load it: ArchSpec, dense weights, expert pool, tokenizer."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from ftrs.errors import ModelLoadError
from ftrs.models.arch import ArchSpec, arch_from_config, load_arch
from ftrs.models.experts import HostExperts
from ftrs.models.gguf_loader import read_gguf
from ftrs.models.names import map_hf_name
from ftrs.models.safetensors_loader import expected_dense_shapes, load_safetensors
from ftrs.models.tokenizer import Tokenizer

log = logging.getLogger(__name__)


@dataclass
class LoadedModel:
    """A checkpoint in memory: what the decoder and the MoE strategies are built from."""

    name: str
    path: Path
    spec: ArchSpec
    dense: dict[str, torch.Tensor]
    experts: HostExperts | None
    tokenizer: Tokenizer | None


def resolve_model(model: str) -> Path:
    """`demo` -> the demo checkpoint (built on first use); anything else must exist on disk."""
    if model == "demo":
        from ftrs.models.demo import ensure_demo

        return ensure_demo()
    path = Path(model).expanduser()
    if not path.exists():
        raise ModelLoadError(str(path), "no such file or directory")
    return path


def _dense_from_hf_names(tensors: dict[str, torch.Tensor], spec: ArchSpec, source: str,
                         dtype: torch.dtype, device: torch.device) -> dict[str, torch.Tensor]:
    want = expected_dense_shapes(spec)
    dense: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        key = map_hf_name(name)
        if not isinstance(key, str) or key not in want:
            continue
        if tuple(t.shape) != want[key]:
            raise ModelLoadError(source, f"tensor {name} has shape {list(t.shape)}, "
                                 f"expected {list(want[key])}")
        dense[key] = t.to(device=device, dtype=dtype)
    missing = sorted(set(want) - set(dense))
    if missing:
        raise ModelLoadError(source, f"missing tensors: {', '.join(missing[:5])}")
    return dense


def load_model(model: str, device: torch.device, dtype: torch.dtype,
               progress: bool = True) -> LoadedModel:
    path = resolve_model(model)
    if path.is_file():
        if path.suffix != ".gguf":
            raise ModelLoadError(str(path), "a model is a checkpoint directory or a .gguf file")
        cfg, tensors, tokenizer = read_gguf(path, progress=progress)
        spec = arch_from_config(cfg, str(path))
        dense = _dense_from_hf_names(tensors, spec, str(path), dtype, device)
        return LoadedModel(model, path, spec, dense, None, tokenizer)
    if not path.is_dir():
        raise ModelLoadError(str(path), "not a directory")
    spec = load_arch(path)
    dense, experts = load_safetensors(path, spec, dtype, device, progress=progress)
    tok: Tokenizer | None = None
    if (path / "tokenizer.json").is_file():
        tok = Tokenizer.from_dir(path)
    else:
        log.warning("%s has no tokenizer.json: only token-id prompts will work", path)
    return LoadedModel(model, path, spec, dense, experts, tok)
