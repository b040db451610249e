//! Quantized CPU matmul: `out[i, r] = sum_c x[i, c] * W[r, c]` with `W` kept in its GGUF block
//! encoding and `x` in fp32.
//!
//! - [`blocks`]: the block layouts and scalar decoders (the portable path, and the oracle of the
//!   SIMD path in the unit tests).
//! - [`kernel`]: one weight row against up to [`kernel::MAX_NX`] rows of `x` at a time, so each
//!   block is decoded once per group of activation rows (prefill amortises the decode).
//!   Compiled twice: portable, and for AVX2/FMA/F16C (LLVM vectorises the same safe code).
//! - [`simd`]: hand-written AVX2/FMA kernels for the hot types (Q4_K, Q6_K, Q8_0, ...), which
//!   decode in registers (`simd::int`: the integer-product ones, and `simd::int::wide` their
//!   AVX-512 VNNI forms); the only module here with `unsafe`.
//! - [`threads`]: the persistent worker pools, one per thread count, and the split by rows;
//!   [`pool`]: the pool itself (the caller works too; idle workers poll briefly, then sleep).
//!
//! The instruction set is chosen once at run time ([`Isa::detect`]). Weights are never copied
//! to fp32 as a whole: each block is decoded into registers or a stack buffer of at most
//! [`blocks::QK_K`] floats right before its products. Accumulation is fp32, in 8 lanes, except
//! where [`rounds_activations`] says the AVX2 kernel takes integer products against the
//! activations as two int8 digits per 32-block (Q8_0, Q4_1, Q5_1, Q4_K, Q6_K: `simd::int`,
//! faster than decoding to fp32, at an error bounded by the rounding).

pub mod blocks;
pub mod fp8;
pub mod iq;
pub mod kernel;
pub mod pool;
pub mod simd;
pub mod threads;

pub use blocks::QType;

use crate::error::{CoreError, Result};

/// [`Isa::set_auto`]'s choice: 0 none (detect), 1 portable, 2 AVX2, 3 AVX-512.
static AUTO: std::sync::atomic::AtomicU8 = std::sync::atomic::AtomicU8::new(0);

/// Which kernel family runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Isa {
    /// Safe Rust, compiled for the baseline target.
    Portable,
    /// AVX2 + FMA + F16C (x86-64 only).
    Avx2,
    /// AVX2's set plus AVX-512 F, BW, VL and VNNI: the integer kernels 32 lanes wide, the
    /// other types as `Avx2` runs them.
    Avx512,
}

impl Isa {
    /// The best family this CPU runs, detected once.
    pub fn detect() -> Isa {
        static DETECTED: std::sync::OnceLock<Isa> = std::sync::OnceLock::new();
        *DETECTED.get_or_init(|| {
            if simd::avx512_available() {
                Isa::Avx512
            } else if simd::avx2_available() {
                Isa::Avx2
            } else {
                Isa::Portable
            }
        })
    }

    /// The family `"auto"` runs in this process: the one [`Isa::set_auto`] chose (a host whose
    /// measurement says another family is faster, `ftrs doctor`), else [`Isa::detect`]'s.
    pub fn auto() -> Isa {
        match AUTO.load(std::sync::atomic::Ordering::Relaxed) {
            1 => Isa::Portable,
            2 => Isa::Avx2,
            3 => Isa::Avx512,
            _ => Isa::detect(),
        }
    }

    /// Makes `"auto"` mean `isa` in this process (None: [`Isa::detect`]'s again). Process-wide,
    /// as the kernels' thread count is; a call already running keeps its family.
    pub fn set_auto(isa: Option<Isa>) {
        let code = match isa {
            None => 0,
            Some(Isa::Portable) => 1,
            Some(Isa::Avx2) => 2,
            Some(Isa::Avx512) => 3,
        };
        AUTO.store(code, std::sync::atomic::Ordering::Relaxed);
    }

