//! The transfer engine: one `lookup` per MoE layer answers slot ids and queues the copies.
//!
//! State lives under one mutex (`State`) shared with one worker thread:
//! - `lookup(layer, demand, prefetch)`: each distinct demanded expert is a hit (resident: pin
//!   its slot), an in-flight transfer (pin; a queued prefetch is moved to the demand queue and
//!   counts as prefetch *used*; the ticket waits on that transfer, never a second copy), or a
//!   miss (capacity is checked for all misses first — queued prefetches are cancelled to make
//!   room if needed, else `Capacity` with nothing changed — then a slot is allocated, evicting
//!   per policy among unpinned slots, and a DEMAND transfer queued). Prefetch keys not resident
//!   and not in flight get a slot only if one is evictable, and a PREFETCH transfer.
//!   Every transfer pins its slot until it ends, so a slot with a copy in flight is never a
//!   victim. The ticket completes when the call's demand transfers have landed. Queued
//!   prefetches for this layer or an earlier one are cancelled: the forward is past them.
//! - The worker always takes the demand queue before the prefetch queue. A demand is copied in
//!   one piece; a prefetch in chunks of `prefetch_chunk_bytes` (0 = whole), and it stays at the
//!   head of its queue until its last chunk is issued, so a demand that arrives meanwhile goes
//!   next: it waits behind the chunks in flight, not behind whole experts. The worker issues a
//!   copy while `inflight_bytes + bytes <= max_inflight_bytes` (0 = no limit; one copy always
//!   fits), a prefetch chunk only while fewer than `max_inflight_prefetches` are in flight (a
//!   started copy cannot be overtaken, so this bounds how long a new demand waits behind
//!   prefetches), and the token bucket allows (waiting on the clock; a real clock wait wakes
//!   early on new work so a demand never waits behind a paced prefetch), and finishes the
//!   oldest in-flight copy. A transfer lands when all its bytes have: its layer's block
//!   (`ExpertLayout::block_bytes`), which may be smaller than the slot stride (`expert_bytes`,
//!   the largest block) when layers store their experts in different types.
//! - Release fences: `release` unpins the slots of the lookups since the last one, trusting
//!   the caller that nothing reads them any more (CPU compute, or a synchronized stream).
//!   `release_after(stream)` first records a fence on the caller's stream (the backend's
//!   `record_fence`: on CUDA an event after the kernels that read those slots) and keeps it
//!   with each of those slots. The worker waits on a slot's fences (`wait_fence`: on CUDA
//!   `cuStreamWaitEvent` on the copy stream, the host never blocks) right before it issues a
//!   copy into that slot, and forgets them then: a wait orders every later copy on the
//!   stream, so each fence is waited once, and only by a copy into a slot it guards. A slot
//!   keeps one fence per caller stream (a later fence on a stream covers an earlier one).
//! - `cancel_prefetches`: a prefetch with no chunk in flight is dropped and its slot freed; one
//!   with a chunk in flight is marked cancelled and its key detached at once (the slot is
//!   reserved, not published, and freed when the chunk ends), so a cancelled prefetch never
//!   lands. Its chunks not yet issued never are. Fill requests are dropped too.
//! - `fill(keys)`: experts computed elsewhere this step (hybrid's CPU share) are copied in when
//!   the link is idle, for later steps to hit. A request is a key, not a transfer: it takes no
//!   slot while it waits. When nothing is queued and a prefetch copy may start, the worker
//!   turns the newest request into a prefetch transfer (into a free slot, else one of its own
//!   layer's evicted per policy: a fill never moves slots between layers), which every demand
//!   and later prefetch overtakes and the stale rule keeps. Counted apart (`fill_*`), so
//!   prefetch precision stays the router's.
//! - Failures (backend errors, injected faults) stop the transfer's remaining chunks, free the
//!   slot and reach `wait(ticket)`.
//! - A panic of the worker is caught at the top of its thread: the copies it had started are
//!   finished first (their memory must outlive them), then every ticket still waiting and every
//!   later `lookup` gets [`CoreError::WorkerPanic`]; nothing blocks forever. `release` and
//!   `cancel_prefetches` then leave the (possibly half-updated) bookkeeping alone.
//! - `close` (also run by `Drop`) drops the prefetches, lets the worker drain the demand copies
//!   and joins it; it is idempotent, and `lookup` on a closed engine is [`CoreError::Closed`].

