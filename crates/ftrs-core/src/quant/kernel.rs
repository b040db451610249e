//! The generic row kernel: decode a span of a weight row into a stack buffer, then dot it with
//! each activation row of the group.
//!
//! Safe Rust, written so LLVM vectorises it: [`rows_generic`] is `#[inline(always)]` and is
//! instantiated twice, here for the baseline target and in [`super::simd`] inside an
//! AVX2/FMA/F16C `#[target_feature]` function (with `FMA = true`, so products fuse).
//! Types without a hand-written SIMD kernel run this path on every CPU.

use half::prelude::*;
use half::{bf16, f16};

use super::blocks::{decode_block, QType};
use super::{simd, Isa};

/// Activation rows handled per pass over a weight row: each decoded block serves this many.
pub const MAX_NX: usize = 8;

/// Elements decoded per step of the generic kernel (a multiple of every block size).
const SPAN: usize = 256;

/// Computes `out[r * n + i] = dot(W[r], x[i])` for the rows of `w` (each `w.len() / rows` bytes)
/// and the `n` rows of `x` (each `cols` floats), with the kernels of `isa`.
pub fn rows(t: QType, isa: Isa, w: &[u8], x: &[f32], n: usize, cols: usize, out: &mut [f32]) {
    match isa {
        Isa::Avx512 => simd::rows_avx512(t, w, x, n, cols, out),
        Isa::Avx2 => simd::rows_avx2(t, w, x, n, cols, out),
        Isa::Portable => rows_generic::<false>(t, w, x, n, cols, out),
    }
}

/// Decodes consecutive blocks of type `t` (`bytes`) into `out` (their elements).
#[inline(always)]
pub fn decode_span(t: QType, bytes: &[u8], out: &mut [f32]) {
    match t {
        QType::F32 => {
            for (o, b) in out.iter_mut().zip(bytes.chunks_exact(4)) {
                *o = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
            }
        }
        QType::F16 => {
            let mut bits = [0u16; SPAN];
            for (chunk_out, chunk_in) in out.chunks_mut(SPAN).zip(bytes.chunks(2 * SPAN)) {
                let m = chunk_out.len();
                for (h, b) in bits[..m].iter_mut().zip(chunk_in.chunks_exact(2)) {
                    *h = u16::from_le_bytes([b[0], b[1]]);
                }
                let halves: &[f16] = bits[..m].reinterpret_cast();
                halves.convert_to_f32_slice(chunk_out);
            }
        }
        QType::BF16 => {
            for (o, b) in out.iter_mut().zip(bytes.chunks_exact(2)) {
                *o = bf16::from_le_bytes([b[0], b[1]]).to_f32();
            }
        }
        _ if super::iq::grid_type(t) => {
            for (o, b) in out
                .chunks_exact_mut(256)
                .zip(bytes.chunks_exact(t.block_info().1))
            {
                super::iq::decode(t, b, o); // inlined: compiled with the kernel's features
            }
        }
        _ => {
            let (be, bb) = t.block_info();
            for (o, b) in out.chunks_exact_mut(be).zip(bytes.chunks_exact(bb)) {
                decode_block(t, b, o);
            }
        }
    }
}

/// `a * b + c`, fused when `FMA` (only instantiated so inside FMA-enabled code).
#[inline(always)]
fn madd<const FMA: bool>(a: f32, b: f32, c: f32) -> f32 {
    if FMA {
        a.mul_add(b, c)
    } else {
        a * b + c
    }
}

/// `acc[k] += sum over j = k mod 8 of w[j] * x[j]`.
#[inline(always)]
fn dot_acc<const FMA: bool>(w: &[f32], x: &[f32], acc: &mut [f32; 8]) {
    let (w8, x8) = (w.chunks_exact(8), x.chunks_exact(8));
    let (wt, xt) = (w8.remainder(), x8.remainder());
    for (wc, xc) in w8.zip(x8) {
        for k in 0..8 {
            acc[k] = madd::<FMA>(wc[k], xc[k], acc[k]);
        }
    }
    for (k, (&a, &b)) in wt.iter().zip(xt).enumerate() {
        acc[k] = madd::<FMA>(a, b, acc[k]);
    }
}

/// `sum a[j] * b[j]` in 8 fp32 lanes (the portable dot; `FMA` fuses the products).
#[inline(always)]
pub fn dot<const FMA: bool>(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0f32; 8];
    dot_acc::<FMA>(a, b, &mut acc);
    hsum8(&acc)
}

/// Sum of the 8 lanes, pairwise.
#[inline(always)]
pub fn hsum8(a: &[f32; 8]) -> f32 {
    ((a[0] + a[4]) + (a[1] + a[5])) + ((a[2] + a[6]) + (a[3] + a[7]))
}

/// The generic kernel; see [`rows`] for the contract.
#[inline(always)]
pub fn rows_generic<const FMA: bool>(
    t: QType,
    w: &[u8],
    x: &[f32],
    n: usize,
    cols: usize,
    out: &mut [f32],
) {
    let (be, bb) = t.block_info();
    let span = SPAN.max(be);
    let rb = cols / be * bb;
    let mut buf = [0f32; SPAN];
    for (row, o) in w.chunks_exact(rb).zip(out.chunks_exact_mut(n)) {
        for g0 in (0..n).step_by(MAX_NX) {
            let g = (n - g0).min(MAX_NX);
            let mut acc = [[0f32; 8]; MAX_NX];
            let mut c0 = 0;
            while c0 < cols {
                let len = (cols - c0).min(span);
                let bytes = &row[c0 / be * bb..(c0 + len) / be * bb];
                let wbuf = &mut buf[..len];
                decode_span(t, bytes, wbuf);
                for (i, a) in acc[..g].iter_mut().enumerate() {
                    let xs = &x[(g0 + i) * cols + c0..][..len];
                    dot_acc::<FMA>(wbuf, xs, a);
                }
                c0 += len;
            }
            for (oi, a) in o[g0..g0 + g].iter_mut().zip(&acc) {
                *oi = hsum8(a);
            }
        }
    }
}
