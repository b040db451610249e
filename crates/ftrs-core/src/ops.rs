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
//! - [`decode_attention`]: dot products, softmax and the weighted sum in fp32 (f64 for the
//!   softmax's normaliser), in a different order from a BLAS matmul: ~1e-6 relative. Over an
//!   int8 cache ([`decode_attention_rows`]) each row is widened to fp32 once per unit, its dot
//!   products times its key scale, its weights times its value scale.
//!
//! Work is cut by rows (norm) or by (query row, head) pairs (attention) over the quantized
//! kernels' worker pool ([`crate::quant::threads`]), only when there is enough of it.

use crate::error::{CoreError, Result};
use crate::quant::simd::{axpy_f32, dot_f32};
use crate::quant::threads;

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

/// The shapes of one decode attention call.
#[derive(Debug, Clone, Copy)]
pub struct AttnShape {
    /// query rows (one decode token each)
    pub rows: usize,
    /// query heads
    pub heads: usize,
    /// key/value heads (`heads` is a multiple: grouped-query attention)
    pub kv_heads: usize,
    /// channels per head
    pub head_dim: usize,
    /// key columns per row (the longest context; shorter rows are masked)
    pub keys: usize,
}

/// A KV cache as decode attention reads it, `num_slots x kv_heads x head_dim` each: fp32 rows,
/// or int8 rows with one fp32 scale per slot and kv head (`num_slots x kv_heads`), a row's
/// values `q * scale` (`ftrs.kvcache.quant`).
#[derive(Debug, Clone, Copy)]
pub enum KvRows<'a> {
    /// fp32 keys and values
    F32 {
        /// keys
        k: &'a [f32],
        /// values
        v: &'a [f32],
    },
    /// int8 keys and values and their scales
    Int8 {
        /// keys
        k: &'a [i8],
        /// values
        v: &'a [i8],
        /// one scale per key row
        k_scale: &'a [f32],
        /// one scale per value row
        v_scale: &'a [f32],
    },
}

impl KvRows<'_> {
    /// Slots of the cache, or None when its parts do not fit `per_slot` values a slot and
    /// `kv_heads` rows a slot.
    fn slots(&self, per_slot: usize, kv_heads: usize) -> Option<usize> {
        let (k, v, scales) = match *self {
            KvRows::F32 { k, v } => (k.len(), v.len(), None),
            KvRows::Int8 {
                k,
                v,
                k_scale,
                v_scale,
            } => (k.len(), v.len(), Some((k_scale.len(), v_scale.len()))),
        };
        let n = k / per_slot;
        let fits = k == v
            && k.is_multiple_of(per_slot)
            && scales.is_none_or(|(a, b)| a == b && a == n * kv_heads);
        fits.then_some(n)
    }

    /// Row `i` (`slot * kv_heads + kv head`) of the keys (`value` false) or the values, `d`
    /// long, and the factor its products take: fp32 rows as they are (factor 1), int8 rows
    /// widened into `buf` (factor: the row's scale).
    #[inline]
    fn row<'b>(&'b self, value: bool, i: usize, d: usize, buf: &'b mut [f32]) -> (&'b [f32], f32) {
        match *self {
            KvRows::F32 { k, v } => (&(if value { v } else { k })[i * d..(i + 1) * d], 1.0),
            KvRows::Int8 {
                k,
                v,
                k_scale,
                v_scale,
            } => {
                let (rows, scales) = if value { (v, v_scale) } else { (k, k_scale) };
                for (o, &x) in buf.iter_mut().zip(&rows[i * d..(i + 1) * d]) {
                    *o = f32::from(x);
                }
                (&buf[..d], scales[i])
            }
        }
    }
}

