"""Shared fixtures: tiny random checkpoints (one per architecture), the real SmolLM2 GGUF, the demo."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

ARCHS = ("llama", "qwen3", "mixtral", "qwen3_moe")

# Triton fixes compile-or-interpret for good when it is first imported: without a GPU the kernel
# tests (tests/kernel_checks) run under its interpreter, so the knob is set before anything imports it.
if "TRITON_INTERPRET" not in os.environ:
    import torch

    if not torch.cuda.is_available():
        os.environ["TRITON_INTERPRET"] = "1"


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    from ftrs.models.tiny import make_tiny

    root = tmp_path_factory.mktemp("tiny")
    return {arch: make_tiny(arch, root / arch, seed=1) for arch in ARCHS}


@pytest.fixture(scope="session")
def hybrid_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Tiny qwen3_5_moe and qwen3_next checkpoints written by transformers (tests/hybrid_models)."""
    pytest.importorskip("transformers.models.qwen3_5_moe")
    pytest.importorskip("transformers.models.qwen3_next")
    from hybrid_models import build

    root = tmp_path_factory.mktemp("hybrid")
    return {arch: build(arch, root / arch) for arch in ("qwen3_5_moe", "qwen3_next")}


@pytest.fixture(scope="session")
def deepseek_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Tiny deepseek_v3 and deepseek_v2 checkpoints written by transformers
    (tests/deepseek_models): v3 with and without q_lora, v3 with YaRN, V2-Lite's shape, V2's
    group-limited routing, and GLM-4.7-Flash's glm4_moe_lite (V3's design)."""
    pytest.importorskip("transformers.models.deepseek_v3")
    from deepseek_models import V2_GROUPED, V2_LITE, YARN, build

    root = tmp_path_factory.mktemp("deepseek")
    variants: dict[str, dict[str, Any]] = {"q_lora": {}, "no_q_lora": {"q_lora_rank": None},
                                           "yarn": YARN, "v2_lite": V2_LITE,
                                           "v2_grouped": V2_GROUPED,
                                           "glm_lite": {"arch": "glm4_moe_lite"}}
    return {name: build(root / name, **changes) for name, changes in variants.items()}


@pytest.fixture(scope="session")
def smollm_gguf() -> Path:
    from ftrs.models.demo import demo_gguf

    return demo_gguf()


@pytest.fixture(scope="session")
def demo_model() -> Path:
    from ftrs.models.demo import ensure_demo

    return ensure_demo()
