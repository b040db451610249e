//! The only module of ftrs-core that touches raw memory.
//!
//! Two things need it: (1) the host pool is one zeroed allocation aligned to a page (so the CUDA
//! driver can pin it and DMA from it; on Linux a mapping of its own, advised to huge pages),
//! owned by [`HostRegion`]; (2) expert copies go between raw addresses (pool → device-slot
//! buffer owned by Python), done by [`copy_parallel`], which
//! cuts a large block into pieces that the caller and long-lived copy helper threads
//! claim and `memcpy`.
//! Everything else in the crate uses the safe, bounds-checked methods here.
//!
//! Ownership rules that make those methods sound:
//! - A [`HostRegion`] is written only through `&mut self` ([`HostRegion::write`],
//!   [`HostRegion::as_mut_slice`]): it is filled before it is shared, and once behind an `Arc`
//!   (a transfer engine's pool) every access is a read, so `Sync` cannot race.
//! - A [`CopyJob`] borrows the region and the [`Destination`] it was checked against for its
//!   lifetime `'a`, so it cannot outlive either; running it on the host is safe. Starting it on
//!   an asynchronous backend is not ([`crate::backend::CopyBackend::submit`] is `unsafe`): the
//!   copy outlives the borrow.
//! - Pinning ([`HostRegion::pin`]) is undone by the region's `Drop`, before it frees the memory.

#![allow(unsafe_code)]

use std::alloc::{self, Layout};
use std::collections::VecDeque;
use std::marker::PhantomData;
use std::ptr::NonNull;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, OnceLock};
use std::time::{Duration, Instant};

use crate::error::{CoreError, Result};

/// Below this many bytes per thread, splitting a copy costs more than it saves.
pub const MIN_BYTES_PER_THREAD: usize = 512 << 10;

/// One zeroed, aligned heap allocation, freed on drop (unpinned first if it was pinned).
#[derive(Debug)]
pub struct HostRegion {
    /// Start of the allocation; valid for `len` bytes until drop; aligned to `layout.align()`.
    ptr: NonNull<u8>,
    /// Length in bytes; > 0; equals `layout.size()`.
    len: usize,
    /// The layout `ptr` was allocated with (needed to free it).
    layout: Layout,
    /// Whether `ptr` is an anonymous mapping of `len` bytes of its own ([`map_huge`]), freed
    /// by `munmap` rather than the allocator.
    mapped: bool,
    /// The device whose context registered the allocation with the CUDA driver (set once, by
    /// the `pin` that registered it); unregistered through the same device in `drop`.
    pinned_on: OnceLock<i32>,
}

// SAFETY: HostRegion owns its allocation like a Box<[u8]>: moving it to another thread moves
// the ownership.
unsafe impl Send for HostRegion {}
// SAFETY: through `&self` the bytes are only read (`read`, copy jobs) and the pin flag is an
// atomic; every write takes `&mut self`, so shared references never race with a writer.
unsafe impl Sync for HostRegion {}

impl HostRegion {
    /// Allocates `len` zeroed bytes aligned to `align` (a power of two). `len == 0` is an error.
    pub fn zeroed(len: usize, align: usize) -> Result<Self> {
        let layout = Layout::from_size_align(len, align).map_err(|e| {
            CoreError::Config(format!("bad pool layout ({len} B, align {align}): {e}"))
        })?;
        if len == 0 {
            return Err(CoreError::Config("pool of zero bytes".into()));
        }
        let (raw, mapped) = match map_huge(len, align) {
            Some(p) => (p, true),
            // SAFETY: `layout` has a non-zero size (checked above).
            None => (unsafe { alloc::alloc_zeroed(layout) }, false),
        };
        let ptr = NonNull::new(raw).ok_or_else(|| {
            CoreError::Capacity(format!("cannot allocate a host pool of {len} bytes"))
        })?;
        Ok(Self {
            ptr,
            len,
            layout,
            mapped,
            pinned_on: OnceLock::new(),
        })
    }

