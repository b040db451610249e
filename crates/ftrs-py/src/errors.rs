//! The one mapping from `ftrs_core::CoreError` to the Python classes of `ftrs.errors`.
//!
//! The classes live in Python (python/ftrs/errors.py) so every layer raises the same types;
//! the module is imported at raise time (cheap after the first import). Rust's orphan rule
//! forbids `impl From<CoreError> for PyErr` outside both crates, so the mapping is the function
//! [`to_py`] plus the `.py()` adapter on results. If `ftrs.errors` cannot be imported (a broken
//! install), a RuntimeError with the same message is raised instead of losing the error.

use ftrs_core::{CoreError, DeviceFault};
use pyo3::exceptions::PyRuntimeError;
use pyo3::prelude::*;
use pyo3::types::PyDict;

/// Builds the `ftrs.errors` exception for `e`.
pub fn to_py(e: CoreError) -> PyErr {
    Python::attach(|py| build(py, &e).unwrap_or_else(|_| PyRuntimeError::new_err(e.to_string())))
}

fn build(py: Python<'_>, e: &CoreError) -> PyResult<PyErr> {
    let m = py.import("ftrs.errors")?;
    let evidence = PyDict::new(py);
    let (class, args): (&str, (String, Option<String>)) = match e {
        CoreError::Config(msg) => ("ConfigError", (msg.clone(), None)),
        CoreError::Capacity(msg) => ("CapacityError", (msg.clone(), None)),
        CoreError::ModelLoad { path, problem } => {
            ("ModelLoadError", (path.clone(), Some(problem.clone())))
        }
        CoreError::Device {
            kind,
            source_name,
            injected,
            detail,
        } => {
            evidence.set_item("source", *source_name)?;
            evidence.set_item("injected", *injected)?;
            evidence.set_item("kind", kind.name())?;
            evidence.set_item("detail", detail)?;
            let class = match kind {
                DeviceFault::DeviceLost => "DeviceLost",
                DeviceFault::KernelFault => "KernelFault",
                DeviceFault::OutOfMemory => "DeviceOutOfMemory",
            };
            (class, (e.to_string(), None))
        }
        CoreError::DriverUnavailable(msg) => {
            evidence.set_item("source", "cuda_driver")?;
            ("DeviceError", (msg.clone(), None))
        }
        CoreError::WorkerPanic { detail, injected } => {
            // A bug in the engine, not the hardware: DESIGN.md's KernelFault ("engine_fault",
            // exit 87). The copy engine is dead; the device policy decides what comes next.
            evidence.set_item("source", "transfer_worker")?;
            evidence.set_item("injected", *injected)?;
            evidence.set_item("kind", "worker_panic")?;
            evidence.set_item("detail", detail)?;
            ("KernelFault", (e.to_string(), None))
        }
        CoreError::Closed => {
            evidence.set_item("source", "transfer_engine")?;
            ("ConfigError", (e.to_string(), None))
        }
    };
    let cls = m.getattr(class)?;
    let kwargs = PyDict::new(py);
    kwargs.set_item("evidence", evidence)?;
    let obj = match args {
        (a, Some(b)) => cls.call((a, b), Some(&kwargs))?,
        (a, None) => cls.call((a,), Some(&kwargs))?,
    };
    Ok(PyErr::from_value(obj))
}

/// `.py()` turns a core result into a Python one through [`to_py`].
pub trait CoreResultExt<T> {
    /// Maps the error with [`to_py`].
    fn py(self) -> PyResult<T>;
}

impl<T> CoreResultExt<T> for Result<T, CoreError> {
    fn py(self) -> PyResult<T> {
        self.map_err(to_py)
    }
}
