//! The integer kernels of [`super`] in AVX-512 (F, BW, VL, VNNI): the same [`X16`] activations
//! and the same exact integer products, a whole 32-element block per instruction.
//!
//! A block's 32 weight quants widen into one vector of 32 i16 lanes and `vpdpwssd` sums their
//! pairs of products with the block's 32 activation integers into 16 i32 lanes (what two
//! `vpmaddwd` and an add do in AVX2); Q5_1's fifth bits become a lane mask (its `qh` word is
//! one) and one masked add. The lanes turn fp32 once per block and meet the scale in a fused
//! multiply-add, as in AVX2, so the two differ only in the order of the fp32 sums.
//! (Q6_K: lanes 0-7 hold the block's first 16 elements, 8-15 the other 16, each half with its
//! own sub-block scale, brought into place by one permute.)

use std::arch::x86_64::*;

use super::super::super::blocks::QType;
use super::super::super::kernel::MAX_NX;
use super::{
    f16, f16x2, group, hsum, ld16, ld32, ld8, prefetch, q4k_scales, q6k_quants, quantize, XRow,
    PREFETCH_AHEAD, X16,
};

/// The 32 i16 of 32-block `k` of an activation row.
///
/// # Safety
/// As [`XRow::block`]: `k` is below the row's block count.
#[inline(always)]
unsafe fn xblock(x: &XRow<'_>, k: usize) -> __m512i {
    // SAFETY: k is in range (this function's contract); the block is 64 readable bytes, and
    // loadu accepts any alignment.
    unsafe { _mm512_loadu_si512(x.block(k).as_ptr().cast()) }
}

/// `sum w[j] x[j]` over 32 elements as 16 fp32 lanes (exact: each lane sums 2 products).
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
fn dot(w: __m512i, x: __m512i) -> __m512 {
    _mm512_cvtepi32_ps(_mm512_dpwssd_epi32(_mm512_setzero_si512(), w, x))
}

/// [`super::q32_block`] with one 32-lane vector per block.
macro_rules! q32_block {
    ($b:expr, $x:expr, $bi:expr, $acc:expr, $mins:expr) => {{
        let (b, bi): (&[u8], usize) = ($b, $bi);
        let (d, m) = if KIND == 0 { (f16(b), 0.0) } else { f16x2(b) };
        let wv = if KIND == 0 {
            _mm512_cvtepi8_epi16(ld32(&b[2..]))
        } else {
            // lanes 0-15: the low nibbles (elements 0-15), 16-31: the high ones (16-31)
            let v = _mm256_cvtepu8_epi16(ld16(&b[if KIND == 1 { 4 } else { 8 }..]));
            let lo = _mm256_and_si256(v, _mm256_set1_epi16(0x0F));
            let w = _mm512_inserti64x4::<1>(_mm512_castsi256_si512(lo), _mm256_srli_epi16(v, 4));
            if KIND == 2 {
                // bit j of qh is bit 4 of element j: 16 added to the lanes it marks
                let qh = u32::from_le_bytes([b[4], b[5], b[6], b[7]]);
                _mm512_mask_add_epi16(w, qh, w, _mm512_set1_epi16(16))
            } else {
                w
            }
        };
        for i in 0..NX {
            // SAFETY: bi is a block of a weight row as long as the activation rows (q32).
            let ((u, sum), xv) = unsafe { ($x[i].unit_sum(bi), xblock(&$x[i], bi)) };
            $acc[i] = _mm512_fmadd_ps(dot(wv, xv), _mm512_set1_ps(d * u), $acc[i]);
            if KIND != 0 {
                $mins[i] = m.mul_add(sum, $mins[i]);
            }
        }
    }};
}

