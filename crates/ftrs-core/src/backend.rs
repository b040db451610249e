//! Copy backends: how a validated [`CopyJob`] reaches the device slot buffer.
//!
//! `submit` starts a copy and returns a [`Completion`] that `finish` waits on, so a backend with
//! asynchronous copies (CUDA streams) can keep several in flight while the engine keeps its
//! bytes-in-flight budget. Backends:
//! - `host`: `memcpy` split over N threads (the CPU device); completes inside `submit`.
//! - `simulated:GBPS[:LATENCY_US]`: does the host copy, then models a serial link (like PCIe):
//!   the copy occupies the link from `max(now, link_free)` for `latency + bytes / bandwidth`;
//!   `finish` sleeps (on the engine's [`Clock`]) until then.
//! - `cuda[:N]`: `cuMemcpyHtoDAsync` on a dedicated stream of device N (default 0) plus an
//!   event per copy (see `cuda.rs`).
//!
//! Release fences: a slot released by the caller may still be read by work the caller queued
//! on its device (kernels on torch's stream). [`CopyBackend::record_fence`] marks that point
//! on the caller's stream, and [`CopyBackend::wait_fence`] orders the copies submitted after it
//! behind the mark: on CUDA an event and `cuStreamWaitEvent` (the device waits, the host does
//! not); on the host backends the caller's reads are done when it releases (CPU compute is
//! synchronous), so a fence is a [`Fence::Marker`] and waiting on it does nothing.
//!
//! Threads: `submit`, `wait_fence` and `finish` run on the engine's worker thread,
//! `record_fence` on the caller's.

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

/// A point in the work a caller queued that reads released slots (see the module doc).
#[derive(Debug)]
pub enum Fence {
    /// Nothing to wait for on the device: the caller's reads were done when it released. The
    /// number names the mark for the backend that made it (a test backend's sequence), 0 for
    /// the host backends.
    Marker(u64),
    /// A CUDA event recorded on the caller's stream.
    Event(crate::cuda::Event),
}

/// A way to copy expert blocks host → destination.
pub trait CopyBackend: Send + Sync + std::fmt::Debug {
    /// The name the backend was created with (`host`, `simulated:12:5`, `cuda`, `cuda:1`).
    fn name(&self) -> String;
    /// The CUDA device its destination lives on; `None` for a host destination.
    fn device_ordinal(&self) -> Option<i32> {
        None
    }
    /// Marks the end of the work queued so far on the caller's `stream` (a raw stream handle
    /// of the backend's device; 0 is its default stream). The default: a `Marker(0)`.
    ///
    /// # Safety
    /// 1. On a device backend, `stream` is 0 or a stream of the backend's device that stays
    ///    live for the call. Host backends never use it.
    #[allow(unsafe_code)]
    unsafe fn record_fence(&self, stream: u64) -> Result<Fence> {
        let _ = stream;
        Ok(Fence::Marker(0))
    }
    /// Makes every copy submitted after this call start only once `fence` fired, without
    /// blocking the calling thread. The default does nothing (host backends).
    fn wait_fence(&self, fence: &Fence) -> Result<()> {
        let _ = fence;
        Ok(())
    }
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

/// A copy backend's spec, parsed and checked (`parse_spec`): what `create_backend` builds.
#[derive(Debug, Clone, PartialEq)]
pub enum BackendSpec {
    /// `host` (or `cpu`): threaded memcpy.
    Host,
    /// `simulated:GBPS[:LATENCY_US]`: bandwidth > 0, latency >= 0, both finite.
    Simulated {
        /// GB/s (1e9 bytes/s).
        gbps: f64,
        /// Per-copy latency, µs.
        latency_us: f64,
    },
    /// `cuda` (device 0) or `cuda:N`.
    Cuda {
        /// Device ordinal, >= 0 (whether the driver sees it is checked when it is built).
        ordinal: i32,
    },
}

/// Parses and checks a backend spec without building anything (no driver is loaded): `host`,
/// `simulated:GBPS[:LATENCY_US]`, `cuda` or `cuda:N`. Every error is `Config`.
pub fn parse_spec(spec: &str) -> Result<BackendSpec> {
    let mut parts = spec.split(':');
    match parts.next().unwrap_or("") {
        "host" | "cpu" if parts.next().is_none() => Ok(BackendSpec::Host),
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
            let latency_us = num(parts.next(), Some(0.0))?;
            if parts.next().is_some() {
                return Err(CoreError::Config(format!(
                    "trailing fields in backend spec {spec:?}"
                )));
            }
            if !(gbps > 0.0 && gbps.is_finite() && latency_us >= 0.0 && latency_us.is_finite()) {
                return Err(CoreError::Config(format!(
                    "simulated link needs bandwidth > 0 and latency >= 0, got {gbps} GB/s, {latency_us} us"
                )));
            }
            Ok(BackendSpec::Simulated { gbps, latency_us })
        }
        "cuda" => match (parts.next(), parts.next()) {
            (None, _) => Ok(BackendSpec::Cuda { ordinal: 0 }),
            (Some(n), None) => n
                .parse::<i64>()
                .map_err(|_| {
                    CoreError::Config(format!("bad device ordinal {n:?} in backend spec {spec:?}"))
                })
                .and_then(crate::cuda::check_ordinal)
                .map(|ordinal| BackendSpec::Cuda { ordinal }),
            (Some(_), Some(_)) => Err(CoreError::Config(format!(
                "trailing fields in backend spec {spec:?}"
            ))),
        },
        _ => Err(CoreError::Config(format!(
            "unknown backend {spec:?}: expected host, simulated:GBPS[:LATENCY_US] or cuda[:N]"
        ))),
    }
}

