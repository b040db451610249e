//! The activations of the integer kernels ([`super`]): [`X16`], each 32-element block of a row
//! as 15-bit integers with its unit and exact sum (and, on demand, the split int8 digits and the
//! 4-value sums the AVX-512 byte kernels read), and [`XRow`], one row of it as a kernel sees it.

use std::arch::x86_64::*;

use super::{hsum, ld8, GroupFn};

/// Zero values after each row of [`X16`]'s values and digits, so that rows whose length is a
/// multiple of 2048 (hidden sizes 2048, 4096, 7168) do not start on the same L1 set: a group
/// of 8 such rows, each with its values, two digits and 4-value sums, wanted more lines of one
/// set than it has ways. Measured (one thread, AVX-512 kernels, 2048×4096, n = 8): Q4_K 5.7 ms
/// and Q6_K 9.0 ms unpadded against the AVX2 kernels' 2.1 and 3.3.
const ROW_PAD: usize = 64;

/// Activation rows as 15-bit integers per 32-element block (the rounding: [`super`]'s module
/// doc).
pub struct X16 {
    /// Values per row in `v`, `hi` and `lo`: `cols` and [`ROW_PAD`] (zeros).
    stride: usize,
    /// `n * stride` values `254 q + r`, row-major.
    pub(super) v: Vec<i16>,
    /// `n * cols / 32` units `u = max|x| / (127 * 254)` (0 for an all-zero block).
    pub(super) d: Vec<f32>,
    /// `n * cols / 32` exact fp32 block sums.
    pub(super) s: Vec<f32>,
    /// Empty, or (after [`X16::with_digits`]) each value as `256 hi + lo`, two int8 digits
    /// (`hi` in -127..=127, `lo` in -128..=127), row-major as `v`: the form `vpdpbusd` takes.
    pub(super) hi: Vec<i8>,
    pub(super) lo: Vec<i8>,
    /// Empty, or (after [`X16::with_sums4`]) `32 *` the sum of each 4 consecutive values,
    /// `n * stride / 4` of them: what a `vpdpbusd` lane of unsigned 6-bit quants owes the
    /// activations for Q6_K's offset of 32.
    pub(super) s4: Vec<i32>,
}

impl X16 {
    /// Adds [`X16::s4`]: 32 times each 4 consecutive values' sum (exact: at most 4.2e6).
    pub fn with_sums4(mut self) -> X16 {
        self.s4 = self
            .v
            .chunks_exact(4)
            .map(|q| 32 * q.iter().map(|&v| i32::from(v)).sum::<i32>())
            .collect();
        self
    }

    /// Puts each 32-block's values in the order NVFP4's nibbles come in: elements 0-7, 16-23,
    /// 8-15, 24-31 (a 16-weight sub-block's low nibbles hold its elements 0-7, the high ones
    /// 8-15). Only `v` moves: units and sums are per block.
    pub fn in_nibble_order(mut self) -> X16 {
        for b in self.v.chunks_exact_mut(32) {
            let (a, c) = b.split_at_mut(16);
            let mut t = [0i16; 8];
            t.copy_from_slice(&a[8..16]);
            a[8..16].copy_from_slice(&c[..8]);
            c[..8].copy_from_slice(&t);
        }
        self
    }

    /// Adds the two-digit form of every value (`hi`, `lo`).
    pub fn with_digits(mut self) -> X16 {
        // |v| <= 32385, so hi = (v + 128) >> 8 stays within -127..=127 and lo within -128..=127
        self.hi = self
            .v
            .iter()
            .map(|&v| ((i32::from(v) + 128) >> 8) as i8)
            .collect();
        self.lo = self
            .v
            .iter()
            .zip(&self.hi)
            .map(|(&v, &h)| (i32::from(v) - 256 * i32::from(h)) as i8)
            .collect();
        self
    }
}

/// One activation row of an [`X16`]: `v` holds (at least) 32 values per entry of `d` and `s`
/// (made only by [`group`]: cols values, cols / 32 units and sums).
#[derive(Clone, Copy)]
pub(super) struct XRow<'a> {
    pub(super) v: &'a [i16],
    pub(super) d: &'a [f32],
    pub(super) s: &'a [f32],
    /// The values' two digits ([`X16::with_digits`]), or empty.
    pub(super) hi: &'a [i8],
    pub(super) lo: &'a [i8],
    /// [`X16::s4`] of this row, or empty.
    pub(super) s4: &'a [i32],
}

