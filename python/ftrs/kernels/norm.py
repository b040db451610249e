# mypy: allow-untyped-defs
# (Triton reads the annotations of @triton.jit functions itself: its kernels carry none but tl.constexpr.)
"""Fused RMSNorm (with an optional residual add) and rotary applied in place on q and k.

Both follow `layers/norm.py` and `layers/rotary.py` op for op, rounding to the model dtype
wherever the reference does, so bf16 and fp16 match bit for bit except where a sum's order
differs:
- RMSNorm: the mean of squares is a reduction whose order differs from torch's; fp32 agrees to
  ~1e-6 relative, bf16 within one rounding of the output (one ulp). The residual add itself is
  exact.
- Rotary: no reduction, so it matches bit for bit in every dtype. Every kernel of this package
  is launched with `enable_fp_fusion=False`: `x*cos + r*sin` stays a multiply and an add, as
  torch computes it, instead of one fused multiply-add.
"""

from __future__ import annotations

import torch

from ftrs.kernels._triton import next_pow2, triton_importable
from ftrs.layers.norm import rms_norm


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float,
                 residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`x`: (..., hidden). With `residual`, normalises `residual + x` and returns it as the new
    residual: (normed, residual + x); without, (normed, None). The norm is `layers.norm`'s
    itself, so the decoder's torch path rounds exactly as it did before the residual add was
    fused into it (`residual + x` is the add the decoder did, in the same dtype)."""
    if residual is not None:
        x = residual + x
    return rms_norm(x, weight, eps), (x if residual is not None else None)


def rotary_ref_(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                positions: torch.Tensor) -> None:
    """Rotates `q` (tokens, heads, d) and `k` (tokens, kv_heads, d) in place ("rotate half").
    `cos`, `sin`: (max_positions, d) fp32 tables; `positions`: (tokens,) int64."""
    for x in (q, k):
        c = cos[positions].to(x.dtype)[:, None, :]
        s = sin[positions].to(x.dtype)[:, None, :]
        half = x.shape[-1] // 2
        rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        x.copy_(x * c + rotated * s)


if triton_importable():
    import triton
    import triton.language as tl

    from ftrs.kernels._triton import round_to

    @triton.jit
    def _rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, n_cols, eps,
                         x_stride, res_stride, out_stride, res_out_stride,
                         HAS_RES: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        mask = cols < n_cols
        x = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0)
        if HAS_RES:
            r = tl.load(res_ptr + row * res_stride + cols, mask=mask, other=0.0)
            x = round_to(r.to(tl.float32) + x.to(tl.float32), x.dtype)
            tl.store(res_out_ptr + row * res_out_stride + cols, x, mask=mask)
        xf = x.to(tl.float32)
        var = tl.sum(xf * xf, axis=0) / n_cols
        normed = round_to(xf * tl.math.rsqrt(var + eps), x.dtype)
        w = tl.load(w_ptr + cols, mask=mask, other=0.0)
        y = w.to(tl.float32) * normed.to(tl.float32)
        tl.store(out_ptr + row * out_stride + cols, round_to(y, out_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _rotary_kernel(q_ptr, k_ptr, cos_ptr, sin_ptr, pos_ptr, q_tok_stride, q_head_stride,
                       k_tok_stride, k_head_stride, table_stride, num_q_heads, num_k_heads,
                       HALF: tl.constexpr, BLOCK: tl.constexpr, BLOCK_H: tl.constexpr):
        # one program per token and tensor (q or k): every head of it at once, the token's
        # cos/sin row read once and broadcast over the heads
        tok = tl.program_id(0).to(tl.int64)
        if tl.program_id(1) == 0:
            base = q_ptr + tok * q_tok_stride
            head_stride = q_head_stride
            heads = num_q_heads
        else:
            base = k_ptr + tok * k_tok_stride
            head_stride = k_head_stride
            heads = num_k_heads
        cols = tl.arange(0, BLOCK)
        hs = tl.arange(0, BLOCK_H)
        col_ok = cols < HALF
        pos = tl.load(pos_ptr + tok).to(tl.int64)
        row = pos * table_stride
        c1 = tl.load(cos_ptr + row + cols, mask=col_ok, other=0.0)
        c2 = tl.load(cos_ptr + row + HALF + cols, mask=col_ok, other=0.0)
        s1 = tl.load(sin_ptr + row + cols, mask=col_ok, other=0.0)
        s2 = tl.load(sin_ptr + row + HALF + cols, mask=col_ok, other=0.0)
        off = hs[:, None].to(tl.int64) * head_stride + cols[None, :]
        mask = (hs[:, None] < heads) & col_ok[None, :]
        x1 = tl.load(base + off, mask=mask, other=0.0)
        x2 = tl.load(base + HALF + off, mask=mask, other=0.0)
        dt = x1.dtype
        c1 = round_to(c1, dt).to(tl.float32)[None, :]
        c2 = round_to(c2, dt).to(tl.float32)[None, :]
        s1 = round_to(s1, dt).to(tl.float32)[None, :]
        s2 = round_to(s2, dt).to(tl.float32)[None, :]
        a = x1.to(tl.float32)
        b = x2.to(tl.float32)
        # each product rounds to the model dtype before the sum, as the reference's ops do
        o1 = round_to(a * c1, dt).to(tl.float32) + round_to(-b * s1, dt).to(tl.float32)
        o2 = round_to(b * c2, dt).to(tl.float32) + round_to(a * s2, dt).to(tl.float32)
        tl.store(base + off, round_to(o1, dt), mask=mask)
        tl.store(base + HALF + off, round_to(o2, dt), mask=mask)


def _rows(x: torch.Tensor) -> torch.Tensor:
    """(..., hidden) as (rows, hidden) with a unit last stride, a view where possible."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    return x.reshape(-1, x.shape[-1])


def rms_norm_triton(x: torch.Tensor, weight: torch.Tensor, eps: float,
                    residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The kernel behind `rms_norm_ref`'s signature: one program per row."""
    shape = x.shape
    x2 = _rows(x)
    n_rows, n_cols = x2.shape
    out = torch.empty(shape, dtype=torch.promote_types(weight.dtype, x.dtype), device=x.device)
    out2 = out.view(-1, n_cols)
    if residual is not None:
        r2 = _rows(residual)
        res_out = torch.empty(shape, dtype=x.dtype, device=x.device)
        ro2 = res_out.view(-1, n_cols)
    else:
        r2 = ro2 = x2
        res_out = None
    if n_rows:
        _rms_norm_kernel[(n_rows,)](
            x2, r2, weight, out2, ro2, n_cols, eps, x2.stride(0), r2.stride(0), out2.stride(0),
            ro2.stride(0), HAS_RES=residual is not None, BLOCK=next_pow2(n_cols),
            enable_fp_fusion=False)
    return out, res_out


def rotary_triton_(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                   positions: torch.Tensor) -> None:
    """The kernel behind `rotary_ref_`: q and k rotated in place by one launch."""
    tokens, hq, d = q.shape
    hk = k.shape[1]
    if q.stride(-1) != 1 or k.stride(-1) != 1 or cos.stride(-1) != 1 or sin.stride() != cos.stride():
        raise ValueError("rotary: q, k and the tables need a unit last stride")
    if tokens == 0:
        return
    _rotary_kernel[(tokens, 2)](
        q, k, cos, sin, positions, q.stride(0), q.stride(1), k.stride(0), k.stride(1),
        cos.stride(0), hq, hk, HALF=d // 2, BLOCK=next_pow2(d // 2),
        BLOCK_H=next_pow2(max(hq, hk)), enable_fp_fusion=False)