/// `out[r, h] = softmax_l(q[r, h] . K[slots[r, l], h / g] * scale) . V[slots[r, l], h / g]`
/// over the columns `l` where `valid[r, l] != 0` (all of them without `valid`); `g = heads /
/// kv_heads`. `k_cache`, `v_cache`: `num_slots x kv_heads x head_dim`. A row with no valid
/// column gets zeros.
#[allow(clippy::too_many_arguments)]
pub fn decode_attention(
    shape: AttnShape,
    q: &[f32],
    k_cache: &[f32],
    v_cache: &[f32],
    slots: &[i64],
    valid: Option<&[u8]>,
    scale: f32,
    out: &mut [f32],
    threads: usize,
) -> Result<()> {
    let cache = KvRows::F32 {
        k: k_cache,
        v: v_cache,
    };
    decode_attention_rows(shape, q, cache, slots, valid, scale, out, threads)
}

/// [`decode_attention`] over either kind of cache: an int8 row's dot products are scaled by
/// its key scale, its values by its value scale (an fp32 cache: the same bits as
/// [`decode_attention`]).
#[allow(clippy::too_many_arguments)]
pub fn decode_attention_rows(
    shape: AttnShape,
    q: &[f32],
    cache: KvRows<'_>,
    slots: &[i64],
    valid: Option<&[u8]>,
    scale: f32,
    out: &mut [f32],
    threads: usize,
) -> Result<()> {
    let AttnShape {
        rows,
        heads,
        kv_heads,
        head_dim: d,
        keys,
    } = shape;
    let per_slot = kv_heads * d;
    if kv_heads == 0
        || !heads.is_multiple_of(kv_heads)
        || d == 0
        || q.len() != rows * heads * d
        || out.len() != q.len()
        || slots.len() != rows * keys
        || valid.is_some_and(|v| v.len() != slots.len())
        || cache.slots(per_slot, kv_heads).is_none()
    {
        return Err(config(format!(
            "decode_attention: {shape:?} does not fit q {}, out {}, slots {} or the cache",
            q.len(),
            out.len(),
            slots.len(),
        )));
    }
    let num_slots = cache.slots(per_slot, kv_heads).unwrap_or(0);
    if let Some(bad) = slots
        .iter()
        .find(|&&s| usize::try_from(s).map_or(true, |s| s >= num_slots))
    {
        return Err(config(format!(
            "decode_attention: slot {bad} outside the cache of {num_slots}"
        )));
    }
    let group = heads / kv_heads;
    // A task unit is `sub` query heads of one kv head: each key and value is read once for
    // all of them (16 heads share one latent row in MLA, 2-8 share a kv head in GQA). A
    // group is cut into parts only to give every thread a unit.
    let sub = heads_per_unit(group, rows * kv_heads, threads::resolve(threads));
    let units = rows * heads / sub;
    // bytes of K and V the units read
    let tasks = threads::plan(units, units * keys * d * 8, threads);
    let one = |unit: usize, o: &mut [f32]| {
        let (r, h0) = (unit * sub / heads, unit * sub % heads);
        let kvh = h0 / group;
        let qs = &q[(r * heads + h0) * d..(r * heads + h0 + sub) * d];
        let row_slots = &slots[r * keys..(r + 1) * keys];
        let row_valid = valid.map(|v| &v[r * keys..(r + 1) * keys]);
        // scores[j * keys + l]: head h0 + j against key l
        let mut scores = vec![f32::NEG_INFINITY; sub * keys];
        let mut max = vec![f32::NEG_INFINITY; sub];
        let mut buf = vec![0f32; d]; // an int8 row widened
        for (l, &slot) in row_slots.iter().enumerate() {
            if row_valid.is_some_and(|v| v[l] == 0) {
                continue;
            }
            let (key, ks) = cache.row(false, slot as usize * kv_heads + kvh, d, &mut buf);
            let ks = ks * scale; // exactly `scale` for an fp32 row
            for (j, (qv, m)) in qs.chunks_exact(d).zip(max.iter_mut()).enumerate() {
                let sc = dot_f32(qv, key) * ks;
                scores[j * keys + l] = sc;
                *m = m.max(sc);
            }
        }
        o.fill(0.0);
        let mut inv = vec![0f32; sub];
        for (j, (&m, iv)) in max.iter().zip(inv.iter_mut()).enumerate() {
            if m == f32::NEG_INFINITY {
                continue; // no valid column: this head's output stays zero
            }
            let mut total = 0f64;
            for sc in scores[j * keys..(j + 1) * keys].iter_mut() {
                *sc = (*sc - m).exp();
                total += f64::from(*sc);
            }
            *iv = (1.0 / total) as f32;
        }
        for (l, &slot) in row_slots.iter().enumerate() {
            if row_valid.is_some_and(|v| v[l] == 0) {
                continue;
            }
            let (value, vs) = cache.row(true, slot as usize * kv_heads + kvh, d, &mut buf);
            for (j, oj) in o.chunks_exact_mut(d).enumerate() {
                let p = scores[j * keys + l];
                if p == 0.0 || p == f32::NEG_INFINITY {
                    continue;
                }
                axpy_f32(p * inv[j] * vs, value, oj);
            }
        }
    };
    threads::for_chunks(tasks, threads, out, sub * d, |first, chunk| {
        for (i, o) in chunk.chunks_exact_mut(sub * d).enumerate() {
            one(first + i, o);
        }
    });
    Ok(())
}

