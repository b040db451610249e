//! The quantized CPU kernels of `ftrs_core::quant` for Python: `quant_matmul`, `quant_matmuls`,
//! `quant_fp8_matmul`, `quant_expert_ffn`, `quant_experts_ffn` (a MoE layer's routed experts), `quant_dequantize`, `quant_block_info` and the thread setting.
//!
//! Buffers are borrowed, never copied: the weight is any C-contiguous buffer (read as bytes),
//! `x` and `out` C-contiguous float32 buffers (numpy arrays, `torch_tensor.numpy()`, memoryviews
//! of the expert pool). The kernels run with the GIL released; the Python objects stay
//! referenced (and their buffers exported, so they cannot be resized) until the call returns.
//! `out` must not overlap the weight or `x`. As with numpy's own GIL-free loops, another
//! Python thread writing these buffers during the call is the caller's bug.

use ftrs_core::quant::{self, threads, Isa, QType};
use pyo3::buffer::PyBuffer;
use pyo3::prelude::*;

use crate::buffers::{buffer, check_disjoint, slice, slice_mut, span, weight_bytes};
use crate::errors::CoreResultExt;

/// `out[i, r] = sum_c x[i, c] * W[r, c]` with W `rows x cols` of GGUF type `qtype`.
#[pyfunction]
#[pyo3(signature = (qtype, weight, x, out, rows, cols, threads = 0, kernel = "auto"))]
#[allow(clippy::too_many_arguments)]
pub fn quant_matmul(
    py: Python<'_>,
    qtype: &str,
    weight: &Bound<'_, PyAny>,
    x: &Bound<'_, PyAny>,
    out: &Bound<'_, PyAny>,
    rows: usize,
    cols: usize,
    threads: usize,
    kernel: &str,
) -> PyResult<()> {
    let t = QType::parse(qtype).py()?;
    let isa = Isa::parse(kernel).py()?;
    with_matmul_buffers(py, weight, x, out, |w, xs, o| {
        quant::matmul(t, w, xs, o, rows, cols, threads, isa)
    })
}

/// Borrows a matmul's weight bytes, `x` and `out` (f32, out writable and disjoint from the
/// other two) and runs `f` on them with the GIL released.
fn with_matmul_buffers<F>(
    py: Python<'_>,
    weight: &Bound<'_, PyAny>,
    x: &Bound<'_, PyAny>,
    out: &Bound<'_, PyAny>,
    f: F,
) -> PyResult<()>
where
    F: FnOnce(&[u8], &[f32], &mut [f32]) -> ftrs_core::error::Result<()> + Send,
{
    let wb = weight_bytes(py, weight)?;
    let xb = buffer::<f32>(x, "x", "float32", false)?;
    let ob = buffer::<f32>(out, "out", "float32", true)?;
    let (w, xs, o) = (span(&wb), span(&xb), span(&ob));
    check_disjoint(o, &[(w.0, w.1, "weight"), (xs.0, xs.1, "x")])?;
    py.detach(|| {
        #[allow(unsafe_code)]
        // SAFETY: the three buffers stay exported until this function returns (wb, xb, ob live
        // past the closure); out was checked writable and disjoint from weight and x; x and
        // out are f32 buffers PyBuffer::get checked for format and alignment.
        let (w, xs, o) = unsafe {
            (
                slice::<u8>(w.0, w.1),
                slice::<f32>(xs.0, xs.1),
                slice_mut::<f32>(o.0, o.1),
            )
        };
        f(w, xs, o)
    })
    .py()?;
    drop((wb, xb, ob));
    Ok(())
}

