//! `TransferEngine`, `simulate_cache`, `host_copy` and `FlightRecorder` for Python.
//!
//! The engine copies into a destination Python allocated: a contiguous torch tensor (on the
//! CPU for the `host` and `simulated` backends, on CUDA for `cuda`), passed as the object
//! itself. The engine keeps a reference to it for as long as its worker may copy into it, so
//! the buffer cannot be freed under the engine, whatever the order in which Python drops
//! things; the caller must still not resize it or swap its storage (`resize_`, `set_`).
//! `wait` and `close` release the GIL while they block; the object's `Drop` (GIL held) never
//! joins the worker (see [`PyTransferEngine`]'s `Drop`).
//!
//! `cuda:N`: the `cuda` backend copies into device N (`cuda` = `cuda:0`), and the destination
//! must be a tensor on that device (`ConfigError` otherwise). `release(stream)` takes the raw
//! handle of the stream whose queued kernels read the released slots (torch's
//! `torch.cuda.current_stream(device).cuda_stream`, a stream of the engine's device, live for
//! the call): the engine records a fence there, and its copies into those slots wait for it on
//! the device. The handle is trusted as given (a driver handle cannot be checked); host
//! backends never use it. A stream capturing a CUDA graph is refused (`ConfigError`): release
//! outside the captured region.

use std::sync::{Arc, Mutex};

use ftrs_core::{
    create_backend, simulate, Clock, CoreError, Destination, DeviceFault, EngineConfig,
    FlightRecorder, MemKind, Policy, RealClock, StepKind, StepRecord, TransferEngine,
};
use pyo3::prelude::*;
use pyo3::types::PyDict;

use crate::errors::CoreResultExt;
use crate::pool::PyExpertPool;

/// Streams expert blocks from an ExpertPool into device slots.
#[pyclass(name = "TransferEngine", module = "ftrs._core", frozen)]
pub struct PyTransferEngine {
    /// The core engine; `None` only inside `Drop`.
    inner: Option<TransferEngine>,
    /// The destination tensor; held while the engine can copy into it; `None` only in `Drop`.
    dst: Option<Py<PyAny>>,
}

/// Address and size in bytes of `dst`, a contiguous torch tensor on the CPU (`ordinal` None)
/// or on CUDA device `ordinal`.
fn tensor_range(dst: &Bound<'_, PyAny>, ordinal: Option<i32>) -> PyResult<(usize, usize)> {
    let device = if ordinal.is_some() { "cuda" } else { "cpu" };
    let config = |msg: String| crate::errors::to_py(CoreError::Config(msg));
    let attr = |name: &str| {
        dst.getattr(name)
            .map_err(|_| config(format!("dst must be a torch tensor (it has no {name})")))
    };
    let on = attr("device")?.getattr("type")?.extract::<String>()?;
    if on != device {
        return Err(config(format!(
            "dst is a {on} tensor, but this backend copies into {device} memory"
        )));
    }
    if let Some(want) = ordinal {
        let index = attr("device")?.getattr("index")?.extract::<Option<i64>>()?;
        if index != Some(i64::from(want)) {
            return Err(config(format!(
                "dst is on cuda:{}, but this backend copies into cuda:{want}",
                index.map_or("?".into(), |i| i.to_string())
            )));
        }
    }
    if !attr("is_contiguous")?.call0()?.extract::<bool>()? {
        return Err(config("dst must be contiguous".into()));
    }
    let addr = attr("data_ptr")?.call0()?.extract::<usize>()?;
    let numel = attr("numel")?.call0()?.extract::<usize>()?;
    let size = attr("element_size")?.call0()?.extract::<usize>()?;
    if addr == 0 {
        return Err(config("dst has no storage (null data_ptr)".into()));
    }
    let nbytes = numel
        .checked_mul(size)
        .ok_or_else(|| config("dst size overflows".into()))?;
    Ok((addr, nbytes))
}

