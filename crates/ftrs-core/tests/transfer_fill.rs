//! Fills (`TransferEngine::fill`): experts computed elsewhere are copied in only when the link
//! is idle, land whole for a later lookup to hit, wait behind every demand and prefetch, are
//! kept by the stale rule, are upgraded (not fetched twice) when demanded in flight, skip what
//! is resident, take no slot while none is evictable, replace only their own layer's
//! experts when no slot is free, and count as uses of their experts in the eviction policy.

mod common;

use std::time::Duration;

use common::*;
use ftrs_core::Policy;

/// Waits until nothing is queued, in flight or asked for.
fn settled(eng: &ftrs_core::TransferEngine) {
    for _ in 0..10_000 {
        let s = eng.stats();
        if s.queue_depth == 0 && s.inflight_bytes == 0 && s.fill_queued == 0 {
            return;
        }
        std::thread::sleep(Duration::from_millis(1));
    }
    panic!("engine never settled");
}

#[test]
fn a_fill_lands_on_an_idle_link_and_a_later_lookup_hits_it() {
    let (eng, dst, p) = host_engine(8);
    assert_eq!(eng.fill(&[(1, 3), (2, 5)]).unwrap(), 2);
    settled(&eng);
    let s = eng.stats();
    assert_eq!(
        (s.fill_requested, s.fill_issued, s.demand_fetches),
        (2, 2, 0)
    );
    assert_eq!((s.prefetch_issued, s.fill_used), (0, 0)); // counted apart from prefetches
    let (slots, t) = eng.lookup(1, &[3], &[]).unwrap();
    eng.wait(t).unwrap();
    assert_eq!(slot_byte(&dst, &p, slots[0]), 16 + 3 + 1);
    let s = eng.stats();
    assert_eq!(
        (s.hits, s.misses, s.demand_fetches, s.fill_used),
        (1, 0, 0, 1)
    );
    assert_eq!(
        slot_byte(&dst, &p, slot_of(&eng, (2, 5)).unwrap()),
        2 * 16 + 5 + 1
    );
    eng.release();
    eng.check_invariants().unwrap();
}

#[test]
fn a_fill_waits_behind_every_demand_and_prefetch() {
    let rig = gated(8);
    let _open = OpenOnDrop(|| rig.3.open());
    let (eng, gate) = (&rig.0, &rig.3);
    // (0,0) blocks at the gate with a prefetch queued behind it; the fill is asked for then,
    // and a second demand after it.
    let (_, t0) = eng.lookup(0, &[0], &[(1, 0)]).unwrap();
    std::thread::sleep(Duration::from_millis(20));
    eng.fill(&[(2, 1)]).unwrap();
    let (_, t1) = eng.lookup(0, &[5], &[]).unwrap();
    gate.open();
    eng.wait(t0).unwrap();
    eng.wait(t1).unwrap();
    settled(eng);
    assert_eq!(gate.order(), vec![(0, 0), (0, 5), (1, 0), (2, 1)]);
    eng.check_invariants().unwrap();
}

#[test]
fn the_stale_rule_keeps_a_fill_and_later_prefetches_overtake_it() {
    let rig = streamed(64); // chunks of 64 bytes, one prefetch chunk in flight
    let _open = OpenOnDrop(|| open_stream(&rig.3));
    let (eng, dst, p, stream) = (&rig.0, &*rig.1, &rig.2, &rig.3);
    eng.fill(&[(0, 2)]).unwrap();
    std::thread::sleep(Duration::from_millis(20)); // its first chunk is on the link
                                                   // Layer 1 is reached: a prefetch of layer 0 would be stale here; the fill is not. The
                                                   // prefetch of layer 2 goes ahead of the fill's chunks left.
    let (_, t) = eng.lookup(1, &[4], &[(2, 6)]).unwrap();
    open_stream(stream);
    eng.wait(t).unwrap();
    settled(eng);
    let order = stream.order.lock().unwrap().clone();
    let first_fill = order.iter().position(|&k| k == (0, 2)).unwrap();
    let prefetch = order.iter().position(|&k| k == (2, 6)).unwrap();
    let last_fill = order.iter().rposition(|&k| k == (0, 2)).unwrap();
    assert!(first_fill < prefetch && prefetch < last_fill, "{order:?}");
    let s = eng.stats();
    assert_eq!(
        (s.fill_issued, s.fill_dropped, s.prefetch_cancelled),
        (1, 0, 0)
    );
    assert_eq!(slot_byte(dst, p, slot_of(eng, (0, 2)).unwrap()), 2 + 1);
    eng.release();
    eng.check_invariants().unwrap();
}