// Denied, not forbidden: `worker` allows the one call of `CopyBackend::submit`.
#![deny(unsafe_code)]

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;

use crate::backend::CopyBackend;
use crate::cache::{Key, Policy, SlotCache};
use crate::clock::{Clock, TokenBucket};
use crate::error::{CoreError, DeviceFault, Result};
use crate::pool::ExpertPool;
use crate::raw::Destination;

mod fence;
mod lookup;
mod state;
mod worker;
use fence::{release_pinned, SlotFence};
use state::{
    allocate, allocate_in_layer, drop_prefetch, lock, queue, unpin, Drill, Prio, State, Ticket,
};
use worker::run_worker;

/// Fill requests kept at most: on a link too slow to serve them the oldest are never reached
/// (the newest go first), and each `fill` call scans the queue to move a repeated key.
pub const MAX_FILL_REQUESTS: usize = 256;

/// Engine settings.
#[derive(Debug, Clone)]
pub struct EngineConfig {
    /// Device slots; > 0.
    pub num_slots: usize,
    /// Eviction policy (`lru`, `lfru` or `lrfu`; `belady` is offline only).
    pub policy: Policy,
    /// Byte budget of copies in flight; 0 = unlimited.
    pub max_inflight_bytes: usize,
    /// Prefetch copies in flight at once; 0 = unlimited. A started copy cannot be overtaken
    /// (a CUDA stream runs its copies in order; a link carries one at a time), so a demand that
    /// arrives while prefetches are in flight waits for them all: 1 bounds that wait by one
    /// expert, at the price of a gap between consecutive prefetches (the worker's turnaround).
    pub max_inflight_prefetches: usize,
    /// A prefetch is copied in chunks of this many bytes (0 = the whole expert at once), so a
    /// demand that arrives while it is on the link waits for one chunk, not for the expert.
    pub prefetch_chunk_bytes: usize,
    /// Pacing rate in bytes/s; 0 = off.
    pub pacing_bytes_per_s: f64,
}

/// Counters, read in one call (see DESIGN.md "Metrics").
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Stats {
    /// Bytes landed host → device: every finished copy, a cancelled prefetch's chunks included
    /// (they crossed the link).
    pub bytes_h2d: u64,
    /// Demanded experts looked up (duplicates in one call count once).
    pub lookups: u64,
    /// Demanded experts already resident.
    pub hits: u64,
    /// Demanded experts not resident (new demand fetch, or waiting on an in-flight prefetch).
    pub misses: u64,
    /// Demand transfers queued.
    pub demand_fetches: u64,
    /// Prefetch transfers queued.
    pub prefetch_issued: u64,
    /// Prefetched experts demanded before eviction (in flight or landed).
    pub prefetch_used: u64,
    /// Prefetched experts evicted or cancelled before any use.
    pub prefetch_wasted: u64,
    /// Prefetches cancelled (queued or started).
    pub prefetch_cancelled: u64,
    /// Transfers with bytes not yet issued (gauge).
    pub queue_depth: u64,
    /// Bytes of issued, unfinished copies (gauge).
    pub inflight_bytes: u64,
    /// Hits per layer.
    pub layer_hits: Vec<u64>,
    /// Misses per layer.
    pub layer_misses: Vec<u64>,
    /// Release fences recorded (`release_after` with slots to release).
    pub fences_recorded: u64,
    /// Release fences a copy waited on before writing into a slot they guard.
    pub fence_waits: u64,
    /// Fill requests taken (`fill`: experts not resident nor in flight then).
    pub fill_requested: u64,
    /// Fill transfers started (the link idle).
    pub fill_issued: u64,
    /// Filled experts demanded before eviction (in flight or landed).
    pub fill_used: u64,
    /// Filled experts evicted before any use.
    pub fill_wasted: u64,
    /// Fill transfers dropped before landing (room for a demand, `cancel_prefetches`).
    pub fill_dropped: u64,
    /// Fill requests waiting for an idle link (gauge).
    pub fill_queued: u64,
}

