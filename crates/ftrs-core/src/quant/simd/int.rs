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

use super::super::blocks::{e8m0_half, QType, E2M1_X2, IQ4_VALUES};
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

/// The 32 fifth bits `qh` of a Q5_1 block as i16 lanes of 16 or 0, lane j of the first
/// vector for element j and of the second for element 16 + j. In bytes first: a shuffle puts
/// byte j / 8 of `qh` in byte j, one AND per byte keeps bit j % 8, a compare turns it into 0xFF
/// or 0; then 16 or 0, widened. (A broadcast-and-compare per 16 lanes took four more ops.)
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn fifth_bits(qh: u32) -> (__m256i, __m256i) {
    let spread = _mm256_shuffle_epi8(
        _mm256_set1_epi32(qh as i32),
        _mm256_setr_epi8(
            0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, // from the low lane's copy
            2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3, // from the high lane's copy
        ),
    );
    let bit = _mm256_set1_epi64x(0x8040_2010_0804_0201_u64 as i64); // byte k: 1 << k
    let set = _mm256_cmpeq_epi8(_mm256_and_si256(spread, bit), bit);
    let b = _mm256_and_si256(set, _mm256_set1_epi8(16));
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

/// IQ4_XS against int activations: per 256-weight super-block, eight 32-weight sub-blocks
/// each scaled by `d * (ls - 32)` (the 6-bit `ls` from `scales_l` and `scales_h`, as
/// `blocks::decode_iq4xs`), their levels looked up as IQ4_NL's; even and odd sub-blocks go to
/// two accumulator chains.
#[target_feature(enable = "avx2,fma,f16c")]
fn iq4xs<const NX: usize>(w: &[u8], x: &[XRow<'_>; NX], n: usize, out: &mut [f32], g0: usize) {
    let nb = x[0].d.len(); // 32-blocks per row: 8 per super-block
    for (row, o) in w.chunks_exact(nb / 8 * 136).zip(out.chunks_exact_mut(n)) {
        let mut chains = [[_mm256_setzero_ps(); NX]; 2];
        for (sb, b) in row.chunks_exact(136).enumerate() {
            prefetch(b, PREFETCH_AHEAD);
            let d = f16(b);
            let high = u16::from_le_bytes([b[2], b[3]]);
            for s in 0..8 {
                let ls = ((b[4 + s / 2] >> (4 * (s % 2))) & 0x0F)
                    | ((((high >> (2 * s)) & 3) as u8) << 4);
                let dl = d * (ls as i32 - 32) as f32;
                let wv = iq4_levels(&b[8 + 16 * s..]);
                let bi = 8 * sb + s;
                let acc = &mut chains[s % 2];
                for i in 0..NX {
                    // SAFETY: bi is a block of a weight row as long as the activation rows.
                    let ((u, _), xv) = unsafe { (x[i].unit_sum(bi), xblock(&x[i], bi)) };
                    acc[i] = _mm256_fmadd_ps(dot32(wv, xv), _mm256_set1_ps(dl * u), acc[i]);
                }
            }
        }
        for i in 0..NX {
            o[g0 + i] = hsum(_mm256_add_ps(chains[0][i], chains[1][i]));
        }
    }
}

/// The 8 (scale, min) pairs of a Q4_K block's 12 packed bytes as two vectors of 8 floats
/// (the layout of `blocks::scale_min_k4`, unpacked 4 at a time in 32-bit words).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn scales_mins_k4(s: &[u8]) -> (__m256, __m256) {
    let word = |k: usize| u32::from_le_bytes([s[4 * k], s[4 * k + 1], s[4 * k + 2], s[4 * k + 3]]);
    let (w0, w1, w2) = (word(0), word(1), word(2));
    let (low6, low4, top2) = (0x3F3F_3F3Fu32, 0x0F0F_0F0Fu32, 0x0303_0303u32);
    let sc = (w0 & low6) as u64 | ((((w2 & low4) | (((w0 >> 6) & top2) << 4)) as u64) << 32);
    let mn = (w1 & low6) as u64 | (((((w2 >> 4) & low4) | (((w1 >> 6) & top2) << 4)) as u64) << 32);
    let f = |v: u64| _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128(v as i64)));
    (f(sc), f(mn))
}

