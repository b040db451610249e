//! Helpers shared by the transfer engine's test files: a pool with recognisable bytes, engines
//! over host, gated and stream backends, and checks of slot contents.

#![allow(dead_code)] // each test file uses a part

use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;

use ftrs_core::backend::{Completion, CopyBackend, HostBackend};
use ftrs_core::raw::CopyJob;
use ftrs_core::{
    Clock, Destination, EngineConfig, ExpertLayout, ExpertPool, MemKind, Policy, RealClock,
    TransferEngine,
};

pub const LAYERS: usize = 3;
pub const EXPERTS: usize = 8;

/// A pool whose every byte of block (l, e) is `l * 16 + e + 1`.
pub fn pool() -> Arc<ExpertPool> {
    let lay = ExpertLayout::new(LAYERS, EXPERTS, &[100, 60], 64).unwrap();
    let mut pool = ExpertPool::new(lay, ftrs_core::PoolDtype::F32).unwrap();
    for l in 0..LAYERS {
        for e in 0..EXPERTS {
            for (t, n) in [(0, 100), (1, 60)] {
                pool.write(l, e, t, &vec![(l * 16 + e + 1) as u8; n])
                    .unwrap();
            }
        }
    }
    Arc::new(pool)
}

/// The slot buffer of a test engine.
pub struct Dst {
    /// Host memory standing in for device slots.
    pub buf: Vec<u8>,
}

pub fn engine_on(
    pool: Arc<ExpertPool>,
    slots: usize,
    backend: Arc<dyn CopyBackend>,
    clock: Arc<dyn Clock>,
    budget: usize,
) -> (TransferEngine, Box<Dst>) {
    engine_paced(pool, slots, backend, clock, budget, 0.0)
}

pub fn engine_paced(
    pool: Arc<ExpertPool>,
    slots: usize,
    backend: Arc<dyn CopyBackend>,
    clock: Arc<dyn Clock>,
    budget: usize,
    pace: f64,
) -> (TransferEngine, Box<Dst>) {
    engine_chunked(pool, slots, backend, clock, budget, pace, 0)
}

pub fn engine_chunked(
    pool: Arc<ExpertPool>,
    slots: usize,
    backend: Arc<dyn CopyBackend>,
    clock: Arc<dyn Clock>,
    budget: usize,
    pace: f64,
    chunk: usize,
) -> (TransferEngine, Box<Dst>) {
    let cfg = EngineConfig {
        num_slots: slots,
        policy: Policy::Lru,
        max_inflight_bytes: budget,
        max_inflight_prefetches: 1,
        prefetch_chunk_bytes: chunk,
        pacing_bytes_per_s: pace,
    };
    engine_cfg(pool, cfg, backend, clock)
}

pub fn engine_cfg(
    pool: Arc<ExpertPool>,
    cfg: EngineConfig,
    backend: Arc<dyn CopyBackend>,
    clock: Arc<dyn Clock>,
) -> (TransferEngine, Box<Dst>) {
    let mut dst = Box::new(Dst {
        buf: vec![0u8; cfg.num_slots * pool.layout().expert_bytes()],
    });
    // SAFETY: `dst.buf` is host memory that outlives the engine (tuple fields drop in order:
    // the engine first), disjoint from the pool, and read only after `wait` or when idle.
    let d =
        unsafe { Destination::new(dst.buf.as_mut_ptr() as usize, dst.buf.len(), MemKind::Host) };
    let eng = TransferEngine::new(pool, d, cfg, backend, clock).unwrap();
    (eng, dst)
}

/// A host engine with `policy` (the others use LRU).
pub fn host_engine_with(
    slots: usize,
    policy: Policy,
) -> (TransferEngine, Box<Dst>, Arc<ExpertPool>) {
    let p = pool();
    let cfg = EngineConfig {
        num_slots: slots,
        policy,
        max_inflight_bytes: 0,
        max_inflight_prefetches: 1,
        prefetch_chunk_bytes: 0,
        pacing_bytes_per_s: 0.0,
    };
    let (e, d) = engine_cfg(
        Arc::clone(&p),
        cfg,
        Arc::new(HostBackend { threads: 1 }),
        Arc::new(RealClock::new()),
    );
    (e, d, p)
}

pub fn host_engine(slots: usize) -> (TransferEngine, Box<Dst>, Arc<ExpertPool>) {
    host_engine_chunked(slots, 0)
}

/// A host engine whose prefetches are copied in chunks of `chunk` bytes.
pub fn host_engine_chunked(
    slots: usize,
    chunk: usize,
) -> (TransferEngine, Box<Dst>, Arc<ExpertPool>) {
    let p = pool();
    let (e, d) = engine_chunked(
        Arc::clone(&p),
        slots,
        Arc::new(HostBackend { threads: 1 }),
        Arc::new(RealClock::new()),
        0,
        0.0,
        chunk,
    );
    (e, d, p)
}

pub fn slot_byte(dst: &Dst, pool: &ExpertPool, slot: u32) -> u8 {
    let lay = pool.layout();
    let base = slot as usize * lay.expert_bytes();
    let t1 = lay.tensor_offset(0, 1).unwrap();
    let b: Vec<u8> = dst.buf[base..base + 100]
        .iter()
        .chain(&dst.buf[base + t1..base + t1 + 60])
        .copied()
        .collect();
    assert!(b.iter().all(|&x| x == b[0]), "slot {slot} is torn");
    b[0]
}

