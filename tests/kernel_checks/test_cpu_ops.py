"""The Rust CPU ops (`ftrs.kernels.cpu`) against the torch references they stand in for.

Tolerances from the math: the rotary has no reduction and no fused multiply-add, so it is the
reference bit for bit. The norm's mean of squares is summed in f64 where torch sums fp32
lanes: the two scales differ by a few fp32 roundings of the sum (relative ~n * 2^-24 at worst
for n = 576, far less in practice), so outputs agree to 2e-6 relative. The attention's dot
products and weighted sums run in another order than a BLAS matmul: each output is a convex
combination of values in [-1, 1], off by a few roundings of its ~64-term sums, so 1e-5 absolute.
"""

from __future__ import annotations

import pytest
import torch

from ftrs.errors import ConfigError
from ftrs.kernels import cpu
from ftrs.kernels.norm import rms_norm_ref, rotary_ref_
from ftrs.kvcache.quant import gather as kv_gather
from ftrs.kvcache.quant import quantize_rows
from ftrs.layers.attention import decode_attention
from ftrs.layers.rotary import Rotary, rotate

pytestmark = pytest.mark.skipif(not cpu.available(), reason="ftrs._core built without the CPU ops")


def _rand(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("shape", [(1, 576), (5, 64), (3, 2, 40), (0, 32)])
def test_rms_norm_matches_the_reference(shape: tuple[int, ...]) -> None:
    x, res = _rand(*shape, seed=1) * 3, _rand(*shape, seed=2)
    w = _rand(shape[-1], seed=3)
    out, none = cpu.rms_norm_cpu(x, w, 1e-6)
    ref, _ = rms_norm_ref(x, w, 1e-6)
    assert none is None and out.shape == x.shape
    torch.testing.assert_close(out, ref, rtol=2e-6, atol=1e-6)
    out, total = cpu.rms_norm_cpu(x, w, 1e-6, residual=res)
    ref, ref_total = rms_norm_ref(x, w, 1e-6, residual=res)
    assert total is not None and ref_total is not None
    assert torch.equal(total, ref_total)  # the residual add is one fp32 add either way
    torch.testing.assert_close(out, ref, rtol=2e-6, atol=1e-6)


def test_rms_norm_hands_other_dtypes_and_views_to_the_reference() -> None:
    x, res, w = _rand(4, 64, seed=4), _rand(4, 64, seed=5), _rand(64, seed=6)
    for args in ((x.bfloat16(), w.bfloat16(), 1e-5, res.bfloat16()), (x.t(), _rand(4, seed=7), 1e-5)):
        got, ref = cpu.rms_norm_cpu(*args), rms_norm_ref(*args)
        assert torch.equal(got[0], ref[0])


def test_rotary_is_the_reference_bit_for_bit() -> None:
    rot = Rotary(64, 10000.0, 256, None, torch.device("cpu"))
    q, k = _rand(6, 9, 64, seed=8), _rand(6, 3, 64, seed=9)
    pos = torch.tensor([0, 5, 17, 255, 3, 3])
    q1, k1, q2, k2 = q.clone(), k.clone(), q.clone(), k.clone()
    cpu.rotary_cpu_(q1, k1, rot.cos, rot.sin, pos)
    rotary_ref_(q2, k2, rot.cos, rot.sin, pos)
    assert torch.equal(q1, q2) and torch.equal(k1, k2)
    table = rot.table(pos, torch.float32)  # the decoder's torch path
    assert torch.equal(q1, rotate(q, *table)) and torch.equal(k1, rotate(k, *table))
    with pytest.raises(ConfigError, match="position 256"):
        cpu.rotary_cpu_(q1, k1, rot.cos, rot.sin, torch.tensor([0, 1, 2, 3, 4, 256]))


def test_rotary_hands_views_to_the_reference() -> None:
    rot = Rotary(32, 10000.0, 16, None, torch.device("cpu"))
    base = _rand(2, 4, 64, seed=10)
    q = base[..., :32]  # a strided view (as an output-gated query)
    k = _rand(2, 1, 32, seed=11)
    want_q, want_k = q.clone(), k.clone()
    rotary_ref_(want_q, want_k, rot.cos, rot.sin, torch.tensor([1, 2]))
    cpu.rotary_cpu_(q, k, rot.cos, rot.sin, torch.tensor([1, 2]))
    assert torch.equal(q, want_q) and torch.equal(k, want_k)


@pytest.mark.parametrize("int8", [False, True], ids=["fp32", "int8"])
@pytest.mark.parametrize("padded", [True, False])
def test_decode_attention_matches_the_torch_path(padded: bool, int8: bool) -> None:
    """fp32 caches, and int8 ones (`--kv-cache-dtype int8`) against the torch path over the
    same rows (`kvcache.quant.gather` widens and scales them)."""
    slots, kv_heads, d, rows, keys = 50, 3, 64, 4, 12
    k_cache, v_cache = _rand(slots, kv_heads, d, seed=12), _rand(slots, kv_heads, d, seed=13)
    k_scale = v_scale = None
    if int8:
        (k_cache, k_scale), (v_cache, v_scale) = quantize_rows(k_cache), quantize_rows(v_cache)
    q = _rand(rows, 9, d, seed=14)
    gather = torch.randint(0, slots, (rows, keys), generator=torch.Generator().manual_seed(15))
    mask = None
    if padded:  # rows of 12, 7, 1 and 10 real keys, the rest padding at slot 0
        lens = torch.tensor([12, 7, 1, 10])
        real = torch.arange(keys)[None, :] < lens[:, None]
        gather = gather.masked_fill(~real, 0)
        mask = real.view(rows, 1, 1, keys)
    got = cpu.decode_attention_cpu(q, k_cache, v_cache, gather, mask, 0.125, k_scale=k_scale,
                                   v_scale=v_scale)
    ref = decode_attention(q, kv_gather(k_cache, k_scale, gather, q.dtype),
                           kv_gather(v_cache, v_scale, gather, q.dtype), mask, 0.125)
    assert got is not None
    torch.testing.assert_close(got, ref, rtol=0, atol=1e-5)


def test_decode_attention_declines_what_it_does_not_cover() -> None:
    cache = _rand(8, 1, 16, seed=16)
    q = _rand(1, 2, 16, seed=17)
    gather = torch.zeros(1, 3, dtype=torch.int64)
    assert cpu.decode_attention_cpu(q.bfloat16(), cache.bfloat16(), cache.bfloat16(), gather,
                                    None, 1.0) is None
    assert cpu.decode_attention_cpu(q, cache, cache, gather.int(), None, 1.0) is None
    codes, scales = quantize_rows(cache)
    assert cpu.decode_attention_cpu(q, codes, codes, gather, None, 1.0,
                                    k_scale=scales.double(), v_scale=scales.double()) is None
    with pytest.raises(ConfigError, match="k_scale"):  # the binding: scales in pairs
        cpu._core().ops_decode_attention(q.numpy(), codes.numpy(), codes.numpy(), gather.numpy(),
                                         None, 1.0, torch.empty_like(q).numpy(), 2, 1, 16,
                                         k_scale=scales.numpy())
    with pytest.raises(ConfigError, match="slot 8 outside"):
        cpu.decode_attention_cpu(q, cache, cache, torch.tensor([[0, 8, 1]]), None, 1.0)
