"""Bad checkpoints fail with a ModelLoadError naming the file and the problem; the CLI prints one line."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from ftrs.errors import ModelLoadError
from ftrs.models.load import load_model

CPU = torch.device("cpu")


def _load(path: Path) -> None:
    load_model(str(path), CPU, torch.float32, progress=False)


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def test_missing_directory(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="no such file or directory") as e:
        _load(tmp_path / "nope")
    assert e.value.path.endswith("nope")


def test_unsupported_architecture(tiny_models: dict[str, Path], tmp_path: Path) -> None:
    d = _copy(tiny_models["llama"], tmp_path / "m")
    cfg = json.loads((d / "config.json").read_text())
    cfg["model_type"] = "gpt_neox"
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match="unsupported architecture 'gpt_neox'") as e:
        _load(d)
    assert e.value.path.endswith("config.json")


def test_truncated_safetensors(tiny_models: dict[str, Path], tmp_path: Path) -> None:
    d = _copy(tiny_models["mixtral"], tmp_path / "m")
    f = d / "model.safetensors"
    data = f.read_bytes()
    f.write_bytes(data[: len(data) // 2])
    with pytest.raises(ModelLoadError) as e:
        _load(d)
    assert "model.safetensors" in e.value.path


def test_wrong_shape(tiny_models: dict[str, Path], tmp_path: Path) -> None:
    for arch, name in [("llama", "model.layers.1.self_attn.q_proj.weight"),
                       ("mixtral", "model.layers.0.block_sparse_moe.experts.3.w2.weight")]:
        d = _copy(tiny_models[arch], tmp_path / arch)
        tensors = load_file(str(d / "model.safetensors"))
        tensors[name] = tensors[name][:-1].contiguous()
        save_file(tensors, str(d / "model.safetensors"))
        with pytest.raises(ModelLoadError, match=re.escape(f"tensor {name} has shape")):
            _load(d)


def test_missing_tensor(tiny_models: dict[str, Path], tmp_path: Path) -> None:
    d = _copy(tiny_models["qwen3"], tmp_path / "m")
    tensors = load_file(str(d / "model.safetensors"))
    del tensors["model.layers.2.self_attn.k_norm.weight"]
    save_file(tensors, str(d / "model.safetensors"))
    with pytest.raises(ModelLoadError, match=r"missing tensors: 2\.k_norm"):
        _load(d)


def test_gguf_with_unsupported_quantization(tmp_path: Path) -> None:
    import gguf

    path = tmp_path / "tq2.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(1)
    w.add_context_length(64)
    w.add_embedding_length(32)
    w.add_feed_forward_length(64)
    w.add_head_count(4)
    w.add_head_count_kv(4)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_tokenizer_model("gpt2")
    w.add_token_list([chr(ord("a") + i) for i in range(16)])
    w.add_token_types([1] * 16)
    w.add_token_merges([])
    rows, cols = 16, 256  # TQ2_0 (ternary) packs 256 weights into 66 bytes
    raw = np.zeros((rows, cols // 256 * 66), dtype=np.uint8)
    w.add_tensor("token_embd.weight", raw,
                 raw_dtype=gguf.GGMLQuantizationType.TQ2_0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ModelLoadError,
                       match=r"tensor token_embd\.weight uses unsupported quantization TQ2_0") as e:
        _load(path)
    assert e.value.path == str(path)


def test_cli_prints_one_line_not_a_traceback(tmp_path: Path) -> None:
    r = subprocess.run([sys.executable, "-m", "ftrs", "generate", "--model", str(tmp_path / "x"),
                        "hello"], capture_output=True, text=True, timeout=120)
    assert r.returncode == ModelLoadError.exit_code
    assert "Traceback" not in r.stderr
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert lines == [f"ftrs: error: {tmp_path / 'x'}: no such file or directory"]
