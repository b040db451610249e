//! `ExpertLayout` and `ExpertPool` for Python: thin newtypes over ftrs-core.
//!
//! The core pool is written through `&mut` only, before it is shared. The wrapper keeps it in
//! an `Arc` under a mutex: `write` and `fill_from_safetensors` need `Arc::get_mut`, which fails
//! with a `ConfigError` while a `TransferEngine` (or any other holder of [`PyExpertPool::share`])
//! still holds the pool; a call that finds the mutex taken (a fill running on another thread)
//! gets the same error instead of blocking with the GIL held.
//!
//! The pool exposes its memory through the buffer protocol (1-D, unsigned bytes) so Python can
//! view it with `torch.frombuffer(pool, dtype=torch.uint8)` without a copy. A view taken while
//! the pool is not shared is writable (a way to fill it); one taken while an engine holds it is
//! read-only, so new views cannot race the engine's copies (a writable view taken before stays
//! writable: writing through it while an engine copies is the caller's race). The region never
//! moves or shrinks while the pool object lives, and every exported view holds a reference to
//! the pool object, so a view never outlives the memory.

use std::ffi::c_int;
use std::sync::{Arc, Mutex};

use ftrs_core::{CoreError, ExpertLayout, ExpertPool, FillEntry, PoolDtype, RawFillEntry};
use pyo3::buffer::PyBuffer;
use pyo3::ffi;
use pyo3::prelude::*;

use crate::errors::CoreResultExt;

/// Offsets of every (layer, expert, tensor) in the host pool.
#[pyclass(name = "ExpertLayout", module = "ftrs._core", frozen)]
#[derive(Clone)]
pub struct PyExpertLayout {
    /// The core layout (immutable).
    pub inner: ExpertLayout,
}

#[pymethods]
impl PyExpertLayout {
    /// `tensor_bytes`: one list of tensor sizes for every layer, or one list per layer (sizes
    /// may differ between layers; each layer's blocks are then its own size).
    #[new]
    #[pyo3(signature = (num_layers, num_experts, tensor_bytes, alignment = 256))]
    fn new(
        num_layers: usize,
        num_experts: usize,
        tensor_bytes: &Bound<'_, PyAny>,
        alignment: usize,
    ) -> PyResult<Self> {
        let inner = if let Ok(per_layer) = tensor_bytes.extract::<Vec<Vec<usize>>>() {
            if per_layer.len() != num_layers {
                return Err(crate::errors::to_py(CoreError::Config(format!(
                    "num_layers is {num_layers} but tensor_bytes has {} layers",
                    per_layer.len()
                ))));
            }
            ExpertLayout::per_layer(num_experts, &per_layer, alignment)
        } else {
            let uniform: Vec<usize> = tensor_bytes.extract()?;
            ExpertLayout::new(num_layers, num_experts, &uniform, alignment)
        };
        Ok(Self { inner: inner.py()? })
    }
    #[getter]
    fn num_layers(&self) -> usize {
        self.inner.num_layers()
    }
    #[getter]
    fn num_experts(&self) -> usize {
        self.inner.num_experts()
    }
    #[getter]
    fn num_tensors(&self) -> usize {
        self.inner.num_tensors()
    }
    /// The largest size of each tensor over the layers (every layer's, for a uniform layout).
    #[getter]
    fn tensor_bytes(&self) -> Vec<usize> {
        (0..self.inner.num_tensors())
            .map(|t| {
                (0..self.inner.num_layers())
                    .filter_map(|l| self.inner.tensor_bytes(l, t).ok())
                    .max()
                    .unwrap_or(0)
            })
            .collect()
    }
    #[getter]
    fn alignment(&self) -> usize {
        self.inner.alignment()
    }
    /// The largest block of any layer: the device slot stride.
    #[getter]
    fn expert_bytes(&self) -> usize {
        self.inner.expert_bytes()
    }
    #[getter]
    fn total_bytes(&self) -> usize {
        self.inner.total_bytes()
    }
    /// Whether every layer has the same tensor sizes.
    #[getter]
    fn uniform(&self) -> bool {
        self.inner.is_uniform()
    }
    /// Size of one block of `layer` (what a transfer of one of its experts moves).
    fn block_bytes(&self, layer: usize) -> PyResult<usize> {
        self.inner.block_bytes(layer).py()
    }
    /// The tensor sizes of an expert of `layer`.
    fn layer_tensor_bytes(&self, layer: usize) -> PyResult<Vec<usize>> {
        (0..self.inner.num_tensors())
            .map(|t| self.inner.tensor_bytes(layer, t))
            .collect::<Result<_, _>>()
            .py()
    }
    /// Offset of (layer, expert, tensor) in the pool.
    fn offset(&self, layer: usize, expert: usize, tensor: usize) -> PyResult<usize> {
        self.inner.offset(layer, expert, tensor).py()
    }
    /// Offset of `tensor` inside an expert block of `layer` (and inside a device slot).
    #[pyo3(signature = (tensor, layer = 0))]
    fn tensor_offset(&self, tensor: usize, layer: usize) -> PyResult<usize> {
        self.inner.tensor_offset(layer, tensor).py()
    }
    fn __repr__(&self) -> String {
        format!(
            "ExpertLayout(num_layers={}, num_experts={}, tensor_bytes={:?}, uniform={}, alignment={}, expert_bytes={}, total_bytes={})",
            self.inner.num_layers(),
            self.inner.num_experts(),
            self.tensor_bytes(),
            self.inner.is_uniform(),
            self.inner.alignment(),
            self.inner.expert_bytes(),
            self.inner.total_bytes()
        )
    }
}

