//! `ftrs._core`: the Python face of ftrs-core, and the only crate that knows pyo3.
//!
//! Wrappers are newtypes over core types (`pool.rs`, `engine.rs`); every core error becomes
//! its `ftrs.errors` class in one function (`errors.rs`). Calls that block or copy a lot
//! (`wait`, `close`, `fill_from_safetensors`, `pin`, `simulate_cache`, `host_copy`, the timed
//! CUDA copies of `cuda.rs`, the kernels of `quant.rs` and `ops.rs`) release the GIL; no `Drop`
//! blocks with it held (an unclosed `TransferEngine` is joined on a thread of its own). The
//! `TransferEngine` holds its destination tensor, and an `ExpertPool` refuses writes while an
//! engine holds it. Unsafe code is denied
//! except the buffer export, the destination wrapper, `host_copy`, the timed CUDA copies and the
//! borrowed buffer slices of `buffers.rs`, each with its contract.

#![deny(unsafe_code)]

mod buffers;
mod cuda;
mod engine;
mod errors;
mod ops;
mod pool;
mod quant;

use pyo3::prelude::*;

#[pymodule]
fn _core(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    m.add_class::<pool::PyExpertLayout>()?;
    m.add_class::<pool::PyExpertPool>()?;
    m.add_class::<engine::PyTransferEngine>()?;
    m.add_class::<engine::PyFlightRecorder>()?;
    m.add_function(wrap_pyfunction!(engine::simulate_cache, m)?)?;
    m.add_function(wrap_pyfunction!(engine::host_copy, m)?)?;
    m.add_function(wrap_pyfunction!(engine::check_copy_backend, m)?)?;
    m.add_function(wrap_pyfunction!(engine::check_cache_policy, m)?)?;
    m.add_function(wrap_pyfunction!(cuda::cuda_available, m)?)?;
    m.add_function(wrap_pyfunction!(cuda::cuda_measure_h2d, m)?)?;
    m.add_function(wrap_pyfunction!(cuda::cuda_measure_d2h, m)?)?;
    quant::register(m)?;
    ops::register(m)?;
    Ok(())
}
