//! Decode attention's inner loops in AVX2/FMA (`crate::ops`): four keys at a time, over fp32
//! rows or int8 ones (widened to fp32 as they are loaded, 8 at a time).
//!
//! A decode query meets each key once, so one dot product is short (a head's 64-128 channels)
//! and a single chain of fused multiply-adds waits on itself; four keys against one query row
//! run eight independent chains (two a key), and four value rows are added into an output row
//! with one load and one store of it instead of four.

#[cfg(target_arch = "x86_64")]
use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T0};

use super::avx2_available;

/// A KV cache element: fp32, or int8 (a row's values before its scale).
pub trait KvElem: Copy + Sync {
    /// `[q . k[0], .., q . k[3]]`, every row as long as `q`: four keys at a time in eight
    /// FMA chains where the CPU has AVX2/FMA/F16C.
    fn dot4(q: &[f32], k: [&[Self]; 4]) -> [f32; 4];
    /// `y += p[0] * x[0] + .. + p[3] * x[3]`, every row as long as `y`: one load and store
    /// of `y` per four rows where the CPU has AVX2/FMA/F16C.
    fn axpy4(p: [f32; 4], x: [&[Self]; 4], y: &mut [f32]);
}

macro_rules! kv_elem {
    ($t:ty, $dot:ident, $axpy:ident) => {
        impl KvElem for $t {
            fn dot4(q: &[f32], k: [&[$t]; 4]) -> [f32; 4] {
                #[cfg(target_arch = "x86_64")]
                if avx2_available() {
                    // SAFETY: the CPU has AVX2, FMA and F16C (checked just above).
                    return unsafe { x86::$dot(q, k) };
                }
                k.map(|r| q.iter().zip(r).map(|(&a, &b)| a * f32::from(b)).sum())
            }

            fn axpy4(p: [f32; 4], x: [&[$t]; 4], y: &mut [f32]) {
                #[cfg(target_arch = "x86_64")]
                if avx2_available() {
                    // SAFETY: the CPU has AVX2, FMA and F16C (checked just above).
                    return unsafe { x86::$axpy(p, x, y) };
                }
                for (i, acc) in y.iter_mut().enumerate() {
                    for j in 0..4 {
                        *acc += p[j] * f32::from(x[j][i]);
                    }
                }
            }
        }
    };
}

kv_elem!(f32, dot4_f32, axpy4_f32);
kv_elem!(i8, dot4_i8, axpy4_i8);

