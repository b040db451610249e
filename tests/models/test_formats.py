"""Config spellings, sharded checkpoints, on-disk dtypes, and the measured bf16 tolerance."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from ftrs.llm import LLM
from ftrs.models.arch import arch_from_config
from ftrs.models.tiny import make_tiny, tiny_config

IDS = [5, 9, 100, 200, 300, 400, 17, 33, 64, 128, 256, 7]

# Measured (seed-1 tiny checkpoints, fp32 weights run in bf16 vs fp32): max |logit diff| 0.049
# (llama), 0.049 (qwen3_moe), 0.052 (mixtral), 0.066 (qwen3), with logits up to ~3.8. On the real
# SmolLM2 GGUF it is 0.92 with logits up to 29, and the argmax agrees at 12 of 13 positions.
# The bound leaves headroom without hiding a real bug (a wrong rotary or norm gives diffs ~1).
BF16_TOL = 0.15


def test_both_config_spellings_give_the_same_spec() -> None:
    a = tiny_config("qwen3_moe")
    b = dict(a)
    b["num_local_experts"] = b.pop("num_experts")
    b["rope_theta"] = b.pop("rope_parameters")["rope_theta"]
    assert arch_from_config(a) == arch_from_config(b)
    spec = arch_from_config(a)
    assert spec.num_experts == 8 and spec.top_k == 4 and spec.moe_layers == (0, 2)
    assert spec.rope_theta == 1e6


def test_sharded_checkpoint_loads_like_single_file(tiny_models: dict[str, Path],
                                                   tmp_path: Path) -> None:
    src = tiny_models["mixtral"]
    d = tmp_path / "sharded"
    shutil.copytree(src, d)
    tensors = load_file(str(d / "model.safetensors"))
    (d / "model.safetensors").unlink()
    names = sorted(tensors)
    half = len(names) // 2
    shards = {"model-00001-of-00002.safetensors": names[:half],
              "model-00002-of-00002.safetensors": names[half:]}
    weight_map = {}
    for fname, keys in shards.items():
        save_file({k: tensors[k] for k in keys}, str(d / fname))
        weight_map |= dict.fromkeys(keys, fname)
    (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    a = LLM(str(src), kv_tokens=512).logits(IDS)
    b = LLM(str(d), kv_tokens=512).logits(IDS)
    assert torch.equal(a, b)


def test_fp16_and_bf16_on_disk_load_and_run(tmp_path: Path) -> None:
    ref = LLM(str(make_tiny("qwen3_moe", tmp_path / "f32", seed=3)), kv_tokens=512).logits(IDS)
    for dtype in (torch.float16, torch.bfloat16):
        d = make_tiny("qwen3_moe", tmp_path / str(dtype), seed=3, dtype=dtype)
        out = LLM(str(d), kv_tokens=512).logits(IDS)  # weights widened to fp32 at load
        assert out.dtype == torch.float32
        assert (out - ref).abs().max().item() < 0.2  # rounding of the stored weights only


def test_bf16_compute_within_measured_tolerance(tiny_models: dict[str, Path]) -> None:
    for arch in ("llama", "qwen3_moe"):
        f32 = LLM(str(tiny_models[arch]), kv_tokens=512, dtype="float32").logits(IDS)
        b16 = LLM(str(tiny_models[arch]), kv_tokens=512, dtype="bfloat16").logits(IDS)
        diff = (f32 - b16).abs().max().item()
        assert 0 < diff <= BF16_TOL, (arch, diff)
