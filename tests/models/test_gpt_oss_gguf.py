"""gpt-oss GGUF files against transformers.

The files are tiny random gpt_oss checkpoints (`tests/gpt_oss_models.py`, with the layer pattern
and clamp a GGUF can say) written as llama.cpp's converter writes them: F32, and MXFP4 experts
beside Q8_0 attention. The oracle is transformers on the source checkpoint's own config with the
weights the file holds (dequantized by the `gguf` package): a config read wrongly from the
metadata (window, layer pattern, YaRN) or a tensor mapped wrongly changes the logits.
"""

from __future__ import annotations

import importlib
import shutil
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch

import gpt_oss_models
from ftrs.errors import ModelLoadError
from ftrs.llm import LLM
from ftrs.models.gguf_loader import gguf_fetch_model, open_gguf
from ftrs.models.gguf_write import gguf_quantizer, keep_f32
from ftrs.models.load import load_model
from ftrs.quant import QuantTensor, use_kernels
from ftrs.quant.matmul import kernel_types
from ftrs.sampling import SamplingParams
from gguf_files import llama_cpp_logits, rewrite

transformers = pytest.importorskip("transformers")
TOL = 1e-4
# llama.cpp on the MXFP4 file (Q8_0 attention) rounds every activation block to Q8_0; measured
# per position max |logit diff| with ftrs: median 0.067, 0.04-0.11 up to position 29, where a
# router near-tie flips one expert (1.79 there, 0.12-0.72 after); the same top token at 39 of
# 41 positions. A wrong block layout is off by O(1) from position 0.
PEER_MXFP4_MEDIAN = 0.15
IDS = torch.randint(3, gpt_oss_models.VOCAB, (41,),
                    generator=torch.Generator().manual_seed(11)).tolist()


def _mxfp4_experts(name: str, w: np.ndarray) -> tuple[str, np.ndarray]:
    """MXFP4 expert matrices, Q8_0 attention projections, F32 for the rest (as the published
    gpt-oss GGUFs mix them)."""
    if w.ndim == 3:
        return gguf_quantizer("MXFP4", min_dims=3)(name, w)
    if name.endswith("_proj.weight") and ".self_attn." in name:
        return gguf_quantizer("Q8_0")(name, w)
    return keep_f32(name, w)