    /// Address of the first byte.
    pub fn addr(&self) -> usize {
        self.ptr.as_ptr() as usize
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Always false (a region is never empty); here for clippy's `len_without_is_empty`.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    fn check(&self, offset: usize, n: usize) -> Result<()> {
        match offset.checked_add(n) {
            Some(end) if end <= self.len => Ok(()),
            _ => Err(CoreError::Config(format!(
                "range [{offset}, {offset}+{n}) outside the pool of {} bytes",
                self.len
            ))),
        }
    }

    /// Copies `src` to `offset`. Exclusive access: nothing reads the region meanwhile.
    pub fn write(&mut self, offset: usize, src: &[u8]) -> Result<()> {
        self.check(offset, src.len())?;
        self.as_mut_slice()[offset..offset + src.len()].copy_from_slice(src);
        Ok(())
    }

    /// The whole region as one exclusive slice: fills split it into disjoint parts
    /// (`split_at_mut`) and write them from several threads.
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: `ptr` is valid for `len` initialised (zeroed) bytes until drop, and `&mut self`
        // makes this the only reference to them for the slice's lifetime.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }

    /// Page-locks the region through the CUDA driver (once), in device `ordinal`'s context
    /// (portable: pinned for every device); `Ok(false)` without a driver, `Config` for a
    /// negative ordinal or a device the driver does not see. A pinned region stays pinned
    /// whatever device a later call names.
    pub fn pin(&self, ordinal: i32) -> Result<bool> {
        if self.is_pinned() {
            return Ok(true);
        }
        // SAFETY: (1) `ptr..ptr+len` is this live allocation; (2) it stays allocated until
        // `drop`, which unregisters it through the device recorded below before freeing it;
        // (3) a second registration of the same range (two racing `pin` calls) is answered
        // "already registered" (`Ok(false)`), and only the call that registered records it.
        match unsafe { crate::cuda::host_register(ordinal, self.addr(), self.len) } {
            Ok(registered) => {
                if registered {
                    let _ = self.pinned_on.set(ordinal);
                }
                Ok(true)
            }
            Err(CoreError::DriverUnavailable(_)) => Ok(false),
            Err(e) => Err(e),
        }
    }

    /// Whether [`Self::pin`] succeeded.
    pub fn is_pinned(&self) -> bool {
        self.pinned_on.get().is_some()
    }

    /// Copies `dst.len()` bytes starting at `offset` into `dst`.
    pub fn read(&self, offset: usize, dst: &mut [u8]) -> Result<()> {
        self.check(offset, dst.len())?;
        // SAFETY: the range is inside the allocation (checked); `dst` is an exclusive borrow.
        unsafe { std::ptr::copy(self.ptr.as_ptr().add(offset), dst.as_mut_ptr(), dst.len()) };
        Ok(())
    }
}

impl Drop for HostRegion {
    fn drop(&mut self) {
        if let Some(&ordinal) = self.pinned_on.get() {
            // SAFETY: (1) the range at `ptr` was registered by `pin` through device `ordinal`
            // and is still allocated; (2) `&mut self` in drop: no copy job borrows the region
            // any more, and engines finish every asynchronous copy before they let go of their
            // pool.
            unsafe { crate::cuda::host_unregister(ordinal, self.addr()) };
        }
        if self.mapped {
            #[cfg(target_os = "linux")]
            // SAFETY: `ptr` is the start of a mapping of `len` bytes made by `map_huge`, unmapped
            // once, here; nothing borrows the region any more (`&mut self`).
            unsafe {
                libc::munmap(self.ptr.as_ptr().cast(), self.len);
            }
        } else {
            // SAFETY: `ptr` was allocated by `alloc_zeroed` with exactly `layout`, freed once.
            unsafe { alloc::dealloc(self.ptr.as_ptr(), self.layout) }
        }
    }
}

