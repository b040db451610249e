//! Single copies timed on the host clock, either way, through the same stream and event types
//! as the copy backend ([`measure_copy`]), for the link probe and the benches. A host range the
//! driver does not know as pinned is refused (`cuPointerGetAttribute`): a pageable copy is
//! staged through a bounce buffer and would measure that, not the link.

#![allow(unsafe_code)]

use std::ffi::c_uint;

use super::{
    check_ordinal, Api, CuDevicePtr, Event, PrimaryContext, Stream, CUDA_ERROR_INVALID_VALUE,
    CU_MEMORYTYPE_DEVICE, CU_MEMORYTYPE_HOST, CU_POINTER_ATTRIBUTE_MEMORY_TYPE,
};
use crate::error::{CoreError, Result};

/// Which way a copy of [`measure_copy`] goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Direction {
    /// Host → device (`cuMemcpyHtoDAsync_v2`), as the backend copies expert blocks.
    HostToDevice,
    /// Device → host (`cuMemcpyDtoHAsync_v2`).
    DeviceToHost,
}

impl Direction {
    /// `h2d` or `d2h`.
    pub fn name(self) -> &'static str {
        match self {
            Self::HostToDevice => "h2d",
            Self::DeviceToHost => "d2h",
        }
    }
}

/// The driver's memory type (`CU_MEMORYTYPE_*`) of the byte at `addr`; `None` for memory the
/// driver does not know (pageable host memory, or no allocation at all).
fn memory_type(api: &Api, addr: CuDevicePtr) -> Result<Option<c_uint>> {
    let mut kind: c_uint = 0;
    // SAFETY: `kind` is a valid out-pointer of the size this attribute writes (a CUmemorytype
    // enum); the driver only looks `addr` up in its tables, it never dereferences it.
    let r = unsafe {
        (api.pointer_get_attribute)(
            (&mut kind as *mut c_uint).cast(),
            CU_POINTER_ATTRIBUTE_MEMORY_TYPE,
            addr,
        )
    };
    if r == CUDA_ERROR_INVALID_VALUE {
        return Ok(None);
    }
    api.check(r, "cuPointerGetAttribute")?;
    Ok(Some(kind))
}

/// `Config` unless the first and the last byte of `addr..addr+len` are memory of type `want`.
fn require_memory(api: &Api, addr: CuDevicePtr, len: usize, want: c_uint) -> Result<()> {
    let what = if want == CU_MEMORYTYPE_HOST {
        "pinned host memory (pin it with ExpertPool.pin or allocate it with pin_memory=True)"
    } else {
        "device memory"
    };
    for at in [addr, addr + (len as CuDevicePtr - 1)] {
        if memory_type(api, at)? != Some(want) {
            return Err(CoreError::Config(format!(
                "byte {at:#x} of the {len}-byte range at {addr:#x} is not {what}"
            )));
        }
    }
    Ok(())
}

/// Seconds of one `len`-byte copy in direction `dir` between device memory at `device` and
/// pinned host memory at `host`, on a new stream of device `ordinal`: the median (upper middle
/// for an even count) of `repeats` copies after one untimed warm-up copy, each timed on the
/// host clock from its issue to the end of `cuEventSynchronize` on an event recorded after it,
/// which is what a caller of `copy_` plus a synchronize sees.
///
/// Errors: `Config` for zero bytes or repeats, a null or overflowing address, a negative
/// ordinal, a device the driver does not see, a host range the driver does not know as pinned
/// or a device range that is not device memory; `DriverUnavailable` without a driver (checked
/// after the arguments, before any copy); a failed copy as `Device`. Device `ordinal`'s context
/// is pushed for the call and popped after, so the caller's current device is unchanged. After a `DeviceToHost` call the host range holds the device bytes.
///
/// # Safety
/// 1. `host..host+len` is host memory that stays allocated for the whole call; for
///    `DeviceToHost` nothing else reads or writes it during the call (it is overwritten).
/// 2. `device..device+len` is device memory of device `ordinal` that stays allocated for the
///    whole call; for `HostToDevice` nothing else reads or writes it during the call, and for
///    `DeviceToHost` nothing else writes it.
pub unsafe fn measure_copy(
    ordinal: i32,
    dir: Direction,
    device: u64,
    host: usize,
    len: usize,
    repeats: u32,
) -> Result<f64> {
    if len == 0 || repeats == 0 {
        return Err(CoreError::Config(format!(
            "a timed {} copy needs bytes > 0 and repeats > 0, got {len} bytes, {repeats} repeats",
            dir.name()
        )));
    }
    let fits = |a: u64| a.checked_add(len as u64).is_some();
    if device == 0 || host == 0 || !fits(device) || !fits(host as u64) {
        return Err(CoreError::Config(format!(
            "a timed {} copy needs non-null addresses with room for {len} bytes \
             (device {device:#x}, host {host:#x})",
            dir.name()
        )));
    }
    check_ordinal(i64::from(ordinal))?;
    let ctx = PrimaryContext::retain(ordinal)?;
    let _pushed = ctx.push()?;
    let stream = Stream::new(&ctx)?;
    require_memory(ctx.api, host as CuDevicePtr, len, CU_MEMORYTYPE_HOST)?;
    require_memory(ctx.api, device, len, CU_MEMORYTYPE_DEVICE)?;
    let mut times = Vec::with_capacity(repeats as usize);
    for i in 0..=repeats {
        let t0 = std::time::Instant::now();
        // SAFETY: the context is current (pushed above); both ranges are live and untouched by
        // others (points 1-2 of this function's contract); the event below is synchronized before
        // the next copy is issued and before returning, so every copy completed by then.
        unsafe { stream.copy(dir, device, host, len) }?;
        Event::record(&stream)?.synchronize()?;
        if i > 0 {
            times.push(t0.elapsed().as_secs_f64());
        }
    }
    times.sort_by(f64::total_cmp);
    Ok(times[times.len() / 2])
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cuda::available;

    #[test]
    fn timed_copy_without_a_driver_is_a_typed_error_not_a_crash() {
        if available() {
            return; // a GPU host: tests/gpu covers the real copies
        }
        let mut host = vec![0u8; 4096];
        for dir in [Direction::DeviceToHost, Direction::HostToDevice] {
            // SAFETY: there is no usable driver (checked above), so the call fails while
            // loading it, before any copy could touch `host` or the made-up device address.
            let r = unsafe { measure_copy(0, dir, 1 << 40, host.as_mut_ptr() as usize, 4096, 3) };
            assert!(
                matches!(r, Err(CoreError::DriverUnavailable(_))),
                "{}: {r:?}",
                dir.name()
            );
        }
        assert!(host.iter().all(|&b| b == 0));
    }

    #[test]
    fn timed_copy_rejects_empty_and_null_ranges_before_loading_the_driver() {
        let mut host = vec![0u8; 64];
        let h = host.as_mut_ptr() as usize;
        for (device, host, len, repeats) in [
            (1 << 40, h, 0, 3),
            (1 << 40, h, 64, 0),
            (0, h, 64, 3),
            (1 << 40, 0, 64, 3),
            (u64::MAX - 8, h, 64, 3),
        ] {
            // SAFETY: every case fails the argument checks, which run before the driver is
            // loaded and before any memory is touched.
            let r = unsafe { measure_copy(0, Direction::DeviceToHost, device, host, len, repeats) };
            assert!(matches!(r, Err(CoreError::Config(_))), "{r:?}");
        }
    }
}
