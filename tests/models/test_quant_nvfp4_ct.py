"""compressed-tensors NVFP4 checkpoints (llm-compressor's `nvfp4-pack-quantized`, as the
`*-NVFP4` checkpoints made with it ship), kept NVFP4.

The checkpoint is quantized here as compressed-tensors lays it out: per weight `weight_packed`
(two e2m1 codes a byte, low nibble first), `weight_scale` (e4m3, one per 16 values),
`weight_global_scale` (fp32, which divides: the inverse of ModelOpt's `weight_scale_2`) and
`input_global_scale`. The oracle: transformers on the weights dequantized to fp32 by the
format's definition, `e2m1 * (weight_scale / weight_global_scale)`, written out in
`tests/quant_models.py`. ftrs keeps `1 / weight_global_scale` as the tensor scale (one more
fp32 rounding than the definition's division: within the 1e-4 the logits are held to).
"""

from __future__ import annotations

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
from ftrs.quant import QuantTensor, use_kernels
from quant_models import CT_NVFP4_QC, strategy_logits_equal_resident, write_nvfp4_checkpoint

transformers = pytest.importorskip("transformers")
TOL = 1e-4
IDS = [3, 17, 250, 41, 99, 500, 7, 8, 311, 42, 42, 42, 130, 64, 255, 1, 300, 12, 77, 5]


@pytest.fixture(scope="module")
def ct_model(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    return write_nvfp4_checkpoint(tmp_path_factory.mktemp("ct"), layout="compressed-tensors")


def test_logits_match_transformers_on_the_definitions_values(ct_model: tuple[Path, Path]) -> None:
    llm = LLM(str(ct_model[0]), kv_tokens=1024, dtype="float32")
    with use_kernels(False):  # the reference path: dequantize, then F.linear
        ours = llm.logits(IDS)
    llm.close()
    m = transformers.AutoModelForCausalLM.from_pretrained(str(ct_model[1]), dtype=torch.float32)
    with torch.no_grad():
        want = m.eval()(torch.tensor([IDS])).logits[0].float()
    assert (ours - want).abs().max().item() <= TOL


def test_the_global_scale_becomes_its_reciprocal(ct_model: tuple[Path, Path]) -> None:
    m = load_model(str(ct_model[0]), torch.device("cpu"), torch.float32, progress=False)
    assert m.spec.nvfp4 == "compressed-tensors" and m.experts is not None
    la = m.spec.moe_layers[-1]
    gate = m.experts.views(m.experts.host_bytes())[la][5][0]
    files = load_file(str(ct_model[0] / "model.safetensors"))
    gs = files[f"model.layers.{la}.mlp.experts.5.gate_proj.weight_global_scale"]
    assert isinstance(gate, QuantTensor) and gate.qtype == "NVFP4"
    assert gate.tensor_scale == float((1.0 / gs.float())[0])
    assert m.experts.exact_bytes(la, 0) == 256 * 4 * 36 + 4  # the same bytes as ModelOpt's
    assert isinstance(m.dense["1.o"], QuantTensor) and m.dense["1.o"].qtype == "NVFP4"
    assert isinstance(m.dense["0.router"], torch.Tensor)  # in the config's `ignore`


def test_offload_equals_resident(ct_model: tuple[Path, Path]) -> None:
    assert strategy_logits_equal_resident(ct_model[0], "offload", IDS)


def test_a_weight_without_its_global_scale(ct_model: tuple[Path, Path], tmp_path: Path) -> None:
    d = shutil.copytree(ct_model[0], tmp_path / "m")
    t = load_file(str(d / "model.safetensors"))
    del t["model.layers.0.mlp.experts.1.up_proj.weight_global_scale"]
    save_file(t, str(d / "model.safetensors"))
    with pytest.raises(ModelLoadError, match=r"NVFP4 weight model\.layers\.0\.mlp\.experts\.1"
                       r"\.up_proj\.weight has no .*up_proj\.weight_global_scale"):
        load_model(str(d), torch.device("cpu"), torch.float32, progress=False)


def _group(**weights: Any) -> dict[str, Any]:
    group = CT_NVFP4_QC["config_groups"]["group_0"]  # type: ignore[index]
    return {"group_0": group | {"weights": group["weights"] | weights}}


@pytest.mark.parametrize(("change", "named"), [
    ({"format": "float-quantized",  # an FP8 checkpoint's
      "config_groups": _group(num_bits=8, strategy="channel", group_size=None)},
     "format 'float-quantized' in group_0"),
    ({"format": "pack-quantized",  # int4 weights (GPTQ/AWQ-like)
      "config_groups": _group(type="int", strategy="group", group_size=128)},
     "format 'pack-quantized'"),
    ({"config_groups": _group(group_size=32)}, "group_0 weights .*group_size=32"),
    ({"sparsity_config": {"format": "sparse-24-bitmask"}}, "a sparsity_config"),
    ({"quantization_status": "frozen"}, "quantization_status 'frozen'"),
])
def test_other_compressed_tensors_schemes_are_refused(ct_model: tuple[Path, Path],
                                                      tmp_path: Path, change: dict[str, Any],
                                                      named: str) -> None:
    d = shutil.copytree(ct_model[0], tmp_path / "m")
    cfg = json.loads((d / "config.json").read_text())
    qc = cfg["quantization_config"] | change
    if "format" in change:  # the group's own format says the same
        qc["config_groups"]["group_0"]["format"] = change["format"]
    (d / "config.json").write_text(json.dumps(cfg | {"quantization_config": qc}))
    with pytest.raises(ModelLoadError, match="unsupported compressed-tensors checkpoint: " + named):
        load_model(str(d), torch.device("cpu"), torch.float32, progress=False)
