//! The small fp32 ops of a CPU decode step, each one call over all rows: RMSNorm with the
//! residual add in front, rotary in place on q and k, and decode attention over paged KV slots.
//!
//! Between two matmuls a decode token of a small model spends longer in the dispatch of these
//! ops than in their math (a 576-wide norm is ~1 µs of arithmetic and ~40 µs of torch ops on a
//! cache the weight streams have just flushed). They follow the torch references of
//! `ftrs.kernels` op for op, in the same fp32 roundings, except where a sum's order differs:
//! - [`rms_norm`]: the mean of squares is summed in f64 (torch sums fp32 lanes), so the scale
//!   differs from torch's by at most an ulp or so; the residual add and the two products are
//!   exact as torch rounds them.
//! - [`rotary`]: `x * cos + rotate_half(x) * sin`, each product and the sum rounded to fp32,
//!   no fused multiply-add: bit for bit the reference.
//! - [`kv_write_int8`]: a token's keys or values into an int8 KV cache, bit for bit
//!   `ftrs.kvcache.quant`'s torch rendering.
//! - [`decode_attention`]: dot products, softmax and the weighted sum in fp32 (f64 for the
//!   softmax's normaliser), in a different order from a BLAS matmul: ~1e-6 relative. Over an
//!   int8 cache ([`KvRows::Int8`]) each row is widened to fp32 once per unit, its dot
//!   products times its key scale, its weights times its value scale. Four keys at a time
//!   (`quant::simd::dot4_f32`, `axpy4_f32`), the rows a few keys ahead prefetched: a decode
//!   query's short dot products otherwise wait on their own FMA chain and on memory.
//!
//! Work is cut by rows (norm) or by (query row, head) pairs (attention) over the quantized
//! kernels' worker pool ([`crate::quant::threads`]), only when there is enough of it.

use crate::error::{CoreError, Result};

mod attn;
pub use attn::{decode_attention, AttnShape, KvRows};

fn config(msg: String) -> CoreError {
    CoreError::Config(msg)
}

/// `out[r] = w * (s * rsqrt(mean(s^2) + eps))` for each row `s` of `rows x n`, where `s = x`,
/// or `s = residual + x` written to `residual_out` first.
pub fn rms_norm(
    x: &[f32],
    residual: Option<(&[f32], &mut [f32])>,
    weight: &[f32],
    eps: f32,
    out: &mut [f32],
) -> Result<()> {
    let n = weight.len();
    if n == 0 || !x.len().is_multiple_of(n) || out.len() != x.len() {
        return Err(config(format!(
            "rms_norm: x has {} values, out {}, weight {}: expected rows x {n} each",
            x.len(),
            out.len(),
            n
        )));
    }
    match residual {
        None => {
            for (xr, or) in x.chunks_exact(n).zip(out.chunks_exact_mut(n)) {
                norm_row(xr, weight, eps, or);
            }
        }
        Some((res, res_out)) => {
            if res.len() != x.len() || res_out.len() != x.len() {
                return Err(config(format!(
                    "rms_norm: residual has {} values and its output {}, x {}",
                    res.len(),
                    res_out.len(),
                    x.len()
                )));
            }
            for ((xr, rr), (sr, or)) in x
                .chunks_exact(n)
                .zip(res.chunks_exact(n))
                .zip(res_out.chunks_exact_mut(n).zip(out.chunks_exact_mut(n)))
            {
                for ((s, &a), &b) in sr.iter_mut().zip(rr).zip(xr) {
                    *s = a + b;
                }
                norm_row(sr, weight, eps, or);
            }
        }
    }
    Ok(())
}

fn norm_row(s: &[f32], w: &[f32], eps: f32, out: &mut [f32]) {
    // four f64 partial sums: vectorisable, and far more exact than the fp32 lanes it replaces
    let mut acc = [0f64; 4];
    let mut chunks = s.chunks_exact(4);
    for c in &mut chunks {
        for (a, &v) in acc.iter_mut().zip(c) {
            *a += f64::from(v) * f64::from(v);
        }
    }
    let tail: f64 = chunks
        .remainder()
        .iter()
        .map(|&v| f64::from(v) * f64::from(v))
        .sum();
    let mean = ((acc[0] + acc[1]) + (acc[2] + acc[3]) + tail) / s.len() as f64;
    let r = 1.0 / (mean as f32 + eps).sqrt();
    for ((o, &v), &g) in out.iter_mut().zip(s).zip(w) {
        *o = (v * r) * g;
    }
}

