//! The transfer engine's bookkeeping: the transfers, tickets and slot state that live under
//! its one mutex, and the mutations the engine's parts share (`allocate`, `queue`,
//! `drop_prefetch`, `unpin`). The rules they keep are the module doc of [`super`]'s.

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex, MutexGuard};

use super::fence::SlotFence;
use super::Stats;
use crate::cache::{Key, SlotCache};
use crate::clock::TokenBucket;
use crate::error::{CoreError, DeviceFault, Result};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Prio {
    Demand,
    Prefetch,
}

#[derive(Debug)]
pub(super) struct Transfer {
    /// The expert; while not cancelled, `inflight[key] == this transfer`.
    pub(super) key: Key,
    /// Destination slot; pinned once by this transfer until it ends.
    pub(super) slot: u32,
    /// Current priority (a prefetch becomes Demand when demanded).
    pub(super) prio: Prio,
    /// Issued as a prefetch (for used/wasted accounting).
    pub(super) was_prefetch: bool,
    /// A prefetch that was demanded before landing.
    pub(super) used: bool,
    /// Started from a fill request (`TransferEngine::fill`): a prefetch the stale rule keeps.
    pub(super) fill: bool,
    /// Size of the expert's block (its layer's `block_bytes`, <= the slot stride): what it moves.
    pub(super) bytes: usize,
    /// Bytes issued to the backend so far; in a queue while below `bytes`.
    pub(super) issued: usize,
    /// Bytes landed so far; the transfer lands at `bytes`.
    pub(super) landed: usize,
    /// Bytes issued and not finished (the copies in flight; > 0 for each one).
    pub(super) inflight_bytes: usize,
    /// Copies in flight that were issued as prefetch chunks.
    pub(super) inflight_prefetch_chunks: usize,
    /// Cancelled with a copy in flight: nothing more is issued, the result is discarded and
    /// the slot freed when the last copy ends.
    pub(super) cancelled: bool,
    /// The first failed copy: nothing more is issued; reported to the waiters at the end.
    pub(super) error: Option<CoreError>,
    /// Tickets completed by this transfer.
    pub(super) waiters: Vec<u64>,
}

#[derive(Debug)]
pub(super) struct Ticket {
    /// Transfers still to land; done at 0.
    pub(super) remaining: usize,
    /// First failure among them.
    pub(super) error: Option<CoreError>,
}

#[derive(Debug)]
pub(super) struct State {
    /// Slot ownership and policy.
    pub(super) cache: SlotCache,
    /// `ready[s]`: slot `s` holds the landed bytes of `cache.id_of_slot(s)`.
    pub(super) ready: Vec<bool>,
    /// `prefetched_unused[s]`: landed by a prefetch and not demanded since.
    pub(super) prefetched_unused: Vec<bool>,
    /// `filled_unused[s]`: landed by a fill and not demanded since.
    pub(super) filled_unused: Vec<bool>,
    /// Live transfers (queued or in flight) by id.
    pub(super) transfers: HashMap<u64, Transfer>,
    /// Key → its live, non-cancelled transfer: never two for one key.
    pub(super) inflight: HashMap<Key, u64>,
    /// Next transfer id.
    pub(super) next_transfer: u64,
    /// Demand transfers with bytes not yet issued, FIFO.
    pub(super) demand_q: VecDeque<u64>,
    /// Prefetch transfers with bytes not yet issued, FIFO (the head may be partly issued); a
    /// fill's transfer (at most one) after the others.
    pub(super) prefetch_q: VecDeque<u64>,
    /// Fill requests not yet started, oldest first, each key once (`TransferEngine::fill`).
    pub(super) fill_q: VecDeque<Key>,
    /// Tickets not yet waited on.
    pub(super) tickets: HashMap<u64, Ticket>,
    /// Next ticket id; ids below it were issued.
    pub(super) next_ticket: u64,
    /// Slots pinned by lookups since the last release (one entry per pin).
    pub(super) pinned: Vec<u32>,
    /// `fences[s]`: fences of releases of slot `s` that no copy into `s` has waited on yet,
    /// at most one per caller stream.
    pub(super) fences: Vec<Vec<Arc<SlotFence>>>,
    /// Bytes of copies in flight.
    pub(super) inflight_bytes: usize,
    /// Copies in flight that were issued as prefetch chunks.
    pub(super) inflight_prefetches: usize,
    /// Chunk size of prefetch copies; 0 = whole expert.
    pub(super) prefetch_chunk_bytes: usize,
    /// Prefetch copies in flight at most; 0 = unlimited (changeable while running).
    pub(super) max_inflight_prefetches: usize,
    /// Armed drill: (what, copies to let through first).
    pub(super) fault: Option<(Drill, u64)>,
    /// Set when the worker panicked: the error every pending and later call gets.
    pub(super) dead: Option<CoreError>,
    /// Pacing, if on.
    pub(super) bucket: Option<TokenBucket>,
    /// Counters.
    pub(super) stats: Stats,
    /// Set by `close`: the worker drains and exits.
    pub(super) shutdown: bool,
}

