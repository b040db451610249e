"""GGUF files of the i-quants of three bits and less (IQ1_S, IQ1_M, IQ2_XXS, IQ2_XS, IQ2_S,
IQ3_XXS, IQ3_S; unsloth's dynamic and llama.cpp's IQ1/IQ2/IQ3 files mix them): loaded with
the experts kept as the file's blocks, computed through the torch dequantizers and the Rust
kernels, against transformers on the values the file holds (the `gguf` package's dequantizer).
llama.cpp's own decode is the peer in tests/quant/test_iquant.py; its logits on this file are
no oracle: it rounds the activations to 8 bits for its integer dot products, which on random
1- to 3-bit weights moves them by 0.57 (of 6.1; measured with llama-cpp-python 0.3.36)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ftrs.llm import LLM
from ftrs.models.load import load_model
from ftrs.quant import QuantTensor, kernel_types, use_kernels
from ftrs.quant.iquant import IQ_TYPES
from ftrs.sampling import SamplingParams
from quant_models import LOW_IQ_CONFIG, LOW_IQ_TYPES, build, strategy_logits_equal_resident

transformers = pytest.importorskip("transformers")
IDS = [3, 17, 250, 41, 99, 500, 7, 8, 311, 42, 42, 42, 130, 64, 255, 1, 300, 12, 77, 5]
TOL = 1e-4
#: The integer kernels' activation rounding through three layers: measured 2.5e-4 on logits
#: up to 6.1 (AVX-512 host, 2026-12-07), bound at 4x that
KERNEL_TOL = 1e-3


@pytest.fixture(scope="module")
def iq_model(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    return build("qwen3_moe", LOW_IQ_TYPES, tmp_path_factory.mktemp("iq"), config=LOW_IQ_CONFIG)


def test_every_low_iquant_is_in_the_file(iq_model: tuple[Path, Path]) -> None:
    import gguf

    held = {t.tensor_type.name for t in gguf.GGUFReader(str(iq_model[0])).tensors}
    assert set(IQ_TYPES) <= held


def test_logits_match_transformers_on_the_files_values(iq_model: tuple[Path, Path]) -> None:
    gguf_path, ref_dir = iq_model
    llm = LLM(str(gguf_path), kv_tokens=1024, dtype="float32")
    with use_kernels(False):
        ours = llm.logits(IDS)
    llm.close()
    m = transformers.AutoModelForCausalLM.from_pretrained(str(ref_dir), dtype=torch.float32)
    with torch.no_grad():
        ref = m.eval()(torch.tensor([IDS])).logits[0].float()
    assert ours.shape == ref.shape == (len(IDS), 512)
    assert (ours - ref).abs().max().item() <= TOL


def test_experts_stay_the_files_blocks(iq_model: tuple[Path, Path]) -> None:
    m = load_model(str(iq_model[0]), torch.device("cpu"), torch.float32, progress=False)
    assert m.experts is not None and m.experts.quantized
    views = m.experts.views(m.experts.host_bytes())
    want = [("IQ2_XXS", "IQ2_XXS", "IQ3_S"), ("IQ2_XS", "IQ2_XS", "IQ3_XXS"),
            ("IQ1_S", "IQ1_S", "IQ2_S")]
    for layer, types in enumerate(want):
        got = views[layer][5]
        assert all(isinstance(w, QuantTensor) for w in got)
        assert tuple(w.qtype for w in got if isinstance(w, QuantTensor)) == types
    # 256x256 matrices: 66+66+110, 74+74+98, 50+50+82 bytes a 256 values, 8 experts a layer
    assert m.experts.payload_bytes() == 8 * 256 * (242 + 246 + 182)
    assert set(IQ_TYPES) <= kernel_types()


def test_kernel_path_agrees_with_the_reference_path(iq_model: tuple[Path, Path]) -> None:
    """The Rust kernels hold the same weights (bit for bit: tests/quant/test_kernels.py) and
    meet the activations as 15-bit integers per 32-block (AVX2; the portable kernel in fp32):
    the same logits within that rounding, the same greedy tokens."""
    llm = LLM(str(iq_model[0]), kv_tokens=1024, dtype="float32")
    params = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)
    with use_kernels(False):
        ref_logits = llm.logits(IDS)
        ref = llm.generate([IDS], params)[0].token_ids
    with use_kernels(True):
        ours = llm.logits(IDS)
        kern = llm.generate([IDS], params)[0].token_ids
    llm.close()
    assert (ours - ref_logits).abs().max().item() <= KERNEL_TOL
    assert kern == ref


@pytest.mark.parametrize("strategy", ["offload", "hybrid"])
def test_offload_and_hybrid_equal_resident(iq_model: tuple[Path, Path], strategy: str) -> None:
    assert strategy_logits_equal_resident(iq_model[0], strategy, IDS)
