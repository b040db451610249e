//! Integer AVX2 kernels: the weights' integer quants against the activations as 15-bit integers.
//!
//! Each activation row is cut into 32-element blocks; a block becomes `x = u (254 q + r)` with
//! `u = max|x| / (127 * 254)`, `q` the int8 high digit and `r` the int8 remainder (two int8
//! digits, stored as their value `254 q + r`, |.| <= 32385, in one i16), so each activation is
//! off by at most half a step of the low digit, `max|x| / 64516` (one digit, as ggml's q8 dot
//! products use, flips greedy tokens of small models). Plus the block's exact fp32 sum, which
//! the mins of Q4_1, Q5_1 and Q4_K meet.
//!
//! The weights' quants are widened to i16 (`q - 32` for Q6_K, signed bytes for Q8_0, MXFP4's
//! nibbles looked up as doubled e2m1 integers, the unsigned nibbles otherwise) and `vpmaddwd` sums pairs of exact products into i32 lanes (a
//! lane holds at most 4 products, below 2^31). Per 32-block (Q6_K: per 16) the lanes turn fp32
//! once and meet the fp32 scale `d_w * sc * u` in a fused multiply-add; the result differs from
//! the fp32 dot by the activation rounding alone, times the weights without their min.
//!
//! One weight row at a time, against up to [`MAX_NX`] activation rows, each with two accumulator
//! chains (a single chain of fused multiply-adds bounds a matvec by their latency). Taking 2 or 4
//! weight rows per pass to share the activation loads measured slower here (Q8_0 and Q6_K by up
//! to 2x, Q4_K and Q5_1 no faster): the loads are not the bound.

use std::arch::x86_64::*;

use super::super::blocks::{e8m0_half, ue4m3_half, QType, E2M1_X2, IQ4_VALUES};
use super::super::kernel::MAX_NX;

mod act;
use act::{group, quantize, XRow, X16};

/// The 8 floats at `s[..8]`.
#[inline(always)]
pub(super) fn ld8(s: &[f32]) -> __m256 {
    let s = &s[..8];
    // SAFETY: 8 readable f32 (sliced above); loadu accepts any alignment.
    unsafe { _mm256_loadu_ps(s.as_ptr()) }
}

/// The 16 i16 at `s[..16]`.
#[inline(always)]
fn ldw(s: &[i16]) -> __m256i {
    let s = &s[..16];
    // SAFETY: 32 readable bytes (sliced above); loadu accepts any alignment.
    unsafe { _mm256_loadu_si256(s.as_ptr().cast()) }
}

/// The 32 bytes at `s[..32]`.
#[inline(always)]
pub(super) fn ld32(s: &[u8]) -> __m256i {
    let s = &s[..32];
    // SAFETY: 32 readable bytes (sliced above); loadu accepts any alignment.
    unsafe { _mm256_loadu_si256(s.as_ptr().cast()) }
}

/// Bytes ahead of the current block that the kernels ask the CPU to fetch: at one thread the
/// hardware prefetcher alone leaves the weight stream short of the memory's bandwidth. Weights
/// streamed from DRAM (400 MB of demo-shaped matrices, one thread): 1 KiB ahead 88 µs a Q5_1
/// 1536x576 call, 2 KiB 74-76, 4 KiB 71-72 (Q6_K 576x1536: 2 KiB 85, 4 KiB 77), 8 and
/// 16 KiB no better; from cache 57 µs at every distance.
const PREFETCH_AHEAD: usize = 4096;

/// Hints the cache line `ahead` bytes past the start of `s` into L1 (a hint: never faults,
/// whatever the address).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn prefetch(s: &[u8], ahead: usize) {
    _mm_prefetch::<_MM_HINT_T0>(s.as_ptr().wrapping_add(ahead).cast());
}

/// The 16 bytes at `s[..16]`.
#[inline(always)]
pub(super) fn ld16(s: &[u8]) -> __m128i {
    let s = &s[..16];
    // SAFETY: 16 readable bytes (sliced above); loadu accepts any alignment.
    unsafe { _mm_loadu_si128(s.as_ptr().cast()) }
}