    /// Parses `"auto"`, `"portable"`, `"avx2"` or `"avx512"`; a family this CPU lacks is a
    /// `Config` error.
    pub fn parse(name: &str) -> Result<Isa> {
        match name {
            "auto" => Ok(Isa::auto()),
            "portable" => Ok(Isa::Portable),
            "avx2" if simd::avx2_available() => Ok(Isa::Avx2),
            "avx2" => Err(CoreError::Config(
                "kernel \"avx2\" requested but this CPU lacks AVX2/FMA/F16C".into(),
            )),
            "avx512" if simd::avx512_available() => Ok(Isa::Avx512),
            "avx512" => Err(CoreError::Config(
                "kernel \"avx512\" requested but this CPU lacks AVX-512 F/BW/VL/VNNI \
                 (or AVX2/FMA/F16C)"
                    .into(),
            )),
            other => Err(CoreError::Config(format!(
                "unknown kernel {other:?}: expected auto, portable, avx2 or avx512"
            ))),
        }
    }

    /// The name [`Isa::parse`] reads.
    pub fn name(self) -> &'static str {
        match self {
            Isa::Portable => "portable",
            Isa::Avx2 => "avx2",
            Isa::Avx512 => "avx512",
        }
    }

    /// The families this CPU runs, plainest first.
    pub fn available() -> Vec<Isa> {
        let mut all = vec![Isa::Portable];
        if simd::avx2_available() {
            all.push(Isa::Avx2);
        }
        if simd::avx512_available() {
            all.push(Isa::Avx512);
        }
        all
    }
}

/// Whether the kernels of `isa` round the activations per 32-element block for type `t`:
/// integer products against x as two int8 digits (`x = d/254 (254 q + r)`, a 15-bit value; one
/// digit, as ggml's q8 dot products use, flips greedy tokens of small models). The result then
/// differs from the fp32 dot by at most `sum over blocks of max|x| / 64516 * sum |w - min|`
/// (Q2_K: `sum |w|`, its mins meet the rounded activations of their 16 values).
pub fn rounds_activations(t: QType, isa: Isa) -> bool {
    matches!(isa, Isa::Avx2 | Isa::Avx512) && has_integer_kernel(t)
}

/// Whether `t` has an integer kernel on AVX2 (`simd::int`; some also on AVX-512).
pub(crate) fn has_integer_kernel(t: QType) -> bool {
    matches!(
        t,
        QType::Q8_0
            | QType::Q4_1
            | QType::Q5_1
            | QType::Q2K
            | QType::Q3K
            | QType::Q4K
            | QType::Q5K
            | QType::Q6K
            | QType::Mxfp4
            | QType::Iq4Nl
            | QType::Iq4Xs
            | QType::Nvfp4
            | QType::Iq1S
            | QType::Iq1M
            | QType::Iq2Xxs
            | QType::Iq2Xs
            | QType::Iq2S
            | QType::Iq3Xxs
            | QType::Iq3S
    )
}

/// Bytes of one encoded row of `cols` weights; `cols` must be a positive multiple of the block.
pub fn row_bytes(t: QType, cols: usize) -> Result<usize> {
    let (be, bb) = t.block_info();
    if cols == 0 || !cols.is_multiple_of(be) {
        return Err(CoreError::Config(format!(
            "{}: cols = {cols} must be a positive multiple of the block size {be}",
            t.name()
        )));
    }
    Ok(cols / be * bb)
}

/// Checks the weight bytes against `rows x cols` of type `t` (its rows, then the type's tail,
/// [`QType::tail_bytes`]); returns bytes per row.
fn check_weight(t: QType, weight: &[u8], rows: usize, cols: usize) -> Result<usize> {
    let rb = row_bytes(t, cols)?;
    if rows == 0 {
        return Err(CoreError::Config(format!(
            "{}: rows must be positive",
            t.name()
        )));
    }
    let want = rows
        .checked_mul(rb)
        .and_then(|b| b.checked_add(t.tail_bytes()))
        .ok_or_else(|| CoreError::Config(format!("{}: {rows} x {cols} overflows", t.name())))?;
    if weight.len() != want {
        let (be, bb) = t.block_info();
        let tail = match t.tail_bytes() {
            0 => String::new(),
            n => format!(" + {n} B tensor scale"),
        };
        return Err(CoreError::Config(format!(
            "{} weight of {rows} x {cols}: expected {want} bytes ({rows} rows x {} blocks x {bb} B \
             per {be}-element block{tail}), got {}",
            t.name(),
            cols / be,
            weight.len()
        )));
    }
    Ok(rb)
}

