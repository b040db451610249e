//! The CUDA driver for Python beyond the copy backend: `cuda_available`, and single copies
//! timed either way (`cuda_measure_h2d`, `cuda_measure_d2h`) for the link probe and benches.
//!
//! Both measuring functions take raw addresses (a torch tensor's `data_ptr()`, a pinned
//! `ExpertPool`'s `address`) and release the GIL while the copies run. The caller keeps both
//! buffers alive for the call, has no other work pending on them (`torch.cuda.synchronize()`
//! first: the copies run on their own stream), and does not touch them until the call returns.
//! The host buffer must be pinned; the core checks that, and the arguments, before copying.
//! `ordinal` names the device (`cuda:N`): `ConfigError` when negative or past the devices the
//! driver sees; its context is pushed for the call, so torch's current device is unchanged.

use ftrs_core::cuda::{measure_copy, Direction};
use pyo3::prelude::*;

use crate::errors::CoreResultExt;

/// True when the CUDA driver loads and sees a device.
#[pyfunction]
pub fn cuda_available(py: Python<'_>) -> bool {
    py.detach(ftrs_core::cuda::available)
}

/// Median seconds of one pinned host → device copy of `nbytes` (after a warm-up copy).
#[pyfunction]
#[pyo3(signature = (device_address, host_address, nbytes, repeats = 5, ordinal = 0))]
pub fn cuda_measure_h2d(
    py: Python<'_>,
    device_address: u64,
    host_address: usize,
    nbytes: usize,
    repeats: u32,
    ordinal: i64,
) -> PyResult<f64> {
    #[allow(unsafe_code)]
    // SAFETY: the contract of this module's doc, which the Python caller keeps (points 1-2 of
    // `measure`): live, idle buffers of `nbytes` until the call returns.
    unsafe {
        measure(
            py,
            Direction::HostToDevice,
            device_address,
            host_address,
            nbytes,
            repeats,
            ordinal,
        )
    }
}

/// Median seconds of one device → pinned host copy of `nbytes` (after a warm-up copy); the
/// host buffer then holds the device bytes.
#[pyfunction]
#[pyo3(signature = (device_address, host_address, nbytes, repeats = 5, ordinal = 0))]
pub fn cuda_measure_d2h(
    py: Python<'_>,
    device_address: u64,
    host_address: usize,
    nbytes: usize,
    repeats: u32,
    ordinal: i64,
) -> PyResult<f64> {
    #[allow(unsafe_code)]
    // SAFETY: the contract of this module's doc, which the Python caller keeps (points 1-2 of
    // `measure`): live, idle buffers of `nbytes` until the call returns.
    unsafe {
        measure(
            py,
            Direction::DeviceToHost,
            device_address,
            host_address,
            nbytes,
            repeats,
            ordinal,
        )
    }
}

/// [`measure_copy`] with the GIL released.
///
/// # Safety
/// 1. `host..host+nbytes` is host memory, and `device..device+nbytes` device memory of device
///    `ordinal`, both allocated for the whole call. A bad `ordinal` is a `ConfigError`.
/// 2. Nothing else uses either range during the call (the destination is overwritten).
#[allow(unsafe_code)]
unsafe fn measure(
    py: Python<'_>,
    dir: Direction,
    device: u64,
    host: usize,
    nbytes: usize,
    repeats: u32,
    ordinal: i64,
) -> PyResult<f64> {
    let ordinal = ftrs_core::cuda::check_ordinal(ordinal).py()?;
    // SAFETY: points 1-2 of this function's contract are points 1-2 of `measure_copy`.
    py.detach(|| unsafe { measure_copy(ordinal, dir, device, host, nbytes, repeats) })
        .py()
}
