//! The fp32 decode-step ops of `ftrs_core::ops` for Python: `ops_rms_norm`, `ops_rotary`,
//! `ops_decode_attention` (over an fp32 or an int8 KV cache), `ops_kv_write_int8`.
//!
//! As in `quant.rs`: buffers are C-contiguous numpy views of torch tensors, borrowed, never
//! copied; every output is checked writable and disjoint from every other buffer of the call;
//! the ops run with the GIL released.

use ftrs_core::ops::{self, AttnShape, KvRows};
use pyo3::buffer::PyBuffer;
use pyo3::prelude::*;

use crate::buffers::{buffer, check_disjoint, config, slice, slice_mut, span};
use crate::errors::CoreResultExt;

/// `out = rms_norm(x)`, or with `residual`: `residual_out = residual + x`, `out =
/// rms_norm(residual_out)`; rows of `weight.len()` floats.
#[pyfunction]
#[pyo3(signature = (x, weight, eps, out, residual = None, residual_out = None))]
pub fn ops_rms_norm(
    py: Python<'_>,
    x: &Bound<'_, PyAny>,
    weight: &Bound<'_, PyAny>,
    eps: f32,
    out: &Bound<'_, PyAny>,
    residual: Option<&Bound<'_, PyAny>>,
    residual_out: Option<&Bound<'_, PyAny>>,
) -> PyResult<()> {
    let xb = buffer::<f32>(x, "x", "float32", false)?;
    let wb = buffer::<f32>(weight, "weight", "float32", false)?;
    let ob = buffer::<f32>(out, "out", "float32", true)?;
    let res = match (residual, residual_out) {
        (None, None) => None,
        (Some(r), Some(ro)) => Some((
            buffer::<f32>(r, "residual", "float32", false)?,
            buffer::<f32>(ro, "residual_out", "float32", true)?,
        )),
        _ => {
            return Err(crate::buffers::config(
                "rms_norm: residual and residual_out come together".into(),
            ))
        }
    };
    let (xs, ws, o) = (span(&xb), span(&wb), span(&ob));
    let mut inputs = vec![(xs.0, xs.1, "x"), (ws.0, ws.1, "weight")];
    let rs = res.as_ref().map(|(r, ro)| (span(r), span(ro)));
    if let Some((r, ro)) = rs {
        inputs.push((r.0, r.1, "residual"));
        check_disjoint(ro, &inputs)?;
        inputs.push((ro.0, ro.1, "residual_out"));
    }
    check_disjoint(o, &inputs)?;
    py.detach(|| {
        #[allow(unsafe_code)]
        // SAFETY: every buffer stays exported until this function returns (xb, wb, ob, res
        // live past the closure); out and residual_out were checked writable and disjoint
        // from every other buffer of the call; all are f32 buffers PyBuffer::get checked.
        let (xs, ws, o, r) = unsafe {
            (
                slice::<f32>(xs.0, xs.1),
                slice::<f32>(ws.0, ws.1),
                slice_mut::<f32>(o.0, o.1),
                rs.map(|(r, ro)| (slice::<f32>(r.0, r.1), slice_mut::<f32>(ro.0, ro.1))),
            )
        };
        ops::rms_norm(xs, r, ws, eps, o)
    })
    .py()?;
    drop((xb, wb, ob, res));
    Ok(())
}

