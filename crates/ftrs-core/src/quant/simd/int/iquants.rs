//! The integer kernels of the i-quants of three bits and less (AVX2): IQ1_S, IQ1_M, IQ2_XXS,
//! IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S.
//!
//! Per 32-weight sub-block the grid rows are fetched as bytes ([`iq::rows8`], [`iq::rows4`]:
//! four 8-byte or eight 4-byte rows make the 32 weights), their signs applied by `vpsignb`
//! (sign indices looked up as byte masks, [`iq::SIGNS7_BYTES`]; sign bytes spread by a byte
//! shuffle, [`byte_signs`]), widened to i16 and met by the activations' 15-bit integers in
//! `vpmaddwd`, as every integer kernel here does. Integer parts of the scales go into the
//! weights where they differ within the sub-block (the 16-weight scales `2 s + 1` of IQ2_XS,
//! IQ2_S and IQ1_M, |weight| <= 43 * 31); IQ1's `grid ± 0.125` is `(8 grid ± 1) / 8`, integers
//! in the grid's bytes (held times 8). What is left, the fp16 `d` times a per-sub-block
//! factor, meets the lanes in one fused multiply-add per activation row.
//!
//! The i32 lanes are exact; turned fp32 they round where they pass 2^24 (IQ2_XS and IQ2_S with
//! large scales only), a relative 2^-24 of the sum, far below the activations' rounding.

use std::arch::x86_64::*;

use super::super::super::iq;
use super::act::XRow;
use super::{bit_mask, bits32, dot32, f16, hsum, prefetch, widen_i8, xblock, PREFETCH_AHEAD};

/// Four 8-byte grid rows as the 32 bytes of a sub-block, row `i[0]` first.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn rows8(g: &[u64; 2048], i: [usize; 4]) -> __m256i {
    let r = |k: usize| g[i[k] & 2047] as i64;
    _mm256_setr_epi64x(r(0), r(1), r(2), r(3))
}

/// Eight 4-byte grid rows as the 32 bytes of a sub-block, row `i[0]` first.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn rows4(g: &[u32; 512], i: [usize; 8]) -> __m256i {
    let r = |k: usize| g[i[k] & 511] as i32;
    _mm256_setr_epi32(r(0), r(1), r(2), r(3), r(4), r(5), r(6), r(7))
}

/// The `vpsignb` operand of four 7-bit sign indices (bits `7 l .. 7 l + 7` of `aux`, one per 8
/// weights): -1 or 1 per byte.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn index_signs(aux: u32) -> __m256i {
    sign_rows([0, 1, 2, 3].map(|l| aux >> (7 * l)))
}

/// The `vpsignb` operand of four sign indices (the low 7 bits of each of `s`).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn sign_rows(s: [u32; 4]) -> __m256i {
    let r = |l: usize| iq::SIGNS7_BYTES[(s[l] & 0x7F) as usize] as i64;
    _mm256_setr_epi64x(r(0), r(1), r(2), r(3))
}

/// The `vpsignb` operand of 32 sign bits (byte `l` of `bits`: the 8 weights `8 l ..`, bit `k`
/// for weight `8 l + k`): [`bits32`]'s 0xFF or 0 per byte, OR 1: -1 or 1.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn byte_signs(bits: u32) -> __m256i {
    _mm256_or_si256(bits32(bits), _mm256_set1_epi8(1))
}

/// IQ1_M's deltas of 32 weights, -1 or 1 per byte by bit 3 of nibble `j / 8` of `nib` (byte
/// `j / 16` of it, bit 3 or 7), from [`bit_mask`] without scalar work.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn nibble_signs(nib: u32) -> __m256i {
    let pick = _mm256_setr_epi8(
        0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, // nibbles 0, 1: byte 0
        1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, // nibbles 2, 3: byte 1
    );
    let (lo, hi) = (
        0x0808_0808_0808_0808_u64 as i64,
        0x8080_8080_8080_8080_u64 as i64,
    );
    let bits = _mm256_setr_epi64x(lo, hi, lo, hi); // bit 3 of the low nibble, then the high
    _mm256_or_si256(bit_mask(nib, pick, bits), _mm256_set1_epi8(1))
}