/// Several matmuls of one `x` in one GIL-free call: `out_j = x @ W_j.T` for each `(qtype,
/// weight, out, rows)` of `calls`, every `W_j` `rows x cols` (a layer's q, k and v: one call
/// where three cost three crossings of the binding). Each out is writable and disjoint from x,
/// every weight and the other outs.
#[pyfunction]
#[pyo3(signature = (x, calls, cols, threads = 0, kernel = "auto"))]
pub fn quant_matmuls(
    py: Python<'_>,
    x: &Bound<'_, PyAny>,
    calls: Vec<(String, Bound<'_, PyAny>, Bound<'_, PyAny>, usize)>,
    cols: usize,
    threads: usize,
    kernel: &str,
) -> PyResult<()> {
    let isa = Isa::parse(kernel).py()?;
    let xb = buffer::<f32>(x, "x", "float32", false)?;
    let mut held = Vec::with_capacity(calls.len());
    for (qtype, weight, out, rows) in &calls {
        let t = QType::parse(qtype).py()?;
        let wb = weight_bytes(py, weight)?;
        let ob = buffer::<f32>(out, "out", "float32", true)?;
        held.push((t, wb, ob, *rows));
    }
    let xs = span(&xb);
    let mut inputs = vec![(xs.0, xs.1, "x")];
    inputs.extend(held.iter().map(|(_, wb, _, _)| {
        let w = span(wb);
        (w.0, w.1, "a weight")
    }));
    let spans: Vec<_> = held
        .iter()
        .map(|(t, wb, ob, rows)| (*t, span(wb), span(ob), *rows))
        .collect();
    for (j, (_, _, o, _)) in spans.iter().enumerate() {
        check_disjoint(*o, &inputs)?;
        let others: Vec<_> = (spans.iter().enumerate())
            .filter(|&(k, _)| k != j)
            .map(|(_, s)| (s.2 .0, s.2 .1, "another out"))
            .collect();
        check_disjoint(*o, &others)?;
    }
    py.detach(|| {
        #[allow(unsafe_code)]
        // SAFETY: as in quant_matmul: x, the weights and the outs stay exported until this
        // function returns (xb, held); each out is writable, f32-aligned and disjoint from x,
        // every weight and every other out, so the `&mut` slices alias nothing.
        let (xs, mut jobs) = unsafe {
            let jobs: Vec<quant::MatmulJob<'_>> = spans
                .iter()
                .map(|&(t, w, o, rows)| {
                    (t, slice::<u8>(w.0, w.1), slice_mut::<f32>(o.0, o.1), rows)
                })
                .collect();
            (slice::<f32>(xs.0, xs.1), jobs)
        };
        quant::matmuls(xs, &mut jobs, cols, threads, isa)
    })
    .py()?;
    drop((xb, held));
    Ok(())
}

/// `out[i, r] = sum_c x[i, c] * W[r, c]` with W an FP8_BLOCK buffer (`rows x cols` e4m3 bytes,
/// then the fp32 scales of its `block = (br, bc)` tiles).
#[pyfunction]
#[pyo3(signature = (weight, x, out, rows, cols, block, threads = 0, kernel = "auto"))]
#[allow(clippy::too_many_arguments)]
pub fn quant_fp8_matmul(
    py: Python<'_>,
    weight: &Bound<'_, PyAny>,
    x: &Bound<'_, PyAny>,
    out: &Bound<'_, PyAny>,
    rows: usize,
    cols: usize,
    block: (usize, usize),
    threads: usize,
    kernel: &str,
) -> PyResult<()> {
    let isa = Isa::parse(kernel).py()?;
    with_matmul_buffers(py, weight, x, out, |w, xs, o| {
        quant::fp8::matmul(w, xs, o, rows, cols, block, threads, isa)
    })
}

/// One expert's SiLU FFN in one GIL-free call: `out = down @ (silu(gate @ x) * (up @ x))` with
/// gate/up `inter x hidden` and down `hidden x inter`, each of its own GGUF type.
#[pyfunction]
#[pyo3(signature = (gate_qtype, gate, up_qtype, up, down_qtype, down, x, out, hidden, inter,
                    threads = 0, kernel = "auto"))]
