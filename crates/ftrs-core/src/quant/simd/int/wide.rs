//! The integer kernels of [`super`] in AVX-512 (F, BW, VL, VNNI): the same [`X16`] activations
//! and the same exact integer products, 32 or 64 elements per instruction.
//!
//! Q5_1's odd last block widens its 32 weight quants into one vector of 32 i16 lanes, and
//! `vpdpwssd` sums their pairs of products with the block's 32 activation integers into 16 i32
//! lanes (what two `vpmaddwd` and an add do in AVX2). Q5_1, Q4_K and Q6_K keep 64 quants as unsigned bytes in one vector and meet the activations' two int8 digits
//! (`vpdpbusd`, four products per lane, high digit then low): fewer unpacking ops per quant,
//! the same integers. The lanes turn fp32 once per block or sub-block and meet the scale in a
//! fused multiply-add, so every kernel here differs from its AVX2 twin only in the order of
//! the fp32 sums.

use std::arch::x86_64::*;

use super::super::super::blocks::QType;
use super::super::super::kernel::MAX_NX;
use super::{
    f16, f16x2, group, hsum, ld16, ld32, ld8, prefetch, quantize, scales_mins_k4, XRow,
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

/// Per i32 lane, the exact integer dot of four unsigned weight bytes of `z` and four activation
/// values of blocks `k`, `k + 1` of `x`, from their two int8 digits: `vpdpbusd` over the high
/// digits, shifted by 8, then over the low ones on top (`256 hi + lo` is the value).
///
/// # Safety
/// As [`XRow::digits2`]: `k + 1` is below the row's block count and the row has its digits.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn dot_digits(z: __m512i, x: &XRow<'_>, k: usize) -> __m512i {
    // SAFETY: this function's contract.
    let (xh, xl) = unsafe { x.digits2(k) };
    // SAFETY: 64 readable bytes each (digits2); loadu accepts any alignment.
    let (xh, xl) = unsafe {
        (
            _mm512_loadu_si512(xh.as_ptr().cast()),
            _mm512_loadu_si512(xl.as_ptr().cast()),
        )
    };
    let high = _mm512_dpbusd_epi32(_mm512_setzero_si512(), z, xh);
    _mm512_dpbusd_epi32(_mm512_slli_epi32::<8>(high), z, xl)
}

/// One Q5_1 block (`$b`, block `$bi` of the row) against each activation row as one 32-lane
/// vector of i16 products (`vpdpwssd`): the odd last block of [`q51`]'s rows. Its min times
/// the block sum goes to `$mins[i]`.
macro_rules! q51_block {
    ($b:expr, $x:expr, $bi:expr, $acc:expr, $mins:expr) => {{
        let (b, bi): (&[u8], usize) = ($b, $bi);
        let (d, m) = f16x2(b);
        // lanes 0-15: the low nibbles (elements 0-15), 16-31: the high ones (16-31)
        let v = _mm256_cvtepu8_epi16(ld16(&b[8..]));
        let lo = _mm256_and_si256(v, _mm256_set1_epi16(0x0F));
        let w = _mm512_inserti64x4::<1>(_mm512_castsi256_si512(lo), _mm256_srli_epi16(v, 4));
        // bit j of qh is bit 4 of element j: 16 added to the lanes it marks
        let qh = u32::from_le_bytes([b[4], b[5], b[6], b[7]]);
        let wv = _mm512_mask_add_epi16(w, qh, w, _mm512_set1_epi16(16));
        for i in 0..NX {
            // SAFETY: bi is a block of a weight row as long as the activation rows (q51).
            let ((u, sum), xv) = unsafe { ($x[i].unit_sum(bi), xblock(&$x[i], bi)) };
            $acc[i] = _mm512_fmadd_ps(dot(wv, xv), _mm512_set1_ps(d * u), $acc[i]);
            $mins[i] = m.mul_add(sum, $mins[i]);
        }
    }};
}

