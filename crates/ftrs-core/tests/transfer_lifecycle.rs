//! The transfer engine's life: a panicking worker fails every waiter with a typed error instead
//! of blocking them, and `close` drains, joins, is idempotent and refuses later lookups.

mod common;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{mpsc, Arc};
use std::time::Duration;

use common::*;
use ftrs_core::backend::{Completion, CopyBackend, HostBackend};
use ftrs_core::raw::CopyJob;
use ftrs_core::{CoreError, RealClock, TransferEngine};

/// Runs `f` on its own thread and fails the test if it has not returned within 10 s (a test
/// of "never blocks forever" must not itself hang).
fn within_10s<T: Send + 'static>(f: impl FnOnce() -> T + Send + 'static) -> T {
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(f());
    });
    rx.recv_timeout(Duration::from_secs(10))
        .expect("call still blocked after 10 s")
}

/// A test-only backend: copies like the host backend, then panics on copy number `at`.
#[derive(Debug)]
struct PanicsOnCopy {
    at: u64,
    copies: AtomicU64,
    inner: HostBackend,
}

impl CopyBackend for PanicsOnCopy {
    fn name(&self) -> String {
        "panics".into()
    }
    unsafe fn submit(&self, job: &CopyJob<'_>) -> ftrs_core::Result<Completion> {
        if self.copies.fetch_add(1, Ordering::Relaxed) == self.at {
            panic!("backend bug on copy {}", self.at);
        }
        // SAFETY: this call's own contract, passed on unchanged.
        unsafe { self.inner.submit(job) }
    }
    fn finish(&self, c: Completion) -> ftrs_core::Result<()> {
        self.inner.finish(c)
    }
}

fn panicking_engine(at: u64) -> Arc<(TransferEngine, Box<Dst>)> {
    let backend = Arc::new(PanicsOnCopy {
        at,
        copies: AtomicU64::new(0),
        inner: HostBackend { threads: 1 },
    });
    Arc::new(engine_on(pool(), 4, backend, Arc::new(RealClock::new()), 0))
}

#[test]
fn a_backend_panic_fails_the_waiting_ticket_and_every_later_lookup() {
    let rig = panicking_engine(1);
    let eng = &rig.0;
    let (_, t0) = eng.lookup(0, &[0], &[]).unwrap();
    eng.wait(t0).unwrap(); // copy 0 goes through
    let (_, t1) = eng.lookup(0, &[1, 2], &[]).unwrap();
    let r = {
        let rig = Arc::clone(&rig);
        within_10s(move || rig.0.wait(t1))
    };
    match r {
        Err(CoreError::WorkerPanic { detail, injected }) => {
            assert!(detail.contains("backend bug on copy 1"), "{detail}");
            assert!(!injected);
        }
        other => panic!("expected WorkerPanic, got {other:?}"),
    }
    eng.release();
    assert_eq!(eng.cancel_prefetches(), 0);
    assert!(matches!(
        eng.lookup(1, &[3], &[]),
        Err(CoreError::WorkerPanic { .. })
    ));
    // close joins a worker that already ended; dropping the rig must not hang either
    within_10s(move || {
        rig.0.close();
        drop(rig);
    });
}

#[test]
fn an_injected_worker_panic_reaches_waiters_blocked_before_it() {
    let rig = Arc::new(host_engine(4));
    let eng = &rig.0;
    eng.inject_panic(2);
    let (_, t) = eng.lookup(2, &[0, 1, 2, 3], &[]).unwrap();
    let waiter = {
        let rig = Arc::clone(&rig);
        std::thread::spawn(move || rig.0.wait(t))
    };
    let r = within_10s(move || waiter.join().unwrap());
    assert!(
        matches!(r, Err(CoreError::WorkerPanic { injected: true, .. })),
        "{r:?}"
    );
    assert!(matches!(
        eng.lookup(0, &[0], &[]),
        Err(CoreError::WorkerPanic { .. })
    ));
}

#[test]
fn close_drains_demand_copies_joins_and_refuses_later_lookups() {
    let rig = host_engine(4);
    let (eng, dst, pool) = (&rig.0, &*rig.1, &rig.2);
    let (slots, t) = eng.lookup(1, &[4, 6], &[(2, 0), (2, 1)]).unwrap();
    eng.close();
    assert!(eng.is_closed());
    eng.wait(t).unwrap(); // issued before the close: landed
    assert_eq!(slot_byte(dst, pool, slots[0]), 16 + 4 + 1);
    assert_eq!(slot_byte(dst, pool, slots[1]), 16 + 6 + 1);
    assert!(matches!(eng.lookup(1, &[4], &[]), Err(CoreError::Closed)));
    eng.close(); // idempotent
    let s = eng.stats();
    assert_eq!(s.queue_depth + s.inflight_bytes, 0);
    assert_eq!(s.demand_fetches, 2);
}