#[allow(clippy::too_many_arguments)]
pub fn quant_expert_ffn(
    py: Python<'_>,
    gate_qtype: &str,
    gate: &Bound<'_, PyAny>,
    up_qtype: &str,
    up: &Bound<'_, PyAny>,
    down_qtype: &str,
    down: &Bound<'_, PyAny>,
    x: &Bound<'_, PyAny>,
    out: &Bound<'_, PyAny>,
    hidden: usize,
    inter: usize,
    threads: usize,
    kernel: &str,
) -> PyResult<()> {
    let types = (
        QType::parse(gate_qtype).py()?,
        QType::parse(up_qtype).py()?,
        QType::parse(down_qtype).py()?,
    );
    let isa = Isa::parse(kernel).py()?;
    let (gb, ub, db) = (
        weight_bytes(py, gate)?,
        weight_bytes(py, up)?,
        weight_bytes(py, down)?,
    );
    let xb = buffer::<f32>(x, "x", "float32", false)?;
    let ob = buffer::<f32>(out, "out", "float32", true)?;
    let (g, u, d, xs, o) = (span(&gb), span(&ub), span(&db), span(&xb), span(&ob));
    check_disjoint(
        o,
        &[
            (g.0, g.1, "gate"),
            (u.0, u.1, "up"),
            (d.0, d.1, "down"),
            (xs.0, xs.1, "x"),
        ],
    )?;
    py.detach(|| {
        #[allow(unsafe_code)]
        // SAFETY: as in quant_matmul: the five buffers stay exported until this function
        // returns; out is writable, f32-aligned and disjoint from the four inputs.
        let (g, u, d, xs, o) = unsafe {
            (
                slice::<u8>(g.0, g.1),
                slice::<u8>(u.0, u.1),
                slice::<u8>(d.0, d.1),
                slice::<f32>(xs.0, xs.1),
                slice_mut::<f32>(o.0, o.1),
            )
        };
        quant::expert_ffn(
            (types.0, g),
            (types.1, u),
            (types.2, d),
            xs,
            o,
            hidden,
            inter,
            threads,
            isa,
        )
    })
    .py()?;
    drop((gb, ub, db, xb, ob));
    Ok(())
}

/// One routed expert as Python passes it: `(gate_qtype, gate, up_qtype, up, down_qtype, down,
/// rows, weights)`.
type ExpertArgs<'py> = (
    String,
    Bound<'py, PyAny>,
    String,
    Bound<'py, PyAny>,
    String,
    Bound<'py, PyAny>,
    Vec<usize>,
    Vec<f32>,
);

/// A MoE layer's routed experts in one call (`ftrs_core::quant::experts_ffn`): for each entry
/// of `experts` in order, `out[rows] += expert_ffn(x[rows]) * weights`, row by row.
#[pyfunction]
#[pyo3(signature = (experts, x, out, hidden, inter, threads = 0, kernel = "auto"))]
#[allow(clippy::too_many_arguments)]
pub fn quant_experts_ffn(
    py: Python<'_>,
    experts: Vec<ExpertArgs<'_>>,
    x: &Bound<'_, PyAny>,
    out: &Bound<'_, PyAny>,
    hidden: usize,
    inter: usize,
    threads: usize,
    kernel: &str,
) -> PyResult<()> {
    let isa = Isa::parse(kernel).py()?;
    let mut types = Vec::with_capacity(experts.len());
    let mut bufs = Vec::with_capacity(experts.len());
    let mut routes = Vec::with_capacity(experts.len());
    for (gt, g, ut, u, dt, d, rows, weights) in experts {
        types.push((
            QType::parse(&gt).py()?,
            QType::parse(&ut).py()?,
            QType::parse(&dt).py()?,
        ));
        bufs.push([
            weight_bytes(py, &g)?,
            weight_bytes(py, &u)?,
            weight_bytes(py, &d)?,
        ]);
        routes.push((rows, weights));
    }
    let xb = buffer::<f32>(x, "x", "float32", false)?;
    let ob = buffer::<f32>(out, "out", "float32", true)?;
    let (xs, o) = (span(&xb), span(&ob));
    let spans: Vec<[(usize, usize); 3]> = bufs.iter().map(|b| b.each_ref().map(span)).collect();
    let mut inputs: Vec<(usize, usize, &str)> = vec![(xs.0, xs.1, "x")];
    inputs.extend(
        spans
            .iter()
            .flatten()
            .map(|&(a, n)| (a, n, "an expert weight")),
    );
    check_disjoint(o, &inputs)?;
    py.detach(|| {
        #[allow(unsafe_code)]
        // SAFETY: as in quant_matmul: every buffer stays exported until this function returns
        // (bufs, xb, ob live past the closure); out is writable, f32-aligned and disjoint from
        // every input.
        let (xs, o) = unsafe { (slice::<f32>(xs.0, xs.1), slice_mut::<f32>(o.0, o.1)) };
        let calls: Vec<quant::RoutedExpert<'_>> = routes
            .iter()
            .zip(&types)
            .zip(&spans)
            .map(|((e, t), s)| {
                #[allow(unsafe_code)]
                // SAFETY: as above, for the three weight buffers of this expert.
                let (g, u, d) = unsafe {
                    (
                        slice::<u8>(s[0].0, s[0].1),
                        slice::<u8>(s[1].0, s[1].1),
                        slice::<u8>(s[2].0, s[2].1),
                    )
                };
                quant::RoutedExpert {
                    gate: (t.0, g),
                    up: (t.1, u),
                    down: (t.2, d),
                    rows: &e.0,
                    weights: &e.1,
                }
            })
            .collect();
        quant::experts_ffn(&calls, xs, o, hidden, inter, threads, isa)
    })
    .py()?;
    drop((bufs, xb, ob));
    Ok(())
}

