"""The decode hot path's shortcuts compute what the plain formulas compute.

Oracles: the reference formulas written out with torch (rotate-half as HF llama writes it, an
expert's FFN as three separate projections, accumulation by index_add_)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ftrs.layers.moe import (
    accumulate,
    expert_contribution,
    expert_mlp,
    gate_up_matrix,
    plan_experts,
)
from ftrs.layers.norm import rms_norm
from ftrs.layers.rotary import Rotary, rotate


def test_rotate_equals_rotate_half_bit_for_bit() -> None:
    rot = Rotary(64, 10000.0, 512, None, torch.device("cpu"))
    pos = torch.tensor([0, 3, 100, 511])
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(4, 9, 64, generator=torch.Generator().manual_seed(0)).to(dtype)
        cos = rot.cos.index_select(0, pos).to(dtype)[:, None, :]
        sin = rot.sin.index_select(0, pos).to(dtype)[:, None, :]
        ref = x * cos + torch.cat((-x[..., 32:], x[..., :32]), dim=-1) * sin
        assert torch.equal(rotate(x, *rot.table(pos, dtype)), ref)


def _block(inter: int, hidden: int, gap: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """gate, up, down as views of one buffer, `gap` floats between gate and up."""
    g = torch.Generator().manual_seed(1)
    buf = torch.randn(3 * inter * hidden + gap, generator=g) * 0.05
    n = inter * hidden
    return (buf[:n].view(inter, hidden), buf[n + gap:2 * n + gap].view(inter, hidden),
            buf[2 * n + gap:].view(hidden, inter))


def test_gate_up_fused_only_when_adjacent_and_same_result() -> None:
    gate, up, down = _block(48, 16, 0)
    gu = gate_up_matrix(gate, up)
    assert gu is not None and gu.shape == (96, 16)
    assert torch.equal(gu[:48], gate) and torch.equal(gu[48:], up)
    assert gate_up_matrix(*_block(48, 16, 4)[:2]) is None  # not back to back
    assert gate_up_matrix(up, gate) is None  # wrong order
    assert gate_up_matrix(gate.clone(), up.clone()) is None  # separate storages
    x = torch.randn(5, 16, generator=torch.Generator().manual_seed(2))
    ref = F.linear(F.silu(F.linear(x, gate)) * F.linear(x, up), down)
    torch.testing.assert_close(expert_mlp(x, (gate, up, down)), ref, rtol=1e-5, atol=1e-6)


def test_an_expert_with_every_row_adds_like_index_add() -> None:
    g = torch.Generator().manual_seed(3)
    x = torch.randn(3, 16, generator=g)
    w = _block(48, 16, 0)
    ids = torch.tensor([[1, 0], [0, 2], [0, 1]])  # expert 0 has every token
    weights = torch.rand(3, 2, generator=g)
    plan = plan_experts(ids, weights, 3)
    out = torch.randn(3, 16, generator=g)
    ref = out.clone()
    for e in plan.experts:
        part = expert_contribution(x, plan, e, w)
        assert part is not None
        accumulate(out, part)
        tok = (ids == e).any(1).nonzero().flatten()
        y = expert_mlp(x.index_select(0, tok), w) * weights[ids == e].unsqueeze(1)
        ref.index_add_(0, tok, y)
    torch.testing.assert_close(out, ref, rtol=0, atol=0)


def test_rms_norm_fp32_equals_the_written_out_form() -> None:
    g = torch.Generator().manual_seed(4)
    for rows in (1, 7):
        x, w = torch.randn(rows, 576, generator=g) * 3, torch.randn(576, generator=g)
        xf = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5)
        assert torch.equal(rms_norm(x, w, 1e-5), w * xf)