/// Rotates `q` (`tokens x q_heads x d`) and `k` (`tokens x k_heads x d`) in place, "rotate
/// half": the first half `a` and second half `b` of each head become `a*c1 - b*s1` and
/// `b*c2 + a*s2`, with `c`, `s` the row `positions[t]` of the `cos` / `sin` tables
/// (`max_positions x d`).
pub fn rotary(
    q: &mut [f32],
    k: &mut [f32],
    d: usize,
    cos: &[f32],
    sin: &[f32],
    positions: &[i64],
) -> Result<()> {
    let tokens = positions.len();
    if d == 0 || !d.is_multiple_of(2) || cos.len() != sin.len() || !cos.len().is_multiple_of(d) {
        return Err(config(format!(
            "rotary: head_dim {d}, tables of {} and {} values",
            cos.len(),
            sin.len()
        )));
    }
    for (name, x) in [("q", &*q), ("k", &*k)] {
        if tokens == 0 || !x.len().is_multiple_of(tokens * d) {
            if tokens == 0 && x.is_empty() {
                continue;
            }
            return Err(config(format!(
                "rotary: {name} has {} values, not {tokens} tokens of heads of {d}",
                x.len()
            )));
        }
    }
    if tokens == 0 {
        return Ok(());
    }
    let max_pos = cos.len() / d;
    let half = d / 2;
    let (q_tok, k_tok) = (q.len() / tokens, k.len() / tokens);
    for (t, &p) in positions.iter().enumerate() {
        let p = usize::try_from(p)
            .ok()
            .filter(|&p| p < max_pos)
            .ok_or_else(|| {
                config(format!(
                    "rotary: position {p} outside the table of {max_pos}"
                ))
            })?;
        let (c, s) = (&cos[p * d..(p + 1) * d], &sin[p * d..(p + 1) * d]);
        let (c1, c2) = c.split_at(half);
        let (s1, s2) = s.split_at(half);
        let heads = q[t * q_tok..(t + 1) * q_tok]
            .chunks_exact_mut(d)
            .chain(k[t * k_tok..(t + 1) * k_tok].chunks_exact_mut(d));
        for head in heads {
            let (a, b) = head.split_at_mut(half);
            for i in 0..half {
                let (x1, x2) = (a[i], b[i]);
                a[i] = x1 * c1[i] + (-x2) * s1[i];
                b[i] = x2 * c2[i] + x1 * s2[i];
            }
        }
    }
    Ok(())
}