/// A Q4_K super-block's prologue, per activation row: the 8 sub-block scales `d * sc * u`, and
/// `dmin * m * sum(x over each sub-block)` added to `mins[i]`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn q4k_scales<const NX: usize>(
    b: &[u8],
    x: &[XRow<'_>; NX],
    bi: usize,
    mins: &mut [__m256; NX],
) -> [[f32; 8]; NX] {
    let (d, dmin) = f16x2(b);
    let (s8, m8) = scales_mins_k4(&b[4..16]);
    let (s8, m8) = (
        _mm256_mul_ps(s8, _mm256_set1_ps(d)),
        _mm256_mul_ps(m8, _mm256_set1_ps(dmin)),
    );
    let mut sc = [[0f32; 8]; NX];
    for i in 0..NX {
        let s = _mm256_mul_ps(s8, ld8(&x[i].d[bi * 8..]));
        // SAFETY: sc[i] holds 8 f32; storeu accepts any alignment.
        unsafe { _mm256_storeu_ps(sc[i].as_mut_ptr(), s) };
        mins[i] = _mm256_fmadd_ps(m8, ld8(&x[i].s[bi * 8..]), mins[i]);
    }
    sc
}

/// Q4_K against int activations: the low nibbles of each 32-byte run are sub-block 2c, the
/// high ones 2c + 1 (two accumulator chains); each sub-block's dot meets `d * sc * u`; the mins
/// enter as `dmin * m * sum(x over the sub-block)`, 8 at a time. `Q5`: Q5_K, the same with the
/// fifth bits of sub-blocks 2c and 2c + 1 from bits 2c and 2c + 1 of `qh[l]` (bytes 16..48).
#[target_feature(enable = "avx2,fma,f16c")]
fn q4k<const NX: usize, const Q5: bool>(
    w: &[u8],
    x: &[XRow<'_>; NX],
    n: usize,
    out: &mut [f32],
    g0: usize,
) {
    let nb = x[0].d.len() / 8;
    let m4 = _mm256_set1_epi16(0x0F);
    let (bb, qs) = if Q5 { (176, 48) } else { (144, 16) };
    for (row, o) in w.chunks_exact(nb * bb).zip(out.chunks_exact_mut(n)) {
        let mut acc = [[_mm256_setzero_ps(); 2]; NX];
        let mut mins = [_mm256_setzero_ps(); NX];
        for (bi, b) in row.chunks_exact(bb).enumerate() {
            for line in [0, 64, 128] {
                prefetch(b, PREFETCH_AHEAD + line);
            }
            let sc = q4k_scales(b, x, bi, &mut mins);
            for c in 0..4 {
                let q = &b[qs + 32 * c..qs + 32 * c + 32];
                let v0 = _mm256_cvtepu8_epi16(ld16(q));
                let v1 = _mm256_cvtepu8_epi16(ld16(&q[16..]));
                let mut lo = (_mm256_and_si256(v0, m4), _mm256_and_si256(v1, m4));
                let mut hi = (_mm256_srli_epi16(v0, 4), _mm256_srli_epi16(v1, 4));
                if Q5 {
                    let (h0, h1) = (
                        _mm256_cvtepu8_epi16(ld16(&b[16..])),
                        _mm256_cvtepu8_epi16(ld16(&b[32..])),
                    );
                    let bit = |v: __m256i, k: i32| {
                        let one = _mm256_and_si256(
                            _mm256_srl_epi16(v, _mm_cvtsi32_si128(k)),
                            _mm256_set1_epi16(1),
                        );
                        _mm256_slli_epi16(one, 4)
                    };
                    let k = 2 * c as i32;
                    lo = (
                        _mm256_or_si256(lo.0, bit(h0, k)),
                        _mm256_or_si256(lo.1, bit(h1, k)),
                    );
                    hi = (
                        _mm256_or_si256(hi.0, bit(h0, k + 1)),
                        _mm256_or_si256(hi.1, bit(h1, k + 1)),
                    );
                }
                let k = bi * 8 + 2 * c;
                for i in 0..NX {
                    let (s0, s1) = (sc[i][2 * c], sc[i][2 * c + 1]);
                    // SAFETY: k + 1 < 8 nb, the activation row's block count (x16 rows are
                    // cols / 32 blocks, the weight row cols / 256 super-blocks).
                    let (x0, x1) = unsafe { (xblock(&x[i], k), xblock(&x[i], k + 1)) };
                    let (p0, p1) = (dot32(lo, x0), dot32(hi, x1));
                    acc[i][0] = _mm256_fmadd_ps(p0, _mm256_set1_ps(s0), acc[i][0]);
                    acc[i][1] = _mm256_fmadd_ps(p1, _mm256_set1_ps(s1), acc[i][1]);
                }
            }
        }
        for i in 0..NX {
            let a = _mm256_add_ps(acc[i][0], acc[i][1]);
            o[g0 + i] = hsum(_mm256_sub_ps(a, mins[i]));
        }
    }
}

/// The 6-bit quants (0..63, bytes) of half `h` of a Q6_K super-block, as four 32-byte runs:
/// run s holds the elements of activation block 4h + s (low nibble | high 2 bits << 4).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn q6k_quants(b: &[u8], h: usize) -> [__m256i; 4] {
    let (m4, m30) = (_mm256_set1_epi8(0x0F), _mm256_set1_epi8(0x30));
    let ql0 = ld32(&b[64 * h..]);
    let ql1 = ld32(&b[64 * h + 32..]);
    let qh = ld32(&b[128 + 32 * h..]);
    [
        _mm256_or_si256(
            _mm256_and_si256(ql0, m4),
            _mm256_and_si256(_mm256_slli_epi16(qh, 4), m30),
        ),
        _mm256_or_si256(
            _mm256_and_si256(ql1, m4),
            _mm256_and_si256(_mm256_slli_epi16(qh, 2), m30),
        ),
        _mm256_or_si256(
            _mm256_and_si256(_mm256_srli_epi16(ql0, 4), m4),
            _mm256_and_si256(qh, m30),
        ),
        _mm256_or_si256(
            _mm256_and_si256(_mm256_srli_epi16(ql1, 4), m4),
            _mm256_and_si256(_mm256_srli_epi16(qh, 2), m30),
        ),
    ]
}