/// A MoE layer's quantized experts, exported once: `forward` groups a router's choice by
/// expert and runs them in one GIL-free call, with no per-call export of the weights.
#[pyclass(name = "QuantExperts", module = "ftrs._core", frozen)]
pub struct PyQuantExperts {
    /// per expert id: (type, exported bytes) of gate, up, down
    experts: Vec<[(QType, PyBuffer<u8>); 3]>,
    hidden: usize,
    inter: usize,
}

#[pymethods]
impl PyQuantExperts {
    /// `experts`: per expert id, `(gate_qtype, gate, up_qtype, up, down_qtype, down)`.
    #[new]
    #[allow(clippy::type_complexity)]
    fn new(
        py: Python<'_>,
        experts: Vec<(
            String,
            Bound<'_, PyAny>,
            String,
            Bound<'_, PyAny>,
            String,
            Bound<'_, PyAny>,
        )>,
        hidden: usize,
        inter: usize,
    ) -> PyResult<Self> {
        let mut out = Vec::with_capacity(experts.len());
        for (gt, g, ut, u, dt, d) in experts {
            let e = [
                (QType::parse(&gt).py()?, weight_bytes(py, &g)?),
                (QType::parse(&ut).py()?, weight_bytes(py, &u)?),
                (QType::parse(&dt).py()?, weight_bytes(py, &d)?),
            ];
            #[allow(unsafe_code)]
            // SAFETY: the buffers stay exported while `e` lives, as the call needs.
            let (gs, us, ds) = unsafe {
                (
                    slice::<u8>(span(&e[0].1).0, span(&e[0].1).1),
                    slice::<u8>(span(&e[1].1).0, span(&e[1].1).1),
                    slice::<u8>(span(&e[2].1).0, span(&e[2].1).1),
                )
            };
            quant::check_ffn((e[0].0, gs), (e[1].0, us), (e[2].0, ds), hidden, inter).py()?;
            out.push(e);
        }
        Ok(Self {
            experts: out,
            hidden,
            inter,
        })
    }