pub fn idle(eng: &TransferEngine) {
    for _ in 0..10_000 {
        let s = eng.stats();
        if s.queue_depth == 0 && s.inflight_bytes == 0 {
            return;
        }
        std::thread::sleep(Duration::from_millis(1));
    }
    panic!("engine never went idle");
}

/// Runs its closure when dropped. Declared after an engine over a held backend ([`Gate`],
/// [`Stream`]) it opens the backend first, so a failed assertion unwinds instead of hanging in
/// the engine's drop, which waits for the copies in flight.
pub struct OpenOnDrop<F: Fn()>(pub F);

impl<F: Fn()> Drop for OpenOnDrop<F> {
    fn drop(&mut self) {
        (self.0)()
    }
}

/// Records the order of copies (as keys) and blocks every copy until the gate opens.
#[derive(Debug)]
pub struct Gate {
    pub inner: HostBackend,
    pub open: Mutex<bool>,
    pub cv: Condvar,
    pub order: Mutex<Vec<(u32, u32)>>,
    pub pool_addr: usize,
    pub eb: usize,
}

impl Gate {
    pub fn new(pool_addr: usize, eb: usize) -> Arc<Self> {
        Arc::new(Self {
            inner: HostBackend { threads: 1 },
            open: Mutex::new(false),
            cv: Condvar::new(),
            order: Mutex::new(Vec::new()),
            pool_addr,
            eb,
        })
    }
    pub fn open(&self) {
        *self.open.lock().unwrap() = true;
        self.cv.notify_all();
    }
    pub fn order(&self) -> Vec<(u32, u32)> {
        self.order.lock().unwrap().clone()
    }
}

impl CopyBackend for Gate {
    fn name(&self) -> String {
        "gate".into()
    }
    unsafe fn submit(&self, job: &CopyJob<'_>) -> ftrs_core::Result<Completion> {
        let block = (job.src() - self.pool_addr) / self.eb;
        self.order
            .lock()
            .unwrap()
            .push(((block / EXPERTS) as u32, (block % EXPERTS) as u32));
        let mut open = self.open.lock().unwrap();
        while !*open {
            open = self.cv.wait(open).unwrap();
        }
        // SAFETY: this call's own contract, passed on unchanged.
        unsafe { self.inner.submit(job) }
    }
    fn finish(&self, c: Completion) -> ftrs_core::Result<()> {
        self.inner.finish(c)
    }
}

pub fn gated(slots: usize) -> (TransferEngine, Box<Dst>, Arc<ExpertPool>, Arc<Gate>) {
    let p = pool();
    let gate = Gate::new(p.address(), p.layout().expert_bytes());
    let (e, d) = engine_on(
        Arc::clone(&p),
        slots,
        gate.clone(),
        Arc::new(RealClock::new()),
        0,
    );
    (e, d, p, gate)
}

/// Copies at once on submit (recording the order), but holds every completion until opened:
/// a link with copies queued on it, like a CUDA stream.
#[derive(Debug)]
pub struct Stream {
    pub inner: HostBackend,
    pub open: Mutex<bool>,
    pub cv: Condvar,
    pub order: Mutex<Vec<(u32, u32)>>,
    pub pool_addr: usize,
    pub eb: usize,
}

impl CopyBackend for Stream {
    fn name(&self) -> String {
        "stream".into()
    }
    unsafe fn submit(&self, job: &CopyJob<'_>) -> ftrs_core::Result<Completion> {
        let block = (job.src() - self.pool_addr) / self.eb;
        self.order
            .lock()
            .unwrap()
            .push(((block / EXPERTS) as u32, (block % EXPERTS) as u32));
        // SAFETY: this call's own contract, passed on unchanged.
        unsafe { self.inner.submit(job) }
    }
    fn finish(&self, c: Completion) -> ftrs_core::Result<()> {
        let mut open = self.open.lock().unwrap();
        while !*open {
            open = self.cv.wait(open).unwrap();
        }
        self.inner.finish(c)
    }
}

/// An engine over a [`Stream`] (completions held until opened) with one prefetch copy in
/// flight and prefetches copied in chunks of `chunk` bytes.
pub fn streamed(chunk: usize) -> (TransferEngine, Box<Dst>, Arc<ExpertPool>, Arc<Stream>) {
    let p = pool();
    let stream = Arc::new(Stream {
        inner: HostBackend { threads: 1 },
        open: Mutex::new(false),
        cv: Condvar::new(),
        order: Mutex::new(Vec::new()),
        pool_addr: p.address(),
        eb: p.layout().expert_bytes(),
    });
    let (e, d) = engine_chunked(
        Arc::clone(&p),
        8,
        stream.clone(),
        Arc::new(RealClock::new()),
        0,
        0.0,
        chunk,
    );
    (e, d, p, stream)
}

pub fn open_stream(s: &Stream) {
    *s.open.lock().unwrap() = true;
    s.cv.notify_all();
}

pub fn slot_of(eng: &TransferEngine, key: (u32, u32)) -> Option<u32> {
    eng.resident()
        .iter()
        .find(|&&(l, e, _)| (l, e) == key)
        .map(|r| r.2)
}