/// Query heads a decode-attention unit takes: the whole group of a kv head, or the largest
/// divisor of it that still gives each of `threads` threads a unit when `groups` (rows x kv
/// heads) are fewer than the threads.
fn heads_per_unit(group: usize, groups: usize, threads: usize) -> usize {
    if groups >= threads {
        return group;
    }
    let parts = threads.div_ceil(groups.max(1));
    (1..=group.div_ceil(parts))
        .rev()
        .find(|s| group.is_multiple_of(*s))
        .unwrap_or(1)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn seq(n: usize, seed: u32) -> Vec<f32> {
        let mut s = seed.wrapping_mul(2654435761).wrapping_add(12345);
        (0..n)
            .map(|_| {
                s = s.wrapping_mul(1664525).wrapping_add(1013904223);
                (s >> 8) as f32 / (1u32 << 24) as f32 * 2.0 - 1.0
            })
            .collect()
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

    /// `decode_attention` against the formula in f64 (1e-5), and the same bits on 1 and 4
    /// threads (the units differ; each head's sums do not).
    fn check_decode_attention(shape: AttnShape, slots: &[i64], valid: Option<&[u8]>) {
        let AttnShape {
            rows,
            heads,
            kv_heads,
            head_dim: d,
            keys,
        } = shape;
        let slots_n = 1 + *slots.iter().max().unwrap() as usize;
        let (k, v) = (
            seq(slots_n * kv_heads * d, 6),
            seq(slots_n * kv_heads * d, 7),
        );
        let q = seq(rows * heads * d, 8);
        let mut first: Option<Vec<f32>> = None;
        for threads in [1, 2, 4] {
            let mut out = vec![1f32; q.len()];
            decode_attention(shape, &q, &k, &v, slots, valid, 0.25, &mut out, threads).unwrap();
            for r in 0..rows {
                for h in 0..heads {
                    let kvh = h / (heads / kv_heads);
                    let cols: Vec<usize> = (0..keys)
                        .filter(|&l| valid.is_none_or(|m| m[r * keys + l] != 0))
                        .collect();
                    let at = |l: usize| (slots[r * keys + l] as usize * kv_heads + kvh) * d;
                    let sc: Vec<f64> = cols
                        .iter()
                        .map(|&l| {
                            (0..d)
                                .map(|i| {
                                    f64::from(q[(r * heads + h) * d + i]) * f64::from(k[at(l) + i])
                                })
                                .sum::<f64>()
                                * 0.25
                        })
                        .collect();
                    let m = sc.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                    let z: f64 = sc.iter().map(|s| (s - m).exp()).sum();
                    for i in 0..d {
                        let want: f64 = cols
                            .iter()
                            .zip(&sc)
                            .map(|(&l, s)| (s - m).exp() / z * f64::from(v[at(l) + i]))
                            .sum();
                        let got = f64::from(out[(r * heads + h) * d + i]);
                        assert!((got - want).abs() < 1e-5, "{r} {h} {i}: {got} vs {want}");
                    }
                }
            }
            match &first {
                None => first = Some(out),
                Some(f) => assert!(f.iter().zip(&out).all(|(a, b)| a.to_bits() == b.to_bits())),
            }
        }
    }

    #[test]
    fn decode_attention_equals_the_softmax_formula_with_masks_and_groups() {
        let shape = AttnShape {
            rows: 2,
            heads: 4,
            kv_heads: 2,
            head_dim: 16,
            keys: 5,
        };
        let slots = [4i64, 0, 7, 2, 8, 1, 3, 5, 0, 0];
        check_decode_attention(shape, &slots, Some(&[1u8, 1, 1, 1, 1, 1, 1, 1, 0, 0]));
        // MLA's shape: one row, six query heads on one kv head (a latent row), cut into parts
        // of two heads on four threads; 20 channels (not a multiple of 8)
        let mla = AttnShape {
            rows: 1,
            heads: 6,
            kv_heads: 1,
            head_dim: 20,
            keys: 7,
        };
        check_decode_attention(mla, &[3, 0, 6, 1, 5, 2, 4], None);
        let q = seq(2 * 4 * 16, 8);
        let (k, v) = (seq(9 * 2 * 16, 6), seq(9 * 2 * 16, 7));
        let mut out = vec![0f32; q.len()];
        let bad = [9i64, 0, 0, 0, 0, 0, 0, 0, 0, 0];
        assert!(decode_attention(shape, &q, &k, &v, &bad, None, 1.0, &mut out, 1).is_err());
    }

    #[test]
    fn an_int8_cache_reads_as_its_rows_times_their_scales() {
        let shape = AttnShape {
            rows: 2,
            heads: 4,
            kv_heads: 2,
            head_dim: 12,
            keys: 4,
        };
        let (n, d) = (6, 12);
        let codes = |seed: u32| -> Vec<i8> {
            seq(n * 2 * d, seed)
                .iter()
                .map(|x| (x * 127.0).round() as i8)
                .collect()
        };
        let (k, v) = (codes(3), codes(4));
        let (ks, vs) = (seq(n * 2, 5), seq(n * 2, 9));
        let widen = |c: &[i8], s: &[f32]| -> Vec<f32> {
            c.iter()
                .enumerate()
                .map(|(i, &x)| f32::from(x) * s[i / d])
                .collect()
        };
        let q = seq(2 * 4 * d, 8);
        let slots = [5i64, 0, 3, 1, 2, 2, 4, 0];
        let valid = [1u8, 1, 1, 1, 1, 1, 0, 0];
        let mut want = vec![0f32; q.len()];
        let (kf, vf) = (widen(&k, &ks), widen(&v, &vs));
        decode_attention(shape, &q, &kf, &vf, &slots, Some(&valid), 0.3, &mut want, 1).unwrap();
        let cache = KvRows::Int8 {
            k: &k,
            v: &v,
            k_scale: &ks,
            v_scale: &vs,
        };
        let mut got = vec![0f32; q.len()];
        decode_attention_rows(shape, &q, cache, &slots, Some(&valid), 0.3, &mut got, 2).unwrap();
        for (a, b) in got.iter().zip(&want) {
            assert!((a - b).abs() <= 1e-5 * (1.0 + b.abs()), "{a} vs {b}");
        }
        let short = KvRows::Int8 {
            k: &k,
            v: &v,
            k_scale: &ks[1..],
            v_scale: &vs[1..],
        };
        assert!(decode_attention_rows(shape, &q, short, &slots, None, 0.3, &mut got, 1).is_err());
    }

    #[test]
    fn a_unit_takes_a_whole_group_unless_threads_would_idle() {
        assert_eq!(heads_per_unit(16, 1, 2), 8); // MLA decode, one row, two threads
        assert_eq!(heads_per_unit(16, 1, 1), 16);
        assert_eq!(heads_per_unit(6, 1, 4), 2);
        assert_eq!(heads_per_unit(7, 1, 2), 1); // a prime group: one head a unit
        assert_eq!(heads_per_unit(4, 8, 2), 4); // enough (row, kv head) groups already
    }
}