/// Rotates `q` (tokens x heads x head_dim) and `k` (tokens x kv_heads x head_dim) in place by
/// the rows `positions` (int64) of the `cos` / `sin` tables (max_positions x head_dim).
#[pyfunction]
pub fn ops_rotary(
    py: Python<'_>,
    q: &Bound<'_, PyAny>,
    k: &Bound<'_, PyAny>,
    head_dim: usize,
    cos: &Bound<'_, PyAny>,
    sin: &Bound<'_, PyAny>,
    positions: &Bound<'_, PyAny>,
) -> PyResult<()> {
    let qb = buffer::<f32>(q, "q", "float32", true)?;
    let kb = buffer::<f32>(k, "k", "float32", true)?;
    let cb = buffer::<f32>(cos, "cos", "float32", false)?;
    let sb = buffer::<f32>(sin, "sin", "float32", false)?;
    let pb = buffer::<i64>(positions, "positions", "int64", false)?;
    let (qs, ks, cs, ss, ps) = (span(&qb), span(&kb), span(&cb), span(&sb), span(&pb));
    let tables = [
        (cs.0, cs.1, "cos"),
        (ss.0, ss.1, "sin"),
        (ps.0, ps.1, "positions"),
    ];
    check_disjoint(qs, &tables)?;
    check_disjoint(ks, &tables)?;
    check_disjoint(ks, &[(qs.0, qs.1, "q")])?;
    py.detach(|| {
        #[allow(unsafe_code)]
        // SAFETY: as in ops_rms_norm: the five buffers stay exported for the call; q and k are
        // writable and disjoint from each other and from the three read-only buffers.
        let (q, k, c, s, p) = unsafe {
            (
                slice_mut::<f32>(qs.0, qs.1),
                slice_mut::<f32>(ks.0, ks.1),
                slice::<f32>(cs.0, cs.1),
                slice::<f32>(ss.0, ss.1),
                slice::<i64>(ps.0, ps.1),
            )
        };
        ops::rotary(q, k, head_dim, c, s, p)
    })
    .py()?;
    drop((qb, kb, cb, sb, pb));
    Ok(())
}

/// Writes `x` (float32, tokens x kv_heads x head_dim) into an int8 KV cache at `slots` (int64,
/// one per token): `cache` (int8, slots x kv_heads x head_dim) and `scales` (float32, slots x
/// kv_heads), both written in place.
#[pyfunction]
pub fn ops_kv_write_int8(
    py: Python<'_>,
    x: &Bound<'_, PyAny>,
    slots: &Bound<'_, PyAny>,
    kv_heads: usize,
    cache: &Bound<'_, PyAny>,
    scales: &Bound<'_, PyAny>,
) -> PyResult<()> {
    let xb = buffer::<f32>(x, "x", "float32", false)?;
    let rb = buffer::<i64>(slots, "slots", "int64", false)?;
    let cb = buffer::<i8>(cache, "cache", "int8", true)?;
    let sb = buffer::<f32>(scales, "scales", "float32", true)?;
    let (xs, rs, cs, ss) = (span(&xb), span(&rb), span(&cb), span(&sb));
    let inputs = [(xs.0, xs.1, "x"), (rs.0, rs.1, "slots")];
    check_disjoint(cs, &inputs)?;
    check_disjoint(ss, &inputs)?;
    check_disjoint(ss, &[(cs.0, cs.1, "cache")])?;
    py.detach(|| {
        #[allow(unsafe_code)]
        // SAFETY: as in ops_rms_norm: the four buffers stay exported for the call; cache and
        // scales are writable and disjoint from each other and from x and slots.
        let (x, r, c, s) = unsafe {
            (
                slice::<f32>(xs.0, xs.1),
                slice::<i64>(rs.0, rs.1),
                slice_mut::<i8>(cs.0, cs.1),
                slice_mut::<f32>(ss.0, ss.1),
            )
        };
        ops::kv_write_int8(x, r, kv_heads, c, s)
    })
    .py()?;
    drop((xb, rb, cb, sb));
    Ok(())
}

/// Decode attention of `q` (rows x heads x head_dim) over the caches' `slots` (rows x keys,
/// int64), `valid` (rows x keys, uint8: a bool mask's bytes, nonzero where a key is real);
/// writes `out` like `q`. The caches are float32, or int8 with `k_scale` and `v_scale` (float32,
/// one per slot and kv head).
#[pyfunction]
#[pyo3(signature = (q, k_cache, v_cache, slots, valid, scale, out, heads, kv_heads, head_dim,
                    threads = 0, k_scale = None, v_scale = None))]
