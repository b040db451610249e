//! `ExpertLayout` and `ExpertPool` for Python: thin newtypes over ftrs-core.
//!
//! The pool exposes its memory through the buffer protocol (writable, 1-D, unsigned bytes) so
//! Python can view it with `torch.frombuffer(pool, dtype=torch.uint8)` without a copy. The
//! region never moves or shrinks while the pool object lives, and every exported view holds a
//! reference to the pool object, so a view never outlives the memory.

use std::ffi::c_int;
use std::sync::Arc;

use ftrs_core::{ExpertLayout, ExpertPool, FillEntry, PoolDtype};
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
    #[new]
    #[pyo3(signature = (num_layers, num_experts, tensor_bytes, alignment = 256))]
    fn new(
        num_layers: usize,
        num_experts: usize,
        tensor_bytes: Vec<usize>,
        alignment: usize,
    ) -> PyResult<Self> {
        Ok(Self {
            inner: ExpertLayout::new(num_layers, num_experts, &tensor_bytes, alignment).py()?,
        })
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
    #[getter]
    fn tensor_bytes(&self) -> Vec<usize> {
        (0..self.inner.num_tensors())
            .map(|t| self.inner.tensor_bytes(t))
            .collect()
    }
    #[getter]
    fn alignment(&self) -> usize {
        self.inner.alignment()
    }
    #[getter]
    fn expert_bytes(&self) -> usize {
        self.inner.expert_bytes()
    }
    #[getter]
    fn total_bytes(&self) -> usize {
        self.inner.total_bytes()
    }
    /// Offset of (layer, expert, tensor) in the pool.
    fn offset(&self, layer: usize, expert: usize, tensor: usize) -> PyResult<usize> {
        self.inner.offset(layer, expert, tensor).py()
    }
    /// Offset of `tensor` inside an expert block (and inside a device slot).
    fn tensor_offset(&self, tensor: usize) -> PyResult<usize> {
        self.inner.tensor_offset(tensor).py()
    }
    fn __repr__(&self) -> String {
        format!(
            "ExpertLayout(num_layers={}, num_experts={}, tensor_bytes={:?}, alignment={}, expert_bytes={})",
            self.inner.num_layers(),
            self.inner.num_experts(),
            self.tensor_bytes(),
            self.inner.alignment(),
            self.inner.expert_bytes()
        )
    }
}

/// All routed experts in one zeroed, page-aligned host region.
#[pyclass(name = "ExpertPool", module = "ftrs._core", frozen)]
pub struct PyExpertPool {
    /// Shared with every engine built on this pool.
    pub inner: Arc<ExpertPool>,
}

#[pymethods]
impl PyExpertPool {
    #[new]
    fn new(layout: &PyExpertLayout, dtype: &str) -> PyResult<Self> {
        let dtype = PoolDtype::parse(dtype).py()?;
        Ok(Self {
            inner: Arc::new(ExpertPool::new(layout.inner.clone(), dtype).py()?),
        })
    }
    #[getter]
    fn address(&self) -> usize {
        self.inner.address()
    }
    #[getter]
    fn nbytes(&self) -> usize {
        self.inner.nbytes()
    }
    #[getter]
    fn dtype(&self) -> &'static str {
        self.inner.dtype().name()
    }
    #[getter]
    fn layout(&self) -> PyExpertLayout {
        PyExpertLayout {
            inner: self.inner.layout().clone(),
        }
    }
    #[getter]
    fn pinned(&self) -> bool {
        self.inner.is_pinned()
    }

    /// Writes one tensor's bytes (any C-contiguous buffer of exactly the layout's size).
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
        self.inner.write(layer, expert, tensor, &bytes).py()
    }

    /// Loads (path, tensor name, layer, expert, tensor index) entries; returns bytes written.
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
        let pool = Arc::clone(&self.inner);
        py.detach(move || pool.fill_from_safetensors(&entries, threads))
            .py()
    }

    /// Page-locks the pool through the CUDA driver; False when there is no driver.
    fn pin(&self, py: Python<'_>) -> PyResult<bool> {
        let pool = Arc::clone(&self.inner);
        py.detach(move || pool.pin()).py()
    }

    fn __len__(&self) -> usize {
        self.inner.nbytes()
    }

    #[allow(unsafe_code)]
    unsafe fn __getbuffer__(
        slf: Bound<'_, Self>,
        view: *mut ffi::Py_buffer,
        flags: c_int,
    ) -> PyResult<()> {
        let (addr, len) = (slf.get().inner.address(), slf.get().inner.nbytes());
        // SAFETY: `view` is the Py_buffer CPython handed us; the region `addr..addr+len` is live
        // and fixed for as long as the pool object lives, and FillInfo stores a new reference to
        // that object in `view->obj`, so the exported view keeps it alive. Writable (readonly=0)
        // by design: Python fills the pool through it.
        let rc = unsafe {
            ffi::PyBuffer_FillInfo(
                view,
                slf.as_ptr(),
                addr as *mut std::ffi::c_void,
                len as ffi::Py_ssize_t,
                0,
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
            self.inner.nbytes(),
            self.inner.dtype().name(),
            self.inner.address()
        )
    }
}
