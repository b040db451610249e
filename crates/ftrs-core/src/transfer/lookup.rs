//! `TransferEngine::lookup`: what one MoE layer's call decides (see the parent module's doc):
//! hits pin their slot, in-flight transfers are waited on (a queued prefetch is promoted),
//! misses get a slot and a demand transfer, stale prefetches are dropped, new ones queued.

#![forbid(unsafe_code)]

use std::collections::HashSet;

use super::{allocate, drop_prefetch, lock, queue, unpin, Prio, Ticket, TransferEngine};
use crate::cache::Key;
use crate::error::{CoreError, Result};

impl TransferEngine {
    /// One call per MoE layer (see the `transfer` module doc). Returns the slots of `demand`, in order, and a
    /// ticket for [`Self::wait`].
    pub fn lookup(&self, layer: u32, demand: &[u32], prefetch: &[Key]) -> Result<(Vec<u32>, u64)> {
        let layout = self.inner.pool.layout();
        for &e in demand {
            layout.check(layer as usize, e as usize)?;
        }
        for &(l, e) in prefetch {
            layout.check(l as usize, e as usize)?;
        }
        // checked above: every key's layer is in range
        let bytes_of = |k: Key| layout.block_bytes(k.0 as usize).unwrap_or(0);
        let mut st = lock(&self.inner.state);
        let st = &mut *st;
        st.usable()?;
        let mut seen = HashSet::new();
        let keys: Vec<Key> = demand
            .iter()
            .map(|&e| (layer, e))
            .filter(|k| seen.insert(*k))
            .collect();

        // Phase 1: pin what is resident or in flight; collect misses.
        let mut pinned_now = Vec::new();
        let mut waits_on = Vec::new();
        let mut misses = Vec::new();
        for &key in &keys {
            st.cache.access(key);
            match st.cache.slot_for(key) {
                Some(slot) => {
                    st.cache.pin(slot);
                    pinned_now.push(slot);
                    if let Some(&tid) = st.inflight.get(&key) {
                        waits_on.push(tid);
                        // Upgrade now, so making room below never cancels what we wait on.
                        let t = st
                            .transfers
                            .get_mut(&tid)
                            .expect("in-flight map points at a live transfer");
                        if t.prio == Prio::Prefetch {
                            t.prio = Prio::Demand;
                            // its bytes not yet issued go next, in one piece
                            if st.prefetch_q.contains(&tid) {
                                st.prefetch_q.retain(|&x| x != tid);
                                st.demand_q.push_back(tid);
                            }
                        }
                    }
                }
                None => misses.push(key),
            }
        }
        // Queued prefetches for this layer or an earlier one are stale: the forward has reached
        // this layer, and those it needs were just moved to the demand queue above. A fill is
        // for a later step: it stays.
        let stale: Vec<u64> = st
            .prefetch_q
            .iter()
            .copied()
            .filter(|tid| {
                st.transfers
                    .get(tid)
                    .is_some_and(|t| t.key.0 <= layer && !t.fill)
            })
            .collect();
        if !stale.is_empty() {
            st.prefetch_q.retain(|tid| !stale.contains(tid));
            for tid in stale {
                drop_prefetch(st, tid);
            }
        }
        while st.cache.evictable() < misses.len() {
            let Some(tid) = st.prefetch_q.pop_back() else {
                break;
            };
            drop_prefetch(st, tid);
        }
        if st.cache.evictable() < misses.len() {
            for slot in pinned_now {
                unpin(st, slot);
            }
            return Err(CoreError::Capacity(format!(
                "layer {layer} needs {} more slots but only {} of {} can be evicted",
                misses.len(),
                st.cache.evictable(),
                st.cache.capacity()
            )));
        }

        // Phase 2: commit.
        let ticket = st.next_ticket;
        st.next_ticket += 1;
        let lstats = layer as usize;
        st.stats.lookups += keys.len() as u64;
        st.stats.hits += (keys.len() - misses.len() - waits_on.len()) as u64;
        st.stats.layer_hits[lstats] += (keys.len() - misses.len() - waits_on.len()) as u64;
        st.stats.misses += (misses.len() + waits_on.len()) as u64;
        st.stats.layer_misses[lstats] += (misses.len() + waits_on.len()) as u64;
        for &slot in &pinned_now {
            if std::mem::take(&mut st.prefetched_unused[slot as usize]) {
                st.stats.prefetch_used += 1;
            }
            if std::mem::take(&mut st.filled_unused[slot as usize]) {
                st.stats.fill_used += 1;
            }
        }
        for &tid in &waits_on {
            let t = st
                .transfers
                .get_mut(&tid)
                .expect("in-flight map points at a live transfer");
            if (t.was_prefetch || t.fill) && !t.used {
                t.used = true;
                if t.fill {
                    st.stats.fill_used += 1;
                } else {
                    st.stats.prefetch_used += 1;
                }
            }
            t.waiters.push(ticket);
        }
        let mut remaining = waits_on.len();
        for &key in &misses {
            let slot = allocate(st, key).expect("capacity checked above");
            st.cache.pin(slot);
            pinned_now.push(slot);
            queue(
                st,
                key,
                bytes_of(key),
                slot,
                Prio::Demand,
                Some(ticket),
                false,
            );
            st.stats.demand_fetches += 1;
            remaining += 1;
        }
        st.tickets.insert(
            ticket,
            Ticket {
                remaining,
                error: None,
            },
        );
        st.pinned.extend(pinned_now);

        // A prefetch takes (and may evict) its slot here, like a miss. Kernels the caller
        // queued before it released that slot may still be reading it (on CUDA nothing here
        // synchronizes with the caller's stream): the copy into it waits, on the device, for
        // the fence the release recorded (`release_after`; see the module doc), so no copy
        // relies on the caller having synchronized before this lookup. A slot released with
        // plain `release` carries no fence: that caller vouched its reads were done.
        for &key in prefetch {
            if st.cache.slot_for(key).is_some() || st.cache.evictable() == 0 {
                continue;
            }
            let slot = allocate(st, key).expect("an evictable slot exists");
            queue(st, key, bytes_of(key), slot, Prio::Prefetch, None, false);
            st.stats.prefetch_issued += 1;
        }
        let slots = demand
            .iter()
            .map(|&e| {
                st.cache
                    .slot_for((layer, e))
                    .expect("demanded key is resident or in flight")
            })
            .collect();
        self.inner.work.notify_all();
        Ok((slots, ticket))
    }
}
