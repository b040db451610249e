"""Sizes and counts of a config that are not at least 1 (zero heads, zero layers, a negative
hidden size, a context of 0 tokens) are refused when the config is read, in a config.json or in
GGUF metadata, with the file and the field named: not a ZeroDivisionError, a model that fails
on its first step, or one that refuses every request. `upcycle` refuses such a source too."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch

from ftrs.errors import ModelLoadError
from ftrs.models.arch import arch_from_config, load_arch
from ftrs.models.gguf_loader import open_gguf
from ftrs.models.gguf_write import keep_f32, write_gguf
from ftrs.models.load import load_model
from ftrs.models.tiny import tiny_config, tiny_tensors, tiny_tokenizer
from ftrs.models.upcycle import upcycle
from gguf_files import rewrite


def _with_config(src: Path, dst: Path, **changes: object) -> Path:
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps(cfg | changes))
    return dst


@pytest.mark.parametrize(("field", "value"), [
    ("num_attention_heads", 0), ("num_hidden_layers", 0), ("num_hidden_layers", -1),
    ("hidden_size", -64), ("num_key_value_heads", 0), ("head_dim", 0), ("vocab_size", 0),
    ("max_position_embeddings", 0), ("intermediate_size", 0)])
def test_a_config_json_count_below_one_names_file_and_field(
        tiny_models: dict[str, Path], tmp_path: Path, field: str, value: int) -> None:
    arch = "mixtral" if field == "num_hidden_layers" and value < 0 else "llama"
    d = _with_config(tiny_models[arch], tmp_path / "m", **{field: value})
    with pytest.raises(ModelLoadError) as e:
        load_model(str(d), torch.device("cpu"), torch.float32, progress=False)
    assert str(e.value) == f"{d / 'config.json'}: field {field!r} must be >= 1, got {value}"


def test_a_qwen3_moe_expert_width_below_one_is_named(tiny_models: dict[str, Path],
                                                    tmp_path: Path) -> None:
    d = _with_config(tiny_models["qwen3_moe"], tmp_path / "m", moe_intermediate_size=0)
    with pytest.raises(ModelLoadError, match="field 'moe_intermediate_size' must be >= 1, got 0"):
        load_arch(d)


def test_a_config_built_by_a_caller_is_held_to_the_same(tiny_models: dict[str, Path]) -> None:
    cfg = json.loads((tiny_models["llama"] / "config.json").read_text())
    with pytest.raises(ModelLoadError, match="field 'num_attention_heads' must be >= 1, got 0"):
        arch_from_config(cfg | {"num_attention_heads": 0, "head_dim": None}, "cfg")


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    cfg = tiny_config("llama")
    path = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    write_gguf(path, cfg, tiny_tensors(cfg, 0), keep_f32,
               tokenizer=tiny_tokenizer(cfg["vocab_size"]), dequantized=False)
    return path


@pytest.mark.parametrize("key", [
    "attention.head_count", "attention.head_count_kv", "block_count", "embedding_length",
    "context_length", "feed_forward_length"])
def test_a_gguf_count_of_zero_names_file_and_key(tiny_gguf: Path, tmp_path: Path,
                                                 key: str) -> None:
    path = rewrite(tiny_gguf, tmp_path / "zero.gguf", fields={f"llama.{key}": 0})
    with pytest.raises(ModelLoadError) as e:
        open_gguf(path)
    assert str(e.value) == f"{path}: GGUF metadata llama.{key} must be >= 1, got 0"


def test_a_gguf_whose_layers_are_all_next_token_blocks_is_refused(tiny_gguf: Path,
                                                                  tmp_path: Path) -> None:
    path = rewrite(tiny_gguf, tmp_path / "mtp.gguf", fields={"llama.nextn_predict_layers": 3})
    with pytest.raises(ModelLoadError, match=re.escape(
            "llama.block_count less llama.nextn_predict_layers 3 must be >= 1, got 0")):
        open_gguf(path)


def test_upcycle_refuses_a_source_without_heads_or_layers(
        tiny_gguf: Path, tiny_models: dict[str, Path], tmp_path: Path) -> None:
    sources = [rewrite(tiny_gguf, tmp_path / "h0.gguf", fields={"llama.attention.head_count": 0}),
               rewrite(tiny_gguf, tmp_path / "b0.gguf", fields={"llama.block_count": 0}),
               _with_config(tiny_models["llama"], tmp_path / "l0", num_hidden_layers=0)]
    for i, src in enumerate(sources):
        dst = tmp_path / f"up{i}"
        with pytest.raises(ModelLoadError, match="must be >= 1, got 0"):
            upcycle(src, dst, 4, 2)
        assert not dst.exists()
