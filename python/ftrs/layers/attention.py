"""Attention over a paged KV cache, for a batch that mixes decode tokens and prefill chunks.

The cache of one layer is a flat array of token slots, `(num_slots, kv_heads, head_dim)`; a
sequence's keys live at the slots its page table names. A step writes the new keys and values
at `slot_mapping`, then reads each sequence's whole context back by gathering its slots:
- decode rows (one query each) are attended together, padded to the longest context, masked;
  with one query per row the scores are a small batched GEMV, computed directly (two matmuls
  and a softmax): the CPU's fused SDPA kernel costs far more than the math on such shapes
  (measured on the demo: ~25 ms against ~0.1 ms per layer under load);
- each prefill chunk is attended on its own with a causal mask shifted by the tokens already
  cached, so a chunked prefill computes exactly what one full pass would.
Everything that depends only on the batch (gathers, masks) is built once per step by
`engine.batch`, not once per layer.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from ftrs.layers.deltanet import LinearMeta


@dataclass(slots=True)
class PrefillSpan:
    """One sequence's prefill chunk: query rows [q_start, q_start+q_len) of the batch."""

    q_start: int
    q_len: int
    gather: torch.Tensor  # (ctx_len,) int64 slots of the whole context, this chunk included
    # (q_len, ctx_len) bool, True where a key is visible; None: build it (or plain causal)
    mask: torch.Tensor | None = None


def prefill_mask(q_len: int, ctx: int, device: torch.device) -> torch.Tensor | None:
    """Causal mask of a chunk of `q_len` queries ending a context of `ctx` keys (None when the
    chunk is the whole context: SDPA's own causal path)."""
    if ctx == q_len:
        return None
    return torch.ones(q_len, ctx, dtype=torch.bool, device=device).tril(ctx - q_len)


@dataclass(slots=True)
class AttnMetadata:
    """Where this step's tokens go in the KV cache and what each of them attends to."""

    slot_mapping: torch.Tensor  # (tokens,) int64: cache slot of every new token
    decode_rows: torch.Tensor  # (num_decode,) int64 query rows that are decode tokens
    decode_gather: torch.Tensor  # (num_decode, max_ctx) int64 slots, padded with slot 0
    # (num_decode, 1, 1, max_ctx) bool, True where a key is real; None: no row is padded
    decode_mask: torch.Tensor | None
    prefills: list[PrefillSpan] = field(default_factory=list)
    decode_only: bool = False  # every row is a decode row, in order (decode_rows = arange)
    linear: LinearMeta | None = None  # state slots of the rows, for linear attention layers


def _gather(cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """`cache[slots]`, through `index_select`: on the CPU it moves the same bytes ~2.5x faster
    than advanced indexing (a decode step of the demo model spends a fifth of its time here)."""
    return cache.index_select(0, slots.reshape(-1)).view(*slots.shape, *cache.shape[1:])


def decode_attention(
    q: torch.Tensor,  # (B, heads, d): one query per row
    k: torch.Tensor,  # (B, L, kv_heads, d)
    v: torch.Tensor,  # (B, L, kv_heads, d)
    mask: torch.Tensor | None,  # (B, 1, 1, L) bool, True where a key is real
    scale: float,
) -> torch.Tensor:  # (B, heads, d)
    b, heads, d = q.shape
    kv_heads = k.shape[2]
    qg = q.view(b, kv_heads, heads // kv_heads, d)  # query heads grouped by their kv head
    kt = k.permute(0, 2, 3, 1)  # (B, kv_heads, d, L)
    scores = torch.matmul(qg, kt) * scale  # (B, kv_heads, group, L)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    return torch.matmul(probs, v.transpose(1, 2)).view(b, heads, d)  # (B, kv_heads, group, d)


def paged_attention(
    q: torch.Tensor,  # (tokens, heads, head_dim)
    k: torch.Tensor,  # (tokens, kv_heads, head_dim)
    v: torch.Tensor,  # (tokens, kv_heads, head_dim)
    k_cache: torch.Tensor,  # (num_slots, kv_heads, head_dim)
    v_cache: torch.Tensor,  # (num_slots, kv_heads, head_dim)
    meta: AttnMetadata,
    scale: float,
) -> torch.Tensor:  # (tokens, heads, head_dim)
    k_cache.index_copy_(0, meta.slot_mapping, k)
    v_cache.index_copy_(0, meta.slot_mapping, v)
    if meta.decode_only:
        return decode_attention(q, _gather(k_cache, meta.decode_gather),
                                _gather(v_cache, meta.decode_gather), meta.decode_mask, scale)
    gqa = q.shape[1] != k.shape[1]  # grouped-query: each kv head serves several query heads
    out = torch.empty_like(q)
    if meta.decode_rows.numel():
        od = decode_attention(q.index_select(0, meta.decode_rows),
                              _gather(k_cache, meta.decode_gather),
                              _gather(v_cache, meta.decode_gather), meta.decode_mask, scale)
        out.index_copy_(0, meta.decode_rows, od)
    for span in meta.prefills:
        rows = slice(span.q_start, span.q_start + span.q_len)
        ctx = span.gather.numel()
        qp = q[rows].transpose(0, 1)  # (heads, n, d)
        kp = _gather(k_cache, span.gather).transpose(0, 1)  # (kv_heads, ctx, d)
        vp = _gather(v_cache, span.gather).transpose(0, 1)
        mask = span.mask if span.mask is not None else prefill_mask(span.q_len, ctx, q.device)
        if mask is None:
            op = F.scaled_dot_product_attention(qp, kp, vp, is_causal=True, scale=scale,
                                                enable_gqa=gqa)
        else:
            op = F.scaled_dot_product_attention(qp, kp, vp, attn_mask=mask, scale=scale,
                                                enable_gqa=gqa)
        out[rows] = op.transpose(0, 1)
    return out
