"""Gated DeltaNet hybrid GGUF files (qwen3next: Qwen3-Next; qwen35moe: Qwen3.5) against
transformers.

The files are the tiny models of `tests/hybrid_models.py`, in the layout a GGUF can say (every
layer MoE, one full attention layer every 2), written as llama.cpp's converter writes them: norms
as 1 + w, the decay as -exp(A_log), the DeltaNet inputs flat (qwen3next's `ssm_ba` grouped), and
Qwen3.5's value heads in tiled order (4 value heads over 2 key heads: the order matters). The
oracle is transformers on the source checkpoint in fp64, within 1e-4 or 1.5x of its own fp32
error (as in `test_deltanet_models.py`); with the experts in Q8_0, transformers on the dequantized
experts.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

import hybrid_models
from ftrs.llm import LLM
from ftrs.models.gguf_loader import gguf_fetch_model, open_gguf
from ftrs.models.gguf_write import gguf_quantizer, keep_f32, write_gguf
from ftrs.models.load import load_model
from ftrs.models.tokenizer import Tokenizer
from ftrs.quant import QuantTensor, use_kernels
from gguf_files import llama_cpp_logits, rewrite

transformers = pytest.importorskip("transformers")
TOL = 1e-4
PEER_TOL = 1e-4  # measured 2.0e-5 (qwen3next), 2.1e-5 (qwen35moe); llama-cpp-python 0.3.36
IDS = torch.randint(3, 512, (37,), generator=torch.Generator().manual_seed(5)).tolist()


@pytest.fixture(scope="module", params=["qwen3_next", "qwen3_5_moe"])
def source(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp(request.param)
    return hybrid_models.build(request.param, root / "src", seed=2, **hybrid_models.GGUF_DELTANET)


def _write(src: Path, out: Path, ref: Path, quantize: object) -> tuple[Path, Path]:
    cfg = json.loads((src / "config.json").read_text())
    held = write_gguf(out, cfg, load_file(str(src / "model.safetensors")), quantize,  # type: ignore[arg-type]
                      Tokenizer.from_dir(src))
    shutil.copytree(src, ref)
    save_file({k: v.contiguous() for k, v in held.items()}, str(ref / "model.safetensors"))
    return out, ref


def _experts_q8(name: str, w: np.ndarray) -> tuple[str, np.ndarray]:
    return gguf_quantizer("Q8_0", min_dims=3)(name, w) if w.ndim == 3 else keep_f32(name, w)


@pytest.fixture(scope="module")
def f32(source: Path) -> tuple[Path, Path]:
    return _write(source, source.parent / "f32.gguf", source.parent / "f32_ref", keep_f32)


@pytest.fixture(scope="module")
def q8(source: Path) -> tuple[Path, Path]:
    return _write(source, source.parent / "q8.gguf", source.parent / "q8_ref", _experts_q8)


def _check(ours: torch.Tensor, ref_dir: Path) -> None:
    with torch.no_grad():
        m = hybrid_models.hf_model(ref_dir)
        fp32 = m(torch.tensor([IDS])).logits[0]
        exact = m.double()(torch.tensor([IDS])).logits[0]
    hf_err = (fp32.double() - exact).abs().max().item()
    assert ours.shape == exact.shape
    assert (ours.double() - exact).abs().max().item() <= max(TOL, 1.5 * hf_err)


def test_the_config_comes_from_the_metadata(f32: tuple[Path, Path], source: Path) -> None:
    cfg = open_gguf(f32[0]).config
    want = json.loads((source / "config.json").read_text())
    qwen35 = want["model_type"] == "qwen3_5_moe_text"
    assert cfg["model_type"] == want["model_type"]
    assert cfg["_v_heads_tiled"] == qwen35
    for key in ("layer_types", "linear_conv_kernel_dim", "linear_key_head_dim",
                "linear_value_head_dim", "linear_num_key_heads", "linear_num_value_heads",
                "moe_intermediate_size", "shared_expert_intermediate_size", "num_experts",
                "num_experts_per_tok", "head_dim", "norm_topk_prob"):
        assert cfg[key] == want[key], key
    assert cfg["partial_rotary_factor"] == want["rope_parameters"]["partial_rotary_factor"]


def test_f32_logits_match_transformers(f32: tuple[Path, Path], source: Path) -> None:
    _check(LLM(str(f32[0]), kv_tokens=1024, dtype="float32").logits(IDS), source)


def test_q8_experts_match_transformers_on_their_values(q8: tuple[Path, Path]) -> None:
    llm = LLM(str(q8[0]), kv_tokens=1024, dtype="float32")
    with use_kernels(False):
        ours = llm.logits(IDS)
    _check(ours, q8[1])
    m = load_model(str(q8[0]), torch.device("cpu"), torch.float32, progress=False)
    assert m.experts is not None
    gate = m.experts.views(m.experts.host_bytes())[1][4][0]
    assert isinstance(gate, QuantTensor) and gate.qtype == "Q8_0"


def test_fetch_model_counts_the_pools_block(q8: tuple[Path, Path]) -> None:
    fm = gguf_fetch_model(q8[0])
    m = load_model(str(q8[0]), torch.device("cpu"), torch.float32, progress=False)
    assert m.experts is not None and fm.expert_bytes == m.experts.expert_bytes
    assert (fm.num_moe_layers, fm.num_experts, fm.top_k, fm.dtype) == (5, 7, 3, "Q8_0")


@pytest.mark.parametrize("strategy", ["offload", "hybrid"])
def test_offload_of_the_gguf_equals_resident(q8: tuple[Path, Path], strategy: str) -> None:
    opts = {"kv_tokens": 1024, "dtype": "float32"}
    ref = LLM(str(q8[0]), moe_strategy="resident", **opts).logits(IDS)
    llm = LLM(str(q8[0]), moe_strategy=strategy, moe_cache_rate=0.25, **opts)
    assert torch.equal(llm.logits(IDS), ref)
    llm.close()


def test_multi_token_prediction_blocks_are_left_out(f32: tuple[Path, Path],
                                                   tmp_path: Path) -> None:
    # the converter appends the MTP block after the decoder's (block_count + 1,
    # nextn_predict_layers 1) with tensors of its own; ftrs runs the decoder's layers only
    arch = gguf.GGUFReader(str(f32[0])).fields["general.architecture"].contents()
    blocks = open_gguf(f32[0]).config["num_hidden_layers"]
    extra = {f"blk.{blocks}.attn_norm.weight": np.ones(64), f"blk.{blocks}.nextn.eh_proj.weight":
             np.zeros((64, 128)), f"blk.{blocks}.ffn_gate_inp.weight": np.zeros((64, 7))}
    with_mtp = rewrite(f32[0], tmp_path / "mtp.gguf", extra=extra,
                       fields={f"{arch}.block_count": blocks + 1,
                               f"{arch}.nextn_predict_layers": 1})
    assert open_gguf(with_mtp).config["num_hidden_layers"] == blocks
    ours = LLM(str(with_mtp), kv_tokens=1024, dtype="float32").logits(IDS)
    assert torch.equal(ours, LLM(str(f32[0]), kv_tokens=1024, dtype="float32").logits(IDS))


@pytest.mark.parametrize("arch", ["qwen3_next", "qwen3_5_moe"])
def test_llama_cpp_computes_the_same_model(arch: str, tmp_path: Path) -> None:
    """The peer on an F32 file (fp32 KV cache); where `llama-cpp-python` is installed. llama.cpp
    takes a value head as wide as a key head (true of every Qwen3-Next and Qwen3.5), so this
    model's are."""
    pytest.importorskip("llama_cpp")
    src = hybrid_models.build(arch, tmp_path / "src", seed=3, linear_value_head_dim=12,
                              **hybrid_models.GGUF_DELTANET)
    path, _ = _write(src, tmp_path / "f32.gguf", tmp_path / "ref", keep_f32)
    theirs = llama_cpp_logits(path, IDS, tmp_path)
    ours = LLM(str(path), kv_tokens=1024, dtype="float32").logits(IDS)
    assert (ours - theirs).abs().max().item() <= PEER_TOL
