//! The device expert cache: `capacity` slots shared by all layers, keyed by (layer, expert).
//!
//! Index-based: `slots[i]` says which key slot `i` holds and how many pins it has; `map` is the
//! inverse. A slot is *free* (on the free list), *occupied* (holds a key) or *reserved* (its key
//! was detached while a copy into it is still running; it returns to the free list when the copy
//! ends). Pinned slots (in use by the layer being computed, or with a transfer in flight) are
//! never victims; when every slot is pinned, [`SlotCache::insert`] fails and the caller computes
//! in waves. Victim choice scans the unpinned occupied slots (O(capacity), a few hundred
//! entries, cheaper than the copy it precedes):
//!
//! - `lru`: the least recently accessed.
//! - `lfru` (frequency-aware LRU): take the `W = max(2, capacity / 4)` least-recent candidates,
//!   evict the least frequently used among them (ties: the least recent). Frequencies count
//!   accesses per key, survive eviction, and are halved every `8 * capacity` accesses so the
//!   cache follows a shifting routing distribution.
//! - `lrfu` (recency and frequency in one score, after Lee et al.'s LRFU): each key scores
//!   `sum over its accesses of 2^(-age / H)`, the age counted in *turns of the key's own layer*
//!   and `H` = [`LRFU_HALF_LIFE_TURNS`]; the lowest score is evicted (ties: the least recent).
//!   A turn is a run of accesses to one layer (a new one starts when the layer changes or a
//!   key repeats), so in decode a turn is a token, whatever the model's layer count and top-k:
//!   an expert used in most of the last few tokens outranks one used once a token ago, and a
//!   layer's score does not fade while the other layers run. Scores survive eviction (a hot
//!   expert brought back keeps its rank). An insert without an access (a prefetch, a fill)
//!   scores at least one access at its layer's last turn.
//! - `belady`: Belady's MIN, an offline oracle: given the whole future access sequence, evict
//!   the key whose next access is farthest (never again = infinitely far).
//!
//! [`simulate`] replays a trace (one Vec of keys per layer-step; a step's keys are pinned
//! together while it is served) and counts hits and misses.

#![forbid(unsafe_code)]

use std::collections::{HashMap, VecDeque};

use crate::error::{CoreError, Result};

/// (layer, expert).
pub type Key = (u32, u32);

/// Eviction policy.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Policy {
    /// Least recently used.
    Lru,
    /// Least frequently used among the least recent (see module doc).
    Lfru,
    /// Lowest recency-and-frequency score, aged in turns of the key's layer (see module doc).
    Lrfu,
    /// Belady's MIN (needs the future; offline only).
    Belady,
}

impl Policy {
    /// Parses `lru | lfru | lrfu | belady`.
    pub fn parse(s: &str) -> Result<Self> {
        match s {
            "lru" => Ok(Self::Lru),
            "lfru" => Ok(Self::Lfru),
            "lrfu" => Ok(Self::Lrfu),
            "belady" | "min" => Ok(Self::Belady),
            _ => Err(CoreError::Config(format!(
                "unknown cache policy {s:?}: expected lru, lfru, lrfu or belady"
            ))),
        }
    }
}

#[derive(Debug, Clone, Default)]
struct Slot {
    /// The key held; `None` when free or reserved. `map[key] == index of this slot`.
    key: Option<Key>,
    /// Pin count; a slot with `pins > 0` is never a victim and never freed.
    pins: u32,
    /// Tick of the last access to `key` (recency); meaningless when `key` is None.
    last_use: u64,
    /// True while detached but not yet freed (a discarded copy still writes into it).
    reserved: bool,
}

/// `lrfu`'s half-life, in turns of a key's layer. Measured on the demo model's routing
/// traces (`bench/policies.py`, recorded and held-out prompts, 25-75 % caches): 8 turns was
/// the best or within 0.002 of the best hit rate of 2, 4, 8, 12, 16 and 32.
pub const LRFU_HALF_LIFE_TURNS: f64 = 8.0;

/// `lrfu`'s state: per key the score as `log2(sum of 2^(turn / H))` over its accesses, so a
/// score never needs rescaling as turns pass (the current score is `2^(crf - turn_now / H)`).
#[derive(Debug, Clone, Default)]
struct Lrfu {
    crf: HashMap<Key, f64>,
    /// Turns so far, per layer.
    turns: HashMap<u32, u64>,
    /// The layer of the current turn and the keys it accessed.
    turn_layer: Option<u32>,
    turn_keys: Vec<Key>,
}

impl Lrfu {
    fn now(&self, layer: u32) -> f64 {
        self.turns.get(&layer).copied().unwrap_or(0) as f64 / LRFU_HALF_LIFE_TURNS
    }

