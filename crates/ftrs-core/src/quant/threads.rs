//! Worker pools of the quantized kernels.
//!
//! One persistent [`Pool`] per thread count asked for (in practice one or two), built on first
//! use and kept for the process: the calling thread plus `threads - 1` workers, which poll for
//! the next call for [`super::pool::SPIN`] after their last task and then sleep, so an idle pool
//! costs no CPU while a decode step's back-to-back calls find them awake.
//!
//! Work is cut by rows: each task gets a contiguous run of weight rows and the matching run of
//! the output, so tasks never share memory. Matrices too small to repay the split run on the
//! calling thread.

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock};

use super::pool::Pool;
use crate::error::{CoreError, Result};

/// Below this much work (weight bytes x activation rows, capped), one thread does it all: a
/// split costs a worker a few cache misses on the call's state, and the tail of the slowest
/// task, about the time to stream this much.
pub const MIN_PARALLEL_WORK: usize = 128 << 10;

/// Tasks per thread, so a worker slowed by a neighbour leaves work to the others.
const TASKS_PER_THREAD: usize = 4;

/// The default thread count; 0 until first read or set.
static DEFAULT_THREADS: AtomicUsize = AtomicUsize::new(0);

/// Physical cores of this host (distinct `core_cpus_list` of online CPUs), else logical CPUs.
pub fn physical_cores() -> usize {
    let logical = std::thread::available_parallelism().map_or(1, |n| n.get());
    let Ok(dir) = std::fs::read_dir("/sys/devices/system/cpu") else {
        return logical;
    };
    let mut cores = std::collections::HashSet::new();
    for entry in dir.flatten() {
        let name = entry.file_name();
        let name = name.to_string_lossy();
        if !name.starts_with("cpu") || !name[3..].chars().all(|c| c.is_ascii_digit()) {
            continue;
        }
        let path = entry.path().join("topology/core_cpus_list");
        let alt = entry.path().join("topology/thread_siblings_list");
        if let Ok(s) = std::fs::read_to_string(&path).or_else(|_| std::fs::read_to_string(&alt)) {
            cores.insert(s.trim().to_string());
        }
    }
    if cores.is_empty() {
        logical
    } else {
        cores.len().min(logical)
    }
}

/// Threads used when a call passes 0: set by [`set_default_threads`], else physical cores
/// minus one (one core stays with the thread that drives the model), at least one.
pub fn default_threads() -> usize {
    match DEFAULT_THREADS.load(Ordering::Relaxed) {
        0 => {
            let n = physical_cores().saturating_sub(1).max(1);
            DEFAULT_THREADS.store(n, Ordering::Relaxed);
            n
        }
        n => n,
    }
}

/// Sets the thread count used when a call passes 0; 0 is a `Config` error.
pub fn set_default_threads(n: usize) -> Result<()> {
    if n == 0 {
        return Err(CoreError::Config(
            "quantized kernel threads must be >= 1".into(),
        ));
    }
    DEFAULT_THREADS.store(n, Ordering::Relaxed);
    Ok(())
}

/// Resolves a call's `threads` argument (0 = default).
pub fn resolve(threads: usize) -> usize {
    if threads == 0 {
        default_threads()
    } else {
        threads
    }
}

/// How many tasks to cut `rows` into for `work` bytes of work on `threads` (0 = default).
pub fn plan(rows: usize, work: usize, threads: usize) -> usize {
    let t = resolve(threads);
    if t <= 1 || work < MIN_PARALLEL_WORK || rows < 2 {
        return 1;
    }
    (t * TASKS_PER_THREAD).min(rows)
}

/// The pool of `n` threads (the caller and `n - 1` workers), built on first use; `None` if
/// the OS refuses the threads.
fn pool(n: usize) -> Option<Arc<Pool>> {
    static POOLS: OnceLock<Mutex<HashMap<usize, Arc<Pool>>>> = OnceLock::new();
    let mut pools = POOLS
        .get_or_init(Default::default)
        .lock()
        .unwrap_or_else(|e| e.into_inner());
    if let Some(p) = pools.get(&n) {
        return Some(p.clone());
    }
    let p = Arc::new(Pool::new(n)?);
    pools.insert(n, p.clone());
    Some(p)
}

/// Runs `f(weight rows, their output)` over `tasks` contiguous runs of rows, on the caller and
/// the pool of `threads` (0 = default) when `tasks > 1`, else on the calling thread alone.
///
/// `weight` holds `rows` rows of `row_bytes`; `out` holds `rows` runs of `out_per_row` floats.
#[allow(clippy::too_many_arguments)]
pub fn for_row_chunks<F>(
    tasks: usize,
    rows: usize,
    threads: usize,
    weight: &[u8],
    row_bytes: usize,
    out: &mut [f32],
    out_per_row: usize,
    f: F,
) where
    F: Fn(&[u8], &mut [f32]) + Sync,
{
    debug_assert_eq!(weight.len(), rows * row_bytes);
    debug_assert_eq!(out.len(), rows * out_per_row);
    let pool = if tasks > 1 {
        pool(resolve(threads))
    } else {
        None
    };
    let Some(pool) = pool else {
        f(weight, out);
        return;
    };
    let per_task = rows.div_ceil(tasks);
    let w: Vec<&[u8]> = weight.chunks(per_task * row_bytes).collect();
    // each task locks its own run of the output once: no contention, and no unsafe split
    let o: Vec<Mutex<&mut [f32]>> = out
        .chunks_mut(per_task * out_per_row)
        .map(Mutex::new)
        .collect();
    pool.run(w.len(), &|i| {
        let mut oi = o[i].lock().unwrap_or_else(|e| e.into_inner());
        f(w[i], &mut oi);
    });
}

/// Runs `f(first unit, its run of units)` over `tasks` contiguous runs of `out`'s units of
/// `unit` floats, on the caller and the pool of `threads` (0 = default) when `tasks > 1`,
/// else on the calling thread alone.
pub fn for_chunks<F>(tasks: usize, threads: usize, out: &mut [f32], unit: usize, f: F)
where
    F: Fn(usize, &mut [f32]) + Sync,
{
    debug_assert!(unit > 0 && out.len().is_multiple_of(unit));
    let units = out.len() / unit.max(1);
    let pool = if tasks > 1 && units > 1 {
        pool(resolve(threads))
    } else {
        None
    };
    let Some(pool) = pool else {
        f(0, out);
        return;
    };
    let per_task = units.div_ceil(tasks);
    let o: Vec<Mutex<&mut [f32]>> = out.chunks_mut(per_task * unit).map(Mutex::new).collect();
    pool.run(o.len(), &|i| {
        let mut oi = o[i].lock().unwrap_or_else(|e| e.into_inner());
        f(i * per_task, &mut oi);
    });
}
