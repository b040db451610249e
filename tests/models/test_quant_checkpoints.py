"""Quantized safetensors checkpoints (block-scaled FP8, ModelOpt NVFP4, gpt_oss' MXFP4) beside
the pool they fill:

- one that safetensors cannot read fails as a plain one does: a ModelLoadError naming the file,
  whichever pass meets it first (the header scans for the experts' formats, the guard's
  included), and one line from the CLI, never safetensors' own error or a traceback;
- the guard's fetch model (`ftrs doctor`, the prefill cap) sizes their routed experts as the
  host pool stores them, in the file's encoding, not in the compute dtype.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ftrs.errors import ModelLoadError
from ftrs.guard.startup import model_fetch
from ftrs.models.load import load_model
from ftrs.models.tiny import make_tiny
from quant_models import write_fp8_checkpoint, write_nvfp4_checkpoint

FORMATS = ["fp8", "nvfp4", "mxfp4"]
EXPERT_MATRICES = ("gate_proj", "up_proj", "down_proj")


def quantized_checkpoint(fmt: str, root: Path) -> Path:
    """A tiny MoE checkpoint directory with its routed experts in `fmt`, by the repo's writers
    (FP8 in 32x32 tiles; the experts alone quantized, the rest plain)."""
    if fmt == "fp8":
        src = make_tiny("qwen3_moe", root / "src", seed=3)
        out, ref = root / "fp8", root / "ref"
        shutil.copytree(src, out)
        shutil.copytree(src, ref)
        write_fp8_checkpoint(src, out, ref, (32, 32),
                             lambda name: ".experts." in name and name.endswith(".weight")
                             and name.split(".")[-2] in EXPERT_MATRICES)
        return out
    if fmt == "nvfp4":
        return write_nvfp4_checkpoint(root)[0]
    pytest.importorskip("transformers")
    pytest.importorskip("gguf")
    import gpt_oss_models

    src = gpt_oss_models.build(root / "src", seed=1)
    return gpt_oss_models.quantize_mxfp4(src, root / "mxfp4", root / "ref")[0]


@pytest.fixture(scope="module", params=FORMATS)
def checkpoint(request: pytest.FixtureRequest,
               tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path]:
    return request.param, quantized_checkpoint(request.param, tmp_path_factory.mktemp(
        request.param))


def truncated(src: Path, dst: Path) -> Path:
    """A copy of the checkpoint `src` with the last 5000 bytes of its weights cut off: its
    header says more than the file holds."""
    d = shutil.copytree(src, dst)
    f = d / "model.safetensors"
    f.write_bytes(f.read_bytes()[:-5000])
    return d


def test_a_truncated_quantized_checkpoint_is_a_load_error_naming_the_file(
        checkpoint: tuple[str, Path], tmp_path: Path) -> None:
    d = truncated(checkpoint[1], tmp_path / "m")
    with pytest.raises(ModelLoadError,
                       match=r"cannot read safetensors: .*incomplete metadata") as e:
        load_model(str(d), torch.device("cpu"), torch.float32, progress=False)
    assert e.value.path == str(d / "model.safetensors")


def test_the_guards_header_read_of_a_truncated_checkpoint_is_a_load_error(
        checkpoint: tuple[str, Path], tmp_path: Path) -> None:
    d = truncated(checkpoint[1], tmp_path / "m")
    with pytest.raises(ModelLoadError, match="cannot read safetensors") as e:
        model_fetch(str(d), "cpu", "auto")
    assert e.value.path == str(d / "model.safetensors")


def test_the_cli_says_one_line_for_a_truncated_fp8_checkpoint(tmp_path: Path) -> None:
    d = truncated(quantized_checkpoint("fp8", tmp_path / "built"), tmp_path / "m")
    r = subprocess.run([sys.executable, "-m", "ftrs", "generate", "--model", str(d), "--dtype",
                        "float32", "hello"], capture_output=True, text=True, timeout=300)
    assert r.returncode == ModelLoadError.exit_code, r.stderr
    assert "Traceback" not in r.stderr
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, r.stderr
    assert lines[0].startswith(f"ftrs: error: {d / 'model.safetensors'}: cannot read "
                               "safetensors: "), lines[0]


#: the encoding the fetch model names, per format and compute dtype (gpt_oss' biases stay plain)
ENCODING = {"fp8": "FP8_BLOCK", "nvfp4": "NVFP4", "mxfp4": "MXFP4+{dtype}"}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_the_guard_sizes_quantized_experts_as_the_pool_stores_them(
        checkpoint: tuple[str, Path], dtype: torch.dtype) -> None:
    """The oracle is the pool the loader fills; the fetch model reads headers only."""
    fmt, d = checkpoint
    name = str(dtype).removeprefix("torch.")
    fm = model_fetch(str(d), "cpu", name)
    experts = load_model(str(d), torch.device("cpu"), dtype, progress=False).experts
    assert experts is not None and experts.quantized
    assert fm.total_expert_bytes == experts.pool.nbytes
    assert fm.num_moe_layers * fm.num_experts == experts.num_experts_total
    assert fm.dtype == ENCODING[fmt].format(dtype=name)


def test_doctor_names_the_experts_encoding(checkpoint: tuple[str, Path], tmp_path: Path) -> None:
    from ftrs.doctor import build_report, format_text

    fmt, d = checkpoint
    (tmp_path / "sys").mkdir()  # a host with no PCI device: a CPU run, in float32
    r = build_report(str(d), sysfs_root=tmp_path / "sys", home=tmp_path / "home", measure=False)
    experts = load_model(str(d), torch.device("cpu"), torch.float32, progress=False).experts
    assert experts is not None
    per_expert = experts.pool.nbytes / experts.num_experts_total / 2**20
    encoding = ENCODING[fmt].format(dtype="float32")
    assert f"{per_expert:.2f} MiB per expert ({encoding})" in format_text(r)