/// On Linux, a region of 2 MiB or more (page-aligned suffices) comes from its own anonymous
/// mapping, zero by construction, advised `MADV_HUGEPAGE` before anything touches it, so that
/// its first writes fault in transparent huge pages where THP is `madvise` (the common default;
/// the allocator's path zeroes the pages first, 4 KiB each). The CPU kernels stream experts
/// from DRAM and pay a TLB miss every 4 KiB otherwise: 2 MiB pages took a demo Q5_1 expert call
/// from 67 to 61 µs and a Q6_K one from 73 to 63 µs at one thread (600 matrices, one process,
/// same bytes). None elsewhere, or when the mapping fails: the allocator's path then.
#[allow(unused_variables)]
fn map_huge(len: usize, align: usize) -> Option<*mut u8> {
    #[cfg(target_os = "linux")]
    if len >= 2 << 20 && 4096 % align == 0 {
        // SAFETY: a fresh private anonymous mapping: no address is given and no memory of
        // anyone else is touched; MAP_FAILED is checked before use.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        if p == libc::MAP_FAILED {
            return None;
        }
        // SAFETY: [p, p + len) is the mapping just made; the advice changes how its pages are
        // backed, never their contents, and a refusal leaves small pages.
        unsafe {
            libc::madvise(p, len, libc::MADV_HUGEPAGE);
        }
        return Some(p.cast());
    }
    None
}

/// Copies `n` bytes from address `src` to address `dst`, on up to `threads` threads (0 = all
/// cores) when the copy is large enough to gain from it.
///
/// The copy is cut into pieces of [`PIECE_BYTES`] that the calling thread and up to
/// `threads - 1` long-lived copy helpers (`helpers`) claim one at a time. The caller starts at
/// once; a helper joins when it wakes. Spawning a thread per call, or handing each helper a fixed
/// half, costs more than copying a megabyte where waking an idle core is slow (virtual machines):
/// this way a late helper costs nothing and an early one halves the time.
///
/// Waking a parked thread is a system call on one side and a scheduler wake-up on the other,
/// each worth several microseconds, which is as long as copying a cached megabyte. So neither
/// side parks at once: a helper polls for the next job for [`HELPER_SPIN`] after its last one
/// (copies come in bursts: the experts of a layer), and is only woken through the kernel when it
/// has gone to sleep; the caller polls for the helpers' last pieces for up to [`CALLER_SPIN`]
/// (at most one piece each) before it sleeps on a condition variable.
///
/// # Safety
/// 1. `src..src+n` is readable and `dst..dst+n` is writable host memory for the whole call.
/// 2. The two ranges do not overlap.
/// 3. No other thread writes either range during the call.
pub unsafe fn copy_parallel(dst: usize, src: usize, n: usize, threads: usize) {
    let threads = effective_threads(threads)
        .min(n / MIN_BYTES_PER_THREAD)
        .max(1);
    if threads == 1 {
        // SAFETY: guaranteed by the caller (points 1-3).
        unsafe { std::ptr::copy_nonoverlapping(src as *const u8, dst as *mut u8, n) };
        return;
    }
    let job = Arc::new(CopyJobShared {
        dst,
        src,
        n,
        pieces: n.div_ceil(PIECE_BYTES),
        next: AtomicUsize::new(0),
        done: AtomicUsize::new(0),
        sleeper: Mutex::new(false),
        all_done: Condvar::new(),
    });
    let pool = helpers();
    for i in 0..(threads - 1).min(pool.len()) {
        pool.send(i, Arc::clone(&job));
    }
    job.work();
    // The caller's ranges must stay valid until every claimed piece has been copied.
    job.wait();
}

/// Bytes per claimable piece of a [`copy_parallel`] call (a multiple of the 4 KiB page).
pub const PIECE_BYTES: usize = 256 << 10;

/// How long an idle copy helper polls for a new job before it parks.
pub const HELPER_SPIN: Duration = Duration::from_micros(200);

/// How long a [`copy_parallel`] caller polls for the helpers' last pieces before it parks.
pub const CALLER_SPIN: Duration = Duration::from_micros(200);

/// One [`copy_parallel`] call, shared by the caller and the helpers it woke.
struct CopyJobShared {
    dst: usize,
    src: usize,
    n: usize,
    pieces: usize,
    /// Next piece to claim; a claim at or past `pieces` means there is nothing left.
    next: AtomicUsize,
    /// Pieces copied (released by each thread after its copies).
    done: AtomicUsize,
    /// True once the caller sleeps on `all_done`.
    sleeper: Mutex<bool>,
    all_done: Condvar,
}

