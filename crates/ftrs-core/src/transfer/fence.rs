//! Release fences (see the parent module's doc): `release_after` records a fence on the
//! caller's stream and leaves it with every slot it releases, at most one per stream and slot
//! (a later fence on a stream covers an earlier one); the worker takes a slot's fences when it
//! issues a copy into it and waits on them first.

// Denied, not forbidden: `release_after` allows the one call of `CopyBackend::record_fence`.
#![deny(unsafe_code)]

use std::sync::Arc;

use super::{lock, unpin, State, TransferEngine};
use crate::backend::Fence;
use crate::error::Result;

/// A fence recorded by `release_after`, shared by every slot it released.
#[derive(Debug)]
pub(super) struct SlotFence {
    /// The caller's stream it was recorded on (a later fence on it covers this one).
    pub(super) stream: u64,
    /// The backend's mark.
    pub(super) fence: Fence,
}

impl TransferEngine {
    /// Like [`Self::release`] for a caller whose reads of the released slots may still be
    /// queued on its `stream` (a raw stream handle of the backend's device, 0 = its default
    /// stream; host backends ignore it): records a fence there first, and no copy into one
    /// of those slots starts before the fence fires (module doc). Nothing to release: no
    /// fence. If the fence cannot be recorded, the error is returned and the slots stay
    /// pinned (a later release retries): a slot must not be rewritten under a reader.
    ///
    /// # Safety
    /// 1. On a device backend, `stream` is 0 or a stream of the backend's device that stays
    ///    live for the call (point 1 of [`crate::backend::CopyBackend::record_fence`]).
    #[allow(unsafe_code)]
    pub unsafe fn release_after(&self, stream: u64) -> Result<()> {
        {
            let st = lock(&self.inner.state);
            if st.dead.is_some() || st.pinned.is_empty() {
                return Ok(());
            }
        }
        // Recorded without the lock (a driver call); the reads it covers were queued by this
        // caller before this call, after the lookups that pinned the slots.
        // SAFETY: point 1 of this function's contract.
        let fence = unsafe { self.inner.backend.record_fence(stream) }?;
        let fence = Arc::new(SlotFence { stream, fence });
        let mut st = lock(&self.inner.state);
        st.stats.fences_recorded += 1;
        if release_pinned(&mut st, Some(&fence)) {
            self.inner.work.notify_all();
        }
        Ok(())
    }
}

/// Unpins every slot pinned since the last release, leaving `fence` (if any) with each.
/// Returns whether fill requests wait (a freed slot may let the worker start one).
pub(super) fn release_pinned(st: &mut State, fence: Option<&Arc<SlotFence>>) -> bool {
    if st.dead.is_some() {
        return false; // a panic may have left the bookkeeping half-updated: leave it alone
    }
    for slot in std::mem::take(&mut st.pinned) {
        if let Some(f) = fence {
            let held = &mut st.fences[slot as usize];
            if !held.iter().any(|h| Arc::ptr_eq(h, f)) {
                held.retain(|h| h.stream != f.stream);
                held.push(Arc::clone(f));
            }
        }
        unpin(st, slot);
    }
    st.tickets
        .retain(|_, t| t.remaining > 0 || t.error.is_some());
    !st.fill_q.is_empty()
}
