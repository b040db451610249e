//! AVX2/FMA/F16C kernels, the only module of `quant` with `unsafe`.
//!
//! Each `#[target_feature]` function here is safe to write but may only be called on a CPU
//! that has the features; [`rows_avx2`] is the one entry, and its callers reach it only when
//! [`avx2_available`] said yes ([`super::Isa`] checks before handing out `Isa::Avx2`).
//!
//! Integer-product kernels (Q8_0, Q4_1, Q5_1, Q4_K, Q6_K) live in `int`: the activations as
//! 15-bit integers per 32-block, tried first. The others here (Q5_K, Q4_0, Q5_0, F32, F16,
//! BF16) decode in registers (nibbles masked and widened, converted to fp32, times the sub-block scale
//! `d * sc`: exactly the reference's weight before its min) and fuse the products into 8-lane
//! fp32 accumulators, per activation row of the group (2-4 chains for groups of 1-3 rows, so
//! one FMA latency chain does not bound a matvec); a block is decoded once per
//! `kernel::MAX_NX` activation rows. Mins (K-quants, Q4_1, Q5_1) enter once per (sub-)block as
//! `m * sum(x over it)`, the sums of `x` computed once per call. Q2_K and Q3_K run the generic
//! kernel compiled for these features.

#![allow(unsafe_code)]

use super::blocks::QType;
use super::kernel;

/// True when this CPU has AVX2, FMA and F16C.
pub fn avx2_available() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        is_x86_feature_detected!("avx2")
            && is_x86_feature_detected!("fma")
            && is_x86_feature_detected!("f16c")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// True when this CPU also has AVX-512 F, BW, VL and VNNI (besides [`avx2_available`]).
pub fn avx512_available() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        avx2_available()
            && is_x86_feature_detected!("avx512f")
            && is_x86_feature_detected!("avx512bw")
            && is_x86_feature_detected!("avx512vl")
            && is_x86_feature_detected!("avx512vnni")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// [`kernel::rows`] for `Isa::Avx512`: the integer kernels in AVX-512 (`int::wide`), every
/// other type as [`rows_avx2`] runs it. Falls back to [`rows_avx2`] on a CPU without the
/// features.
pub fn rows_avx512(t: QType, w: &[u8], x: &[f32], n: usize, cols: usize, out: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    if avx512_available() {
        // SAFETY: the CPU has AVX-512 F/BW/VL/VNNI, AVX2, FMA and F16C (checked just above).
        if unsafe { int::wide::rows(t, w, x, n, cols, out) } {
            return;
        }
    }
    rows_avx2(t, w, x, n, cols, out)
}

/// [`kernel::rows`] for `Isa::Avx2`. Falls back to the portable kernel when the CPU lacks the
/// features (so a wrong `Isa` costs speed, never safety).
pub fn rows_avx2(t: QType, w: &[u8], x: &[f32], n: usize, cols: usize, out: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    if avx2_available() {
        // SAFETY: the CPU has AVX2, FMA and F16C (checked just above; the check is cached by
        // std after its first call).
        unsafe { rows_x86(t, w, x, n, cols, out) };
        return;
    }
    kernel::rows_generic::<false>(t, w, x, n, cols, out);
}

/// One FP8_BLOCK weight row decoded into `buf`: `buf[c] = e4m3(w[c]) * scales[c / bc]`, exactly
/// [`super::fp8::decode_row_portable`]'s values, 16 weights per step through F16C where the
/// CPU has AVX2/FMA/F16C.
pub fn fp8_decode(w: &[u8], scales: &[f32], bc: usize, buf: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    if avx2_available() {
        // SAFETY: the CPU has AVX2, FMA and F16C (checked just above).
        unsafe { x86::fp8_decode_x86(w, scales, bc, buf) };
        return;
    }
    super::fp8::decode_row_portable(w, scales, bc, buf)
}

/// One FP8_BLOCK weight row times one activation row: `sum_c e4m3(w[c]) * scales[c / bc] *
/// x[c]`, each tile's products summed before its scale meets them (the portable form decodes
/// the row, then dots it).
pub fn fp8_dot(w: &[u8], scales: &[f32], bc: usize, x: &[f32], buf: &mut [f32]) -> f32 {
    #[cfg(target_arch = "x86_64")]
    if avx2_available() {
        // SAFETY: the CPU has AVX2, FMA and F16C (checked just above).
        return unsafe { x86::fp8_dot_x86(w, scales, bc, x) };
    }
    super::fp8::decode_row_portable(w, scales, bc, buf);
    kernel::dot::<false>(buf, x)
}