impl CopyJobShared {
    /// Claims and copies pieces until none is left.
    fn work(&self) {
        let mut copied = 0;
        loop {
            let i = self.next.fetch_add(1, Ordering::Relaxed);
            if i >= self.pieces {
                break;
            }
            let off = i * PIECE_BYTES;
            let len = PIECE_BYTES.min(self.n - off);
            // SAFETY: piece `i` lies inside the call's ranges, and each piece is claimed by
            // exactly one thread. The claim succeeded, so the piece is not counted done yet and
            // the `copy_parallel` call is still blocked in `wait`: the ranges are valid (points
            // 1-3 of its contract).
            unsafe {
                std::ptr::copy_nonoverlapping(
                    (self.src + off) as *const u8,
                    (self.dst + off) as *mut u8,
                    len,
                )
            };
            copied += 1;
        }
        if copied > 0 && self.done.fetch_add(copied, Ordering::AcqRel) + copied == self.pieces {
            // `done` is final before the lock is taken: a caller that has not set `sleeper` yet
            // will see it when it checks under the lock, one that has is woken here.
            let sleeper = self.sleeper.lock().unwrap_or_else(|p| p.into_inner());
            if *sleeper {
                self.all_done.notify_all();
            }
        }
    }

    fn finished(&self) -> bool {
        self.done.load(Ordering::Acquire) == self.pieces
    }

    /// Blocks until every piece has been copied.
    fn wait(&self) {
        let start = Instant::now();
        while !self.finished() {
            if start.elapsed() >= CALLER_SPIN {
                let mut sleeper = self.sleeper.lock().unwrap_or_else(|p| p.into_inner());
                *sleeper = true;
                while !self.finished() {
                    sleeper = self
                        .all_done
                        .wait(sleeper)
                        .unwrap_or_else(|p| p.into_inner());
                }
                return;
            }
            std::hint::spin_loop();
        }
    }
}

/// One copy helper's mailbox.
struct Mailbox {
    /// Jobs not yet taken.
    queue: Mutex<VecDeque<Arc<CopyJobShared>>>,
    /// Length of `queue`, readable without the lock (what a polling helper watches).
    pending: AtomicUsize,
    /// False while the helper sleeps on `wake` (changed under the `queue` lock only).
    awake: AtomicBool,
    wake: Condvar,
}

impl Mailbox {
    fn take(&self) -> Option<Arc<CopyJobShared>> {
        let mut q = self.queue.lock().unwrap_or_else(|p| p.into_inner());
        let job = q.pop_front();
        if job.is_some() {
            self.pending.fetch_sub(1, Ordering::Release);
        }
        job
    }

    /// The helper's loop: run jobs; when there are none, poll for [`HELPER_SPIN`], then sleep.
    fn serve(&self) {
        loop {
            if let Some(job) = self.take() {
                job.work();
                continue;
            }
            let idle = Instant::now();
            while self.pending.load(Ordering::Acquire) == 0 && idle.elapsed() < HELPER_SPIN {
                std::hint::spin_loop();
            }
            if self.pending.load(Ordering::Acquire) > 0 {
                continue;
            }
            let mut q = self.queue.lock().unwrap_or_else(|p| p.into_inner());
            self.awake.store(false, Ordering::SeqCst);
            while q.is_empty() {
                q = self.wake.wait(q).unwrap_or_else(|p| p.into_inner());
            }
            self.awake.store(true, Ordering::SeqCst);
        }
    }

    /// Hands `job` over, waking the helper through the kernel only if it sleeps. The check
    /// and the helper's decision to sleep both happen under the queue lock, so no job is
    /// left behind a sleeping helper.
    fn post(&self, job: Arc<CopyJobShared>) {
        let mut q = self.queue.lock().unwrap_or_else(|p| p.into_inner());
        q.push_back(job);
        self.pending.fetch_add(1, Ordering::Release);
        let asleep = !self.awake.load(Ordering::SeqCst);
        drop(q);
        if asleep {
            self.wake.notify_one();
        }
    }
}

