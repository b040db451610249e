//! The CUDA driver API, loaded at run time from `libcuda.so.1` with `libloading`, so the wheel
//! builds and imports on hosts with no CUDA at all (creating the backend then fails cleanly with
//! [`CoreError::DriverUnavailable`]).
//!
//! Three layers, like cudarc: (1) `Api`, the raw `extern "C"` function pointers, resolved
//! once per process and kept forever (the library is never unloaded); (2) `check`, which turns
//! a `CUresult` into a typed error (`CUDA_ERROR_OUT_OF_MEMORY` → OutOfMemory, anything else →
//! KernelFault: a CUDA error alone is not evidence of a lost device, DESIGN.md "Errors");
//! (3) safe RAII types [`Event`], `Stream`, `PrimaryContext` and the [`CudaBackend`], which
//! copies with `cuMemcpyHtoDAsync_v2` on its own stream and records one event per copy.
//!
//! Devices: everything takes a device ordinal (`cuda:N`), checked against `cuDeviceGetCount`
//! (`Config` when out of range) and served by that device's primary context, the one torch's
//! runtime uses for `cuda:N`. The transfer worker (a thread of ours) makes it current with
//! `cuCtxSetCurrent`; a call on a caller's thread (backend creation, release fences, host
//! registration, timed copies) pushes it for the call and pops it after
//! (`cuCtxPushCurrent_v2` / `cuCtxPopCurrent_v2`), so torch's current device on that thread
//! is left as it was.
//!
//! Release fences ([`crate::backend::Fence`]): `record_fence` records an event of ours on the
//! caller's stream (torch's current stream); `wait_fence` makes the copy stream wait for it
//! with `cuStreamWaitEvent`, on the device: the host never blocks. The wait takes the event's
//! state at the time of the call, so the event may be destroyed right after. A stream that is
//! capturing a CUDA graph is refused (`Config`): the record would become a node of the graph.
//!
//! [`measure_copy`] (module `measure`) times single copies either way (`cuMemcpyHtoDAsync_v2`
//! or `cuMemcpyDtoHAsync_v2`) through the same stream and event types, for the link probe and
//! the benches. It refuses a host range the driver does not know as pinned
//! (`cuPointerGetAttribute`): a pageable copy is staged through a bounce buffer and would
//! measure that, not the link.

#![allow(unsafe_code)]

use std::ffi::{c_char, c_int, c_uint, c_void, CStr};
use std::sync::OnceLock;

use crate::backend::{Completion, CopyBackend, Fence};
use crate::error::{CoreError, DeviceFault, Result};
use crate::raw::{CopyJob, MemKind};

mod measure;
pub use measure::{measure_copy, Direction};

type CuResult = c_int;
type CuDevice = c_int;
type CuContext = *mut c_void;
type CuStream = *mut c_void;
type CuEvent = *mut c_void;
type CuDevicePtr = u64;

const CUDA_SUCCESS: CuResult = 0;
const CUDA_ERROR_INVALID_VALUE: CuResult = 1;
const CUDA_ERROR_OUT_OF_MEMORY: CuResult = 2;
const CUDA_ERROR_NOT_READY: CuResult = 600;
const CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED: CuResult = 712;
const CU_STREAM_NON_BLOCKING: c_uint = 1;
const CU_STREAM_CAPTURE_STATUS_NONE: c_int = 0;
const CU_EVENT_DISABLE_TIMING: c_uint = 2;
const CU_MEMHOSTREGISTER_PORTABLE: c_uint = 1;
const CU_POINTER_ATTRIBUTE_MEMORY_TYPE: c_int = 2;
const CU_MEMORYTYPE_HOST: c_uint = 1;
const CU_MEMORYTYPE_DEVICE: c_uint = 2;