#[derive(Debug)]
struct Inner {
    /// Bookkeeping.
    state: Mutex<State>,
    /// Wakes the worker (new work, shutdown).
    work: Condvar,
    /// Wakes waiters (a transfer ended).
    done: Condvar,
    /// Source of every copy; outlives the worker (held here).
    pool: Arc<ExpertPool>,
    /// The slot buffer; holds `num_slots * expert_bytes` bytes.
    dst: Destination,
    /// How copies are made.
    backend: Arc<dyn CopyBackend>,
    /// Time for pacing.
    clock: Arc<dyn Clock>,
    /// Copy budget; 0 = unlimited.
    max_inflight_bytes: usize,
}

/// Streams expert blocks from the pool into device slots (see module doc).
#[derive(Debug)]
pub struct TransferEngine {
    /// Shared with the worker.
    inner: Arc<Inner>,
    /// The worker; taken and joined by the first `close` (or drop).
    worker: Mutex<Option<JoinHandle<()>>>,
}

impl TransferEngine {
    /// Starts an engine copying from `pool` into `dst` (slot stride = `expert_bytes`).
    pub fn new(
        pool: Arc<ExpertPool>,
        dst: Destination,
        cfg: EngineConfig,
        backend: Arc<dyn CopyBackend>,
        clock: Arc<dyn Clock>,
    ) -> Result<Self> {
        let eb = pool.layout().expert_bytes();
        let cache = SlotCache::new(cfg.num_slots, cfg.policy)?;
        let need = cfg.num_slots.saturating_mul(eb);
        if dst.len() < need {
            return Err(CoreError::Config(format!(
                "destination of {} bytes is smaller than {} slots x {eb} bytes = {need}",
                dst.len(),
                cfg.num_slots
            )));
        }
        if !(cfg.pacing_bytes_per_s >= 0.0 && cfg.pacing_bytes_per_s.is_finite()) {
            return Err(CoreError::Config(format!(
                "bad pacing rate {}",
                cfg.pacing_bytes_per_s
            )));
        }
        let bucket = (cfg.pacing_bytes_per_s > 0.0).then(|| {
            let burst = (eb as f64).max(cfg.pacing_bytes_per_s / 100.0);
            TokenBucket::new(cfg.pacing_bytes_per_s, burst, clock.now())
        });
        let layers = pool.layout().num_layers();
        let state = State {
            cache,
            ready: vec![false; cfg.num_slots],
            prefetched_unused: vec![false; cfg.num_slots],
            filled_unused: vec![false; cfg.num_slots],
            transfers: HashMap::new(),
            inflight: HashMap::new(),
            next_transfer: 0,
            demand_q: VecDeque::new(),
            prefetch_q: VecDeque::new(),
            fill_q: VecDeque::new(),
            tickets: HashMap::new(),
            next_ticket: 0,
            pinned: Vec::new(),
            fences: (0..cfg.num_slots).map(|_| Vec::new()).collect(),
            inflight_bytes: 0,
            inflight_prefetches: 0,
            max_inflight_prefetches: cfg.max_inflight_prefetches,
            prefetch_chunk_bytes: cfg.prefetch_chunk_bytes,
            fault: None,
            dead: None,
            bucket,
            stats: Stats {
                layer_hits: vec![0; layers],
                layer_misses: vec![0; layers],
                ..Stats::default()
            },
            shutdown: false,
        };
        let inner = Arc::new(Inner {
            state: Mutex::new(state),
            work: Condvar::new(),
            done: Condvar::new(),
            pool,
            dst,
            backend,
            clock,
            max_inflight_bytes: cfg.max_inflight_bytes,
        });
        let w = Arc::clone(&inner);
        let worker = std::thread::Builder::new()
            .name("ftrs-transfer".into())
            .spawn(move || run_worker(&w))
            .map_err(|e| CoreError::Config(format!("cannot start transfer thread: {e}")))?;
        Ok(Self {
            inner,
            worker: Mutex::new(Some(worker)),
        })
    }