    /// `out[t] += sum_j weights[t, j] * expert_{ids[t, j]}(x[t])`, the experts in ascending
    /// id (`ids` int64 and `weights` float32, both tokens x k); returns `(expert, rows routed
    /// to it)` in that order.
    #[pyo3(signature = (ids, weights, x, out, threads = 0, kernel = "auto"))]
    #[allow(clippy::too_many_arguments)]
    fn forward(
        &self,
        py: Python<'_>,
        ids: &Bound<'_, PyAny>,
        weights: &Bound<'_, PyAny>,
        x: &Bound<'_, PyAny>,
        out: &Bound<'_, PyAny>,
        threads: usize,
        kernel: &str,
    ) -> PyResult<Vec<(usize, usize)>> {
        let isa = Isa::parse(kernel).py()?;
        let ib = buffer::<i64>(ids, "ids", "int64", false)?;
        let wb = buffer::<f32>(weights, "weights", "float32", false)?;
        let xb = buffer::<f32>(x, "x", "float32", false)?;
        let ob = buffer::<f32>(out, "out", "float32", true)?;
        let (is, ws, xs, o) = (span(&ib), span(&wb), span(&xb), span(&ob));
        let tokens = xs.1 / 4 / self.hidden.max(1);
        let k = (is.1 / 8).checked_div(tokens).unwrap_or(0);
        let mut inputs: Vec<(usize, usize, &str)> = vec![
            (xs.0, xs.1, "x"),
            (is.0, is.1, "ids"),
            (ws.0, ws.1, "weights"),
        ];
        inputs.extend(
            self.experts
                .iter()
                .flatten()
                .map(|(_, b)| (span(b).0, span(b).1, "an expert weight")),
        );
        check_disjoint(o, &inputs)?;
        let counts = py
            .detach(|| {
                #[allow(unsafe_code)]
                // SAFETY: as in quant_matmul: every buffer stays exported until this function
                // returns (the experts' for self's life); out is writable, f32-aligned and
                // disjoint from every input.
                let (ids, ws, xs, o) = unsafe {
                    (
                        slice::<i64>(is.0, is.1),
                        slice::<f32>(ws.0, ws.1),
                        slice::<f32>(xs.0, xs.1),
                        slice_mut::<f32>(o.0, o.1),
                    )
                };
                let routes = quant::group_routes(ids, ws, k.max(1), self.experts.len())?;
                let calls: Vec<quant::RoutedExpert<'_>> = routes
                    .iter()
                    .map(|r| {
                        let e = &self.experts[r.expert];
                        #[allow(unsafe_code)]
                        // SAFETY: as above, for the three weight buffers of this expert.
                        let (g, u, d) = unsafe {
                            (
                                slice::<u8>(span(&e[0].1).0, span(&e[0].1).1),
                                slice::<u8>(span(&e[1].1).0, span(&e[1].1).1),
                                slice::<u8>(span(&e[2].1).0, span(&e[2].1).1),
                            )
                        };
                        quant::RoutedExpert {
                            gate: (e[0].0, g),
                            up: (e[1].0, u),
                            down: (e[2].0, d),
                            rows: &r.rows,
                            weights: &r.weights,
                        }
                    })
                    .collect();
                quant::experts_ffn(&calls, xs, o, self.hidden, self.inter, threads, isa)?;
                Ok::<_, ftrs_core::CoreError>(
                    routes.iter().map(|r| (r.expert, r.rows.len())).collect(),
                )
            })
            .py()?;
        drop((ib, wb, xb, ob));
        Ok(counts)
    }

    /// The number of experts.
    fn __len__(&self) -> usize {
        self.experts.len()
    }
}

/// Decodes W (`rows x cols` of type `qtype`) into the float32 buffer `out`.
#[pyfunction]
#[pyo3(signature = (qtype, weight, out, rows, cols, threads = 0))]
pub fn quant_dequantize(
    py: Python<'_>,
    qtype: &str,
    weight: &Bound<'_, PyAny>,
    out: &Bound<'_, PyAny>,
    rows: usize,
    cols: usize,
    threads: usize,
) -> PyResult<()> {
    let t = QType::parse(qtype).py()?;
    let wb = weight_bytes(py, weight)?;
    let ob = buffer::<f32>(out, "out", "float32", true)?;
    let (w, o) = (span(&wb), span(&ob));
    check_disjoint(o, &[(w.0, w.1, "weight")])?;
    py.detach(|| {
        #[allow(unsafe_code)]
        // SAFETY: as in quant_matmul: both buffers stay exported for the call, out is
        // writable, f32-aligned and disjoint from the weight.
        let (w, o) = unsafe { (slice::<u8>(w.0, w.1), slice_mut::<f32>(o.0, o.1)) };
        quant::dequantize(t, w, o, rows, cols, threads)
    })
    .py()?;
    drop((wb, ob));
    Ok(())
}