/// Raw driver entry points. Every pointer came from the same `libcuda.so.1`, which `_lib`
/// keeps loaded; the value lives in a process-wide `OnceLock`, so the pointers never dangle.
#[derive(Debug)]
struct Api {
    /// Keeps the library mapped for the life of the process.
    _lib: libloading::Library,
    init: unsafe extern "C" fn(c_uint) -> CuResult,
    device_get_count: unsafe extern "C" fn(*mut c_int) -> CuResult,
    device_get: unsafe extern "C" fn(*mut CuDevice, c_int) -> CuResult,
    primary_ctx_retain: unsafe extern "C" fn(*mut CuContext, CuDevice) -> CuResult,
    primary_ctx_release: unsafe extern "C" fn(CuDevice) -> CuResult,
    ctx_set_current: unsafe extern "C" fn(CuContext) -> CuResult,
    ctx_push_current: unsafe extern "C" fn(CuContext) -> CuResult,
    ctx_pop_current: unsafe extern "C" fn(*mut CuContext) -> CuResult,
    stream_create: unsafe extern "C" fn(*mut CuStream, c_uint) -> CuResult,
    stream_destroy: unsafe extern "C" fn(CuStream) -> CuResult,
    memcpy_htod_async:
        unsafe extern "C" fn(CuDevicePtr, *const c_void, usize, CuStream) -> CuResult,
    memcpy_dtoh_async: unsafe extern "C" fn(*mut c_void, CuDevicePtr, usize, CuStream) -> CuResult,
    pointer_get_attribute: unsafe extern "C" fn(*mut c_void, c_int, CuDevicePtr) -> CuResult,
    event_create: unsafe extern "C" fn(*mut CuEvent, c_uint) -> CuResult,
    event_record: unsafe extern "C" fn(CuEvent, CuStream) -> CuResult,
    stream_wait_event: unsafe extern "C" fn(CuStream, CuEvent, c_uint) -> CuResult,
    stream_is_capturing: unsafe extern "C" fn(CuStream, *mut c_int) -> CuResult,
    event_synchronize: unsafe extern "C" fn(CuEvent) -> CuResult,
    event_query: unsafe extern "C" fn(CuEvent) -> CuResult,
    event_destroy: unsafe extern "C" fn(CuEvent) -> CuResult,
    host_register: unsafe extern "C" fn(*mut c_void, usize, c_uint) -> CuResult,
    host_unregister: unsafe extern "C" fn(*mut c_void) -> CuResult,
    get_error_string: unsafe extern "C" fn(CuResult, *mut *const c_char) -> CuResult,
}

impl Api {
    /// Loads the driver and resolves every symbol.
    fn load() -> std::result::Result<Self, String> {
        // SAFETY: loading libcuda runs its initialisers, which have no preconditions; the
        // library is the NVIDIA driver, not arbitrary code chosen by a user.
        let lib = unsafe { libloading::Library::new("libcuda.so.1") }
            .map_err(|e| format!("CUDA driver not found (libcuda.so.1: {e})"))?;
        macro_rules! sym {
            ($name:literal) => {
                // SAFETY: the symbol is declared in cuda.h with exactly the field's signature;
                // the pointer stays valid while `lib` is loaded, and `lib` moves into `Api`.
                *unsafe { lib.get(concat!($name, "\0").as_bytes()) }
                    .map_err(|e| format!("CUDA driver lacks {}: {e}", $name))?
            };
        }
        Ok(Self {
            init: sym!("cuInit"),
            device_get_count: sym!("cuDeviceGetCount"),
            device_get: sym!("cuDeviceGet"),
            primary_ctx_retain: sym!("cuDevicePrimaryCtxRetain"),
            primary_ctx_release: sym!("cuDevicePrimaryCtxRelease_v2"),
            ctx_set_current: sym!("cuCtxSetCurrent"),
            ctx_push_current: sym!("cuCtxPushCurrent_v2"),
            ctx_pop_current: sym!("cuCtxPopCurrent_v2"),
            stream_create: sym!("cuStreamCreate"),
            stream_destroy: sym!("cuStreamDestroy_v2"),
            memcpy_htod_async: sym!("cuMemcpyHtoDAsync_v2"),
            memcpy_dtoh_async: sym!("cuMemcpyDtoHAsync_v2"),
            pointer_get_attribute: sym!("cuPointerGetAttribute"),
            event_create: sym!("cuEventCreate"),
            event_record: sym!("cuEventRecord"),
            stream_wait_event: sym!("cuStreamWaitEvent"),
            stream_is_capturing: sym!("cuStreamIsCapturing"),
            event_synchronize: sym!("cuEventSynchronize"),
            event_query: sym!("cuEventQuery"),
            event_destroy: sym!("cuEventDestroy_v2"),
            host_register: sym!("cuMemHostRegister_v2"),
            host_unregister: sym!("cuMemHostUnregister"),
            get_error_string: sym!("cuGetErrorString"),
            _lib: lib,
        })
    }

