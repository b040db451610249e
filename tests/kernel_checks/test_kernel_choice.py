"""The engine's choice of kernels, end to end: the runtime builds it once and hands it to the
decoder and the MoE strategy; `--kernels torch` runs the references; `--kernels triton` where
Triton cannot run is one clear error line with the ConfigError exit code."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

import ftrs.kernels as kernels
from ftrs.cli import main
from ftrs.engine import runtime
from ftrs.errors import ConfigError
from ftrs.kernels import attention, cpu, moe, norm
from ftrs.llm import LLM
from ftrs.moe.base import create_strategy


def _no_interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    """As a CPU process without TRITON_INTERPRET sees it (the test session sets the knob)."""
    monkeypatch.setattr(kernels, "interpreting", lambda: False)


def test_kernels_torch_runs_the_references(tiny_models: dict[str, Path],
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    handed: dict[str, Any] = {}

    def create(name: str, **kw: Any) -> Any:
        handed.update(kw)
        return create_strategy(name, **kw)

    monkeypatch.setattr(runtime, "create_strategy", create)
    llm = LLM(str(tiny_models["mixtral"]), kv_tokens=256, kernels="torch", device="cpu")
    rt = llm.engine.rt
    k = rt.kernels
    assert k.name == "torch"
    assert (k.rms_norm, k.rotary_, k.fused_moe, k.paged_attention) == (
        norm.rms_norm_ref, norm.rotary_ref_, moe.fused_moe_ref, attention.paged_attention_ref)
    assert handed["kernels"] is k  # the MoE strategy is handed the same choice
    dec = rt.decoder
    assert dec.kernels is k and dec.norm is norm.rms_norm_ref
    assert dec.rotary_ is None and not dec.uses_paged_kernel  # layers.rotary, layers.attention
    assert llm.logits([3, 4, 5]).shape == (3, 512)
    llm.close()


def test_auto_on_a_cpu_without_the_interpreter_picks_the_cpu_ops(
        tiny_models: dict[str, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    _no_interpreter(monkeypatch)
    llm = LLM(str(tiny_models["llama"]), kv_tokens=256, device="cpu")  # kernels="auto"
    assert llm.engine.rt.kernels.name == llm.engine.kernels == "cpu"
    dec = llm.engine.rt.decoder
    assert dec.norm is cpu.rms_norm_cpu and dec.rotary_ is cpu.rotary_cpu_
    assert dec.kernels.decode_attention is cpu.decode_attention_cpu
    assert not dec.uses_paged_kernel  # the paged Triton kernel needs block tables; not here
    llm.close()


def test_triton_on_a_cpu_without_the_interpreter_is_a_config_error(
        tiny_models: dict[str, Path], monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    _no_interpreter(monkeypatch)
    with pytest.raises(ConfigError, match="triton cannot run here"):
        LLM(str(tiny_models["llama"]), kv_tokens=256, device="cpu", kernels="triton")
    rc = main(["generate", "hi", "--model", str(tiny_models["llama"]), "--device", "cpu",
               "--kernels", "triton", "--max-tokens", "2"])
    assert rc == ConfigError.exit_code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == ("ftrs: error: kernels: triton cannot run here (device cpu is not CUDA); "
                       "use --kernels auto or torch")
    assert not any("loading" in line for line in err)  # refused before the model loads


def test_triton_under_the_interpreter_wires_every_kernel(tiny_models: dict[str, Path]) -> None:
    if not kernels.interpreting():
        pytest.skip("needs TRITON_INTERPRET=1 (set by tests/conftest.py without a GPU)")
    llm = LLM(str(tiny_models["llama"]), kv_tokens=256, device="cpu", kernels="triton")
    dec = llm.engine.rt.decoder
    assert llm.engine.rt.kernels.name == llm.engine.kernels == "triton"
    assert dec.norm is norm.rms_norm_triton and dec.rotary_ is norm.rotary_triton_
    assert dec.uses_paged_kernel and all(dec.paged_kernel)
    llm.engine.forward_once([3, 4, 5])  # the benches' seam builds its block tables too
    llm.close()
