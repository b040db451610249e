"""The CPU side of `Kernels`: RMSNorm, rotary and decode attention as one Rust call each
(`ftrs._core.ops_*`, GIL released), behind the torch references' signatures.

Between two matmuls a decode token of a small model spends longer dispatching these ops through
torch than computing them: the demo's 576-wide norm is five torch ops and ~40 µs inside a
decode step, about a microsecond of arithmetic. Each op here takes fp32, C-contiguous CPU
tensors and hands anything else (another dtype, a strided view) to its reference, so the
choice is always safe. Numerics (`ftrs_core::ops`): the rotary is the reference bit for bit;
the norm sums its squares in f64 and the attention its dot products in another order than
torch's matmul, so both differ from the references by rounding only (~1e-6 relative, tested).
The MoE router stays torch's: its top-k choice and weights feed every expert, and a model
whose logits are sensitive (the tiny qwen3_next is at 0.94 of its 1e-4 test tolerance on the
torch path) moved to 1.9e-4 with a Rust router, for 1 % of a decode step.
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np
import torch

from ftrs.kernels.norm import rms_norm_ref, rotary_ref_

F32 = torch.float32


@functools.cache
def _core() -> Any:
    from ftrs import _core

    return _core


def available() -> bool:
    """Whether the extension has the ops (an older build may not)."""
    return hasattr(_core(), "ops_rms_norm")


# These wrappers sit on a decode step's hot path (about five calls per layer): their checks are
# attribute reads (`dtype is`, `is_cpu`: a `device` object costs more than the Rust op it
# guards), and outputs are numpy arrays viewed as tensors (`torch.from_numpy`), one conversion
# where `torch.empty` then `.numpy()` made two.
def _plain(t: torch.Tensor) -> bool:
    return t.dtype is F32 and t.is_cpu and t.is_contiguous()


def _plain_int8(t: torch.Tensor) -> bool:
    return t.dtype is torch.int8 and t.is_cpu and t.is_contiguous()


def _out_like(a: np.ndarray) -> tuple[np.ndarray, torch.Tensor]:
    """A new array shaped like `a` and the tensor over its memory."""
    out = np.empty_like(a)
    return out, torch.from_numpy(out)


def rms_norm_cpu(x: torch.Tensor, weight: torch.Tensor, eps: float,
                 residual: torch.Tensor | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`rms_norm_ref`'s contract: (normed, residual + x) with a residual, (normed, None) without."""
    if not (_plain(x) and _plain(weight) and (residual is None or (
            _plain(residual) and residual.shape == x.shape))):
        return rms_norm_ref(x, weight, eps, residual)
    xa = x.numpy()
    out, out_t = _out_like(xa)
    if residual is None:
        _core().ops_rms_norm(xa, weight.numpy(), eps, out)
        return out_t, None
    total, total_t = _out_like(xa)
    _core().ops_rms_norm(xa, weight.numpy(), eps, out, residual.numpy(), total)
    return out_t, total_t


def rotary_cpu_(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                positions: torch.Tensor) -> None:
    """`rotary_ref_`'s contract: q (tokens, heads, d) and k (tokens, kv_heads, d) rotated in place."""
    if not (_plain(q) and _plain(k) and _plain(cos) and _plain(sin)
            and positions.dtype is torch.int64
            and positions.is_contiguous() and cos.shape[-1] == q.shape[-1]):
        rotary_ref_(q, k, cos, sin, positions)
        return
    _core().ops_rotary(q.numpy(), k.numpy(), q.shape[-1], cos.numpy(), sin.numpy(),
                       positions.numpy())


def decode_attention_cpu(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                         gather: torch.Tensor, mask: torch.Tensor | None, scale: float,
                         k_scale: torch.Tensor | None = None,
                         v_scale: torch.Tensor | None = None) -> torch.Tensor | None:
    """One query per row over the cache slots `gather` (rows, keys), `mask` (rows, 1, 1, keys)
    True where a key is real (None: all are); q (rows, heads, d), caches (slots, kv_heads, d).
    An int8 cache (`kvcache/quant.py`) comes with its scales (slots, kv_heads), fp32. None when
    the inputs are not plain CPU tensors of those types: the caller takes the torch path."""
    if k_scale is None and v_scale is None:
        if not (_plain(k_cache) and _plain(v_cache)):
            return None
    elif not (k_scale is not None and v_scale is not None and _plain(k_scale)
              and _plain(v_scale) and _plain_int8(k_cache) and _plain_int8(v_cache)):
        return None
    if not (_plain(q) and gather.dtype is torch.int64 and gather.is_contiguous()
            and (mask is None or mask.is_contiguous())):
        return None
    qa = q.numpy()
    out, out_t = _out_like(qa)
    valid = None if mask is None else mask.view(torch.uint8).numpy()
    scales = {} if k_scale is None or v_scale is None else {
        "k_scale": k_scale.numpy(), "v_scale": v_scale.numpy()}
    _core().ops_decode_attention(qa, k_cache.numpy(), v_cache.numpy(), gather.numpy(),
                                 valid, scale, out, q.shape[1], k_cache.shape[1], q.shape[2],
                                 **scales)
    return out_t

