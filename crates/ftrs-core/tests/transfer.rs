//! Transfer engine behaviour: bytes land where the slots say, capacity errors change nothing,
//! faults free their slot, budget and pacing on a virtual clock, and random lookups keep every
//! invariant. Demand before prefetch and chunked prefetches: `transfer_prefetch.rs`.

mod common;

use std::sync::Arc;
use std::time::Duration;

use common::*;
use ftrs_core::backend::{Completion, CopyBackend, HostBackend, SimulatedBackend};
use ftrs_core::raw::CopyJob;
use ftrs_core::{Clock, CoreError, DeviceFault, RealClock, VirtualClock};
use proptest::prelude::*;

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
    assert_eq!(
        (eng.resident_in(1), eng.resident_in(0)),
        (vec![3, 5], vec![])
    );
    eng.check_invariants().unwrap();
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
    unsafe fn submit(&self, job: &CopyJob<'_>) -> ftrs_core::Result<Completion> {
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

#[test]
fn per_layer_blocks_move_their_own_bytes_into_slots_of_the_largest() {
    // Layer 1 is the largest, layer 2 (the last) the smallest: a copy of the region's last block
    // sized to the slot stride would run past the region's end.
    let sizes = [vec![100, 60], vec![100, 200], vec![40, 30]];
    let lay = ftrs_core::ExpertLayout::per_layer(EXPERTS, &sizes, 64).unwrap();
    let mut pool = ftrs_core::ExpertPool::new(lay, ftrs_core::PoolDtype::F32).unwrap();
    for (l, s) in sizes.iter().enumerate() {
        for e in 0..EXPERTS {
            for (t, &n) in s.iter().enumerate() {
                let bytes: Vec<u8> = (0..n).map(|i| (l * 64 + e * 7 + t * 3 + i) as u8).collect();
                pool.write(l, e, t, &bytes).unwrap();
            }
        }
    }
    let pool = Arc::new(pool);
    let lay = pool.layout();
    assert_eq!(lay.expert_bytes(), lay.block_bytes(1).unwrap());
    let (eng, dst) = engine_chunked(
        Arc::clone(&pool),
        4,
        Arc::new(HostBackend { threads: 1 }),
        Arc::new(RealClock::new()),
        0,
        0.0,
        48,
    );
    let mut want_bytes = 0u64;
    for l in 0..LAYERS as u32 {
        for e in (0..EXPERTS as u32).step_by(2) {
            let next = [(l, e + 1)];
            let (slots, t) = eng.lookup(l, &[e], &next).unwrap();
            eng.wait(t).unwrap();
            let (slots2, t2) = eng.lookup(l, &[e + 1], &[]).unwrap();
            eng.wait(t2).unwrap();
            for (x, s) in [(e, slots[0]), (e + 1, slots2[0])] {
                let bb = lay.block_bytes(l as usize).unwrap();
                let mut block = vec![0u8; bb];
                pool.read(
                    lay.block_offset(l as usize, x as usize).unwrap(),
                    &mut block,
                )
                .unwrap();
                let at = s as usize * lay.expert_bytes();
                assert_eq!(&dst.buf[at..at + bb], &block[..], "layer {l} expert {x}");
                want_bytes += bb as u64;
            }
            eng.check_invariants().unwrap();
            eng.release();
        }
    }
    assert_eq!(eng.stats().bytes_h2d, want_bytes);
    drop(eng);
}
