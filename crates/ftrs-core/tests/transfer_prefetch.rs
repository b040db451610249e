//! Demand before prefetch: a demand overtakes queued prefetches and prefetch chunks, waits
//! behind at most the allowed copies in flight, upgrades an in-flight prefetch instead of
//! fetching twice; stale and cancelled prefetches never land; chunks land whole.

mod common;

use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;

use common::*;
use ftrs_core::backend::{HostBackend, SimulatedBackend};
use ftrs_core::{
    Clock, Destination, DeviceFault, EngineConfig, MemKind, Policy, RealClock, TransferEngine,
    VirtualClock,
};

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
