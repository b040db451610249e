"""glm4_moe (GLM-4.5, 4.6, 4.7, 4.5-Air) against transformers on tiny checkpoints it wrote
(`tests/deepseek_models.py`, `GLM`: 6 routed experts in 3 groups, top-3, one shared expert, the
first layer dense, 4 query heads over 2 kv heads of 16 channels with q/k/v biases, q/k norms and
rotary on the first 8), fp32: the logits of a 57-token prompt within 1e-4, an incremental decode
against transformers' full forward, offload and hybrid equal to resident."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

import deepseek_models
from decode_checks import record_logits
from ftrs.errors import ModelLoadError
from ftrs.llm import LLM
from ftrs.models.arch import arch_from_config
from ftrs.sampling import SamplingParams

pytest.importorskip("transformers.models.glm4_moe")
TOL = 1e-4
IDS = [(i * 37 + 11) % 509 + 3 for i in range(57)]
#: GLM-4.5-Air's routing (one group, no scaling) and its attention without q/k norms
VARIANTS = {"glm": {}, "no_qk_norm": {"use_qk_norm": False},
            "air_routing": {"n_group": 1, "topk_group": 1, "routed_scaling_factor": 1.0}}


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("glm4_moe")
    return {name: deepseek_models.build(root / name, arch="glm4_moe", **changes)
            for name, changes in VARIANTS.items()}


def ref_logits(path: Path, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return deepseek_models.hf_model(path)(torch.tensor([ids])).logits[0].float()


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_logits_match_transformers(models: dict[str, Path], variant: str) -> None:
    llm = LLM(str(models[variant]), kv_tokens=1024, dtype="float32")
    ours = llm.logits(IDS)
    ref = ref_logits(models[variant], IDS)
    assert ours.shape == ref.shape == (57, 512)
    assert ref.abs().max().item() > 1.0
    assert (ours - ref).abs().max().item() <= TOL
    spec = llm.engine.spec
    assert (spec.rotary_dim, spec.qk_norm, spec.router) == (
        8, variant != "no_qk_norm", "grouped_sigmoid")
    llm.close()


def test_incremental_decode_matches_full_forward(models: dict[str, Path],
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    llm = LLM(str(models["glm"]), kv_tokens=1024, dtype="float32", max_prefill_length=16)
    seen = record_logits(llm, monkeypatch)
    out = llm.generate([IDS[:40]], SamplingParams(max_tokens=18, temperature=0,
                                                  ignore_eos=True))[0].token_ids
    prefill_chunks = len(seen) - 17
    assert prefill_chunks >= 1 and len(out) == 18
    ref = ref_logits(models["glm"], IDS[:40] + out[:17])
    for step, s in enumerate(seen[prefill_chunks - 1:]):
        assert (s[-1] - ref[39 + step]).abs().max().item() <= TOL, step
    llm.close()


@pytest.mark.parametrize("strategy", ["offload", "hybrid"])
def test_offloaded_experts_equal_resident(models: dict[str, Path], strategy: str) -> None:
    from quant_models import strategy_logits_equal_resident

    assert strategy_logits_equal_resident(models["glm"], strategy, IDS)


def test_the_multi_token_prediction_layer_is_left_out(models: dict[str, Path],
                                                       tmp_path: Path) -> None:
    from deepseek_models import with_mtp_layer

    d = with_mtp_layer(models["glm"], tmp_path / "mtp")
    with_mtp = LLM(str(d), kv_tokens=1024, dtype="float32").logits(IDS)
    assert torch.equal(with_mtp, LLM(str(models["glm"]), kv_tokens=1024,
                                     dtype="float32").logits(IDS))


@pytest.mark.parametrize(("change", "message"), [
    ({"n_group": 4}, "6 experts in 4 groups"),
    ({"topk_group": 4}, "top-4 groups"),
    ({"partial_rotary_factor": 0.05}, "partial_rotary_factor 0.05"),
    ({"n_routed_experts": 0}, "positive 'n_routed_experts'"),
])
def test_a_config_that_cannot_run_is_refused_by_name(change: dict[str, object],
                                                     message: str) -> None:
    cfg = deepseek_models.GLM | {"model_type": "glm4_moe"} | change
    with pytest.raises(ModelLoadError, match=message):
        arch_from_config(cfg, "config.json")


# --- GGUF (`glm4moe`, as llama.cpp's converter writes it) ---------------------------------

def _gguf(src: Path, out: Path, quantize: object = None) -> dict[str, torch.Tensor]:
    import json

    from safetensors.torch import load_file

    from ftrs.models.gguf_write import keep_f32, write_gguf
    from ftrs.models.tokenizer import Tokenizer

    cfg = json.loads((src / "config.json").read_text())
    return write_gguf(out, cfg, load_file(str(src / "model.safetensors")),
                      quantize or keep_f32, Tokenizer.from_dir(src))  # type: ignore[arg-type]


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_a_gguf_file_runs_as_its_source(models: dict[str, Path], variant: str,
                                        tmp_path: Path) -> None:
    import json

    from ftrs.models.gguf_loader import open_gguf

    path = tmp_path / "f32.gguf"
    _gguf(models[variant], path)
    cfg, src = open_gguf(path).config, json.loads((models[variant] / "config.json").read_text())
    keys = ("n_routed_experts", "n_shared_experts", "num_experts_per_tok", "n_group",
            "topk_group", "first_k_dense_replace", "routed_scaling_factor", "norm_topk_prob",
            "use_qk_norm", "attention_bias", "num_key_value_heads", "head_dim")
    assert {k: cfg[k] for k in keys} == {k: src[k] for k in keys}
    assert cfg["model_type"] == "glm4_moe" and cfg["partial_rotary_factor"] == 0.5
    ours = LLM(str(path), kv_tokens=1024, dtype="float32").logits(IDS)
    assert (ours - ref_logits(models[variant], IDS)).abs().max().item() <= TOL


def test_gguf_q8_experts_match_transformers_on_their_values(tmp_path: Path) -> None:
    import numpy as np
    from safetensors.torch import save_file

    from ftrs.models.gguf_write import gguf_quantizer, keep_f32
    from ftrs.quant import use_kernels

    src = deepseek_models.build(tmp_path / "src", seed=4, arch="glm4_moe", hidden_size=64,
                                moe_intermediate_size=32, intermediate_size=64)

    def experts_q8(name: str, w: np.ndarray) -> tuple[str, np.ndarray]:
        return gguf_quantizer("Q8_0", min_dims=3)(name, w) if w.ndim == 3 else keep_f32(name, w)

    held = _gguf(src, tmp_path / "q8.gguf", experts_q8)
    ref = shutil.copytree(src, tmp_path / "ref")
    save_file({k: v.contiguous() for k, v in held.items()}, str(ref / "model.safetensors"))
    llm = LLM(str(tmp_path / "q8.gguf"), kv_tokens=1024, dtype="float32")
    with use_kernels(False):  # the Rust kernels round activations to int8 digits
        ours = llm.logits(IDS)
    assert (ours - ref_logits(ref, IDS)).abs().max().item() <= TOL
    assert (ours - ref_logits(src, IDS)).abs().max().item() > 10 * TOL  # Q8_0 changed them
    llm.close()


def test_llama_cpp_computes_the_same_gguf(models: dict[str, Path], tmp_path: Path) -> None:
    """The peer on the F32 file (fp32 KV cache), where `llama-cpp-python` is installed."""
    pytest.importorskip("llama_cpp")
    from gguf_files import llama_cpp_logits

    path = tmp_path / "f32.gguf"
    _gguf(models["glm"], path)
    ours = LLM(str(path), kv_tokens=1024, dtype="float32").logits(IDS)
    assert (ours - llama_cpp_logits(path, IDS, tmp_path)).abs().max().item() <= 1e-4