#[test]
fn a_demand_for_a_fill_in_flight_upgrades_it_instead_of_fetching_twice() {
    let rig = streamed(64);
    let _open = OpenOnDrop(|| open_stream(&rig.3));
    let (eng, dst, p, stream) = (&rig.0, &*rig.1, &rig.2, &rig.3);
    eng.fill(&[(0, 2)]).unwrap();
    std::thread::sleep(Duration::from_millis(20));
    let (slots, t) = eng.lookup(0, &[2], &[]).unwrap();
    open_stream(stream);
    eng.wait(t).unwrap();
    assert_eq!(slot_byte(dst, p, slots[0]), 2 + 1);
    let s = eng.stats();
    assert_eq!(
        (s.demand_fetches, s.misses, s.fill_used, s.fill_issued),
        (0, 1, 1, 1)
    );
    eng.release();
    settled(eng);
    eng.check_invariants().unwrap();
}

#[test]
fn a_fill_skips_what_is_resident_and_waits_for_its_layers_slot() {
    let (eng, dst, p) = host_engine(2);
    let (_, t) = eng.lookup(0, &[0, 1], &[]).unwrap();
    eng.wait(t).unwrap();
    // both slots pinned: (0,1) is resident, skipped; (0,2) waits for a slot of layer 0
    assert_eq!(eng.fill(&[(0, 1), (0, 2)]).unwrap(), 1);
    std::thread::sleep(Duration::from_millis(20));
    let s = eng.stats();
    assert_eq!((s.fill_issued, s.fill_queued), (0, 1));
    eng.release(); // a slot is evictable again: the fill starts, evicting per policy (LRU)
    settled(&eng);
    assert_eq!(eng.stats().fill_issued, 1);
    assert_eq!(slot_byte(&dst, &p, slot_of(&eng, (0, 2)).unwrap()), 2 + 1);
    assert!(slot_of(&eng, (0, 0)).is_none() && slot_of(&eng, (0, 1)).is_some());
    eng.check_invariants().unwrap();
}

#[test]
fn a_fill_replaces_only_its_own_layers_experts() {
    let (eng, dst, p) = host_engine(4);
    for layer in [0, 1] {
        let (_, t) = eng.lookup(layer, &[0, 1], &[]).unwrap();
        eng.wait(t).unwrap();
        eng.release();
    }
    // the cache is full and layer 0's experts are the least recent: a fill of layer 1 still
    // evicts layer 1's least recent, (1,0); one of layer 2, which holds no slot, is dropped
    eng.fill(&[(1, 2)]).unwrap();
    settled(&eng);
    eng.fill(&[(2, 0)]).unwrap();
    settled(&eng);
    let s = eng.stats();
    assert_eq!((s.fill_requested, s.fill_issued, s.fill_queued), (2, 1, 0));
    assert_eq!(
        slot_byte(&dst, &p, slot_of(&eng, (1, 2)).unwrap()),
        16 + 2 + 1
    );
    for (key, held) in [
        ((0, 0), true),
        ((0, 1), true),
        ((1, 0), false),
        ((1, 1), true),
    ] {
        assert_eq!(slot_of(&eng, key).is_some(), held, "{key:?}");
    }
    assert!(slot_of(&eng, (2, 0)).is_none());
    eng.check_invariants().unwrap();
}