/// A checked weight's rows, and the scale its tail holds (1 without one).
fn rows_and_scale(t: QType, weight: &[u8], rows: usize, rb: usize) -> (&[u8], f32) {
    let (body, tail) = weight.split_at(rows * rb);
    match t.tail_bytes() {
        4 => (
            body,
            f32::from_le_bytes([tail[0], tail[1], tail[2], tail[3]]),
        ),
        _ => (body, 1.0),
    }
}

/// Multiplies every value by a tensor's scale (none when it is 1: the other types).
fn apply_scale(out: &mut [f32], scale: f32) {
    if scale != 1.0 {
        out.iter_mut().for_each(|v| *v *= scale);
    }
}

/// Checks an FFN's weights: `gate` and `up` `inter x hidden`, `down` `hidden x inter`.
pub fn check_ffn(
    gate: (QType, &[u8]),
    up: (QType, &[u8]),
    down: (QType, &[u8]),
    hidden: usize,
    inter: usize,
) -> Result<()> {
    check_weight(gate.0, gate.1, inter, hidden)?;
    check_weight(up.0, up.1, inter, hidden)?;
    check_weight(down.0, down.1, hidden, inter)?;
    Ok(())
}

/// `out[i * rows + r] = sum_c x[i * cols + c] * W[r, c]` for `n = x.len() / cols` rows of `x`.
///
/// `weight` holds `rows` rows of `cols` weights of type `t`, each as GGUF stores it, then the
/// type's tail (NVFP4: the tensor scale, which multiplies every result). `threads`
/// = 0 uses [`threads::default_threads`]. Sizes are checked first: a mismatch is a `Config`
/// error saying what was expected, and nothing is written.
#[allow(clippy::too_many_arguments)]
pub fn matmul(
    t: QType,
    weight: &[u8],
    x: &[f32],
    out: &mut [f32],
    rows: usize,
    cols: usize,
    threads: usize,
    isa: Isa,
) -> Result<()> {
    let rb = check_weight(t, weight, rows, cols)?;
    let n = check_x_out(x, out, rows, cols)?;
    let (body, scale) = rows_and_scale(t, weight, rows, rb);
    by_rows(body, rb, rows, n, threads, out, |w, o| {
        kernel::rows(t, isa, w, x, n, cols, o)
    });
    apply_scale(out, scale);
    Ok(())
}

/// One weight of [`matmuls`]: its type, bytes, output (`n x rows`) and row count.
pub type MatmulJob<'a> = (QType, &'a [u8], &'a mut [f32], usize);

