//! ftrs-core: the Rust half of ftrs (DESIGN.md "The Rust core"), with no Python in it.
//!
//! - [`layout`]: where each (layer, expert, tensor) lives in the host pool.
//! - [`pool`]: the page-aligned host pool and its safetensors loader.
//! - [`cache`]: the device slot cache (LRU, frequency-aware LRU, Belady) and its simulator.
//! - [`transfer`]: the transfer engine: lookups, demand/prefetch queues, tickets, budget, pacing.
//! - [`backend`] / [`cuda`]: how bytes move (host memcpy, simulated link, CUDA driver).
//! - [`clock`]: real and virtual time, token bucket.
//! - [`recorder`]: the lock-free flight recorder.
//! - [`quant`]: quantized CPU matmul over GGUF blocks (SIMD in `quant::simd`), multi-threaded.
//! - [`ops`]: the small fp32 ops of a CPU decode step (RMSNorm, rotary, decode attention).
//! - [`raw`]: the only module with raw-pointer code besides the CUDA FFI.
//!
//! Unsafe code is denied crate-wide and allowed only in `raw`, `cuda`, `quant::simd` and
//! `quant::pool` (a call's task function lent to the kernel workers), plus
//! the one call of the `unsafe fn CopyBackend::submit` in `transfer::worker` and the one of
//! `unsafe fn CopyBackend::record_fence` in `TransferEngine::release_after` (a raw stream
//! handle of the caller's); every other module forbids it.
//!
//! Soundness from safe code rests on four rules: the host pool is written only through `&mut`
//! (filled before an engine shares it behind an `Arc`, read-only after); a `raw::CopyJob<'a>`
//! borrows the region it copies from, so it cannot outlive it (a `compile_fail` doctest shows
//! it); every function that takes a raw address is an `unsafe fn` with a numbered `# Safety`
//! list, including an asynchronous backend's `submit`, whose copy outlives that borrow; and the
//! transfer worker finishes every copy it started, even after a panic, before its engine lets
//! go of the pool. A worker panic reaches every waiter as `CoreError::WorkerPanic`.

#![deny(unsafe_code)]

pub mod backend;
pub mod cache;
pub mod clock;
pub mod cuda;
pub mod error;
pub mod layout;
pub mod ops;
pub mod pool;
pub mod quant;
pub mod raw;
pub mod recorder;
pub mod transfer;

pub use backend::{create_backend, parse_spec, BackendSpec, CopyBackend};
pub use cache::{simulate, Key, Policy, SlotCache};
pub use clock::{Clock, RealClock, TokenBucket, VirtualClock};
pub use error::{CoreError, DeviceFault, Result};
pub use layout::ExpertLayout;
pub use pool::{ExpertPool, FillEntry, PoolDtype, RawFillEntry};
pub use raw::{Destination, MemKind};
pub use recorder::{FlightRecorder, StepKind, StepRecord};
pub use transfer::{EngineConfig, Stats, TransferEngine};
