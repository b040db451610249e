//! The kernels' worker pool: the calling thread and `n - 1` workers share a call's tasks.
//!
//! A decode step makes a few hundred kernel calls of tens of microseconds each, with a little
//! Python between them. A pool whose caller sleeps while idle workers are woken through the
//! OS pays two wake-ups per call, each as long as a small matmul (a rayon pool here made two
//! threads slower than one). So the caller publishes the call, takes tasks itself, and waits
//! for the last one spinning; workers take tasks as soon as the call is published and, after
//! their last task, poll for the next call for [`SPIN`], then sleep on a condition variable:
//! within a decode step they stay awake, and a pool idle for longer than that uses no CPU.
//!
//! One call at a time per pool: a second caller (another thread, while the pool works) runs its
//! tasks alone. A task that panics is caught; the caller panics once every task has ended.
//!
//! The only `unsafe` here: a call's task function is borrowed from the caller's stack and
//! handed to the workers as a raw pointer. It is read only between a worker's increment of
//! [`Shared::active`] and its decrement, and only while [`Shared::job`] points at the call;
//! [`Pool::run`] clears `job` and then waits for `active` to reach zero before it returns
//! (both sequentially consistent: a worker that read the pointer is counted before the caller
//! checks), so no worker can touch the function after the call returns.

#![allow(unsafe_code)]

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::ptr;
use std::sync::atomic::{AtomicBool, AtomicPtr, AtomicU64, AtomicUsize, Ordering::*};
use std::sync::{Arc, Condvar, Mutex, TryLockError};
use std::time::{Duration, Instant};

/// How long an idle worker polls for the next call before it sleeps.
pub const SPIN: Duration = Duration::from_micros(200);

/// One call: `tasks` tasks of `f`, taken in order by whoever is free.
struct Job {
    /// The caller's task function, its lifetime erased (see the module doc).
    f: *const (dyn Fn(usize) + Sync),
    tasks: usize,
    next: AtomicUsize,
    done: AtomicUsize,
    panicked: AtomicBool,
}

// SAFETY: `f` is `Sync` (shared calls are fine) and is only called while the caller keeps it
// alive (module doc); the rest are atomics.
unsafe impl Sync for Job {}

impl Job {
    /// Takes and runs tasks until none is left.
    fn work(&self) {
        loop {
            let i = self.next.fetch_add(1, Relaxed);
            if i >= self.tasks {
                return;
            }
            // SAFETY: `f` outlives every task (module doc: the caller waits for `done` and
            // then for `active`).
            let f = unsafe { &*self.f };
            if catch_unwind(AssertUnwindSafe(|| f(i))).is_err() {
                self.panicked.store(true, Relaxed);
            }
            self.done.fetch_add(1, Release);
        }
    }
}

/// What the caller and the workers share.
struct Shared {
    /// Bumped once per call.
    generation: AtomicU64,
    /// The current call, null between calls.
    job: AtomicPtr<Job>,
    /// Workers between reading `job` and being done with it.
    active: AtomicUsize,
    /// Sleeping workers, and the condition variable they sleep on.
    sleepers: Mutex<usize>,
    wake: Condvar,
}

/// A pool of `n - 1` workers; the caller is the `n`th thread.
pub struct Pool {
    shared: Arc<Shared>,
    workers: usize,
    /// Held by the call in progress.
    busy: Mutex<()>,
}

impl Pool {
    /// Starts `n - 1` workers named `ftrs-quant-{i}`; `None` if the OS refuses a thread.
    pub fn new(n: usize) -> Option<Pool> {
        let shared = Arc::new(Shared {
            generation: AtomicU64::new(0),
            job: AtomicPtr::new(ptr::null_mut()),
            active: AtomicUsize::new(0),
            sleepers: Mutex::new(0),
            wake: Condvar::new(),
        });
        let workers = n.saturating_sub(1);
        for i in 0..workers {
            let s = shared.clone();
            std::thread::Builder::new()
                .name(format!("ftrs-quant-{i}"))
                .spawn(move || worker(&s))
                .ok()?;
        }
        Some(Pool {
            shared,
            workers,
            busy: Mutex::new(()),
        })
    }

    /// Threads that run a call's tasks: the workers and the caller.
    pub fn threads(&self) -> usize {
        self.workers + 1
    }

