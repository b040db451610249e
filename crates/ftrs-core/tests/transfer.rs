//! Transfer engine behaviour: bytes land where the slots say, demand before prefetch, no
//! double fetch, cancellation, faults, budget and pacing on a virtual clock.

use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;

use ftrs_core::backend::{Completion, CopyBackend, HostBackend, SimulatedBackend};
use ftrs_core::raw::CopyJob;
use ftrs_core::{
    Clock, CoreError, Destination, DeviceFault, EngineConfig, ExpertLayout, ExpertPool, MemKind,
    Policy, RealClock, TransferEngine, VirtualClock,
};
use proptest::prelude::*;

const LAYERS: usize = 3;
const EXPERTS: usize = 8;

/// A pool whose every byte of block (l, e) is `l * 16 + e + 1`.
fn pool() -> Arc<ExpertPool> {
    let lay = ExpertLayout::new(LAYERS, EXPERTS, &[100, 60], 64).unwrap();
    let pool = ExpertPool::new(lay, ftrs_core::PoolDtype::F32).unwrap();
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
struct Dst {
    /// Host memory standing in for device slots.
    buf: Vec<u8>,
}

fn engine_on(
    pool: Arc<ExpertPool>,
    slots: usize,
    backend: Arc<dyn CopyBackend>,
    clock: Arc<dyn Clock>,
    budget: usize,
) -> (TransferEngine, Box<Dst>) {
    engine_paced(pool, slots, backend, clock, budget, 0.0)
}

fn engine_paced(
    pool: Arc<ExpertPool>,
    slots: usize,
    backend: Arc<dyn CopyBackend>,
    clock: Arc<dyn Clock>,
    budget: usize,
    pace: f64,
) -> (TransferEngine, Box<Dst>) {
    engine_chunked(pool, slots, backend, clock, budget, pace, 0)
}

fn engine_chunked(
    pool: Arc<ExpertPool>,
    slots: usize,
    backend: Arc<dyn CopyBackend>,
    clock: Arc<dyn Clock>,
    budget: usize,
    pace: f64,
    chunk: usize,
) -> (TransferEngine, Box<Dst>) {
    let mut dst = Box::new(Dst {
        buf: vec![0u8; slots * pool.layout().expert_bytes()],
    });
    // SAFETY: `dst.buf` is host memory that outlives the engine (tuple fields drop in order:
    // the engine first), disjoint from the pool, and read only after `wait` or when idle.
    let d =
        unsafe { Destination::new(dst.buf.as_mut_ptr() as usize, dst.buf.len(), MemKind::Host) };
    let cfg = EngineConfig {
        num_slots: slots,
        policy: Policy::Lru,
        max_inflight_bytes: budget,
        max_inflight_prefetches: 1,
        prefetch_chunk_bytes: chunk,
        pacing_bytes_per_s: pace,
    };
    let eng = TransferEngine::new(pool, d, cfg, backend, clock).unwrap();
    (eng, dst)
}

fn host_engine(slots: usize) -> (TransferEngine, Box<Dst>, Arc<ExpertPool>) {
    host_engine_chunked(slots, 0)
}

/// A host engine whose prefetches are copied in chunks of `chunk` bytes.
fn host_engine_chunked(slots: usize, chunk: usize) -> (TransferEngine, Box<Dst>, Arc<ExpertPool>) {
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

fn slot_byte(dst: &Dst, pool: &ExpertPool, slot: u32) -> u8 {
    let lay = pool.layout();
    let base = slot as usize * lay.expert_bytes();
    let t1 = lay.tensor_offset(1).unwrap();
    let b: Vec<u8> = dst.buf[base..base + 100]
        .iter()
        .chain(&dst.buf[base + t1..base + t1 + 60])
        .copied()
        .collect();
    assert!(b.iter().all(|&x| x == b[0]), "slot {slot} is torn");
    b[0]
}

fn idle(eng: &TransferEngine) {
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
struct OpenOnDrop<F: Fn()>(F);

impl<F: Fn()> Drop for OpenOnDrop<F> {
    fn drop(&mut self) {
        (self.0)()
    }
}

/// Records the order of copies (as keys) and blocks every copy until the gate opens.
#[derive(Debug)]
struct Gate {
    inner: HostBackend,
    open: Mutex<bool>,
    cv: Condvar,
    order: Mutex<Vec<(u32, u32)>>,
    pool_addr: usize,
    eb: usize,
}

impl Gate {
    fn new(pool_addr: usize, eb: usize) -> Arc<Self> {
        Arc::new(Self {
            inner: HostBackend { threads: 1 },
            open: Mutex::new(false),
            cv: Condvar::new(),
            order: Mutex::new(Vec::new()),
            pool_addr,
            eb,
        })
    }
    fn open(&self) {
        *self.open.lock().unwrap() = true;
        self.cv.notify_all();
    }
    fn order(&self) -> Vec<(u32, u32)> {
        self.order.lock().unwrap().clone()
    }
}

impl CopyBackend for Gate {
    fn name(&self) -> String {
        "gate".into()
    }
    fn submit(&self, job: &CopyJob) -> ftrs_core::Result<Completion> {
        let block = (job.src() - self.pool_addr) / self.eb;
        self.order
            .lock()
            .unwrap()
            .push(((block / EXPERTS) as u32, (block % EXPERTS) as u32));
        let mut open = self.open.lock().unwrap();
        while !*open {
            open = self.cv.wait(open).unwrap();
        }
        self.inner.submit(job)
    }
    fn finish(&self, c: Completion) -> ftrs_core::Result<()> {
        self.inner.finish(c)
    }
}

fn gated(slots: usize) -> (TransferEngine, Box<Dst>, Arc<ExpertPool>, Arc<Gate>) {
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

#[test]
fn demanded_bytes_land_in_the_returned_slots_and_hit_the_second_time() {
    let rig = host_engine(4);
    let (eng, dst, pool) = (&rig.0, &*rig.1, &rig.2);
    let (slots, t) = eng.lookup(1, &[3, 5, 3], &[]).unwrap();
    assert_eq!(slots[0], slots[2]);
    eng.wait(t).unwrap();
    assert_eq!(slot_byte(dst, pool, slots[0]), 16 + 3 + 1);
    assert_eq!(slot_byte(dst, pool, slots[1]), 16 + 5 + 1);
    eng.release();
    let (again, t) = eng.lookup(1, &[5, 3], &[]).unwrap();
    eng.wait(t).unwrap();
    assert_eq!(again, vec![slots[1], slots[0]]);
    let s = eng.stats();
    assert_eq!(
        (s.lookups, s.hits, s.misses, s.demand_fetches),
        (4, 2, 2, 2)
    );
    assert_eq!(s.layer_hits[1], 2);
    assert_eq!(s.bytes_h2d, 2 * pool.layout().expert_bytes() as u64);
    assert_eq!(eng.resident(), vec![(1, 3, slots[0]), (1, 5, slots[1])]);
    eng.check_invariants().unwrap();
}

#[test]
fn a_demand_never_waits_behind_a_queued_prefetch() {
    let rig = gated(8);
    let _open = OpenOnDrop(|| rig.3.open());
    let (eng, _dst, _p, gate) = (&rig.0, &*rig.1, &rig.2, &rig.3);
    // (0,0) starts and blocks at the gate; three prefetches queue behind it.
    let (_, t0) = eng.lookup(0, &[0], &[(1, 0), (1, 1), (1, 2)]).unwrap();
    std::thread::sleep(Duration::from_millis(20));
    let (_, t1) = eng.lookup(0, &[5], &[]).unwrap();
    gate.open();
    eng.wait(t0).unwrap();
    eng.wait(t1).unwrap();
    idle(eng);
    assert_eq!(gate.order(), vec![(0, 0), (0, 5), (1, 0), (1, 1), (1, 2)]);
    assert_eq!(eng.stats().prefetch_issued, 3);
}

#[test]
fn a_demand_for_an_inflight_prefetch_upgrades_it_instead_of_fetching_twice() {
    let rig = gated(8);
    let _open = OpenOnDrop(|| rig.3.open());
    let (eng, dst, p, gate) = (&rig.0, &*rig.1, &rig.2, &rig.3);
    let (_, t0) = eng.lookup(0, &[0], &[(1, 0), (1, 1), (1, 2)]).unwrap();
    std::thread::sleep(Duration::from_millis(20));
    let (slots, t1) = eng.lookup(1, &[2], &[]).unwrap();
    gate.open();
    eng.wait(t0).unwrap();
    eng.wait(t1).unwrap();
    assert_eq!(slot_byte(dst, p, slots[0]), 16 + 2 + 1);
    idle(eng);
    // The lookup of layer 1 also cancelled the layer's other queued prefetches: stale.
    assert_eq!(gate.order(), vec![(0, 0), (1, 2)]);
    let s = eng.stats();
    assert_eq!((s.prefetch_used, s.demand_fetches, s.misses), (1, 1, 2));
    assert_eq!((s.prefetch_cancelled, s.prefetch_wasted), (2, 2));
    eng.check_invariants().unwrap();
}

#[test]
fn queued_prefetches_of_layers_the_lookups_reached_are_cancelled() {
    let rig = gated(8);
    let _open = OpenOnDrop(|| rig.3.open());
    let (eng, _dst, _p, gate) = (&rig.0, &*rig.1, &rig.2, &rig.3);
    // (0,0) blocks at the gate; prefetches for layers 1 and 2 queue behind it.
    let (_, t0) = eng.lookup(0, &[0], &[(1, 4), (2, 4), (1, 5)]).unwrap();
    std::thread::sleep(Duration::from_millis(20));
    // Layer 1 is reached and needs neither 4 nor 5: both are stale; layer 2's stays.
    let (_, t1) = eng.lookup(1, &[6], &[]).unwrap();
    gate.open();
    eng.wait(t0).unwrap();
    eng.wait(t1).unwrap();
    idle(eng);
    assert_eq!(gate.order(), vec![(0, 0), (1, 6), (2, 4)]);
    assert_eq!(eng.stats().prefetch_cancelled, 2);
    assert!(eng
        .resident()
        .iter()
        .all(|&(l, e, _)| (l, e) != (1, 4) && (l, e) != (1, 5)));
    eng.check_invariants().unwrap();
}

/// Copies at once on submit (recording the order), but holds every completion until opened:
/// a link with copies queued on it, like a CUDA stream.
#[derive(Debug)]
struct Stream {
    inner: HostBackend,
    open: Mutex<bool>,
    cv: Condvar,
    order: Mutex<Vec<(u32, u32)>>,
    pool_addr: usize,
    eb: usize,
}

impl CopyBackend for Stream {
    fn name(&self) -> String {
        "stream".into()
    }
    fn submit(&self, job: &CopyJob) -> ftrs_core::Result<Completion> {
        let block = (job.src() - self.pool_addr) / self.eb;
        self.order
            .lock()
            .unwrap()
            .push(((block / EXPERTS) as u32, (block % EXPERTS) as u32));
        self.inner.submit(job)
    }
    fn finish(&self, c: Completion) -> ftrs_core::Result<()> {
        let mut open = self.open.lock().unwrap();
        while !*open {
            open = self.cv.wait(open).unwrap();
        }
        self.inner.finish(c)
    }
}

/// Order of copies when a demand arrives while three prefetches wait for the link.
fn submission_order(max_inflight_prefetches: usize) -> Vec<(u32, u32)> {
    submission_order_set(max_inflight_prefetches, None)
}

/// [`submission_order`] with the limit changed to `set` before the first lookup.
fn submission_order_set(max_inflight_prefetches: usize, set: Option<usize>) -> Vec<(u32, u32)> {
    let p = pool();
    let stream = Arc::new(Stream {
        inner: HostBackend { threads: 1 },
        open: Mutex::new(false),
        cv: Condvar::new(),
        order: Mutex::new(Vec::new()),
        pool_addr: p.address(),
        eb: p.layout().expert_bytes(),
    });
    let mut buf = vec![0u8; 8 * p.layout().expert_bytes()];
    // SAFETY: `buf` is host memory, disjoint from the pool, that outlives the engine (dropped
    // at the end of this function, after it), and is never read here.
    let dst = unsafe { Destination::new(buf.as_mut_ptr() as usize, buf.len(), MemKind::Host) };
    let cfg = EngineConfig {
        num_slots: 8,
        policy: Policy::Lru,
        max_inflight_bytes: 0,
        max_inflight_prefetches,
        prefetch_chunk_bytes: 0,
        pacing_bytes_per_s: 0.0,
    };
    let eng = TransferEngine::new(p, dst, cfg, stream.clone(), Arc::new(RealClock::new())).unwrap();
    let _open = OpenOnDrop(|| open_stream(&stream));
    if let Some(n) = set {
        eng.set_max_inflight_prefetches(n);
    }
    let (_, t) = eng.lookup(0, &[], &[(1, 0), (1, 1), (1, 2)]).unwrap();
    eng.wait(t).unwrap();
    std::thread::sleep(Duration::from_millis(20));
    let (_, t) = eng.lookup(0, &[5], &[]).unwrap();
    open_stream(&stream);
    eng.wait(t).unwrap();
    idle(&eng);
    eng.check_invariants().unwrap();
    drop(eng);
    drop(buf);
    let order = stream.order.lock().unwrap().clone();
    order
}

#[test]
fn a_demand_waits_behind_at_most_the_allowed_prefetches_in_flight() {
    // One prefetch on the link: the demand overtakes the two still queued.
    assert_eq!(submission_order(1), vec![(1, 0), (0, 5), (1, 1), (1, 2)]);
    assert_eq!(submission_order(2), vec![(1, 0), (1, 1), (0, 5), (1, 2)]);
    // No limit: every prefetch was on the link before the demand came.
    assert_eq!(submission_order(0), vec![(1, 0), (1, 1), (1, 2), (0, 5)]);
}

#[test]
fn the_prefetch_limit_can_change_while_running() {
    // Configured without a limit, set to one before any copy: the demand overtakes.
    assert_eq!(
        submission_order_set(0, Some(1)),
        vec![(1, 0), (0, 5), (1, 1), (1, 2)]
    );
    assert_eq!(
        submission_order_set(1, Some(0)),
        vec![(1, 0), (1, 1), (1, 2), (0, 5)]
    );
}

#[test]
fn cancelled_prefetches_never_land_queued_or_started() {
    let rig = gated(8);
    let _open = OpenOnDrop(|| rig.3.open());
    let (eng, _dst, _p, gate) = (&rig.0, &*rig.1, &rig.2, &rig.3);
    // A started prefetch (blocked in the backend) and two queued ones.
    let (_, t) = eng.lookup(0, &[], &[(2, 1), (2, 2), (2, 3)]).unwrap();
    eng.wait(t).unwrap();
    std::thread::sleep(Duration::from_millis(20));
    assert_eq!(eng.cancel_prefetches(), 3);
    gate.open();
    idle(eng);
    assert!(eng.resident().is_empty(), "{:?}", eng.resident());
    assert_eq!(gate.order(), vec![(2, 1)]);
    let s = eng.stats();
    assert_eq!((s.prefetch_cancelled, s.prefetch_wasted), (3, 3));
    eng.check_invariants().unwrap();
    // All slots are usable again.
    let (_, t) = eng.lookup(0, &[0, 1, 2, 3, 4, 5, 6, 7], &[]).unwrap();
    eng.wait(t).unwrap();
}

#[test]
fn demand_beyond_unpinned_capacity_is_a_capacity_error_that_changes_nothing() {
    let rig = host_engine(3);
    let (eng, _dst, _p) = (&rig.0, &*rig.1, &rig.2);
    let (_, t) = eng.lookup(0, &[0, 1], &[]).unwrap();
    eng.wait(t).unwrap();
    assert!(matches!(
        eng.lookup(1, &[0, 1], &[]),
        Err(CoreError::Capacity(_))
    ));
    eng.check_invariants().unwrap();
    let (_, t) = eng.lookup(1, &[0], &[]).unwrap();
    eng.wait(t).unwrap();
    assert!(matches!(
        eng.lookup(0, &[9], &[]),
        Err(CoreError::Config(_))
    ));
}

#[test]
fn an_injected_fault_fails_the_nth_copy_and_frees_its_slot() {
    let rig = host_engine(4);
    let (eng, _dst, _p) = (&rig.0, &*rig.1, &rig.2);
    eng.inject_fault(DeviceFault::DeviceLost, 1);
    let (_, t) = eng.lookup(0, &[0], &[]).unwrap();
    eng.wait(t).unwrap();
    let (_, t) = eng.lookup(0, &[1], &[]).unwrap();
    match eng.wait(t) {
        Err(CoreError::Device {
            kind: DeviceFault::DeviceLost,
            injected: true,
            ..
        }) => {}
        other => panic!("expected an injected DeviceLost, got {other:?}"),
    }
    eng.release();
    eng.check_invariants().unwrap();
    assert_eq!(eng.resident().len(), 1);
    let (_, t) = eng.lookup(0, &[1], &[]).unwrap();
    eng.wait(t).unwrap();
}

#[test]
fn the_inflight_budget_bounds_bytes_in_flight_on_a_simulated_link() {
    let clock = Arc::new(VirtualClock::new());
    let p = pool();
    let eb = p.layout().expert_bytes();
    // 1 byte per ns, 10 us per copy.
    let link = Arc::new(SimulatedBackend::new(1.0, 10.0, clock.clone(), 1).unwrap());
    let rig = engine_on(Arc::clone(&p), 8, link, clock.clone(), 2 * eb);
    let (eng, dst) = (&rig.0, &*rig.1);
    let (slots, t) = eng.lookup(0, &[0, 1, 2, 3, 4, 5], &[]).unwrap();
    eng.wait(t).unwrap();
    for (e, s) in slots.iter().enumerate() {
        assert_eq!(slot_byte(dst, &p, *s), e as u8 + 1);
    }
    // A serial link: six copies of (10 us + eb ns) back to back.
    let expect = 6.0 * (10e-6 + eb as f64 * 1e-9);
    let took = clock.now().as_secs_f64();
    assert!((took - expect).abs() < 1e-9, "{took} vs {expect}");
}

#[test]
fn pacing_holds_the_byte_rate_on_a_virtual_clock() {
    let clock = Arc::new(VirtualClock::new());
    let p = pool();
    let eb = p.layout().expert_bytes() as f64;
    let rate = eb * 100.0; // 100 blocks per virtual second; burst = one block
    let rig = engine_paced(
        Arc::clone(&p),
        8,
        Arc::new(HostBackend { threads: 1 }),
        clock.clone(),
        0,
        rate,
    );
    let eng = &rig.0;
    let (_, t) = eng.lookup(0, &[0, 1, 2, 3, 4, 5, 6, 7], &[]).unwrap();
    eng.wait(t).unwrap();
    // The first block rides the burst; seven more at 10 ms each.
    let took = clock.now().as_secs_f64();
    assert!((took - 0.07).abs() < 1e-6, "took {took}");
}

#[test]
fn pacing_can_be_turned_on_and_off_while_running() {
    let clock = Arc::new(VirtualClock::new());
    let p = pool();
    let eb = p.layout().expert_bytes() as f64;
    let rig = engine_paced(
        Arc::clone(&p),
        8,
        Arc::new(HostBackend { threads: 1 }),
        clock.clone(),
        0,
        0.0,
    );
    let eng = &rig.0;
    assert_eq!(eng.pacing_bytes_per_s(), 0.0);
    assert!(eng.set_pacing(-1.0).is_err());
    assert!(eng.set_pacing(f64::NAN).is_err());
    eng.set_pacing(eb * 100.0).unwrap();
    assert_eq!(eng.pacing_bytes_per_s(), eb * 100.0);
    let (_, t) = eng.lookup(0, &[0, 1, 2, 3], &[]).unwrap();
    eng.wait(t).unwrap();
    eng.release();
    // One block rides the burst; three more at 10 ms each.
    let took = clock.now().as_secs_f64();
    assert!((took - 0.03).abs() < 1e-6, "took {took}");
    eng.set_pacing(0.0).unwrap();
    assert_eq!(eng.pacing_bytes_per_s(), 0.0);
    let (_, t) = eng.lookup(1, &[0, 1, 2, 3], &[]).unwrap();
    eng.wait(t).unwrap();
    let after = clock.now().as_secs_f64();
    assert!(
        (after - took).abs() < 1e-6,
        "unpaced copies took {}",
        after - took
    );
}

/// Copies on submit, but each copy ends 0-160 us later (a fixed pseudo-random pattern), so
/// lookups and cancellations meet copies and chunks in flight.
#[derive(Debug, Default)]
struct Lagging {
    copies: std::sync::atomic::AtomicU64,
}

impl CopyBackend for Lagging {
    fn name(&self) -> String {
        "lagging".into()
    }
    fn submit(&self, job: &CopyJob) -> ftrs_core::Result<Completion> {
        job.run_host(1)?;
        let n = self
            .copies
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        Ok(Completion::At(Duration::from_micros(n * 7919 % 5 * 40)))
    }
    fn finish(&self, c: Completion) -> ftrs_core::Result<()> {
        if let Completion::At(lag) = c {
            std::thread::sleep(lag);
        }
        Ok(())
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 64, ..ProptestConfig::default() })]

    #[test]
    fn random_lookups_keep_every_invariant(
        ops in proptest::collection::vec(
            (0u8..5, 0u32..LAYERS as u32, proptest::collection::vec(0u32..EXPERTS as u32, 0..4),
             proptest::collection::vec((0u32..LAYERS as u32, 0u32..EXPERTS as u32), 0..4)),
            1..40),
        slots in 4usize..10,
        chunk in prop_oneof![Just(0usize), 1usize..200],
        lagging in any::<bool>(),
    ) {
        let p = pool();
        let backend: Arc<dyn CopyBackend> = if lagging {
            Arc::new(Lagging::default())
        } else {
            Arc::new(HostBackend { threads: 1 })
        };
        let (e, d) =
            engine_chunked(Arc::clone(&p), slots, backend, Arc::new(RealClock::new()), 0, 0.0, chunk);
        let rig = (e, d, p);
    let (eng, dst, p) = (&rig.0, &*rig.1, &rig.2);
        let mut held: Vec<((u32, u32), u32)> = Vec::new();
        for (op, layer, demand, prefetch) in ops {
            match op {
                0..=2 => match eng.lookup(layer, &demand, &prefetch) {
                    Ok((got, t)) => {
                        eng.wait(t).unwrap();
                        for (e, s) in demand.iter().zip(&got) {
                            held.push(((layer, *e), *s));
                        }
                    }
                    Err(CoreError::Capacity(_)) => {}
                    Err(e) => panic!("{e}"),
                },
                3 => { eng.release(); held.clear(); }
                _ => { eng.cancel_prefetches(); }
            }
            eng.check_invariants().map_err(TestCaseError::fail)?;
            // Pinned experts stay resident, in their slot, with their bytes.
            let resident = eng.resident();
            prop_assert!(resident.len() <= slots);
            for &((l, e), s) in &held {
                prop_assert!(resident.contains(&(l, e, s)), "{:?} lost slot {}", (l, e), s);
                prop_assert_eq!(slot_byte(dst, p, s), (l * 16 + e + 1) as u8);
            }
            let mut seen = std::collections::HashSet::new();
            for (_, _, s) in &resident {
                prop_assert!(seen.insert(*s), "slot {} owned twice", s);
            }
        }
    }
}

/// An engine over a [`Stream`] (completions held until opened) with one prefetch copy in
/// flight and prefetches copied in chunks of `chunk` bytes.
fn streamed(chunk: usize) -> (TransferEngine, Box<Dst>, Arc<ExpertPool>, Arc<Stream>) {
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

fn open_stream(s: &Stream) {
    *s.open.lock().unwrap() = true;
    s.cv.notify_all();
}

fn slot_of(eng: &TransferEngine, key: (u32, u32)) -> Option<u32> {
    eng.resident()
        .iter()
        .find(|&&(l, e, _)| (l, e) == key)
        .map(|r| r.2)
}

#[test]
fn a_demand_overtakes_a_chunked_prefetch_between_its_chunks() {
    let rig = streamed(64);
    let _open = OpenOnDrop(|| open_stream(&rig.3));
    let (eng, dst, p, stream) = (&rig.0, &*rig.1, &rig.2, &rig.3);
    assert_eq!(
        p.layout().expert_bytes(),
        192,
        "three chunks of 64 bytes per expert"
    );
    // The first chunk of (1,0) is on the link; its other two wait (one prefetch copy at a time).
    eng.lookup(0, &[], &[(1, 0)]).unwrap();
    std::thread::sleep(Duration::from_millis(20));
    let (slots, t) = eng.lookup(0, &[5], &[]).unwrap();
    open_stream(stream);
    eng.wait(t).unwrap();
    idle(eng);
    assert_eq!(
        stream.order.lock().unwrap().clone(),
        vec![(1, 0), (0, 5), (1, 0), (1, 0)]
    );
    assert_eq!(slot_byte(dst, p, slots[0]), 5 + 1);
    let s = slot_of(eng, (1, 0)).expect("the prefetch landed whole");
    assert_eq!(slot_byte(dst, p, s), 16 + 1);
    assert_eq!(eng.stats().bytes_h2d, 2 * 192);
    eng.check_invariants().unwrap();
}

#[test]
fn a_chunked_prefetch_demanded_midway_ends_as_one_demand_copy() {
    let rig = streamed(64);
    let _open = OpenOnDrop(|| open_stream(&rig.3));
    let (eng, dst, p, stream) = (&rig.0, &*rig.1, &rig.2, &rig.3);
    eng.lookup(0, &[], &[(1, 0)]).unwrap();
    std::thread::sleep(Duration::from_millis(20));
    // Demanded with one chunk on the link: the other 128 bytes go as one demand copy, and
    // the ticket waits for both.
    let (slots, t) = eng.lookup(1, &[0], &[]).unwrap();
    open_stream(stream);
    eng.wait(t).unwrap();
    assert_eq!(slot_byte(dst, p, slots[0]), 16 + 1);
    idle(eng);
    let s = eng.stats();
    assert_eq!(
        (s.prefetch_used, s.demand_fetches, s.bytes_h2d),
        (1, 0, 192)
    );
    assert_eq!(stream.order.lock().unwrap().len(), 2);
    eng.check_invariants().unwrap();
}

#[test]
fn a_cancelled_chunked_prefetch_issues_no_more_chunks_and_never_lands() {
    let rig = streamed(64);
    let _open = OpenOnDrop(|| open_stream(&rig.3));
    let (eng, _dst, _p, stream) = (&rig.0, &*rig.1, &rig.2, &rig.3);
    eng.lookup(0, &[], &[(2, 1), (2, 2)]).unwrap();
    std::thread::sleep(Duration::from_millis(20));
    assert_eq!(eng.cancel_prefetches(), 2);
    eng.check_invariants().unwrap();
    open_stream(stream);
    idle(eng);
    assert_eq!(stream.order.lock().unwrap().clone(), vec![(2, 1)]);
    assert!(eng.resident().is_empty(), "{:?}", eng.resident());
    let s = eng.stats();
    // the one chunk crossed the link
    assert_eq!((s.prefetch_cancelled, s.bytes_h2d), (2, 64));
    eng.check_invariants().unwrap();
    let (_, t) = eng.lookup(0, &[0, 1, 2, 3, 4, 5, 6, 7], &[]).unwrap();
    eng.wait(t).unwrap();
}

#[test]
fn chunked_prefetches_land_whole_for_any_chunk_size() {
    for chunk in [1, 50, 64, 191, 192, 1000] {
        let rig = host_engine_chunked(8, chunk);
        let (eng, dst, p) = (&rig.0, &*rig.1, &rig.2);
        eng.lookup(0, &[], &[(1, 2), (2, 7), (1, 5)]).unwrap();
        idle(eng);
        let (slots, t) = eng.lookup(1, &[2, 5], &[]).unwrap();
        eng.wait(t).unwrap();
        assert_eq!(slot_byte(dst, p, slots[0]), 16 + 2 + 1, "chunk {chunk}");
        assert_eq!(slot_byte(dst, p, slots[1]), 16 + 5 + 1, "chunk {chunk}");
        let s = eng.stats();
        assert_eq!(
            (s.hits, s.prefetch_used, s.bytes_h2d),
            (2, 2, 3 * 192),
            "chunk {chunk}"
        );
        eng.check_invariants().unwrap();
    }
}

#[test]
fn a_failed_chunk_fails_its_whole_prefetch_and_frees_the_slot() {
    let rig = host_engine_chunked(4, 64);
    let (eng, dst, p) = (&rig.0, &*rig.1, &rig.2);
    eng.inject_fault(DeviceFault::DeviceLost, 1); // the second chunk fails
    eng.lookup(0, &[], &[(1, 3)]).unwrap();
    idle(eng);
    eng.check_invariants().unwrap();
    assert!(eng.resident().is_empty(), "{:?}", eng.resident());
    assert_eq!(eng.stats().bytes_h2d, 64);
    // fetched again, whole, on demand
    let (slots, t) = eng.lookup(1, &[3], &[]).unwrap();
    eng.wait(t).unwrap();
    assert_eq!(slot_byte(dst, p, slots[0]), 16 + 3 + 1);
    assert_eq!(eng.stats().misses, 1);
}

#[test]
fn chunks_keep_a_simulated_link_busy_for_exactly_the_bytes() {
    let clock = Arc::new(VirtualClock::new());
    let p = pool();
    let eb = p.layout().expert_bytes();
    // 1 byte per ns, no per-copy latency: 50-byte chunks cost the link nothing extra.
    let link = Arc::new(SimulatedBackend::new(1.0, 0.0, clock.clone(), 1).unwrap());
    let rig = engine_chunked(Arc::clone(&p), 8, link, clock.clone(), 0, 0.0, 50);
    let eng = &rig.0;
    eng.lookup(0, &[], &[(1, 0), (1, 1)]).unwrap();
    idle(eng);
    let took = clock.now().as_secs_f64();
    let expect = 2.0 * eb as f64 * 1e-9;
    assert!((took - expect).abs() < 1e-12, "{took} vs {expect}");
    assert_eq!(eng.stats().bytes_h2d, 2 * eb as u64);
}

#[test]
fn ready_tells_landed_slots_from_those_still_on_the_link() {
    let rig = streamed(0);
    let _open = OpenOnDrop(|| open_stream(&rig.3));
    let (eng, stream) = (&rig.0, &rig.3);
    let (first, t) = eng.lookup(0, &[1], &[]).unwrap();
    open_stream(stream);
    eng.wait(t).unwrap();
    eng.release();
    *stream.open.lock().unwrap() = false;
    // (0,1) is resident; (0,2) is copied but its completion is held
    let (slots, t) = eng.lookup(0, &[1, 2], &[]).unwrap();
    assert_eq!(slots[0], first[0]);
    assert_eq!(eng.ready(&slots), vec![true, false]);
    assert_eq!(eng.ready(&[99]), vec![false]);
    open_stream(stream);
    eng.wait(t).unwrap();
    assert_eq!(eng.ready(&slots), vec![true, true]);
    eng.check_invariants().unwrap();
}
