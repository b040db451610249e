"""Writing Q4_K and Q6_K blocks (numpy): the `gguf` package reads K-quants but cannot write them.

Q4_K: a 256-value super-block is 8 sub-blocks of 32; value = d·sc_j·q − dmin·m_j with q in
0..15 and 6-bit sc_j, m_j. Per sub-block a small search over shrunken ranges picks the (scale,
min) with the least squared error (llama.cpp's `make_qkx2` does a finer version of the same);
the super-block scales d and dmin map the largest sub-block scale and min onto 63.

Q6_K: 16 sub-blocks of 16; value = d·sc_j·(q − 32) with q in 0..63 and int8 sc_j; sub-block scale
from its largest magnitude, d maps the largest |scale| onto 127.

Both write the exact byte layout `ftrs.quant.dequant` (and ggml) read.
"""

from __future__ import annotations

import numpy as np

QK = 256
_SHRINK = np.linspace(0.7, 1.0, 13, dtype=np.float32)


def _f16_bytes(v: np.ndarray) -> np.ndarray:
    return v.astype(np.float16).view(np.uint8).reshape(-1, 2)


def _blocks(x: np.ndarray) -> tuple[np.ndarray, tuple[int, ...]]:
    x = np.ascontiguousarray(x, dtype=np.float32)
    if x.shape[-1] % QK:
        raise ValueError(f"K-quants need rows of a multiple of {QK} values, got {x.shape[-1]}")
    return x.reshape(-1, QK), x.shape