/// 32 signed weight bytes widened to i16, the first 16 times `s0` and the last 16 times `s1`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn scaled16(w: __m256i, s0: i16, s1: i16) -> (__m256i, __m256i) {
    let (a, b) = widen_i8(w);
    (
        _mm256_mullo_epi16(a, _mm256_set1_epi16(s0)),
        _mm256_mullo_epi16(b, _mm256_set1_epi16(s1)),
    )
}

fn u16_at(b: &[u8], i: usize) -> u32 {
    u16::from_le_bytes([b[i], b[i + 1]]) as u32
}

fn u32_at(b: &[u8], i: usize) -> u32 {
    u32::from_le_bytes([b[i], b[i + 1], b[i + 2], b[i + 3]])
}

/// The `d` of a super-block: its fp16 at 0, or IQ1_M's, the top nibbles of its four scale words.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn block_d<const KIND: u8>(b: &[u8]) -> f32 {
    if KIND == 6 {
        let top = |k: usize| u16_at(b, 48 + 2 * k) >> 12 << (4 * k);
        let bits = top(0) | top(1) | top(2) | top(3);
        _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(bits as i32)))
    } else {
        f16(b)
    }
}

/// Sub-block `k` (weights `32 k .. 32 k + 32`) of super-block `b` of the kind `KIND` (see
/// [`iq()`]): its 32 weights as two i16 vectors, and the factor that times `d` scales them
/// (the layouts are [`crate::quant::iq`]'s decoders').
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn sub32<const KIND: u8>(b: &[u8], k: usize, g8: &[u64; 2048], g4: &[u32; 512]) -> W32 {
    match KIND {
        0 => {
            // IQ2_XXS: 4 grid bytes, a u32 of four sign indices and the scale in bits 28..
            let q = &b[2 + 8 * k..10 + 8 * k];
            let aux = u32_at(q, 4);
            let idx = [q[0], q[1], q[2], q[3]].map(usize::from);
            let w = _mm256_sign_epi8(rows8(g8, idx), index_signs(aux));
            (widen_i8(w), (2 * (aux >> 28) + 1) as f32 * 0.125)
        }
        1 => {
            // IQ2_XS: 4 u16 (9-bit index, 7-bit sign index), two 4-bit scales in a byte
            let q: [u32; 4] = std::array::from_fn(|l| u16_at(b, 2 + 8 * k + 2 * l));
            let signs = sign_rows(q.map(|v| v >> 9));
            let w = _mm256_sign_epi8(rows8(g8, q.map(|v| (v & 511) as usize)), signs);
            let sc = b[66 + k];
            let s = |v: u8| 2 * (v & 0x0F) as i16 + 1;
            (scaled16(w, s(sc), s(sc >> 4)), 0.125)
        }
        2 => {
            // IQ2_S: 4 grid bytes and 2 high bits each, 4 sign bytes, two 4-bit scales
            let qh = b[66 + k] as usize;
            let idx: [usize; 4] =
                std::array::from_fn(|l| b[2 + 4 * k + l] as usize | (qh >> (2 * l) & 3) << 8);
            let w = _mm256_sign_epi8(rows8(g8, idx), byte_signs(u32_at(b, 34 + 4 * k)));
            let sc = b[74 + k];
            let s = |v: u8| 2 * (v & 0x0F) as i16 + 1;
            (scaled16(w, s(sc), s(sc >> 4)), 0.125)
        }
        3 => {
            // IQ3_XXS: 8 bytes of 4-wide indices; a u32 of four sign indices and the scale
            let q = &b[2 + 8 * k..10 + 8 * k];
            let aux = u32_at(b, 66 + 4 * k);
            let idx: [usize; 8] = std::array::from_fn(|j| q[j] as usize);
            let w = _mm256_sign_epi8(rows4(g4, idx), index_signs(aux));
            (widen_i8(w), (2 * (aux >> 28) + 1) as f32 * 0.25)
        }
        4 => {
            // IQ3_S: 8 index bytes and a ninth bit each, 4 sign bytes, a 4-bit scale
            let qh = b[66 + k] as usize;
            let idx: [usize; 8] =
                std::array::from_fn(|j| b[2 + 8 * k + j] as usize | (qh >> j & 1) << 8);
            let w = _mm256_sign_epi8(rows4(g4, idx), byte_signs(u32_at(b, 74 + 4 * k)));
            let s = (b[106 + k / 2] >> (4 * (k % 2))) & 0x0F;
            (widen_i8(w), (1 + 2 * s as u32) as f32)
        }
        5 => {
            // IQ1_S: 4 index bytes; a u16 of four 3-bit high parts, the scale, delta's sign
            let qh = u16_at(b, 34 + 2 * k) as usize;
            let idx: [usize; 4] =
                std::array::from_fn(|l| b[2 + 4 * k + l] as usize | (qh >> (3 * l) & 7) << 8);
            let delta = if qh & 0x8000 == 0 { 1 } else { -1 };
            let w = _mm256_add_epi8(rows8(g8, idx), _mm256_set1_epi8(delta));
            (widen_i8(w), (2 * ((qh >> 12) & 7) + 1) as f32 * 0.125)
        }
        _ => {
            // IQ1_M: 4 index bytes, a nibble each (3 high bits, delta's sign), 3-bit scales
            let nib = u16_at(b, 32 + 2 * k) as usize; // the 4 nibbles of this sub-block
            let idx: [usize; 4] =
                std::array::from_fn(|l| b[4 * k + l] as usize | (nib >> (4 * l) & 7) << 8);
            let w = _mm256_add_epi8(rows8(g8, idx), nibble_signs(nib as u32));
            let word = u16_at(b, 48 + 2 * (k / 2)) as usize; // scales of 16-blocks 2k, 2k+1
            let s = |sub: usize| 2 * (word >> (3 * (sub % 4)) & 7) as i16 + 1;
            (scaled16(w, s(2 * k), s(2 * k + 1)), 0.125)
        }
    }
}

