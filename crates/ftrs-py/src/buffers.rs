//! Borrowed Python buffers for the GIL-free kernels (`quant.rs`, `ops.rs`): export, check,
//! and view as slices, never copied. A buffer stays exported (so it cannot be freed or
//! resized) while its `PyBuffer` lives; the kernels run on slices of it with the GIL released.

use ftrs_core::CoreError;
use pyo3::buffer::{Element, PyBuffer};
use pyo3::prelude::*;

use crate::errors::to_py;

/// A `Config` error as the Python `ConfigError`.
pub(crate) fn config(msg: String) -> PyErr {
    to_py(CoreError::Config(msg))
}

/// Exports `obj` as C-contiguous elements of `T`, read-only or writable; `what` names the
/// argument in errors.
pub(crate) fn buffer<T: Element>(
    obj: &Bound<'_, PyAny>,
    what: &str,
    kind: &str,
    writable: bool,
) -> PyResult<PyBuffer<T>> {
    let buf = PyBuffer::<T>::get(obj)
        .map_err(|e| config(format!("{what} must be a C-contiguous {kind} buffer: {e}")))?;
    if !buf.is_c_contiguous() {
        return Err(config(format!("{what} must be C-contiguous")));
    }
    if writable && buf.readonly() {
        return Err(config(format!("{what} must be writable")));
    }
    Ok(buf)
}

/// The weight as bytes, whatever its element type (`memoryview(obj).cast("B")`); a buffer that
/// already is C-contiguous bytes (a uint8 numpy array) is taken as it is, without the cast.
pub(crate) fn weight_bytes(py: Python<'_>, obj: &Bound<'_, PyAny>) -> PyResult<PyBuffer<u8>> {
    if let Ok(buf) = PyBuffer::<u8>::get(obj) {
        if buf.is_c_contiguous() {
            return Ok(buf);
        }
    }
    let view = py
        .import("builtins")?
        .getattr("memoryview")?
        .call1((obj,))
        .and_then(|v| v.call_method1("cast", ("B",)))
        .map_err(|e| config(format!("weight must be a C-contiguous buffer: {e}")))?;
    buffer::<u8>(&view, "weight", "byte", false)
}

/// `(address, length in bytes)` of a buffer.
pub(crate) fn span<T: Element>(b: &PyBuffer<T>) -> (usize, usize) {
    (b.buf_ptr() as usize, b.len_bytes())
}

/// Rejects `out` overlapping any of `inputs`.
pub(crate) fn check_disjoint(out: (usize, usize), inputs: &[(usize, usize, &str)]) -> PyResult<()> {
    for &(a, n, name) in inputs {
        if n > 0 && out.1 > 0 && a < out.0 + out.1 && out.0 < a + n {
            return Err(config(format!("out overlaps {name}")));
        }
    }
    Ok(())
}

/// Read-only slice over an exported buffer.
///
/// # Safety
/// 1. `(addr, len)` is the span of a buffer exported (and so kept alive and unresized) for the
///    whole lifetime `'a`, aligned for `T` (PyBuffer::get checked it) with `len` a multiple of
///    `size_of::<T>()`.
/// 2. Nothing writes the span during `'a` (no `&mut` made by [`slice_mut`] overlaps it).
#[allow(unsafe_code)]
pub(crate) unsafe fn slice<'a, T>(addr: usize, len: usize) -> &'a [T] {
    if len == 0 {
        return &[];
    }
    // SAFETY: points 1-2 of this function's contract.
    unsafe { std::slice::from_raw_parts(addr as *const T, len / std::mem::size_of::<T>()) }
}

/// Writable slice over an exported, writable buffer.
///
/// # Safety
/// As [`slice`], and no other slice of the span exists during `'a`.
#[allow(unsafe_code)]
pub(crate) unsafe fn slice_mut<'a, T>(addr: usize, len: usize) -> &'a mut [T] {
    if len == 0 {
        return &mut [];
    }
    // SAFETY: this function's contract.
    unsafe { std::slice::from_raw_parts_mut(addr as *mut T, len / std::mem::size_of::<T>()) }
}
