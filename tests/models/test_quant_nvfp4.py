"""ModelOpt NVFP4 safetensors (as NVIDIA's `*-FP4` / `*-NVFP4` checkpoints ship them), kept NVFP4.

The checkpoint is quantized here the way ModelOpt's export lays it out: per weight, `weight`
(two e2m1 codes a byte, low nibble first), `weight_scale` (e4m3, one per 16 values),
`weight_scale_2` (fp32) and `input_scale`; the router, norms, embeddings and LM head stay plain.
The oracle: transformers on the same weights dequantized to fp32 from the definition
(`e2m1 * weight_scale * weight_scale_2`), written out in this file.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from ftrs.errors import ModelLoadError
from ftrs.llm import LLM
from ftrs.models.load import load_model
from ftrs.quant import QuantTensor, kernel_types, use_kernels
from ftrs.sampling import SamplingParams
from quant_models import spy_kernel_types, strategy_logits_equal_resident, write_nvfp4_checkpoint

transformers = pytest.importorskip("transformers")
TOL = 1e-4
IDS = [3, 17, 250, 41, 99, 500, 7, 8, 311, 42, 42, 42, 130, 64, 255, 1, 300, 12, 77, 5]


@pytest.fixture(scope="module")
def nvfp4_model(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    return write_nvfp4_checkpoint(tmp_path_factory.mktemp("nvfp4"))


def reference_logits(ref_dir: Path) -> torch.Tensor:
    m = transformers.AutoModelForCausalLM.from_pretrained(str(ref_dir), dtype=torch.float32)
    with torch.no_grad():
        return m.eval()(torch.tensor([IDS])).logits[0].float()


def test_nvfp4_logits_match_dequantized_fp32(nvfp4_model: tuple[Path, Path],
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    # the reference path (dequantize, then F.linear) against transformers on the same values
    seen = spy_kernel_types(monkeypatch)
    llm = LLM(str(nvfp4_model[0]), kv_tokens=1024, dtype="float32")
    with use_kernels(False):
        ours = llm.logits(IDS)
    assert "NVFP4" not in seen
    assert (ours - reference_logits(nvfp4_model[1])).abs().max().item() <= TOL


def test_nvfp4_kernels_keep_the_greedy_tokens(nvfp4_model: tuple[Path, Path],
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    # the Rust NVFP4 kernel rounds activations per 32-block (its bound: tests/quant): the
    # same greedy tokens as the reference path, as for the GGUF types and MXFP4
    assert "NVFP4" in kernel_types()
    llm = LLM(str(nvfp4_model[0]), kv_tokens=1024, dtype="float32")
    params = SamplingParams(max_tokens=64, temperature=0, ignore_eos=True)
    with use_kernels(False):
        ref = llm.generate([IDS], params)[0].token_ids
    seen = spy_kernel_types(monkeypatch)
    with use_kernels(True):
        ours = llm.generate([IDS], params)[0].token_ids
    assert "NVFP4" in seen
    same = sum(a == b for a, b in zip(ours, ref))
    assert len(ours) == len(ref) == 64
    assert same >= 0.95 * 64, (same, ours, ref)
    llm.close()


@pytest.mark.parametrize("strategy", ["offload", "hybrid"])
def test_nvfp4_offload_and_hybrid_equal_resident(nvfp4_model: tuple[Path, Path],
                                                 strategy: str) -> None:
    # NVFP4 experts cross the link as their bytes, tensor scale included (offload), or are
    # computed in the pool by the same kernel (hybrid)
    assert strategy_logits_equal_resident(nvfp4_model[0], strategy, IDS)


def test_nvfp4_experts_and_projections_stay_nvfp4(nvfp4_model: tuple[Path, Path]) -> None:
    m = load_model(str(nvfp4_model[0]), torch.device("cpu"), torch.float32, progress=False)
    assert m.experts is not None
    la = m.spec.moe_layers[-1]
    gate = m.experts.views(m.experts.host_bytes())[la][6][0]
    assert isinstance(gate, QuantTensor) and gate.qtype == "NVFP4"
    # 256 x 256 values in 64-value blocks of 36 bytes, then the fp32 tensor scale: 4.5 bits
    # a weight against fp32's 32
    assert m.experts.exact_bytes(la, 0) == 256 * 4 * 36 + 4
    files = load_file(str(nvfp4_model[0] / "model.safetensors"))
    assert gate.tensor_scale == files[f"model.layers.{la}.mlp.experts.6.gate_proj.weight_scale_2"]
    assert isinstance(m.dense["0.q"], QuantTensor) and m.dense["0.q"].qtype == "NVFP4"
    assert isinstance(m.dense["0.router"], torch.Tensor)  # left plain by the export


def test_hf_quant_config_json_names_the_quantization(tmp_path: Path,
                                                     nvfp4_model: tuple[Path, Path]) -> None:
    nv_dir, _ = write_nvfp4_checkpoint(tmp_path, hf_quant_config=True)
    ref = LLM(str(nvfp4_model[0]), kv_tokens=1024, dtype="float32").logits(IDS)
    assert torch.equal(LLM(str(nv_dir), kv_tokens=1024, dtype="float32").logits(IDS), ref)


def test_nvfp4_weight_without_its_tensor_scale(nvfp4_model: tuple[Path, Path],
                                               tmp_path: Path) -> None:
    d = shutil.copytree(nvfp4_model[0], tmp_path / "m")
    t = load_file(str(d / "model.safetensors"))
    del t["model.layers.2.mlp.experts.3.down_proj.weight_scale_2"]
    save_file(t, str(d / "model.safetensors"))
    with pytest.raises(ModelLoadError, match=r"NVFP4 weight model\.layers\.2\.mlp\.experts\.3"
                       r"\.down_proj\.weight has no .*down_proj\.weight_scale_2"):
        load_model(str(d), torch.device("cpu"), torch.float32, progress=False)


def test_packed_fp4_without_the_quantization_config(nvfp4_model: tuple[Path, Path],
                                                    tmp_path: Path) -> None:
    d = shutil.copytree(nvfp4_model[0], tmp_path / "m")
    cfg = json.loads((d / "config.json").read_text())
    del cfg["quantization_config"]
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError,
                       match=r"uint8 .*no NVFP4 quantization \(modelopt or compressed-tensors\)"):
        load_model(str(d), torch.device("cpu"), torch.float32, progress=False)


@pytest.mark.parametrize("qc", [{"quant_algo": "FP8"}, {"quant_algo": "NVFP4", "group_size": 32}])
def test_other_modelopt_algorithms_refused(nvfp4_model: tuple[Path, Path], tmp_path: Path,
                                           qc: dict[str, object]) -> None:
    d = shutil.copytree(nvfp4_model[0], tmp_path / "m")
    cfg = json.loads((d / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "modelopt", **qc}
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match="unsupported modelopt quantization"):
        load_model(str(d), torch.device("cpu"), torch.float32, progress=False)
