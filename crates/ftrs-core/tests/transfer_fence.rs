//! Release fences: a copy into a slot released with `release_after` waits on that release's
//! fence first (once), a copy into a slot that was never released with one does not wait,
//! a later fence on a stream replaces an earlier one, a fence that cannot be recorded leaves
//! the slots pinned, a failed wait is retried by the slot's next copy, and demand still goes
//! before prefetch. The backend below records every fence, wait and copy in one sequence.

mod common;

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, OnceLock};
use std::time::Duration;

use common::*;
use ftrs_core::backend::{Completion, CopyBackend, Fence, HostBackend};
use ftrs_core::raw::CopyJob;
use ftrs_core::{CoreError, DeviceFault, ExpertPool, RealClock, TransferEngine};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Op {
    /// Fence `n` recorded on the caller's stream.
    Record(u64),
    /// The copy stream ordered behind fence `n`.
    Wait(u64),
    /// A copy of expert `key` into `slot`.
    Copy { slot: u32, key: (u32, u32) },
}

/// Host copies that log fences, waits and copies in the order the engine calls them, and
/// block every copy until opened (open by default).
#[derive(Debug)]
struct Recorder {
    inner: HostBackend,
    ops: Mutex<Vec<Op>>,
    /// Last fence number given out.
    fences: AtomicU64,
    /// The slot buffer's first byte (set once the engine exists).
    dst: OnceLock<usize>,
    pool_addr: usize,
    eb: usize,
    open: Mutex<bool>,
    cv: Condvar,
    fail_record: AtomicBool,
    fail_wait: AtomicBool,
}

impl Recorder {
    fn ops(&self) -> Vec<Op> {
        self.ops.lock().unwrap().clone()
    }
    fn set_open(&self, open: bool) {
        *self.open.lock().unwrap() = open;
        self.cv.notify_all();
    }
}

impl CopyBackend for Recorder {
    fn name(&self) -> String {
        "recorder".into()
    }
    unsafe fn record_fence(&self, _stream: u64) -> ftrs_core::Result<Fence> {
        if self.fail_record.load(Ordering::SeqCst) {
            return Err(CoreError::Config("no fence today".into()));
        }
        let n = self.fences.fetch_add(1, Ordering::SeqCst) + 1;
        self.ops.lock().unwrap().push(Op::Record(n));
        Ok(Fence::Marker(n))
    }
    fn wait_fence(&self, fence: &Fence) -> ftrs_core::Result<()> {
        let Fence::Marker(n) = fence else {
            panic!("a host test backend got a CUDA fence")
        };
        if self.fail_wait.swap(false, Ordering::SeqCst) {
            return Err(CoreError::Device {
                kind: DeviceFault::KernelFault,
                source_name: "copy_backend",
                injected: true,
                detail: "wait refused".into(),
            });
        }
        self.ops.lock().unwrap().push(Op::Wait(*n));
        Ok(())
    }
    unsafe fn submit(&self, job: &CopyJob<'_>) -> ftrs_core::Result<Completion> {
        let base = *self
            .dst
            .get()
            .expect("destination known before the first copy");
        let slot = ((job.dst() - base) / self.eb) as u32;
        let block = (job.src() - self.pool_addr) / self.eb;
        let key = ((block / EXPERTS) as u32, (block % EXPERTS) as u32);
        self.ops.lock().unwrap().push(Op::Copy { slot, key });
        let mut open = self.open.lock().unwrap();
        while !*open {
            open = self.cv.wait(open).unwrap();
        }
        drop(open);
        // SAFETY: this call's own contract, passed on unchanged.
        unsafe { self.inner.submit(job) }
    }
    fn finish(&self, c: Completion) -> ftrs_core::Result<()> {
        self.inner.finish(c)
    }
}

struct Rig {
    eng: TransferEngine,
    _dst: Box<Dst>,
    pool: Arc<ExpertPool>,
    rec: Arc<Recorder>,
}

fn rig(slots: usize, chunk: usize) -> Rig {
    let pool = pool();
    let rec = Arc::new(Recorder {
        inner: HostBackend { threads: 1 },
        ops: Mutex::new(Vec::new()),
        fences: AtomicU64::new(0),
        dst: OnceLock::new(),
        pool_addr: pool.address(),
        eb: pool.layout().expert_bytes(),
        open: Mutex::new(true),
        cv: Condvar::new(),
        fail_record: AtomicBool::new(false),
        fail_wait: AtomicBool::new(false),
    });
    let (eng, dst) = engine_chunked(
        Arc::clone(&pool),
        slots,
        rec.clone(),
        Arc::new(RealClock::new()),
        0,
        0.0,
        chunk,
    );
    rec.dst.set(dst.buf.as_ptr() as usize).unwrap();
    Rig {
        eng,
        _dst: dst,
        pool,
        rec,
    }
}

