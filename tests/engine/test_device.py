"""`cuda:N` honoured: resolved to an explicit index, made current for the thread that runs
steps, named to the copy backend and the profile key.
CUDA is faked where a test needs a machine with several GPUs (the CPU is all CI has)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from ftrs.config import EngineConfig
from ftrs.engine.runtime import Runtime, resolve_device
from ftrs.errors import ConfigError
from ftrs.guard.bench_strategy import device_name
from ftrs.llm import LLM
from ftrs.moe.offload import backend_spec


@pytest.fixture
def two_gpus(monkeypatch: pytest.MonkeyPatch) -> list[object]:
    """torch.cuda as on a machine with two GPUs, cuda:1 current; records set_device calls."""
    made_current: list[object] = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    monkeypatch.setattr(torch.cuda, "set_device", made_current.append)
    return made_current


def test_a_cuda_device_resolves_to_an_explicit_index(two_gpus: list[object]) -> None:
    assert resolve_device("cuda:0") == torch.device("cuda", 0)
    assert resolve_device("cuda:1") == torch.device("cuda", 1)
    assert resolve_device("cuda") == torch.device("cuda", 1)  # the current one, by name
    assert resolve_device("auto") == torch.device("cuda", 1)
    assert resolve_device("cpu") == torch.device("cpu")
    for bad in ("cuda:2", "tpu", "cuda:x"):
        with pytest.raises(ConfigError):
            resolve_device(bad)


def test_without_cuda_a_cuda_device_is_refused() -> None:
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with pytest.raises(ConfigError, match="CUDA is not available"):
        resolve_device("cuda:1")
    assert resolve_device("auto") == torch.device("cpu")


def test_the_runtime_makes_its_device_current(two_gpus: list[object]) -> None:
    Runtime.use_device(SimpleNamespace(device=torch.device("cuda", 1)))  # type: ignore[arg-type]
    Runtime.use_device(SimpleNamespace(device=torch.device("cpu")))  # type: ignore[arg-type]
    assert two_gpus == [torch.device("cuda", 1)]


def test_every_step_makes_the_device_current_on_its_thread(tiny_models: dict[str, Path]) -> None:
    llm = LLM(str(tiny_models["llama"]), device="cpu", dtype="float32", kv_tokens=256)
    calls = []
    rt = llm.engine.rt
    rt.use_device = lambda: calls.append(rt.device)  # type: ignore[method-assign]
    llm.generate([[1, 2, 3]])
    llm.close()
    assert calls and all(d == torch.device("cpu") for d in calls)


def test_the_cuda_copy_backend_copies_into_the_model_device(two_gpus: list[object]) -> None:
    auto, cuda = EngineConfig(), EngineConfig(copy_backend="cuda")
    assert backend_spec(auto, torch.device("cuda", 1)) == "cuda:1"
    assert backend_spec(cuda, resolve_device("cuda")) == "cuda:1"  # the current device, named
    assert backend_spec(auto, torch.device("cpu")) == "host"


def test_the_profile_key_names_the_configured_gpu(two_gpus: list[object],
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    asked: list[object] = []

    def name(index: object = None) -> str:
        asked.append(index)
        return "GPU"

    monkeypatch.setattr(torch.cuda, "get_device_name", name)
    assert device_name("cuda:1") == "GPU"
    assert device_name("auto") == "GPU"
    assert asked == [1, None]  # None: the current device