    /// Layer 2: a `CUresult` as a typed error naming the call.
    fn check(&self, r: CuResult, call: &str) -> Result<()> {
        if r == CUDA_SUCCESS {
            return Ok(());
        }
        let mut msg: *const c_char = std::ptr::null();
        // SAFETY: `msg` is a valid out-pointer; the driver stores a static string or nothing.
        let text =
            if unsafe { (self.get_error_string)(r, &mut msg) } == CUDA_SUCCESS && !msg.is_null() {
                // SAFETY: on success the driver returned a NUL-terminated static string.
                unsafe { CStr::from_ptr(msg) }
                    .to_string_lossy()
                    .into_owned()
            } else {
                "unknown error".to_string()
            };
        let kind = if r == CUDA_ERROR_OUT_OF_MEMORY {
            DeviceFault::OutOfMemory
        } else {
            DeviceFault::KernelFault
        };
        Err(CoreError::Device {
            kind,
            source_name: "copy_backend",
            injected: false,
            detail: format!("{call} failed: CUresult {r} ({text})"),
        })
    }
}

/// The process-wide driver, initialised with `cuInit(0)`.
fn api() -> Result<&'static Api> {
    static API: OnceLock<std::result::Result<Api, String>> = OnceLock::new();
    let api = API
        .get_or_init(|| {
            let api = Api::load()?;
            // SAFETY: cuInit has no preconditions; flags must be 0.
            let r = unsafe { (api.init)(0) };
            if r != CUDA_SUCCESS {
                return Err(format!(
                    "CUDA driver found but cuInit failed (CUresult {r})"
                ));
            }
            Ok(api)
        })
        .as_ref()
        .map_err(|e| CoreError::DriverUnavailable(e.clone()))?;
    Ok(api)
}

/// True when the driver loads and sees at least one device.
pub fn available() -> bool {
    device_count().is_ok_and(|n| n > 0)
}

/// Devices the driver sees; `DriverUnavailable` without a driver.
pub fn device_count() -> Result<i32> {
    let api = api()?;
    let mut n: c_int = 0;
    // SAFETY: `n` is a valid out-pointer.
    api.check(
        unsafe { (api.device_get_count)(&mut n) },
        "cuDeviceGetCount",
    )?;
    Ok(n)
}

/// A device ordinal from a caller's integer (`cuda:N`, a torch device index): `Config` unless
/// it is in `0..=i32::MAX`. Whether the device exists is checked when it is opened.
pub fn check_ordinal(n: i64) -> Result<i32> {
    i32::try_from(n).ok().filter(|&o| o >= 0).ok_or_else(|| {
        CoreError::Config(format!("bad CUDA device ordinal {n}: expected 0 or more"))
    })
}

/// A retained primary context of one device; released on drop.
#[derive(Debug)]
struct PrimaryContext {
    /// The driver.
    api: &'static Api,
    /// Device ordinal handle.
    device: CuDevice,
    /// The retained context; valid until `drop` releases it.
    ctx: CuContext,
}

