//! The transfer worker: issues copies (demand queue first; a demand whole, a prefetch in
//! chunks) within the byte budget and the pacing bucket, and finishes them oldest first (see
//! the parent module's doc).
//!
//! Locking: decisions happen under the state lock; `wait_fence`, `submit` and `finish` on the
//! backend run without it, so `lookup` never waits for a copy.
//!
//! Release fences: a copy into slot `s` takes `s`'s fences (the releases' marks not waited on
//! yet) when it is issued and waits on them before it is submitted; if a wait fails they go
//! back to the slot (its next copy waits on them) and the copy fails.
//!
//! A panic anywhere in the loop is caught by [`run_worker`]: it finishes the copies already
//! submitted (an asynchronous copy must end before its memory may be freed), then fails every
//! waiting ticket and marks the engine dead (`State::dead`), so `wait` never blocks forever.
//!
//! The one `unsafe` block is the call of `CopyBackend::submit`, whose contract this loop keeps.

#![deny(unsafe_code)]

use std::collections::VecDeque;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::Arc;

use super::{allocate_in_layer, lock, queue, unpin, Drill, Inner, Prio, SlotFence, State};
use crate::backend::Completion;
use crate::error::{CoreError, Result};
use crate::layout::ExpertLayout;
use crate::raw::CopyJob;

/// One copy issued to the backend: a whole transfer or one chunk of it.
struct Issued {
    /// The transfer.
    tid: u64,
    /// Bytes of this copy.
    len: usize,
    /// Issued as a prefetch chunk (counted in `inflight_prefetches` until it ends).
    prefetch: bool,
}

/// What an armed drill does to the copy being issued.
enum Injected {
    /// The copy fails with this error instead of being submitted.
    Error(CoreError),
    /// The worker panics.
    Panic,
}

enum Step<'a> {
    /// Wait on the fences of the destination slot, then submit the job (or apply the drill).
    Submit(Issued, CopyJob<'a>, Option<Injected>, Fences),
    Finish,
    Exit,
}

/// The payload of a drill's panic (`TransferEngine::inject_panic`), told apart from a real one.
struct InjectedPanic;

/// The release fences a copy takes from its slot: (slot, fences).
type Fences = (u32, Vec<Arc<SlotFence>>);

/// Copies issued to the backend and not finished yet, oldest first.
type Pending = VecDeque<(Issued, Result<Completion>)>;

/// The worker thread's body: [`worker_loop`], and the panic path of the module doc.
pub(super) fn run_worker(inner: &Inner) {
    let mut pending = Pending::new();
    let Err(payload) = catch_unwind(AssertUnwindSafe(|| worker_loop(inner, &mut pending))) else {
        return;
    };
    let injected = payload.is::<InjectedPanic>();
    let detail = if injected {
        "injected panic of the transfer worker (drill)".to_string()
    } else {
        payload
            .downcast_ref::<&str>()
            .map(|s| s.to_string())
            .or_else(|| payload.downcast_ref::<String>().cloned())
            .unwrap_or_else(|| "a panic without a message".into())
    };
    for (_, c) in pending.drain(..) {
        if let Ok(c) = c {
            // Its result no longer matters, only that the copy has ended.
            let _ = catch_unwind(AssertUnwindSafe(|| inner.backend.finish(c)));
        }
    }
    let err = CoreError::WorkerPanic { detail, injected };
    let mut st = lock(&inner.state);
    for t in st.tickets.values_mut() {
        if t.remaining > 0 {
            t.remaining = 0;
            t.error.get_or_insert_with(|| err.clone());
        }
    }
    st.dead = Some(err);
    drop(st);
    inner.done.notify_all();
}

