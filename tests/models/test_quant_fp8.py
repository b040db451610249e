"""FP8 block-scaled safetensors (as Qwen3-FP8 and DeepSeek-V3 ship them), kept FP8.

The oracle: transformers on the same weights dequantized to fp32 (weight x its tile's
`weight_scale_inv`), computed here from the definition.
"""

from __future__ import annotations

import importlib
import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from ftrs.errors import ModelLoadError
from ftrs.llm import LLM
from ftrs.models.load import load_model
from ftrs.models.tiny import make_tiny
from ftrs.quant import FP8_BLOCK, QuantTensor, kernel_types, use_kernels
from quant_models import strategy_logits_equal_resident, to_fp8, write_fp8_checkpoint

transformers = pytest.importorskip("transformers")
TOL = 1e-4
IDS = [3, 17, 250, 41, 99, 500, 7, 8, 311, 42, 42, 42, 130, 64, 255, 1, 300, 12, 77, 5]
BLOCK = (32, 32)  # the tiny experts are 48 wide: partial tiles at the edge
QUANTIZED = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@pytest.fixture(scope="module")
def fp8_model(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("fp8")
    src = make_tiny("qwen3_moe", root / "src", seed=3)
    fp8_dir, ref_dir = root / "fp8", root / "ref"
    shutil.copytree(src, fp8_dir)
    shutil.copytree(src, ref_dir)
    write_fp8_checkpoint(src, fp8_dir, ref_dir, BLOCK,
                         lambda name: name.endswith(".weight") and name.split(".")[-2] in QUANTIZED)
    return fp8_dir, ref_dir


@pytest.mark.parametrize("kernels", [False, True], ids=["reference", "kernel"])
def test_fp8_logits_match_dequantized_fp32(fp8_model: tuple[Path, Path], kernels: bool,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    # reference: dequantize, then F.linear; kernel: the Rust FP8 matmul, the same weights
    # summed in another order (at one row, each tile's sum times its scale): the same bound
    fp8_dir, ref_dir = fp8_model
    assert FP8_BLOCK in kernel_types()
    core = importlib.import_module("ftrs._core")
    calls: list[tuple[int, int]] = []
    fp8_matmul = core.quant_fp8_matmul

    def spy(w: Any, x: Any, out: Any, rows: int, cols: int, *rest: Any) -> None:
        calls.append((rows, cols))
        fp8_matmul(w, x, out, rows, cols, *rest)

    monkeypatch.setattr(core, "quant_fp8_matmul", spy)
    llm = LLM(str(fp8_dir), kv_tokens=1024, dtype="float32")
    with use_kernels(kernels):
        ours = llm.logits(IDS)
    assert bool(calls) == kernels
    m = transformers.AutoModelForCausalLM.from_pretrained(str(ref_dir), dtype=torch.float32)
    with torch.no_grad():
        ref = m.eval()(torch.tensor([IDS])).logits[0].float()
    assert (ours - ref).abs().max().item() <= TOL


@pytest.mark.parametrize("strategy", ["offload", "hybrid"])
def test_fp8_offload_and_hybrid_equal_resident(fp8_model: tuple[Path, Path],
                                               strategy: str) -> None:
    # FP8 experts cross the link as their bytes (offload), or are computed in the pool by the
    # same kernel (hybrid): the same logits as resident, bit for bit
    assert strategy_logits_equal_resident(fp8_model[0], strategy, IDS)


def test_fp8_experts_stay_fp8_in_the_pool(fp8_model: tuple[Path, Path]) -> None:
    m = load_model(str(fp8_model[0]), torch.device("cpu"), torch.float32, progress=False)
    assert m.experts is not None
    gate = m.experts.views(m.experts.host_bytes())[0][5][0]
    assert isinstance(gate, QuantTensor) and gate.qtype == FP8_BLOCK
    # 48x64 fp8 bytes + a 2x2 grid of fp32 scales, against 48x64x4 bytes in fp32
    assert m.experts.exact_bytes(0, 0) == 48 * 64 + 4 * 4
    w8, s, _ = to_fp8(load_file(str(fp8_model[1].parent / "src" / "model.safetensors"))[
        "model.layers.0.mlp.experts.5.gate_proj.weight"], BLOCK)
    assert torch.equal(gate.data[:48 * 64], w8.view(torch.uint8).reshape(-1))
    assert torch.equal(gate.data[48 * 64:].view(torch.float32), s.reshape(-1))


def test_fp8_weight_without_scales(fp8_model: tuple[Path, Path], tmp_path: Path) -> None:
    d = shutil.copytree(fp8_model[0], tmp_path / "m")
    t = load_file(str(d / "model.safetensors"))
    del t["model.layers.1.self_attn.v_proj.weight_scale_inv"]
    save_file(t, str(d / "model.safetensors"))
    with pytest.raises(ModelLoadError, match=r"FP8 weight model\.layers\.1\.self_attn\.v_proj"
                       r"\.weight has no model\.layers\.1\.self_attn\.v_proj\.weight_scale_inv"):
        load_model(str(d), torch.device("cpu"), torch.float32, progress=False)


@pytest.mark.parametrize("qc", [{"quant_method": "awq", "bits": 4}, {"quant_method": "fp8"}])
def test_other_quantization_configs_refused(fp8_model: tuple[Path, Path], tmp_path: Path,
                                            qc: dict[str, object]) -> None:
    d = shutil.copytree(fp8_model[0], tmp_path / "m")
    cfg = json.loads((d / "config.json").read_text())
    cfg["quantization_config"] = qc
    (d / "config.json").write_text(json.dumps(cfg))
    match = "'awq'" if qc["quant_method"] == "awq" else "weight_block_size"
    with pytest.raises(ModelLoadError, match=match):
        load_model(str(d), torch.device("cpu"), torch.float32, progress=False)