/// [`super::q32`]: Q8_0 (`KIND` 0), Q4_1 (1), Q5_1 (2); even and odd blocks in two chains.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
fn q32<const NX: usize, const KIND: u8>(
    w: &[u8],
    x: &[XRow<'_>; NX],
    n: usize,
    out: &mut [f32],
    g0: usize,
) {
    let bb = match KIND {
        0 => 34,
        1 => 20,
        _ => 24,
    };
    let nb = x[0].d.len();
    for (row, o) in w.chunks_exact(nb * bb).zip(out.chunks_exact_mut(n)) {
        let mut even = [_mm512_setzero_ps(); NX];
        let mut odd = [_mm512_setzero_ps(); NX];
        let (mut mins_even, mut mins_odd) = ([0f32; NX], [0f32; NX]);
        let mut pairs = row.chunks_exact(2 * bb);
        for (k, b2) in pairs.by_ref().enumerate() {
            prefetch(b2, PREFETCH_AHEAD);
            q32_block!(&b2[..bb], x, 2 * k, even, mins_even);
            q32_block!(&b2[bb..], x, 2 * k + 1, odd, mins_odd);
        }
        let last = pairs.remainder();
        if !last.is_empty() {
            q32_block!(last, x, nb - 1, even, mins_even);
        }
        for i in 0..NX {
            o[g0 + i] =
                _mm512_reduce_add_ps(_mm512_add_ps(even[i], odd[i])) + (mins_even[i] + mins_odd[i]);
        }
    }
}

/// [`super::q4k`]: each 32-byte run of quants widens once; its low nibbles are sub-block 2c,
/// its high ones 2c + 1.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
fn q4k<const NX: usize>(w: &[u8], x: &[XRow<'_>; NX], n: usize, out: &mut [f32], g0: usize) {
    let nb = x[0].d.len() / 8;
    let m4 = _mm512_set1_epi16(0x0F);
    for (row, o) in w.chunks_exact(nb * 144).zip(out.chunks_exact_mut(n)) {
        let mut acc = [[_mm512_setzero_ps(); 2]; NX];
        let mut mins = [_mm256_setzero_ps(); NX];
        for (bi, b) in row.chunks_exact(144).enumerate() {
            for line in [0, 64, 128] {
                prefetch(b, PREFETCH_AHEAD + line);
            }
            let sc = q4k_scales(b, x, bi, &mut mins);
            for c in 0..4 {
                let v = _mm512_cvtepu8_epi16(ld32(&b[16 + 32 * c..]));
                let (lo, hi) = (_mm512_and_si512(v, m4), _mm512_srli_epi16::<4>(v));
                let k = bi * 8 + 2 * c;
                for i in 0..NX {
                    let (s0, s1) = (sc[i][2 * c], sc[i][2 * c + 1]);
                    // SAFETY: k + 1 < 8 nb, the activation row's block count (x16 rows are
                    // cols / 32 blocks, the weight row cols / 256 super-blocks).
                    let (x0, x1) = unsafe { (xblock(&x[i], k), xblock(&x[i], k + 1)) };
                    let (p0, p1) = (dot(lo, x0), dot(hi, x1));
                    acc[i][0] = _mm512_fmadd_ps(p0, _mm512_set1_ps(s0), acc[i][0]);
                    acc[i][1] = _mm512_fmadd_ps(p1, _mm512_set1_ps(s1), acc[i][1]);
                }
            }
        }
        for i in 0..NX {
            let a = _mm512_reduce_add_ps(_mm512_add_ps(acc[i][0], acc[i][1]));
            o[g0 + i] = a - hsum(mins[i]);
        }
    }
}

/// [`super::q6k`]: the 6-bit quants of activation block s of half h, assembled as bytes as
/// there, widen into one vector; its 16 lanes take the scales `d * sc * u` of sub-blocks
/// 8h + 2s (lanes 0-7) and 8h + 2s + 1 (lanes 8-15).
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
fn q6k<const NX: usize>(w: &[u8], x: &[XRow<'_>; NX], n: usize, out: &mut [f32], g0: usize) {
    let nb = x[0].d.len() / 8;
    let k32 = _mm256_set1_epi8(32);
    // lane j of the 16 sub-block scales takes the unit of activation block j / 2
    let pair = _mm512_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7);
    // for activation block b of a super-block: lanes 0-7 from scale 2b, lanes 8-15 from 2b + 1
    let halves = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1);
    let pick: [__m512i; 8] =
        std::array::from_fn(|b| _mm512_add_epi32(_mm512_set1_epi32(2 * b as i32), halves));
    for (row, o) in w.chunks_exact(nb * 210).zip(out.chunks_exact_mut(n)) {
        let mut acc = [[_mm512_setzero_ps(); 2]; NX];
        for (bi, b) in row.chunks_exact(210).enumerate() {
            for line in [0, 64, 128, 192] {
                prefetch(b, PREFETCH_AHEAD + line);
            }
            let d = _mm512_set1_ps(f16(&b[208..]));
            let s16 = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(ld16(&b[192..]))), d);
            let su: [__m512; NX] = std::array::from_fn(|i| {
                let u = _mm512_castps256_ps512(ld8(&x[i].d[bi * 8..]));
                _mm512_mul_ps(s16, _mm512_permutexvar_ps(pair, u))
            });
            for h in 0..2 {
                let q = q6k_quants(b, h);
                for (s, &qs) in q.iter().enumerate() {
                    let wv = _mm512_cvtepi8_epi16(_mm256_sub_epi8(qs, k32));
                    let blk = 4 * h + s;
                    for i in 0..NX {
                        let sv = _mm512_permutexvar_ps(pick[blk], su[i]);
                        // SAFETY: bi * 8 + blk < 8 nb, as in q4k.
                        let p = dot(wv, unsafe { xblock(&x[i], bi * 8 + blk) });
                        acc[i][s & 1] = _mm512_fmadd_ps(p, sv, acc[i][s & 1]);
                    }
                }
            }
        }
        for i in 0..NX {
            o[g0 + i] = _mm512_reduce_add_ps(_mm512_add_ps(acc[i][0], acc[i][1]));
        }
    }
}

/// [`super::rows`] with the AVX-512 kernels; false (and nothing written) for a type without
/// one.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
pub fn rows(t: QType, w: &[u8], x: &[f32], n: usize, cols: usize, out: &mut [f32]) -> bool {
    if !super::integer(t) {
        return false;
    }
    let x16: X16 = quantize(x, n, cols);
    match t {
        QType::Q8_0 => dispatch!(q32, 0; w, &x16, n, cols, out),
        QType::Q4_1 => dispatch!(q32, 1; w, &x16, n, cols, out),
        QType::Q5_1 => dispatch!(q32, 2; w, &x16, n, cols, out),
        QType::Q4K => dispatch!(q4k; w, &x16, n, cols, out),
        _ => dispatch!(q6k; w, &x16, n, cols, out),
    }
    true
}