/// Q6_K against int activations: per half block h, 32-block s of the activations meets the
/// 6-bit quants `(low nibble | high 2 bits << 4) - 32` assembled as bytes and widened; its two
/// 16-element halves (sub-blocks 8h + 2s and 8h + 2s + 1) meet their own `d * sc * u`, in two
/// accumulator chains.
#[target_feature(enable = "avx2,fma,f16c")]
fn q6k<const NX: usize>(w: &[u8], x: &[XRow<'_>; NX], n: usize, out: &mut [f32], g0: usize) {
    let nb = x[0].d.len() / 8;
    let k32 = _mm256_set1_epi8(32);
    // lane j of the 16 scales' expansion takes the unit of activation block j / 2
    let pair_lo = _mm256_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3);
    let pair_hi = _mm256_setr_epi32(4, 4, 5, 5, 6, 6, 7, 7);
    for (row, o) in w.chunks_exact(nb * 210).zip(out.chunks_exact_mut(n)) {
        let mut acc = [[_mm256_setzero_ps(); 2]; NX];
        for (bi, b) in row.chunks_exact(210).enumerate() {
            for line in [0, 64, 128, 192] {
                prefetch(b, PREFETCH_AHEAD + line);
            }
            let d = _mm256_set1_ps(f16(&b[208..]));
            let s0 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(ld8b(&b[192..])));
            let s1 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(ld8b(&b[200..])));
            let (s0, s1) = (_mm256_mul_ps(s0, d), _mm256_mul_ps(s1, d));
            let mut sc = [[0f32; 16]; NX];
            for i in 0..NX {
                let u = ld8(&x[i].d[bi * 8..]);
                let u0 = _mm256_permutevar8x32_ps(u, pair_lo);
                let u1 = _mm256_permutevar8x32_ps(u, pair_hi);
                let (lo, hi) = sc[i].split_at_mut(8);
                // SAFETY: lo and hi hold 8 f32 each; storeu accepts any alignment.
                unsafe {
                    _mm256_storeu_ps(lo.as_mut_ptr(), _mm256_mul_ps(s0, u0));
                    _mm256_storeu_ps(hi.as_mut_ptr(), _mm256_mul_ps(s1, u1));
                }
            }
            for h in 0..2 {
                let q = q6k_quants(b, h);
                for (s, &qs) in q.iter().enumerate() {
                    let (w0, w1) = widen_i8(_mm256_sub_epi8(qs, k32));
                    let (k, j) = (bi * 8 + 4 * h + s, 8 * h + 2 * s);
                    for i in 0..NX {
                        // SAFETY: k < 8 nb, as in q4k.
                        let xv = unsafe { xblock(&x[i], k) };
                        let p0 = _mm256_cvtepi32_ps(_mm256_madd_epi16(w0, xv.0));
                        let p1 = _mm256_cvtepi32_ps(_mm256_madd_epi16(w1, xv.1));
                        let (sa, sb) = (sc[i][j], sc[i][j + 1]);
                        acc[i][0] = _mm256_fmadd_ps(p0, _mm256_set1_ps(sa), acc[i][0]);
                        acc[i][1] = _mm256_fmadd_ps(p1, _mm256_set1_ps(sb), acc[i][1]);
                    }
                }
            }
        }
        for i in 0..NX {
            o[g0 + i] = hsum(_mm256_add_ps(acc[i][0], acc[i][1]));
        }
    }
}