/// Asks the CPU to bring the cache lines of `s` toward L1 (a hint: no effect on results), so a
/// row needed a few iterations later does not stall on memory. No-op off x86-64.
#[inline]
pub fn prefetch<T>(s: &[T]) {
    #[cfg(target_arch = "x86_64")]
    {
        let bytes = std::mem::size_of_val(s);
        let base = s.as_ptr().cast::<i8>();
        for off in (0..bytes).step_by(64) {
            // SAFETY: `base + off` lies inside `s` (off < its byte length); a prefetch never
            // faults and changes no memory.
            unsafe { _mm_prefetch::<_MM_HINT_T0>(base.add(off)) };
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    use super::super::int::{hsum, ld8};

    /// The 8 int8 at `s[..8]` as 8 floats.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    fn ld8i(s: &[i8]) -> __m256 {
        let b: [i8; 8] = s[..8].try_into().unwrap_or([0; 8]);
        let v = _mm_cvtsi64_si128(i64::from_le_bytes(b.map(|x| x as u8)));
        _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v))
    }

    /// Stores 8 floats at `o[..8]`.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    fn st8(o: &mut [f32], v: __m256) {
        let o = &mut o[..8];
        // SAFETY: 8 writable f32 (sliced above); storeu accepts any alignment.
        unsafe { _mm256_storeu_ps(o.as_mut_ptr(), v) }
    }

    /// The kernels of one row type: `$ld` loads 8 of its elements as floats.
    macro_rules! four_rows {
        ($t:ty, $ld:ident, $dot:ident, $axpy:ident) => {
            /// `[q . k[0], .., q . k[3]]`, every row as long as `q`.
            #[target_feature(enable = "avx2,fma,f16c")]
            pub(super) fn $dot(q: &[f32], k: [&[$t]; 4]) -> [f32; 4] {
                let d = q.len();
                let k = k.map(|r| &r[..d]);
                let mut a = [_mm256_setzero_ps(); 8];
                let mut i = 0;
                while i + 16 <= d {
                    let (q0, q1) = (ld8(&q[i..]), ld8(&q[i + 8..]));
                    for j in 0..4 {
                        a[2 * j] = _mm256_fmadd_ps(q0, $ld(&k[j][i..]), a[2 * j]);
                        a[2 * j + 1] = _mm256_fmadd_ps(q1, $ld(&k[j][i + 8..]), a[2 * j + 1]);
                    }
                    i += 16;
                }
                if i + 8 <= d {
                    let q0 = ld8(&q[i..]);
                    for j in 0..4 {
                        a[2 * j] = _mm256_fmadd_ps(q0, $ld(&k[j][i..]), a[2 * j]);
                    }
                    i += 8;
                }
                let mut out = [0f32; 4];
                for (j, o) in out.iter_mut().enumerate() {
                    let mut tail = 0f32;
                    for (&x, &y) in q[i..].iter().zip(&k[j][i..]) {
                        tail = x.mul_add(f32::from(y), tail);
                    }
                    *o = hsum(_mm256_add_ps(a[2 * j], a[2 * j + 1])) + tail;
                }
                out
            }

            /// `y += p[0] * x[0] + .. + p[3] * x[3]`, every row as long as `y`.
            #[target_feature(enable = "avx2,fma,f16c")]
            pub(super) fn $axpy(p: [f32; 4], x: [&[$t]; 4], y: &mut [f32]) {
                let d = y.len();
                let x = x.map(|r| &r[..d]);
                let pv = p.map(|v| _mm256_set1_ps(v));
                let mut i = 0;
                while i + 8 <= d {
                    let mut acc = ld8(&y[i..]);
                    for j in 0..4 {
                        acc = _mm256_fmadd_ps(pv[j], $ld(&x[j][i..]), acc);
                    }
                    st8(&mut y[i..], acc);
                    i += 8;
                }
                for (t, acc) in y[i..].iter_mut().enumerate() {
                    for j in 0..4 {
                        *acc = p[j].mul_add(f32::from(x[j][i + t]), *acc);
                    }
                }
            }
        };
    }

    four_rows!(f32, ld8, dot4_f32, axpy4_f32);
    four_rows!(i8, ld8i, dot4_i8, axpy4_i8);
}

#[cfg(test)]
mod tests {
    use super::KvElem;
    use crate::ops::tests::seq;

    /// Against the sums in f64, over lengths with and without a 16-, 8- and scalar tail, for
    /// fp32 rows and int8 ones.
    fn check<T: KvElem>(make: impl Fn(f32) -> T, back: impl Fn(T) -> f64) {
        for d in [1, 7, 8, 15, 16, 20, 64, 72] {
            let q = seq(d, 1);
            let rows: Vec<Vec<T>> = (0..4)
                .map(|j| seq(d, 2 + j).into_iter().map(&make).collect())
                .collect();
            let k = [&rows[0][..], &rows[1], &rows[2], &rows[3]];
            let got = T::dot4(&q, k);
            for (j, r) in rows.iter().enumerate() {
                let want: f64 = q.iter().zip(r).map(|(&a, &b)| f64::from(a) * back(b)).sum();
                let tol = 1e-5 * (1.0 + want.abs());
                assert!((f64::from(got[j]) - want).abs() < tol, "{d} {j}");
            }
            let p = [0.5, -1.25, 0.0, 2.0];
            let mut y = seq(d, 9);
            let y0 = y.clone();
            T::axpy4(p, k, &mut y);
            for i in 0..d {
                let want = f64::from(y0[i])
                    + (0..4)
                        .map(|j| f64::from(p[j]) * back(rows[j][i]))
                        .sum::<f64>();
                assert!(
                    (f64::from(y[i]) - want).abs() < 1e-5 * (1.0 + want.abs()),
                    "{d} {i}"
                );
            }
        }
    }

    #[test]
    fn four_rows_at_a_time_equal_the_sums() {
        check(|x| x, f64::from);
        check(|x| (x * 127.0).round() as i8, f64::from);
    }
}