/// A sub-block's weights (two i16 vectors) and the factor of `d` that scales them.
type W32 = ((__m256i, __m256i), f32);

/// The i-quant `KIND` (its grid's slot in `iq`, whose test grids differ by slot, so a kernel
/// reading another type's grid fails the kernel tests: 0 IQ2_XXS, 1 IQ2_XS, 2 IQ2_S, 3 IQ3_XXS,
/// 4 IQ3_S, 5 IQ1_S, 6 IQ1_M; `BB` bytes a 256-weight block) against int activations; even and odd sub-blocks go to two
/// accumulator chains.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) fn iq<const NX: usize, const KIND: u8, const BB: usize>(
    w: &[u8],
    x: &[XRow<'_>; NX],
    n: usize,
    out: &mut [f32],
    g0: usize,
) {
    static NO_ROWS8: [u64; 2048] = [0; 2048];
    static NO_ROWS4: [u32; 512] = [0; 512];
    let (g8, g4) = if matches!(KIND, 3 | 4) {
        (&NO_ROWS8, iq::rows4(KIND as usize))
    } else {
        (iq::rows8(KIND as usize), &NO_ROWS4)
    };
    let nb = x[0].d.len(); // 32-blocks per row: 8 per super-block
    for (row, o) in w.chunks_exact(nb / 8 * BB).zip(out.chunks_exact_mut(n)) {
        let mut even = [_mm256_setzero_ps(); NX];
        let mut odd = [_mm256_setzero_ps(); NX];
        for (sb, b) in row.chunks_exact(BB).enumerate() {
            prefetch(b, PREFETCH_AHEAD);
            let b: &[u8; BB] = b.try_into().expect("BB bytes");
            let d = block_d::<KIND>(b);
            for k in (0..8).step_by(2) {
                // two sub-blocks a step, each to its own chain (kept in registers)
                for (kk, acc) in [(k, &mut even), (k + 1, &mut odd)] {
                    let (wv, f) = sub32::<KIND>(b, kk, g8, g4);
                    let dk = d * f;
                    let bi = 8 * sb + kk;
                    for i in 0..NX {
                        // SAFETY: bi is a block of a weight row as long as the activation rows.
                        let ((u, _), xv) = unsafe { (x[i].unit_sum(bi), xblock(&x[i], bi)) };
                        acc[i] = _mm256_fmadd_ps(dot32(wv, xv), _mm256_set1_ps(dk * u), acc[i]);
                    }
                }
            }
        }
        for i in 0..NX {
            o[g0 + i] = hsum(_mm256_add_ps(even[i], odd[i]));
        }
    }
}