/// The 8 bytes at `s[..8]`, in the low half of a vector.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) fn ld8b(s: &[u8]) -> __m128i {
    let s: [u8; 8] = s[..8].try_into().unwrap_or([0; 8]);
    _mm_cvtsi64_si128(i64::from_le_bytes(s))
}

/// The fp16 at `b[0..2]` as fp32.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) fn f16(b: &[u8]) -> f32 {
    let h = u16::from_le_bytes([b[0], b[1]]);
    _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(h as i32)))
}

/// The two fp16 at `b[0..4]` as fp32.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn f16x2(b: &[u8]) -> (f32, f32) {
    let h = u32::from_le_bytes([b[0], b[1], b[2], b[3]]);
    let v = _mm_cvtph_ps(_mm_cvtsi32_si128(h as i32));
    (_mm_cvtss_f32(v), _mm_cvtss_f32(_mm_movehdup_ps(v)))
}

/// Sum of the 8 lanes.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) fn hsum(v: __m256) -> f32 {
    let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    let s = _mm_add_ss(s, _mm_movehdup_ps(s));
    _mm_cvtss_f32(s)
}

/// The 32 bytes of `v` as two vectors of 16 i16, sign-extended (elements 0-15, 16-31).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn widen_i8(v: __m256i) -> (__m256i, __m256i) {
    (
        _mm256_cvtepi8_epi16(_mm256_castsi256_si128(v)),
        _mm256_cvtepi8_epi16(_mm256_extracti128_si256(v, 1)),
    )
}

/// `sum w[j] x[j]` over 32 elements as 8 fp32 lanes (exact: each lane sums 4 products).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn dot32(w: (__m256i, __m256i), x: (__m256i, __m256i)) -> __m256 {
    let p = _mm256_add_epi32(_mm256_madd_epi16(w.0, x.0), _mm256_madd_epi16(w.1, x.1));
    _mm256_cvtepi32_ps(p)
}

/// The two i16 vectors of 32-block `k` of an activation row.
///
/// # Safety
/// As [`XRow::block`]: `k` is below the row's block count.
#[inline(always)]
unsafe fn xblock(x: &XRow<'_>, k: usize) -> (__m256i, __m256i) {
    // SAFETY: this function's contract.
    let v = unsafe { x.block(k) };
    (ldw(v), ldw(&v[16..]))
}

/// One group of `NX` activation rows against every weight row of `w`; writes
/// `out[r * n + g0 + i]`.
type GroupFn<const NX: usize> = fn(&[u8], &[XRow<'_>; NX], usize, &mut [f32], usize);

/// 0xFF in byte `j` where byte `pick[j]` of `v` has a bit of `bits[j]` set (`bits` one bit a
/// byte), else 0: a shuffle of the broadcast `v`, an AND and a compare, no scalar work.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) fn bit_mask(v: u32, pick: __m256i, bits: __m256i) -> __m256i {
    let spread = _mm256_shuffle_epi8(_mm256_set1_epi32(v as i32), pick);
    _mm256_cmpeq_epi8(_mm256_and_si256(spread, bits), bits)
}

/// [`bit_mask`] of bit `j % 8` of byte `j / 8`: one bit of `v` per byte, in order.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) fn bits32(v: u32) -> __m256i {
    let pick = _mm256_setr_epi8(
        0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, // from the low lane's copy
        2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3, // from the high lane's copy
    );
    bit_mask(
        v,
        pick,
        _mm256_set1_epi64x(0x8040_2010_0804_0201_u64 as i64),
    ) // byte k: 1 << k
}

/// The 32 fifth bits `qh` of a Q5_1 block as i16 lanes of 16 or 0, lane j of the first
/// vector for element j and of the second for element 16 + j: [`bits32`]'s 0xFF or 0 per
/// byte, then 16 or 0, widened. (A broadcast-and-compare per 16 lanes took four more ops.)
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn fifth_bits(qh: u32) -> (__m256i, __m256i) {
    let b = _mm256_and_si256(bits32(qh), _mm256_set1_epi8(16));
    (
        _mm256_cvtepu8_epi16(_mm256_castsi256_si128(b)),
        _mm256_cvtepu8_epi16(_mm256_extracti128_si256(b, 1)),
    )
}

