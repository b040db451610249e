//! The one error type of ftrs-core.
//!
//! Every variant maps to exactly one class of the Python module `ftrs.errors` (the mapping lives
//! in `ftrs-py`, in one function): `Config` → ConfigError, `Capacity` → CapacityError,
//! `ModelLoad` → ModelLoadError(path, problem), `Device` → DeviceLost / KernelFault /
//! DeviceOutOfMemory by [`DeviceFault`], `DriverUnavailable` → DeviceError, `WorkerPanic` →
//! KernelFault (an engine bug, not the hardware: the class DESIGN.md gives to "engine or kernel
//! bug", HTTP 500 `engine_fault`, exit 87), `Closed` → ConfigError (a call on a closed engine
//! is a misuse by the caller). Variants carry the evidence the Python side puts in
//! `FtrsError.evidence`.

use std::fmt;

/// What a failed copy says about the device (DESIGN.md "Errors").
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum DeviceFault {
    /// The device left the bus; further work on it is pointless.
    DeviceLost,
    /// A CUDA error while the device still answers (driver or kernel bug).
    KernelFault,
    /// The device ran out of memory.
    OutOfMemory,
}

impl DeviceFault {
    /// Parses the names used by `inject_fault`: `device_lost`, `kernel_fault`, `oom`.
    pub fn parse(kind: &str) -> Result<Self, CoreError> {
        match kind {
            "device_lost" => Ok(Self::DeviceLost),
            "kernel_fault" => Ok(Self::KernelFault),
            "oom" | "out_of_memory" => Ok(Self::OutOfMemory),
            other => Err(CoreError::Config(format!(
                "unknown fault kind {other:?}: expected device_lost, kernel_fault or oom"
            ))),
        }
    }

    /// The stable name used in evidence and by `parse`.
    pub fn name(self) -> &'static str {
        match self {
            Self::DeviceLost => "device_lost",
            Self::KernelFault => "kernel_fault",
            Self::OutOfMemory => "oom",
        }
    }
}

impl fmt::Display for DeviceFault {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Errors of ftrs-core. Expected shortfalls only; internal invariants use `debug_assert!`.
#[derive(Debug, Clone, thiserror::Error, PartialEq)]
pub enum CoreError {
    /// An argument or setting is invalid (unknown policy, zero slots, index out of range).
    #[error("{0}")]
    Config(String),
    /// The request cannot be served with the slots at hand (everything pinned).
    #[error("{0}")]
    Capacity(String),
    /// A checkpoint file cannot be read into the pool.
    #[error("{path}: {problem}")]
    ModelLoad {
        /// The file at fault, as given by the caller.
        path: String,
        /// What is wrong with it, naming the tensor where one is involved.
        problem: String,
    },
    /// A copy to the device failed.
    #[error("{kind} during copy ({source_name}): {detail}")]
    Device {
        /// What the failure says about the device.
        kind: DeviceFault,
        /// The component that saw it (`copy_backend`).
        source_name: &'static str,
        /// True when the failure was injected by `inject_fault` (a drill).
        injected: bool,
        /// Driver error text or drill description.
        detail: String,
    },
    /// The CUDA driver cannot be loaded or initialised (no GPU on this host).
    #[error("{0}")]
    DriverUnavailable(String),
    /// The transfer worker thread panicked: every waiting and later call gets this error.
    #[error("transfer worker panicked: {detail}")]
    WorkerPanic {
        /// The panic message.
        detail: String,
        /// True when the panic was injected by `inject_panic` (a drill).
        injected: bool,
    },
    /// The transfer engine was closed; only its counters can still be read.
    #[error("the transfer engine is closed")]
    Closed,
}

/// Shorthand for results of this crate.
pub type Result<T, E = CoreError> = std::result::Result<T, E>;
