//! Copy backends: how a validated [`CopyJob`] reaches the device slot buffer.
//!
//! `submit` starts a copy and returns a [`Completion`] that `finish` waits on, so a backend with
//! asynchronous copies (CUDA streams) can keep several in flight while the engine keeps its
//! bytes-in-flight budget. Backends:
//! - `host`: `memcpy` split over N threads (the CPU device); completes inside `submit`.
//! - `simulated:GBPS[:LATENCY_US]`: does the host copy, then models a serial link (like PCIe):
//!   the copy occupies the link from `max(now, link_free)` for `latency + bytes / bandwidth`;
//!   `finish` sleeps (on the engine's [`Clock`]) until then.
//! - `cuda`: `cuMemcpyHtoDAsync` on a dedicated stream plus an event (see `cuda.rs`).

// `unsafe fn submit` declares a contract (allowed where it is declared); no unsafe block here.
#![deny(unsafe_code)]

use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::clock::Clock;
use crate::error::{CoreError, Result};
use crate::raw::CopyJob;

/// How to know a submitted copy finished.
#[derive(Debug)]
pub enum Completion {
    /// Already done.
    Done,
    /// Done once the clock reaches this time (simulated link).
    At(Duration),
    /// Done once this CUDA event fires.
    Event(crate::cuda::Event),
}

/// A way to copy expert blocks host → destination.
pub trait CopyBackend: Send + Sync + std::fmt::Debug {
    /// The name the backend was created with (`host`, `simulated:12:5`, `cuda`).
    fn name(&self) -> String;
    /// Starts `job`. An asynchronous backend (CUDA) is still copying when this returns, past
    /// the job's borrow of its source and destination, hence `unsafe`.
    ///
    /// # Safety
    /// 1. The job's source region stays allocated and unwritten, and its destination range
    ///    allocated and touched by nobody else, until [`Self::finish`] returned for the returned
    ///    completion (or this call failed). A completion must not be dropped unfinished.
    #[allow(unsafe_code)]
    unsafe fn submit(&self, job: &CopyJob<'_>) -> Result<Completion>;
    /// Blocks until `c` is done; copy failures surface here or in `submit`.
    fn finish(&self, c: Completion) -> Result<()>;
}

/// `memcpy` on up to `threads` threads.
#[derive(Debug)]
pub struct HostBackend {
    /// Threads per large copy; 0 = all cores.
    pub threads: usize,
}

impl CopyBackend for HostBackend {
    fn name(&self) -> String {
        "host".into()
    }
    #[allow(unsafe_code)] // declares the trait's contract; the body is safe code
    unsafe fn submit(&self, job: &CopyJob<'_>) -> Result<Completion> {
        job.run_host(self.threads)?;
        Ok(Completion::Done)
    }
    fn finish(&self, c: Completion) -> Result<()> {
        debug_assert!(matches!(c, Completion::Done));
        Ok(())
    }
}

/// Host copies timed like a serial link of `bytes_per_s` with a per-copy `latency`.
#[derive(Debug)]
pub struct SimulatedBackend {
    /// Link bandwidth in bytes/s; > 0.
    bytes_per_s: f64,
    /// Fixed cost per copy.
    latency: Duration,
    /// The time source the link is modelled in.
    clock: Arc<dyn Clock>,
    /// When the link is next free; only increases.
    link_free: Mutex<Duration>,
    /// Threads for the host copy itself.
    threads: usize,
    /// The spec string, for `name`.
    spec: String,
}

impl SimulatedBackend {
    /// A link of `gbps` GB/s (1e9 bytes/s) and `latency_us` µs per copy.
    pub fn new(gbps: f64, latency_us: f64, clock: Arc<dyn Clock>, threads: usize) -> Result<Self> {
        if !(gbps > 0.0 && gbps.is_finite() && latency_us >= 0.0 && latency_us.is_finite()) {
            return Err(CoreError::Config(format!(
                "simulated link needs bandwidth > 0 and latency >= 0, got {gbps} GB/s, {latency_us} us"
            )));
        }
        Ok(Self {
            bytes_per_s: gbps * 1e9,
            latency: Duration::from_secs_f64(latency_us * 1e-6),
            clock,
            link_free: Mutex::new(Duration::ZERO),
            threads,
            spec: format!("simulated:{gbps}:{latency_us}"),
        })
    }
}

impl CopyBackend for SimulatedBackend {
    fn name(&self) -> String {
        self.spec.clone()
    }
    #[allow(unsafe_code)] // declares the trait's contract; the body is safe code
    unsafe fn submit(&self, job: &CopyJob<'_>) -> Result<Completion> {
        // The link time starts at submission, as a DMA's would: the host copy that moves the
        // bytes here runs inside it (on a slow link it is hidden; on a fast one it is the
        // longer of the two), instead of being added in front of it.
        let submitted = self.clock.now();
        job.run_host(self.threads)?;
        let mut free = self.link_free.lock().unwrap_or_else(|p| p.into_inner());
        let start = (*free).max(submitted);
        let end =
            start + self.latency + Duration::from_secs_f64(job.len() as f64 / self.bytes_per_s);
        *free = end;
        Ok(Completion::At(end.max(self.clock.now())))
    }
    fn finish(&self, c: Completion) -> Result<()> {
        if let Completion::At(t) = c {
            self.clock.sleep_until(t);
        }
        Ok(())
    }
}

/// Builds a backend from its spec: `host`, `simulated:GBPS[:LATENCY_US]` or `cuda`.
pub fn create_backend(
    spec: &str,
    clock: Arc<dyn Clock>,
    threads: usize,
) -> Result<Arc<dyn CopyBackend>> {
    let mut parts = spec.split(':');
    match parts.next().unwrap_or("") {
        "host" | "cpu" if parts.next().is_none() => Ok(Arc::new(HostBackend { threads })),
        "simulated" => {
            let num = |s: Option<&str>, default: Option<f64>| -> Result<f64> {
                match s {
                    Some(s) => s.parse::<f64>().map_err(|_| {
                        CoreError::Config(format!("bad number {s:?} in backend spec {spec:?}"))
                    }),
                    None => default.ok_or_else(|| {
                        CoreError::Config(format!(
                            "backend spec {spec:?} needs simulated:GBPS[:LATENCY_US]"
                        ))
                    }),
                }
            };
            let gbps = num(parts.next(), None)?;
            let lat = num(parts.next(), Some(0.0))?;
            if parts.next().is_some() {
                return Err(CoreError::Config(format!(
                    "trailing fields in backend spec {spec:?}"
                )));
            }
            Ok(Arc::new(SimulatedBackend::new(gbps, lat, clock, threads)?))
        }
        "cuda" if parts.next().is_none() => Ok(Arc::new(crate::cuda::CudaBackend::new(0)?)),
        _ => Err(CoreError::Config(format!(
            "unknown backend {spec:?}: expected host, simulated:GBPS[:LATENCY_US] or cuda"
        ))),
    }
}