/// Long-lived copy helper threads, one per core but the caller's, started on first use.
struct Helpers {
    boxes: Vec<Arc<Mailbox>>,
}

impl Helpers {
    fn len(&self) -> usize {
        self.boxes.len()
    }
    /// Gives helper `i` `job`. A helper that could not be started simply does not help: the
    /// caller claims every piece nobody else does.
    fn send(&self, i: usize, job: Arc<CopyJobShared>) {
        if let Some(b) = self.boxes.get(i) {
            b.post(job);
        }
    }
}

fn helpers() -> &'static Helpers {
    static HELPERS: OnceLock<Helpers> = OnceLock::new();
    HELPERS.get_or_init(|| {
        let boxes = (1..effective_threads(0))
            .filter_map(|i| {
                let mailbox = Arc::new(Mailbox {
                    queue: Mutex::new(VecDeque::new()),
                    pending: AtomicUsize::new(0),
                    awake: AtomicBool::new(true),
                    wake: Condvar::new(),
                });
                let served = Arc::clone(&mailbox);
                std::thread::Builder::new()
                    .name(format!("ftrs-copy-{i}"))
                    .spawn(move || served.serve())
                    .ok()
                    .map(|_| mailbox)
            })
            .collect();
        Helpers { boxes }
    })
}

/// Where a destination buffer lives.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MemKind {
    /// Host memory, written with `memcpy`.
    Host,
    /// CUDA device memory (a `CUdeviceptr`), written by the CUDA backend only.
    Device,
}

/// The device-side slot buffer: `len` bytes at `base`, owned by the caller (Python).
#[derive(Debug, Clone, Copy)]
pub struct Destination {
    /// First byte; valid for `len` bytes while any engine using it lives (the `new` contract).
    base: usize,
    /// Size in bytes.
    len: usize,
    /// Host or device memory.
    kind: MemKind,
}

impl Destination {
    /// Wraps a caller-owned buffer.
    ///
    /// # Safety
    /// 1. `base..base+len` is writable memory of `kind` (host memory, or device memory of the
    ///    device the CUDA backend uses) for as long as this value, any copy job or engine built
    ///    on it, or any asynchronous copy started from such a job lives.
    /// 2. It does not overlap the expert pool.
    /// 3. While a copy into a slot runs, nobody else writes that slot, and readers of a slot
    ///    only read it after the engine reported it ready.
    pub unsafe fn new(base: usize, len: usize, kind: MemKind) -> Self {
        Self { base, len, kind }
    }
    /// First byte.
    pub fn base(&self) -> usize {
        self.base
    }
    /// Size in bytes.
    pub fn len(&self) -> usize {
        self.len
    }
    /// True for a zero-byte buffer.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    /// Host or device.
    pub fn kind(&self) -> MemKind {
        self.kind
    }
}