impl PrimaryContext {
    /// Retains device `ordinal`'s primary context: `Config` for a negative ordinal (before
    /// the driver is loaded) or one the driver does not see, `DriverUnavailable` without a
    /// driver.
    fn retain(ordinal: i32) -> Result<Self> {
        check_ordinal(i64::from(ordinal))?;
        let api = api()?;
        let count = device_count()?;
        if ordinal >= count {
            return Err(CoreError::Config(format!(
                "CUDA device {ordinal} does not exist: the driver sees {count} device(s)"
            )));
        }
        let mut device: CuDevice = 0;
        // SAFETY: `device` is a valid out-pointer.
        api.check(
            unsafe { (api.device_get)(&mut device, ordinal) },
            "cuDeviceGet",
        )?;
        let mut ctx: CuContext = std::ptr::null_mut();
        // SAFETY: `ctx` is a valid out-pointer; `device` came from cuDeviceGet.
        api.check(
            unsafe { (api.primary_ctx_retain)(&mut ctx, device) },
            "cuDevicePrimaryCtxRetain",
        )?;
        Ok(Self { api, device, ctx })
    }

    /// Makes the context current on the calling thread (cheap; done before every call batch).
    /// Only on threads of ours (the transfer worker): elsewhere use [`Self::push`].
    fn make_current(&self) -> Result<()> {
        // SAFETY: `ctx` is retained (valid) until drop.
        self.api.check(
            unsafe { (self.api.ctx_set_current)(self.ctx) },
            "cuCtxSetCurrent",
        )
    }

    /// Makes the context current on the calling thread until the returned guard drops, which
    /// restores the thread's previous context (a caller's thread: torch's current device).
    fn push(&self) -> Result<Pushed<'_>> {
        // SAFETY: `ctx` is retained (valid) until drop, which the guard's borrow outlives.
        self.api.check(
            unsafe { (self.api.ctx_push_current)(self.ctx) },
            "cuCtxPushCurrent_v2",
        )?;
        Ok(Pushed(self))
    }
}

/// A context pushed on the calling thread's stack by [`PrimaryContext::push`]; popped on drop.
struct Pushed<'a>(&'a PrimaryContext);

impl Drop for Pushed<'_> {
    fn drop(&mut self) {
        let mut popped: CuContext = std::ptr::null_mut();
        // SAFETY: balances the push of `PrimaryContext::push` on this thread (the guard is not
        // `Send`); `popped` is a valid out-pointer. An error at this point leaves nothing to do.
        unsafe { (self.0.api.ctx_pop_current)(&mut popped) };
        debug_assert!(popped.is_null() || popped == self.0.ctx);
    }
}

impl Drop for PrimaryContext {
    fn drop(&mut self) {
        // SAFETY: balances the retain in `retain`; errors at teardown are ignored.
        unsafe { (self.api.primary_ctx_release)(self.device) };
    }
}

/// A non-blocking stream; destroyed on drop.
#[derive(Debug)]
struct Stream {
    /// The driver.
    api: &'static Api,
    /// Valid stream handle until drop.
    raw: CuStream,
}

impl Stream {
    /// A new stream of `ctx`, which the caller made current on this thread.
    fn new(ctx: &PrimaryContext) -> Result<Self> {
        let mut raw: CuStream = std::ptr::null_mut();
        // SAFETY: `raw` is a valid out-pointer and a context is current.
        ctx.api.check(
            unsafe { (ctx.api.stream_create)(&mut raw, CU_STREAM_NON_BLOCKING) },
            "cuStreamCreate",
        )?;
        Ok(Self { api: ctx.api, raw })
    }

