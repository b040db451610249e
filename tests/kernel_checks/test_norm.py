"""Fused RMSNorm and in-place rotary against their torch references (and `layers/`)."""

from __future__ import annotations

import pytest
import torch

from ftrs.kernels.norm import rms_norm_ref, rms_norm_triton, rotary_ref_, rotary_triton_

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _ulps(a: torch.Tensor, b: torch.Tensor) -> float:
    """Largest difference in units of the dtype's spacing at b's magnitude."""
    eps = torch.finfo(a.dtype).eps
    scale = b.float().abs().clamp_min(torch.finfo(a.dtype).tiny) * eps
    return float(((a.float() - b.float()).abs() / scale).max())


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,hidden", [(1, 40), (5, 67), (3, 128)])
def test_rms_norm_matches_reference(device: str, dtype: torch.dtype, rows: int, hidden: int) -> None:
    g = torch.Generator().manual_seed(rows * hidden)
    x = torch.randn(rows, hidden, generator=g).to(dtype).to(device)
    w = (1 + 0.1 * torch.randn(hidden, generator=g)).to(dtype).to(device)
    got, res = rms_norm_triton(x, w, 1e-6)
    want, _ = rms_norm_ref(x, w, 1e-6)
    assert res is None and got.dtype == want.dtype and got.shape == want.shape
    # the mean of squares sums in another order (and rsqrt may be approximate on a GPU): fp32 to
    # a few ulps; half types round twice (normed, then times w), so two ulps
    assert _ulps(got, want) <= (8 if dtype == torch.float32 else 2.01)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_with_residual_returns_the_exact_sum(device: str, dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(7)
    x = torch.randn(4, 3, 24, generator=g).to(dtype).to(device)
    r = torch.randn(4, 3, 24, generator=g).to(dtype).to(device)
    w = torch.randn(24, generator=g).to(dtype).to(device)
    got, new_res = rms_norm_triton(x, w, 1e-5, residual=r)
    want, want_res = rms_norm_ref(x, w, 1e-5, residual=r)
    assert new_res is not None and torch.equal(new_res, r + x)
    assert want_res is not None and torch.equal(want_res, r + x)
    assert got.shape == (4, 3, 24)
    assert _ulps(got, want) <= (8 if dtype == torch.float32 else 2.01)


def test_rms_norm_reference_is_the_layer_math() -> None:
    from ftrs.layers.norm import rms_norm

    x = torch.randn(6, 32, dtype=torch.bfloat16)
    w = torch.randn(32, dtype=torch.bfloat16)
    assert torch.equal(rms_norm_ref(x, w, 1e-6)[0], rms_norm(x, w, 1e-6))


def test_rms_norm_empty_batch(device: str) -> None:
    x = torch.zeros(0, 16, device=device)
    out, _ = rms_norm_triton(x, torch.ones(16, device=device), 1e-6)
    assert out.shape == (0, 16)


def _tables(d: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    inv = 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d))
    freqs = torch.arange(n).float()[:, None] * inv[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


@pytest.mark.parametrize("dtype", DTYPES)
def test_rotary_in_place_is_exact(device: str, dtype: torch.dtype) -> None:
    tokens, hq, hk, d = 5, 6, 2, 24
    g = torch.Generator().manual_seed(3)
    q = torch.randn(tokens, hq, d, generator=g).to(dtype)
    k = torch.randn(tokens, hk, d, generator=g).to(dtype)
    cos, sin = _tables(d, 64)
    pos = torch.tensor([0, 9, 10, 63, 1])
    q_ref, k_ref = q.clone(), k.clone()
    rotary_ref_(q_ref, k_ref, cos, sin, pos)
    qd, kd = q.clone().to(device), k.clone().to(device)
    rotary_triton_(qd, kd, cos.to(device), sin.to(device), pos.to(device))
    assert torch.equal(qd.cpu(), q_ref) and torch.equal(kd.cpu(), k_ref)
    assert not torch.equal(q_ref, q)  # it did rotate


def test_rotary_reference_is_the_layer_math() -> None:
    from ftrs.layers.rotary import Rotary

    rot = Rotary(16, 10000.0, 32, None, torch.device("cpu"))
    q = torch.randn(3, 4, 16, dtype=torch.bfloat16)
    k = torch.randn(3, 2, 16, dtype=torch.bfloat16)
    pos = torch.tensor([2, 0, 31])
    want_q, want_k = rot.apply(q, pos), rot.apply(k, pos)
    rotary_ref_(q, k, rot.cos, rot.sin, pos)
    assert torch.equal(q, want_q) and torch.equal(k, want_k)


def test_rotary_on_strided_views(device: str) -> None:
    """q and k as views into one fused qkv projection output."""
    tokens, hq, hk, d = 3, 3, 1, 8
    qkv = torch.randn(tokens, (hq + 2 * hk) * d).to(device)
    q = qkv[:, : hq * d].view(tokens, hq, d)
    k = qkv[:, hq * d:(hq + hk) * d].view(tokens, hk, d)
    v_before = qkv[:, (hq + hk) * d:].clone()
    cos, sin = _tables(d, 8)
    pos = torch.tensor([1, 2, 7])
    q_ref, k_ref = q.cpu().clone(), k.cpu().clone()
    rotary_ref_(q_ref, k_ref, cos, sin, pos)
    rotary_triton_(q, k, cos.to(device), sin.to(device), pos.to(device))
    torch.testing.assert_close(q.cpu(), q_ref, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(k.cpu(), k_ref, rtol=1e-6, atol=1e-6)
    assert torch.equal(qkv[:, (hq + hk) * d:], v_before)  # v untouched