    fn access(&mut self, key: Key) {
        if self.turn_layer != Some(key.0) || self.turn_keys.contains(&key) {
            *self.turns.entry(key.0).or_insert(0) += 1;
            self.turn_layer = Some(key.0);
            self.turn_keys.clear();
        }
        self.turn_keys.push(key);
        let t = self.now(key.0);
        let v = self.crf.entry(key).or_insert(f64::NEG_INFINITY);
        *v = log2_add(*v, t);
    }

    /// An insert with no access: at least one access at the layer's last turn.
    fn inserted(&mut self, key: Key) {
        let t = self.now(key.0);
        let v = self.crf.entry(key).or_insert(t);
        *v = v.max(t);
    }

    /// log2 of the current score (comparable across layers).
    fn score(&self, key: Key) -> f64 {
        self.crf.get(&key).copied().unwrap_or(f64::NEG_INFINITY) - self.now(key.0)
    }
}

/// `log2(2^a + 2^b)`, exact for `a` or `b` = -inf.
fn log2_add(a: f64, b: f64) -> f64 {
    let (hi, lo) = if a >= b { (a, b) } else { (b, a) };
    if lo == f64::NEG_INFINITY {
        return hi;
    }
    hi + (lo - hi).exp2().ln_1p() / std::f64::consts::LN_2
}

/// Future accesses for Belady: per key, the positions (in access order) still to come.
#[derive(Debug, Clone, Default)]
struct Oracle {
    /// Positions of each key's future accesses, increasing; the front is the next one.
    next: HashMap<Key, VecDeque<u64>>,
}

/// Fixed-capacity slot cache with pinning.
#[derive(Debug, Clone)]
pub struct SlotCache {
    /// One entry per device slot; `len() == capacity`.
    slots: Vec<Slot>,
    /// Key → slot, exactly the occupied slots.
    map: HashMap<Key, u32>,
    /// Free slots (no key, not reserved, no pins), used LIFO.
    free: Vec<u32>,
    /// Logical time: number of accesses so far.
    tick: u64,
    /// Eviction policy.
    policy: Policy,
    /// LFRU access counts, decayed (halved) every `8 * capacity` accesses.
    freq: HashMap<Key, u32>,
    /// Present iff `policy == Belady`.
    oracle: Option<Oracle>,
    /// Scores and turns (used iff `policy == Lrfu`).
    lrfu: Lrfu,
}

impl SlotCache {
    /// A cache of `capacity` slots; `belady` needs [`SlotCache::with_future`].
    pub fn new(capacity: usize, policy: Policy) -> Result<Self> {
        if policy == Policy::Belady {
            return Err(CoreError::Config(
                "belady is an offline oracle: it needs the future trace (use simulate_cache)"
                    .into(),
            ));
        }
        Self::build(capacity, policy, None)
    }

    /// A Belady cache that will see exactly the accesses in `future`, in that order.
    pub fn with_future(capacity: usize, future: &[Key]) -> Result<Self> {
        let mut oracle = Oracle::default();
        for (i, k) in future.iter().enumerate() {
            oracle.next.entry(*k).or_default().push_back(i as u64);
        }
        Self::build(capacity, Policy::Belady, Some(oracle))
    }

    fn build(capacity: usize, policy: Policy, oracle: Option<Oracle>) -> Result<Self> {
        if capacity == 0 || capacity > u32::MAX as usize {
            return Err(CoreError::Config(format!(
                "slot count must be in 1..2^32, got {capacity}"
            )));
        }
        Ok(Self {
            slots: vec![Slot::default(); capacity],
            map: HashMap::with_capacity(capacity),
            free: (0..capacity as u32).rev().collect(),
            tick: 0,
            policy,
            freq: HashMap::new(),
            oracle,
            lrfu: Lrfu::default(),
        })
    }

