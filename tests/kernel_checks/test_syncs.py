"""The fused MoE and paged attention never wait on the device from the host (GPU: torch
reports synchronising calls under `set_sync_debug_mode("error")`), and the MoE strategies on the
fused kernel read nothing back per expert (any device: the host reads of tensors made from
ftrs code are counted)."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from ftrs.config import EngineConfig
from ftrs.kernels import select_kernels
from ftrs.kernels.attention import PagedMeta, paged_attention_triton
from ftrs.kernels.moe import SlotWeights, fused_moe_triton
from ftrs.layers.moe import route
from ftrs.models.load import LoadedModel, load_model
from ftrs.moe.base import MoEStrategy, create_strategy, import_strategy

#: Tensor methods that read device memory on the host (each a sync on CUDA).
HOST_READS = ("item", "tolist", "nonzero", "cpu", "numpy", "__bool__", "__int__", "__float__",
              "__index__")


@pytest.fixture
def host_reads(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[str]]:
    """Records `module.method` of every host read called from ftrs code (not from Triton's
    interpreter, which runs kernels on numpy)."""
    seen: list[str] = []
    for name in HOST_READS:
        real = getattr(torch.Tensor, name)

        def counted(self: torch.Tensor, *a: Any, _real: Any = real, _name: str = name,
                    **kw: Any) -> Any:
            caller = sys._getframe(1).f_globals.get("__name__", "")
            if caller.startswith("ftrs."):
                seen.append(f"{caller}.{_name}")
            return _real(self, *a, **kw)

        monkeypatch.setattr(torch.Tensor, name, counted)
    yield seen


def _strategy(name: str, loaded: LoadedModel, device: torch.device, **options: Any
              ) -> MoEStrategy:
    import_strategy(name)
    assert loaded.experts is not None
    config = EngineConfig(model=str(loaded.path), moe_strategy=name, **options)
    routers = {la: loaded.dense[f"{la}.router"] for la in loaded.spec.moe_layers}
    return create_strategy(name, experts=loaded.experts, device=device, config=config,
                           routers=routers, kernels=select_kernels("triton", device))


def _reads_per_forward(moe: MoEStrategy, loaded: LoadedModel, tokens: int,
                       seen: list[str]) -> tuple[list[str], int]:
    """Host reads of one forward over every MoE layer, and the distinct experts it used."""
    s = loaded.spec
    x = torch.randn(tokens, s.hidden_size, generator=torch.Generator().manual_seed(tokens))
    x = x.to(next(iter(loaded.dense.values())).device)
    routed = []
    for layer in s.moe_layers:
        router = loaded.dense[f"{layer}.router"]
        assert isinstance(router, torch.Tensor)
        routed.append((layer, *route(x, router, s.top_k, s.norm_topk_prob)))
    distinct = sum(len(set(ids.flatten().cpu().tolist())) for _, ids, _ in routed)
    seen.clear()
    moe.begin_forward(tokens)
    for layer, ids, w in routed:
        moe.forward(layer, x, ids, w)
    moe.end_forward()
    return list(seen), distinct


@pytest.mark.parametrize("name", ["resident", "offload"])
def test_strategy_on_the_fused_kernel_reads_nothing_per_expert(
        tiny_models: dict[str, Path], device: str, name: str, host_reads: list[str]) -> None:
    dev = torch.device(device)
    loaded = load_model(str(tiny_models["mixtral"]), dev, torch.float32, progress=False)
    moe = _strategy(name, loaded, dev, moe_cache_rate=0.5, moe_prefetch=False,
                    copy_backend="cuda" if dev.type == "cuda" else "host")
    try:
        one, few = _reads_per_forward(moe, loaded, 1, host_reads)
        wide, many = _reads_per_forward(moe, loaded, 9, host_reads)
    finally:
        moe.close()
    assert many > few  # the wide forward used more experts...
    layers = len(loaded.spec.moe_layers)
    if name == "resident":  # ...and nothing at all is read back
        assert one == [] and wide == []
    else:  # ...and offload reads the layer's distinct experts once per layer, for the lookup
        assert one == wide == ["ftrs.moe.offload.tolist"] * layers


@pytest.mark.gpu
def test_resident_strategy_on_the_fused_kernel_never_syncs(tiny_models: dict[str, Path],
                                                           device: str) -> None:
    dev = torch.device(device)
    if dev.type != "cuda":
        pytest.skip("sync counting needs CUDA")
    loaded = load_model(str(tiny_models["mixtral"]), dev, torch.bfloat16, progress=False)
    moe = _strategy("resident", loaded, dev)
    s = loaded.spec
    x = torch.randn(8, s.hidden_size, device=dev, dtype=torch.bfloat16)
    router = loaded.dense[f"{s.moe_layers[0]}.router"]
    assert isinstance(router, torch.Tensor)
    ids, w = route(x, router, s.top_k, s.norm_topk_prob)
    moe.forward(s.moe_layers[0], x, ids, w)  # compile outside the checked region
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for layer in s.moe_layers:
            moe.forward(layer, x, ids, w)
    finally:
        torch.cuda.set_sync_debug_mode(0)


@pytest.mark.gpu
def test_fused_moe_launches_without_a_sync(device: str) -> None:
    dev = torch.device(device)
    if dev.type != "cuda":
        pytest.skip("sync counting needs CUDA")
    e, h, i, t, k = 8, 128, 96, 32, 2
    w = SlotWeights(*(torch.randn(e, r, c, device=dev, dtype=torch.bfloat16)
                      for r, c in ((i, h), (i, h), (h, i))))
    x = torch.randn(t, h, device=dev, dtype=torch.bfloat16)
    ids = torch.rand(t, e, device=dev).topk(k, dim=1).indices
    rw = torch.full((t, k), 0.5, device=dev, dtype=torch.bfloat16)
    slot_of = torch.randperm(e, device=dev)
    fused_moe_triton(x, ids, rw, slot_of, w)  # compile outside the checked region
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        fused_moe_triton(x, ids, rw, slot_of, w)
    finally:
        torch.cuda.set_sync_debug_mode(0)


@pytest.mark.gpu
def test_paged_attention_launches_without_a_sync(device: str) -> None:
    dev = torch.device(device)
    if dev.type != "cuda":
        pytest.skip("sync counting needs CUDA")
    meta = PagedMeta.build([[3, 1], [0], [2]], [0, 1, 2], [1, 1, 4], [20, 9, 16], 16, dev)
    q = torch.randn(6, 6, 64, device=dev, dtype=torch.bfloat16)
    kc = torch.randn(4 * 16, 2, 64, device=dev, dtype=torch.bfloat16)
    paged_attention_triton(q, kc, kc, meta, 0.125)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        paged_attention_triton(q, kc, kc, meta, 0.125)
    finally:
        torch.cuda.set_sync_debug_mode(0)
