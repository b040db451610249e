//! The flight recorder: a fixed ring of the last N step records, for crash reports.
//!
//! Lock-free: the ring is N slots of atomics. A writer claims sequence number `i` with one
//! `fetch_add` on `head` and writes slot `i % N` under a per-slot seqlock: it stores the slot's
//! `seq` as `2i + 1` (odd: being written), a release fence, the fields (relaxed atomic stores),
//! then `seq = 2i + 2` (release). A reader of slot `i % N` loads `seq` (acquire), reads the
//! fields, fences (acquire) and re-loads `seq`; the record is taken only if both loads equal
//! `2i + 2`, so torn or overwritten records are skipped, never returned half-written. The hot
//! path is intended for one writer (the engine loop); concurrent writers stay safe as long as
//! they do not lap the ring within one record's write.

#![forbid(unsafe_code)]

use std::sync::atomic::{fence, AtomicU64, Ordering};

/// What a step did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StepKind {
    /// Unknown or not given.
    Unknown = 0,
    /// Only prefill chunks.
    Prefill = 1,
    /// Only decode tokens.
    Decode = 2,
    /// Both.
    Mixed = 3,
    /// Nothing to do.
    Idle = 4,
}

impl StepKind {
    /// Parses `prefill|decode|mixed|idle` (anything else is Unknown).
    pub fn parse(s: &str) -> Self {
        match s {
            "prefill" => Self::Prefill,
            "decode" => Self::Decode,
            "mixed" => Self::Mixed,
            "idle" => Self::Idle,
            _ => Self::Unknown,
        }
    }
    /// The name `parse` accepts (`unknown` for Unknown).
    pub fn name(self) -> &'static str {
        match self {
            Self::Unknown => "unknown",
            Self::Prefill => "prefill",
            Self::Decode => "decode",
            Self::Mixed => "mixed",
            Self::Idle => "idle",
        }
    }
    fn from_u64(v: u64) -> Self {
        match v {
            1 => Self::Prefill,
            2 => Self::Decode,
            3 => Self::Mixed,
            4 => Self::Idle,
            _ => Self::Unknown,
        }
    }
}

/// One engine step. Unknown floats are NaN, unknown integers -1.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct StepRecord {
    /// Step id, increasing.
    pub step: i64,
    /// Unix time in seconds.
    pub time: f64,
    /// What the step did.
    pub kind: StepKind,
    /// Tokens in the batch.
    pub tokens: i64,
    /// Prefill-chunk tokens in the batch.
    pub chunk_tokens: i64,
    /// Bytes of expert copies issued this step.
    pub bytes_issued: i64,
    /// Bytes in flight at the end of the step.
    pub inflight_bytes: i64,
    /// Experts fetched this step.
    pub experts_fetched: i64,
    /// Board power in W.
    pub power_w: f64,
    /// GPU temperature in °C.
    pub temperature_c: f64,
    /// PCIe link generation.
    pub link_gen: i64,
    /// PCIe link width.
    pub link_width: i64,
}

impl StepRecord {
    /// A record of `step` with every other field unknown.
    pub fn new(step: i64) -> Self {
        Self {
            step,
            time: f64::NAN,
            kind: StepKind::Unknown,
            tokens: -1,
            chunk_tokens: -1,
            bytes_issued: -1,
            inflight_bytes: -1,
            experts_fetched: -1,
            power_w: f64::NAN,
            temperature_c: f64::NAN,
            link_gen: -1,
            link_width: -1,
        }
    }

    fn to_words(self) -> [u64; FIELDS] {
        [
            self.step as u64,
            self.time.to_bits(),
            self.kind as u64,
            self.tokens as u64,
            self.chunk_tokens as u64,
            self.bytes_issued as u64,
            self.inflight_bytes as u64,
            self.experts_fetched as u64,
            self.power_w.to_bits(),
            self.temperature_c.to_bits(),
            self.link_gen as u64,
            self.link_width as u64,
        ]
    }

    fn from_words(w: [u64; FIELDS]) -> Self {
        Self {
            step: w[0] as i64,
            time: f64::from_bits(w[1]),
            kind: StepKind::from_u64(w[2]),
            tokens: w[3] as i64,
            chunk_tokens: w[4] as i64,
            bytes_issued: w[5] as i64,
            inflight_bytes: w[6] as i64,
            experts_fetched: w[7] as i64,
            power_w: f64::from_bits(w[8]),
            temperature_c: f64::from_bits(w[9]),
            link_gen: w[10] as i64,
            link_width: w[11] as i64,
        }
    }
}