/// `(elements per block, bytes per block)` of a GGUF type.
#[pyfunction]
pub fn quant_block_info(qtype: &str) -> PyResult<(usize, usize)> {
    Ok(QType::parse(qtype).py()?.block_info())
}

/// Installs the grid of an i-quant type (`entries x width` fp32 values, row-major, as the
/// `gguf` package's tables give them); the kernels refuse the type until then.
#[pyfunction]
pub fn quant_set_grid(qtype: &str, values: Vec<f32>) -> PyResult<()> {
    quant::iq::set_grid(QType::lookup(qtype).py()?, &values).py()
}

/// The thread count the kernels use when a call passes 0.
#[pyfunction]
pub fn quant_threads() -> usize {
    threads::default_threads()
}

/// Sets the thread count the kernels use when a call passes 0 (>= 1).
#[pyfunction]
pub fn quant_set_threads(n: usize) -> PyResult<()> {
    threads::set_default_threads(n).py()
}

/// Whether the kernels of `kernel` round the activations to int8 per 32-block for `qtype`
/// (integer products, as ggml's q8 dot products; see `ftrs_core::quant::rounds_activations`).
#[pyfunction]
#[pyo3(signature = (qtype, kernel = "auto"))]
pub fn quant_rounds_activations(qtype: &str, kernel: &str) -> PyResult<bool> {
    Ok(quant::rounds_activations(
        QType::parse(qtype).py()?,
        Isa::parse(kernel).py()?,
    ))
}

/// The kernel family `kernel="auto"` picks in this process: `"avx512"`, `"avx2"` or
/// `"portable"` (the best this CPU runs, unless `quant_set_kernel` chose another).
#[pyfunction]
pub fn quant_kernel() -> &'static str {
    Isa::auto().name()
}

/// Makes `kernel="auto"` mean `name` in this process (`"auto"`: the best this CPU runs again);
/// a family this CPU lacks is a `ConfigError`.
#[pyfunction]
pub fn quant_set_kernel(name: &str) -> PyResult<()> {
    let isa = if name == "auto" {
        None
    } else {
        Some(Isa::parse(name).py()?)
    };
    Isa::set_auto(isa);
    Ok(())
}

/// Every kernel family this CPU runs, plainest first (`"portable"` always).
#[pyfunction]
pub fn quant_kernels() -> Vec<&'static str> {
    Isa::available().into_iter().map(Isa::name).collect()
}

/// Adds this module's functions to `ftrs._core`.
pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(quant_matmul, m)?)?;
    m.add_function(wrap_pyfunction!(quant_matmuls, m)?)?;
    m.add_function(wrap_pyfunction!(quant_fp8_matmul, m)?)?;
    m.add_function(wrap_pyfunction!(quant_dequantize, m)?)?;
    m.add_function(wrap_pyfunction!(quant_expert_ffn, m)?)?;
    m.add_function(wrap_pyfunction!(quant_experts_ffn, m)?)?;
    m.add_class::<PyQuantExperts>()?;
    m.add_function(wrap_pyfunction!(quant_block_info, m)?)?;
    m.add_function(wrap_pyfunction!(quant_set_grid, m)?)?;
    m.add_function(wrap_pyfunction!(quant_threads, m)?)?;
    m.add_function(wrap_pyfunction!(quant_set_threads, m)?)?;
    m.add_function(wrap_pyfunction!(quant_kernel, m)?)?;
    m.add_function(wrap_pyfunction!(quant_set_kernel, m)?)?;
    m.add_function(wrap_pyfunction!(quant_kernels, m)?)?;
    m.add_function(wrap_pyfunction!(quant_rounds_activations, m)?)?;
    Ok(())
}