/// Q3_K's 32 quants of half `h`, 32-block `s` as signed bytes `q - 4` (-4..3): the 2 low bits
/// `(qs[32h + l] >> 2s) & 3` (bytes 32..96), the third `(hmask[l] >> (4h + s)) & 1` (bytes
/// 0..32; set means no `- 4`), as `blocks::decode_q3k` reads them.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn q3k_quants(b: &[u8], h: usize, s: usize) -> __m256i {
    let low = _mm256_srl_epi16(ld32(&b[32 + 32 * h..]), _mm_cvtsi32_si128(2 * s as i32));
    let high = _mm256_srl_epi16(ld32(b), _mm_cvtsi32_si128((4 * h + s) as i32));
    let q = _mm256_or_si256(
        _mm256_and_si256(low, _mm256_set1_epi8(3)),
        _mm256_slli_epi16(_mm256_and_si256(high, _mm256_set1_epi8(1)), 2),
    );
    _mm256_sub_epi8(q, _mm256_set1_epi8(4))
}

/// A Q3_K block's 16 scales (12 packed bytes: `blocks::scales_q3k`'s layout) as 16 bytes
/// `ls + 32` in scale order, unpacked four at a time in 32-bit words: the low nibbles of bytes
/// 0..8, then their high nibbles, each with its 2 top bits from bytes 8..12.
#[inline]
fn q3k_scale_bytes(s: &[u8]) -> [u8; 16] {
    let word = |k: usize| u32::from_le_bytes([s[4 * k], s[4 * k + 1], s[4 * k + 2], s[4 * k + 3]]);
    let (a0, a1, top) = (word(0), word(1), word(2));
    let (low4, top2) = (0x0F0F_0F0Fu32, 0x0303_0303u32);
    let parts = [
        (a0 & low4) | ((top & top2) << 4),
        (a1 & low4) | (((top >> 2) & top2) << 4),
        ((a0 >> 4) & low4) | (((top >> 4) & top2) << 4),
        ((a1 >> 4) & low4) | (((top >> 6) & top2) << 4),
    ];
    let mut out = [0u8; 16];
    for (o, p) in out.chunks_exact_mut(4).zip(parts) {
        o.copy_from_slice(&p.to_le_bytes());
    }
    out
}