/// Builds a backend from its spec (`parse_spec`). A bad spec or ordinal is `Config`, checked
/// before the driver is loaded; a device the driver does not see is `Config`, no driver
/// `DriverUnavailable`.
pub fn create_backend(
    spec: &str,
    clock: Arc<dyn Clock>,
    threads: usize,
) -> Result<Arc<dyn CopyBackend>> {
    match parse_spec(spec)? {
        BackendSpec::Host => Ok(Arc::new(HostBackend { threads })),
        BackendSpec::Simulated { gbps, latency_us } => Ok(Arc::new(SimulatedBackend::new(
            gbps, latency_us, clock, threads,
        )?)),
        BackendSpec::Cuda { ordinal } => Ok(Arc::new(crate::cuda::CudaBackend::new(ordinal)?)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::clock::RealClock;

    fn spec(s: &str) -> Result<Arc<dyn CopyBackend>> {
        create_backend(s, Arc::new(RealClock::new()), 1)
    }

    #[test]
    fn bad_cuda_ordinals_are_config_errors_before_the_driver_is_loaded() {
        for s in [
            "cuda:",
            "cuda:x",
            "cuda:-1",
            "cuda:1.5",
            "cuda:99999999999",
            "cuda:0:1",
        ] {
            assert!(matches!(spec(s), Err(CoreError::Config(_))), "{s}");
        }
    }

    #[test]
    fn a_cuda_ordinal_needs_the_driver_then_a_device_of_that_number() {
        for s in ["cuda", "cuda:0", "cuda:3"] {
            match (crate::cuda::device_count(), spec(s)) {
                (Err(_), r) => assert!(matches!(r, Err(CoreError::DriverUnavailable(_))), "{s}"),
                (Ok(n), r) => {
                    let want: i32 = s.strip_prefix("cuda:").map_or(0, |n| n.parse().unwrap());
                    if want >= n {
                        assert!(matches!(r, Err(CoreError::Config(_))), "{s}");
                    } else {
                        let b = r.unwrap();
                        assert_eq!(b.device_ordinal(), Some(want));
                    }
                }
            }
        }
    }

    #[test]
    fn specs_parse_without_building_and_bad_ones_are_config_errors() {
        assert_eq!(parse_spec("host").unwrap(), BackendSpec::Host);
        assert_eq!(
            parse_spec("simulated:0.5:20").unwrap(),
            BackendSpec::Simulated {
                gbps: 0.5,
                latency_us: 20.0
            }
        );
        assert_eq!(
            parse_spec("cuda:2").unwrap(),
            BackendSpec::Cuda { ordinal: 2 }
        );
        for s in [
            "",
            "bogus",
            "host:1",
            "simulated",
            "simulated:0",
            "simulated:-1",
            "simulated:abc",
            "simulated:inf",
            "simulated:1:-5",
            "simulated:1:2:3",
            "cuda:-1",
        ] {
            assert!(matches!(parse_spec(s), Err(CoreError::Config(_))), "{s:?}");
        }
    }

    #[test]
    fn host_backends_copy_into_host_memory_and_fence_with_markers() {
        for s in ["host", "simulated:1"] {
            let b = spec(s).unwrap();
            assert_eq!(b.device_ordinal(), None);
            #[allow(unsafe_code)]
            // SAFETY: host backends never use the stream handle (point 1 of `record_fence`).
            let f = unsafe { b.record_fence(12345) }.unwrap();
            assert!(matches!(f, Fence::Marker(0)));
            b.wait_fence(&f).unwrap();
        }
    }
}
