"""Fused MoE over cache slots against its torch reference, and the reference against layers.moe."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ftrs.kernels.moe import SlotWeights, dequant_q8_0, fused_moe_ref, fused_moe_triton

H, INTER, E = 40, 24, 5  # hidden and intermediate sizes that no block size divides


def _case(dtype: torch.dtype, tokens: int = 7, seed: int = 0) -> tuple[torch.Tensor, ...]:
    """Expert 0 gets no token, expert 1 one token, expert 2 every token; k = 2."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, H, generator=g).to(dtype)
    other = torch.tensor([3, 4])[torch.arange(tokens) % 2]
    other[tokens // 2] = 1
    ids = torch.stack((torch.full((tokens,), 2), other), dim=1)
    ids[::3] = ids[::3].flip(1)  # the pair order within a token must not matter
    w = torch.rand(tokens, 2, generator=g)
    w = (w / w.sum(1, keepdim=True)).to(dtype)
    return x, ids, w


def _weights(dtype: torch.dtype, slots: int = 6, seed: int = 1) -> SlotWeights:
    g = torch.Generator().manual_seed(seed)
    return SlotWeights((torch.randn(slots, INTER, H, generator=g) / H**0.5).to(dtype),
                       (torch.randn(slots, INTER, H, generator=g) / H**0.5).to(dtype),
                       (torch.randn(slots, H, INTER, generator=g) / INTER**0.5).to(dtype))


SLOT_OF = torch.tensor([5, 0, 3, 1, 4])  # experts live in scattered slots


def _to(device: str, *ts: torch.Tensor) -> list[torch.Tensor]:
    return [t.to(device) for t in ts]


def _close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    """fp32: dot products summed in another order (1e-5 of the largest output); bf16/fp16: a few
    roundings of the intermediate activations, bounded by 2 ulps of the largest output."""
    if dtype == torch.float32:
        scale = max(1.0, float(want.abs().max()))
        torch.testing.assert_close(got.cpu(), want, rtol=1e-5, atol=1e-5 * scale)
    else:
        bound = 2 * torch.finfo(dtype).eps * float(want.float().abs().max())
        assert float((got.cpu().float() - want.float()).abs().max()) <= bound


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_fused_moe_matches_reference(device: str, dtype: torch.dtype) -> None:
    x, ids, rw = _case(dtype)
    w = _weights(dtype)
    want = fused_moe_ref(x, ids, rw, SLOT_OF, w)
    got = fused_moe_triton(*_to(device, x, ids, rw, SLOT_OF), SlotWeights(*_to(device, *w[:3])))
    _close(got, want, dtype)
    assert want.abs().min(dim=1).values.gt(0).all()  # every token got a contribution


def test_fused_moe_all_tokens_one_expert_over_several_blocks(device: str) -> None:
    tokens = 37  # > 2 blocks of 16 rows for the one expert every token shares
    x, ids, rw = _case(torch.float32, tokens=tokens, seed=4)
    w = _weights(torch.float32)
    want = fused_moe_ref(x, ids, rw, SLOT_OF, w)
    got = fused_moe_triton(*_to(device, x, ids, rw, SLOT_OF), SlotWeights(*_to(device, *w[:3])))
    _close(got, want, torch.float32)


def test_fused_moe_one_token(device: str) -> None:
    x, ids, rw = _case(torch.bfloat16, tokens=1, seed=2)
    w = _weights(torch.bfloat16)
    want = fused_moe_ref(x, ids, rw, SLOT_OF, w)
    got = fused_moe_triton(*_to(device, x, ids, rw, SLOT_OF), SlotWeights(*_to(device, *w[:3])))
    _close(got, want, torch.bfloat16)


def test_fused_moe_waves_add_up_to_one_call_bit_for_bit(device: str) -> None:
    """Experts absent from the slot table are skipped; two waves (low ids, then high ids) onto
    the same `out` add in the same order as one call with every expert."""
    x, ids, rw = _to(device, *_case(torch.bfloat16, seed=3))
    w = SlotWeights(*_to(device, *_weights(torch.bfloat16)[:3]))
    slot_of = SLOT_OF.to(device)
    whole = fused_moe_triton(x, ids, rw, slot_of, w)
    low = torch.where(torch.arange(E, device=device) <= 2, slot_of, -1)
    high = torch.where(torch.arange(E, device=device) > 2, slot_of, -1)
    out = fused_moe_triton(x, ids, rw, low, w)
    partial = out.clone()
    fused_moe_triton(x, ids, rw, high, w, out=out)
    assert torch.equal(out, whole)
    assert not torch.equal(partial, whole)
    ref_low = fused_moe_ref(x.cpu(), ids.cpu(), rw.cpu(), low.cpu(),
                            SlotWeights(*(t.cpu() for t in w[:3])))
    _close(partial, ref_low, torch.bfloat16)


def test_fused_moe_no_tokens(device: str) -> None:
    w = SlotWeights(*_to(device, *_weights(torch.float32)[:3]))
    x = torch.zeros(0, H, device=device)
    ids = torch.zeros(0, 2, dtype=torch.long, device=device)
    out = fused_moe_triton(x, ids, torch.zeros(0, 2, device=device), SLOT_OF.to(device), w)
    assert out.shape == (0, H)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reference_is_combine_experts(dtype: torch.dtype) -> None:
    """The kernel's reference computes exactly what every MoE strategy computes."""
    from ftrs.layers.moe import combine_experts

    x, ids, rw = _case(dtype)
    w = _weights(dtype)
    want = torch.zeros_like(x)
    present = [e for e in torch.unique(ids).tolist() if int(SLOT_OF[e]) >= 0]
    combine_experts(x, ids, rw, present,
                    lambda e: (w.gate[SLOT_OF[e]], w.up[SLOT_OF[e]], w.down[SLOT_OF[e]]), want)
    assert torch.equal(fused_moe_ref(x, ids, rw, SLOT_OF, w), want)


def _q8_0_bytes(m: torch.Tensor) -> torch.Tensor:
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize

    raw = quantize(m.float().numpy(), GGMLQuantizationType.Q8_0)
    return torch.from_numpy(np.ascontiguousarray(raw)).view(torch.uint8)


def test_dequant_q8_0_matches_gguf() -> None:
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    m = torch.randn(3, 64)
    raw = _q8_0_bytes(m)
    want = dequantize(raw.numpy(), GGMLQuantizationType.Q8_0)
    assert torch.equal(dequant_q8_0(raw, torch.float32), torch.from_numpy(want))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_moe_q8_0_dequantizes_in_kernel(device: str, dtype: torch.dtype) -> None:
    h, i = 64, 32  # whole 32-value blocks
    g = torch.Generator().manual_seed(9)
    slots = 4
    gate = torch.stack([_q8_0_bytes(torch.randn(i, h, generator=g) / 8) for _ in range(slots)])
    up = torch.stack([_q8_0_bytes(torch.randn(i, h, generator=g) / 8) for _ in range(slots)])
    down = torch.stack([_q8_0_bytes(torch.randn(h, i, generator=g) / 6) for _ in range(slots)])
    w = SlotWeights(gate, up, down, "Q8_0")
    x = torch.randn(5, h, generator=g).to(dtype)
    ids = torch.tensor([[0, 2], [2, 3], [3, 0], [2, 0], [1, 2]])
    rw = torch.full((5, 2), 0.5).to(dtype)
    slot_of = torch.tensor([3, -1, 0, 2])
    want = fused_moe_ref(x, ids, rw, slot_of, w)
    got = fused_moe_triton(*_to(device, x, ids, rw, slot_of),
                           SlotWeights(*_to(device, gate, up, down), "Q8_0"))
    _close(got, want, dtype)


def test_pairs_filled_in_two_calls_combine_bit_for_bit(device: str) -> None:
    """Experts that landed first, then the rest, into one pair buffer: the same sum as one call."""
    from ftrs.kernels.moe import combine_pairs, moe_pairs_triton

    x, ids, rw = _to(device, *_case(torch.float32, seed=6))
    w = SlotWeights(*_to(device, *_weights(torch.float32)[:3]))
    slot_of = SLOT_OF.to(device)
    landed = torch.where(torch.tensor([0, 1, 0, 1, 1], device=device).bool(), slot_of, -1)
    rest = torch.where(landed < 0, slot_of, -1)
    y = moe_pairs_triton(x, ids, rw, landed, w)
    moe_pairs_triton(x, ids, rw, rest, w, y=y)
    got = combine_pairs(y, ids, torch.zeros_like(x))
    assert torch.equal(got, fused_moe_triton(x, ids, rw, slot_of, w))


def test_slot_views_over_a_region_read_each_block() -> None:
    """Views over a byte region with padded blocks see exactly the bytes of each slot's tensors."""
    from ftrs.kernels.moe import SlotWeights as SW

    slots, h, inter = 3, 8, 4
    sizes = [inter * h * 2, inter * h * 2, h * inter * 2]  # bf16
    offsets = [0, 128, 256]
    slot_bytes = 384
    region = torch.zeros(slots * slot_bytes, dtype=torch.uint8)
    want = []
    for s in range(slots):
        mats = [torch.randn(inter, h).bfloat16(), torch.randn(inter, h).bfloat16(),
                torch.randn(h, inter).bfloat16()]
        for m, off, n in zip(mats, offsets, sizes, strict=True):
            region[s * slot_bytes + off:s * slot_bytes + off + n] = m.view(-1).view(torch.uint8)
        want.append(mats)
    w = SW.from_region(region, slots, slot_bytes, offsets, [(inter, h), (inter, h), (h, inter)],
                       torch.bfloat16)
    for s in range(slots):
        assert torch.equal(w.gate[s], want[s][0]) and torch.equal(w.up[s], want[s][1])
        assert torch.equal(w.down[s], want[s][2])
    with pytest.raises(ValueError, match="overrun"):
        SW.from_region(region, slots + 1, slot_bytes, offsets, [(inter, h)] * 2 + [(h, inter)],
                       torch.bfloat16)


def _q4_k_bytes(rows: int, cols: int, g: torch.Generator) -> torch.Tensor:
    """Random Q4_K rows: any bytes are valid except d/dmin, set to small finite halves."""
    raw = torch.randint(0, 256, (rows, cols // 256, 144), generator=g, dtype=torch.uint8)
    halves = (torch.rand(rows, cols // 256, 2, generator=g) * 0.02).half()
    raw[..., 0:4] = halves.view(torch.uint8).view(rows, cols // 256, 4)
    return raw.reshape(rows, -1)


def test_dequant_q4_k_matches_gguf() -> None:
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    from ftrs.kernels.moe import dequant_q4_k

    raw = _q4_k_bytes(3, 512, torch.Generator().manual_seed(0))
    want = dequantize(raw.numpy(), GGMLQuantizationType.Q4_K)
    assert torch.equal(dequant_q4_k(raw, torch.float32), torch.from_numpy(want))


@pytest.mark.parametrize("dtype", [pytest.param(torch.float32, marks=pytest.mark.slow),
                                   torch.bfloat16])
def test_fused_moe_q4_k_dequantizes_in_kernel(device: str, dtype: torch.dtype) -> None:
    h, i, slots = 256, 256, 2  # one super-block per row: the smallest Q4_K matrices
    g = torch.Generator().manual_seed(11)
    gate, up, down = (torch.stack([_q4_k_bytes(r, c, g) for _ in range(slots)])
                      for r, c in ((i, h), (i, h), (h, i)))
    x = (torch.randn(2, h, generator=g) / 4).to(dtype)
    ids = torch.tensor([[0, 1], [1, 0]])
    rw = torch.tensor([[0.75, 0.25], [0.5, 0.5]]).to(dtype)
    slot_of = torch.tensor([1, 0])
    want = fused_moe_ref(x, ids, rw, slot_of, SlotWeights(gate, up, down, "Q4_K"))
    got = fused_moe_triton(*_to(device, x, ids, rw, slot_of),
                           SlotWeights(*_to(device, gate, up, down), "Q4_K"))
    _close(got, want, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_moe_fp8_block_dequantizes_in_kernel(device: str, dtype: torch.dtype) -> None:
    h, i, slots, block = 64, 40, 3, (16, 32)  # the last row tile is partial
    g = torch.Generator().manual_seed(12)
    codes = torch.tensor([c for c in range(256) if c & 0x7F != 0x7F], dtype=torch.uint8)  # no NaN

    def fp8(rows: int, cols: int) -> tuple[torch.Tensor, torch.Tensor]:
        w = codes[torch.randint(0, codes.numel(), (rows, cols), generator=g)].view(torch.float8_e4m3fn)
        sc = torch.rand(-(-rows // block[0]), -(-cols // block[1]), generator=g) / 448 / cols**0.5
        return w, sc

    mats = [[fp8(r, c) for _ in range(slots)] for r, c in ((i, h), (i, h), (h, i))]
    ws = [torch.stack([m[0] for m in per]) for per in mats]
    scs = [torch.stack([m[1] for m in per]) for per in mats]
    assert set(torch.cat([w.view(torch.uint8).flatten() for w in ws]).tolist()) == set(codes.tolist())
    x = torch.randn(5, h, generator=g).to(dtype)
    ids = torch.tensor([[0, 2], [2, 1], [1, 0], [2, 0], [0, 1]])
    rw = torch.full((5, 2), 0.5).to(dtype)
    slot_of = torch.tensor([1, 2, 0])
    want = fused_moe_ref(x, ids, rw, slot_of, SlotWeights(*ws, "FP8_BLOCK", (scs[0], scs[1], scs[2]), block))
    dw, ds = _to(device, *ws), _to(device, *scs)
    got = fused_moe_triton(*_to(device, x, ids, rw, slot_of),
                           SlotWeights(*dw, "FP8_BLOCK", (ds[0], ds[1], ds[2]), block))
    _close(got, want, dtype)


def test_dequant_fp8_block_scales_each_tile() -> None:
    from ftrs.kernels.moe import dequant_fp8_block

    w = torch.ones(3, 5).to(torch.float8_e4m3fn)
    sc = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    want = torch.tensor([[1, 1, 2, 2, 3], [1, 1, 2, 2, 3], [4, 4, 5, 5, 6]], dtype=torch.float32)
    assert torch.equal(dequant_fp8_block(w, sc, (2, 2), torch.float32), want)


@pytest.mark.parametrize(("gate_up", "down", "h", "i"), [
    ("Q5_1", "Q6_K", 96, 256),  # the demo's Q4_K_M layers; 96 columns: a partial BLOCK_K tile
    ("Q6_K", "Q5_1", 256, 160),
    ("Q4_K", "Q6_K", 256, 256),
    ("Q5_1", "Q5_1", 160, 96),
    ("MXFP4", "MXFP4", 96, 160),  # 17-byte blocks: odd row strides
    ("MXFP4", "Q6_K", 160, 256),
    ("IQ4_XS", "IQ4_NL", 256, 96),  # an IQ4_XS file's mix; 18-byte blocks
    ("IQ4_NL", "IQ4_XS", 160, 256),
    ("Q3_K", "Q5_K", 256, 256),  # a Q3_K_M file's mix
    ("Q2_K", "Q3_K", 256, 256),  # a Q2_K file's
    ("Q5_K", "Q6_K", 256, 256),  # a Q5_K_M file's
    ("Q4_0", "Q5_0", 96, 160),  # the legacy blocks, and a K-quant file's fallback rows
    ("Q4_1", "Q8_0", 160, 96),
    ("IQ2_XXS", "IQ3_S", 256, 256),  # unsloth's dynamic IQ2 files' mixes
    ("IQ2_XS", "IQ3_XXS", 256, 256),
    ("IQ1_S", "IQ2_S", 256, 256),
    ("IQ1_M", "IQ4_XS", 256, 256),
])
def test_fused_moe_gguf_types_mixed_per_matrix(device: str, gate_up: str, down: str, h: int,
                                               i: int) -> None:
    from ftrs.quant.fixtures import random_blocks

    slots = 3
    rng = np.random.default_rng(13)

    def stack(qtype: str, rows: int, cols: int) -> torch.Tensor:
        return torch.stack([torch.from_numpy(random_blocks(qtype, rows, cols, rng))
                            for _ in range(slots)])

    gate, up, down_w = stack(gate_up, i, h), stack(gate_up, i, h), stack(down, h, i)
    g = torch.Generator().manual_seed(14)
    x = (torch.randn(5, h, generator=g) / 4).to(torch.bfloat16)
    ids = torch.tensor([[0, 2], [2, 1], [1, 0], [2, 0], [0, 1]])
    rw = torch.full((5, 2), 0.5).to(torch.bfloat16)
    slot_of = torch.tensor([1, 2, 0])
    w = SlotWeights(gate, up, down_w, gate_up, down_qtype=down)
    want = fused_moe_ref(x, ids, rw, slot_of, w)
    assert want.abs().max() > 0
    got = fused_moe_triton(*_to(device, x, ids, rw, slot_of),
                           w._replace(**dict(zip(("gate", "up", "down"),
                                                 _to(device, gate, up, down_w)))))
    _close(got, want, torch.bfloat16)


def test_reference_dequantizes_the_gguf_types_as_gguf() -> None:
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    from ftrs.kernels.moe import dequant_gguf
    from ftrs.quant.fixtures import random_blocks

    rng = np.random.default_rng(15)
    for qtype in ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q5_K", "Q6_K", "MXFP4",
                  "IQ4_NL", "IQ4_XS", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S", "IQ1_S",
                  "IQ1_M"):
        raw = random_blocks(qtype, 4, 512, rng)
        want = dequantize(raw, GGMLQuantizationType[qtype])
        assert torch.equal(dequant_gguf(torch.from_numpy(raw), qtype, torch.float32),
                           torch.from_numpy(want))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("qtype", ["none", "MXFP4"])
def test_fused_moe_gpt_oss_biases_and_clamped_swiglu(device: str, dtype: torch.dtype,
                                                      qtype: str) -> None:
    # gpt_oss's experts: bias rows on gate, up and down, and the clamped SwiGLU; a limit the
    # activations reach, so the clamps act
    from ftrs.quant.fixtures import random_blocks

    h, i, slots = 64, 96, 6
    x, ids, rw = _case(dtype)
    x = torch.randn(x.shape[0], h, generator=torch.Generator().manual_seed(21)).to(dtype) * 3
    if qtype == "none":
        g = torch.Generator().manual_seed(22)
        w = SlotWeights(*((torch.randn(slots, r, c, generator=g) / c**0.5).to(dtype)
                          for r, c in ((i, h), (i, h), (h, i))))
    else:
        rng = np.random.default_rng(23)
        gate, up, down = (torch.stack([torch.from_numpy(random_blocks(qtype, r, c, rng))
                                       for _ in range(slots)]) for r, c in ((i, h), (i, h), (h, i)))
        w = SlotWeights(gate, up, down, qtype)
    g = torch.Generator().manual_seed(24)
    biases = tuple((torch.randn(slots, n, generator=g) * 0.5).to(dtype) for n in (i, i, h))
    w = w._replace(biases=biases, clamp=(1.702, 0.7))
    want = fused_moe_ref(x, ids, rw, SLOT_OF, w)
    plain = fused_moe_ref(x, ids, rw, SLOT_OF, w._replace(biases=None, clamp=None))
    assert not torch.equal(want, plain)  # the biases and the clamp change the result
    dev = _to(device, *w.biases)
    got = fused_moe_triton(*_to(device, x, ids, rw, SLOT_OF),
                           w._replace(gate=w.gate.to(device), up=w.up.to(device),
                                      down=w.down.to(device), biases=tuple(dev)))
    _close(got, want, dtype)


def _nvfp4_slots(rows: int, cols: int, slots: int, rng: np.random.Generator
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """(slots, rows, row bytes) NVFP4 blocks (every scale byte's kind: zero, subnormal, 0x7F,
    bit 7 set, which the format ignores) and (slots,) fp32 tensor scales of one matrix."""
    from ftrs.quant.fixtures import random_blocks

    raw = np.stack([random_blocks("NVFP4", rows, cols, rng) for _ in range(slots)])
    raw[:, 0, :4] = [0x00, 0x05, 0x7F, 0xB8]
    return torch.from_numpy(raw), torch.from_numpy(rng.uniform(2e-4, 1e-3, slots).astype(np.float32))


def test_reference_dequantizes_nvfp4_as_gguf_times_the_tensor_scale() -> None:
    gguf = pytest.importorskip("gguf")
    if not hasattr(gguf.GGMLQuantizationType, "NVFP4"):
        pytest.skip("this gguf package has no NVFP4")
    from ftrs.kernels.moe_ref import dequant_nvfp4

    raw, ts = _nvfp4_slots(3, 128, 1, np.random.default_rng(16))
    blocks = gguf.quants.dequantize(raw[0].numpy(), gguf.GGMLQuantizationType.NVFP4)
    want = torch.from_numpy(np.asarray(blocks, dtype=np.float32)) * ts[0]
    assert torch.equal(dequant_nvfp4(raw[0], ts[0], torch.float32), want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_moe_nvfp4_dequantizes_in_kernel(device: str, dtype: torch.dtype) -> None:
    """ModelOpt's NVFP4 experts: blocks in the slot, the tensor scale of each slot's matrix
    read beside them; 192 columns: three 64-value blocks, a partial BLOCK_K tile."""
    h, i, slots = 192, 128, 3
    rng = np.random.default_rng(17)
    (gate, gs), (up, us), (down, ds) = (_nvfp4_slots(r, c, slots, rng)
                                        for r, c in ((i, h), (i, h), (h, i)))
    g = torch.Generator().manual_seed(18)
    x = torch.randn(5, h, generator=g).to(dtype)
    ids = torch.tensor([[0, 2], [2, 1], [1, 0], [2, 0], [0, 1]])
    rw = torch.full((5, 2), 0.5).to(dtype)
    slot_of = torch.tensor([1, 2, 0])
    w = SlotWeights(gate, up, down, "NVFP4", scales=(gs, us, ds))
    want = fused_moe_ref(x, ids, rw, slot_of, w)
    unscaled = fused_moe_ref(x, ids, rw, slot_of, w._replace(scales=(gs * 2, us, ds)))
    assert not torch.equal(want, unscaled)  # the reference reads each tensor scale
    dev = _to(device, gate, up, down, gs, us, ds)
    got = fused_moe_triton(*_to(device, x, ids, rw, slot_of),
                           SlotWeights(*dev[:3], "NVFP4", scales=(dev[3], dev[4], dev[5])))
    _close(got, want, dtype)
    with pytest.raises(ValueError, match="NVFP4 gate/up need a NVFP4 down"):
        fused_moe_triton(x, ids, rw, slot_of, w._replace(down_qtype="Q8_0"))
    with pytest.raises(ValueError, match="one fp32 tensor scale per slot"):
        fused_moe_triton(x, ids, rw, slot_of, w._replace(scales=None))
