"""minimax_m2 (MiniMax-M2, M2.1) against transformers on tiny checkpoints it wrote
(`tests/deepseek_models.py`, `MINIMAX`: 6 experts, top-3 by sigmoid scores plus a correction
bias, every layer routed; 4 query heads over 2 kv heads of 16 channels, q/k norms over all
heads' channels, rotary on the first 8 or on all 16), fp32: the logits of a 57-token prompt
within 1e-4, an incremental decode against the full forward, offload and hybrid equal to
resident."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import deepseek_models
from decode_checks import record_logits
from ftrs.errors import ModelLoadError
from ftrs.llm import LLM
from ftrs.models.arch import arch_from_config
from ftrs.sampling import SamplingParams

pytest.importorskip("transformers.models.minimax_m2")
TOL = 1e-4
IDS = [(i * 37 + 11) % 509 + 3 for i in range(57)]
VARIANTS = {"partial_rotary": {}, "full_rotary": {"rotary_dim": 16}}


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("minimax_m2")
    return {name: deepseek_models.build(root / name, arch="minimax_m2", **changes)
            for name, changes in VARIANTS.items()}


def ref_logits(path: Path, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return deepseek_models.hf_model(path)(torch.tensor([ids])).logits[0].float()


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_logits_match_transformers(models: dict[str, Path], variant: str) -> None:
    llm = LLM(str(models[variant]), kv_tokens=1024, dtype="float32")
    ours = llm.logits(IDS)
    ref = ref_logits(models[variant], IDS)
    assert ref.abs().max().item() > 1.0
    assert (ours - ref).abs().max().item() <= TOL
    spec = llm.engine.spec
    assert (spec.qk_norm_full, spec.qk_norm, spec.moe_layers) == (True, False, (0, 1, 2))
    llm.close()


def test_incremental_decode_matches_full_forward(models: dict[str, Path],
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    llm = LLM(str(models["partial_rotary"]), kv_tokens=1024, dtype="float32",
              max_prefill_length=16)
    seen = record_logits(llm, monkeypatch)
    out = llm.generate([IDS[:40]], SamplingParams(max_tokens=18, temperature=0,
                                                  ignore_eos=True))[0].token_ids
    prefill_chunks = len(seen) - 17
    ref = ref_logits(models["partial_rotary"], IDS[:40] + out[:17])
    for step, s in enumerate(seen[prefill_chunks - 1:]):
        assert (s[-1] - ref[39 + step]).abs().max().item() <= TOL, step
    llm.close()


@pytest.mark.parametrize("strategy", ["offload", "hybrid"])
def test_offloaded_experts_equal_resident(models: dict[str, Path], strategy: str) -> None:
    from quant_models import strategy_logits_equal_resident

    assert strategy_logits_equal_resident(models["partial_rotary"], strategy, IDS)


@pytest.mark.parametrize(("change", "message"), [
    ({"scoring_func": "softmax"}, "sigmoid scores"),
    ({"shared_intermediate_size": 64}, "shared expert"),
    ({"qk_norm_type": "per_head"}, "qk_norm_type 'per_head'"),
    ({"rotary_dim": 15}, "rotary_dim 15"),
])
def test_a_config_that_cannot_run_is_refused_by_name(change: dict[str, object],
                                                     message: str) -> None:
    cfg = deepseek_models.MINIMAX | {"model_type": "minimax_m2"} | change
    with pytest.raises(ModelLoadError, match=message):
        arch_from_config(cfg, "config.json")


# --- GGUF (`minimax-m2`, as llama.cpp's converter writes it) -----------------------------

def _gguf(src: Path, out: Path) -> Path:
    import json

    from safetensors.torch import load_file

    from ftrs.models.gguf_write import keep_f32, write_gguf
    from ftrs.models.tokenizer import Tokenizer

    cfg = json.loads((src / "config.json").read_text())
    write_gguf(out, cfg, load_file(str(src / "model.safetensors")), keep_f32,
               Tokenizer.from_dir(src))
    return out


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_a_gguf_file_runs_as_its_source(models: dict[str, Path], variant: str,
                                        tmp_path: Path) -> None:
    from ftrs.models.gguf_loader import open_gguf

    path = _gguf(models[variant], tmp_path / "f32.gguf")
    cfg = open_gguf(path).config
    assert (cfg["model_type"], cfg["rotary_dim"], cfg["num_local_experts"], cfg["use_qk_norm"]) \
        == ("minimax_m2", 8 if variant == "partial_rotary" else 16, 6, True)
    ours = LLM(str(path), kv_tokens=1024, dtype="float32").logits(IDS)
    assert (ours - ref_logits(models[variant], IDS)).abs().max().item() <= TOL


def test_llama_cpp_computes_the_same_gguf(models: dict[str, Path], tmp_path: Path) -> None:
    """The peer on the F32 file (fp32 KV cache), where `llama-cpp-python` is installed."""
    pytest.importorskip("llama_cpp")
    from gguf_files import llama_cpp_logits

    path = _gguf(models["partial_rotary"], tmp_path / "f32.gguf")
    ours = LLM(str(path), kv_tokens=1024, dtype="float32").logits(IDS)
    assert (ours - llama_cpp_logits(path, IDS, tmp_path)).abs().max().item() <= 1e-4