    /// Number of slots.
    pub fn num_slots(&self) -> usize {
        lock(&self.inner.state).cache.capacity()
    }
    /// The backend's name.
    pub fn backend_name(&self) -> String {
        self.inner.backend.name()
    }

    /// Blocks until every demand transfer of `ticket` landed; returns the first failure.
    pub fn wait(&self, ticket: u64) -> Result<()> {
        let mut st = lock(&self.inner.state);
        loop {
            match st.tickets.get(&ticket) {
                None if ticket < st.next_ticket => return Ok(()),
                None => return Err(CoreError::Config(format!("unknown ticket {ticket}"))),
                Some(t) if t.remaining == 0 => {
                    let t = st.tickets.remove(&ticket).expect("present");
                    return t.error.map_or(Ok(()), Err);
                }
                Some(_) => st = self.inner.done.wait(st).unwrap_or_else(|p| p.into_inner()),
            }
        }
    }

    /// Whether each of `slots` holds the landed bytes of its expert now: a forward computes
    /// those while the rest of its lookup is on the link. A slot out of range is `false`.
    pub fn ready(&self, slots: &[u32]) -> Vec<bool> {
        let st = lock(&self.inner.state);
        slots
            .iter()
            .map(|&s| st.ready.get(s as usize).copied().unwrap_or(false))
            .collect()
    }

    /// Unpins everything pinned by lookups since the last release. The caller guarantees that
    /// nothing reads those slots any more (see [`Self::release_after`] otherwise).
    pub fn release(&self) {
        let mut st = lock(&self.inner.state);
        if release_pinned(&mut st, None) {
            self.inner.work.notify_all();
        }
    }

    /// Asks for `keys` to be copied in whenever the link is idle, for a later step to hit:
    /// experts a forward computed elsewhere (hybrid's CPU share). Each key counts as used now
    /// in the cache's policy, as a lookup's keys do: the eviction policy sees every expert a
    /// layer used, wherever it was computed (without it, `lrfu` scored a filled expert as
    /// used once however often the CPU computed it, and evicted it first). Keys resident or
    /// in flight are then skipped; the others join the fill queue (again asked: moved to its newest end),
    /// which keeps the newest [`MAX_FILL_REQUESTS`] (at most `num_slots`). The worker starts
    /// one, newest first, only when no demand and no prefetch is queued and a prefetch copy
    /// may start; it is then a prefetch in chunks (overtaken by every demand and later
    /// prefetch) that the stale rule of `lookup` keeps, into a free slot or else one its own
    /// layer holds (a request whose layer holds none is dropped). Returns how many keys were
    /// queued.
    pub fn fill(&self, keys: &[Key]) -> Result<usize> {
        let layout = self.inner.pool.layout();
        for &(l, e) in keys {
            layout.check(l as usize, e as usize)?;
        }
        let mut st = lock(&self.inner.state);
        let st = &mut *st;
        st.usable()?;
        let mut n = 0;
        for &key in keys {
            if st.cache.access(key).is_some() {
                continue;
            }
            st.fill_q.retain(|&k| k != key);
            st.fill_q.push_back(key);
            n += 1;
        }
        let cap = st.cache.capacity().min(MAX_FILL_REQUESTS);
        while st.fill_q.len() > cap {
            st.fill_q.pop_front();
        }
        st.stats.fill_requested += n as u64;
        if n > 0 {
            self.inner.work.notify_all();
        }
        Ok(n)
    }

