//! Decode attention over paged KV slots (the parent's docs: its numerics), fp32 or int8 rows.

use super::config;
use crate::error::Result;
use crate::quant::simd::{prefetch, KvElem};
use crate::quant::threads;

/// Valid keys ahead of the current four whose rows are prefetched.
const AHEAD: usize = 8;

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
}

/// `out[r, h] = softmax_l(q[r, h] . K[slots[r, l], h / g] * scale) . V[slots[r, l], h / g]`
/// over the columns `l` where `valid[r, l] != 0` (all of them without `valid`); `g = heads /
/// kv_heads`; the cache's rows `num_slots x kv_heads x head_dim`, fp32 or int8 (an int8 row's
/// dot products times its key scale, its weights times its value scale). A row with no valid
/// column gets zeros.
#[allow(clippy::too_many_arguments)]
pub fn decode_attention(
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
    let parts = AttnParts {
        shape,
        q,
        slots,
        valid,
        scale,
        threads,
    };
    match cache {
        KvRows::F32 { k, v } => attend(&parts, k, v, None, out),
        KvRows::Int8 {
            k,
            v,
            k_scale,
            v_scale,
        } => attend(&parts, k, v, Some((k_scale, v_scale)), out),
    }
    Ok(())
}

/// One checked call's inputs besides the cache.
struct AttnParts<'a> {
    shape: AttnShape,
    q: &'a [f32],
    slots: &'a [i64],
    valid: Option<&'a [u8]>,
    scale: f32,
    threads: usize,
}

/// The attention of a checked call over rows of `T` (`scales`: each key and value row's factor;
/// None: 1).
fn attend<T: KvElem>(
    parts: &AttnParts<'_>,
    k: &[T],
    v: &[T],
    scales: Option<(&[f32], &[f32])>,
    out: &mut [f32],
) {
    let AttnParts {
        shape,
        q,
        slots,
        valid,
        scale,
        threads,
    } = *parts;
    let (rows, heads, kv_heads) = (shape.rows, shape.heads, shape.kv_heads);
    let (d, keys) = (shape.head_dim, shape.keys);
    let group = heads / kv_heads;
    // A task unit is `sub` query heads of one kv head: each key and value is read once for
    // all of them (16 heads share one latent row in MLA, 2-8 share a kv head in GQA). A
    // group is cut into parts only to give every thread a unit.
    let sub = heads_per_unit(group, rows * kv_heads, threads::resolve(threads));
    let units = rows * heads / sub;
    // bytes of K and V the units read
    let tasks = threads::plan(units, units * keys * d * 8, threads);
    let ahead = |src: &[T], rows: &[usize], b: usize| {
        for &i in rows.get(4 * b + AHEAD..4 * b + AHEAD + 4).unwrap_or(&[]) {
            prefetch(row(src, i, d));
        }
    };
    let (k_scale, v_scale) = (scales.map(|s| s.0), scales.map(|s| s.1));
    let factor = |s: Option<&[f32]>, i: usize| s.map_or(1.0, |s| s[i]);
    let one = |unit: usize, o: &mut [f32]| {
        let (r, h0) = (unit * sub / heads, unit * sub % heads);
        let kvh = h0 / group;
        let qs = &q[(r * heads + h0) * d..(r * heads + h0 + sub) * d];
        let row_slots = &slots[r * keys..(r + 1) * keys];
        let row_valid = valid.map(|v| &v[r * keys..(r + 1) * keys]);
        // the cache rows of the valid columns, in column order
        let rows: Vec<usize> = row_slots
            .iter()
            .enumerate()
            .filter(|&(l, _)| row_valid.is_none_or(|v| v[l] != 0))
            .map(|(_, &slot)| slot as usize * kv_heads + kvh)
            .collect();
        let n = rows.len();
        o.fill(0.0);
        if n == 0 {
            return; // no valid column: zeros
        }
        // scores[j * n + c]: head h0 + j against the c-th valid key, four keys at a time; the
        // rows AHEAD keys on are prefetched
        let mut scores = vec![0f32; sub * n];
        let mut max = vec![f32::NEG_INFINITY; sub];
        for (b, idx) in rows.chunks(4).enumerate() {
            ahead(k, &rows, b);
            let keys4 = four(k, idx, d);
            for (j, (qv, m)) in qs.chunks_exact(d).zip(max.iter_mut()).enumerate() {
                let dots = T::dot4(qv, keys4);
                for (t, (&dot, &i)) in dots.iter().zip(idx).enumerate() {
                    let sc = dot * (factor(k_scale, i) * scale); // exactly `scale`: fp32 rows
                    scores[j * n + 4 * b + t] = sc;
                    *m = m.max(sc);
                }
            }
        }
        let mut inv = vec![0f32; sub];
        for (j, (&m, iv)) in max.iter().zip(inv.iter_mut()).enumerate() {
            let mut total = 0f64;
            for sc in scores[j * n..(j + 1) * n].iter_mut() {
                *sc = (*sc - m).exp();
                total += f64::from(*sc);
            }
            *iv = (1.0 / total) as f32;
        }
        for (b, idx) in rows.chunks(4).enumerate() {
            ahead(v, &rows, b);
            let values4 = four(v, idx, d);
            for (j, oj) in o.chunks_exact_mut(d).enumerate() {
                let mut p = [0f32; 4];
                for (t, (pt, &i)) in p.iter_mut().zip(idx).enumerate() {
                    *pt = scores[j * n + 4 * b + t] * inv[j] * factor(v_scale, i);
                }
                T::axpy4(p, values4, oj);
            }
        }
    };
    threads::for_chunks(tasks, threads, out, sub * d, |first, chunk| {
        for (i, o) in chunk.chunks_exact_mut(sub * d).enumerate() {
            one(first + i, o);
        }
    });
}

