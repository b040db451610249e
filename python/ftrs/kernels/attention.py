# mypy: allow-untyped-defs
# (Triton reads the annotations of @triton.jit functions itself: its kernels carry none but tl.constexpr.)
"""Attention over the paged KV cache read through a block table: decode and chunked prefill.

The cache of one layer is `(num_slots, kv_heads, head_dim)`; page `p` is slots
`[p*page_size, (p+1)*page_size)` (`layers/attention.py`, `kvcache/pages.py`). A sequence's
context position `j` lives at slot `block_table[seq, j // page_size] * page_size + j % page_size`.
The kernel reads keys and values from those slots directly: no gather, no padding to the
longest context, and a sequence's work ends at its own length.

One launch serves a whole mixed batch. Sequence `b` has `q_len[b]` query rows starting at row
`q_start[b]` of `q`, and `ctx_len[b]` keys already in the cache (this step's included); its
query `t` sits at position `ctx_len - q_len + t` and sees keys up to there (causal; a decode
row sees the whole context). A program takes one sequence, one kv head and a block of its
query rows, and stacks the group's query heads (GQA) under each row, so K and V are read once
per group. Online softmax in fp32 (flash attention).

The caller writes this step's keys and values into the cache first (as `paged_attention` does).
Tolerance against the torch reference: fp32 ~1e-5, bf16/fp16 a few ulps (the exponentials and
sums run in another order, and P is rounded to the model dtype before P·V as SDPA does).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ftrs.kernels._triton import dot_precision, interpreting, next_pow2, triton_importable
from ftrs.kvcache import quant as kvquant


@dataclass(slots=True)
class PagedMeta:
    """Per sequence of the step: where its query rows are and which pages hold its context."""

    block_table: torch.Tensor  # (seqs, max_pages) int32 page ids; entries past a context unused
    q_start: torch.Tensor  # (seqs,) int32 first query row of the sequence in q
    q_len: torch.Tensor  # (seqs,) int32 query rows (1 for decode)
    ctx_len: torch.Tensor  # (seqs,) int32 keys in the cache, this step's included
    max_q_len: int  # host copy of q_len.max(): sizes the grid without a device read
    page_size: int

    @classmethod
    def build(cls, pages: list[list[int]], q_start: list[int], q_len: list[int],
              ctx_len: list[int], page_size: int, device: torch.device) -> PagedMeta:
        """From host lists (one entry per sequence)."""
        width = max((len(p) for p in pages), default=1) or 1
        table = torch.zeros(len(pages), width, dtype=torch.int32)
        for i, p in enumerate(pages):
            table[i, : len(p)] = torch.tensor(p, dtype=torch.int32)

        def ints(v: list[int]) -> torch.Tensor:
            return torch.tensor(v, dtype=torch.int32).to(device)

        return cls(table.to(device), ints(q_start), ints(q_len), ints(ctx_len),
                   max(q_len, default=0), page_size)


def context_slots(meta: PagedMeta, seq: int, end: int) -> torch.Tensor:
    """Cache slots of context positions [0, end) of sequence `seq`."""
    pos = torch.arange(end, device=meta.block_table.device)
    pages = meta.block_table[seq].long()[pos // meta.page_size]
    return pages * meta.page_size + pos % meta.page_size


def paged_attention_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        meta: PagedMeta, scale: float, k_scale: torch.Tensor | None = None,
                        v_scale: torch.Tensor | None = None) -> torch.Tensor:
    """Per sequence: gather its context through the block table, SDPA with the causal mask
    shifted by the cached prefix. `q`: (tokens, heads, d) -> (tokens, heads, d). An int8
    cache comes with its scales (slots, kv_heads) and is read as `kvcache/quant.py` reads it."""
    out = torch.zeros_like(q)
    gqa = q.shape[1] != k_cache.shape[1]
    for b, (qs, ql, cl) in enumerate(zip(meta.q_start.tolist(), meta.q_len.tolist(),
                                         meta.ctx_len.tolist())):
        if ql == 0:
            continue
        slots = context_slots(meta, b, cl)
        qb = q[qs:qs + ql].transpose(0, 1)  # (heads, ql, d)
        kb = kvquant.gather(k_cache, k_scale, slots, q.dtype).transpose(0, 1)  # (kv_heads, cl, d)
        vb = kvquant.gather(v_cache, v_scale, slots, q.dtype).transpose(0, 1)
        mask = torch.ones(ql, cl, dtype=torch.bool, device=q.device).tril(cl - ql)
        ob = F.scaled_dot_product_attention(qb, kb, vb, attn_mask=mask, scale=scale, enable_gqa=gqa)
        out[qs:qs + ql] = ob.transpose(0, 1)
    return out


if triton_importable():
    import triton
    import triton.language as tl

    from ftrs.kernels._triton import round_to

    @triton.jit
    def _paged_attn_kernel(q_ptr, k_ptr, v_ptr, o_ptr, table_ptr, q_start_ptr, q_len_ptr,
                           ctx_len_ptr, ks_ptr, vs_ptr, scale, group, head_dim, stride_qt,
                           stride_qh, stride_ks, stride_kh, stride_ss, stride_ot, stride_oh,
                           stride_table, PAGE: tl.constexpr, GP: tl.constexpr,
                           BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                           UPCAST: tl.constexpr, PREC: tl.constexpr, INT8: tl.constexpr):
        seq = tl.program_id(0)
        kvh = tl.program_id(1)
        qb = tl.program_id(2)
        q_len = tl.load(q_len_ptr + seq)
        if qb * BLOCK_Q >= q_len:
            return
        q0 = tl.load(q_start_ptr + seq).to(tl.int64)
        ctx = tl.load(ctx_len_ptr + seq)
        M: tl.constexpr = BLOCK_Q * GP
        r = tl.arange(0, M)
        t = qb * BLOCK_Q + r // GP  # query index within the sequence
        g = r % GP
        row_ok = (t < q_len) & (g < group)
        head = kvh * group + g
        d = tl.arange(0, BLOCK_D)
        d_ok = d < head_dim
        q_off = (q0 + t).to(tl.int64)[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :]
        q = tl.load(q_ptr + q_off, mask=row_ok[:, None] & d_ok[None, :], other=0.0)
        DT: tl.constexpr = q_ptr.dtype.element_ty
        pos = ctx - q_len + t  # absolute position of each query row
        m_i = tl.full((M,), -1.0e30, dtype=tl.float32)
        l_i = tl.zeros((M,), dtype=tl.float32)
        acc = tl.zeros((M, BLOCK_D), dtype=tl.float32)
        kv_end = tl.minimum(ctx, ctx - q_len + (qb + 1) * BLOCK_Q)  # causal limit of the block
        for n0 in range(0, kv_end, BLOCK_N):
            j = n0 + tl.arange(0, BLOCK_N)
            j_ok = j < kv_end
            page = tl.load(table_ptr + seq * stride_table + j // PAGE, mask=j_ok, other=0)
            slot = page.to(tl.int64) * PAGE + j % PAGE
            kv_off = slot[:, None] * stride_ks + kvh * stride_kh + d[None, :]
            kv_mask = j_ok[:, None] & d_ok[None, :]
            k = tl.load(k_ptr + kv_off, mask=kv_mask, other=0)
            s_off = slot * stride_ss + kvh  # int8: one scale per slot and kv head
            if INT8:  # scaled in fp32, then the compute dtype (`kvcache/quant.py`)
                k_s = tl.load(ks_ptr + s_off, mask=j_ok, other=0.0)
                k = (k.to(tl.float32) * k_s[:, None]).to(DT)
            if UPCAST:
                s = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision="ieee")
            else:
                s = tl.dot(q, tl.trans(k), input_precision=PREC)
            s = s * scale
            seen = (j[None, :] <= pos[:, None]) & j_ok[None, :]
            s = tl.where(seen, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            p = tl.exp(s - m_new[:, None])
            alpha = tl.exp(m_i - m_new)
            l_i = l_i * alpha + tl.sum(p, axis=1)
            v = tl.load(v_ptr + kv_off, mask=kv_mask, other=0)
            if INT8:
                v_s = tl.load(vs_ptr + s_off, mask=j_ok, other=0.0)
                v = (v.to(tl.float32) * v_s[:, None]).to(DT)
            acc = acc * alpha[:, None]
            if UPCAST:
                acc = tl.dot(round_to(p, DT).to(tl.float32), v.to(tl.float32), acc,
                             input_precision="ieee")
            else:
                acc = tl.dot(round_to(p, DT), v, acc, input_precision=PREC)
            m_i = m_new
        o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        o_off = (q0 + t).to(tl.int64)[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :]
        tl.store(o_ptr + o_off, round_to(o, DT), mask=row_ok[:, None] & d_ok[None, :])


def paged_attention_triton(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           meta: PagedMeta, scale: float, k_scale: torch.Tensor | None = None,
                           v_scale: torch.Tensor | None = None) -> torch.Tensor:
    """The kernel behind `paged_attention_ref`'s signature: one launch for the whole batch; an
    int8 cache is read as int8 and each row scaled in registers."""
    _, heads, head_dim = q.shape
    kv_heads = k_cache.shape[1]
    if heads % kv_heads:
        raise ValueError(f"paged attention: {heads} query heads over {kv_heads} kv heads")
    if q.stride(-1) != 1 or k_cache.stride() != v_cache.stride() or k_cache.stride(-1) != 1:
        raise ValueError("paged attention: q and the caches need a unit last stride, "
                         "and both caches the same layout")
    int8 = k_scale is not None or v_scale is not None
    if int8 and not (k_scale is not None and v_scale is not None
                     and k_cache.dtype == v_cache.dtype == torch.int8
                     and k_scale.stride() == v_scale.stride() and k_scale.stride(-1) == 1
                     and k_scale.shape == k_cache.shape[:2]):
        raise ValueError("paged attention: an int8 cache needs int8 keys and values and both "
                         "scales (slots, kv_heads) in one layout")
    ks, vs = (k_scale, v_scale) if k_scale is not None and v_scale is not None else (q, q)
    out = torch.zeros_like(q)
    seqs = meta.q_len.numel()
    if seqs == 0 or meta.max_q_len == 0:
        return out
    group = heads // kv_heads
    gp = next_pow2(group)
    block_q = max(1, 16 // gp)  # at least 16 rows per dot
    if meta.max_q_len > block_q:
        block_q = min(next_pow2(meta.max_q_len), max(block_q, 64 // gp))
    grid = (seqs, kv_heads, triton.cdiv(meta.max_q_len, block_q))
    _paged_attn_kernel[grid](
        q, k_cache, v_cache, out, meta.block_table, meta.q_start, meta.q_len, meta.ctx_len,
        ks, vs, scale, group, head_dim, q.stride(0), q.stride(1), k_cache.stride(0),
        k_cache.stride(1), ks.stride(0) if int8 else 0,
        out.stride(0), out.stride(1), meta.block_table.stride(0), PAGE=meta.page_size, GP=gp,
        BLOCK_Q=block_q, BLOCK_N=32, BLOCK_D=max(16, next_pow2(head_dim)), UPCAST=interpreting(),
        PREC=dot_precision(q.dtype), INT8=int8, enable_fp_fusion=False)
    return out