/// Q3_K against int activations: as [`q6k`], the two 16-element halves of each 32-block
/// (sub-blocks 8h + 2s, 8h + 2s + 1) meeting their own `d * (ls - 32) * u`, the products for
/// all 16 scales formed in two vectors once per super-block and activation row.
#[target_feature(enable = "avx2,fma,f16c")]
fn q3k<const NX: usize>(w: &[u8], x: &[XRow<'_>; NX], n: usize, out: &mut [f32], g0: usize) {
    let nb = x[0].d.len() / 8;
    let k32 = _mm_set1_epi8(32);
    // lane j of the 16 scales' expansion takes the unit of activation block j / 2
    let pair_lo = _mm256_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3);
    let pair_hi = _mm256_setr_epi32(4, 4, 5, 5, 6, 6, 7, 7);
    for (row, o) in w.chunks_exact(nb * 110).zip(out.chunks_exact_mut(n)) {
        let mut acc = [[_mm256_setzero_ps(); 2]; NX];
        for (bi, b) in row.chunks_exact(110).enumerate() {
            prefetch(b, PREFETCH_AHEAD);
            prefetch(b, PREFETCH_AHEAD + 64);
            let d = _mm256_set1_ps(f16(&b[108..]));
            let ls = _mm_sub_epi8(ld16(&q3k_scale_bytes(&b[96..108])), k32);
            let s0 = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(ls)), d);
            let s1 = _mm256_mul_ps(
                _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(ls, 8))),
                d,
            );
            let mut sc = [[0f32; 16]; NX];
            for i in 0..NX {
                let u = ld8(&x[i].d[bi * 8..]);
                let (lo, hi) = sc[i].split_at_mut(8);
                // SAFETY: lo and hi hold 8 f32 each; storeu accepts any alignment.
                unsafe {
                    _mm256_storeu_ps(
                        lo.as_mut_ptr(),
                        _mm256_mul_ps(s0, _mm256_permutevar8x32_ps(u, pair_lo)),
                    );
                    _mm256_storeu_ps(
                        hi.as_mut_ptr(),
                        _mm256_mul_ps(s1, _mm256_permutevar8x32_ps(u, pair_hi)),
                    );
                }
            }
            for h in 0..2 {
                for s in 0..4 {
                    let (w0, w1) = widen_i8(q3k_quants(b, h, s));
                    let (k, j) = (bi * 8 + 4 * h + s, 8 * h + 2 * s);
                    for i in 0..NX {
                        // SAFETY: k < 8 nb, a block of a weight row as long as the activations.
                        let xv = unsafe { xblock(&x[i], k) };
                        let p0 = _mm256_cvtepi32_ps(_mm256_madd_epi16(w0, xv.0));
                        let p1 = _mm256_cvtepi32_ps(_mm256_madd_epi16(w1, xv.1));
                        acc[i][0] = _mm256_fmadd_ps(p0, _mm256_set1_ps(sc[i][j]), acc[i][0]);
                        acc[i][1] = _mm256_fmadd_ps(p1, _mm256_set1_ps(sc[i][j + 1]), acc[i][1]);
                    }
                }
            }
        }
        for i in 0..NX {
            o[g0 + i] = hsum(_mm256_add_ps(acc[i][0], acc[i][1]));
        }
    }
}

/// Q2_K against int activations: each 32-block's quants `(qs[32h + l] >> 2s) & 3` as bytes, its
/// two 16-element halves (sub-blocks 8h + 2s, 8h + 2s + 1) meeting `d * (sc & 15) * u`, and the
/// halves' activation sums (a product with ones) meeting `-dmin * (sc >> 4) * u`, both formed
/// for all 16 sub-blocks in vectors once per super-block and activation row.
#[target_feature(enable = "avx2,fma,f16c")]
fn q2k<const NX: usize>(w: &[u8], x: &[XRow<'_>; NX], n: usize, out: &mut [f32], g0: usize) {
    let nb = x[0].d.len() / 8;
    let (m4, m3, ones) = (
        _mm_set1_epi8(0x0F),
        _mm256_set1_epi8(3),
        _mm256_set1_epi16(1),
    );
    let pair_lo = _mm256_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3);
    let pair_hi = _mm256_setr_epi32(4, 4, 5, 5, 6, 6, 7, 7);
    let floats = |v: __m128i| {
        (
            _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(v)),
            _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(v, 8))),
        )
    };
    for (row, o) in w.chunks_exact(nb * 84).zip(out.chunks_exact_mut(n)) {
        let mut acc = [[_mm256_setzero_ps(); 2]; NX];
        for (bi, b) in row.chunks_exact(84).enumerate() {
            prefetch(b, PREFETCH_AHEAD);
            prefetch(b, PREFETCH_AHEAD + 64);
            let d = _mm256_set1_ps(f16(&b[80..]));
            let dmin = _mm256_set1_ps(-f16(&b[82..]));
            let raw = ld16(b);
            let (s0, s1) = floats(_mm_and_si128(raw, m4));
            let (n0, n1) = floats(_mm_and_si128(_mm_srli_epi16(raw, 4), m4));
            let (s0, s1) = (_mm256_mul_ps(s0, d), _mm256_mul_ps(s1, d));
            let (n0, n1) = (_mm256_mul_ps(n0, dmin), _mm256_mul_ps(n1, dmin));
            let mut sc = [[0f32; 16]; NX];
            let mut mn = [[0f32; 16]; NX];
            for i in 0..NX {
                let u = ld8(&x[i].d[bi * 8..]);
                let (u0, u1) = (
                    _mm256_permutevar8x32_ps(u, pair_lo),
                    _mm256_permutevar8x32_ps(u, pair_hi),
                );
                let (slo, shi) = sc[i].split_at_mut(8);
                let (mlo, mhi) = mn[i].split_at_mut(8);
                // SAFETY: each half holds 8 f32; storeu accepts any alignment.
                unsafe {
                    _mm256_storeu_ps(slo.as_mut_ptr(), _mm256_mul_ps(s0, u0));
                    _mm256_storeu_ps(shi.as_mut_ptr(), _mm256_mul_ps(s1, u1));
                    _mm256_storeu_ps(mlo.as_mut_ptr(), _mm256_mul_ps(n0, u0));
                    _mm256_storeu_ps(mhi.as_mut_ptr(), _mm256_mul_ps(n1, u1));
                }
            }
            for h in 0..2 {
                let qs = ld32(&b[16 + 32 * h..]);
                for s in 0..4 {
                    let q = _mm256_srl_epi16(qs, _mm_cvtsi32_si128(2 * s as i32));
                    let (w0, w1) = widen_i8(_mm256_and_si256(q, m3));
                    let (k, j) = (bi * 8 + 4 * h + s, 8 * h + 2 * s);
                    for i in 0..NX {
                        // SAFETY: k < 8 nb, a block of a weight row as long as the activations.
                        let xv = unsafe { xblock(&x[i], k) };
                        let p0 = _mm256_cvtepi32_ps(_mm256_madd_epi16(w0, xv.0));
                        let p1 = _mm256_cvtepi32_ps(_mm256_madd_epi16(w1, xv.1));
                        let t0 = _mm256_cvtepi32_ps(_mm256_madd_epi16(ones, xv.0));
                        let t1 = _mm256_cvtepi32_ps(_mm256_madd_epi16(ones, xv.1));
                        let a = _mm256_fmadd_ps(p0, _mm256_set1_ps(sc[i][j]), acc[i][0]);
                        let c = _mm256_fmadd_ps(p1, _mm256_set1_ps(sc[i][j + 1]), acc[i][1]);
                        acc[i][0] = _mm256_fmadd_ps(t0, _mm256_set1_ps(mn[i][j]), a);
                        acc[i][1] = _mm256_fmadd_ps(t1, _mm256_set1_ps(mn[i][j + 1]), c);
                    }
                }
            }
        }
        for i in 0..NX {
            o[g0 + i] = hsum(_mm256_add_ps(acc[i][0], acc[i][1]));
        }
    }
}

