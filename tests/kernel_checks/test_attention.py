"""Paged attention through a block table against its torch reference, and the reference
against `layers.attention.paged_attention` (the gather + padded SDPA the decoder runs now)."""

from __future__ import annotations

import pytest
import torch

from ftrs.kernels.attention import (
    PagedMeta,
    context_slots,
    paged_attention_ref,
    paged_attention_triton,
)

PAGE, HEADS, KV_HEADS, D = 4, 6, 2, 24  # GQA ratio 3, a head size no block divides
NUM_PAGES = 24


def _batch(specs: list[tuple[int, int]], seed: int) -> tuple[PagedMeta, list[list[int]]]:
    """`specs`: (q_len, ctx_len) per sequence; pages handed out scrambled, last ones partly used.
    Query rows of the sequences are laid out in reverse order, as nothing says they are sorted."""
    g = torch.Generator().manual_seed(seed)
    free = torch.randperm(NUM_PAGES, generator=g).tolist()
    pages = [[free.pop() for _ in range(-(-ctx // PAGE))] for _, ctx in specs]
    q_len = [q for q, _ in specs]
    starts, row = [0] * len(specs), 0
    for i in reversed(range(len(specs))):
        starts[i], row = row, row + q_len[i]
    return PagedMeta.build(pages, starts, q_len, [c for _, c in specs], PAGE,
                           torch.device("cpu")), pages


def _tensors(tokens: int, dtype: torch.dtype, seed: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(tokens, HEADS, D, generator=g).to(dtype)
    kc = torch.randn(NUM_PAGES * PAGE, KV_HEADS, D, generator=g).to(dtype)
    vc = torch.randn(NUM_PAGES * PAGE, KV_HEADS, D, generator=g).to(dtype)
    return q, kc, vc


def _on(meta: PagedMeta, device: str) -> PagedMeta:
    return PagedMeta(meta.block_table.to(device), meta.q_start.to(device), meta.q_len.to(device),
                     meta.ctx_len.to(device), meta.max_q_len, meta.page_size)


def _close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    """fp32 to 1e-5; half types within 2 ulps of the largest output (softmax in another order,
    P rounded to the model dtype)."""
    if dtype == torch.float32:
        torch.testing.assert_close(got.cpu(), want, rtol=1e-5, atol=1e-5)
    else:
        bound = 2 * torch.finfo(dtype).eps * float(want.float().abs().max())
        assert float((got.cpu().float() - want.float()).abs().max()) <= bound


DECODE = [(1, 1), (1, 6), (1, 13), (1, 4)]  # a context of one token, partly filled last pages
MIXED = [(1, 9), (5, 13), (7, 7), (1, 1), (3, 3)]  # cached prefixes and whole prompts


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("specs", [DECODE, MIXED], ids=["decode", "mixed"])
def test_paged_attention_matches_reference(device: str, dtype: torch.dtype,
                                           specs: list[tuple[int, int]]) -> None:
    meta, _ = _batch(specs, seed=len(specs))
    q, kc, vc = _tensors(sum(s[0] for s in specs), dtype, seed=1)
    want = paged_attention_ref(q, kc, vc, meta, D**-0.5)
    got = paged_attention_triton(q.to(device), kc.to(device), vc.to(device), _on(meta, device),
                                 D**-0.5)
    _close(got, want, dtype)


def test_paged_attention_long_prefill_over_several_blocks(device: str) -> None:
    specs = [(37, 45), (1, 30)]  # query rows over several programs, keys over several tiles
    meta, _ = _batch(specs, seed=5)
    q, kc, vc = _tensors(38, torch.float32, seed=2)
    want = paged_attention_ref(q, kc, vc, meta, 0.3)
    got = paged_attention_triton(q.to(device), kc.to(device), vc.to(device), _on(meta, device), 0.3)
    _close(got, want, torch.float32)


def test_a_single_key_returns_its_value(device: str) -> None:
    """Independent of any softmax: one key in context means the output is that key's value."""
    meta, pages = _batch([(1, 1)], seed=0)
    q, kc, vc = _tensors(1, torch.float32, seed=3)
    got = paged_attention_triton(q.to(device), kc.to(device), vc.to(device), _on(meta, device), 1.0)
    slot = pages[0][0] * PAGE
    want = vc[slot].repeat_interleave(HEADS // KV_HEADS, dim=0)
    torch.testing.assert_close(got.cpu()[0], want, rtol=1e-6, atol=1e-6)


def test_reference_is_the_layer() -> None:
    """The kernel's reference equals the decoder's gather + SDPA path on the same batch."""
    from ftrs.layers.attention import AttnMetadata, PrefillSpan, paged_attention

    meta, _ = _batch(MIXED, seed=len(MIXED))
    q, kc, vc = _tensors(sum(s[0] for s in MIXED), torch.float32, seed=1)
    decode_rows, decode_ctx, prefills, new_slots = [], [], [], []
    for b, (qs, ql, cl) in enumerate(zip(meta.q_start.tolist(), meta.q_len.tolist(),
                                         meta.ctx_len.tolist())):
        ctx = context_slots(meta, b, cl)
        new_slots.append((qs, ctx[cl - ql:]))
        if ql == 1:
            decode_rows.append(qs)
            decode_ctx.append(ctx)
        else:
            prefills.append(PrefillSpan(qs, ql, ctx))
    width = max(c.numel() for c in decode_ctx)
    gather = torch.zeros(len(decode_ctx), width, dtype=torch.long)
    mask = torch.zeros(len(decode_ctx), 1, 1, width, dtype=torch.bool)
    for i, c in enumerate(decode_ctx):
        gather[i, : c.numel()] = c
        mask[i, 0, 0, : c.numel()] = True
    slot_mapping = torch.zeros(q.shape[0], dtype=torch.long)
    for qs, s in new_slots:
        slot_mapping[qs:qs + s.numel()] = s
    layer_meta = AttnMetadata(slot_mapping, torch.tensor(decode_rows), gather, mask, prefills)
    k_new, v_new = kc[slot_mapping], vc[slot_mapping]  # rewriting what is there already
    want = paged_attention(q, k_new, v_new, kc.clone(), vc.clone(), layer_meta, D**-0.5)
    torch.testing.assert_close(paged_attention_ref(q, kc, vc, meta, D**-0.5), want,
                               rtol=1e-6, atol=1e-6)


def test_empty_batch(device: str) -> None:
    meta = PagedMeta.build([], [], [], [], PAGE, torch.device(device))
    q = torch.zeros(0, HEADS, D, device=device)
    kc = torch.zeros(PAGE, KV_HEADS, D, device=device)
    assert paged_attention_triton(q, kc, kc, meta, 1.0).shape == (0, HEADS, D)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_cache(device: str, dtype: torch.dtype) -> None:
    """An int8 cache (`--kv-cache-dtype int8`): each row scaled in the kernel = the reference
    over a plain cache holding `q * s` in the compute dtype, written here by hand."""
    from ftrs.kvcache.quant import quantize_rows

    meta, _ = _batch(MIXED, seed=3)
    q, kc, vc = _tensors(sum(s[0] for s in MIXED), dtype, seed=4)
    (kq, ks), (vq, vs) = quantize_rows(kc), quantize_rows(vc)
    k_vals = (kq.float() * ks[..., None]).to(dtype)
    v_vals = (vq.float() * vs[..., None]).to(dtype)
    want = paged_attention_ref(q, k_vals, v_vals, meta, D**-0.5)
    got = paged_attention_triton(q.to(device), kq.to(device), vq.to(device), _on(meta, device),
                                 D**-0.5, k_scale=ks.to(device), v_scale=vs.to(device))
    _close(got, want, dtype)
    ref = paged_attention_ref(q, kq, vq, meta, D**-0.5, k_scale=ks, v_scale=vs)
    _close(ref, want, dtype)
    with pytest.raises(ValueError, match="int8"):
        paged_attention_triton(q.to(device), kq.to(device), vq.to(device), _on(meta, device),
                               D**-0.5, k_scale=ks.to(device))
