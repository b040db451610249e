//! `TransferEngine`, `simulate_cache`, `host_copy` and `FlightRecorder` for Python.
//!
//! The engine copies into a destination buffer Python allocated (a torch tensor on CPU or
//! CUDA) and passed as an address and a size: the caller must keep that tensor alive, and not
//! resize it, for as long as the engine lives. `wait` releases the GIL while it blocks.

use std::sync::Arc;

use ftrs_core::{
    create_backend, simulate, Clock, Destination, DeviceFault, EngineConfig, FlightRecorder,
    MemKind, Policy, RealClock, StepKind, StepRecord, TransferEngine,
};
use pyo3::prelude::*;
use pyo3::types::PyDict;

use crate::errors::CoreResultExt;
use crate::pool::PyExpertPool;

/// Streams expert blocks from an ExpertPool into device slots.
#[pyclass(name = "TransferEngine", module = "ftrs._core", frozen)]
pub struct PyTransferEngine {
    /// The core engine; its worker thread is joined when this object is collected.
    inner: TransferEngine,
}

#[pymethods]
impl PyTransferEngine {
    #[new]
    #[pyo3(signature = (pool, num_slots, dst_address, dst_nbytes, backend = "host", policy = "lru",
                        max_inflight_bytes = 0, pacing_bytes_per_s = 0.0, threads = 0,
                        max_inflight_prefetches = 1, prefetch_chunk_bytes = 0))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        pool: &PyExpertPool,
        num_slots: usize,
        dst_address: usize,
        dst_nbytes: usize,
        backend: &str,
        policy: &str,
        max_inflight_bytes: usize,
        pacing_bytes_per_s: f64,
        threads: usize,
        max_inflight_prefetches: usize,
        prefetch_chunk_bytes: usize,
    ) -> PyResult<Self> {
        let policy = Policy::parse(policy).py()?;
        let clock: Arc<dyn Clock> = Arc::new(RealClock::new());
        let backend = create_backend(backend, Arc::clone(&clock), threads).py()?;
        let kind = if backend.name() == "cuda" {
            MemKind::Device
        } else {
            MemKind::Host
        };
        if dst_address == 0 {
            return Err(crate::errors::to_py(ftrs_core::CoreError::Config(
                "dst_address is null".into(),
            )));
        }
        #[allow(unsafe_code)]
        // SAFETY: the documented contract of this class: the caller's buffer at `dst_address`
        // holds `dst_nbytes` bytes of `kind` memory, is distinct from the pool, and outlives the
        // engine (Python keeps the tensor referenced next to the engine).
        let dst = unsafe { Destination::new(dst_address, dst_nbytes, kind) };
        let cfg = EngineConfig {
            num_slots,
            policy,
            max_inflight_bytes,
            max_inflight_prefetches,
            prefetch_chunk_bytes,
            pacing_bytes_per_s,
        };
        Ok(Self {
            inner: TransferEngine::new(Arc::clone(&pool.inner), dst, cfg, backend, clock).py()?,
        })
    }

    #[getter]
    fn num_slots(&self) -> usize {
        self.inner.num_slots()
    }
    #[getter]
    fn backend_name(&self) -> String {
        self.inner.backend_name()
    }

    /// One call per MoE layer: (slots aligned with `demand`, ticket).
    #[pyo3(signature = (layer, demand, prefetch = Vec::new()))]
    fn lookup(
        &self,
        layer: u32,
        demand: Vec<u32>,
        prefetch: Vec<(u32, u32)>,
    ) -> PyResult<(Vec<u32>, u64)> {
        self.inner.lookup(layer, &demand, &prefetch).py()
    }

    /// Blocks (without the GIL) until the ticket's demand copies landed.
    fn wait(&self, py: Python<'_>, ticket: u64) -> PyResult<()> {
        py.detach(|| self.inner.wait(ticket)).py()
    }

    /// Unpins the slots of every lookup since the last release.
    fn release(&self) {
        self.inner.release()
    }

    /// Drops prefetches not yet demanded; returns how many.
    fn cancel_prefetches(&self) -> usize {
        self.inner.cancel_prefetches()
    }

    /// All counters in one dict.
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let s = self.inner.stats();
        let d = PyDict::new(py);
        for (k, v) in [
            ("bytes_h2d", s.bytes_h2d),
            ("lookups", s.lookups),
            ("hits", s.hits),
            ("misses", s.misses),
            ("demand_fetches", s.demand_fetches),
            ("prefetch_issued", s.prefetch_issued),
            ("prefetch_used", s.prefetch_used),
            ("prefetch_wasted", s.prefetch_wasted),
            ("prefetch_cancelled", s.prefetch_cancelled),
            ("queue_depth", s.queue_depth),
            ("inflight_bytes", s.inflight_bytes),
        ] {
            d.set_item(k, v)?;
        }
        d.set_item("layer_hits", s.layer_hits)?;
        d.set_item("layer_misses", s.layer_misses)?;
        Ok(d)
    }

    fn reset_stats(&self) {
        self.inner.reset_stats()
    }

    /// Turns pacing on at `bytes_per_s` from the next copy on (0 turns it off); the adaptive
    /// guard calls it while serving.
    fn set_pacing(&self, bytes_per_s: f64) -> PyResult<()> {
        self.inner.set_pacing(bytes_per_s).py()
    }

    /// Sets how many prefetch copies may be in flight at once (0 = no limit): a started copy
    /// cannot be overtaken, so this bounds how long a new demand waits behind prefetches.
    fn set_max_inflight_prefetches(&self, n: usize) {
        self.inner.set_max_inflight_prefetches(n)
    }

    /// Whether each slot holds its expert's landed bytes now.
    fn ready(&self, slots: Vec<u32>) -> Vec<bool> {
        self.inner.ready(&slots)
    }

    /// Sets the chunk size of prefetch copies issued from now on (0 = whole expert).
    fn set_prefetch_chunk_bytes(&self, n: usize) {
        self.inner.set_prefetch_chunk_bytes(n)
    }

    /// The pacing rate in bytes per second; 0 when pacing is off.
    #[getter]
    fn pacing_bytes_per_s(&self) -> f64 {
        self.inner.pacing_bytes_per_s()
    }

    /// (layer, expert, slot) of every slot whose bytes landed.
    fn resident(&self) -> Vec<(u32, u32, u32)> {
        self.inner.resident()
    }

    /// Drill: the copy after the next `after_copies` ones fails with `kind`
    /// (device_lost | kernel_fault | oom).
    #[pyo3(signature = (kind, after_copies = 0))]
    fn inject_fault(&self, kind: &str, after_copies: u64) -> PyResult<()> {
        self.inner
            .inject_fault(DeviceFault::parse(kind).py()?, after_copies);
        Ok(())
    }
}

