"""Shared fixtures: tiny random checkpoints (one per architecture), the real SmolLM2 GGUF, the demo."""

from __future__ import annotations

from pathlib import Path

import pytest

ARCHS = ("llama", "qwen3", "mixtral", "qwen3_moe")


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    from ftrs.models.tiny import make_tiny

    root = tmp_path_factory.mktemp("tiny")
    return {arch: make_tiny(arch, root / arch, seed=1) for arch in ARCHS}


@pytest.fixture(scope="session")
def smollm_gguf() -> Path:
    from ftrs.models.demo import demo_gguf

    return demo_gguf()


@pytest.fixture(scope="session")
def demo_model() -> Path:
    from ftrs.models.demo import ensure_demo

    return ensure_demo()