impl Rig {
    /// Demands `experts` of `layer`, waits for them, and returns their slots.
    fn fetch(&self, layer: u32, experts: &[u32]) -> Vec<u32> {
        let (slots, t) = self.eng.lookup(layer, experts, &[]).unwrap();
        self.eng.wait(t).unwrap();
        slots
    }
    fn release_after(&self, stream: u64) -> ftrs_core::Result<()> {
        // SAFETY: a host test backend never uses the stream handle.
        unsafe { self.eng.release_after(stream) }
    }
}

fn copy(slot: u32, key: (u32, u32)) -> Op {
    Op::Copy { slot, key }
}

#[test]
fn a_copy_into_a_slot_released_after_a_fence_waits_on_it_first_and_once() {
    let r = rig(2, 0);
    let s = r.fetch(0, &[0, 1]);
    r.release_after(7).unwrap();
    let a = r.fetch(0, &[2])[0]; // evicts (0,0): its slot was released after fence 1
    assert_eq!(a, s[0]);
    r.eng.release(); // plain: this caller's reads of (0,2) are done
    let b = r.fetch(0, &[3])[0]; // evicts (0,1): also released after fence 1, not waited yet
    assert_eq!(b, s[1]);
    r.eng.release();
    let c = r.fetch(0, &[4])[0]; // evicts (0,2): fence 1 was waited on by its copy already
    assert_eq!(c, a);
    r.eng.release();
    idle(&r.eng);
    assert_eq!(
        r.rec.ops(),
        vec![
            copy(s[0], (0, 0)),
            copy(s[1], (0, 1)),
            Op::Record(1),
            Op::Wait(1),
            copy(a, (0, 2)),
            Op::Wait(1),
            copy(b, (0, 3)),
            copy(c, (0, 4)),
        ]
    );
    let st = r.eng.stats();
    assert_eq!((st.fences_recorded, st.fence_waits), (1, 2));
    assert_eq!(slot_byte(&r._dst, &r.pool, c), 5); // byte of (0,4): 0*16 + 4 + 1
    r.eng.check_invariants().unwrap();
}

#[test]
fn copies_into_slots_never_released_after_a_fence_do_not_wait() {
    let r = rig(4, 0);
    r.fetch(0, &[0]);
    r.release_after(3).unwrap();
    for e in 1..4 {
        r.fetch(0, &[e]); // free slots: nobody read them
        r.eng.release();
    }
    r.release_after(3).unwrap(); // nothing pinned: no fence
    r.fetch(1, &[0]); // evicts (0,0), the one slot behind fence 1
    r.eng.release();
    idle(&r.eng);
    let ops = r.rec.ops();
    let waits: Vec<usize> = (0..ops.len())
        .filter(|&i| matches!(ops[i], Op::Wait(_)))
        .collect();
    assert_eq!(waits.len(), 1, "{ops:?}");
    assert_eq!(ops[waits[0]], Op::Wait(1));
    assert!(matches!(ops[waits[0] + 1], Op::Copy { key: (1, 0), .. }));
    assert_eq!(r.eng.stats().fences_recorded, 1);
}

#[test]
fn a_later_fence_on_a_stream_replaces_the_earlier_one_and_other_streams_add_up() {
    let r = rig(1, 0);
    let s = r.fetch(0, &[0])[0];
    r.release_after(7).unwrap(); // fence 1
    r.fetch(0, &[0]); // a hit, read again on stream 7
    r.release_after(7).unwrap(); // fence 2 covers fence 1
    r.fetch(0, &[0]);
    r.release_after(9).unwrap(); // fence 3, another stream
    r.fetch(0, &[1]);
    r.eng.release();
    idle(&r.eng);
    assert_eq!(
        r.rec.ops(),
        vec![
            copy(s, (0, 0)),
            Op::Record(1),
            Op::Record(2),
            Op::Record(3),
            Op::Wait(2),
            Op::Wait(3),
            copy(s, (0, 1)),
        ]
    );
    r.eng.check_invariants().unwrap();
}