def quantize_q4_k(x: np.ndarray) -> np.ndarray:
    """(..., cols) fp32 -> (..., cols / 256 * 144) uint8 Q4_K."""
    b, shape = _blocks(x)
    n = b.shape[0]
    sub = b.reshape(n, 8, 32)
    lo = np.minimum(sub.min(axis=2), 0.0)  # (n, 8): the min is never above zero
    hi = sub.max(axis=2)
    best_err = np.full((n, 8), np.inf, dtype=np.float32)
    best_s = np.zeros((n, 8), dtype=np.float32)
    best_m = np.zeros((n, 8), dtype=np.float32)
    for f in _SHRINK:  # shrink the range toward the middle, keep the least squared error
        mid = (hi + lo) / 2
        a, z = mid + (lo - mid) * f, mid + (hi - mid) * f
        s = np.maximum(z - a, 1e-30) / 15
        m = np.maximum(-a, 0.0)
        q = np.clip(np.rint((sub + m[..., None]) / s[..., None]), 0, 15)
        err = ((q * s[..., None] - m[..., None] - sub) ** 2).sum(axis=2)
        better = err < best_err
        best_err = np.where(better, err, best_err)
        best_s = np.where(better, s, best_s)
        best_m = np.where(better, m, best_m)
    d = (best_s.max(axis=1) / 63).astype(np.float16).astype(np.float32)
    dmin = (best_m.max(axis=1) / 63).astype(np.float16).astype(np.float32)
    sc = np.clip(np.rint(best_s / np.where(d > 0, d, 1)[:, None]), 0, 63).astype(np.uint8)
    mn = np.clip(np.rint(best_m / np.where(dmin > 0, dmin, 1)[:, None]), 0, 63).astype(np.uint8)
    eff_s = d[:, None] * sc.astype(np.float32)
    eff_m = dmin[:, None] * mn.astype(np.float32)
    q = np.clip(np.rint((sub + eff_m[..., None]) / np.where(eff_s > 0, eff_s, 1)[..., None]),
                0, 15).astype(np.uint8)
    scales = np.empty((n, 12), dtype=np.uint8)
    scales[:, 0:4] = sc[:, 0:4] | ((sc[:, 4:8] >> 4) << 6)
    scales[:, 4:8] = mn[:, 0:4] | ((mn[:, 4:8] >> 4) << 6)
    scales[:, 8:12] = (sc[:, 4:8] & 0xF) | ((mn[:, 4:8] & 0xF) << 4)
    pairs = q.reshape(n, 4, 2, 32)
    qs = (pairs[:, :, 0] | (pairs[:, :, 1] << 4)).reshape(n, 128)
    out = np.concatenate([_f16_bytes(d), _f16_bytes(dmin), scales, qs], axis=1)
    return out.reshape(*shape[:-1], shape[-1] // QK * 144)


def quantize_q6_k(x: np.ndarray) -> np.ndarray:
    """(..., cols) fp32 -> (..., cols / 256 * 210) uint8 Q6_K."""
    b, shape = _blocks(x)
    n = b.shape[0]
    sub = b.reshape(n, 16, 16)
    s = np.abs(sub).max(axis=2) / 31  # (n, 16)
    d = (s.max(axis=1) / 127).astype(np.float16).astype(np.float32)
    sc = np.clip(np.rint(s / np.where(d > 0, d, 1)[:, None]), -128, 127).astype(np.int8)
    eff = d[:, None] * sc.astype(np.float32)
    signed = np.clip(np.rint(sub / np.where(eff > 0, eff, 1)[..., None]), -32, 31)
    q = (signed + 32).astype(np.uint8).reshape(n, 2, 4, 32)  # (half, row of 32 in it, l)
    ql = np.empty((n, 2, 64), dtype=np.uint8)
    ql[:, :, 0:32] = (q[:, :, 0] & 0xF) | ((q[:, :, 2] & 0xF) << 4)
    ql[:, :, 32:64] = (q[:, :, 1] & 0xF) | ((q[:, :, 3] & 0xF) << 4)
    qh = np.zeros((n, 2, 32), dtype=np.uint8)
    for i in range(4):
        qh |= ((q[:, :, i] >> 4) & 3) << (2 * i)
    out = np.concatenate([ql.reshape(n, 128), qh.reshape(n, 64), sc.view(np.uint8),
                          _f16_bytes(d)], axis=1)
    return out.reshape(*shape[:-1], shape[-1] // QK * 210)


def quantize_q5_1(x: np.ndarray) -> np.ndarray:
    """(..., cols) fp32 -> (..., cols / 32 * 24) uint8 Q5_1: value = d·q + m, q in 0..31.

    The step is searched over `(max − min) / k` for k in 15..31 (least squared error per block),
    not fixed at k = 31: values already on a coarser grid (a Q4_1 file's, step (max − min)/15)
    are then held exactly, at k = 30.
    """
    x = np.ascontiguousarray(x, dtype=np.float32)
    if x.shape[-1] % 32:
        raise ValueError(f"Q5_1 needs rows of a multiple of 32 values, got {x.shape[-1]}")
    shape = x.shape
    b = x.reshape(-1, 32)
    n = b.shape[0]
    m = b.min(axis=1).astype(np.float16).astype(np.float32)
    span = b.max(axis=1) - m
    best_err = np.full(n, np.inf, dtype=np.float32)
    best_d = np.zeros(n, dtype=np.float32)
    for k in range(15, 32):
        d = (span / k).astype(np.float16).astype(np.float32)
        q = np.clip(np.rint((b - m[:, None]) / np.where(d > 0, d, 1)[:, None]), 0, 31)
        err = ((q * d[:, None] + m[:, None] - b) ** 2).sum(axis=1)
        better = err < best_err
        best_err = np.where(better, err, best_err)
        best_d = np.where(better, d, best_d)
    q = np.clip(np.rint((b - m[:, None]) / np.where(best_d > 0, best_d, 1)[:, None]), 0, 31)
    q = q.astype(np.uint32)
    qh = (((q >> 4) & 1) << np.arange(32, dtype=np.uint32)).sum(axis=1).astype(np.uint32)
    lo = (q & 0xF).astype(np.uint8)
    qs = lo[:, :16] | (lo[:, 16:] << 4)
    out = np.concatenate([_f16_bytes(best_d), _f16_bytes(m),
                          qh.astype("<u4").view(np.uint8).reshape(n, 4), qs], axis=1)
    return out.reshape(*shape[:-1], shape[-1] // 32 * 24)