    /// Queues one copy of `len` bytes between `device` and `host` in direction `dir`.
    ///
    /// # Safety
    /// 1. The stream's context is current on the calling thread.
    /// 2. `host..host+len` is host memory and `device..device+len` device memory of that
    ///    context, both allocated until the copy completed (an event recorded after it fired).
    /// 3. Until then nobody else writes either range, nor reads the destination range.
    unsafe fn copy(
        &self,
        dir: Direction,
        device: CuDevicePtr,
        host: usize,
        len: usize,
    ) -> Result<()> {
        let api = self.api;
        match dir {
            Direction::HostToDevice => {
                // SAFETY: points 1-3 of this function's contract.
                let r = unsafe {
                    (api.memcpy_htod_async)(device, host as *const c_void, len, self.raw)
                };
                api.check(r, "cuMemcpyHtoDAsync_v2")
            }
            Direction::DeviceToHost => {
                // SAFETY: points 1-3 of this function's contract.
                let r =
                    unsafe { (api.memcpy_dtoh_async)(host as *mut c_void, device, len, self.raw) };
                api.check(r, "cuMemcpyDtoHAsync_v2")
            }
        }
    }
}

impl Drop for Stream {
    fn drop(&mut self) {
        // SAFETY: `raw` is a live stream; the driver waits for pending work before freeing it.
        unsafe { (self.api.stream_destroy)(self.raw) };
    }
}

/// A recorded event marking the end of one copy; destroyed on drop.
#[derive(Debug)]
pub struct Event {
    /// The driver.
    api: &'static Api,
    /// Valid event handle until drop.
    raw: CuEvent,
}

// SAFETY: CUDA driver handles may be used from any thread once a context is current there;
// `Event` only calls synchronize/query/destroy and is waited on by `cuStreamWaitEvent`, each
// thread-safe in the driver.
unsafe impl Send for Event {}
// SAFETY: as above: no method mutates Rust-side state, and the driver calls are thread-safe.
unsafe impl Sync for Event {}

impl Event {
    /// A new event recorded on `stream`: it fires once the work queued there so far is done.
    /// The stream's context must be current on the calling thread.
    fn record(stream: &Stream) -> Result<Self> {
        // SAFETY: `stream.raw` is a live stream of the current context (caller).
        unsafe { Self::record_raw(stream.api, stream.raw) }
    }

    /// A new event recorded on the raw stream handle `stream`.
    ///
    /// # Safety
    /// 1. A context is current on the calling thread, and `stream` is null (that context's
    ///    default stream) or a live stream of that context.
    unsafe fn record_raw(api: &'static Api, stream: CuStream) -> Result<Self> {
        let mut raw: CuEvent = std::ptr::null_mut();
        // SAFETY: `raw` is a valid out-pointer and a context is current (point 1).
        api.check(
            unsafe { (api.event_create)(&mut raw, CU_EVENT_DISABLE_TIMING) },
            "cuEventCreate",
        )?;
        let event = Self { api, raw };
        // SAFETY: the event is live; the stream is live in the current context (point 1).
        api.check(
            unsafe { (api.event_record)(event.raw, stream) },
            "cuEventRecord",
        )?;
        Ok(event)
    }

    /// Blocks until the event fires.
    fn synchronize(&self) -> Result<()> {
        // SAFETY: `raw` is a live event.
        self.api.check(
            unsafe { (self.api.event_synchronize)(self.raw) },
            "cuEventSynchronize",
        )
    }
    /// True once the event fired (non-blocking).
    pub fn is_done(&self) -> Result<bool> {
        // SAFETY: `raw` is a live event.
        let r = unsafe { (self.api.event_query)(self.raw) };
        if r == CUDA_ERROR_NOT_READY {
            return Ok(false);
        }
        self.api.check(r, "cuEventQuery").map(|()| true)
    }
}

impl Drop for Event {
    fn drop(&mut self) {
        // SAFETY: `raw` is a live event, destroyed once.
        unsafe { (self.api.event_destroy)(self.raw) };
    }
}

/// Asynchronous host → device copies on a dedicated stream of device `ordinal`.
#[derive(Debug)]
pub struct CudaBackend {
    /// Copies are issued here; declared before `ctx` so it is destroyed first.
    stream: Stream,
    /// The device's primary context: made current on the worker before each call, pushed for
    /// the calls on a caller's thread.
    ctx: PrimaryContext,
    /// The device (`cuda:N`); exists (checked by `new`).
    ordinal: i32,
}

