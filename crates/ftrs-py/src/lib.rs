//! `ftrs._core`: the Python face of ftrs-core, and the only crate that knows pyo3.
//!
//! Wrappers are newtypes over core types (`pool.rs`, `engine.rs`); every core error becomes
//! its `ftrs.errors` class in one function (`errors.rs`). Calls that block or copy a lot
//! (`wait`, `fill_from_safetensors`, `pin`, `simulate_cache`, `host_copy`) release the GIL.
//! Unsafe code is denied except the buffer export, the destination wrapper and `host_copy`,
//! each with its contract.

#![deny(unsafe_code)]

mod engine;
mod errors;
mod pool;

use pyo3::prelude::*;

/// True when the CUDA driver loads and sees a device.
#[pyfunction]
fn cuda_available(py: Python<'_>) -> bool {
    py.detach(ftrs_core::cuda::available)
}

#[pymodule]
fn _core(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    m.add_class::<pool::PyExpertLayout>()?;
    m.add_class::<pool::PyExpertPool>()?;
    m.add_class::<engine::PyTransferEngine>()?;
    m.add_class::<engine::PyFlightRecorder>()?;
    m.add_function(wrap_pyfunction!(engine::simulate_cache, m)?)?;
    m.add_function(wrap_pyfunction!(engine::host_copy, m)?)?;
    m.add_function(wrap_pyfunction!(cuda_available, m)?)?;
    Ok(())
}