@pytest.fixture(scope="module")
def source(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("gpt_oss_gguf")
    return gpt_oss_models.build(root / "src", seed=3, **gpt_oss_models.GGUF_EXPRESSIBLE)


@pytest.fixture(scope="module")
def f32(source: Path) -> tuple[Path, Path]:
    return gpt_oss_models.to_gguf(source, source.parent / "f32.gguf", source.parent / "f32_ref",
                                  keep_f32)


@pytest.fixture(scope="module")
def mxfp4(source: Path) -> tuple[Path, Path]:
    return gpt_oss_models.to_gguf(source, source.parent / "mxfp4.gguf",
                                  source.parent / "mxfp4_ref", _mxfp4_experts)


def hf_logits(ref_dir: Path) -> torch.Tensor:
    m = transformers.AutoModelForCausalLM.from_pretrained(str(ref_dir), dtype=torch.float32)
    with torch.no_grad():
        return m.eval()(torch.tensor([IDS])).logits[0].float()


def test_the_config_comes_from_the_metadata(f32: tuple[Path, Path]) -> None:
    cfg = open_gguf(f32[0]).config
    assert cfg["model_type"] == "gpt_oss"
    assert cfg["layer_types"] == gpt_oss_models.GGUF_EXPRESSIBLE["layer_types"]
    assert (cfg["sliding_window"], cfg["head_dim"], cfg["intermediate_size"]) == (9, 20, 64)
    assert (cfg["num_local_experts"], cfg["num_experts_per_tok"]) == (7, 3)
    assert cfg["rope_scaling"] == {"rope_type": "yarn", "factor": 8.0, "beta_fast": 32.0,
                                   "beta_slow": 1.0, "original_max_position_embeddings": 64,
                                   "truncate": False}


def test_f32_logits_match_transformers(f32: tuple[Path, Path], source: Path) -> None:
    ours = LLM(str(f32[0]), kv_tokens=1024, dtype="float32").logits(IDS)
    ref = hf_logits(source)  # F32 holds the source's weights exactly
    assert ours.shape == ref.shape == (len(IDS), gpt_oss_models.VOCAB)
    assert (ours - ref).abs().max().item() <= TOL


def test_mxfp4_reference_path_matches_transformers(mxfp4: tuple[Path, Path]) -> None:
    llm = LLM(str(mxfp4[0]), kv_tokens=1024, dtype="float32")
    with use_kernels(False):
        ours = llm.logits(IDS)
    assert (ours - hf_logits(mxfp4[1])).abs().max().item() <= TOL
    llm.close()


def test_mxfp4_experts_are_the_files_bytes(mxfp4: tuple[Path, Path]) -> None:
    m = load_model(str(mxfp4[0]), torch.device("cpu"), torch.float32, progress=False)
    assert m.experts is not None
    reader = gguf.GGUFReader(str(mxfp4[0]))
    file = {t.name: np.asarray(t.data) for t in reader.tensors}
    views = m.experts.views(m.experts.host_bytes())
    for layer, expert in ((0, 0), (1, 6), (2, 3)):
        gate, up, down, b_gate, b_up, b_down = views[layer][expert]
        for w, part in ((gate, "gate"), (up, "up"), (down, "down")):
            assert isinstance(w, QuantTensor) and w.qtype == "MXFP4"
            want = file[f"blk.{layer}.ffn_{part}_exps.weight"][expert].reshape(-1)
            assert np.array_equal(w.data.numpy(), want)
        for b, part in ((b_gate, "gate"), (b_up, "up"), (b_down, "down")):
            want = file[f"blk.{layer}.ffn_{part}_exps.bias"][expert]
            assert np.array_equal(b.reshape(-1).numpy(), want)
    assert isinstance(m.dense["0.q"], QuantTensor) and m.dense["0.q"].qtype == "Q8_0"


def test_mxfp4_kernel_path_greedy_agrees_with_reference(mxfp4: tuple[Path, Path],
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    assert {"MXFP4", "Q8_0"} <= set(kernel_types())
    quant_matmul = importlib.import_module("ftrs.quant.matmul")
    kernel_matmul = quant_matmul._kernel_matmul
    seen: set[str] = set()

    def spy(x: torch.Tensor, w: QuantTensor) -> torch.Tensor:
        seen.add(w.qtype)
        return kernel_matmul(x, w)

    core = quant_matmul._core_module()
    kernel_matmuls = core.quant_matmuls

    def spy_many(x: Any, calls: list[tuple[Any, ...]], cols: int) -> None:  # q, k, v in one
        seen.update(c[0] for c in calls)
        kernel_matmuls(x, calls, cols)

    monkeypatch.setattr(quant_matmul, "_kernel_matmul", spy)
    monkeypatch.setattr(core, "quant_matmuls", spy_many)
    llm = LLM(str(mxfp4[0]), kv_tokens=1024, dtype="float32")
    params = SamplingParams(max_tokens=48, temperature=0, ignore_eos=True)
    with use_kernels(False):
        ref = llm.generate([IDS], params)[0].token_ids
    assert not seen
    with use_kernels(True):
        ours = llm.generate([IDS], params)[0].token_ids
    assert {"MXFP4", "Q8_0"} <= seen
    same = sum(a == b for a, b in zip(ours, ref))
    assert len(ours) == len(ref) == 48 and same >= 0.95 * 48, (same, ours, ref)
    llm.close()


@pytest.mark.parametrize("strategy", ["offload", "hybrid"])
def test_offload_of_the_gguf_equals_resident(mxfp4: tuple[Path, Path], strategy: str) -> None:
    opts = {"kv_tokens": 1024, "dtype": "float32"}
    ref = LLM(str(mxfp4[0]), moe_strategy="resident", **opts).logits(IDS)
    llm = LLM(str(mxfp4[0]), moe_strategy=strategy, moe_cache_rate=0.25, **opts)
    assert torch.equal(llm.logits(IDS), ref)
    llm.close()


def test_fetch_model_counts_the_pools_block(mxfp4: tuple[Path, Path]) -> None:
    fm = gguf_fetch_model(mxfp4[0])
    m = load_model(str(mxfp4[0]), torch.device("cpu"), torch.float32, progress=False)
    assert m.experts is not None
    assert fm.expert_bytes == m.experts.expert_bytes
    assert (fm.num_moe_layers, fm.num_experts, fm.top_k) == (3, 7, 3)


def test_a_missing_expert_bias_is_refused(f32: tuple[Path, Path], tmp_path: Path) -> None:
    bad = rewrite(f32[0], tmp_path / "bad.gguf", drop="blk.1.ffn_up_exps.bias")
    with pytest.raises(ModelLoadError, match=r"layer 1: found 5 of 6 expert tensors"):
        load_model(str(bad), torch.device("cpu"), torch.float32, progress=False)


def test_an_unknown_rope_scaling_is_refused(f32: tuple[Path, Path], tmp_path: Path) -> None:
    bad = rewrite(f32[0], tmp_path / "bad.gguf", fields={"gpt-oss.rope.scaling.type": "longrope"})
    with pytest.raises(ModelLoadError, match="unsupported GGUF rope scaling 'longrope'"):
        open_gguf(bad)


@pytest.mark.parametrize("name", ["f32", "mxfp4"])
def test_llama_cpp_computes_the_same_model(name: str, f32: tuple[Path, Path],
                                           mxfp4: tuple[Path, Path], tmp_path: Path,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """The peer reads the file as ftrs does, but for one choice: llama.cpp rounds YaRN's ramp
    ends to whole dimensions (`truncate: true` in HF's terms) for every model, while gpt-oss
    was trained without that rounding (its config says `truncate: false`, which ftrs follows:
    transformers is the oracle). With the rounding put back, the logits agree to fp32 noise
    (F32 file) and to the peer's rounding of activations (MXFP4, `PEER_MXFP4_MEDIAN`); without
    it they do not. Runs where `llama-cpp-python` is installed (the `bench` extra)."""
    pytest.importorskip("llama_cpp")
    path = {"f32": f32, "mxfp4": mxfp4}[name][0]
    theirs = llama_cpp_logits(path, IDS, tmp_path)

    if name == "f32":  # the rounding is not a detail
        ours = LLM(str(path), kv_tokens=1024, dtype="float32").logits(IDS)
        assert (ours - theirs).abs().max().item() > 0.5

    import ftrs.models.gguf_loader as loader

    config = loader.gguf_config

    def rounded(*args: object) -> dict[str, object]:
        cfg = config(*args)  # type: ignore[arg-type]  # the loader's own arguments
        cfg["rope_scaling"]["truncate"] = True
        return cfg

    monkeypatch.setattr(loader, "gguf_config", rounded)
    ours = LLM(str(path), kv_tokens=1024, dtype="float32").logits(IDS)
    per_position = (ours - theirs).abs().amax(dim=1)
    if name == "f32":
        assert per_position.max().item() <= 1e-4
    else:
        assert per_position.median().item() <= PEER_MXFP4_MEDIAN
        assert (ours.argmax(1) == theirs.argmax(1)).float().mean().item() >= 0.9


def test_the_rewrite_helper_keeps_a_loadable_file(f32: tuple[Path, Path], tmp_path: Path) -> None:
    # the refusals above come from the edit, not from the copy
    same = rewrite(f32[0], tmp_path / "same.gguf")
    assert open_gguf(same).config == open_gguf(f32[0]).config
    shutil.rmtree(tmp_path, ignore_errors=True)