    /// Cancels every prefetch not yet demanded and every fill request; returns how many
    /// prefetch and fill transfers it dropped.
    pub fn cancel_prefetches(&self) -> usize {
        let mut st = lock(&self.inner.state);
        let st = &mut *st;
        if st.dead.is_some() {
            return 0; // nothing will be copied any more (see `release`)
        }
        st.fill_q.clear();
        let mut n = 0;
        while let Some(tid) = st.prefetch_q.pop_front() {
            drop_prefetch(st, tid);
            n += 1;
        }
        // Wholly issued, still in flight.
        let flying: Vec<u64> = st
            .transfers
            .iter()
            .filter(|(_, t)| t.prio == Prio::Prefetch && !t.cancelled)
            .map(|(id, _)| *id)
            .collect();
        for tid in flying {
            drop_prefetch(st, tid);
            n += 1;
        }
        n
    }

    /// A snapshot of the counters.
    pub fn stats(&self) -> Stats {
        let st = lock(&self.inner.state);
        let mut s = st.stats.clone();
        s.queue_depth = (st.demand_q.len() + st.prefetch_q.len()) as u64;
        s.fill_queued = st.fill_q.len() as u64;
        s.inflight_bytes = st.inflight_bytes as u64;
        s
    }

    /// Zeroes the counters (gauges are recomputed on read).
    pub fn reset_stats(&self) {
        let mut st = lock(&self.inner.state);
        let layers = st.stats.layer_hits.len();
        st.stats = Stats {
            layer_hits: vec![0; layers],
            layer_misses: vec![0; layers],
            ..Stats::default()
        };
    }

    /// The experts of `layer` whose bytes have landed, ascending: `resident` for one layer,
    /// without listing every slot (a hybrid layer asks it once a call).
    pub fn resident_in(&self, layer: u32) -> Vec<u32> {
        let st = lock(&self.inner.state);
        let mut v: Vec<u32> = st
            .cache
            .resident()
            .filter(|((l, _), s)| *l == layer && st.ready[*s as usize])
            .map(|((_, e), _)| e)
            .collect();
        v.sort_unstable();
        v
    }

    /// (layer, expert, slot) of every slot whose bytes have landed.
    pub fn resident(&self) -> Vec<(u32, u32, u32)> {
        let st = lock(&self.inner.state);
        let mut v: Vec<_> = st
            .cache
            .resident()
            .filter(|(_, s)| st.ready[*s as usize])
            .map(|((l, e), s)| (l, e, s))
            .collect();
        v.sort_unstable();
        v
    }

    /// Makes the copy after the next `after_copies` ones fail with `kind` (a drill).
    pub fn inject_fault(&self, kind: DeviceFault, after_copies: u64) {
        lock(&self.inner.state).fault = Some((Drill::Fault(kind), after_copies));
    }

    /// Makes the worker panic while issuing the copy after the next `after_copies` ones (a
    /// drill of the panic path: waiters get [`CoreError::WorkerPanic`]).
    pub fn inject_panic(&self, after_copies: u64) {
        lock(&self.inner.state).fault = Some((Drill::Panic, after_copies));
    }

    /// Drops the queued prefetches, lets the worker finish the demand copies and the copies in
    /// flight, and joins it. Blocks until then; idempotent (a second call returns at once,
    /// even while the first still joins). Afterwards `lookup` is [`CoreError::Closed`];
    /// counters, `ready` and `resident` can still be read.
    pub fn close(&self) {
        if !self.is_closed() {
            self.cancel_prefetches();
            lock(&self.inner.state).shutdown = true;
            self.inner.work.notify_all();
        }
        let worker = self.worker.lock().unwrap_or_else(|p| p.into_inner()).take();
        if let Some(w) = worker {
            // The worker catches its own panics (`run_worker`), so the join has nothing to report.
            let _ = w.join();
        }
    }

    /// Whether `close` was called.
    pub fn is_closed(&self) -> bool {
        lock(&self.inner.state).shutdown
    }