impl XRow<'_> {
    /// The 32 values of block `k`, without a bounds check (the hot loops read one per weight
    /// block; the checks were a third of their instructions).
    ///
    /// # Safety
    /// `k < self.d.len()`: the kernels' block indices run over a weight row of as many blocks
    /// as the activation row has.
    #[inline(always)]
    pub(super) unsafe fn block(&self, k: usize) -> &[i16] {
        debug_assert!(k < self.d.len() && self.v.len() >= 32 * self.d.len());
        // SAFETY: k < d.len() (this function's contract) and v.len() >= 32 d.len() (group
        // slices cols values and cols / 32 units), so 32 k + 32 <= v.len().
        unsafe { self.v.get_unchecked(32 * k..32 * k + 32) }
    }

    /// The two digits of blocks `k` and `k + 1` (64 values each), without a bounds check.
    ///
    /// # Safety
    /// `k + 1 < self.d.len()` and the row has its digits (`hi` and `lo` as long as `v`).
    #[inline(always)]
    pub(super) unsafe fn digits2(&self, k: usize) -> (&[i8], &[i8]) {
        debug_assert!(k + 1 < self.d.len() && self.hi.len() == self.v.len());
        debug_assert!(self.lo.len() == self.v.len() && self.v.len() >= 32 * self.d.len());
        // SAFETY: 32 k + 64 <= 32 d.len() <= v.len() == hi.len() == lo.len() (the contract).
        unsafe {
            (
                self.hi.get_unchecked(32 * k..32 * k + 64),
                self.lo.get_unchecked(32 * k..32 * k + 64),
            )
        }
    }

    /// [`X16::s4`] of blocks `k` and `k + 1` (16 sums of 4 values), without a bounds check.
    ///
    /// # Safety
    /// `k + 1 < self.d.len()` and the row has its sums (`s4` a quarter as long as `v`).
    #[inline(always)]
    pub(super) unsafe fn sums4(&self, k: usize) -> &[i32] {
        debug_assert!(k + 1 < self.d.len() && 4 * self.s4.len() == self.v.len());
        // SAFETY: 8 k + 16 <= 8 d.len() <= v.len() / 4 == s4.len() (the contract).
        unsafe { self.s4.get_unchecked(8 * k..8 * k + 16) }
    }

    /// Block `k`'s unit `u` and exact sum, unchecked as [`XRow::block`].
    ///
    /// # Safety
    /// As [`XRow::block`].
    #[inline(always)]
    pub(super) unsafe fn unit_sum(&self, k: usize) -> (f32, f32) {
        debug_assert!(k < self.d.len() && self.s.len() == self.d.len());
        // SAFETY: k < d.len() == s.len() (this function's contract; group).
        unsafe { (*self.d.get_unchecked(k), *self.s.get_unchecked(k)) }
    }
}

/// Rounds `n` rows of `cols` activations (a multiple of 32) to [`X16`].
#[target_feature(enable = "avx2,fma,f16c")]
pub fn quantize(x: &[f32], n: usize, cols: usize) -> X16 {
    let blocks = n * cols / 32;
    let stride = cols + ROW_PAD;
    let mut out = X16 {
        stride,
        v: vec![0; n * stride],
        d: vec![0.0; blocks],
        s: vec![0.0; blocks],
        hi: Vec::new(),
        lo: Vec::new(),
        s4: Vec::new(),
    };
    let sign = _mm256_set1_ps(-0.0);
    let k254 = _mm256_set1_ps(254.0);
    let rows = out
        .v
        .chunks_exact_mut(stride)
        .flat_map(|r| r[..cols].chunks_exact_mut(32));
    for (b, (xb, vb)) in x[..n * cols].chunks_exact(32).zip(rows).enumerate() {
        let f = [ld8(xb), ld8(&xb[8..]), ld8(&xb[16..]), ld8(&xb[24..])];
        let m = _mm256_max_ps(
            _mm256_max_ps(_mm256_andnot_ps(sign, f[0]), _mm256_andnot_ps(sign, f[1])),
            _mm256_max_ps(_mm256_andnot_ps(sign, f[2]), _mm256_andnot_ps(sign, f[3])),
        );
        let m = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
        let m = _mm_max_ps(m, _mm_movehl_ps(m, m));
        let amax = _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
        let d = amax / 127.0;
        let inv = _mm256_set1_ps(if d > 0.0 { 1.0 / d } else { 0.0 });
        let mut ints = [_mm256_setzero_si256(); 4];
        for k in 0..4 {
            let t = _mm256_mul_ps(f[k], inv);
            let q = _mm256_round_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(t);
            let r = _mm256_round_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(
                _mm256_mul_ps(_mm256_sub_ps(t, q), k254),
            );
            // 254 q + r is an integer below 2^15: exact in fp32
            ints[k] = _mm256_cvtps_epi32(_mm256_fmadd_ps(q, k254, r));
        }
        // packs interleaves 128-bit lanes; the permute puts elements back in order
        let lo = _mm256_permute4x64_epi64::<0xD8>(_mm256_packs_epi32(ints[0], ints[1]));
        let hi = _mm256_permute4x64_epi64::<0xD8>(_mm256_packs_epi32(ints[2], ints[3]));
        let (v0, v1) = vb.split_at_mut(16);
        // SAFETY: v0 and v1 hold 16 i16 (32 bytes) each; storeu accepts any alignment.
        unsafe {
            _mm256_storeu_si256(v0.as_mut_ptr().cast(), lo);
            _mm256_storeu_si256(v1.as_mut_ptr().cast(), hi);
        }
        out.d[b] = d / 254.0;
        out.s[b] = hsum(_mm256_add_ps(
            _mm256_add_ps(f[0], f[1]),
            _mm256_add_ps(f[2], f[3]),
        ));
    }
    out
}

/// Row `r` of a digit array, or nothing when the values have no digits.
fn digit_row(d: &[i8], r: usize, stride: usize, cols: usize) -> &[i8] {
    if d.is_empty() {
        d
    } else {
        &d[r * stride..][..cols]
    }
}

/// Runs `f` for the group of activation rows `g0..g0 + NX`.
#[inline(always)]
pub(super) fn group<const NX: usize>(
    f: GroupFn<NX>,
    w: &[u8],
    x16: &X16,
    n: usize,
    cols: usize,
    g0: usize,
    out: &mut [f32],
) {
    let (per, stride) = (cols / 32, x16.stride);
    let x: [XRow<'_>; NX] = std::array::from_fn(|i| XRow {
        v: &x16.v[(g0 + i) * stride..][..cols],
        d: &x16.d[(g0 + i) * per..][..per],
        s: &x16.s[(g0 + i) * per..][..per],
        hi: digit_row(&x16.hi, g0 + i, stride, cols),
        lo: digit_row(&x16.lo, g0 + i, stride, cols),
        s4: if x16.s4.is_empty() {
            &x16.s4
        } else {
            &x16.s4[(g0 + i) * stride / 4..][..cols / 4]
        },
    });
    f(w, &x, n, out, g0);
}
