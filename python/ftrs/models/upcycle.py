"""`ftrs models upcycle`: a dense llama checkpoint -> a Mixtral-format MoE with identical experts.

Each MLP is copied into E experts and a seeded random router is added. Because the top-k router
weights are renormalised to sum to one, the MoE computes sum_k w_k * MLP(x) = MLP(x) whatever
the router picks: its output must equal the dense model's, an exact oracle for every MoE path.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from ftrs.errors import ConfigError, ModelLoadError
from ftrs.models.gguf_loader import read_gguf
from ftrs.models.out_dir import made_for, writing_into
from ftrs.models.tiny import check_seed
from ftrs.models.tokenizer import Tokenizer

log = logging.getLogger(__name__)
SHARD_BYTES = 1 << 30
_MLP = {"mlp.gate_proj.weight": "w1.weight", "mlp.up_proj.weight": "w3.weight",
        "mlp.down_proj.weight": "w2.weight"}


def _check_source(src: Path) -> None:
    """ModelLoadError unless `src` is a directory or a `.gguf` file."""
    if src.is_dir() or (src.is_file() and src.suffix == ".gguf"):
        return
    problem = "a file that is not a GGUF" if src.exists() else "no such file or directory"
    raise ModelLoadError(str(src), f"{problem}: give a dense llama checkpoint directory or GGUF file")


def _check_llama(cfg: dict[str, Any], source: str) -> None:
    if cfg.get("model_type") != "llama":
        raise ModelLoadError(source, f"upcycle takes a dense llama model, got {cfg.get('model_type')!r}")


def read_dense(src: Path) -> tuple[dict[str, Any], dict[str, torch.Tensor], Tokenizer | None]:
    """(config, tensors under HF names, tokenizer) of a dense llama checkpoint dir or GGUF file."""
    _check_source(src)
    if src.is_file():
        return read_gguf(src)
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    from ftrs.models.config_file import read_config
    from ftrs.models.safetensors_loader import checkpoint_files

    cfg = read_config(src)  # a missing or unparseable config.json: ModelLoadError naming it
    _check_llama(cfg, str(src))  # before the tensors are read
    tensors: dict[str, torch.Tensor] = {}
    for f in checkpoint_files(src):
        try:
            tensors |= load_file(str(f))
        except (OSError, SafetensorError) as e:  # truncated, a bad header: named, not a traceback
            raise ModelLoadError(str(f), f"cannot read: {e}") from e
    tok = Tokenizer.from_dir(src) if (src / "tokenizer.json").is_file() else None
    return cfg, tensors, tok


def _save_sharded(tensors: dict[str, torch.Tensor], out: Path) -> None:
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > SHARD_BYTES:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += nbytes
    weight_map: dict[str, str] = {}
    for i, shard in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(out / fname), metadata={"format": "pt"})
        weight_map |= dict.fromkeys(shard, fname)
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    (out / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1))


def upcycle_tensors(cfg: dict[str, Any], tensors: dict[str, torch.Tensor], experts: int,
                    top_k: int, seed: int = 0, router_std: float = 0.5, copy: bool = True,
                    source: str = "") -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """(Mixtral config, tensors) of the upcycled model. Without `copy`, every expert of a layer
    is the same tensor object (no memory per expert)."""
    if not 1 <= top_k <= experts:
        raise ConfigError(f"upcycle: need 1 <= top-k <= experts, got top-k {top_k}, {experts} experts")
    _check_llama(cfg, source)
    check_seed(seed, "upcycle")
    g = torch.Generator().manual_seed(seed)
    hidden = int(cfg["hidden_size"])
    out: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        head, _, tail = name.partition(".mlp.")
        mlp_key = "mlp." + tail
        if tail and mlp_key in _MLP:
            for e in range(experts):
                out[f"{head}.block_sparse_moe.experts.{e}.{_MLP[mlp_key]}"] = (
                    t.clone() if copy else t)
            router = f"{head}.block_sparse_moe.gate.weight"
            if router not in out:
                out[router] = (torch.randn(experts, hidden, generator=g) * router_std).to(t.dtype)
        else:
            out[name] = t.contiguous()
    new_cfg = dict(cfg)
    new_cfg |= {"model_type": "mixtral", "architectures": ["MixtralForCausalLM"],
                "num_local_experts": experts, "num_experts_per_tok": top_k,
                "router_jitter_noise": 0.0, "output_router_logits": False}
    return new_cfg, out


def upcycle(src: Path, dst: Path, experts: int, top_k: int, seed: int = 0,
            router_std: float = 0.5) -> Path:
    """Write the upcycled `src` to `dst`, a new or empty directory (ConfigError otherwise: the
    files of a model already there, the source's own included, would be loaded with the new
    shards); returns `dst`. A failure leaves no directory behind that this call made."""
    if not 1 <= top_k <= experts:
        raise ConfigError(f"upcycle: need 1 <= top-k <= experts, got top-k {top_k}, {experts} experts")
    check_seed(seed, "upcycle")
    _check_source(src)
    if dst.exists() and os.path.samefile(src, dst):
        raise ConfigError(f"upcycle: DST {dst} is SRC itself: upcycling in place would mix the "
                          "dense weights with the new shards; give a new or empty directory")
    # made before the (long) read, so a DST that cannot be written fails at once; removed
    # again when the source turns out not to be a dense llama (or anything else fails)
    with made_for(dst, "upcycle", "DST", must_be_empty=True):
        cfg, tensors, tokenizer = read_dense(src)
        new_cfg, out = upcycle_tensors(cfg, tensors, experts, top_k, seed, router_std,
                                       source=str(src))
        with writing_into(dst, "upcycle", "DST"):
            _save_sharded(out, dst)
            (dst / "config.json").write_text(json.dumps(new_cfg, indent=2))
            if tokenizer is not None:
                tokenizer.save(dst)
    log.info("upcycled %s -> %s (%d experts, top-%d)", src, dst, experts, top_k)
    return dst