/// An MXFP4 block's 16 bytes of nibbles as the 32 doubled e2m1 values they code, signed bytes
/// in element order: (elements 0-15 from the low nibbles, 16-31 from the high ones). One byte
/// shuffle per half looks each nibble up in [`E2M1_X2`] (|value| <= 12, exact in the products).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) fn e2m1_nibbles(v: __m128i) -> (__m128i, __m128i) {
    level_nibbles(v, &E2M1_X2)
}

/// 16 bytes of nibbles as the 32 signed levels `table[q]` they index, in element order
/// (elements 0-15 from the low nibbles, 16-31 from the high ones): one byte shuffle per half.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn level_nibbles(v: __m128i, table: &[i8; 16]) -> (__m128i, __m128i) {
    let lut = ld16(&table.map(|q| q as u8));
    let m4 = _mm_set1_epi8(0x0F);
    (
        _mm_shuffle_epi8(lut, _mm_and_si128(v, m4)),
        _mm_shuffle_epi8(lut, _mm_and_si128(_mm_srli_epi16(v, 4), m4)),
    )
}

/// IQ4's 16 bytes of nibbles as two vectors of 16 i16 levels ([`IQ4_VALUES`], |level| <= 127:
/// four products with a 15-bit activation stay below 2^24, exact through `dot32`).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn iq4_levels(b: &[u8]) -> (__m256i, __m256i) {
    let (lo, hi) = level_nibbles(ld16(b), &IQ4_VALUES);
    (_mm256_cvtepi8_epi16(lo), _mm256_cvtepi8_epi16(hi))
}

/// Adds block `$bi` of one weight row (`$b`, of the 32-element kind `KIND`, see [`q32`]) times
/// each activation row's block `$bi` to `$acc[i]`, and its min times the block sum to
/// `$mins[i]` (a macro so that it inlines into the `target_feature` kernel).
macro_rules! q32_block {
    ($b:expr, $x:expr, $bi:expr, $acc:expr, $mins:expr) => {{
        let (b, bi): (&[u8], usize) = ($b, $bi);
        let (d, m) = match KIND {
            0 | 4 => (f16(b), 0.0),
            3 => (e8m0_half(b[0]), 0.0),
            _ => f16x2(b),
        };
        let wv = if KIND == 0 {
            (
                _mm256_cvtepi8_epi16(ld16(&b[2..])),
                _mm256_cvtepi8_epi16(ld16(&b[18..])),
            )
        } else if KIND == 4 {
            iq4_levels(&b[2..])
        } else if KIND == 3 {
            let (lo, hi) = e2m1_nibbles(ld16(&b[1..]));
            (_mm256_cvtepi8_epi16(lo), _mm256_cvtepi8_epi16(hi))
        } else {
            // widened bytes: each i16 lane holds element j (low nibble) and j + 16 (high)
            let v = _mm256_cvtepu8_epi16(ld16(&b[if KIND == 1 { 4 } else { 8 }..]));
            let lo = _mm256_and_si256(v, _mm256_set1_epi16(0x0F));
            let hi = _mm256_srli_epi16(v, 4);
            if KIND == 2 {
                let (h0, h1) = fifth_bits(u32::from_le_bytes([b[4], b[5], b[6], b[7]]));
                (_mm256_or_si256(lo, h0), _mm256_or_si256(hi, h1))
            } else {
                (lo, hi)
            }
        };
        for i in 0..NX {
            // SAFETY: bi is a block of a weight row as long as the activation rows (q32).
            let ((u, sum), xv) = unsafe { ($x[i].unit_sum(bi), xblock(&$x[i], bi)) };
            $acc[i] = _mm256_fmadd_ps(dot32(wv, xv), _mm256_set1_ps(d * u), $acc[i]);
            if KIND == 1 || KIND == 2 {
                $mins[i] = m.mul_add(sum, $mins[i]);
            }
        }
    }};
}