/// Row `i` (`slot * kv_heads + kv head`) of a cache of rows `d` long.
fn row<T>(src: &[T], i: usize, d: usize) -> &[T] {
    &src[i * d..(i + 1) * d]
}

/// Rows `idx` (1 to 4) as four: a shorter list repeats its first row (its results dropped).
fn four<'a, T>(src: &'a [T], idx: &[usize], d: usize) -> [&'a [T]; 4] {
    std::array::from_fn(|t| row(src, idx.get(t).copied().unwrap_or(idx[0]), d))
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
    use crate::ops::tests::seq;

    /// `decode_attention` against the formula in f64 (1e-5), and the same bits on 1 and 4
    /// threads (the units differ; each head's sums do not).
    fn check_decode_attention(shape: AttnShape, slots: &[i64], valid: Option<&[u8]>) {
        let (rows, heads, kv_heads) = (shape.rows, shape.heads, shape.kv_heads);
        let (d, keys) = (shape.head_dim, shape.keys);
        let slots_n = 1 + *slots.iter().max().unwrap() as usize;
        let (k, v) = (
            seq(slots_n * kv_heads * d, 6),
            seq(slots_n * kv_heads * d, 7),
        );
        let q = seq(rows * heads * d, 8);
        let mut first: Option<Vec<f32>> = None;
        for threads in [1, 2, 4] {
            let mut out = vec![1f32; q.len()];
            let cache = KvRows::F32 { k: &k, v: &v };
            decode_attention(shape, &q, cache, slots, valid, 0.25, &mut out, threads).unwrap();
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
        let cache = KvRows::F32 { k: &k, v: &v };
        assert!(decode_attention(shape, &q, cache, &bad, None, 1.0, &mut out, 1).is_err());
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
        let plain = KvRows::F32 { k: &kf, v: &vf };
        decode_attention(shape, &q, plain, &slots, Some(&valid), 0.3, &mut want, 1).unwrap();
        let cache = KvRows::Int8 {
            k: &k,
            v: &v,
            k_scale: &ks,
            v_scale: &vs,
        };
        let mut got = vec![0f32; q.len()];
        decode_attention(shape, &q, cache, &slots, Some(&valid), 0.3, &mut got, 2).unwrap();
        for (a, b) in got.iter().zip(&want) {
            assert!((a - b).abs() <= 1e-5 * (1.0 + b.abs()), "{a} vs {b}");
        }
        let short = KvRows::Int8 {
            k: &k,
            v: &v,
            k_scale: &ks[1..],
            v_scale: &vs[1..],
        };
        assert!(decode_attention(shape, &q, short, &slots, None, 0.3, &mut got, 1).is_err());
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