#[test]
fn a_prefetch_waits_before_its_first_chunk_only() {
    let r = rig(2, 32);
    let s = r.fetch(0, &[0, 1]);
    r.release_after(7).unwrap();
    let (_, t) = r.eng.lookup(0, &[], &[(2, 5)]).unwrap();
    r.eng.wait(t).unwrap();
    idle(&r.eng);
    let ops = r.rec.ops();
    let after: Vec<Op> = ops[3..].to_vec(); // past the two copies and the record
    let chunks = r.pool.layout().block_bytes(2).unwrap().div_ceil(32);
    assert!(chunks > 1);
    let mut want = vec![Op::Wait(1)];
    want.extend(std::iter::repeat_n(copy(s[0], (2, 5)), chunks));
    assert_eq!(after, want);
    assert_eq!(slot_of(&r.eng, (2, 5)), Some(s[0]));
}

#[test]
fn a_fence_that_cannot_be_recorded_leaves_the_slots_pinned_until_a_release_succeeds() {
    let r = rig(2, 0);
    r.fetch(0, &[0, 1]);
    r.rec.fail_record.store(true, Ordering::SeqCst);
    assert!(matches!(r.release_after(7), Err(CoreError::Config(_))));
    assert!(matches!(
        r.eng.lookup(0, &[2], &[]),
        Err(CoreError::Capacity(_))
    ));
    r.rec.fail_record.store(false, Ordering::SeqCst);
    r.release_after(7).unwrap();
    let a = r.fetch(0, &[2])[0];
    r.eng.release();
    idle(&r.eng);
    let ops = r.rec.ops();
    assert_eq!(ops[2..], [Op::Record(1), Op::Wait(1), copy(a, (0, 2))]);
}

#[test]
fn a_failed_wait_fails_the_copy_and_the_slot_s_next_copy_waits_again() {
    let r = rig(1, 0);
    let s = r.fetch(0, &[0])[0];
    r.release_after(7).unwrap();
    r.rec.fail_wait.store(true, Ordering::SeqCst);
    let (_, t) = r.eng.lookup(0, &[1], &[]).unwrap();
    assert!(matches!(r.eng.wait(t), Err(CoreError::Device { .. })));
    r.eng.release();
    idle(&r.eng);
    assert_eq!(r.eng.stats().fence_waits, 0);
    r.fetch(0, &[1]);
    r.eng.release();
    idle(&r.eng);
    assert_eq!(
        r.rec.ops(),
        vec![copy(s, (0, 0)), Op::Record(1), Op::Wait(1), copy(s, (0, 1))]
    );
    assert_eq!(r.eng.stats().fence_waits, 1);
    r.eng.check_invariants().unwrap();
}

#[test]
fn a_demand_still_goes_before_a_queued_prefetch_and_each_waits_on_its_slot_s_fence() {
    let r = rig(3, 0);
    let _open = OpenOnDrop(|| r.rec.set_open(true));
    r.fetch(0, &[0, 1, 2]);
    r.release_after(7).unwrap(); // every slot behind fence 1
    r.rec.set_open(false);
    let (_, t0) = r.eng.lookup(0, &[3], &[]).unwrap(); // starts, blocks in the backend
    std::thread::sleep(Duration::from_millis(20));
    let (_, tp) = r.eng.lookup(0, &[], &[(1, 0)]).unwrap(); // queued behind it
    let (_, t1) = r.eng.lookup(0, &[4], &[]).unwrap(); // must overtake the prefetch
    r.rec.set_open(true);
    for t in [t0, tp, t1] {
        r.eng.wait(t).unwrap();
    }
    r.eng.release();
    idle(&r.eng);
    let ops = r.rec.ops();
    let tail: Vec<Op> = ops[4..].to_vec(); // past three copies and the record
    let keys: Vec<(u32, u32)> = tail
        .iter()
        .filter_map(|op| match op {
            Op::Copy { key, .. } => Some(*key),
            _ => None,
        })
        .collect();
    assert_eq!(keys, vec![(0, 3), (0, 4), (1, 0)]);
    // each of the three slots was behind fence 1: every copy waited right before it
    for pair in tail.chunks(2) {
        assert!(matches!(pair, [Op::Wait(1), Op::Copy { .. }]), "{tail:?}");
    }
    r.eng.check_invariants().unwrap();
}