/// Q5_1 two blocks at a time, the activations as two int8 digits (`vpdpbusd`).
///
/// A pair's 64 quants stay bytes: each block's 16-byte run is broadcast (a load) into two
/// 128-bit lanes, and one variable shift (0 or 4 per lane) and one AND leave the low nibbles
/// (elements 0-15) then the high ones (16-31) of 2p, then of 2p + 1: element order, in two ALU
/// ops where AND/shift/AND on the run pair and two lane shuffles took five (13 % of a demo
/// gate/up call, measured). The fifth bits of both blocks are one 64-bit lane mask and one
/// masked byte add. `vpdpbusd` sums four exact products of weight byte and activation digit per
/// i32 lane, for the high digits, whose sums are shifted by 8 and then take the low digits'
/// products on top (`256 hi + lo` is the same integer as [`X16`]'s value), so lanes 0-7 hold
/// block 2p's partial dots and 8-15 block 2p + 1's. The blocks' fp16 `d` and `m` of up to 16
/// blocks come in one gather, meet the activation units in one multiply, and a permute hands
/// each lane its block's scale: per block about half the instructions of a one-block step
/// (which spends most of them on its scalar scale). Same integers as the AVX2 kernel, so the
/// two differ only in the order of the fp32 sums. An odd last block takes [`q51_block`]'s step.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
fn q51<const NX: usize>(w: &[u8], x: &[XRow<'_>; NX], n: usize, out: &mut [f32], g0: usize) {
    const BB: usize = 24;
    let nb = x[0].d.len();
    let m4 = _mm512_set1_epi8(0x0F);
    // per 128-bit lane: the low nibbles (shift 0), then the high ones (shift 4)
    let nibble = _mm512_setr_epi64(
        0,
        0,
        0x0004_0004_0004_0004,
        0x0004_0004_0004_0004,
        0,
        0,
        0x0004_0004_0004_0004,
        0x0004_0004_0004_0004,
    );
    let k16 = _mm512_set1_epi8(16);
    let offsets = _mm512_mullo_epi32(
        _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
        _mm512_set1_epi32(BB as i32),
    );
    // pair p of a group: lanes 0-7 take the scale of its block 2p, lanes 8-15 of 2p + 1
    let lanes: [__m512i; 8] = std::array::from_fn(|p| {
        _mm512_mask_blend_epi32(
            0xFF00,
            _mm512_set1_epi32(2 * p as i32),
            _mm512_set1_epi32(2 * p as i32 + 1),
        )
    });
    let zero = _mm512_setzero_si512();
    for (row, o) in w.chunks_exact(nb * BB).zip(out.chunks_exact_mut(n)) {
        let mut acc = [_mm512_setzero_ps(); NX];
        let mut mins = [_mm512_setzero_ps(); NX];
        let mut odd = [_mm512_setzero_ps(); NX];
        let mut odd_mins = [0f32; NX];
        let mut k = 0;
        while k + 2 <= nb {
            let pairs = ((nb - k) / 2).min(8);
            let mask: __mmask16 = ((1u32 << (2 * pairs)) - 1) as u16;
            // SAFETY: the masked lanes read the first 4 bytes (d, m) of blocks k .. k + 2
            // pairs, all within this row; masked-off lanes read nothing.
            let dm = unsafe {
                _mm512_mask_i32gather_epi32::<1>(zero, mask, offsets, row[k * BB..].as_ptr().cast())
            };
            let d = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(dm));
            let m = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32::<16>(dm)));
            let mut scale = [_mm512_setzero_ps(); NX];
            for i in 0..NX {
                // SAFETY: k + 2 pairs <= nb == d.len() == s.len(); masked-off lanes read nothing.
                let (u, s) = unsafe {
                    (
                        _mm512_maskz_loadu_ps(mask, x[i].d.as_ptr().add(k)),
                        _mm512_maskz_loadu_ps(mask, x[i].s.as_ptr().add(k)),
                    )
                };
                scale[i] = _mm512_mul_ps(d, u);
                mins[i] = _mm512_fmadd_ps(m, s, mins[i]);
            }
            for (p, lane) in lanes.iter().enumerate().take(pairs) {
                let bi = k + 2 * p;
                let a = &row[bi * BB..(bi + 2) * BB];
                prefetch(a, PREFETCH_AHEAD);
                // 128-bit lanes [2p's run, 2p's run, 2p+1's run, 2p+1's run], each shifted by
                // 0 or 4 and masked: the 64 quants in element order
                let z = _mm512_inserti64x4::<1>(
                    _mm512_castsi256_si512(_mm256_broadcastsi128_si256(ld16(&a[8..]))),
                    _mm256_broadcastsi128_si256(ld16(&a[BB + 8..])),
                );
                let z = _mm512_and_si512(_mm512_srlv_epi16(z, nibble), m4);
                let qh = u64::from(u32::from_le_bytes([a[4], a[5], a[6], a[7]]))
                    | u64::from(u32::from_le_bytes([
                        a[BB + 4],
                        a[BB + 5],
                        a[BB + 6],
                        a[BB + 7],
                    ])) << 32;
                let wv = _mm512_mask_add_epi8(z, qh, z, k16);
                for i in 0..NX {
                    // SAFETY: bi + 1 < nb (the loop's bound) and rows() gave x its digits.
                    let t = unsafe { dot_digits(wv, &x[i], bi) };
                    let sv = _mm512_permutexvar_ps(*lane, scale[i]);
                    acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(t), sv, acc[i]);
                }
            }
            k += 2 * pairs;
        }
        if k < nb {
            q51_block!(&row[k * BB..], x, k, odd, odd_mins);
        }
        for i in 0..NX {
            o[g0 + i] = _mm512_reduce_add_ps(_mm512_add_ps(acc[i], odd[i]))
                + (_mm512_reduce_add_ps(mins[i]) + odd_mins[i]);
        }
    }
}

