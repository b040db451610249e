"""The kernel selector, the config field and its CLI flag."""

from __future__ import annotations

import argparse

import pytest
import torch

import ftrs.kernels as kernels
from ftrs.config import EngineConfig, add_engine_arguments, engine_config_from_args
from ftrs.errors import ConfigError
from ftrs.kernels import attention, cpu, moe, norm, select_kernels

CPU = torch.device("cpu")


def test_torch_mode_gives_the_references() -> None:
    k = select_kernels("torch", CPU)
    assert k.name == "torch"
    assert (k.rms_norm, k.rotary_, k.fused_moe, k.paged_attention) == (
        norm.rms_norm_ref, norm.rotary_ref_, moe.fused_moe_ref, attention.paged_attention_ref)


def test_auto_on_the_cpu_never_interprets() -> None:
    assert select_kernels("auto", CPU).name == "cpu"  # the Rust ops, never Triton's interpreter


def test_cpu_mode_gives_the_rust_ops_on_the_cpu_only() -> None:
    k = select_kernels("cpu", CPU)
    assert (k.name, k.rms_norm, k.rotary_, k.decode_attention) == (
        "cpu", cpu.rms_norm_cpu, cpu.rotary_cpu_, cpu.decode_attention_cpu)
    assert k.rotates_in_place and not select_kernels("torch", CPU).rotates_in_place
    with pytest.raises(ConfigError, match="cpu runs on the CPU"):
        select_kernels("cpu", torch.device("cuda"))
    assert EngineConfig(kernels="cpu").kernels == "cpu"


def test_cpu_mode_without_the_ops_is_a_config_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cpu, "available", lambda: False)  # an extension built before them
    with pytest.raises(ConfigError, match="no CPU ops"):
        select_kernels("cpu", CPU)
    assert select_kernels("auto", CPU).name == "torch"


def test_triton_mode_on_the_cpu_needs_the_interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    if kernels.interpreting():
        k = select_kernels("triton", CPU)
        assert k.fused_moe is moe.fused_moe_triton and k.paged_attention is attention.paged_attention_triton
    monkeypatch.setattr(kernels, "interpreting", lambda: False)
    with pytest.raises(ConfigError, match="not CUDA"):
        select_kernels("triton", CPU)


def test_triton_mode_without_triton_is_a_config_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(kernels, "triton_importable", lambda: False)
    with pytest.raises(ConfigError, match="does not import"):
        select_kernels("triton", torch.device("cuda"))
    assert select_kernels("auto", torch.device("cuda")).name == "torch"


def test_unknown_mode() -> None:
    with pytest.raises(ConfigError):
        select_kernels("cuda", CPU)
    with pytest.raises(ConfigError, match="kernels"):
        EngineConfig(kernels="fast")


def test_cli_flag() -> None:
    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)
    assert engine_config_from_args(parser.parse_args(["--kernels", "torch"])).kernels == "torch"
    assert engine_config_from_args(parser.parse_args([])).kernels == "auto"