/// The 32-element blocks against int activations, by `KIND`: 0 = Q8_0 (signed bytes), 1 =
/// Q4_1, 2 = Q5_1 (nibbles, Q5_1 plus bit j of the u32 `qh` as bit 4 of element j; the min
/// `m` meets the exact block sum), 3 = MXFP4 (nibbles looked up as doubled e2m1 integers,
/// times the halved e8m0 scale: [`e2m1_nibbles`]), 4 = IQ4_NL (nibbles looked up in
/// [`IQ4_VALUES`], times the fp16 d). Even and odd blocks go to two accumulator chains (and two
/// chains of mins).
#[target_feature(enable = "avx2,fma,f16c")]
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
        2 => 24,
        3 => 17,
        _ => 18,
    };
    let nb = x[0].d.len();
    for (row, o) in w.chunks_exact(nb * bb).zip(out.chunks_exact_mut(n)) {
        let mut even = [_mm256_setzero_ps(); NX];
        let mut odd = [_mm256_setzero_ps(); NX];
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
            o[g0 + i] = hsum(_mm256_add_ps(even[i], odd[i])) + (mins_even[i] + mins_odd[i]);
        }
    }
}

/// NVFP4 against int activations: each 64-weight block meets two 32-blocks of the activations,
/// each of those two 16-weight sub-blocks with their own e4m3 scales. A half's 16 bytes of
/// nibbles are looked up as doubled e2m1 integers (MXFP4's [`e2m1_nibbles`]): the low nibbles
/// are elements 0-7 and 16-23, the high ones 8-15 and 24-31, the order the activations were put
/// in ([`X16::in_nibble_order`]), so after `vpmaddwd` lanes 0-3 hold the first sub-block's
/// pair sums and 4-7 the second's (|.| <= 4 * 12 * 32385, exact), and one fused multiply-add
/// meets both scales (`ue4m3_half(s) * u`, four lanes each). The halves go to two chains; the
/// tensor scale is the caller's ([`crate::quant::matmul`]).
#[target_feature(enable = "avx2,fma,f16c")]
fn nvfp4<const NX: usize>(w: &[u8], x: &[XRow<'_>; NX], n: usize, out: &mut [f32], g0: usize) {
    let nb = x[0].d.len(); // 32-blocks per row: 2 per block
    for (row, o) in w.chunks_exact(nb / 2 * 36).zip(out.chunks_exact_mut(n)) {
        let mut chains = [[_mm256_setzero_ps(); NX]; 2];
        for (k, b) in row.chunks_exact(36).enumerate() {
            prefetch(b, PREFETCH_AHEAD);
            for (h, acc) in chains.iter_mut().enumerate() {
                let (lo, hi) = e2m1_nibbles(ld16(&b[4 + 16 * h..]));
                let wv = (_mm256_cvtepi8_epi16(lo), _mm256_cvtepi8_epi16(hi));
                let dv = _mm256_setr_m128(
                    _mm_set1_ps(ue4m3_half(b[2 * h])),
                    _mm_set1_ps(ue4m3_half(b[2 * h + 1])),
                );
                let bi = 2 * k + h;
                for i in 0..NX {
                    // SAFETY: bi is a block of a weight row as long as the activation rows.
                    let ((u, _), xv) = unsafe { (x[i].unit_sum(bi), xblock(&x[i], bi)) };
                    let scale = _mm256_mul_ps(dv, _mm256_set1_ps(u));
                    acc[i] = _mm256_fmadd_ps(dot32(wv, xv), scale, acc[i]);
                }
            }
        }
        for i in 0..NX {
            o[g0 + i] = hsum(_mm256_add_ps(chains[0][i], chains[1][i]));
        }
    }
}

/// Runs kernel `$kern` over the activation rows in groups of up to 8 (the last one smaller).
macro_rules! dispatch {
    ($kern:ident $(, $extra:expr)*; $w:expr, $x:expr, $n:expr, $cols:expr, $out:expr) => {{
        let mut g0 = 0;
        while g0 < $n {
            let g = ($n - g0).min(MAX_NX);
            match g {
                1 => group::<1>($kern::<1 $(, $extra)*>, $w, $x, $n, $cols, g0, $out),
                2 => group::<2>($kern::<2 $(, $extra)*>, $w, $x, $n, $cols, g0, $out),
                3 => group::<3>($kern::<3 $(, $extra)*>, $w, $x, $n, $cols, g0, $out),
                4 => group::<4>($kern::<4 $(, $extra)*>, $w, $x, $n, $cols, g0, $out),
                5 => group::<5>($kern::<5 $(, $extra)*>, $w, $x, $n, $cols, g0, $out),
                6 => group::<6>($kern::<6 $(, $extra)*>, $w, $x, $n, $cols, g0, $out),
                7 => group::<7>($kern::<7 $(, $extra)*>, $w, $x, $n, $cols, g0, $out),
                _ => group::<8>($kern::<8 $(, $extra)*>, $w, $x, $n, $cols, g0, $out),
            }
            g0 += g;
        }
    }};
}

/// Whether `t` has an integer kernel here (and some in [`wide`]).
fn integer(t: QType) -> bool {
    super::super::has_integer_kernel(t)
}

/// The integer kernel of `t` (Q8_0, Q4_1, Q5_1, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, MXFP4, IQ4_NL,
/// IQ4_XS, NVFP4, the i-quants IQ1_S to IQ3_S) for `n` rows
/// of `x`; false (and nothing written) for another type.
#[target_feature(enable = "avx2,fma,f16c")]
pub fn rows(t: QType, w: &[u8], x: &[f32], n: usize, cols: usize, out: &mut [f32]) -> bool {
    if !integer(t) {
        return false;
    }
    let x16 = quantize(x, n, cols);
    match t {
        QType::Q8_0 => dispatch!(q32, 0; w, &x16, n, cols, out),
        QType::Q4_1 => dispatch!(q32, 1; w, &x16, n, cols, out),
        QType::Q5_1 => dispatch!(q32, 2; w, &x16, n, cols, out),
        QType::Mxfp4 => dispatch!(q32, 3; w, &x16, n, cols, out),
        QType::Iq4Nl => dispatch!(q32, 4; w, &x16, n, cols, out),
        QType::Iq4Xs => dispatch!(iq4xs; w, &x16, n, cols, out),
        QType::Nvfp4 => {
            let x16 = x16.in_nibble_order();
            dispatch!(nvfp4; w, &x16, n, cols, out)
        }
        QType::Q3K => dispatch!(q3k; w, &x16, n, cols, out),
        QType::Q2K => dispatch!(q2k; w, &x16, n, cols, out),
        QType::Iq2Xxs => dispatch!(iq, 0, 66; w, &x16, n, cols, out),
        QType::Iq2Xs => dispatch!(iq, 1, 74; w, &x16, n, cols, out),
        QType::Iq2S => dispatch!(iq, 2, 82; w, &x16, n, cols, out),
        QType::Iq3Xxs => dispatch!(iq, 3, 98; w, &x16, n, cols, out),
        QType::Iq3S => dispatch!(iq, 4, 110; w, &x16, n, cols, out),
        QType::Iq1S => dispatch!(iq, 5, 50; w, &x16, n, cols, out),
        QType::Iq1M => dispatch!(iq, 6, 56; w, &x16, n, cols, out),
        QType::Q4K => dispatch!(q4k, false; w, &x16, n, cols, out),
        QType::Q5K => dispatch!(q4k, true; w, &x16, n, cols, out),
        _ => dispatch!(q6k; w, &x16, n, cols, out),
    }
    true
}

mod iquants;
mod kquants;
pub(super) mod wide;

use iquants::iq;
use kquants::{iq4xs, q2k, q3k, q4k, q6k, scales_mins_k4};
