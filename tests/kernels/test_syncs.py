"""The fused MoE and paged attention never wait on the device from the host (GPU only: torch
reports synchronising calls under `set_sync_debug_mode("error")`)."""

from __future__ import annotations

import pytest
import torch

from ftrs.kernels.attention import PagedMeta, paged_attention_triton
from ftrs.kernels.moe import SlotWeights, fused_moe_triton

pytestmark = pytest.mark.gpu


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