/// Writes `x` (`tokens x kv_heads x d`) into an int8 KV cache (`num_slots x kv_heads x d`
/// codes in `cache`, `num_slots x kv_heads` scales in `scales`) at the slots `slots` (one per
/// token), each row (token, kv head) on its own: `s = max|x| / 127` (fp32), `q =
/// round-half-even(x / max(s, MIN_POSITIVE))` clamped to +-127, as
/// `ftrs.kvcache.quant.quantize_rows` computes them in torch, bit for bit.
pub fn kv_write_int8(
    x: &[f32],
    slots: &[i64],
    kv_heads: usize,
    cache: &mut [i8],
    scales: &mut [f32],
) -> Result<()> {
    let n = scales.len();
    let d = cache.len().checked_div(n).unwrap_or(0);
    let num_slots = n.checked_div(kv_heads).unwrap_or(0);
    if d == 0
        || cache.len() != n * d
        || n != num_slots * kv_heads
        || x.len() != slots.len() * kv_heads * d
    {
        return Err(config(format!(
            "kv_write_int8: x {} values, {} slots, {kv_heads} kv heads, cache {} and {} scales do not fit",
            x.len(),
            slots.len(),
            cache.len(),
            n
        )));
    }
    if let Some(bad) = slots
        .iter()
        .find(|&&r| usize::try_from(r).map_or(true, |r| r >= num_slots))
    {
        return Err(config(format!(
            "kv_write_int8: slot {bad} outside the cache of {num_slots}"
        )));
    }
    for (t, &slot) in slots.iter().enumerate() {
        for h in 0..kv_heads {
            let (src, r) = (
                &x[(t * kv_heads + h) * d..][..d],
                slot as usize * kv_heads + h,
            );
            let s = src.iter().fold(0f32, |m, v| m.max(v.abs())) / 127.0;
            let div = s.max(f32::MIN_POSITIVE);
            for (o, &v) in cache[r * d..(r + 1) * d].iter_mut().zip(src) {
                *o = (v / div).round_ties_even().clamp(-127.0, 127.0) as i8;
            }
            scales[r] = s;
        }
    }
    Ok(())
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::quant::threads;

    /// `n` pseudo-random values in [-1, 1), the same for the same seed (the ops' tests and
    /// the attention kernels' share them).
    pub(crate) fn seq(n: usize, seed: u32) -> Vec<f32> {
        let mut s = seed.wrapping_mul(2654435761).wrapping_add(12345);
        (0..n)
            .map(|_| {
                s = s.wrapping_mul(1664525).wrapping_add(1013904223);
                (s >> 8) as f32 / (1u32 << 24) as f32 * 2.0 - 1.0
            })
            .collect()
    }

    #[test]
    fn kv_write_int8_quantizes_each_row_by_its_largest_value() {
        // two tokens, two kv heads, three channels, into slots 1 and 0 of a cache of 3
        let x = [
            0.0, 0.0, 0.0, 2.54, -1.27, 0.01, 0.5, 1.0, -0.25, 1.0, 1.0, 1.0,
        ];
        let (mut cache, mut scales) = (vec![9i8; 3 * 2 * 3], vec![9f32; 3 * 2]);
        kv_write_int8(&x, &[1, 0], 2, &mut cache, &mut scales).unwrap();
        assert_eq!(&cache[6..9], &[0, 0, 0]); // a zero row: codes 0, scale 0
        assert_eq!(scales[2], 0.0);
        assert_eq!(&cache[9..12], &[127, -64, 0]); // 0.01 / s = 0.5 rounds to even: 0
        assert_eq!(scales[3], 2.54 / 127.0);
        assert_eq!(&cache[0..3], &[64, 127, -32]); // 63.5 rounds to even: 64
        assert_eq!(&cache[3..6], &[127, 127, 127]);
        assert_eq!(&cache[12..18], &[9; 6]); // slot 2 untouched
        assert!(kv_write_int8(&x, &[3, 0], 2, &mut cache, &mut scales).is_err());
        assert!(kv_write_int8(&x[..6], &[0, 1], 2, &mut cache, &mut scales).is_err());
    }

    #[test]
    fn for_chunks_gives_each_unit_its_index_once() {
        for (tasks, threads) in [(1, 1), (3, 2), (20, 2)] {
            let mut out = vec![-1f32; 10 * 3];
            threads::for_chunks(tasks, threads, &mut out, 3, |first, chunk| {
                for (i, u) in chunk.chunks_exact_mut(3).enumerate() {
                    u.fill((first + i) as f32);
                }
            });
            let want: Vec<f32> = (0..30).map(|i| (i / 3) as f32).collect();
            assert_eq!(out, want, "tasks {tasks}, threads {threads}");
        }
    }

    #[test]
    fn rms_norm_matches_the_formula_in_f64_and_adds_the_residual() {
        let (rows, n) = (3, 40);
        let (x, res, w) = (seq(rows * n, 1), seq(rows * n, 2), seq(n, 3));
        let mut out = vec![0f32; rows * n];
        let mut res_out = vec![0f32; rows * n];
        rms_norm(&x, Some((&res, &mut res_out)), &w, 1e-5, &mut out).unwrap();
        for r in 0..rows {
            let s: Vec<f64> = (0..n)
                .map(|i| f64::from(res[r * n + i] + x[r * n + i]))
                .collect();
            let ms = s.iter().map(|v| v * v).sum::<f64>() / n as f64;
            for i in 0..n {
                assert_eq!(res_out[r * n + i], res[r * n + i] + x[r * n + i]);
                let want = s[i] / (ms + 1e-5).sqrt() * f64::from(w[i]);
                assert!((f64::from(out[r * n + i]) - want).abs() <= 1e-6 * want.abs().max(1.0));
            }
        }
        let mut plain = vec![0f32; rows * n];
        rms_norm(&res_out, None, &w, 1e-5, &mut plain).unwrap();
        assert_eq!(plain, out);
        assert!(rms_norm(&x, None, &w[..7], 1e-5, &mut out).is_err());
    }

    #[test]
    fn rotary_rotates_each_half_pair_by_its_position_angle() {
        let (d, heads) = (8, 2);
        let theta: Vec<f32> = (0..4 * d).map(|i| 0.1 * i as f32).collect();
        let cos: Vec<f32> = theta.iter().map(|t| t.cos()).collect();
        let sin: Vec<f32> = theta.iter().map(|t| t.sin()).collect();
        let q0 = seq(2 * heads * d, 4);
        let k0 = seq(2 * d, 5);
        let (mut q, mut k) = (q0.clone(), k0.clone());
        rotary(&mut q, &mut k, d, &cos, &sin, &[3, 1]).unwrap();
        for (x0, x, per_tok) in [(&q0, &q, heads * d), (&k0, &k, d)] {
            for (t, p) in [(0usize, 3usize), (1, 1)] {
                for h in 0..per_tok / d {
                    let at = t * per_tok + h * d;
                    for i in 0..d / 2 {
                        let (a, b) = (x0[at + i], x0[at + d / 2 + i]);
                        let (c1, s1) = (cos[p * d + i], sin[p * d + i]);
                        let (c2, s2) = (cos[p * d + d / 2 + i], sin[p * d + d / 2 + i]);
                        assert_eq!(x[at + i], a * c1 + (-b) * s1);
                        assert_eq!(x[at + d / 2 + i], b * c2 + a * s2);
                    }
                }
            }
        }
        assert!(rotary(&mut q, &mut k, d, &cos, &sin, &[4, 0]).is_err());
    }
}