/// What an armed drill does to its copy.
#[derive(Debug, Clone, Copy)]
pub(super) enum Drill {
    /// The copy fails with this device fault.
    Fault(DeviceFault),
    /// The worker panics while issuing the copy (tests the panic path).
    Panic,
}

impl State {
    /// `Ok` while the engine takes calls: else the worker's panic, or [`CoreError::Closed`].
    pub(super) fn usable(&self) -> Result<()> {
        if let Some(e) = &self.dead {
            return Err(e.clone());
        }
        if self.shutdown {
            return Err(CoreError::Closed);
        }
        Ok(())
    }
}

pub(super) fn lock(m: &Mutex<State>) -> MutexGuard<'_, State> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// A slot for `key` (not resident): free or evicted per policy.
pub(super) fn allocate(st: &mut State, key: Key) -> Result<u32> {
    let inserted = st.cache.insert(key)?;
    account(st, inserted)
}

/// A slot for `key` (not resident): free or one of its own layer's, evicted per policy.
pub(super) fn allocate_in_layer(st: &mut State, key: Key) -> Result<u32> {
    let inserted = st.cache.insert_in_layer(key)?;
    account(st, inserted)
}

/// Counts the eviction of an insert (an unused prefetch or fill wasted) and resets the slot.
fn account(st: &mut State, (slot, evicted): (u32, Option<Key>)) -> Result<u32> {
    let s = slot as usize;
    if evicted.is_some() && std::mem::take(&mut st.prefetched_unused[s]) {
        st.stats.prefetch_wasted += 1;
    }
    if evicted.is_some() && std::mem::take(&mut st.filled_unused[s]) {
        st.stats.fill_wasted += 1;
    }
    st.ready[s] = false;
    st.prefetched_unused[s] = false;
    st.filled_unused[s] = false;
    Ok(slot)
}

/// Queues a transfer of `bytes` (the block size of `key`'s layer) into `slot`; `fill`: a
/// prefetch started from a fill request. A prefetch goes ahead of a queued fill.
#[allow(clippy::too_many_arguments)]
pub(super) fn queue(
    st: &mut State,
    key: Key,
    bytes: usize,
    slot: u32,
    prio: Prio,
    ticket: Option<u64>,
    fill: bool,
) {
    let tid = st.next_transfer;
    st.next_transfer += 1;
    st.cache.pin(slot);
    let t = Transfer {
        key,
        slot,
        prio,
        was_prefetch: prio == Prio::Prefetch && !fill,
        used: false,
        fill,
        bytes,
        issued: 0,
        landed: 0,
        inflight_bytes: 0,
        inflight_prefetch_chunks: 0,
        cancelled: false,
        error: None,
        waiters: ticket.into_iter().collect(),
    };
    st.transfers.insert(tid, t);
    debug_assert!(!st.inflight.contains_key(&key), "{key:?} fetched twice");
    st.inflight.insert(key, tid);
    match prio {
        Prio::Demand => st.demand_q.push_back(tid),
        Prio::Prefetch if fill => st.prefetch_q.push_back(tid),
        Prio::Prefetch => {
            // before the fill, if one is queued: the worker issues the head, and a fill's
            // chunks left resume once the prefetches ahead of it are out
            let at = st
                .prefetch_q
                .iter()
                .position(|id| st.transfers.get(id).is_some_and(|t| t.fill))
                .unwrap_or(st.prefetch_q.len());
            st.prefetch_q.insert(at, tid);
        }
    }
}

/// Cancels prefetch `tid`, which the caller took out of the prefetch queue if it was there.
/// With no copy in flight it is dropped and its slot freed; otherwise its key is detached at
/// once and the slot, reserved, is freed when its last copy ends.
pub(super) fn drop_prefetch(st: &mut State, tid: u64) {
    let t = st
        .transfers
        .get_mut(&tid)
        .expect("cancelled transfer is live");
    debug_assert!(t.prio == Prio::Prefetch && !t.cancelled && t.waiters.is_empty());
    let (key, slot) = (t.key, t.slot);
    if t.fill {
        st.stats.fill_dropped += 1;
    } else {
        st.stats.prefetch_cancelled += 1;
        st.stats.prefetch_wasted += 1;
    }
    st.inflight.remove(&key);
    if t.inflight_bytes > 0 {
        t.cancelled = true;
        st.cache.detach(slot);
        return;
    }
    st.transfers.remove(&tid);
    unpin(st, slot);
    if st.cache.pins(slot) == 0 && st.cache.id_of_slot(slot).is_some() {
        st.cache.free(slot);
    }
}

/// Drops one pin; a reserved slot (detached key) is freed at its last pin.
pub(super) fn unpin(st: &mut State, slot: u32) {
    st.cache.unpin(slot);
    if st.cache.pins(slot) == 0 && st.cache.is_reserved(slot) {
        st.cache.free(slot);
    }
}
