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
`engine.batch`, not once per layer. On the Triton path (`ftrs.kernels`) the decoder calls the
paged attention kernel instead for its full-attention layers, which reads the cache through
the block tables of `AttnMetadata.paged`; the layers below serve the torch path and the
sliding-window and sink layers, which the kernel does not cover.

Two per-layer variants (gpt_oss), both exact in chunked prefill and decode:
- a sliding window: a query at position p sees keys p - window + 1 .. p only. The cache keeps
  every key; a sliding layer gathers only the slots its queries can see, with masks to match,
  cut once per step per window size (`window_view`) from the positions the gathers imply
  (column j of a context's slots is position j);
- attention sinks: one learned logit per head joins the softmax of every query and is dropped
  after it (the probabilities of the real keys sum to less than one). Those layers attend with
  the explicit two-matmul form, which has a column to put it in.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple

import torch
import torch.nn.functional as F

from ftrs.kvcache import quant as kvquant
from ftrs.layers.deltanet import LinearMeta

if TYPE_CHECKING:  # the kernel modules import Triton: loaded only when a kernel is chosen
    from ftrs.kernels.attention import PagedMeta


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


class WindowView(NamedTuple):
    """One step's keys for one sliding-window size: only the slots a query can see."""

    decode_gather: torch.Tensor  # (num_decode, w) slots, w = min(window, max_ctx)
    decode_mask: torch.Tensor | None  # (num_decode, 1, 1, w) bool; None without decode rows
    prefills: list[tuple[torch.Tensor, torch.Tensor]]  # per span: (slots, (q_len, slots) mask)


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
    windows: dict[int, WindowView] = field(default_factory=dict)  # built by `window_view`
    # block tables of the step's sequences, for the paged attention kernel (the Triton path only)
    paged: PagedMeta | None = None


def window_view(meta: AttnMetadata, window: int) -> WindowView:
    """The step's gathers and masks cut to the last `window` keys of each query (built on first
    use, then shared by every layer with that window): a sliding layer reads O(window) keys."""
    got = meta.windows.get(window)
    if got is not None:
        return got
    gather, mask = meta.decode_gather, None
    if gather.numel():
        rows, width = gather.shape
        w = min(window, width)
        if meta.decode_mask is None:
            lens = torch.full((rows, 1), width, device=gather.device)
        else:
            lens = meta.decode_mask.view(rows, width).sum(dim=1, keepdim=True)
        # a decode query is its row's last real key, at position lens - 1: it sees lens - w ..
        # lens - 1, the negative positions of a short row masked out
        pos = lens - w + torch.arange(w, device=gather.device)
        gather = gather.gather(1, pos.clamp(min=0))
        mask = (pos >= 0).view(rows, 1, 1, w)
    prefills = []
    for span in meta.prefills:
        ctx = span.gather.numel()
        first = ctx - span.q_len  # position of the chunk's first query
        lo = max(0, first - window + 1)  # the oldest key any query of the chunk sees
        vis = torch.ones(span.q_len, ctx - lo, dtype=torch.bool, device=span.gather.device)
        # query i (position first + i) sees keys j with first + i - window < j <= first + i
        prefills.append((span.gather[lo:], vis.tril(first - lo).triu(first - lo - window + 1)))
    got = meta.windows[window] = WindowView(gather, mask, prefills)
    return got


def decode_attention(
    q: torch.Tensor,  # (B, heads, d): one query per row
    k: torch.Tensor,  # (B, L, kv_heads, d)
    v: torch.Tensor,  # (B, L, kv_heads, d)
    mask: torch.Tensor | None,  # (B, 1, 1, L) bool, True where a key is real
    scale: float,
    sinks: torch.Tensor | None = None,  # (heads,) logits that join every softmax
) -> torch.Tensor:  # (B, heads, d)
    b, heads, d = q.shape
    kv_heads = k.shape[2]
    qg = q.view(b, kv_heads, heads // kv_heads, d)  # query heads grouped by their kv head
    kt = k.permute(0, 2, 3, 1)  # (B, kv_heads, d, L)
    scores = torch.matmul(qg, kt) * scale  # (B, kv_heads, group, L)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    probs = _softmax(scores, None if sinks is None else sinks.view(kv_heads, -1, 1))
    return torch.matmul(probs, v.transpose(1, 2)).view(b, heads, d)  # (B, kv_heads, group, d)


def _softmax(scores: torch.Tensor, sinks: torch.Tensor | None) -> torch.Tensor:
    """Softmax over the last dim of `scores`; with `sinks` (shaped to broadcast against
    `scores[..., :1]`), each head's sink joins as one more column, then is dropped."""
    if sinks is None:
        return torch.softmax(scores, dim=-1)
    sink = sinks.to(scores.dtype).expand(*scores.shape[:-1], 1)
    return torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]


def prefill_attention(
    q: torch.Tensor,  # (heads, n, d)
    k: torch.Tensor,  # (kv_heads, ctx, d)
    v: torch.Tensor,  # (kv_heads, ctx, d)
    mask: torch.Tensor | None,  # (n, ctx) bool, True where visible; None: plain causal (n == ctx)
    scale: float,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:  # (heads, n, d)
    """One prefill chunk: through SDPA, or explicitly (two matmuls) when sinks join the softmax."""
    heads, n, d = q.shape
    kv_heads = k.shape[0]
    if sinks is None:
        gqa = heads != kv_heads  # grouped-query: each kv head serves several query heads
        if mask is None:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale,
                                                  enable_gqa=gqa)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale,
                                              enable_gqa=gqa)
    if mask is None:
        mask = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
    qg = q.view(kv_heads, heads // kv_heads, n, d)
    scores = torch.matmul(qg, k.unsqueeze(1).transpose(-1, -2)) * scale  # (kv, group, n, ctx)
    scores = scores.masked_fill(~mask, float("-inf"))
    probs = _softmax(scores, sinks.view(kv_heads, -1, 1, 1))
    return torch.matmul(probs, v.unsqueeze(1)).view(heads, n, d)


def paged_attention(
    q: torch.Tensor,  # (tokens, heads, head_dim)
    k: torch.Tensor,  # (tokens, kv_heads, head_dim)
    v: torch.Tensor,  # (tokens, kv_heads, head_dim)
    k_cache: torch.Tensor,  # (num_slots, kv_heads, head_dim)
    v_cache: torch.Tensor,  # (num_slots, kv_heads, head_dim)
    meta: AttnMetadata,
    scale: float,
    sinks: torch.Tensor | None = None,  # (heads,) attention-sink logits of this layer
    window: int = 0,  # a sliding-window layer's window; 0: the whole causal context
    # the decode rows through a kernel, `Kernels.decode_attention` (no sinks); None: torch
    decode: Callable[..., torch.Tensor | None] | None = None,
    # the scales of an int8 cache, (num_slots, kv_heads) each (`kvcache/quant.py`); None: plain
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:  # (tokens, heads, head_dim)
    kvquant.write(k_cache, k_scale, meta.slot_mapping, k)
    if v_cache.data_ptr() != k_cache.data_ptr():  # MLA: one latent tensor, written once
        kvquant.write(v_cache, v_scale, meta.slot_mapping, v)
    wv = window_view(meta, window) if window else None
    gather, decode_mask = (meta.decode_gather, meta.decode_mask) if wv is None else wv[:2]

    def keys(slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return (kvquant.gather(k_cache, k_scale, slots, q.dtype),
                kvquant.gather(v_cache, v_scale, slots, q.dtype))

    def decode_rows(qd: torch.Tensor) -> torch.Tensor:
        od = None if decode is None or sinks is not None else decode(
            qd, k_cache, v_cache, gather, decode_mask, scale, k_scale=k_scale, v_scale=v_scale)
        if od is not None:
            return od
        return decode_attention(qd, *keys(gather), decode_mask, scale, sinks)

    if meta.decode_only:
        return decode_rows(q)
    out = torch.empty_like(q)
    if meta.decode_rows.numel():
        out.index_copy_(0, meta.decode_rows, decode_rows(q.index_select(0, meta.decode_rows)))
    for i, span in enumerate(meta.prefills):
        rows = slice(span.q_start, span.q_start + span.q_len)
        slots, mask = span.gather, span.mask
        if wv is not None:
            slots, mask = wv.prefills[i]
        elif mask is None:
            mask = prefill_mask(span.q_len, slots.numel(), q.device)
        qp = q[rows].transpose(0, 1)  # (heads, n, d)
        kp, vp = (t.transpose(0, 1) for t in keys(slots))  # (kv_heads, keys, d)
        out[rows] = prefill_attention(qp, kp, vp, mask, scale, sinks).transpose(0, 1)
    return out