/// All routed experts in one zeroed, page-aligned host region.
#[pyclass(name = "ExpertPool", module = "ftrs._core", frozen)]
pub struct PyExpertPool {
    /// The pool; uniquely owned (fillable) until shared with an engine, read-only while shared.
    /// Locked only briefly, or by a fill for its duration (with the GIL released).
    inner: Mutex<Arc<ExpertPool>>,
    /// The region's first byte; fixed for the pool's life (read without the lock).
    address: usize,
    /// The region's size in bytes; fixed.
    nbytes: usize,
    /// Element type; fixed.
    dtype: PoolDtype,
    /// The layout; fixed.
    layout: ExpertLayout,
}

impl PyExpertPool {
    /// A shared handle on the pool (what a `TransferEngine` holds). While any handle lives,
    /// `write` and `fill_from_safetensors` raise `ConfigError`.
    pub fn share(&self) -> PyResult<Arc<ExpertPool>> {
        let pool = self.inner.try_lock().map_err(|_| busy())?;
        Ok(Arc::clone(&pool))
    }

    /// Runs `f` on the uniquely owned pool; `ConfigError` if it is shared or being filled.
    fn with_mut<T>(&self, f: impl FnOnce(&mut ExpertPool) -> Result<T, CoreError>) -> PyResult<T> {
        let mut pool = self.inner.try_lock().map_err(|_| busy())?;
        let pool = Arc::get_mut(&mut pool).ok_or_else(|| {
            crate::errors::to_py(CoreError::Config(
                "the expert pool is in use by a TransferEngine and read-only: fill it before \
                 creating the engine (or close the engine and drop it first)"
                    .into(),
            ))
        })?;
        f(pool).py()
    }

    /// True while something besides this object holds the pool (an engine).
    fn shared(&self) -> bool {
        self.inner
            .try_lock()
            .map_or(true, |p| Arc::strong_count(&p) > 1)
    }
}

fn busy() -> PyErr {
    crate::errors::to_py(CoreError::Config(
        "the expert pool is being filled on another thread".into(),
    ))
}

