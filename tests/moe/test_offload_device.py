"""The offload strategy's copy backend follows the model's CUDA device (`cuda:N`)."""

from __future__ import annotations

import pytest
import torch

from ftrs.config import EngineConfig
from ftrs.errors import ConfigError
from ftrs.moe.offload import backend_spec, cuda_ordinal


def spec(copy_backend: str, device: torch.device) -> str:
    return backend_spec(EngineConfig(model="m", copy_backend=copy_backend), device)


def test_the_cuda_backend_copies_into_the_model_s_device() -> None:
    gpu2 = torch.device("cuda", 2)  # a device object only: nothing runs on it
    assert cuda_ordinal(gpu2) == 2
    assert spec("auto", gpu2) == "cuda:2"
    assert spec("cuda", gpu2) == "cuda:2"
    assert spec("cuda:2", gpu2) == "cuda:2"  # a mismatch with the model's device is the engine's
    assert spec("simulated:5", gpu2) == "simulated:5"


def test_host_devices_copy_with_the_host_backends_and_refuse_cuda() -> None:
    cpu = torch.device("cpu")
    assert spec("auto", cpu) == "host"
    assert spec("simulated:5:10", cpu) == "simulated:5:10"
    for bad in ("cuda", "cuda:1"):
        with pytest.raises(ConfigError, match="needs a CUDA device"):
            spec(bad, cpu)
