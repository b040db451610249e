//! The integer kernels of the 256-weight super-block types (AVX2): Q2_K, Q3_K, Q4_K and Q5_K,
//! Q6_K, IQ4_XS. Each meets the activations as two int8 digits per 32-block ([`super::act`]),
//! its sub-block scales formed once per super-block and activation row; the 32-weight types
//! and the shared loads and dots are [`super`]'s.

use std::arch::x86_64::*;

use super::act::XRow;
use super::{
    dot32, f16, f16x2, hsum, iq4_levels, ld16, ld32, ld8, ld8b, prefetch, widen_i8, xblock,
    PREFETCH_AHEAD,
};

/// IQ4_XS against int activations: per 256-weight super-block, eight 32-weight sub-blocks
/// each scaled by `d * (ls - 32)` (the 6-bit `ls` from `scales_l` and `scales_h`, as
/// `blocks::decode_iq4xs`), their levels looked up as IQ4_NL's; even and odd sub-blocks go to
/// two accumulator chains.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) fn iq4xs<const NX: usize>(
    w: &[u8],
    x: &[XRow<'_>; NX],
    n: usize,
    out: &mut [f32],
    g0: usize,
) {
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
pub(super) fn scales_mins_k4(s: &[u8]) -> (__m256, __m256) {
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
pub(super) fn q4k<const NX: usize, const Q5: bool>(
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

/// The 16 sub-block factors `s * u` of one super-block per activation row: `s0`, `s1` the
/// scales of sub-blocks 0..8 and 8..16 (16 values each), `u` the unit of activation block
/// `8 bi + j / 2` for sub-block j.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn times_units<const NX: usize>(
    s0: __m256,
    s1: __m256,
    x: &[XRow<'_>; NX],
    bi: usize,
) -> [[f32; 16]; NX] {
    let pair_lo = _mm256_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3);
    let pair_hi = _mm256_setr_epi32(4, 4, 5, 5, 6, 6, 7, 7);
    let mut out = [[0f32; 16]; NX];
    for i in 0..NX {
        let u = ld8(&x[i].d[bi * 8..]);
        let (lo, hi) = out[i].split_at_mut(8);
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
    out
}

/// Q6_K against int activations: per half block h, 32-block s of the activations meets the
/// 6-bit quants `(low nibble | high 2 bits << 4) - 32` assembled as bytes and widened; its two
/// 16-element halves (sub-blocks 8h + 2s and 8h + 2s + 1) meet their own `d * sc * u`, in two
/// accumulator chains.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) fn q6k<const NX: usize>(
    w: &[u8],
    x: &[XRow<'_>; NX],
    n: usize,
    out: &mut [f32],
    g0: usize,
) {
    let nb = x[0].d.len() / 8;
    let k32 = _mm256_set1_epi8(32);
    for (row, o) in w.chunks_exact(nb * 210).zip(out.chunks_exact_mut(n)) {
        let mut acc = [[_mm256_setzero_ps(); 2]; NX];
        for (bi, b) in row.chunks_exact(210).enumerate() {
            for line in [0, 64, 128, 192] {
                prefetch(b, PREFETCH_AHEAD + line);
            }
            let d = _mm256_set1_ps(f16(&b[208..]));
            let s0 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(ld8b(&b[192..])));
            let s1 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(ld8b(&b[200..])));
            let sc = times_units(_mm256_mul_ps(s0, d), _mm256_mul_ps(s1, d), x, bi);
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
pub(super) fn q3k<const NX: usize>(
    w: &[u8],
    x: &[XRow<'_>; NX],
    n: usize,
    out: &mut [f32],
    g0: usize,
) {
    let nb = x[0].d.len() / 8;
    let k32 = _mm_set1_epi8(32);
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
            let sc = times_units(s0, s1, x, bi);
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
pub(super) fn q2k<const NX: usize>(
    w: &[u8],
    x: &[XRow<'_>; NX],
    n: usize,
    out: &mut [f32],
    g0: usize,
) {
    let nb = x[0].d.len() / 8;
    let (m4, m3, ones) = (
        _mm_set1_epi8(0x0F),
        _mm256_set1_epi8(3),
        _mm256_set1_epi16(1),
    );
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
            let sc = times_units(s0, s1, x, bi);
            let mn = times_units(n0, n1, x, bi);
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