// SAFETY: the handles are thread-safe driver objects; every method makes the context current
// on the calling thread before using them.
unsafe impl Send for CudaBackend {}
// SAFETY: as above; the driver serialises work on a stream internally.
unsafe impl Sync for CudaBackend {}

impl CudaBackend {
    /// Opens device `ordinal`; `DriverUnavailable` without a driver, `Config` for a device the
    /// driver does not see.
    pub fn new(ordinal: i32) -> Result<Self> {
        let ctx = PrimaryContext::retain(ordinal)?;
        let pushed = ctx.push()?;
        let stream = Stream::new(&ctx);
        drop(pushed);
        Ok(Self {
            stream: stream?,
            ctx,
            ordinal,
        })
    }
}

impl CopyBackend for CudaBackend {
    fn name(&self) -> String {
        if self.ordinal == 0 {
            "cuda".into()
        } else {
            format!("cuda:{}", self.ordinal)
        }
    }

    fn device_ordinal(&self) -> Option<i32> {
        Some(self.ordinal)
    }

    unsafe fn record_fence(&self, stream: u64) -> Result<Fence> {
        let _pushed = self.ctx.push()?;
        let api = self.ctx.api;
        let raw = stream as usize as CuStream;
        // A record on a capturing stream would be a node of the graph, and the copy stream's
        // wait on it would pull the copy stream into the capture: refused.
        let mut capture: c_int = CU_STREAM_CAPTURE_STATUS_NONE;
        // SAFETY: the context is current; `raw` is 0 or a live stream of it (point 1 of
        // `CopyBackend::record_fence`); `capture` is a valid out-pointer.
        api.check(
            unsafe { (api.stream_is_capturing)(raw, &mut capture) },
            "cuStreamIsCapturing",
        )?;
        if capture != CU_STREAM_CAPTURE_STATUS_NONE {
            return Err(CoreError::Config(
                "a release fence cannot be recorded on a stream capturing a CUDA graph: \
                 release the slots outside the captured region"
                    .into(),
            ));
        }
        // SAFETY: this device's context is current (pushed above); `raw` is 0 or a live
        // stream of this device (point 1 of `CopyBackend::record_fence`), i.e. of its primary
        // context, the one torch's runtime uses.
        let event = unsafe { Event::record_raw(api, raw) }?;
        Ok(Fence::Event(event))
    }

    fn wait_fence(&self, fence: &Fence) -> Result<()> {
        let Fence::Event(event) = fence else {
            return Ok(());
        };
        self.ctx.make_current()?;
        let api = self.ctx.api;
        // SAFETY: the context is current; both handles are live (the event until `fence`
        // drops, which is after this call: the wait takes the event's state now). Flags: 0.
        api.check(
            unsafe { (api.stream_wait_event)(self.stream.raw, event.raw, 0) },
            "cuStreamWaitEvent",
        )
    }

    unsafe fn submit(&self, job: &CopyJob<'_>) -> Result<Completion> {
        if job.kind() != MemKind::Device {
            return Err(CoreError::Config(
                "cuda backend needs a device destination".into(),
            ));
        }
        self.ctx.make_current()?;
        // SAFETY: the context is current (above); `CopyJob` guarantees both ranges are in
        // bounds; the caller keeps the source region allocated and unwritten, and the
        // destination untouched, until `finish` returned for the completion recorded below
        // (point 1 of `CopyBackend::submit`); the destination is device memory per
        // `Destination::new`'s contract.
        unsafe {
            self.stream.copy(
                Direction::HostToDevice,
                job.dst() as CuDevicePtr,
                job.src(),
                job.len(),
            )
        }?;
        Ok(Completion::Event(Event::record(&self.stream)?))
    }

    fn finish(&self, c: Completion) -> Result<()> {
        match c {
            Completion::Event(e) => {
                self.ctx.make_current()?;
                e.synchronize()
            }
            _ => Ok(()),
        }
    }
}