/// `sum a[j] * b[j]` over equal-length rows, in fused multiply-adds on four 8-lane chains where
/// the CPU has AVX2/FMA/F16C (the portable dot otherwise).
pub fn dot_f32(a: &[f32], b: &[f32]) -> f32 {
    #[cfg(target_arch = "x86_64")]
    if avx2_available() {
        // SAFETY: the CPU has AVX2, FMA and F16C (checked just above).
        return unsafe { x86::dot_x86(a, b) };
    }
    kernel::dot::<false>(a, b)
}

mod attn;
pub use attn::{prefetch, KvElem};

#[cfg(target_arch = "x86_64")]
use x86::rows_x86;

#[cfg(target_arch = "x86_64")]
mod int;

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    use super::super::blocks::{scale_min_k4, QType};
    use super::super::kernel::{self, MAX_NX};
    use super::int::{f16, hsum, ld16, ld32, ld8, ld8b};

    /// 32 signed bytes as four vectors of 8 floats (elements 0-7, 8-15, 16-23, 24-31).
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    fn i8x32_to_ps(v: __m256i) -> [__m256; 4] {
        let lo = _mm256_castsi256_si128(v);
        let hi = _mm256_extracti128_si256(v, 1);
        [
            _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(lo)),
            _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_unpackhi_epi64(lo, lo))),
            _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(hi)),
            _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_unpackhi_epi64(hi, hi))),
        ]
    }

    /// Adds `w * x_i[at..at + 8]` to `acc[i]` for each of the group's activation rows, `x_i`
    /// being row i's `B` activations of the current block (`at` is a constant after unrolling,
    /// so the bounds checks fold away).
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    fn fma_rows<const NX: usize, const C: usize, const B: usize>(
        w: __m256,
        xb: &[&[f32; B]; NX],
        at: usize,
        acc: &mut [[__m256; C]; NX],
    ) {
        // Chain by position: consecutive products go to different accumulators, so a small
        // group is not held back by the fused multiply-add latency of one dependency chain.
        let j = (at / 8) % C;
        for i in 0..NX {
            acc[i][j] = _mm256_fmadd_ps(w, ld8(&xb[i][at..at + 8]), acc[i][j]);
        }
    }

    /// Sum of all lanes of all chains of one activation row.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    fn hsum_chains<const C: usize>(a: &[__m256; C]) -> f32 {
        let mut v = a[0];
        for &c in &a[1..] {
            v = _mm256_add_ps(v, c);
        }
        hsum(v)
    }

    /// Row i's activations of block `bi` (of `B` elements), for each row of the group.
    #[inline(always)]
    fn block_x<'a, const NX: usize, const B: usize>(
        xr: &[&'a [f32]; NX],
        bi: usize,
    ) -> [&'a [f32; B]; NX] {
        std::array::from_fn(|i| {
            let s: &[f32; B] = xr[i][bi * B..bi * B + B].try_into().expect("block in row");
            s
        })
    }

    /// Per activation row, the sums of its 32-element sub-blocks (`cols / 32` each).
    fn sums32(x: &[f32], n: usize, cols: usize) -> Vec<f32> {
        let mut s = Vec::with_capacity(n * cols / 32);
        for row in x.chunks_exact(cols).take(n) {
            s.extend(row.chunks_exact(32).map(|c| {
                let mut a = [0f32; 8];
                for v in c.chunks_exact(8) {
                    for k in 0..8 {
                        a[k] += v[k];
                    }
                }
                kernel::hsum8(&a)
            }));
        }
        s
    }

    /// One group of `NX` activation rows starting at `g0` against every weight row of `w`.
    type GroupFn<const NX: usize> =
        fn(&[u8], &[&[f32]; NX], &[&[f32]; NX], usize, &mut [f32], usize);

    /// Q4_K (and Q5_K when `Q5`): the nibbles of each 8-byte run become 8 + 8 weights of two
    /// sub-blocks (Q5_K: plus the fifth bit from `qh`), scaled by `d * sc`; the mins enter once
    /// per block as `dmin * m . sum(x over the sub-block)`.
    #[target_feature(enable = "avx2,fma,f16c")]
    fn qk45<const NX: usize, const C: usize, const Q5: bool>(
        w: &[u8],
        xr: &[&[f32]; NX],
        xs: &[&[f32]; NX],
        n: usize,
        out: &mut [f32],
        g0: usize,
    ) {
        let bb = if Q5 { 176 } else { 144 };
        let qs_at = if Q5 { 48 } else { 16 };
        let cols = xr[0].len();
        let rb = cols / 256 * bb;
        let mask = _mm256_set1_epi32(0x0F);
        let one = _mm256_set1_epi32(1);
        for (row, o) in w.chunks_exact(rb).zip(out.chunks_exact_mut(n)) {
            let mut acc = [[_mm256_setzero_ps(); C]; NX];
            for (bi, b) in row.chunks_exact(bb).enumerate() {
                let xb = block_x::<NX, 256>(xr, bi);
                let (d, dmin) = (f16(b), f16(&b[2..]));
                let mut sc = [0f32; 8];
                let mut mn = [0f32; 8];
                for j in 0..8 {
                    let (s, m) = scale_min_k4(&b[4..16], j);
                    sc[j] = d * s as f32;
                    mn[j] = dmin * m as f32;
                }
                let mins = ld8(&mn);
                for i in 0..NX {
                    acc[i][0] = _mm256_fnmadd_ps(mins, ld8(&xs[i][bi * 8..]), acc[i][0]);
                }
                let qs: &[u8; 128] = b[qs_at..qs_at + 128].try_into().expect("block");
                let qh: &[u8; 32] = b[16..48].try_into().expect("block");
                for c in 0..4 {
                    let (s0, s1) = (_mm256_set1_ps(sc[2 * c]), _mm256_set1_ps(sc[2 * c + 1]));
                    let shift = _mm_cvtsi32_si128(2 * c as i32);
                    for k in 0..4 {
                        let v = _mm256_cvtepu8_epi32(ld8b(&qs[32 * c + 8 * k..]));
                        let mut lo = _mm256_and_si256(v, mask);
                        let mut hi = _mm256_srli_epi32(v, 4);
                        if Q5 {
                            let h =
                                _mm256_srl_epi32(_mm256_cvtepu8_epi32(ld8b(&qh[8 * k..])), shift);
                            lo =
                                _mm256_or_si256(lo, _mm256_slli_epi32(_mm256_and_si256(h, one), 4));
                            let h1 = _mm256_and_si256(_mm256_srli_epi32(h, 1), one);
                            hi = _mm256_or_si256(hi, _mm256_slli_epi32(h1, 4));
                        }
                        let at = 64 * c + 8 * k;
                        let (lo, hi) = (_mm256_cvtepi32_ps(lo), _mm256_cvtepi32_ps(hi));
                        fma_rows(_mm256_mul_ps(lo, s0), &xb, at, &mut acc);
                        fma_rows(_mm256_mul_ps(hi, s1), &xb, at + 32, &mut acc);
                    }
                }
            }
            for i in 0..NX {
                o[g0 + i] = hsum_chains(&acc[i]);
            }
        }
    }

    /// The 32-element legacy blocks, by `KIND`: 0 = Q4_0, 1 = Q4_1, 2 = Q5_0, 3 = Q5_1. The 16
    /// bytes of nibbles (low: elements 0-15, high: 16-31) plus, for Q5, bit j of the u32 `qh`
    /// as bit 4 of element j (spread to bytes by a shuffle and a bit mask); minus 8 (Q4_0) or
    /// 16 (Q5_0); widened to floats, times d. Q4_1/Q5_1 add `m * sum(x over the block)`.
    #[target_feature(enable = "avx2,fma,f16c")]
    fn q32<const NX: usize, const C: usize, const KIND: u8>(
        w: &[u8],
        xr: &[&[f32]; NX],
        xs: &[&[f32]; NX],
        n: usize,
        out: &mut [f32],
        g0: usize,
    ) {
        let (bb, qh_at, qs_at) = match KIND {
            0 => (18, 0, 2),
            1 => (20, 0, 4),
            2 => (22, 2, 6),
            _ => (24, 4, 8),
        };
        let five = KIND >= 2;
        let has_min = KIND % 2 == 1;
        let bias = match KIND {
            0 => 8,
            2 => 16,
            _ => 0,
        };
        let cols = xr[0].len();
        let rb = cols / 32 * bb;
        let m4 = _mm_set1_epi8(0x0F);
        let kb = _mm256_set1_epi8(bias);
        // Byte j of the spread takes byte j / 8 of qh and keeps bit j % 8.
        let pick = _mm256_setr_epi8(
            0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, //
            2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3,
        );
        let bit = _mm256_set1_epi64x(0x8040_2010_0804_0201u64 as i64);
        let b16 = _mm256_set1_epi8(0x10);
        for (row, o) in w.chunks_exact(rb).zip(out.chunks_exact_mut(n)) {
            let mut acc = [[_mm256_setzero_ps(); C]; NX];
            let mut mins = [0f32; NX];
            for (bi, b) in row.chunks_exact(bb).enumerate() {
                let xb = block_x::<NX, 32>(xr, bi);
                let d = _mm256_set1_ps(f16(b));
                let v = ld16(&b[qs_at..]);
                let lo = _mm_and_si128(v, m4);
                let hi = _mm_and_si128(_mm_srli_epi16(v, 4), m4);
                let mut q = _mm256_set_m128i(hi, lo);
                if five {
                    let qh =
                        u32::from_le_bytes([b[qh_at], b[qh_at + 1], b[qh_at + 2], b[qh_at + 3]]);
                    let spread = _mm256_shuffle_epi8(_mm256_set1_epi32(qh as i32), pick);
                    let set = _mm256_cmpeq_epi8(_mm256_and_si256(spread, bit), bit);
                    q = _mm256_or_si256(q, _mm256_and_si256(set, b16));
                }
                let f = i8x32_to_ps(_mm256_sub_epi8(q, kb));
                for (k, &fk) in f.iter().enumerate() {
                    fma_rows(_mm256_mul_ps(fk, d), &xb, 8 * k, &mut acc);
                }
                if has_min {
                    let m = f16(&b[2..]);
                    for i in 0..NX {
                        mins[i] = m.mul_add(xs[i][bi], mins[i]);
                    }
                }
            }
            for i in 0..NX {
                o[g0 + i] = hsum_chains(&acc[i]) + mins[i];
            }
        }
    }

    /// F32, F16 (F16C) and BF16 (shifted into the high half): 8 weights per step.
    #[target_feature(enable = "avx2,fma,f16c")]
    fn float<const NX: usize, const C: usize, const KIND: u8>(
        w: &[u8],
        xr: &[&[f32]; NX],
        _xs: &[&[f32]; NX],
        n: usize,
        out: &mut [f32],
        g0: usize,
    ) {
        let cols = xr[0].len();
        let es = if KIND == 0 { 4 } else { 2 };
        let main = cols / 8 * 8;
        for (row, o) in w.chunks_exact(cols * es).zip(out.chunks_exact_mut(n)) {
            let mut acc = [[_mm256_setzero_ps(); C]; NX];
            for c in (0..main).step_by(8) {
                let xb = block_x::<NX, 8>(xr, c / 8);
                let j = (c / 8) % C;
                let wv = match KIND {
                    0 => _mm256_castsi256_ps(ld32(&row[4 * c..])),
                    1 => _mm256_cvtph_ps(ld16(&row[2 * c..])),
                    _ => _mm256_castsi256_ps(_mm256_slli_epi32(
                        _mm256_cvtepu16_epi32(ld16(&row[2 * c..])),
                        16,
                    )),
                };
                for i in 0..NX {
                    acc[i][j] = _mm256_fmadd_ps(wv, ld8(xb[i]), acc[i][j]);
                }
            }
            let mut tail = [0f32; NX];
            if main < cols {
                let mut wt = [0f32; 8];
                kernel::decode_span(
                    match KIND {
                        0 => QType::F32,
                        1 => QType::F16,
                        _ => QType::BF16,
                    },
                    &row[main * es..],
                    &mut wt[..cols - main],
                );
                for i in 0..NX {
                    for (c, &wc) in wt[..cols - main].iter().enumerate() {
                        tail[i] = wc.mul_add(xr[i][main + c], tail[i]);
                    }
                }
            }
            for i in 0..NX {
                o[g0 + i] = hsum_chains(&acc[i]) + tail[i];
            }
        }
    }

    /// 16 e4m3 bytes as fp16 bits of their value / 2^8: sign-extended to i16 and shifted left
    /// by 7 (the sign lands in bit 15, and its copy in bit 14 is cleared), exponent and mantissa
    /// under fp16's (subnormals included); the NaN codes (magnitude bits all ones) get an
    /// all-ones fp16 exponent.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    fn e4m3x16(b16: &[u8]) -> __m256i {
        let bits = _mm256_and_si256(
            _mm256_slli_epi16(_mm256_cvtepi8_epi16(ld16(b16)), 7),
            _mm256_set1_epi16(0xBFFFu16 as i16),
        );
        let mag = _mm256_set1_epi16(0x3F80);
        let nan = _mm256_cmpeq_epi16(_mm256_and_si256(bits, mag), mag);
        _mm256_or_si256(bits, _mm256_and_si256(nan, _mm256_set1_epi16(0x7E00)))
    }

    /// [`super::fp8_decode`]: 16 weights per step ([`e4m3x16`]), converted by F16C and
    /// multiplied by `256 * scale` (exact in the power of two, so one rounding, as the
    /// reference's `w * scale`); a tile's tail of under 16 scalar.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub fn fp8_decode_x86(w: &[u8], scales: &[f32], bc: usize, buf: &mut [f32]) {
        for ((wt, bt), &s) in w.chunks(bc).zip(buf.chunks_mut(bc)).zip(scales) {
            let s256 = _mm256_set1_ps(s * 256.0);
            let mut ws = wt.chunks_exact(16);
            let mut bs = bt.chunks_exact_mut(16);
            for (b16, o16) in ws.by_ref().zip(bs.by_ref()) {
                let bits = e4m3x16(b16);
                let lo = _mm256_mul_ps(_mm256_cvtph_ps(_mm256_castsi256_si128(bits)), s256);
                let hi = _mm256_mul_ps(_mm256_cvtph_ps(_mm256_extracti128_si256(bits, 1)), s256);
                let (o0, o1) = o16.split_at_mut(8);
                st8(o0, lo);
                st8(o1, hi);
            }
            for (o, &b) in bs.into_remainder().iter_mut().zip(ws.remainder()) {
                *o = super::super::fp8::e4m3(b) * s;
            }
        }
    }

    /// [`super::fp8_dot`]: per tile, the decoded weights (value / 2^8) times `x` in two chains
    /// of fused multiply-adds, then the tile's sums times `256 * scale` into the row's; a tile's
    /// tail of under 16 scalar (`e4m3 * scale`, then times x).
    #[target_feature(enable = "avx2,fma,f16c")]
    pub fn fp8_dot_x86(w: &[u8], scales: &[f32], bc: usize, x: &[f32]) -> f32 {
        let mut total = [_mm256_setzero_ps(); 2];
        let mut tail = 0f32;
        for ((wt, xt), &s) in w.chunks(bc).zip(x.chunks(bc)).zip(scales) {
            let mut acc = [_mm256_setzero_ps(); 2];
            let mut ws = wt.chunks_exact(16);
            let mut xs = xt.chunks_exact(16);
            for (b16, x16) in ws.by_ref().zip(xs.by_ref()) {
                let bits = e4m3x16(b16);
                let lo = _mm256_cvtph_ps(_mm256_castsi256_si128(bits));
                let hi = _mm256_cvtph_ps(_mm256_extracti128_si256(bits, 1));
                acc[0] = _mm256_fmadd_ps(lo, ld8(x16), acc[0]);
                acc[1] = _mm256_fmadd_ps(hi, ld8(&x16[8..]), acc[1]);
            }
            let s256 = _mm256_set1_ps(s * 256.0);
            total[0] = _mm256_fmadd_ps(acc[0], s256, total[0]);
            total[1] = _mm256_fmadd_ps(acc[1], s256, total[1]);
            for (&b, &xv) in ws.remainder().iter().zip(xs.remainder()) {
                tail = (super::super::fp8::e4m3(b) * s).mul_add(xv, tail);
            }
        }
        hsum_chains(&total) + tail
    }

    /// [`super::dot_f32`]: four chains of 8-lane fused multiply-adds, a scalar tail.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub fn dot_x86(a: &[f32], b: &[f32]) -> f32 {
        let mut acc = [_mm256_setzero_ps(); 4];
        let (a32, b32) = (a.chunks_exact(32), b.chunks_exact(32));
        let (at, bt) = (a32.remainder(), b32.remainder());
        for (ac, bc) in a32.zip(b32) {
            for k in 0..4 {
                acc[k] = _mm256_fmadd_ps(ld8(&ac[8 * k..]), ld8(&bc[8 * k..]), acc[k]);
            }
        }
        let mut tail = 0f32;
        for (&x, &y) in at.iter().zip(bt) {
            tail = x.mul_add(y, tail);
        }
        hsum_chains(&acc) + tail
    }

    /// Stores 8 floats at `o[..8]`.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    fn st8(o: &mut [f32], v: __m256) {
        let o = &mut o[..8];
        // SAFETY: 8 writable f32 (sliced above); storeu accepts any alignment.
        unsafe { _mm256_storeu_ps(o.as_mut_ptr(), v) }
    }

    /// Runs `f::<NX>` for the group of activation rows `g0..g0 + NX`.
    #[inline(always)]
    #[allow(clippy::too_many_arguments)]
    fn group<const NX: usize>(
        f: GroupFn<NX>,
        w: &[u8],
        x: &[f32],
        sums: &[f32],
        n: usize,
        cols: usize,
        g0: usize,
        out: &mut [f32],
    ) {
        let xr: [&[f32]; NX] = std::array::from_fn(|i| &x[(g0 + i) * cols..][..cols]);
        let per = cols / 32;
        let xs: [&[f32]; NX] =
            std::array::from_fn(|i| sums.get((g0 + i) * per..(g0 + i + 1) * per).unwrap_or(&[]));
        f(w, &xr, &xs, n, out, g0);
    }

    /// Runs kernel `$kern` over the activation rows in groups of up to 8 (the last one smaller).
    macro_rules! dispatch {
        ($kern:ident $(, $extra:expr)?; $w:expr, $x:expr, $sums:expr, $n:expr, $cols:expr, $out:expr) => {{
            let mut g0 = 0;
            while g0 < $n {
                let g = ($n - g0).min(MAX_NX);
                match g {
                    1 => group::<1>($kern::<1, 4 $(, $extra)?>, $w, $x, $sums, $n, $cols, g0, $out),
                    2 => group::<2>($kern::<2, 2 $(, $extra)?>, $w, $x, $sums, $n, $cols, g0, $out),
                    3 => group::<3>($kern::<3, 2 $(, $extra)?>, $w, $x, $sums, $n, $cols, g0, $out),
                    4 => group::<4>($kern::<4, 1 $(, $extra)?>, $w, $x, $sums, $n, $cols, g0, $out),
                    5 => group::<5>($kern::<5, 1 $(, $extra)?>, $w, $x, $sums, $n, $cols, g0, $out),
                    6 => group::<6>($kern::<6, 1 $(, $extra)?>, $w, $x, $sums, $n, $cols, g0, $out),
                    7 => group::<7>($kern::<7, 1 $(, $extra)?>, $w, $x, $sums, $n, $cols, g0, $out),
                    _ => group::<8>($kern::<8, 1 $(, $extra)?>, $w, $x, $sums, $n, $cols, g0, $out),
                }
                g0 += g;
            }
        }};
    }

    /// The AVX2 rows kernel: hand-written for the hot types, the generic kernel compiled for
    /// these features for the rest.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub fn rows_x86(t: QType, w: &[u8], x: &[f32], n: usize, cols: usize, out: &mut [f32]) {
        if super::int::rows(t, w, x, n, cols, out) {
            return;
        }
        match t {
            QType::Q5K => {
                let sums = sums32(x, n, cols);
                dispatch!(qk45, true; w, x, &sums, n, cols, out)
            }
            QType::Q4_0 => dispatch!(q32, 0; w, x, &[], n, cols, out),
            QType::Q5_0 => dispatch!(q32, 2; w, x, &[], n, cols, out),
            QType::F32 => dispatch!(float, 0; w, x, &[], n, cols, out),
            QType::F16 => dispatch!(float, 1; w, x, &[], n, cols, out),
            QType::BF16 => dispatch!(float, 2; w, x, &[], n, cols, out),
            _ => kernel::rows_generic::<true>(t, w, x, n, cols, out),
        }
    }
}
