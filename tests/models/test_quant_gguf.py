"""Quantized GGUF MoE checkpoints (qwen3moe, Mixtral-style llama) against transformers.

Each test model is a tiny random transformers checkpoint written as GGUF (`quant_models`:
the `gguf` package's quantizers, random K-quant blocks with finite scales). The oracle is transformers on the weights the file holds (dequantized with the
`gguf` package's reference): ftrs' reference path (dequantize, then fp32 matmul) must give the
same logits within 1e-4; its kernel path (Rust, from the blocks) the same greedy tokens.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from ftrs.errors import ModelLoadError
from ftrs.llm import LLM
from ftrs.models.gguf_loader import open_gguf
from ftrs.models.gguf_write import gguf_quantizer, keep_f32, write_gguf
from ftrs.models.load import load_model
from ftrs.models.tiny import make_tiny, tiny_tensors, tiny_tokenizer
from ftrs.quant import QuantTensor, kernel_types, use_kernels
from ftrs.sampling import SamplingParams
from quant_models import IQ4_TYPES, MIXTRAL_TYPES, QWEN3MOE_TYPES, _mixed, build, quant_config

transformers = pytest.importorskip("transformers")
TOL = 1e-4
IDS = [3, 17, 250, 41, 99, 500, 7, 8, 311, 42, 42, 42, 130, 64, 255, 1, 300, 12, 77, 5]


@pytest.fixture(scope="module")
def quant_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Path]]:
    root = tmp_path_factory.mktemp("quant")
    return {"qwen3_moe": build("qwen3_moe", QWEN3MOE_TYPES, root),
            "mixtral": build("mixtral", MIXTRAL_TYPES, root)}


def hf_logits(ref_dir: Path, ids: list[int]) -> torch.Tensor:
    m = transformers.AutoModelForCausalLM.from_pretrained(str(ref_dir), dtype=torch.float32)
    with torch.no_grad():
        return m.eval()(torch.tensor([ids])).logits[0].float()


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
def test_reference_path_logits_match_transformers(quant_models: dict[str, tuple[Path, Path]],
                                                   arch: str) -> None:
    gguf_path, ref_dir = quant_models[arch]
    llm = LLM(str(gguf_path), kv_tokens=1024, dtype="float32")
    with use_kernels(False):
        ours = llm.logits(IDS)
    ref = hf_logits(ref_dir, IDS)
    assert ours.shape == ref.shape == (len(IDS), 512)
    assert (ours - ref).abs().max().item() <= TOL


def test_quantized_experts_stay_file_bytes(quant_models: dict[str, tuple[Path, Path]]) -> None:
    gguf_path, _ = quant_models["qwen3_moe"]
    m = load_model(str(gguf_path), torch.device("cpu"), torch.float32, progress=False)
    assert m.experts is not None and m.experts.quantized
    views = m.experts.views(m.experts.host_bytes())
    gate, up, down = views[0][3]
    assert isinstance(gate, QuantTensor) and gate.qtype == "Q4_K"
    assert isinstance(up, QuantTensor) and up.qtype == "Q5_K"
    assert isinstance(down, QuantTensor) and down.qtype == "Q6_K"
    assert isinstance(views[2][3][2], QuantTensor) and views[2][3][2].qtype == "Q4_K"
    # the pool holds the file's bytes: 256x256 per matrix, 144/176/210 bytes per 256 values
    per_expert_l0 = 256 * (144 + 176 + 210)
    assert m.experts.payload_bytes() == 8 * (per_expert_l0 + 256 * (144 + 176 + 144))
    assert m.experts.pool.nbytes < 1.1 * m.experts.payload_bytes() * 210 / 177


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
def test_kernel_path_greedy_agrees_with_reference(quant_models: dict[str, tuple[Path, Path]],
                                                  arch: str) -> None:
    gguf_path, _ = quant_models[arch]
    needed = set(QWEN3MOE_TYPES.values() if arch == "qwen3_moe" else MIXTRAL_TYPES.values())
    if not (needed - {"F16", "BF16"}) & kernel_types():
        pytest.skip("no quantized CPU kernels in this build")
    llm = LLM(str(gguf_path), kv_tokens=1024, dtype="float32")
    params = SamplingParams(max_tokens=64, temperature=0, ignore_eos=True)
    with use_kernels(False):
        ref = llm.generate([IDS], params)[0].token_ids
    with use_kernels(True):
        ours = llm.generate([IDS], params)[0].token_ids
    same = sum(a == b for a, b in zip(ours, ref))
    assert len(ours) == len(ref) == 64
    assert same >= 0.95 * 64, (same, ours, ref)


def test_iq4_file_matches_transformers_and_keeps_its_blocks(tmp_path: Path) -> None:
    # IQ4_XS / IQ4_NL (non-linear 4-bit levels): the reference path against transformers on
    # the file's values, the pool holding the file's types, the Rust kernels' greedy tokens
    gguf_path, ref_dir = build("qwen3_moe", IQ4_TYPES, tmp_path)
    llm = LLM(str(gguf_path), kv_tokens=1024, dtype="float32")
    with use_kernels(False):
        ours = llm.logits(IDS)
    assert (ours - hf_logits(ref_dir, IDS)).abs().max().item() <= TOL
    m = load_model(str(gguf_path), torch.device("cpu"), torch.float32, progress=False)
    assert m.experts is not None
    gate, up, down = m.experts.views(m.experts.host_bytes())[0][6]
    assert [w.qtype for w in (gate, up, down) if isinstance(w, QuantTensor)] == [
        "IQ4_XS", "IQ4_XS", "IQ4_NL"]
    assert {"IQ4_XS", "IQ4_NL"} <= kernel_types()
    params = SamplingParams(max_tokens=64, temperature=0, ignore_eos=True)
    with use_kernels(False):
        ref = llm.generate([IDS], params)[0].token_ids
    with use_kernels(True):
        kern = llm.generate([IDS], params)[0].token_ids
    assert sum(a == b for a, b in zip(kern, ref)) >= 0.95 * 64, (kern, ref)
    llm.close()


# --- bad files -----------------------------------------------------------------------------

def _write(path: Path, arch: str, types: dict[str, str], edit: Any = None) -> Path:
    cfg = quant_config(arch)
    if edit is not None:
        edit(cfg)
    tensors = tiny_tensors(quant_config(arch), 1)
    write_gguf(path, cfg, tensors, _mixed(types, 1), tiny_tokenizer(cfg["vocab_size"]))
    return path


def test_truncated_gguf_is_a_load_error(quant_models: dict[str, tuple[Path, Path]],
                                        tmp_path: Path) -> None:
    src = quant_models["mixtral"][0]
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(src.read_bytes()[: src.stat().st_size - 1000])
    with pytest.raises(ModelLoadError, match="truncated") as e:
        load_model(str(cut), torch.device("cpu"), torch.float32, progress=False)
    assert e.value.path == str(cut)


def test_expert_count_disagreeing_with_tensors(tmp_path: Path) -> None:
    path = _write(tmp_path / "e.gguf", "qwen3_moe", {"experts": "Q8_0"},
                  edit=lambda c: c.update(num_experts=16))
    with pytest.raises(ModelLoadError, match=r"blk\.0\.ffn_\w+_exps\.weight holds 8 experts, "
                       r"metadata says expert_count = 16"):
        load_model(str(path), torch.device("cpu"), torch.float32, progress=False)


def test_expert_tensor_of_the_wrong_shape(tmp_path: Path) -> None:
    path = _write(tmp_path / "s.gguf", "qwen3_moe", {"experts": "Q8_0"},
                  edit=lambda c: c.update(moe_intermediate_size=128))
    with pytest.raises(ModelLoadError, match=r"ffn_gate_exps\.weight has shape \[8, 256, 256\], "
                       r"expected \[8, 128, 256\]"):
        load_model(str(path), torch.device("cpu"), torch.float32, progress=False)


@pytest.mark.parametrize(("qtype", "block"), [("TQ2_0", (256, 66)), ("NVFP4", (64, 36))])
def test_unsupported_expert_type_named_before_loading(tmp_path: Path, qtype: str,
                                                      block: tuple[int, int]) -> None:
    # NVFP4 has ftrs blocks (ModelOpt safetensors) but a GGUF file keeps its tensor scale
    # outside them, which the loader does not read: refused, not loaded off by that factor

    def other(name: str, w: np.ndarray) -> tuple[str, np.ndarray]:
        if "experts.0.up" in name:
            n, nbytes = block
            return qtype, np.zeros((*w.shape[:-1], w.shape[-1] // n * nbytes), np.uint8)
        return "F32", w.astype(np.float32)

    cfg = quant_config("qwen3_moe")
    assert qtype in gguf.GGMLQuantizationType.__members__
    path = tmp_path / "other.gguf"
    write_gguf(path, cfg, tiny_tensors(cfg, 1), other, tiny_tokenizer(512))
    with pytest.raises(ModelLoadError, match=r"tensor blk\.0\.ffn_up_exps\.weight uses "
                       f"unsupported quantization {qtype}"):
        load_model(str(path), torch.device("cpu"), torch.float32, progress=False)


def test_dense_gguf_archs_match_transformers(tmp_path: Path) -> None:
    for arch in ("qwen3", "llama"):  # dense, Q8_0; llama's q/k permutation undone
        d = make_tiny(arch, tmp_path / arch, seed=2)
        cfg = json.loads((d / "config.json").read_text())
        from safetensors.torch import load_file

        held = write_gguf(tmp_path / f"{arch}.gguf", cfg, load_file(str(d / "model.safetensors")),
                          gguf_quantizer("Q8_0"), tiny_tokenizer(512))
        ref_dir = tmp_path / f"{arch}-ref"
        shutil.copytree(d, ref_dir)
        save_file({k: v.contiguous() for k, v in held.items()}, str(ref_dir / "model.safetensors"))
        llm = LLM(str(tmp_path / f"{arch}.gguf"), kv_tokens=1024, dtype="float32")
        with use_kernels(False):
            ours = llm.logits(IDS)
        assert (ours - hf_logits(ref_dir, IDS)).abs().max().item() <= TOL, arch


def test_fused_gate_up_experts_are_cut_apart(tmp_path: Path) -> None:
    # the converter's --fuse-gate-up-exps: one (experts, 2I, H) tensor, gate rows first, in the
    # gate's type (Q4_K here); the pool holds each half as its own tensor, bytes unchanged
    cfg = quant_config("qwen3_moe")
    path = tmp_path / "fused.gguf"
    held = write_gguf(path, cfg, tiny_tensors(cfg, 1), _mixed(QWEN3MOE_TYPES, 1),
                      tiny_tokenizer(512), fuse_gate_up=True)
    names = {t.name for t in gguf.GGUFReader(str(path)).tensors}
    assert "blk.0.ffn_gate_up_exps.weight" in names and "blk.0.ffn_up_exps.weight" not in names
    ref_dir = tmp_path / "ref"
    ref_dir.mkdir()
    save_file({k: v.contiguous() for k, v in held.items()}, str(ref_dir / "model.safetensors"))
    (ref_dir / "config.json").write_text(json.dumps(cfg))
    llm = LLM(str(path), kv_tokens=1024, dtype="float32")
    with use_kernels(False):
        ours = llm.logits(IDS)
    assert (ours - hf_logits(ref_dir, IDS)).abs().max().item() <= TOL
    m = load_model(str(path), torch.device("cpu"), torch.float32, progress=False)
    assert m.experts is not None
    gate, up, _ = m.experts.views(m.experts.host_bytes())[0][5]
    assert isinstance(up, QuantTensor) and (gate.qtype, up.qtype) == ("Q4_K", "Q4_K")
    fused = next(t for t in gguf.GGUFReader(str(path)).tensors
                 if t.name == "blk.0.ffn_gate_up_exps.weight")
    rows = np.asarray(fused.data)[5]
    assert np.array_equal(up.data.numpy(), rows[rows.shape[0] // 2:].reshape(-1))


def test_llama3_rope_scaling_travels_as_rope_freqs(tmp_path: Path) -> None:
    # llama.cpp stores llama3's scaling as one divisor per frequency (`rope_freqs.weight`); the
    # original context (32) puts the tiny model's 8 frequencies in all three bands (kept,
    # blended, divided by the factor)
    d = make_tiny("llama", tmp_path / "llama3", seed=4)
    cfg = json.loads((d / "config.json").read_text())
    cfg["rope_scaling"] = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                           "high_freq_factor": 4.0, "original_max_position_embeddings": 32}
    (d / "config.json").write_text(json.dumps(cfg))
    from safetensors.torch import load_file

    path = tmp_path / "llama3.gguf"
    write_gguf(path, cfg, load_file(str(d / "model.safetensors")), keep_f32, tiny_tokenizer(512))
    factors = open_gguf(path).config["rope_scaling"]["factors"]
    assert factors[0] == 1.0 and factors[-1] == 8.0 and 1.0 < factors[1] < 8.0
    ours = LLM(str(path), kv_tokens=1024, dtype="float32").logits(IDS)
    assert (ours - hf_logits(d, IDS)).abs().max().item() <= TOL
    plain = tmp_path / "plain"  # the scaling is not a no-op on these positions
    shutil.copytree(d, plain)
    (plain / "config.json").write_text(json.dumps({k: v for k, v in cfg.items()
                                                   if k != "rope_scaling"}))
    assert (ours - hf_logits(plain, IDS)).abs().max().item() > 100 * TOL


def test_guard_fetch_model_counts_the_quantized_bytes(
        quant_models: dict[str, tuple[Path, Path]]) -> None:
    from ftrs.guard.startup import model_fetch

    gguf_path, _ = quant_models["qwen3_moe"]
    fm = model_fetch(str(gguf_path), "cpu", "auto")
    m = load_model(str(gguf_path), torch.device("cpu"), torch.float32, progress=False)
    assert m.experts is not None
    # what one miss moves over the link, on average over the layers (their types differ): the
    # pool's bytes per block, rounded up
    blocks = fm.num_moe_layers * fm.num_experts
    assert fm.expert_bytes == -(-m.experts.pool.nbytes // blocks)
    assert fm.expert_bytes < m.experts.expert_bytes  # smaller than the largest block
    assert fm.expert_bytes < 256 * 256 * 3 * 4 / 5  # against 786 KiB per expert in fp32
    assert (fm.num_moe_layers, fm.num_experts, fm.top_k) == (2, 8, 4)
