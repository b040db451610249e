//! Time for pacing and link models, behind a trait so tests never read the wall clock.
//!
//! [`RealClock`] is monotonic time since its creation. [`VirtualClock`] only moves when someone
//! sleeps on it: `sleep(d)` advances it by `d` and returns at once, so a test of a 1 GB/s pace
//! over 10 s runs in microseconds and its timings are exact. [`TokenBucket`] is the pacing
//! rule: tokens (bytes) refill at `rate` up to `burst`; a copy of `n` bytes may start once
//! `min(n, burst)` tokens are there and then takes all `n` (the balance may go negative, which
//! delays the next copy), so over any long run bytes ≤ burst + rate · elapsed.

#![forbid(unsafe_code)]

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// A source of time that can also be slept on.
pub trait Clock: Send + Sync + std::fmt::Debug {
    /// Time since the clock's epoch.
    fn now(&self) -> Duration;
    /// Sleeps `d` (a virtual clock advances by `d` instead).
    fn sleep(&self, d: Duration);
    /// True for the wall clock: a waiter should block on its condvar (waking early on news).
    /// A virtual clock advances by `d` and returns false (nothing to block on).
    fn block_or_advance(&self, d: Duration) -> bool;
    /// Sleeps until `t` (no-op if `t` has passed).
    fn sleep_until(&self, t: Duration) {
        let now = self.now();
        if t > now {
            self.sleep(t - now);
        }
    }
}

/// The monotonic wall clock.
#[derive(Debug)]
pub struct RealClock {
    /// The epoch; `now()` is the time elapsed since it.
    start: Instant,
}

impl RealClock {
    /// A clock whose epoch is now.
    pub fn new() -> Self {
        Self {
            start: Instant::now(),
        }
    }
}

impl Default for RealClock {
    fn default() -> Self {
        Self::new()
    }
}

impl Clock for RealClock {
    fn now(&self) -> Duration {
        self.start.elapsed()
    }
    fn sleep(&self, d: Duration) {
        std::thread::sleep(d)
    }
    fn block_or_advance(&self, _d: Duration) -> bool {
        true
    }
}

/// A clock that moves only when slept on.
#[derive(Debug, Default)]
pub struct VirtualClock {
    /// Nanoseconds since the epoch; only increases.
    nanos: AtomicU64,
}

impl VirtualClock {
    /// A clock at time zero.
    pub fn new() -> Self {
        Self::default()
    }
    /// Moves time forward by `d`.
    pub fn advance(&self, d: Duration) {
        self.nanos.fetch_add(d.as_nanos() as u64, Ordering::SeqCst);
    }
}

impl Clock for VirtualClock {
    fn now(&self) -> Duration {
        Duration::from_nanos(self.nanos.load(Ordering::SeqCst))
    }
    fn sleep(&self, d: Duration) {
        self.advance(d)
    }
    fn block_or_advance(&self, d: Duration) -> bool {
        self.advance(d);
        false
    }
}

/// Byte-rate limiter (see module doc).
#[derive(Debug, Clone)]
pub struct TokenBucket {
    /// Refill rate in bytes per second; > 0.
    rate: f64,
    /// Bucket size in bytes; > 0.
    burst: f64,
    /// Current balance in bytes; <= burst, may be negative (debt).
    tokens: f64,
    /// Time of the last refill.
    last: Duration,
}

impl TokenBucket {
    /// A full bucket at time `now`.
    pub fn new(rate: f64, burst: f64, now: Duration) -> Self {
        debug_assert!(rate > 0.0 && burst > 0.0);
        Self {
            rate,
            burst,
            tokens: burst,
            last: now,
        }
    }

    /// Refill rate in bytes per second.
    pub fn rate(&self) -> f64 {
        self.rate
    }

    fn refill(&mut self, now: Duration) {
        if now > self.last {
            let dt = (now - self.last).as_secs_f64();
            self.tokens = (self.tokens + dt * self.rate).min(self.burst);
            self.last = now;
        }
    }

    /// How long from `now` until a copy of `bytes` may start (zero when it may start now).
    pub fn delay_for(&mut self, now: Duration, bytes: usize) -> Duration {
        self.refill(now);
        let need = (bytes as f64).min(self.burst);
        if self.tokens >= need {
            Duration::ZERO
        } else {
            Duration::from_secs_f64((need - self.tokens) / self.rate)
        }
    }

    /// Takes `bytes` tokens at `now` (call once `delay_for` said zero).
    pub fn consume(&mut self, now: Duration, bytes: usize) {
        self.refill(now);
        self.tokens -= bytes as f64;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn virtual_clock_moves_only_when_slept_on() {
        let c = VirtualClock::new();
        assert_eq!(c.now(), Duration::ZERO);
        c.sleep(Duration::from_millis(5));
        c.sleep_until(Duration::from_millis(3));
        assert_eq!(c.now(), Duration::from_millis(5));
        assert!(!c.block_or_advance(Duration::from_millis(1)));
        assert_eq!(c.now(), Duration::from_millis(6));
    }

    #[test]
    fn bucket_paces_to_rate_after_the_burst() {
        let c = VirtualClock::new();
        let mut b = TokenBucket::new(1e6, 1e6, c.now());
        for _ in 0..10 {
            let d = b.delay_for(c.now(), 1_000_000);
            c.sleep(d);
            assert_eq!(b.delay_for(c.now(), 1_000_000), Duration::ZERO);
            b.consume(c.now(), 1_000_000);
        }
        // The first MB rides the initial burst; the other nine take one second each.
        let t = c.now().as_secs_f64();
        assert!((t - 9.0).abs() < 1e-6, "took {t}");
    }

    #[test]
    fn copies_larger_than_the_burst_go_into_debt() {
        let mut b = TokenBucket::new(100.0, 10.0, Duration::ZERO);
        assert_eq!(b.delay_for(Duration::ZERO, 50), Duration::ZERO);
        b.consume(Duration::ZERO, 50);
        // Balance is -40: the next 10-byte copy waits for 50 tokens = 0.5 s.
        let d = b.delay_for(Duration::ZERO, 10).as_secs_f64();
        assert!((d - 0.5).abs() < 1e-9, "{d}");
    }
}
