//! The transfer worker: issues copies (demand queue first) within the byte budget and the
//! pacing bucket, and finishes them oldest first (see the parent module's doc).
//!
//! Locking: decisions happen under the state lock; `submit` and `finish` on the backend run
//! without it, so `lookup` never waits for a copy.

#![forbid(unsafe_code)]

use std::collections::VecDeque;

use super::{lock, unpin, Inner, Prio};
use crate::backend::Completion;
use crate::error::{CoreError, Result};
use crate::raw::CopyJob;

enum Step {
    Submit(u64, CopyJob, Option<CoreError>),
    Finish,
    Exit,
}

pub(super) fn worker_loop(inner: &Inner) {
    let eb = inner.pool.layout().expert_bytes();
    let mut pending: VecDeque<(u64, Result<Completion>)> = VecDeque::new();
    loop {
        let step = {
            let mut st = lock(&inner.state);
            loop {
                let prefetch_room = st.max_inflight_prefetches == 0
                    || st.inflight_prefetches < st.max_inflight_prefetches;
                let next = st
                    .demand_q
                    .front()
                    .or(st.prefetch_q.front().filter(|_| prefetch_room))
                    .copied();
                let fits = inner.max_inflight_bytes == 0
                    || st.inflight_bytes == 0
                    || st.inflight_bytes + eb <= inner.max_inflight_bytes;
                if let (Some(tid), true) = (next, fits) {
                    let now = inner.clock.now();
                    let delay = st
                        .bucket
                        .as_mut()
                        .map_or(std::time::Duration::ZERO, |b| b.delay_for(now, eb));
                    if !delay.is_zero() {
                        if !pending.is_empty() {
                            break Step::Finish;
                        }
                        if inner.clock.block_or_advance(delay) {
                            st = inner
                                .work
                                .wait_timeout(st, delay)
                                .unwrap_or_else(|p| p.into_inner())
                                .0;
                        }
                        continue;
                    }
                    if let Some(b) = st.bucket.as_mut() {
                        b.consume(now, eb);
                    }
                    if st.demand_q.front() == Some(&tid) {
                        st.demand_q.pop_front();
                    } else {
                        st.prefetch_q.pop_front();
                    }
                    st.inflight_bytes += eb;
                    let t = st.transfers.get_mut(&tid).expect("queued transfer is live");
                    t.started = true;
                    t.started_as_prefetch = t.prio == Prio::Prefetch;
                    let (key, slot) = (t.key, t.slot);
                    st.inflight_prefetches += usize::from(t.started_as_prefetch);
                    let src = inner
                        .pool
                        .layout()
                        .block_offset(key.0 as usize, key.1 as usize);
                    let job = src.and_then(|off| {
                        CopyJob::new(inner.pool.region(), off, &inner.dst, slot as usize * eb, eb)
                    });
                    let fault = match st.fault {
                        Some((kind, 0)) => {
                            st.fault = None;
                            Some(CoreError::Device {
                                kind,
                                source_name: "copy_backend",
                                injected: true,
                                detail: format!("injected {kind} on copy of expert {key:?}"),
                            })
                        }
                        Some((kind, n)) => {
                            st.fault = Some((kind, n - 1));
                            None
                        }
                        None => None,
                    };
                    match job {
                        Ok(job) => break Step::Submit(tid, job, fault),
                        Err(e) => {
                            pending.push_back((tid, Err(e)));
                            continue;
                        }
                    }
                }
                if !pending.is_empty() {
                    break Step::Finish;
                }
                if st.shutdown {
                    break Step::Exit;
                }
                st = inner.work.wait(st).unwrap_or_else(|p| p.into_inner());
            }
        };
        match step {
            Step::Submit(tid, job, fault) => {
                let r = match fault {
                    Some(e) => Err(e),
                    None => inner.backend.submit(&job),
                };
                pending.push_back((tid, r));
            }
            Step::Finish => {
                let (tid, c) = pending.pop_front().expect("pending is non-empty");
                let r = c.and_then(|c| inner.backend.finish(c));
                complete(inner, tid, r, eb);
            }
            Step::Exit => return,
        }
    }
}

fn complete(inner: &Inner, tid: u64, r: Result<()>, eb: usize) {
    let mut st = lock(&inner.state);
    let st = &mut *st;
    let t = st.transfers.remove(&tid).expect("started transfer is live");
    st.inflight_bytes -= eb;
    st.inflight_prefetches -= usize::from(t.started_as_prefetch);
    if !t.cancelled {
        st.inflight.remove(&t.key);
    }
    let s = t.slot as usize;
    match (&r, t.cancelled) {
        (Ok(()), false) => {
            st.ready[s] = true;
            st.prefetched_unused[s] = t.was_prefetch && !t.used;
            st.stats.bytes_h2d += eb as u64;
        }
        (Err(_), false) => {
            st.cache.detach(t.slot);
        }
        (_, true) => {}
    }
    unpin(st, t.slot);
    for w in &t.waiters {
        if let Some(tk) = st.tickets.get_mut(w) {
            tk.remaining -= 1;
            if let (Err(e), None) = (&r, &tk.error) {
                tk.error = Some(e.clone());
            }
        }
    }
    inner.done.notify_all();
}
