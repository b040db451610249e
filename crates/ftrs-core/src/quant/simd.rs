//! AVX2/FMA/F16C kernels, the only module of `quant` with `unsafe`.
//!
//! Each `#[target_feature]` function here is safe to write but may only be called on a CPU
//! that has the features; [`rows_avx2`] is the one entry, and its callers reach it only when
//! [`avx2_available`] said yes ([`super::Isa`] checks before handing out `Isa::Avx2`).
//!
//! Hand-written kernels decode the hot block types in registers (nibbles masked and widened,
//! converted to fp32, scaled per sub-block) and fuse the products into 8-lane fp32
//! accumulators, one per activation row of the group, so a block is decoded once per
//! [`MAX_NX`] activation rows. Other types run the generic kernel compiled for these features.
//! Sub-block scales multiply the sub-block's partial sums (`d*sc * sum(q*x) - dmin*m *
//! sum(x)`), the same algebra as the reference with a different rounding order.

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

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
fn rows_x86(t: QType, w: &[u8], x: &[f32], n: usize, cols: usize, out: &mut [f32]) {
    kernel::rows_generic::<true>(t, w, x, n, cols, out);
}