    /// Turns pacing on at `bytes_per_s` (0 turns it off), from the next copy on: the adaptive
    /// guard slows the link down while serving. Copies already started are not affected.
    pub fn set_pacing(&self, bytes_per_s: f64) -> Result<()> {
        if !(bytes_per_s >= 0.0 && bytes_per_s.is_finite()) {
            return Err(CoreError::Config(format!("bad pacing rate {bytes_per_s}")));
        }
        let eb = self.inner.pool.layout().expert_bytes();
        let now = self.inner.clock.now();
        let mut st = lock(&self.inner.state);
        st.bucket = (bytes_per_s > 0.0).then(|| {
            let burst = (eb as f64).max(bytes_per_s / 100.0);
            TokenBucket::new(bytes_per_s, burst, now)
        });
        drop(st);
        self.inner.work.notify_all();
        Ok(())
    }

    /// Sets how many prefetch copies may be in flight at once from the next copy on (0 = no
    /// limit; see [`EngineConfig::max_inflight_prefetches`]).
    pub fn set_max_inflight_prefetches(&self, n: usize) {
        lock(&self.inner.state).max_inflight_prefetches = n;
        self.inner.work.notify_all();
    }

    /// Sets the chunk size of prefetch copies issued from now on (0 = whole expert; see
    /// [`EngineConfig::prefetch_chunk_bytes`]).
    pub fn set_prefetch_chunk_bytes(&self, n: usize) {
        lock(&self.inner.state).prefetch_chunk_bytes = n;
    }

    /// The pacing rate in bytes per second; 0 when pacing is off.
    pub fn pacing_bytes_per_s(&self) -> f64 {
        lock(&self.inner.state)
            .bucket
            .as_ref()
            .map_or(0.0, TokenBucket::rate)
    }

    /// Checks the cache's structural invariants and the engine's own (tests).
    pub fn check_invariants(&self) -> std::result::Result<(), String> {
        let st = lock(&self.inner.state);
        st.cache.check_invariants()?;
        let eb = self.inner.pool.layout().expert_bytes();
        let bytes: usize = st.transfers.values().map(|t| t.inflight_bytes).sum();
        if let Some((tid, t)) = st.transfers.iter().find(|(_, t)| t.bytes > eb) {
            return Err(format!(
                "transfer {tid} moves {} bytes into a {eb}-byte slot",
                t.bytes
            ));
        }
        if bytes != st.inflight_bytes {
            return Err(format!("inflight_bytes {} != {bytes}", st.inflight_bytes));
        }
        for (tid, t) in &st.transfers {
            let queued = st.demand_q.contains(tid) || st.prefetch_q.contains(tid);
            let open = t.issued < t.bytes && !t.cancelled && t.error.is_none();
            if queued != open || t.landed + t.inflight_bytes > t.issued || t.issued > t.bytes {
                return Err(format!(
                    "transfer {tid} of {:?}: queued {queued}, issued {}, landed {}, in flight {}",
                    t.key, t.issued, t.landed, t.inflight_bytes
                ));
            }
        }
        let prefetches: usize = st
            .transfers
            .values()
            .map(|t| t.inflight_prefetch_chunks)
            .sum();
        if prefetches != st.inflight_prefetches {
            return Err(format!(
                "inflight_prefetches {} != {prefetches}",
                st.inflight_prefetches
            ));
        }
        for (slot, held) in st.fences.iter().enumerate() {
            let streams: std::collections::HashSet<u64> = held.iter().map(|f| f.stream).collect();
            if streams.len() != held.len() {
                return Err(format!("slot {slot} holds two fences of one stream"));
            }
        }
        for (key, tid) in &st.inflight {
            let t = &st.transfers[tid];
            if t.key != *key || t.cancelled || st.cache.slot_for(*key) != Some(t.slot) {
                return Err(format!("in-flight entry of {key:?} is stale"));
            }
        }
        Ok(())
    }
}

impl Drop for TransferEngine {
    fn drop(&mut self) {
        // Prefetches are dropped; demand copies and copies in flight finish before the join, so
        // no copy outlives the pool or the destination.
        self.close();
    }
}