const FIELDS: usize = 12;

#[derive(Debug, Default)]
struct Slot {
    /// Seqlock word: `2i + 1` while record `i` is written, `2i + 2` once it is complete.
    seq: AtomicU64,
    /// The record as words (see `StepRecord::to_words`).
    words: [AtomicU64; FIELDS],
}

/// Ring of the last `capacity` records.
#[derive(Debug)]
pub struct FlightRecorder {
    /// `capacity` slots; record `i` lives in slot `i % capacity`.
    slots: Vec<Slot>,
    /// Records ever written (the next sequence number).
    head: AtomicU64,
}

impl FlightRecorder {
    /// A ring of `capacity` (>= 1) records.
    pub fn new(capacity: usize) -> Self {
        let capacity = capacity.max(1);
        Self {
            slots: (0..capacity).map(|_| Slot::default()).collect(),
            head: AtomicU64::new(0),
        }
    }
    /// Ring size.
    pub fn capacity(&self) -> usize {
        self.slots.len()
    }
    /// Records held (≤ capacity).
    pub fn len(&self) -> usize {
        (self.head.load(Ordering::Acquire) as usize).min(self.capacity())
    }
    /// True before the first record.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Appends `r`, overwriting the oldest record when full. Lock-free, no allocation.
    pub fn record(&self, r: StepRecord) {
        let i = self.head.fetch_add(1, Ordering::AcqRel);
        let slot = &self.slots[(i % self.slots.len() as u64) as usize];
        slot.seq.store(2 * i + 1, Ordering::Relaxed);
        fence(Ordering::Release);
        for (a, w) in slot.words.iter().zip(r.to_words()) {
            a.store(w, Ordering::Relaxed);
        }
        slot.seq.store(2 * i + 2, Ordering::Release);
    }

    /// The records held, oldest first (records being overwritten during the call are skipped).
    pub fn dump(&self) -> Vec<StepRecord> {
        let head = self.head.load(Ordering::Acquire);
        let start = head.saturating_sub(self.slots.len() as u64);
        let mut out = Vec::with_capacity((head - start) as usize);
        for i in start..head {
            let slot = &self.slots[(i % self.slots.len() as u64) as usize];
            let want = 2 * i + 2;
            if slot.seq.load(Ordering::Acquire) != want {
                continue;
            }
            let words: [u64; FIELDS] =
                std::array::from_fn(|k| slot.words[k].load(Ordering::Relaxed));
            fence(Ordering::Acquire);
            if slot.seq.load(Ordering::Relaxed) == want {
                out.push(StepRecord::from_words(words));
            }
        }
        out
    }
}

impl Default for FlightRecorder {
    fn default() -> Self {
        Self::new(512)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ring_keeps_the_last_capacity_records_oldest_first() {
        let r = FlightRecorder::new(4);
        for s in 0..10 {
            let mut rec = StepRecord::new(s);
            rec.kind = StepKind::Decode;
            rec.power_w = s as f64 * 10.0;
            r.record(rec);
        }
        let d = r.dump();
        assert_eq!(
            d.iter().map(|x| x.step).collect::<Vec<_>>(),
            vec![6, 7, 8, 9]
        );
        assert_eq!(d[0].power_w, 60.0);
        assert_eq!(d[0].kind, StepKind::Decode);
        assert_eq!(d[0].tokens, -1);
        assert!(d[0].temperature_c.is_nan());
        assert_eq!(r.len(), 4);
    }

    #[test]
    fn concurrent_reader_never_sees_a_torn_record() {
        let r = std::sync::Arc::new(FlightRecorder::new(8));
        let w = std::sync::Arc::clone(&r);
        let writer = std::thread::spawn(move || {
            for s in 0..20_000i64 {
                let mut rec = StepRecord::new(s);
                rec.tokens = s * 3;
                rec.link_width = s * 7;
                w.record(rec);
            }
        });
        for _ in 0..200 {
            for rec in r.dump() {
                assert_eq!(rec.tokens, rec.step * 3);
                assert_eq!(rec.link_width, rec.step * 7);
            }
        }
        writer.join().unwrap();
        assert_eq!(r.dump().last().unwrap().step, 19_999);
    }
}