#[pymethods]
impl PyTransferEngine {
    #[new]
    #[pyo3(signature = (pool, num_slots, dst, backend = "host", policy = "lru",
                        max_inflight_bytes = 0, pacing_bytes_per_s = 0.0, threads = 0,
                        max_inflight_prefetches = 1, prefetch_chunk_bytes = 0))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        pool: &PyExpertPool,
        num_slots: usize,
        dst: &Bound<'_, PyAny>,
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
        let ordinal = backend.device_ordinal();
        let kind = if ordinal.is_some() {
            MemKind::Device
        } else {
            MemKind::Host
        };
        let (dst_address, dst_nbytes) = tensor_range(dst, ordinal)?;
        let pool = pool.share()?;
        let (p0, p1) = (pool.address(), pool.address() + pool.nbytes());
        if kind == MemKind::Host && dst_address < p1 && p0 < dst_address + dst_nbytes {
            return Err(crate::errors::to_py(CoreError::Config(
                "dst overlaps the expert pool".into(),
            )));
        }
        #[allow(unsafe_code)]
        // SAFETY: `Destination::new`'s contract: (1) `dst` is a contiguous tensor of `kind`
        // memory, on the backend's device for device memory (checked above) whose `dst_nbytes` bytes at `dst_address` stay allocated while
        // this object holds the tensor, i.e. until the worker has stopped (`Drop` lets go of it
        // only after the join); resizing it in place is outside the documented contract of this
        // class. (2) Host destinations were checked not to overlap the pool; a device one cannot.
        // (3) Only the engine writes the slots it copies into; Python reads a slot after `wait`
        // or `ready` said it landed (the documented use).
        let dst_mem = unsafe { Destination::new(dst_address, dst_nbytes, kind) };
        let cfg = EngineConfig {
            num_slots,
            policy,
            max_inflight_bytes,
            max_inflight_prefetches,
            prefetch_chunk_bytes,
            pacing_bytes_per_s,
        };
        Ok(Self {
            inner: Some(TransferEngine::new(pool, dst_mem, cfg, backend, clock).py()?),
            dst: Some(dst.clone().unbind()),
        })
    }

    #[getter]
    fn num_slots(&self) -> usize {
        self.engine().num_slots()
    }
    #[getter]
    fn backend_name(&self) -> String {
        self.engine().backend_name()
    }

    /// The destination object the engine copies into (held for the engine's life).
    #[getter]
    fn destination(&self, py: Python<'_>) -> Py<PyAny> {
        self.dst
            .as_ref()
            .expect("only Drop takes the destination")
            .clone_ref(py)
    }

    /// Drops the queued prefetches, waits (GIL released) for the copies already started and
    /// joins the worker. Idempotent; afterwards every call but the counters (`stats`,
    /// `resident`, `ready`, the getters) raises `ConfigError`.
    fn close(&self, py: Python<'_>) {
        py.detach(|| self.engine().close())
    }

    /// Whether `close` was called.
    #[getter]
    fn closed(&self) -> bool {
        self.engine().is_closed()
    }

    /// One call per MoE layer: (slots aligned with `demand`, ticket).
    #[pyo3(signature = (layer, demand, prefetch = Vec::new()))]
    fn lookup(
        &self,
        layer: u32,
        demand: Vec<u32>,
        prefetch: Vec<(u32, u32)>,
    ) -> PyResult<(Vec<u32>, u64)> {
        self.live()?.lookup(layer, &demand, &prefetch).py()
    }

    /// Blocks (without the GIL) until the ticket's demand copies landed.
    fn wait(&self, py: Python<'_>, ticket: u64) -> PyResult<()> {
        let engine = self.live()?;
        py.detach(|| engine.wait(ticket)).py()
    }

    /// Unpins the slots of every lookup since the last release. `stream`: the raw handle of
    /// the stream whose queued work still reads them (module doc); a fence is recorded there
    /// and copies into those slots wait for it. None: nothing reads them any more.
    #[pyo3(signature = (stream = None))]
    fn release(&self, stream: Option<u64>) -> PyResult<()> {
        let engine = self.live()?;
        match stream {
            None => engine.release(),
            #[allow(unsafe_code)]
            // SAFETY: point 1 of `release_after`: the handle is 0 or a live stream of the
            // engine's device, the documented contract of this method (module doc).
            Some(s) => unsafe { engine.release_after(s) }.py()?,
        }
        Ok(())
    }

    /// Asks for `keys` ((layer, expert)) to be copied in when the link is idle, for a later
    /// step to hit (`TransferEngine::fill`); returns how many were queued.
    fn fill(&self, keys: Vec<(u32, u32)>) -> PyResult<usize> {
        self.live()?.fill(&keys).py()
    }

    /// Drops prefetches not yet demanded and fill requests; returns how many transfers.
    fn cancel_prefetches(&self) -> PyResult<usize> {
        Ok(self.live()?.cancel_prefetches())
    }

    /// All counters in one dict.
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let s = self.engine().stats();
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
            ("fences_recorded", s.fences_recorded),
            ("fence_waits", s.fence_waits),
            ("fill_requested", s.fill_requested),
            ("fill_issued", s.fill_issued),
            ("fill_used", s.fill_used),
            ("fill_wasted", s.fill_wasted),
            ("fill_dropped", s.fill_dropped),
            ("fill_queued", s.fill_queued),
        ] {
            d.set_item(k, v)?;
        }
        d.set_item("layer_hits", s.layer_hits)?;
        d.set_item("layer_misses", s.layer_misses)?;
        Ok(d)
    }

    fn reset_stats(&self) {
        self.engine().reset_stats()
    }

    /// Turns pacing on at `bytes_per_s` from the next copy on (0 turns it off); the adaptive
    /// guard calls it while serving.
    fn set_pacing(&self, bytes_per_s: f64) -> PyResult<()> {
        self.live()?.set_pacing(bytes_per_s).py()
    }

    /// Sets how many prefetch copies may be in flight at once (0 = no limit): a started copy
    /// cannot be overtaken, so this bounds how long a new demand waits behind prefetches.
    fn set_max_inflight_prefetches(&self, n: usize) -> PyResult<()> {
        self.live()?.set_max_inflight_prefetches(n);
        Ok(())
    }

    /// Whether each slot holds its expert's landed bytes now.
    fn ready(&self, slots: Vec<u32>) -> Vec<bool> {
        self.engine().ready(&slots)
    }

    /// Sets the chunk size of prefetch copies issued from now on (0 = whole expert).
    fn set_prefetch_chunk_bytes(&self, n: usize) -> PyResult<()> {
        self.live()?.set_prefetch_chunk_bytes(n);
        Ok(())
    }

    /// The pacing rate in bytes per second; 0 when pacing is off.
    #[getter]
    fn pacing_bytes_per_s(&self) -> f64 {
        self.engine().pacing_bytes_per_s()
    }

    /// (layer, expert, slot) of every slot whose bytes landed.
    fn resident(&self) -> Vec<(u32, u32, u32)> {
        self.engine().resident()
    }

    /// The experts of `layer` whose bytes landed, ascending.
    fn resident_in(&self, layer: u32) -> Vec<u32> {
        self.engine().resident_in(layer)
    }

    /// Drill: the copy after the next `after_copies` ones fails with `kind`
    /// (device_lost | kernel_fault | oom), or, for `worker_panic`, the worker panics on it
    /// (every waiter then gets `KernelFault`, and the engine stays dead).
    #[pyo3(signature = (kind, after_copies = 0))]
    fn inject_fault(&self, kind: &str, after_copies: u64) -> PyResult<()> {
        let engine = self.live()?;
        if kind == "worker_panic" {
            engine.inject_panic(after_copies);
        } else {
            engine.inject_fault(DeviceFault::parse(kind).py()?, after_copies);
        }
        Ok(())
    }
}

