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
    # GLM-4.5 ships its MTP block as layer num_hidden_layers (here 4), experts included
    from safetensors.torch import load_file, save_file

    d = shutil.copytree(models["glm"], tmp_path / "mtp")
    t = load_file(str(d / "model.safetensors"))
    t |= {k.replace("layers.3.", "layers.4."): v.clone() for k, v in t.items() if ".layers.3." in k}
    t["model.layers.4.eh_proj.weight"] = torch.zeros(48, 96)
    save_file(t, str(d / "model.safetensors"))
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