    /// Runs `f(0) .. f(tasks - 1)`, each once, on the caller and the workers; returns when all
    /// have returned. Panics (after they have) if one did.
    pub fn run(&self, tasks: usize, f: &(dyn Fn(usize) + Sync)) {
        let _busy = match self.busy.try_lock() {
            Ok(g) => g,
            Err(TryLockError::Poisoned(e)) => e.into_inner(),
            Err(TryLockError::WouldBlock) => {
                (0..tasks).for_each(f); // another call holds the workers
                return;
            }
        };
        // SAFETY: only the lifetime is erased; run() outlives every use (module doc).
        let f: *const (dyn Fn(usize) + Sync + 'static) = unsafe { std::mem::transmute(f) };
        let job = Job {
            f,
            tasks,
            next: AtomicUsize::new(0),
            done: AtomicUsize::new(0),
            panicked: AtomicBool::new(false),
        };
        let s = &*self.shared;
        s.job.store(ptr::from_ref(&job).cast_mut(), SeqCst);
        s.generation.fetch_add(1, SeqCst);
        {
            let sleepers = s.sleepers.lock().unwrap_or_else(|e| e.into_inner());
            if *sleepers > 0 {
                s.wake.notify_all();
            }
        }
        job.work();
        let mut spins = 0u32;
        while job.done.load(Acquire) < tasks {
            spins += 1;
            if spins < 1 << 14 {
                std::hint::spin_loop();
            } else {
                std::thread::yield_now(); // a worker descheduled mid-task
            }
        }
        s.job.store(ptr::null_mut(), SeqCst);
        while s.active.load(SeqCst) != 0 {
            std::hint::spin_loop();
        }
        if job.panicked.load(Relaxed) {
            panic!("a quantized kernel task panicked");
        }
    }
}

/// A worker: runs the tasks of each call it sees, polls for [`SPIN`] after the last one, then
/// sleeps until the next call. Lives as long as the process (pools are never dropped).
fn worker(s: &Shared) {
    let mut seen = s.generation.load(SeqCst);
    loop {
        let idle_since = Instant::now();
        let mut polls = 0u32;
        loop {
            let g = s.generation.load(SeqCst);
            if g != seen {
                seen = g;
                break;
            }
            polls = polls.wrapping_add(1);
            if polls.is_multiple_of(64) && idle_since.elapsed() >= SPIN {
                let mut sleepers = s.sleepers.lock().unwrap_or_else(|e| e.into_inner());
                *sleepers += 1;
                while s.generation.load(SeqCst) == seen {
                    sleepers = s.wake.wait(sleepers).unwrap_or_else(|e| e.into_inner());
                }
                *sleepers -= 1;
                seen = s.generation.load(SeqCst);
                break;
            }
            std::hint::spin_loop();
        }
        s.active.fetch_add(1, SeqCst);
        let job = s.job.load(SeqCst);
        if !job.is_null() {
            // SAFETY: non-null `job` read after our `active` increment: the caller is still
            // in `run` and keeps the job alive until `active` drops back (module doc).
            unsafe { &*job }.work();
        }
        s.active.fetch_sub(1, SeqCst);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_task_runs_once_across_many_calls() {
        let pool = Pool::new(3).expect("threads");
        assert_eq!(pool.threads(), 3);
        for tasks in [0, 1, 2, 7, 64] {
            for _ in 0..50 {
                let hits: Vec<AtomicUsize> = (0..tasks).map(|_| AtomicUsize::new(0)).collect();
                pool.run(tasks, &|i| {
                    hits[i].fetch_add(1, Relaxed);
                });
                assert!(hits.iter().all(|h| h.load(Relaxed) == 1), "tasks = {tasks}");
            }
        }
    }

    #[test]
    fn workers_wake_from_sleep_and_a_panic_reaches_the_caller() {
        let pool = Pool::new(2).expect("threads");
        std::thread::sleep(SPIN * 5); // the worker is asleep now
        let sum = AtomicUsize::new(0);
        pool.run(16, &|i| {
            sum.fetch_add(i, Relaxed);
        });
        assert_eq!(sum.load(Relaxed), 120);
        let caught = catch_unwind(AssertUnwindSafe(|| {
            pool.run(4, &|i| assert_ne!(i, 2, "task 2 fails"));
        }));
        assert!(caught.is_err());
        let again = AtomicUsize::new(0);
        pool.run(4, &|_| {
            again.fetch_add(1, Relaxed);
        });
        assert_eq!(
            again.load(Relaxed),
            4,
            "the pool serves calls after a panic"
        );
    }

    #[test]
    fn a_second_caller_runs_alone_while_the_pool_is_busy() {
        let pool = Arc::new(Pool::new(2).expect("threads"));
        let total = Arc::new(AtomicUsize::new(0));
        let threads: Vec<_> = (0..4)
            .map(|_| {
                let (pool, total) = (pool.clone(), total.clone());
                std::thread::spawn(move || {
                    for _ in 0..200 {
                        pool.run(8, &|_| {
                            total.fetch_add(1, Relaxed);
                        });
                    }
                })
            })
            .collect();
        for t in threads {
            t.join().expect("caller");
        }
        assert_eq!(total.load(Relaxed), 4 * 200 * 8);
    }
}
