//! The bound on callers waiting for a running operation ([`Coordinator::begin_or_wait`]).
//!
//! [`Coordinator::begin_or_wait`]: super::Coordinator::begin_or_wait

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

/// How many callers may wait for running operations at once, by default. Over HTTP each holds
/// its request body (up to the body limit): 1 000 waiters of 1 KiB bodies hold 1 MiB; of
/// bodies at the default 1 MiB limit, up to 1 GiB, so lower it for large bodies.
pub(super) const DEFAULT_MAX_WAITERS: u32 = 1_000;
/// Waiting on a store that cannot notify: the first re-read after this, then twice as long
/// each time, up to [`POLL_MAX`].
pub(super) const POLL_FIRST: Duration = Duration::from_millis(50);
pub(super) const POLL_MAX: Duration = Duration::from_secs(1);
/// A waiter wakes this long after the lease it last read should have ended, so that the
/// record has expired by then (a store's clock and ours may differ by a little).
pub(super) const LEASE_END_SLACK: Duration = Duration::from_millis(20);

/// Counts the callers waiting for running operations under one coordinator (and its clones).
pub(super) struct Waiters {
    pub(super) waiting: AtomicUsize,
    pub(super) max: u32,
}

/// One waiter's place under the bound; counted until dropped (a caller that gives up, or whose
/// future is dropped when its client hangs up, frees it).
pub(super) struct WaiterPlace {
    waiters: Arc<Waiters>,
}

impl WaiterPlace {
    pub(super) fn take(waiters: &Arc<Waiters>) -> Option<Self> {
        let before = waiters.waiting.fetch_add(1, Ordering::AcqRel);
        let place = Self {
            waiters: waiters.clone(),
        };
        (before < waiters.max as usize).then_some(place)
    }
}

impl Drop for WaiterPlace {
    fn drop(&mut self) {
        self.waiters.waiting.fetch_sub(1, Ordering::AcqRel);
    }
}

/// Who reads a key with a claim: a caller, or a caller waiting for the key to settle, whose
/// every read is a [`Store::claim_waiting`](crate::Store::claim_waiting).
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(super) enum Reader {
    Caller,
    Waiter,
}