/// [`super::kquants::q4k`] with the activations as two int8 digits (`vpdpbusd`), as [`q51`]: each
/// 32-byte run of quants is broadcast (a load) into both 256-bit halves, and one variable shift
/// (0, then 4) and one AND leave its low nibbles (sub-block 2c) then its high ones (2c + 1),
/// which are elements 64c .. 64c + 63 in order. The high digits' four-product sums are shifted
/// by 8 and take the low digits' products on top, so lanes 0-7 hold sub-block 2c's partial dots
/// and 8-15 those of 2c + 1, each turned fp32 once and met by its scale `d * sc * u` (one
/// permute of the super-block's 8). Two ALU ops fewer per 64 quants than widening them to i16
/// for `vpdpwssd`; the same integers, so the two differ only in the order of the fp32 sums.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
fn q4k<const NX: usize>(w: &[u8], x: &[XRow<'_>; NX], n: usize, out: &mut [f32], g0: usize) {
    let nb = x[0].d.len() / 8;
    let m4 = _mm512_set1_epi8(0x0F);
    // lower 256 bits: the low nibbles (shift 0); upper: the high ones (shift 4)
    let nibble = _mm512_inserti64x4::<1>(_mm512_setzero_si512(), _mm256_set1_epi16(4));
    // run c: lanes 0-7 take sub-block 2c's scale, 8-15 that of 2c + 1
    let halves = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1);
    let pick: [__m512i; 4] =
        std::array::from_fn(|c| _mm512_add_epi32(_mm512_set1_epi32(2 * c as i32), halves));
    for (row, o) in w.chunks_exact(nb * 144).zip(out.chunks_exact_mut(n)) {
        let mut acc = [[_mm512_setzero_ps(); 2]; NX];
        let mut mins = [_mm256_setzero_ps(); NX];
        for (bi, b) in row.chunks_exact(144).enumerate() {
            for line in [0, 64, 128] {
                prefetch(b, PREFETCH_AHEAD + line);
            }
            let (d, dmin) = f16x2(b);
            let (s8, m8) = scales_mins_k4(&b[4..16]);
            let (s8, m8) = (
                _mm256_mul_ps(s8, _mm256_set1_ps(d)),
                _mm256_mul_ps(m8, _mm256_set1_ps(dmin)),
            );
            let sc: [__m512; NX] = std::array::from_fn(|i| {
                mins[i] = _mm256_fmadd_ps(m8, ld8(&x[i].s[bi * 8..]), mins[i]);
                _mm512_castps256_ps512(_mm256_mul_ps(s8, ld8(&x[i].d[bi * 8..])))
            });
            for c in 0..4 {
                let z = _mm512_broadcast_i64x4(ld32(&b[16 + 32 * c..]));
                let z = _mm512_and_si512(_mm512_srlv_epi16(z, nibble), m4);
                let k = bi * 8 + 2 * c;
                for i in 0..NX {
                    // SAFETY: k + 1 < 8 nb, the activation row's block count (x16 rows are
                    // cols / 32 blocks, the weight row cols / 256 super-blocks), and rows()
                    // gave x its digits.
                    let t = unsafe { dot_digits(z, &x[i], k) };
                    let sv = _mm512_permutexvar_ps(pick[c], sc[i]);
                    acc[i][c & 1] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(t), sv, acc[i][c & 1]);
                }
            }
        }
        for i in 0..NX {
            let a = _mm512_reduce_add_ps(_mm512_add_ps(acc[i][0], acc[i][1]));
            o[g0 + i] = a - hsum(mins[i]);
        }
    }
}

