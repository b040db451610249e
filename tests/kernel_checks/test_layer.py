"""One decoder layer computed through the kernel selector, as the decoder's call sites would
call it, against the same layer through `layers/` as the decoder calls it now: the kernels'
signatures fit the call sites and the pieces agree together (mixed decode + prefill batch,
GQA ratio 3, scrambled pages, a MoE layer)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ftrs.kernels import select_kernels
from ftrs.kernels.attention import PagedMeta
from ftrs.kernels.moe import SlotWeights
from ftrs.layers.attention import AttnMetadata, PrefillSpan, paged_attention
from ftrs.layers.moe import combine_experts, route
from ftrs.layers.norm import rms_norm
from ftrs.layers.rotary import Rotary

HID, HEADS, KV, D, E, TOP_K, INTER, PAGE, EPS = 48, 6, 2, 16, 4, 2, 32, 4, 1e-6


def test_one_layer_through_the_kernels_equals_the_layers(device: str) -> None:
    g = torch.Generator().manual_seed(0)

    def rnd(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=g) / shape[-1] ** 0.5).to(device)

    w = {"in": 1 + rnd(HID), "post": 1 + rnd(HID), "q": rnd(HEADS * D, HID),
         "k": rnd(KV * D, HID), "v": rnd(KV * D, HID), "o": rnd(HID, HEADS * D),
         "router": rnd(E, HID)}
    experts = [(rnd(INTER, HID), rnd(INTER, HID), rnd(HID, INTER)) for _ in range(E)]
    rot = Rotary(D, 10000.0, 64, None, torch.device(device))
    # sequence 0 decodes its 6th token (pages 5, 2); sequence 1 prefills positions 4..6 (pages 7, 0)
    pages = [[5, 2], [7, 0]]
    positions = torch.tensor([5, 4, 5, 6], device=device)
    slots = torch.tensor([2 * PAGE + 1, 0 * PAGE + 0, 0 * PAGE + 1, 0 * PAGE + 2], device=device)
    ctx0 = torch.tensor([5 * PAGE + i for i in range(4)] + [2 * PAGE + i for i in range(2)], device=device)
    ctx1 = torch.tensor([7 * PAGE + i for i in range(4)] + [0 * PAGE + i for i in range(3)], device=device)
    layer_meta = AttnMetadata(slots, torch.tensor([0], device=device), ctx0[None, :],
                              torch.ones(1, 1, 1, 6, dtype=torch.bool, device=device),
                              [PrefillSpan(1, 3, ctx1)])
    paged = PagedMeta.build(pages, [0, 1], [1, 3], [6, 7], PAGE, torch.device(device))
    prior_k = rnd(8 * PAGE, KV, D)  # the cached prefix of both sequences
    prior_v = rnd(8 * PAGE, KV, D)
    h0 = rnd(4, HID) * 4

    def qkv(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return (F.linear(x, w["q"]).view(4, HEADS, D), F.linear(x, w["k"]).view(4, KV, D),
                F.linear(x, w["v"]).view(4, KV, D))

    # the decoder today
    h = h0.clone()
    x = rms_norm(h, w["in"], EPS)
    q, k, v = qkv(x)
    q, k = rot.apply(q, positions), rot.apply(k, positions)
    o = paged_attention(q, k, v, prior_k.clone(), prior_v.clone(), layer_meta, D**-0.5)
    h = h + F.linear(o.reshape(4, -1), w["o"])
    x = rms_norm(h, w["post"], EPS)
    ids, rw = route(x, w["router"], TOP_K, True)
    moe = torch.zeros_like(x)
    combine_experts(x, ids, rw, torch.unique(ids).tolist(), lambda e: experts[e], moe)
    want = h + moe

    # the same layer through the kernels
    kern = select_kernels("triton", torch.device(device))
    kc, vc = prior_k.clone(), prior_v.clone()
    h = h0.clone()
    x, _ = kern.rms_norm(h, w["in"], EPS)
    q, k, v = qkv(x)
    kern.rotary_(q, k, rot.cos, rot.sin, positions)
    kc.index_copy_(0, slots, k)
    vc.index_copy_(0, slots, v)
    o = kern.paged_attention(q, kc, vc, paged, D**-0.5)
    x, h = kern.rms_norm(F.linear(o.reshape(4, -1), w["o"]), w["post"], EPS, residual=h)
    ids2, rw2 = route(x, w["router"], TOP_K, True)
    stacked = SlotWeights(*(torch.stack([ex[t] for ex in experts]) for t in range(3)))
    # out=None: experts summed from zero, then added to h, in the decoder's order
    got = h + kern.fused_moe(x, ids2, rw2, torch.arange(E, device=device), stacked)

    assert torch.equal(ids2, ids)  # same routing: the hidden states agree closely enough
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