    /// Number of slots.
    pub fn capacity(&self) -> usize {
        self.slots.len()
    }
    /// Number of occupied slots.
    pub fn len(&self) -> usize {
        self.map.len()
    }
    /// True when no slot holds a key.
    pub fn is_empty(&self) -> bool {
        self.map.is_empty()
    }
    /// The policy.
    pub fn policy(&self) -> Policy {
        self.policy
    }
    /// The slot holding `key`.
    pub fn slot_for(&self, key: Key) -> Option<u32> {
        self.map.get(&key).copied()
    }
    /// The key held by `slot`.
    pub fn id_of_slot(&self, slot: u32) -> Option<Key> {
        self.slots.get(slot as usize).and_then(|s| s.key)
    }
    /// Pin count of `slot`.
    pub fn pins(&self, slot: u32) -> u32 {
        self.slots[slot as usize].pins
    }
    /// True while `slot` is detached but not yet freed.
    pub fn is_reserved(&self, slot: u32) -> bool {
        self.slots[slot as usize].reserved
    }
    /// (key, slot) of every occupied slot.
    pub fn resident(&self) -> impl Iterator<Item = (Key, u32)> + '_ {
        self.map.iter().map(|(k, s)| (*k, *s))
    }

    /// Records an access to `key` (recency, frequency, oracle) and returns its slot if resident.
    pub fn access(&mut self, key: Key) -> Option<u32> {
        self.tick += 1;
        if let Some(o) = &mut self.oracle {
            let q = o.next.get_mut(&key);
            debug_assert!(
                q.as_ref().is_some_and(|q| !q.is_empty()),
                "belady: unforeseen {key:?}"
            );
            if let Some(q) = q {
                q.pop_front();
            }
        }
        if self.policy == Policy::Lrfu {
            self.lrfu.access(key);
        }
        if self.policy == Policy::Lfru {
            *self.freq.entry(key).or_insert(0) += 1;
            if self.tick.is_multiple_of(8 * self.capacity() as u64) {
                self.freq.retain(|_, f| {
                    *f /= 2;
                    *f > 0
                });
            }
        }
        let slot = self.slot_for(key)?;
        self.slots[slot as usize].last_use = self.tick;
        Some(slot)
    }

    /// Pins `slot` (it must hold a key or be reserved).
    pub fn pin(&mut self, slot: u32) {
        let s = &mut self.slots[slot as usize];
        debug_assert!(s.key.is_some() || s.reserved, "pinning a free slot {slot}");
        s.pins += 1;
    }

    /// Drops one pin of `slot`.
    pub fn unpin(&mut self, slot: u32) {
        let s = &mut self.slots[slot as usize];
        debug_assert!(s.pins > 0, "unpinning unpinned slot {slot}");
        s.pins = s.pins.saturating_sub(1);
    }

    /// Slots an insert could use now: free plus unpinned occupied.
    pub fn evictable(&self) -> usize {
        self.free.len()
            + self
                .slots
                .iter()
                .filter(|s| s.key.is_some() && s.pins == 0)
                .count()
    }

    /// Slots an insert limited to `layer` ([`Self::insert_in_layer`]) could use now, and the
    /// slots that layer holds: (free plus its unpinned occupied, its occupied).
    pub fn layer_room(&self, layer: u32) -> (usize, usize) {
        let (mut unpinned, mut held) = (0, 0);
        for s in self
            .slots
            .iter()
            .filter(|s| s.key.is_some_and(|k| k.0 == layer))
        {
            held += 1;
            unpinned += usize::from(s.pins == 0);
        }
        (self.free.len() + unpinned, held)
    }

    /// Puts `key` (not resident) in a free slot, or evicts a victim. Returns the slot and the
    /// evicted key. The new slot is unpinned; its recency is the current tick.
    pub fn insert(&mut self, key: Key) -> Result<(u32, Option<Key>)> {
        self.insert_where(key, false)
    }

    /// As [`Self::insert`], but the victim (when no slot is free) is one of `key`'s own
    /// layer's: the insert changes what a layer holds, never how many slots it holds.
    pub fn insert_in_layer(&mut self, key: Key) -> Result<(u32, Option<Key>)> {
        self.insert_where(key, true)
    }

    fn insert_where(&mut self, key: Key, same_layer: bool) -> Result<(u32, Option<Key>)> {
        debug_assert!(!self.map.contains_key(&key), "{key:?} inserted twice");
        let (slot, evicted) = match self.free.pop() {
            Some(slot) => (slot, None),
            None => {
                let slot = self.victim(same_layer.then_some(key.0)).ok_or_else(|| {
                    CoreError::Capacity(if same_layer {
                        format!("layer {} holds no unpinned slot", key.0)
                    } else {
                        format!(
                            "all {} expert slots are pinned; compute this layer in waves",
                            self.capacity()
                        )
                    })
                })?;
                let old = self.slots[slot as usize].key.take();
                if let Some(old) = old {
                    self.map.remove(&old);
                }
                (slot, old)
            }
        };
        let s = &mut self.slots[slot as usize];
        debug_assert!(s.pins == 0 && !s.reserved && s.key.is_none());
        s.key = Some(key);
        s.last_use = self.tick;
        self.map.insert(key, slot);
        if self.policy == Policy::Lrfu {
            self.lrfu.inserted(key);
        }
        Ok((slot, evicted))
    }

    /// Removes the key of `slot` but keeps the slot out of use (reserved) until [`Self::free`].
    pub fn detach(&mut self, slot: u32) -> Option<Key> {
        let s = &mut self.slots[slot as usize];
        let key = s.key.take()?;
        s.reserved = true;
        self.map.remove(&key);
        Some(key)
    }

    /// Returns an unpinned occupied or reserved `slot` to the free list.
    pub fn free(&mut self, slot: u32) {
        let s = &mut self.slots[slot as usize];
        debug_assert_eq!(s.pins, 0, "freeing pinned slot {slot}");
        debug_assert!(s.key.is_some() || s.reserved, "double free of slot {slot}");
        if let Some(k) = s.key.take() {
            self.map.remove(&k);
        }
        s.reserved = false;
        self.free.push(slot);
    }

    fn victim(&self, layer: Option<u32>) -> Option<u32> {
        let mut cands: Vec<(u64, u32)> = self
            .slots
            .iter()
            .enumerate()
            .filter(|(_, s)| s.key.is_some_and(|k| layer.is_none_or(|l| k.0 == l)) && s.pins == 0)
            .map(|(i, s)| (s.last_use, i as u32))
            .collect();
        if cands.is_empty() {
            return None;
        }
        let key_of = |slot: u32| self.slots[slot as usize].key.expect("candidate has a key");
        match self.policy {
            Policy::Lru => cands.iter().min().map(|c| c.1),
            Policy::Lfru => {
                let w = (self.capacity() / 4).max(2).min(cands.len());
                cands.select_nth_unstable(w - 1);
                let f = |slot: u32| self.freq.get(&key_of(slot)).copied().unwrap_or(0);
                cands[..w]
                    .iter()
                    .min_by_key(|(t, s)| (f(*s), *t))
                    .map(|c| c.1)
            }
            Policy::Lrfu => cands
                .iter()
                .map(|&(t, s)| (self.lrfu.score(key_of(s)), t, s))
                .min_by(|a, b| a.0.total_cmp(&b.0).then(a.1.cmp(&b.1)))
                .map(|c| c.2),
            Policy::Belady => {
                let o = self.oracle.as_ref().expect("belady cache has an oracle");
                let next = |slot: u32| {
                    o.next
                        .get(&key_of(slot))
                        .and_then(|q| q.front().copied())
                        .unwrap_or(u64::MAX)
                };
                cands
                    .iter()
                    .max_by_key(|(t, s)| (next(*s), std::cmp::Reverse(*t)))
                    .map(|c| c.1)
            }
        }
    }

    /// Checks every structural invariant (tests): map ↔ slots agree, no key in two slots, free
    /// slots hold nothing and have no pins.
    pub fn check_invariants(&self) -> std::result::Result<(), String> {
        let mut owners = HashMap::new();
        for (i, s) in self.slots.iter().enumerate() {
            if let Some(k) = s.key {
                if owners.insert(k, i).is_some() {
                    return Err(format!("{k:?} owned by two slots"));
                }
                if self.map.get(&k) != Some(&(i as u32)) {
                    return Err(format!("map disagrees for slot {i}"));
                }
                if s.reserved {
                    return Err(format!("slot {i} both occupied and reserved"));
                }
            }
        }
        if owners.len() != self.map.len() {
            return Err("map has stale keys".into());
        }
        let mut seen = vec![false; self.slots.len()];
        for &f in &self.free {
            let s = &self.slots[f as usize];
            if seen[f as usize] || s.key.is_some() || s.reserved || s.pins > 0 {
                return Err(format!("bad free slot {f}"));
            }
            seen[f as usize] = true;
        }
        Ok(())
    }
}

/// Replays `trace` (one Vec of keys per layer-step) through a cache of `capacity` slots.
/// A step's keys (deduplicated) are pinned together while it is served. Returns (hits, misses).
pub fn simulate(trace: &[Vec<Key>], capacity: usize, policy: Policy) -> Result<(u64, u64)> {
    let steps: Vec<Vec<Key>> = trace
        .iter()
        .map(|step| {
            let mut seen = std::collections::HashSet::new();
            step.iter().copied().filter(|k| seen.insert(*k)).collect()
        })
        .collect();
    let mut cache = match policy {
        Policy::Belady => SlotCache::with_future(capacity, &steps.concat())?,
        p => SlotCache::new(capacity, p)?,
    };
    let (mut hits, mut misses) = (0u64, 0u64);
    let mut pinned = Vec::new();
    for step in &steps {
        for &key in step {
            let slot = match cache.access(key) {
                Some(slot) => {
                    hits += 1;
                    slot
                }
                None => {
                    misses += 1;
                    cache.insert(key)?.0
                }
            };
            cache.pin(slot);
            pinned.push(slot);
        }
        for slot in pinned.drain(..) {
            cache.unpin(slot);
        }
    }
    Ok((hits, misses))
}
