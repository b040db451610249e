"""Load an HF checkpoint directory: single-file or sharded safetensors, fp32/bf16/fp16 on disk.

Dense tensors are read through safetensors' mmap and cast to the model dtype; routed experts go
straight from the files into the host expert pool by Rust (`ExpertPool.fill_from_safetensors`),
in parallel, converting dtype on the way. Shapes are checked against the ArchSpec before any
byte is copied, so a bad file fails with its name and the tensor at fault.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch
from safetensors import safe_open
from tqdm import tqdm

from ftrs.errors import ModelLoadError
from ftrs.models.arch import ArchSpec
from ftrs.models.experts import HostExperts
from ftrs.models.names import ExpertKey, map_hf_name

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


def expected_dense_shapes(spec: ArchSpec) -> dict[str, tuple[int, ...]]:
    s = spec
    q_out, kv_out = s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim
    shapes: dict[str, tuple[int, ...]] = {"embed": (s.vocab_size, s.hidden_size),
                                          "norm": (s.hidden_size,)}
    if not s.tie_word_embeddings:
        shapes["lm_head"] = (s.vocab_size, s.hidden_size)
    for layer in range(s.num_layers):
        p = f"{layer}."
        shapes |= {p + "input_norm": (s.hidden_size,), p + "post_norm": (s.hidden_size,),
                   p + "q": (q_out, s.hidden_size), p + "k": (kv_out, s.hidden_size),
                   p + "v": (kv_out, s.hidden_size), p + "o": (s.hidden_size, q_out)}
        if s.qk_norm:
            shapes |= {p + "q_norm": (s.head_dim,), p + "k_norm": (s.head_dim,)}
        if s.is_moe_layer(layer):
            shapes[p + "router"] = (s.num_experts, s.hidden_size)
        else:
            i = s.intermediate_size
            shapes |= {p + "gate": (i, s.hidden_size), p + "up": (i, s.hidden_size),
                       p + "down": (s.hidden_size, i)}
    return shapes


def load_safetensors(model_dir: Path, spec: ArchSpec, dtype: torch.dtype, device: torch.device,
                     progress: bool = True) -> tuple[dict[str, torch.Tensor], HostExperts | None]:
    files = checkpoint_files(model_dir)
    want = expected_dense_shapes(spec)
    optional = {f"{la}.{b}" for la in range(spec.num_layers) for b in ("q_bias", "k_bias", "v_bias")}
    if spec.tie_word_embeddings:
        optional.add("lm_head")
    dense: dict[str, torch.Tensor] = {}
    entries: list[tuple[str, str, int, int, int]] = []
    seen_experts: set[ExpertKey] = set()
    experts = HostExperts(spec, dtype) if spec.is_moe else None
    layer_index = experts.layer_index if experts else {}
    bar = tqdm(total=len(files), desc="loading weights", unit="file", disable=not progress,
               leave=False)
    for path in files:
        try:
            handle = safe_open(str(path), framework="pt")
        except Exception as e:  # safetensors raises its own error types for truncated headers
            raise ModelLoadError(str(path), f"cannot read safetensors: {e}") from e
        with handle as f:
            for name in f.keys():
                key = map_hf_name(name)
                if key is None:
                    continue
                shape = tuple(f.get_slice(name).get_shape())
                if isinstance(key, ExpertKey):
                    if experts is None or key.layer not in layer_index or not 0 <= key.expert < spec.num_experts:
                        raise ModelLoadError(str(path), f"unexpected expert tensor {name}")
                    if shape != spec.expert_shapes[key.tensor]:
                        raise ModelLoadError(str(path), f"tensor {name} has shape {list(shape)}, "
                                             f"expected {list(spec.expert_shapes[key.tensor])}")
                    entries.append((str(path), name, layer_index[key.layer], key.expert, key.tensor))
                    seen_experts.add(key)
                    continue
                if key not in want and key not in optional:
                    raise ModelLoadError(str(path), f"unexpected tensor {name} for {spec.arch}")
                if key in want and shape != want[key]:
                    raise ModelLoadError(str(path), f"tensor {name} has shape {list(shape)}, "
                                         f"expected {list(want[key])}")
                try:
                    # copy=True: never leave a weight backed by the file's pages, which the
                    # kernel may drop under memory pressure and fault back in on every step
                    dense[key] = f.get_tensor(name).to(device=device, dtype=dtype, copy=True)
                except Exception as e:
                    raise ModelLoadError(str(path), f"cannot read tensor {name}: {e}") from e
        bar.update(1)
    bar.close()
    missing = sorted(set(want) - set(dense))
    if missing:
        raise ModelLoadError(str(model_dir), f"missing tensors: {', '.join(missing[:5])}"
                             + (" ..." if len(missing) > 5 else ""))
    if experts is not None:
        need = len(spec.moe_layers) * spec.num_experts * 3
        if len(seen_experts) != need:
            raise ModelLoadError(str(model_dir),
                                 f"found {len(seen_experts)} of {need} routed-expert tensors")
        log.info("filling the expert pool: %d tensors, %.1f MiB", len(entries),
                 experts.pool.nbytes / 2**20)
        experts.pool.fill_from_safetensors(entries)
    return dense, experts
