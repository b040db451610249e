"""The int8 KV cache (`--kv-cache-dtype int8`): every cached key and value row in int8 with one
fp32 scale per token and kv head.

Why: on a GPU the KV cache, the dense weights and the expert cache share one card; a cache
row of `head_dim` bf16 values (2 bytes each) becomes `head_dim` bytes plus a 4-byte scale,
so the same memory holds about twice the context, or leaves room for more expert slots
(fewer transfers over the link). On the CPU an fp32 row shrinks about 4x.

The format: a row `x` (one token, one kv head) is stored as `q = round(x / s)` in [-127, 127]
with `s = max|x| / 127` (a zero row: `s = 0`, `q = 0`); it is read back as `q * s` in fp32,
then in the compute dtype. Each value is off by at most `s / 2` (half a step of its own row),
and the row's largest value is exact up to the scale's rounding. A row is quantized once, when
its token is written; every later read of it (decode and prefill, every path: torch, the
Triton kernel, the sliding and sink layers) sees the same stored values.

A cache layer is passed around as its data tensor and its scales (`None`: a plain cache in
the compute dtype); `write` and `gather` serve both.
"""

from __future__ import annotations

from typing import Any

import torch

QMAX = 127


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`x` (..., d) -> (int8 values (..., d), fp32 scales (...)): one scale per row."""
    xf = x.float()
    scale = xf.abs().amax(dim=-1) / QMAX
    # a zero row divides by the tiny floor: its values stay 0
    q = (xf / scale.clamp(min=torch.finfo(torch.float32).tiny).unsqueeze(-1)).round_()
    return q.clamp_(-QMAX, QMAX).to(torch.int8), scale


def dequantize_rows(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """int8 rows (..., d) and their scales (...) -> values in `dtype` (through fp32)."""
    return (q.float() * scale.unsqueeze(-1)).to(dtype)


def write(cache: torch.Tensor, scale: torch.Tensor | None, slots: torch.Tensor,
          x: torch.Tensor) -> None:
    """Store `x` (tokens, kv_heads, d) at cache slots `slots` (tokens,), quantized when the
    cache has scales."""
    if scale is None:
        cache.index_copy_(0, slots, x)
        return
    if _rust_writes(x, slots, cache, scale):
        _core().ops_kv_write_int8(x.numpy(), slots.numpy(), cache.shape[1], cache.numpy(),
                                  scale.numpy())
        return
    q, s = quantize_rows(x)
    cache.index_copy_(0, slots, q)
    scale.index_copy_(0, slots, s)


def _rust_writes(x: torch.Tensor, slots: torch.Tensor, cache: torch.Tensor,
                 scale: torch.Tensor) -> bool:
    """Whether `write` goes to the Rust op (`ftrs_core::ops::kv_write_int8`, the same values
    bit for bit in one call where torch takes ten): everything on the CPU, contiguous, fp32
    rows, int64 slots. A decode step writes every layer's keys and values this way."""
    return (x.dtype is torch.float32 and slots.dtype is torch.int64 and x.is_cpu
            and cache.is_cpu and x.is_contiguous() and slots.is_contiguous()
            and cache.is_contiguous() and scale.is_contiguous())


def _core() -> Any:
    from ftrs import _core as core

    return core


def gather(cache: torch.Tensor, scale: torch.Tensor | None, slots: torch.Tensor,
           dtype: torch.dtype) -> torch.Tensor:
    """`cache[slots]` in `dtype`: `slots` of any shape, the rows' shape after it. Through
    `index_select`: on the CPU it moves the same bytes ~2.5x faster than advanced indexing (a
    decode step of the demo model spends a fifth of its time here)."""
    flat = slots.reshape(-1)
    rows = cache.index_select(0, flat)
    if scale is not None:
        rows = dequantize_rows(rows, scale.index_select(0, flat), dtype)
    return rows.view(*slots.shape, *cache.shape[1:])


def bytes_per_token(kv_heads: int, head_dim: int, dtype: torch.dtype, kv_cache_dtype: str) -> int:
    """Bytes one token takes in one cache tensor (keys or values) of one layer."""
    if kv_cache_dtype == "int8":
        return kv_heads * (head_dim + 4)  # int8 values and an fp32 scale per kv head
    return kv_heads * head_dim * dtype.itemsize


def model_bytes_per_token(spec: Any, dtype: torch.dtype, kv_cache_dtype: str) -> int:
    """Bytes one token takes in a model's whole KV cache (`spec`: its `ArchSpec`): keys and
    values of every attention layer (linear attention layers keep none; MLA one latent row)."""
    tensors = 1 if spec.mla is not None else 2
    return tensors * max(1, len(spec.kv_layers)) * bytes_per_token(
        spec.num_kv_heads, spec.head_dim, dtype, kv_cache_dtype)


__all__ = ["bytes_per_token", "dequantize_rows", "gather",
           "model_bytes_per_token", "quantize_rows", "write"]