#[test]
fn a_fill_counts_as_a_use_of_its_experts() {
    // LRU: (0,0) and (0,1) resident, (0,0) the older; the CPU then uses (0,0) (a fill of a
    // resident expert is no copy, but it is a use), so a demand for (0,2) evicts (0,1).
    let (eng, _dst, _p) = host_engine(2);
    let (_, t) = eng.lookup(0, &[0, 1], &[]).unwrap();
    eng.wait(t).unwrap();
    eng.release();
    assert_eq!(eng.fill(&[(0, 0)]).unwrap(), 0);
    let (_, t) = eng.lookup(0, &[2], &[]).unwrap();
    eng.wait(t).unwrap();
    eng.release();
    assert!(slot_of(&eng, (0, 0)).is_some() && slot_of(&eng, (0, 1)).is_none());

    // LRFU: the device used (0,0) at three turns; the CPU then used (0,1) at four, each a
    // fill (landed after the first). A demand for (0,2) evicts (0,0), the lower score; had
    // the fills not counted, (0,1) would score one use and go.
    let (eng, _dst, _p) = host_engine_with(2, Policy::Lrfu);
    for _ in 0..3 {
        let (_, t) = eng.lookup(0, &[0], &[]).unwrap();
        eng.wait(t).unwrap();
        eng.release();
    }
    for _ in 0..4 {
        eng.fill(&[(0, 1)]).unwrap();
        settled(&eng);
    }
    assert_eq!(eng.stats().fill_issued, 1);
    let (_, t) = eng.lookup(0, &[2], &[]).unwrap();
    eng.wait(t).unwrap();
    eng.release();
    assert!(slot_of(&eng, (0, 0)).is_none() && slot_of(&eng, (0, 1)).is_some());
    eng.check_invariants().unwrap();
}

#[test]
fn cancel_prefetches_drops_fill_requests_and_a_closed_engine_refuses_them() {
    let (eng, _dst, _p) = host_engine(2);
    let (_, t) = eng.lookup(0, &[0, 1], &[]).unwrap();
    eng.wait(t).unwrap();
    eng.fill(&[(1, 1), (1, 2)]).unwrap();
    eng.cancel_prefetches();
    eng.release();
    settled(&eng);
    assert_eq!(eng.stats().fill_issued, 0);
    assert!(eng.fill(&[(9, 0)]).is_err()); // no such layer
    eng.close();
    assert!(eng.fill(&[(1, 1)]).is_err());
}

#[test]
fn the_fill_queue_keeps_the_newest_requests() {
    let (eng, _dst, _p) = host_engine(2);
    let (_, t) = eng.lookup(0, &[0, 1], &[]).unwrap();
    eng.wait(t).unwrap();
    // no slot evictable: three requests wait, the queue keeps two (the slot count)
    eng.fill(&[(0, 2), (0, 3), (0, 4)]).unwrap();
    eng.fill(&[(0, 3)]).unwrap(); // asked again: now the newest
    assert_eq!(eng.stats().fill_queued, 2);
    eng.release();
    settled(&eng);
    // (0,2) was dropped; (0,3) and (0,4) were copied (ties in recency may evict one for the
    // other: `fills_are_served_newest_first` has their order)
    assert!(slot_of(&eng, (0, 2)).is_none());
    assert!(slot_of(&eng, (0, 4)).is_some());
    let s = eng.stats();
    assert_eq!((s.fill_requested, s.fill_issued), (4, 2));
    eng.check_invariants().unwrap();
}

#[test]
fn fills_are_served_newest_first() {
    let rig = gated(8);
    let _open = OpenOnDrop(|| rig.3.open());
    let (eng, gate) = (&rig.0, &rig.3);
    let (_, t) = eng.lookup(0, &[0], &[]).unwrap(); // blocks at the gate
    std::thread::sleep(Duration::from_millis(20));
    eng.fill(&[(1, 1), (1, 2)]).unwrap();
    eng.fill(&[(1, 3)]).unwrap();
    gate.open();
    eng.wait(t).unwrap();
    settled(eng);
    assert_eq!(gate.order(), vec![(0, 0), (1, 3), (1, 2), (1, 1)]);
}