/// Replays a trace (one list of (layer, expert) per layer-step); returns (hits, misses).
#[pyfunction]
pub fn simulate_cache(
    py: Python<'_>,
    trace: Vec<Vec<(u32, u32)>>,
    capacity: usize,
    policy: &str,
) -> PyResult<(u64, u64)> {
    let policy = Policy::parse(policy).py()?;
    py.detach(|| simulate(&trace, capacity, policy)).py()
}

/// The host backend's copy between raw addresses (for bench/copy.py). The caller guarantees
/// both ranges are live, host, disjoint and not written by anyone else during the call.
#[pyfunction]
#[pyo3(signature = (dst_address, src_address, nbytes, threads = 0))]
pub fn host_copy(
    py: Python<'_>,
    dst_address: usize,
    src_address: usize,
    nbytes: usize,
    threads: usize,
) -> PyResult<()> {
    let overlap = dst_address < src_address.saturating_add(nbytes)
        && src_address < dst_address.saturating_add(nbytes);
    if nbytes > 0 && (dst_address == 0 || src_address == 0 || overlap) {
        return Err(crate::errors::to_py(ftrs_core::CoreError::Config(
            "host_copy needs non-null, non-overlapping ranges".into(),
        )));
    }
    #[allow(unsafe_code)]
    // SAFETY: the documented contract of this function (points 1-3 of `copy_parallel`): Python
    // passes addresses of live host buffers of at least `nbytes`; overlap is rejected above.
    py.detach(|| unsafe {
        ftrs_core::raw::copy_parallel(dst_address, src_address, nbytes, threads)
    });
    Ok(())
}

/// Ring of the last N step records.
#[pyclass(name = "FlightRecorder", module = "ftrs._core", frozen)]
pub struct PyFlightRecorder {
    /// The lock-free ring.
    inner: FlightRecorder,
}

#[pymethods]
impl PyFlightRecorder {
    #[new]
    #[pyo3(signature = (capacity = 512))]
    fn new(capacity: usize) -> Self {
        Self {
            inner: FlightRecorder::new(capacity),
        }
    }

    #[getter]
    fn capacity(&self) -> usize {
        self.inner.capacity()
    }

    /// Appends one step record; unknown floats default to NaN, integers to -1.
    #[pyo3(signature = (step, *, time = f64::NAN, kind = "unknown", tokens = -1, chunk_tokens = -1,
                        bytes_issued = -1, inflight_bytes = -1, experts_fetched = -1,
                        power_w = f64::NAN, temperature_c = f64::NAN, link_gen = -1, link_width = -1))]
    #[allow(clippy::too_many_arguments)]
    fn record(
        &self,
        step: i64,
        time: f64,
        kind: &str,
        tokens: i64,
        chunk_tokens: i64,
        bytes_issued: i64,
        inflight_bytes: i64,
        experts_fetched: i64,
        power_w: f64,
        temperature_c: f64,
        link_gen: i64,
        link_width: i64,
    ) {
        self.inner.record(StepRecord {
            step,
            time,
            kind: StepKind::parse(kind),
            tokens,
            chunk_tokens,
            bytes_issued,
            inflight_bytes,
            experts_fetched,
            power_w,
            temperature_c,
            link_gen,
            link_width,
        });
    }

    /// Records oldest → newest, as dicts.
    fn dump<'py>(&self, py: Python<'py>) -> PyResult<Vec<Bound<'py, PyDict>>> {
        self.inner
            .dump()
            .into_iter()
            .map(|r| {
                let d = PyDict::new(py);
                d.set_item("step", r.step)?;
                d.set_item("time", r.time)?;
                d.set_item("kind", r.kind.name())?;
                d.set_item("tokens", r.tokens)?;
                d.set_item("chunk_tokens", r.chunk_tokens)?;
                d.set_item("bytes_issued", r.bytes_issued)?;
                d.set_item("inflight_bytes", r.inflight_bytes)?;
                d.set_item("experts_fetched", r.experts_fetched)?;
                d.set_item("power_w", r.power_w)?;
                d.set_item("temperature_c", r.temperature_c)?;
                d.set_item("link_gen", r.link_gen)?;
                d.set_item("link_width", r.link_width)?;
                Ok(d)
            })
            .collect()
    }

    fn __len__(&self) -> usize {
        self.inner.len()
    }
}