/// Page-locks `len` bytes at `addr` for DMA (`cuMemHostRegister_v2`, portable: every context
/// sees it pinned) through device `ordinal`'s primary context, so no context is created on a
/// device the caller does not use. `Ok(true)` when this call registered the range, `Ok(false)`
/// when it was registered already; `DriverUnavailable` without a driver, `Config` for a
/// device the driver does not see.
///
/// # Safety
/// 1. `addr..addr+len` is one live host allocation of this process.
/// 2. It stays allocated until [`host_unregister`] has been called for `addr` with the same
///    `ordinal` (the driver keeps the registration, and may DMA from the range, until then).
pub unsafe fn host_register(ordinal: i32, addr: usize, len: usize) -> Result<bool> {
    let ctx = PrimaryContext::retain(ordinal)?;
    let pushed = ctx.push()?;
    // SAFETY: the context is current (above); the range is a live host allocation that outlives
    // the registration (points 1-2 of this function's contract).
    let r =
        unsafe { (ctx.api.host_register)(addr as *mut c_void, len, CU_MEMHOSTREGISTER_PORTABLE) };
    drop(pushed);
    if r == CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED {
        return Ok(false);
    }
    ctx.api.check(r, "cuMemHostRegister_v2")?;
    // The registration belongs to the context; keep the primary context retained for the
    // process so the pinning stays valid.
    std::mem::forget(ctx);
    Ok(true)
}

/// Undoes [`host_register`] before the memory at `addr` is freed. Errors are ignored: this
/// runs at teardown, where the device may already be gone.
///
/// # Safety
/// 1. `addr` is the start of a range registered by [`host_register`] through device
///    `ordinal`, still allocated.
/// 2. No copy from or to that range is in flight on any stream (the pages stop being locked).
pub unsafe fn host_unregister(ordinal: i32, addr: usize) {
    if let Ok(ctx) = PrimaryContext::retain(ordinal) {
        if let Ok(_pushed) = ctx.push() {
            // SAFETY: the context is current; `addr` is a registered, live range with no copy in
            // flight (points 1-2 of this function's contract).
            unsafe { (ctx.api.host_unregister)(addr as *mut c_void) };
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn missing_driver_is_a_typed_error_not_a_crash() {
        if available() {
            return; // a GPU host: nothing to check here
        }
        assert!(matches!(
            CudaBackend::new(0),
            Err(CoreError::DriverUnavailable(_)) | Err(CoreError::Device { .. })
        ));
    }

    #[test]
    fn negative_or_huge_ordinals_are_config_errors_before_the_driver_is_loaded() {
        assert_eq!(check_ordinal(3).unwrap(), 3);
        for bad in [-1, i64::from(i32::MIN), 1 << 40] {
            assert!(
                matches!(check_ordinal(bad), Err(CoreError::Config(_))),
                "{bad}"
            );
        }
        assert!(matches!(CudaBackend::new(-2), Err(CoreError::Config(_))));
        let mut host = vec![0u8; 64];
        let h = host.as_mut_ptr() as usize;
        // SAFETY: the ordinal fails the argument checks, before the driver is loaded and before
        // any memory is touched.
        let r = unsafe { measure_copy(-1, Direction::HostToDevice, 1 << 40, h, 64, 1) };
        assert!(matches!(r, Err(CoreError::Config(_))), "{r:?}");
        // SAFETY: as above: refused before the driver is loaded.
        let r = unsafe { host_register(-1, h, 64) };
        assert!(matches!(r, Err(CoreError::Config(_))), "{r:?}");
    }

    #[test]
    fn an_ordinal_past_the_last_device_is_a_config_error() {
        let Ok(n) = device_count() else {
            assert!(matches!(
                CudaBackend::new(1),
                Err(CoreError::DriverUnavailable(_))
            ));
            return; // no driver: which devices exist is unknown
        };
        assert!(matches!(CudaBackend::new(n), Err(CoreError::Config(_))));
    }
}