/// One validated copy: `len` bytes from a [`HostRegion`] to a [`Destination`]. Only
/// [`CopyJob::new`] makes one, from bounds-checked offsets, and the job borrows both for `'a`,
/// so it can neither outlive the region nor the destination value; running it on the host
/// ([`CopyJob::run_host`]) is therefore safe.
///
/// Freeing the source while a job exists does not compile:
///
/// ```compile_fail,E0505
/// use ftrs_core::raw::{CopyJob, Destination, HostRegion, MemKind};
/// let region = HostRegion::zeroed(4096, 4096).unwrap();
/// let mut buf = vec![0u8; 4096];
/// // SAFETY: `buf` is host memory that outlives every use of `dst`, distinct from `region`.
/// let dst = unsafe { Destination::new(buf.as_mut_ptr() as usize, buf.len(), MemKind::Host) };
/// let job = CopyJob::new(&region, 0, &dst, 0, 4096).unwrap();
/// drop(region); // error[E0505]: cannot move out of `region` because it is borrowed
/// job.run_host(1).unwrap();
/// ```
///
/// while the same lines with the job run first do:
///
/// ```
/// use ftrs_core::raw::{CopyJob, Destination, HostRegion, MemKind};
/// let mut region = HostRegion::zeroed(4096, 4096).unwrap();
/// region.write(0, &[7; 16]).unwrap();
/// let mut buf = vec![0u8; 4096];
/// // SAFETY: `buf` is host memory that outlives every use of `dst`, distinct from `region`.
/// let dst = unsafe { Destination::new(buf.as_mut_ptr() as usize, buf.len(), MemKind::Host) };
/// let job = CopyJob::new(&region, 0, &dst, 0, 4096).unwrap();
/// job.run_host(1).unwrap();
/// drop(region);
/// assert_eq!(buf[..16], [7; 16]);
/// ```
#[derive(Debug, Clone)]
pub struct CopyJob<'a> {
    /// Source address inside the borrowed [`HostRegion`]; `src..src+len` inside it.
    src: usize,
    /// Destination address inside the borrowed [`Destination`]; `dst..dst+len` inside it.
    dst: usize,
    /// Bytes to copy.
    len: usize,
    /// Kind of the destination memory.
    kind: MemKind,
    /// The region and the destination the addresses point into, borrowed for the job's life.
    _borrows: PhantomData<(&'a HostRegion, &'a Destination)>,
}

impl<'a> CopyJob<'a> {
    /// Checks both ranges and builds the job, which borrows `src` and `dst` for `'a`.
    pub fn new(
        src: &'a HostRegion,
        src_off: usize,
        dst: &'a Destination,
        dst_off: usize,
        len: usize,
    ) -> Result<Self> {
        src.check(src_off, len)?;
        match dst_off.checked_add(len) {
            Some(end) if end <= dst.len => {}
            _ => {
                return Err(CoreError::Config(format!(
                    "destination range [{dst_off}, +{len}) outside {} bytes",
                    dst.len
                )))
            }
        }
        Ok(Self {
            src: src.addr() + src_off,
            dst: dst.base + dst_off,
            len,
            kind: dst.kind,
            _borrows: PhantomData,
        })
    }
    /// Source address (host).
    pub fn src(&self) -> usize {
        self.src
    }
    /// Destination address (host or device).
    pub fn dst(&self) -> usize {
        self.dst
    }
    /// Bytes.
    pub fn len(&self) -> usize {
        self.len
    }
    /// True for an empty copy.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    /// Destination memory kind.
    pub fn kind(&self) -> MemKind {
        self.kind
    }

    /// Runs the copy with `memcpy` on up to `threads` threads. Errors for device destinations.
    pub fn run_host(&self, threads: usize) -> Result<()> {
        if self.kind != MemKind::Host {
            return Err(CoreError::Config(
                "host backend cannot write device memory".into(),
            ));
        }
        // SAFETY: `new` checked both ranges; the job borrows the source region, which is only
        // read while shared (writes need `&mut`), so it is live and unchanged for this call; the
        // destination is writable host memory, disjoint from the region and written by nobody
        // else, per `Destination::new`'s contract (points 1-3); the copy ends before we return.
        unsafe { copy_parallel(self.dst, self.src, self.len, threads) };
        Ok(())
    }
}

/// Memory-maps `file` read-only.
///
/// The map lives only while a fill runs. A file truncated underneath us by another process is
/// outside the contract (as for every mmap-based loader): it would fault, not corrupt the pool.
pub fn map_readonly(file: &std::fs::File) -> std::io::Result<memmap2::Mmap> {
    // SAFETY: the map is read-only and dropped before the fill returns; concurrent modification
    // of the file by another process is documented as unsupported.
    unsafe { memmap2::Mmap::map(file) }
}

/// `threads`, or the number of cores when 0 (read once: `available_parallelism` reads the
/// cgroup files on every call, which costs more than a 1 MiB copy).
pub fn effective_threads(threads: usize) -> usize {
    static CORES: OnceLock<usize> = OnceLock::new();
    if threads > 0 {
        threads
    } else {
        *CORES.get_or_init(|| std::thread::available_parallelism().map_or(1, |n| n.get()))
    }
}

#[cfg(test)]
mod tests;