impl PyTransferEngine {
    /// The core engine (present until `Drop`).
    fn engine(&self) -> &TransferEngine {
        self.inner.as_ref().expect("only Drop takes the engine")
    }

    /// The core engine, or `ConfigError` once closed.
    fn live(&self) -> PyResult<&TransferEngine> {
        let engine = self.engine();
        if engine.is_closed() {
            return Err(crate::errors::to_py(CoreError::Closed));
        }
        Ok(engine)
    }
}

impl Drop for PyTransferEngine {
    /// Runs with the GIL held (the object's deallocation), so it never joins the worker: a
    /// closed engine has no worker left; an open one is closed on a thread of its own, which
    /// also holds the destination until the worker has stopped copying into it.
    fn drop(&mut self) {
        let (Some(engine), dst) = (self.inner.take(), self.dst.take()) else {
            return;
        };
        if engine.is_closed() {
            return; // joined by `close` (no method call runs during Drop)
        }
        let payload = Arc::new(Mutex::new(Some((engine, dst))));
        let theirs = Arc::clone(&payload);
        let spawned = std::thread::Builder::new()
            .name("ftrs-transfer-close".into())
            .spawn(move || {
                if let Some((engine, dst)) = theirs.lock().unwrap_or_else(|p| p.into_inner()).take()
                {
                    drop(engine); // closes and joins the worker
                    drop(dst); // then lets go of the buffer (decref deferred to the next GIL holder)
                }
            });
        if spawned.is_err() {
            // No thread to close it on: leak the engine and its destination rather than join
            // with the GIL held or free the buffer under a running worker.
            if let Some(p) = payload.lock().unwrap_or_else(|p| p.into_inner()).take() {
                std::mem::forget(p);
            }
        }
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

/// Checks a copy-backend spec (`host`, `simulated:GBPS[:LAT_US]`, `cuda[:N]`) without building
/// it: `ConfigError` when it would not build for its form (a CUDA device's presence is checked
/// when the engine starts).
#[pyfunction]
pub fn check_copy_backend(spec: &str) -> PyResult<()> {
    ftrs_core::parse_spec(spec).map(|_| ()).py()
}

/// Checks an expert-cache policy name: `ConfigError` unless a device cache can run it (the
/// offline `belady` cannot), by building a one-slot cache of it.
#[pyfunction]
pub fn check_cache_policy(name: &str) -> PyResult<()> {
    Policy::parse(name)
        .and_then(|p| ftrs_core::SlotCache::new(1, p))
        .map(|_| ())
        .py()
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