/// Runs kernel `$kern` over the activation rows in groups of up to 8 (the last one smaller).
macro_rules! dispatch {
    ($kern:ident $(, $extra:expr)?; $w:expr, $x:expr, $n:expr, $cols:expr, $out:expr) => {{
        let mut g0 = 0;
        while g0 < $n {
            let g = ($n - g0).min(MAX_NX);
            match g {
                1 => group::<1>($kern::<1 $(, $extra)?>, $w, $x, $n, $cols, g0, $out),
                2 => group::<2>($kern::<2 $(, $extra)?>, $w, $x, $n, $cols, g0, $out),
                3 => group::<3>($kern::<3 $(, $extra)?>, $w, $x, $n, $cols, g0, $out),
                4 => group::<4>($kern::<4 $(, $extra)?>, $w, $x, $n, $cols, g0, $out),
                5 => group::<5>($kern::<5 $(, $extra)?>, $w, $x, $n, $cols, g0, $out),
                6 => group::<6>($kern::<6 $(, $extra)?>, $w, $x, $n, $cols, g0, $out),
                7 => group::<7>($kern::<7 $(, $extra)?>, $w, $x, $n, $cols, g0, $out),
                _ => group::<8>($kern::<8 $(, $extra)?>, $w, $x, $n, $cols, g0, $out),
            }
            g0 += g;
        }
    }};
}

/// Whether `t` has an integer kernel here (and in [`wide`]).
fn integer(t: QType) -> bool {
    matches!(
        t,
        QType::Q8_0
            | QType::Q4_1
            | QType::Q5_1
            | QType::Q4K
            | QType::Q6K
            | QType::Mxfp4
            | QType::Iq4Nl
            | QType::Iq4Xs
            | QType::Q3K
            | QType::Q2K
            | QType::Q5K
    )
}

/// The integer kernel of `t` (Q8_0, Q4_1, Q5_1, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, MXFP4, IQ4_NL,
/// IQ4_XS) for `n` rows
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
        QType::Q3K => dispatch!(q3k; w, &x16, n, cols, out),
        QType::Q2K => dispatch!(q2k; w, &x16, n, cols, out),
        QType::Q4K => dispatch!(q4k, false; w, &x16, n, cols, out),
        QType::Q5K => dispatch!(q4k, true; w, &x16, n, cols, out),
        _ => dispatch!(q6k; w, &x16, n, cols, out),
    }
    true
}

pub(super) mod wide;
