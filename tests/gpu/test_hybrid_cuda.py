"""The hybrid strategy on a GPU: the CPU share, the link share and the device share together.

On a GPU the CPU share computes in fp32 through the Rust kernels while the device computes
with torch, so hybrid equals resident within fp32 rounding (not bit for bit, as on a CPU-only
host: tests/moe/test_hybrid.py). The split is forced both ways through injected estimates,
and so is the layer mode (the split, or every expert on the CPU).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ftrs.llm import LLM
from ftrs.moe.hybrid import CostModel, HybridStrategy, LayerModes
from gpu.test_offload_cuda import make_cuda
from moe.test_offload import IDS, quiesce

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def hybrid(llm: LLM) -> HybridStrategy:
    moe = llm.engine.moe_strategy()
    assert isinstance(moe, HybridStrategy)
    return moe


def frozen_modes(cheap: str) -> LayerModes:
    m = LayerModes(explore_share=0, learn=False)
    dear = "cpu" if cheap == "split" else "split"
    m.seconds = {(mode, 1 << b): t for b in range(8) for mode, t in ((cheap, 0.0), (dear, 1.0))}
    return m


@pytest.mark.parametrize("link", ["slow", "fast", "all-cpu"])
def test_cuda_hybrid_matches_resident(tiny_models: dict[str, Path], link: str) -> None:
    ref = make_cuda(tiny_models["mixtral"], moe_strategy="resident")
    want = ref.logits(IDS)
    ref.close()
    llm = make_cuda(tiny_models["mixtral"], moe_strategy="hybrid", moe_cache_rate=0.5,
                    copy_backend="cuda", moe_prefetch=False)
    moe = hybrid(llm)
    assert not moe.cost.device_is_cpu
    gbps = 1e-3 if link == "slow" else 1e3  # injected: the CPU or the link takes every miss
    moe.cost = CostModel(gbps * 1e9, 0.0, cpu_s_per_token=1e-4, learn=False)
    moe.modes = frozen_modes("cpu" if link == "all-cpu" else "split")
    got = llm.logits(IDS)
    s = quiesce(moe)
    llm.close()
    assert got.dtype == want.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    if link == "all-cpu":  # a fast link, but every layer call runs on the CPU
        assert s["layers_all_cpu"] > 0 and s["layers_split"] == 0
        assert s["cpu_computed"] > 0 and s["fetched"] == 0 and s["device_computed"] == 0
    elif link == "slow":
        assert s["cpu_computed"] > 0 and s["fetched"] == 0 and s["bytes_h2d"] == 0
    else:
        assert s["fetched"] > 0 and s["cpu_computed"] == 0 and s["bytes_h2d"] > 0