/// Several matmuls of the one `x` (a layer's q, k and v projections): `out = x @ W.T` for each
/// job, as [`matmul`] computes it, in one call. Every job's sizes are checked before any is
/// run, so a mismatch is a `Config` error and no `out` is written.
pub fn matmuls(
    x: &[f32],
    jobs: &mut [MatmulJob<'_>],
    cols: usize,
    threads: usize,
    isa: Isa,
) -> Result<()> {
    for (t, w, o, rows) in jobs.iter() {
        check_weight(*t, w, *rows, cols)?;
        check_x_out(x, o, *rows, cols)?;
    }
    for (t, w, o, rows) in jobs.iter_mut() {
        matmul(*t, w, x, o, *rows, cols, threads, isa)?;
    }
    Ok(())
}

/// Checks `x` (n x cols, n >= 1) and `out` (n x rows) of a matmul; returns n.
fn check_x_out(x: &[f32], out: &[f32], rows: usize, cols: usize) -> Result<usize> {
    if x.is_empty() || !x.len().is_multiple_of(cols) {
        return Err(CoreError::Config(format!(
            "x has {} floats: expected n x {cols} with n >= 1",
            x.len()
        )));
    }
    let n = x.len() / cols;
    if out.len() != n * rows {
        return Err(CoreError::Config(format!(
            "out has {} floats: expected n x rows = {n} x {rows} = {}",
            out.len(),
            n * rows
        )));
    }
    Ok(n)
}

/// Runs `run(weight rows, their n results each)` over runs of whole rows of `weight` (`rb`
/// bytes a row) on the kernels' threads, and writes `out` as [i][row]: `run` writes one row's
/// n results together ([row][i]).
fn by_rows<F>(
    weight: &[u8],
    rb: usize,
    rows: usize,
    n: usize,
    threads: usize,
    out: &mut [f32],
    run: F,
) where
    F: Fn(&[u8], &mut [f32]) + Sync,
{
    let work = weight.len().saturating_mul(n.min(kernel::MAX_NX));
    let tasks = threads::plan(rows, work, threads);
    if n == 1 {
        threads::for_row_chunks(tasks, rows, threads, weight, rb, out, 1, run);
    } else {
        let mut tmp = vec![0f32; rows * n];
        threads::for_row_chunks(tasks, rows, threads, weight, rb, &mut tmp, n, run);
        for (r, vals) in tmp.chunks_exact(n).enumerate() {
            for (i, &v) in vals.iter().enumerate() {
                out[i * rows + r] = v;
            }
        }
    }
}

/// One expert's SiLU FFN: `out[i] = down @ (silu(gate @ x[i]) * (up @ x[i]))` for the `n = x.len()
/// / hidden` rows of `x`, in one call (a decode step makes three kernel calls and two
/// elementwise passes per expert otherwise).
///
/// `gate` and `up` are `inter x hidden`, `down` is `hidden x inter`, each `(type, bytes)` as
/// [`matmul`] reads it; `silu(g) = g / (1 + exp(-g))` in fp32. Every size is checked before any
/// work: a mismatch is a `Config` error and `out` is not written.
#[allow(clippy::too_many_arguments)]
pub fn expert_ffn(
    gate: (QType, &[u8]),
    up: (QType, &[u8]),
    down: (QType, &[u8]),
    x: &[f32],
    out: &mut [f32],
    hidden: usize,
    inter: usize,
    threads: usize,
    isa: Isa,
) -> Result<()> {
    check_ffn(gate, up, down, hidden, inter)?;
    if x.is_empty() || !x.len().is_multiple_of(hidden) || out.len() != x.len() {
        return Err(CoreError::Config(format!(
            "expert FFN: x has {} floats and out {}: expected the same n x {hidden}, n >= 1",
            x.len(),
            out.len()
        )));
    }
    let n = x.len() / hidden;
    let mut g = vec![0f32; n * inter];
    let mut u = vec![0f32; n * inter];
    matmul(gate.0, gate.1, x, &mut g, inter, hidden, threads, isa)?;
    matmul(up.0, up.1, x, &mut u, inter, hidden, threads, isa)?;
    for (gv, &uv) in g.iter_mut().zip(&u) {
        *gv = *gv / (1.0 + (-*gv).exp()) * uv;
    }
    matmul(down.0, down.1, &g, out, hidden, inter, threads, isa)
}

/// One routed expert of a MoE layer for [`experts_ffn`]: its three weights as
/// [`expert_ffn`] reads them, the rows of `x` routed to it (ascending) and each row's router
/// weight.
#[derive(Clone, Copy)]
pub struct RoutedExpert<'a> {
    pub gate: (QType, &'a [u8]),
    pub up: (QType, &'a [u8]),
    pub down: (QType, &'a [u8]),
    pub rows: &'a [usize],
    pub weights: &'a [f32],
}

/// One expert's share of a router's top-k choice: the rows routed to it (ascending) and each
/// row's router weight.
#[derive(Debug, Clone, PartialEq)]
pub struct Route {
    pub expert: usize,
    pub rows: Vec<usize>,
    pub weights: Vec<f32>,
}

/// Groups a router's choice, `ids` and `weights` (`tokens x k`, row-major), by expert, in
/// ascending expert id: the order every strategy adds the experts' outputs in. An id at or
/// above `num_experts` is a `Config` error.
pub fn group_routes(
    ids: &[i64],
    weights: &[f32],
    k: usize,
    num_experts: usize,
) -> Result<Vec<Route>> {
    if k == 0 || ids.len() != weights.len() || !ids.len().is_multiple_of(k) {
        return Err(CoreError::Config(format!(
            "routes: {} ids and {} weights: expected the same tokens x {k}",
            ids.len(),
            weights.len()
        )));
    }
    let mut by: Vec<Option<Route>> = vec![None; num_experts];
    for (i, (&e, &w)) in ids.iter().zip(weights).enumerate() {
        let slot = usize::try_from(e)
            .ok()
            .and_then(|e| by.get_mut(e))
            .ok_or_else(|| {
                CoreError::Config(format!("routes: expert {e} of a layer of {num_experts}"))
            })?;
        let r = slot.get_or_insert_with(|| Route {
            expert: usize::try_from(e).unwrap_or_default(),
            rows: Vec::new(),
            weights: Vec::new(),
        });
        r.rows.push(i / k);
        r.weights.push(w);
    }
    Ok(by.into_iter().flatten().collect())
}

/// A MoE layer's routed experts in one call: for each expert in the order given,
/// `y = expert_ffn(x[rows])`, then `out[rows[j]] += y[j] * weights[j]` (the product rounded to
/// fp32, then one add: what `layers.moe` does in torch, so the sums agree bit for bit when the
/// experts come in the same order). Everything is checked before any work: a mismatch is a
/// `Config` error and `out` is not written.
#[allow(clippy::too_many_arguments)]
pub fn experts_ffn(
    experts: &[RoutedExpert<'_>],
    x: &[f32],
    out: &mut [f32],
    hidden: usize,
    inter: usize,
    threads: usize,
    isa: Isa,
) -> Result<()> {
    if hidden == 0 || !x.len().is_multiple_of(hidden) || out.len() != x.len() {
        return Err(CoreError::Config(format!(
            "routed experts: x has {} floats and out {}: expected the same n x {hidden}",
            x.len(),
            out.len()
        )));
    }
    let n = x.len() / hidden;
    for (k, e) in experts.iter().enumerate() {
        check_ffn(e.gate, e.up, e.down, hidden, inter)?;
        if e.rows.is_empty() || e.rows.len() != e.weights.len() {
            return Err(CoreError::Config(format!(
                "routed expert {k}: {} rows and {} weights: expected the same number, >= 1",
                e.rows.len(),
                e.weights.len()
            )));
        }
        if let Some(&r) = e.rows.iter().find(|&&r| r >= n) {
            return Err(CoreError::Config(format!(
                "routed expert {k}: row {r} of x, which has {n} rows"
            )));
        }
    }
    let mut gathered = Vec::new();
    for e in experts {
        let all = e.rows.len() == n && e.rows.iter().enumerate().all(|(j, &r)| j == r);
        let xe: &[f32] = if all {
            x
        } else {
            gathered.clear();
            for &r in e.rows {
                gathered.extend_from_slice(&x[r * hidden..(r + 1) * hidden]);
            }
            &gathered
        };
        let mut y = vec![0f32; xe.len()];
        expert_ffn(
            e.gate, e.up, e.down, xe, &mut y, hidden, inter, threads, isa,
        )?;
        for ((&r, &w), yr) in e.rows.iter().zip(e.weights).zip(y.chunks_exact(hidden)) {
            for (o, &v) in out[r * hidden..(r + 1) * hidden].iter_mut().zip(yr) {
                let p = v * w;
                *o += p;
            }
        }
    }
    Ok(())
}

/// Decodes `rows x cols` weights of type `t` into `out` (fp32, row-major), bit-equal to the
/// GGUF reference dequantizer. Sizes are checked as in [`matmul`].
pub fn dequantize(
    t: QType,
    weight: &[u8],
    out: &mut [f32],
    rows: usize,
    cols: usize,
    threads: usize,
) -> Result<()> {
    let rb = check_weight(t, weight, rows, cols)?;
    if out.len() != rows * cols {
        return Err(CoreError::Config(format!(
            "out has {} floats: expected rows x cols = {rows} x {cols} = {}",
            out.len(),
            rows * cols
        )));
    }
    let (body, scale) = rows_and_scale(t, weight, rows, rb);
    let tasks = threads::plan(rows, body.len(), threads);
    threads::for_row_chunks(tasks, rows, threads, body, rb, out, cols, |w, o| {
        kernel::decode_span(t, w, o)
    });
    apply_scale(out, scale);
    Ok(())
}

#[cfg(test)]
mod tests;