#[allow(clippy::too_many_arguments)]
pub fn ops_decode_attention(
    py: Python<'_>,
    q: &Bound<'_, PyAny>,
    k_cache: &Bound<'_, PyAny>,
    v_cache: &Bound<'_, PyAny>,
    slots: &Bound<'_, PyAny>,
    valid: Option<&Bound<'_, PyAny>>,
    scale: f32,
    out: &Bound<'_, PyAny>,
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
    threads: usize,
    k_scale: Option<&Bound<'_, PyAny>>,
    v_scale: Option<&Bound<'_, PyAny>>,
) -> PyResult<()> {
    let int8 = match (k_scale, v_scale) {
        (Some(a), Some(b)) => Some((
            buffer::<f32>(a, "k_scale", "float32", false)?,
            buffer::<f32>(b, "v_scale", "float32", false)?,
        )),
        (None, None) => None,
        _ => {
            return Err(config(
                "decode attention: give both k_scale and v_scale, or neither".into(),
            ))
        }
    };
    let qb = buffer::<f32>(q, "q", "float32", false)?;
    // the caches' bytes: float32 elements, or int8 ones beside their scales
    let (kb, vb) = if int8.is_some() {
        (
            Caches::I8(buffer::<i8>(k_cache, "k_cache", "int8", false)?),
            Caches::I8(buffer::<i8>(v_cache, "v_cache", "int8", false)?),
        )
    } else {
        (
            Caches::F32(buffer::<f32>(k_cache, "k_cache", "float32", false)?),
            Caches::F32(buffer::<f32>(v_cache, "v_cache", "float32", false)?),
        )
    };
    let sb = buffer::<i64>(slots, "slots", "int64", false)?;
    let mb = valid
        .map(|v| buffer::<u8>(v, "valid", "uint8", false))
        .transpose()?;
    let ob = buffer::<f32>(out, "out", "float32", true)?;
    let (qs, ks, vs, ss, os) = (span(&qb), kb.span(), vb.span(), span(&sb), span(&ob));
    let ms = mb.as_ref().map(span);
    let scs = int8.as_ref().map(|(a, b)| (span(a), span(b)));
    let mut inputs = vec![
        (qs.0, qs.1, "q"),
        (ks.0, ks.1, "k_cache"),
        (vs.0, vs.1, "v_cache"),
        (ss.0, ss.1, "slots"),
    ];
    if let Some(m) = ms {
        inputs.push((m.0, m.1, "valid"));
    }
    if let Some((a, b)) = scs {
        inputs.push((a.0, a.1, "k_scale"));
        inputs.push((b.0, b.1, "v_scale"));
    }
    check_disjoint(os, &inputs)?;
    let rows = (qs.1 / 4).checked_div(heads * head_dim).unwrap_or(0);
    let keys = (ss.1 / 8).checked_div(rows).unwrap_or(0);
    let shape = AttnShape {
        rows,
        heads,
        kv_heads,
        head_dim,
        keys,
    };
    py.detach(|| {
        #[allow(unsafe_code)]
        // SAFETY: as in ops_rms_norm: every buffer stays exported for the call; out is
        // writable and disjoint from the read-only buffers; each span's element type is the
        // one its buffer was checked for (int8 caches exactly when scales were given).
        let (q, cache, s, m, o) = unsafe {
            let cache = match scs {
                Some((a, b)) => KvRows::Int8 {
                    k: slice::<i8>(ks.0, ks.1),
                    v: slice::<i8>(vs.0, vs.1),
                    k_scale: slice::<f32>(a.0, a.1),
                    v_scale: slice::<f32>(b.0, b.1),
                },
                None => KvRows::F32 {
                    k: slice::<f32>(ks.0, ks.1),
                    v: slice::<f32>(vs.0, vs.1),
                },
            };
            (
                slice::<f32>(qs.0, qs.1),
                cache,
                slice::<i64>(ss.0, ss.1),
                ms.map(|m| slice::<u8>(m.0, m.1)),
                slice_mut::<f32>(os.0, os.1),
            )
        };
        ops::decode_attention(shape, q, cache, s, m, scale, o, threads)
    })
    .py()?;
    drop((qb, kb, vb, sb, mb, ob, int8));
    Ok(())
}

/// A cache's exported buffer, of either element type.
enum Caches {
    F32(PyBuffer<f32>),
    I8(PyBuffer<i8>),
}

impl Caches {
    fn span(&self) -> (usize, usize) {
        match self {
            Caches::F32(b) => span(b),
            Caches::I8(b) => span(b),
        }
    }
}

/// Adds this module's functions to `ftrs._core`.
pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(ops_rms_norm, m)?)?;
    m.add_function(wrap_pyfunction!(ops_rotary, m)?)?;
    m.add_function(wrap_pyfunction!(ops_decode_attention, m)?)?;
    m.add_function(wrap_pyfunction!(ops_kv_write_int8, m)?)?;
    Ok(())
}
