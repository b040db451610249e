# mypy: allow-untyped-defs
# (Triton reads the annotations of @triton.jit functions itself: its kernels carry none but tl.constexpr.)
"""Fused MoE over cache slots: one sort of the (token, expert) pairs, two grouped GEMMs, one sum.

The experts of a layer are computed from weights that sit in device slots, named by a table
`slot_of[expert]` (-1: not in a slot now, skipped: the offload strategy computes a layer in
waves this way, adding wave after wave into the same `out`). Per call:
1. the T*k (token, expert) pairs are sorted by expert once (`argsort` + counts by
   `scatter_add_`, all on the device, nothing read back), and each expert's run of pairs is
   padded to a multiple of BLOCK_M, so every block of rows belongs to one expert;
2. a grouped GEMM per block computes gate and up together and stores SiLU(gate)·up (with
   `SlotWeights.biases`, each slot's bias rows added before the rounding F.linear does; with
   `SlotWeights.clamp`, gpt_oss's clamped SwiGLU op by op instead);
3. a second grouped GEMM computes the down projection (plus its bias row) times the routing
   weight, one row per pair;
4. each token adds its k rows in ascending expert id, onto `out`.

Exactness. The kernels round to the model dtype wherever the reference (`layers/moe.py`:
`F.linear`, `silu`, `*`, the weight product, the accumulation) rounds, and step 4 adds in
the reference's order, so the only differences left are inside the dot products (another
summation order) and SiLU's `exp`: fp32 agrees to ~1e-5 relative, bf16/fp16 to a few ulps of
a row's largest value (tests: `tests/kernel_checks/test_moe.py`).

Weights: `SlotWeights` holds the three stacked tensors (slots, rows, cols) in a float dtype, or
quantized, dequantized inside the kernel to the activations' dtype (the reference dequantizes
to fp32 and casts, the same rounding), so no scratch copy exists:
- `Q8_0` (GGUF): uint8 (slots, rows, cols/32*34); a 32-value block is an fp16 scale d and 32
  int8 q: d*q.
- `Q4_K` (GGUF): uint8 (slots, rows, cols/256*144); a 256-value super-block is fp16 d and dmin,
  12 bytes of packed 6-bit scales and mins of its eight 32-value sub-blocks, 128 bytes of
  nibbles: (d*sc)*q - dmin*m, in that order (fp fusion is off, as in every kernel here).
- `Q5_1` (GGUF): uint8 (slots, rows, cols/32*24); a 32-value block is fp16 d and m, 4 bytes of
  fifth bits (bit j for value j), 16 bytes of nibbles (value j < 16 low, j >= 16 high): d*q + m.
- `Q6_K` (GGUF): uint8 (slots, rows, cols/256*210); a 256-value super-block is 128 bytes of low
  nibbles, 64 bytes of 2-bit highs, 16 int8 scales (one per 16 values) and fp16 d:
  (d*scale)*(q - 32).
- `MXFP4` (GGUF, ggml's `block_mxfp4`): uint8 (slots, rows, cols/32*17); a 32-value block is
  an e8m0 exponent e and 16 bytes of e2m1 nibbles (value j < 16 low, j >= 16 high):
  e2m1(q) * 2^(e - 127), exact in fp32 (ggml's doubled values times 2^(e - 128)).
- `IQ4_NL` (GGUF): uint8 (slots, rows, cols/32*18); a 32-value block is fp16 d and 16 bytes of
  nibbles (value j < 16 low, j >= 16 high) indexing 16 non-linear int levels L: d*L[q].
- `IQ4_XS` (GGUF): uint8 (slots, rows, cols/256*136); a 256-value super-block is fp16 d, a u16
  of 2-bit scale highs, 4 bytes of 4-bit scale lows, then 16 bytes of nibbles per 32-value
  sub-block s: (d*(ls_s - 32))*L[q], in that order.
- `Q4_0`, `Q4_1`, `Q5_0` (GGUF): 18-, 20- and 22-byte blocks of 32 values: fp16 d (and m),
  Q5_0's 4 bytes of fifth bits, 16 bytes of nibbles: d*(q - 8), d*q + m, d*(q - 16).
- `Q2_K` (GGUF): 84-byte super-blocks of 256: 16 bytes of (scale, min) nibbles (one per 16
  values), 64 bytes of 2-bit quants, fp16 d and dmin: (d*sc)*q - dmin*m.
- `Q3_K` (GGUF): 110-byte super-blocks of 256: 32 bytes of high-bit masks, 64 of 2-bit quants,
  12 of packed 6-bit scales, fp16 d: (d*(sc - 32))*(q - 4*(1 - high bit)).
- `Q5_K` (GGUF): 176-byte super-blocks of 256: Q4_K's header, 32 bytes of fifth bits (bit j for
  sub-block j), 128 of nibbles: (d*sc)*q - dmin*m.
- `NVFP4` (ggml's `block_nvfp4`): uint8 (slots, rows, cols/64*36); four 16-value sub-blocks,
  each a ue4m3 scale byte and 8 bytes of e2m1 nibbles, and one fp32 tensor scale per matrix
  (`scales`: one per slot): (e2m1(q)*scale)*tensor scale.
- `IQ1_S`, `IQ1_M`, `IQ2_XXS`, `IQ2_XS`, `IQ2_S`, `IQ3_XXS`, `IQ3_S` (GGUF): 50-, 56-, 66-, 74-,
  82-, 98- and 110-byte super-blocks of 256 (`quant/iquant.py`): grid indices, signs, small
  scales under an fp16 d; each value is a grid entry read from the type's fp32 grid (a kernel
  argument, `grid_ptr`), times its scale and sign (IQ1: plus its ±0.125 delta), in the
  reference decoder's order.
- `FP8_BLOCK`: float8_e4m3fn (slots, rows, cols) with fp32 `scales` (slots, rows/br, cols/bc)
  per (br, bc) tile (`fp8_block`), the layout of `ftrs.quant`: w*scale.
Gate and up share one type (one kernel reads both); `down` may have its own GGUF type
(`down_qtype`): a `Q4_K_M` GGUF stores Q5_1 or Q4_K gate/up and Q6_K or Q4_K down, a `Q3_K_M`
Q3_K over Q4_K or Q5_K. FP8_BLOCK and NVFP4 carry side buffers and are not mixed. Any slot and row stride works,
so the views can point straight into the offload strategy's slot buffer
(`SlotWeights.from_region`).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from ftrs.kernels._triton import dot_precision, interpreting, triton_importable
from ftrs.kernels.moe_ref import (
    _BLOCK,
    SlotWeights,
    dequant_fp8_block,
    dequant_gguf,
    dequant_q4_k,
    dequant_q8_0,
    fused_moe_ref,
)

__all__ = ["QTYPES", "SlotWeights", "combine_pairs", "dequant_fp8_block", "dequant_gguf",
           "dequant_q4_k", "dequant_q8_0", "fused_moe_ref", "fused_moe_triton",
           "moe_pairs_triton", "sort_pairs"]

#: the i-quants of three bits and less, which read their format's grid (`_grid_arg`)
_IQ_CODES = {"IQ2_XXS": 16, "IQ2_XS": 17, "IQ2_S": 18, "IQ3_XXS": 19, "IQ3_S": 20, "IQ1_S": 21,
             "IQ1_M": 22}
QTYPES = ("none", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K",
          "MXFP4", "IQ4_NL", "IQ4_XS", *_IQ_CODES, "NVFP4", "FP8_BLOCK")
_QUANT_CODE = {"none": 0, "Q8_0": 1, "FP8_BLOCK": 2, "Q4_K": 3, "Q5_1": 4, "Q6_K": 5, "MXFP4": 6,
               "IQ4_NL": 7, "IQ4_XS": 8, "Q4_0": 9, "Q4_1": 10, "Q5_0": 11, "Q2_K": 12,
               "Q3_K": 13, "Q5_K": 14, "NVFP4": 15, **_IQ_CODES}
#: Types whose gate/up and down must share the type (a side buffer outside the GGUF blocks).
_UNMIXED = ("FP8_BLOCK", "NVFP4")


if triton_importable():
    import triton
    import triton.language as tl

    from ftrs.kernels._triton import round_to
    from ftrs.kernels.moe_tiles import _w_tile

    @triton.jit
    def _mm(acc, a, b, UPCAST: tl.constexpr, PREC: tl.constexpr):
        if UPCAST:  # the interpreter's dot has no bf16
            return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
        else:
            return tl.dot(a, b, acc, input_precision=PREC)

    @triton.jit
    def _moe_gate_up_kernel(x_ptr, pair_ptr, bslot_ptr, g_ptr, gs_ptr, u_ptr, us_ptr, grid_ptr,
                            act_ptr, gb_ptr, ub_ptr, stride_gbs, stride_ubs,
                            n_pairs, top_k, hidden, inter, stride_xt, stride_s, stride_r, sc_stride_s,
                            sc_stride_r, stride_act, QUANT: tl.constexpr, BR: tl.constexpr,
                            BC: tl.constexpr, BLOCK_M: tl.constexpr,
                            BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, UPCAST: tl.constexpr,
                            PREC: tl.constexpr, HAS_BIAS: tl.constexpr, CLAMP: tl.constexpr,
                            ALPHA: tl.constexpr, LIMIT: tl.constexpr):
        blk = tl.program_id(0)
        slot = tl.load(bslot_ptr + blk).to(tl.int64)
        if slot < 0:
            return
        rows = blk * BLOCK_M + tl.arange(0, BLOCK_M)
        pair = tl.load(pair_ptr + rows).to(tl.int64)
        valid = pair < n_pairs
        tok = pair // top_k
        n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        DT: tl.constexpr = act_ptr.dtype.element_ty
        acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, hidden, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            xa = tl.load(x_ptr + tok[:, None] * stride_xt + k[None, :],
                         mask=valid[:, None] & (k < hidden)[None, :], other=0.0)
            wg = _w_tile(g_ptr, gs_ptr, grid_ptr, slot, n, k, inter, hidden, stride_s, stride_r,
                         sc_stride_s, sc_stride_r, QUANT, DT, BR, BC)
            acc_g = _mm(acc_g, xa, wg, UPCAST, PREC)
            wu = _w_tile(u_ptr, us_ptr, grid_ptr, slot, n, k, inter, hidden, stride_s, stride_r,
                         sc_stride_s, sc_stride_r, QUANT, DT, BR, BC)
            acc_u = _mm(acc_u, xa, wu, UPCAST, PREC)
        if HAS_BIAS:  # F.linear with a bias: the product plus the bias, one rounding
            bmask = n < inter
            gb = tl.load(gb_ptr + slot * stride_gbs + n, mask=bmask, other=0.0).to(tl.float32)
            ub = tl.load(ub_ptr + slot * stride_ubs + n, mask=bmask, other=0.0).to(tl.float32)
            acc_g = acc_g + gb[None, :]
            acc_u = acc_u + ub[None, :]
        g = round_to(acc_g, DT).to(tl.float32)
        u = round_to(acc_u, DT).to(tl.float32)
        if CLAMP:  # gpt_oss: (clamp(u) + 1) * (clamp(g) * sigmoid(alpha * clamp(g))), op by op
            g = tl.minimum(g, LIMIT)
            u = tl.minimum(tl.maximum(u, -LIMIT), LIMIT)
            ga = round_to(g * ALPHA, DT).to(tl.float32)
            sg = round_to(1.0 / (1.0 + tl.exp(-ga)), DT).to(tl.float32)
            glu = round_to(g * sg, DT).to(tl.float32)
            a = round_to(round_to(u + 1.0, DT).to(tl.float32) * glu, DT)
        else:
            s = round_to(g / (1.0 + tl.exp(-g)), DT).to(tl.float32)
            a = round_to(s * u, DT)
        tl.store(act_ptr + pair[:, None] * stride_act + n[None, :], a,
                 mask=valid[:, None] & (n < inter)[None, :])

    @triton.jit
    def _moe_down_kernel(act_ptr, pair_ptr, bslot_ptr, d_ptr, ds_ptr, grid_ptr, rw_ptr, y_ptr, db_ptr,
                         stride_dbs, n_pairs, hidden, inter,
                         stride_act, stride_s, stride_r, sc_stride_s, sc_stride_r, stride_y,
                         QUANT: tl.constexpr, BR: tl.constexpr, BC: tl.constexpr,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                         BLOCK_K: tl.constexpr, UPCAST: tl.constexpr, PREC: tl.constexpr,
                         HAS_BIAS: tl.constexpr):
        blk = tl.program_id(0)
        slot = tl.load(bslot_ptr + blk).to(tl.int64)
        if slot < 0:
            return
        rows = blk * BLOCK_M + tl.arange(0, BLOCK_M)
        pair = tl.load(pair_ptr + rows).to(tl.int64)
        valid = pair < n_pairs
        n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        DT: tl.constexpr = y_ptr.dtype.element_ty
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, inter, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            a = tl.load(act_ptr + pair[:, None] * stride_act + k[None, :],
                        mask=valid[:, None] & (k < inter)[None, :], other=0.0)
            wd = _w_tile(d_ptr, ds_ptr, grid_ptr, slot, n, k, hidden, inter, stride_s, stride_r,
                         sc_stride_s, sc_stride_r, QUANT, DT, BR, BC)
            acc = _mm(acc, a, wd, UPCAST, PREC)
        if HAS_BIAS:
            db = tl.load(db_ptr + slot * stride_dbs + n, mask=n < hidden, other=0.0)
            acc = acc + db.to(tl.float32)[None, :]
        y = round_to(acc, DT).to(tl.float32)
        rw = tl.load(rw_ptr + pair, mask=valid, other=0.0).to(tl.float32)
        tl.store(y_ptr + pair[:, None] * stride_y + n[None, :], round_to(y * rw[:, None], DT),
                 mask=valid[:, None] & (n < hidden)[None, :])


class _Sorted(NamedTuple):
    pair_of_row: torch.Tensor  # (blocks*BLOCK_M,) pair index per padded row, n_pairs = padding
    block_slot: torch.Tensor  # (blocks,) slot of each block's expert, -1 = nothing to compute


def sort_pairs(ids: torch.Tensor, slot_of: torch.Tensor, block_m: int) -> _Sorted:
    """Group the (token, expert) pairs by expert, each expert's run padded to `block_m` rows.
    Device ops only, sized from shapes known on the host: no synchronisation."""
    num_experts = slot_of.numel()
    flat = ids.reshape(-1).long()  # pair p = token * k + j
    n = flat.numel()
    dev = flat.device
    order = torch.argsort(flat, stable=True)  # pairs in ascending expert id
    counts = torch.zeros(num_experts, dtype=torch.long, device=dev)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    pad_end = torch.cumsum(padded, 0)
    run_start = torch.cumsum(counts, 0) - counts
    sorted_e = flat[order]
    dest = pad_end[sorted_e] - padded[sorted_e] + torch.arange(n, device=dev) - run_start[sorted_e]
    num_blocks = -(-(n + min(num_experts, n) * (block_m - 1)) // block_m)
    pair_of_row = torch.full((num_blocks * block_m,), n, dtype=torch.int32, device=dev)
    pair_of_row[dest] = order.to(torch.int32)
    starts = torch.arange(num_blocks, device=dev) * block_m
    block_expert = torch.searchsorted(pad_end, starts, right=True)  # num_experts past the end
    slot_ext = torch.cat((slot_of.to(device=dev, dtype=torch.int32),
                          torch.full((1,), -1, dtype=torch.int32, device=dev)))
    return _Sorted(pair_of_row, slot_ext[block_expert])


def _weight_args(w: SlotWeights, which: int) -> tuple[torch.Tensor, torch.Tensor, int, int, int, int]:
    """(pointer tensor, scale pointer tensor, slot stride, row stride, and the same for scales)."""
    m = (w.gate, w.up, w.down)[which]
    qtype = w.qtype_of(which)
    if m.stride(-1) != 1:
        raise ValueError("fused_moe: expert weights need a unit last stride")
    if qtype == "NVFP4":  # scale bytes in the block; the fp32 tensor scale, one per slot
        sc = w.scales[which] if w.scales is not None else None
        if m.dtype != torch.uint8 or m.shape[-1] % 36:
            raise ValueError("fused_moe: NVFP4 weights are uint8 rows of 36-byte blocks")
        if sc is None or sc.dtype != torch.float32 or sc.shape[0] != m.shape[0] or sc[0].numel() != 1:
            raise ValueError("fused_moe: NVFP4 needs one fp32 tensor scale per slot and matrix")
        return m, sc, m.stride(0), m.stride(1), sc.stride(0), 0
    if qtype == "MXFP4":  # no fp16 field: the exponent is a byte of the block
        if m.dtype != torch.uint8 or m.shape[-1] % 17:
            raise ValueError("fused_moe: MXFP4 weights are uint8 rows of 17-byte blocks")
        return m, m, m.stride(0), m.stride(1), 0, 0
    if qtype in _BLOCK:  # the fp16 fields are read through a half view of the same bytes
        nbytes = _BLOCK[qtype][1]
        if m.dtype != torch.uint8 or m.shape[-1] % nbytes or m.stride(0) % 2 or m.stride(1) % 2:
            raise ValueError(f"fused_moe: {qtype} weights are uint8 rows of {nbytes}-byte "
                             "blocks at even strides")
        return (m.view(torch.int8) if qtype == "Q8_0" else m, m.view(torch.float16),
                m.stride(0), m.stride(1), m.stride(0) // 2, m.stride(1) // 2)
    if qtype == "FP8_BLOCK":
        if w.scales is None or w.fp8_block is None or m.dtype != torch.float8_e4m3fn:
            raise ValueError("fused_moe: FP8_BLOCK needs float8_e4m3fn weights, scales and the block")
        sc = w.scales[which]
        if sc.dtype != torch.float32 or sc.stride(-1) != 1:
            raise ValueError("fused_moe: FP8_BLOCK scales are fp32 with a unit last stride")
        return m.view(torch.uint8), sc, m.stride(0), m.stride(1), sc.stride(0), sc.stride(1)
    return m, m, m.stride(0), m.stride(1), 0, 0


def _grid_arg(qtype: str, x: torch.Tensor) -> torch.Tensor:
    """The fp32 grid an i-quant's tiles read (`quant.iquant`'s, on x's device); `x` (never
    read) for every other type."""
    if qtype not in _IQ_CODES:
        return x
    from ftrs.quant.iquant import grid

    return grid(qtype, x.device)


def _bias_args(w: SlotWeights, x: torch.Tensor, inter: int, hidden: int
               ) -> tuple[tuple[torch.Tensor, torch.Tensor, torch.Tensor], tuple[int, int, int]]:
    """(gate, up, down bias rows), (their slot strides); `x` (never read) without biases."""
    if w.biases is None:
        return (x, x, x), (0, 0, 0)
    gb, ub, db = w.biases
    if (gb.shape[-1], ub.shape[-1], db.shape[-1]) != (inter, inter, hidden):
        raise ValueError("fused_moe: bias rows do not match the intermediate/hidden sizes")
    if any(b.dtype != x.dtype or b.dim() != 2 or b.stride(-1) != 1 for b in (gb, ub, db)):
        raise ValueError("fused_moe: biases are (slots, n) rows in the activations' dtype with "
                         "a unit last stride")
    return (gb, ub, db), (gb.stride(0), ub.stride(0), db.stride(0))


def _cols(m: torch.Tensor, qtype: str) -> int:
    if qtype in _BLOCK:
        elems, nbytes = _BLOCK[qtype]
        return m.shape[-1] // nbytes * elems
    return m.shape[-1]


def moe_pairs_triton(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
                     slot_of: torch.Tensor, w: SlotWeights,
                     y: torch.Tensor | None = None) -> torch.Tensor:
    """Steps 1-3: each (token, expert) pair's weighted expert output, as rows `token*k + j` of
    `y` (T*k, H) in x's dtype. Only the rows of experts with a slot are written, so calls with
    disjoint slot tables may fill one `y` in any order (experts that landed first, then the
    rest) before `combine_pairs` adds it up. A new `y` starts at zeros."""
    for qt in (w.qtype, w.qtype_of(2)):
        if qt not in QTYPES:
            raise ValueError(f"fused_moe: weight type {qt!r} has no kernel (known: {QTYPES})")
    for qt in _UNMIXED:
        if qt in (w.qtype, w.qtype_of(2)) and w.qtype != w.qtype_of(2):
            raise ValueError(f"fused_moe: {qt} gate/up need a {qt} down")
    if x.stride(-1) != 1:
        x = x.contiguous()
    tokens, hidden = x.shape
    top_k = ids.shape[1]
    inter = w.gate.shape[1]
    if _cols(w.gate, w.qtype) != hidden or _cols(w.down, w.qtype_of(2)) != inter:
        raise ValueError("fused_moe: weight shapes do not match the hidden/intermediate sizes")
    n = tokens * top_k
    y = torch.zeros(n, hidden, dtype=x.dtype, device=x.device) if y is None else y
    if n == 0:
        return y
    block_m = 16 if n < 64 * slot_of.numel() else 64
    srt = sort_pairs(ids, slot_of, block_m)
    num_blocks = srt.block_slot.numel()
    act = torch.empty(n, inter, dtype=x.dtype, device=x.device)
    rw = weights.to(x.dtype).reshape(-1).contiguous()
    br, bc = w.fp8_block or (1, 1)
    consts = dict(BR=br, BC=bc, BLOCK_M=block_m, BLOCK_N=64,
                  BLOCK_K=64, UPCAST=interpreting(), PREC=dot_precision(x.dtype),
                  HAS_BIAS=w.biases is not None, enable_fp_fusion=False)
    (gb, ub, db), (gbs, ubs, dbs) = _bias_args(w, x, inter, hidden)
    alpha, limit = w.clamp or (1.0, 0.0)
    g, gs, ss, sr, scs, scr = _weight_args(w, 0)
    u, us, uss, usr, uscs, uscr = _weight_args(w, 1)
    if (uss, usr, uscs, uscr) != (ss, sr, scs, scr):
        raise ValueError("fused_moe: gate and up need the same strides")
    _moe_gate_up_kernel[(num_blocks, triton.cdiv(inter, 64))](
        x, srt.pair_of_row, srt.block_slot, g, gs, u, us, _grid_arg(w.qtype, x), act, gb, ub, gbs,
        ubs, n, top_k, hidden,
        inter, x.stride(0), ss, sr, scs, scr, act.stride(0), QUANT=_QUANT_CODE[w.qtype],
        CLAMP=w.clamp is not None, ALPHA=float(alpha), LIMIT=float(limit), **consts)
    d, ds, dss, dsr, dscs, dscr = _weight_args(w, 2)
    _moe_down_kernel[(num_blocks, triton.cdiv(hidden, 64))](
        act, srt.pair_of_row, srt.block_slot, d, ds, _grid_arg(w.qtype_of(2), x), rw, y, db, dbs,
        n, hidden, inter,
        act.stride(0), dss, dsr, dscs, dscr, y.stride(0), QUANT=_QUANT_CODE[w.qtype_of(2)],
        **consts)
    return y


def combine_pairs(y: torch.Tensor, ids: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """Step 4: adds each token's k rows of `y` onto `out` in ascending expert id, the order
    the reference adds experts in (a row left at zero adds nothing)."""
    tokens, top_k = ids.shape
    by_id = ids.argsort(dim=1).to(out.device)  # (T, k)
    rows = torch.arange(tokens, device=out.device)[:, None] * top_k + by_id
    for j in range(top_k):
        out += y.index_select(0, rows[:, j])
    return out


def fused_moe_triton(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
                     slot_of: torch.Tensor, w: SlotWeights,
                     out: torch.Tensor | None = None) -> torch.Tensor:
    """The kernels behind `fused_moe_ref`'s signature (see the module doc)."""
    y = moe_pairs_triton(x, ids, weights, slot_of, w)
    return combine_pairs(y, ids, torch.zeros_like(x) if out is None else out)