/// [`super::kquants::q6k`] with the activations as two int8 digits (`vpdpbusd`): a half super-block's
/// 128 6-bit quants are assembled as unsigned bytes in two vectors of 64 elements in order
/// (the 64 low-nibble bytes in one load, the 32 high-bit bytes broadcast to both halves and
/// shifted per half; seven ALU ops), each `vpdpbusd` lane sums four products `q * x` exactly,
/// and the offset 32 leaves as one subtraction of the activations' precomputed `32 * sum`
/// ([`X16::with_sums4`]): the exact integer `sum (q - 32) x` per lane, as the i16 path gets.
/// Lanes 4j .. 4j + 3 hold sub-block 4m + j of the run, met by its scale `d * sc * u` through
/// one permute. The same integers, so the two differ only in the order of the fp32 sums.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
fn q6k<const NX: usize>(w: &[u8], x: &[XRow<'_>; NX], n: usize, out: &mut [f32], g0: usize) {
    let nb = x[0].d.len() / 8;
    let (m4, m30) = (_mm512_set1_epi8(0x0F), _mm512_set1_epi8(0x30));
    // the high 2 bits of run 0 (lower half) sit at bits 0-1 of qh, of run 1 (upper) at 2-3,
    // of run 2 at 4-5, of run 3 at 6-7: shifted into bits 4-5
    let up_a = _mm512_inserti64x4::<1>(_mm512_set1_epi16(4), _mm256_set1_epi16(2));
    let down_b = _mm512_inserti64x4::<1>(_mm512_setzero_si512(), _mm256_set1_epi16(2));
    // lane j of the 16 sub-block scales takes the unit of activation block j / 2
    let pair = _mm512_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7);
    // run m of a super-block (64 elements): lanes 4j .. 4j + 3 from sub-block 4m + j
    let quarters = _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);
    let pick: [__m512i; 4] =
        std::array::from_fn(|m| _mm512_add_epi32(_mm512_set1_epi32(4 * m as i32), quarters));
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
                let ql = &b[64 * h..64 * h + 64];
                // SAFETY: 64 readable bytes (sliced above); loadu accepts any alignment.
                let l = unsafe { _mm512_loadu_si512(ql.as_ptr().cast()) };
                let qh = _mm512_broadcast_i64x4(ld32(&b[128 + 32 * h..]));
                // (l & 0x0F) | hb, hb already masked to bits 4-5
                let runs = [
                    _mm512_ternarylogic_epi32::<0xEC>(
                        l,
                        _mm512_and_si512(_mm512_sllv_epi16(qh, up_a), m30),
                        m4,
                    ),
                    _mm512_ternarylogic_epi32::<0xEC>(
                        _mm512_srli_epi16::<4>(l),
                        _mm512_and_si512(_mm512_srlv_epi16(qh, down_b), m30),
                        m4,
                    ),
                ];
                for (r, z) in runs.into_iter().enumerate() {
                    let k = bi * 8 + 4 * h + 2 * r;
                    for i in 0..NX {
                        // SAFETY: k + 1 < 8 nb, the activation row's block count, and rows()
                        // gave x its digits and sums; sums4 is 64 readable bytes and loadu
                        // accepts any alignment.
                        let (t, s4) = unsafe {
                            (
                                dot_digits(z, &x[i], k),
                                _mm512_loadu_si512(x[i].sums4(k).as_ptr().cast()),
                            )
                        };
                        let t = _mm512_sub_epi32(t, s4);
                        let sv = _mm512_permutexvar_ps(pick[2 * h + r], su[i]);
                        acc[i][r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(t), sv, acc[i][r]);
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
/// one (the AVX2 integer kernels run them). The byte kernels (`vpdpbusd`: Q5_1, Q4_K, Q6_K) are
/// the ones kept: Q8_0, Q4_1 and MXFP4 as 32 i16 lanes and `vpdpwssd` were the AVX2 products in
/// wider vectors, and measured slower than AVX2 on a Zen 4 host (one thread, streamed from
/// DRAM; AVX2 time / AVX-512 time, n = 1 / 8: Q8_0 0.91 / 0.76 on the 49152x576 LM head,
/// 0.89 / 0.85 at 576x1536; MXFP4 0.98 / 0.96 at 2880x2880; Q4_1 0.90 / 1.15 at 576x1536).
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
pub fn rows(t: QType, w: &[u8], x: &[f32], n: usize, cols: usize, out: &mut [f32]) -> bool {
    if !matches!(t, QType::Q5_1 | QType::Q4K | QType::Q6K) {
        return false;
    }
    let x16: X16 = quantize(x, n, cols).with_digits();
    match t {
        QType::Q5_1 => dispatch!(q51; w, &x16, n, cols, out),
        QType::Q4K => dispatch!(q4k; w, &x16, n, cols, out),
        _ => {
            let x16 = x16.with_sums4();
            dispatch!(q6k; w, &x16, n, cols, out)
        }
    }
    true
}