fn worker_loop(inner: &Inner, pending: &mut Pending) {
    let eb = inner.pool.layout().expert_bytes();
    loop {
        let step = {
            let mut st = lock(&inner.state);
            loop {
                let prefetch_room = st.max_inflight_prefetches == 0
                    || st.inflight_prefetches < st.max_inflight_prefetches;
                if prefetch_room && st.demand_q.is_empty() && st.prefetch_q.is_empty() {
                    start_fill(&mut st, inner.pool.layout());
                }
                let next = st
                    .demand_q
                    .front()
                    .or(st.prefetch_q.front().filter(|_| prefetch_room))
                    .copied()
                    .map(|tid| (tid, next_len(&st, tid)));
                let fits = |len: usize| {
                    inner.max_inflight_bytes == 0
                        || st.inflight_bytes == 0
                        || st.inflight_bytes + len <= inner.max_inflight_bytes
                };
                if let Some((tid, len)) = next.filter(|&(_, len)| fits(len)) {
                    let now = inner.clock.now();
                    let delay = st
                        .bucket
                        .as_mut()
                        .map_or(std::time::Duration::ZERO, |b| b.delay_for(now, len));
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
                        b.consume(now, len);
                    }
                    let t = st.transfers.get_mut(&tid).expect("queued transfer is live");
                    let prefetch = t.prio == Prio::Prefetch;
                    let (key, slot, at) = (t.key, t.slot, t.issued);
                    t.issued += len;
                    t.inflight_bytes += len;
                    t.inflight_prefetch_chunks += usize::from(prefetch);
                    if t.issued == t.bytes {
                        if st.demand_q.front() == Some(&tid) {
                            st.demand_q.pop_front();
                        } else {
                            st.prefetch_q.pop_front();
                        }
                    }
                    st.inflight_bytes += len;
                    st.inflight_prefetches += usize::from(prefetch);
                    let src = inner
                        .pool
                        .layout()
                        .block_offset(key.0 as usize, key.1 as usize);
                    let job = src.and_then(|off| {
                        let dst_off = slot as usize * eb + at;
                        CopyJob::new(inner.pool.region(), off + at, &inner.dst, dst_off, len)
                    });
                    let fault = match st.fault {
                        Some((Drill::Fault(kind), 0)) => {
                            st.fault = None;
                            Some(Injected::Error(CoreError::Device {
                                kind,
                                source_name: "copy_backend",
                                injected: true,
                                detail: format!("injected {kind} on copy of expert {key:?}"),
                            }))
                        }
                        Some((Drill::Panic, 0)) => {
                            st.fault = None;
                            Some(Injected::Panic)
                        }
                        Some((drill, n)) => {
                            st.fault = Some((drill, n - 1));
                            None
                        }
                        None => None,
                    };
                    let issued = Issued { tid, len, prefetch };
                    match job {
                        Ok(job) => {
                            let fences = std::mem::take(&mut st.fences[slot as usize]);
                            st.stats.fence_waits += fences.len() as u64;
                            break Step::Submit(issued, job, fault, (slot, fences));
                        }
                        Err(e) => {
                            pending.push_back((issued, Err(e)));
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
            Step::Submit(issued, job, fault, (slot, fences)) => {
                let waited = fences
                    .iter()
                    .try_for_each(|f| inner.backend.wait_fence(&f.fence));
                if let Err(e) = waited {
                    restore_fences(inner, slot, fences);
                    pending.push_back((issued, Err(e)));
                    continue;
                }
                drop(fences); // waited: the copies submitted from now on come after them
                let r = match fault {
                    Some(Injected::Error(e)) => Err(e),
                    Some(Injected::Panic) => std::panic::panic_any(InjectedPanic),
                    #[allow(unsafe_code)]
                    // SAFETY: point 1 of `CopyBackend::submit`: the job borrows `inner`'s pool
                    // region and destination, and `inner` outlives this thread (it holds an
                    // `Arc`); the completion goes into `pending`, which is finished before the
                    // loop exits (it exits only when `pending` is empty; after a panic
                    // `run_worker` finishes it). The pool is only read while shared (writes need
                    // `&mut`); the destination range is the slot of this transfer, pinned by it,
                    // which no other copy targets and readers read only once it is ready
                    // (`Destination::new`, point 3).
                    None => unsafe { inner.backend.submit(&job) },
                };
                pending.push_back((issued, r));
            }
            Step::Finish => {
                let (issued, c) = pending.pop_front().expect("pending is non-empty");
                let r = c.and_then(|c| inner.backend.finish(c));
                complete(inner, &issued, r);
            }
            Step::Exit => return,
        }
    }
}

/// The link is idle (nothing queued, room for a prefetch copy): the newest fill request not
/// resident or in flight becomes a prefetch transfer into a free slot, or else into one its
/// own layer holds, evicted per policy. A fill changes what a layer holds, never how many
/// slots: demands and prefetches set that. In a decode's cycle over the layers the policy's
/// victim from the whole cache is a layer that comes next (least recently used), so a fill
/// taking it would trade a hit soon for one a whole token later. A request whose layer holds
/// only pinned slots waits (its layer is computing; `release` wakes the worker); one whose
/// layer holds none is dropped. Older requests stay queued for the next idle moment.
fn start_fill(st: &mut State, layout: &ExpertLayout) {
    while let Some(key) = st.fill_q.pop_back() {
        if st.cache.slot_for(key).is_some() {
            continue; // resident or in flight since it was asked for
        }
        let (room, held) = st.cache.layer_room(key.0);
        if room == 0 && held == 0 {
            continue; // no free slot, and its layer holds none to give
        }
        if room == 0 {
            st.fill_q.push_back(key);
            return;
        }
        let Ok(slot) = allocate_in_layer(st, key) else {
            return; // not reached: a free slot or one of the layer's is evictable
        };
        let bytes = layout.block_bytes(key.0 as usize).unwrap_or(0);
        queue(st, key, bytes, slot, Prio::Prefetch, None, true);
        st.stats.fill_issued += 1;
        return;
    }
}

/// Gives `slot` back the fences a failed wait took from it (beside any recorded since), so
/// the next copy into it waits on them.
fn restore_fences(inner: &Inner, slot: u32, fences: Vec<Arc<SlotFence>>) {
    let mut st = lock(&inner.state);
    let st = &mut *st;
    st.stats.fence_waits = st.stats.fence_waits.saturating_sub(fences.len() as u64);
    let held = &mut st.fences[slot as usize];
    for f in fences {
        if !held.iter().any(|h| h.stream == f.stream) {
            held.push(f); // a fence recorded since on its stream covers it
        }
    }
}

/// Bytes of the next copy of queued transfer `tid`: a prefetch's next chunk, or all that is left.
fn next_len(st: &State, tid: u64) -> usize {
    let t = &st.transfers[&tid];
    let left = t.bytes - t.issued;
    match (t.prio, st.prefetch_chunk_bytes) {
        (Prio::Prefetch, c) if c > 0 => c.min(left),
        _ => left,
    }
}

/// One copy ended (`r`): counts its bytes; the transfer ends once none of its copies is in
/// flight and it landed whole, failed or was cancelled.
fn complete(inner: &Inner, c: &Issued, r: Result<()>) {
    let mut st = lock(&inner.state);
    let st = &mut *st;
    st.inflight_bytes -= c.len;
    st.inflight_prefetches -= usize::from(c.prefetch);
    let t = st
        .transfers
        .get_mut(&c.tid)
        .expect("issued transfer is live");
    t.inflight_bytes -= c.len;
    t.inflight_prefetch_chunks -= usize::from(c.prefetch);
    match r {
        Ok(()) => {
            t.landed += c.len;
            st.stats.bytes_h2d += c.len as u64;
        }
        Err(e) => {
            if t.error.is_none() {
                t.error = Some(e);
            }
            // nothing more of it is issued
            if t.issued < t.bytes && !t.cancelled {
                st.demand_q.retain(|&x| x != c.tid);
                st.prefetch_q.retain(|&x| x != c.tid);
            }
        }
    }
    let ended = t.inflight_bytes == 0 && (t.landed == t.bytes || t.cancelled || t.error.is_some());
    if !ended {
        return;
    }
    let t = st.transfers.remove(&c.tid).expect("present above");
    if !t.cancelled {
        st.inflight.remove(&t.key);
    }
    let s = t.slot as usize;
    match (&t.error, t.cancelled) {
        (None, false) => {
            st.ready[s] = true;
            st.prefetched_unused[s] = t.was_prefetch && !t.used;
            st.filled_unused[s] = t.fill && !t.used;
        }
        (Some(_), false) => {
            st.cache.detach(t.slot);
        }
        (_, true) => {}
    }
    unpin(st, t.slot);
    for w in &t.waiters {
        if let Some(tk) = st.tickets.get_mut(w) {
            tk.remaining -= 1;
            if let (Some(e), None) = (&t.error, &tk.error) {
                tk.error = Some(e.clone());
            }
        }
    }
    inner.done.notify_all();
}