#[pymethods]
impl PyExpertPool {
    #[new]
    fn new(layout: &PyExpertLayout, dtype: &str) -> PyResult<Self> {
        let dtype = PoolDtype::parse(dtype).py()?;
        let pool = ExpertPool::new(layout.inner.clone(), dtype).py()?;
        Ok(Self {
            address: pool.address(),
            nbytes: pool.nbytes(),
            dtype,
            layout: layout.inner.clone(),
            inner: Mutex::new(Arc::new(pool)),
        })
    }
    #[getter]
    fn address(&self) -> usize {
        self.address
    }
    #[getter]
    fn nbytes(&self) -> usize {
        self.nbytes
    }
    #[getter]
    fn dtype(&self) -> &'static str {
        self.dtype.name()
    }
    #[getter]
    fn layout(&self) -> PyExpertLayout {
        PyExpertLayout {
            inner: self.layout.clone(),
        }
    }
    #[getter]
    fn pinned(&self) -> PyResult<bool> {
        Ok(self.share()?.is_pinned())
    }

    /// Writes one tensor's bytes (any C-contiguous buffer of exactly the layout's size).
    /// `ConfigError` while a `TransferEngine` holds the pool.
    fn write(
        &self,
        py: Python<'_>,
        layer: usize,
        expert: usize,
        tensor: usize,
        data: &Bound<'_, PyAny>,
    ) -> PyResult<()> {
        let view = py
            .import("builtins")?
            .getattr("memoryview")?
            .call1((data,))?
            .call_method1("cast", ("B",))?;
        let buf = PyBuffer::<u8>::get(&view)?;
        let bytes = buf.to_vec(py)?;
        self.with_mut(|pool| pool.write(layer, expert, tensor, &bytes))
    }

    /// Loads (path, tensor name, layer, expert, tensor index) entries; returns bytes written.
    /// `ConfigError` while a `TransferEngine` holds the pool.
    #[pyo3(signature = (entries, threads = 0))]
    fn fill_from_safetensors(
        &self,
        py: Python<'_>,
        entries: Vec<(String, String, usize, usize, usize)>,
        threads: usize,
    ) -> PyResult<usize> {
        let entries: Vec<FillEntry> = entries
            .into_iter()
            .map(|(path, tensor, layer, expert, tensor_index)| FillEntry {
                path,
                tensor,
                layer,
                expert,
                tensor_index,
            })
            .collect();
        py.detach(|| self.with_mut(|pool| pool.fill_from_safetensors(&entries, threads)))
    }

    /// Copies (file offset, layer, expert, tensor index) entries of the file at `path` as they
    /// are, each its layout tensor's bytes, on `threads` threads (0 = all cores), the GIL
    /// released; returns bytes written. `ModelLoadError` for a range past the file's end,
    /// `ConfigError` while a `TransferEngine` holds the pool.
    #[pyo3(signature = (path, entries, threads = 0))]
    fn fill_from_file(
        &self,
        py: Python<'_>,
        path: String,
        entries: Vec<(usize, usize, usize, usize)>,
        threads: usize,
    ) -> PyResult<usize> {
        let entries: Vec<RawFillEntry> = entries
            .into_iter()
            .map(|(offset, layer, expert, tensor_index)| RawFillEntry {
                offset,
                layer,
                expert,
                tensor_index,
            })
            .collect();
        py.detach(|| self.with_mut(|pool| pool.fill_from_file(&path, &entries, threads)))
    }

    /// Page-locks the pool through the CUDA driver, in the context of CUDA device `device`
    /// (the pinning is portable: every device sees it); False when there is no driver.
    /// `ConfigError` for a negative ordinal or a device the driver does not see.
    #[pyo3(signature = (device = 0))]
    fn pin(&self, py: Python<'_>, device: i64) -> PyResult<bool> {
        let ordinal = ftrs_core::cuda::check_ordinal(device).py()?;
        let pool = self.share()?;
        py.detach(move || pool.pin(ordinal)).py()
    }

    fn __len__(&self) -> usize {
        self.nbytes
    }

    #[allow(unsafe_code)]
    unsafe fn __getbuffer__(
        slf: Bound<'_, Self>,
        view: *mut ffi::Py_buffer,
        flags: c_int,
    ) -> PyResult<()> {
        let pool = slf.get();
        let (addr, len) = (pool.address, pool.nbytes);
        let readonly = c_int::from(pool.shared());
        // SAFETY: `view` is the Py_buffer CPython handed us; the region `addr..addr+len` is live
        // and fixed for as long as the pool object lives, and FillInfo stores a new reference to
        // that object in `view->obj`, so the exported view keeps it alive. Writable while no
        // engine holds the pool (Python may fill it through the view), read-only once one does
        // (FillInfo then refuses a request for a writable view with BufferError).
        let rc = unsafe {
            ffi::PyBuffer_FillInfo(
                view,
                slf.as_ptr(),
                addr as *mut std::ffi::c_void,
                len as ffi::Py_ssize_t,
                readonly,
                flags,
            )
        };
        if rc != 0 {
            return Err(PyErr::fetch(slf.py()));
        }
        Ok(())
    }

    #[allow(unsafe_code)]
    unsafe fn __releasebuffer__(&self, _view: *mut ffi::Py_buffer) {
        // Nothing to free: FillInfo's format string is static and CPython drops `view->obj`.
    }

    fn __repr__(&self) -> String {
        format!(
            "ExpertPool(nbytes={}, dtype={:?}, address=0x{:x})",
            self.nbytes,
            self.dtype.name(),
            self.address
        )
    }
}
