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


def test_integer_tensor_refused_by_dtype(tiny_models: dict[str, Path], tmp_path: Path) -> None:
    for arch, name in [("llama", "model.layers.1.self_attn.q_proj.weight"),
                       ("mixtral", "model.layers.0.block_sparse_moe.experts.3.w2.weight")]:
        d = _copy(tiny_models[arch], tmp_path / arch)
        tensors = load_file(str(d / "model.safetensors"))
        tensors[name] = (tensors[name] * 100).to(torch.int32)
        save_file(tensors, str(d / "model.safetensors"))
        with pytest.raises(ModelLoadError, match=re.escape(
                f"tensor {name} has dtype I32, expected a float type (F32, F16, BF16, or the "
                "quantized formats' own dtypes")) as e:
            _load(d)
        assert e.value.path.endswith("model.safetensors")


def _with_config(src: Path, dst: Path, **changes: object) -> Path:
    d = _copy(src, dst)
    cfg = json.loads((d / "config.json").read_text())
    for k, v in changes.items():
        if v is None:
            del cfg[k]
        else:
            cfg[k] = v
    (d / "config.json").write_text(json.dumps(cfg))
    return d


def test_missing_moe_fields_are_named(tiny_models: dict[str, Path], tmp_path: Path) -> None:
    for arch, field in [("qwen3_moe", "num_experts_per_tok"), ("qwen3_moe", "num_experts"),
                        ("mixtral", "num_local_experts"), ("qwen3", "hidden_size")]:
        d = _with_config(tiny_models[arch], tmp_path / f"{arch}-{field}", **{field: None})
        with pytest.raises(ModelLoadError, match=re.escape(f"missing field {field!r} for {arch}")):
            _load(d)


def test_integer_config_fields_must_be_integers(tiny_models: dict[str, Path],
                                                tmp_path: Path) -> None:
    for i, (field, value, shown) in enumerate([("hidden_size", "64", '"64"'),
                                               ("num_experts_per_tok", True, "true"),
                                               ("num_hidden_layers", 3.0, "3.0")]):
        d = _with_config(tiny_models["qwen3_moe"], tmp_path / str(i), **{field: value})
        with pytest.raises(ModelLoadError) as e:
            _load(d)
        assert str(e.value) == (f"{d / 'config.json'}: field {field!r} must be an integer, "
                                f"got {shown}")


def test_a_directory_of_gguf_shards_names_the_file_to_pass(tmp_path: Path) -> None:
    d = tmp_path / "split"
    d.mkdir()
    for i in (2, 1, 3):
        (d / f"model-0000{i}-of-00003.gguf").write_bytes(b"")
    with pytest.raises(ModelLoadError, match=re.escape(
            f"config.json not found; {d} holds GGUF files; pass one of them: "
            f"{d / 'model-00001-of-00003.gguf'}")):
        _load(d)
    with pytest.raises(ModelLoadError, match=r"config\.json not found$"):
        _load(tmp_path)  # no GGUF there: no hint


def test_gguf_without_tokenizer_loads_for_token_ids(tmp_path: Path,
                                                    caplog: pytest.LogCaptureFixture) -> None:
    from ftrs.models.gguf_write import keep_f32, write_gguf
    from ftrs.models.tiny import tiny_config, tiny_tensors
    from ftrs.models.tokenizer import Tokenizer

    with pytest.raises(ModelLoadError, match=re.escape(
            "t.gguf: has no tokenizer (tokenizer.ggml.model missing)")):
        Tokenizer.from_gguf_fields({}, "t.gguf")
    cfg = tiny_config("llama")
    path = tmp_path / "notok.gguf"
    write_gguf(path, cfg, tiny_tensors(cfg, 0), keep_f32, dequantized=False)
    with caplog.at_level("WARNING"):
        m = load_model(str(path), CPU, torch.float32, progress=False)
    assert m.tokenizer is None and m.spec.vocab_size == cfg["vocab_size"]
    assert "has no tokenizer (tokenizer.ggml.model missing): only token-id prompts" in caplog.text


def test_a_load_error_is_not_printed_after_the_progress_bar(
        tiny_models: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    d = _copy(tiny_models["llama"], tmp_path / "m")
    tensors = load_file(str(d / "model.safetensors"))
    tensors["model.norm.weight"] = tensors["model.norm.weight"][:-1].contiguous()
    save_file(tensors, str(d / "model.safetensors"))
    try:
        load_model(str(d), CPU, torch.float32, progress=True)
    except ModelLoadError as e:  # read while the error is alive, when the CLI prints it
        assert "has shape" in str(e)
        err = capsys.readouterr().err
    else:
        pytest.fail("the bad shape loaded")
    assert "loading weights" in err  # the bar was drawn ...
    assert re.split(r"[\r\n]", err)[-1].strip() == ""  # ... and its line cleared at the error
