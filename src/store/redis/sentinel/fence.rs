//! The fence: raised while the sentinels fail the master over (claims refused, owners' writes
//! held), and the `blind` and `listening` flags beside it; the watcher raises and lowers it.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use tokio::sync::Notify;

/// Raised while the sentinels fail the master over; see the module docs.
#[derive(Default)]
pub(crate) struct Fence {
    raised: AtomicBool,
    /// How many times it was raised: a write checked against the fence reads it first, and
    /// once answered tells whether a failover began while it was on its way (see [`pass`](Self::pass)).
    raises: AtomicU64,
    lowered: Notify,
    /// No sentinel can be heard, and a failover could have promoted a replica since: claims are
    /// refused meanwhile.
    pub(super) blind: AtomicBool,
    /// The watch listens: its first subscriptions are made, and the sentinels were asked
    /// whether a failover is under way. Until then a failover's announcement would go unheard
    /// (a store started in the second before one claimed on the old master, and keys ran twice:
    /// found by tests/history.rs), so claims wait.
    listening: AtomicBool,
}

impl Fence {
    pub(crate) fn is_raised(&self) -> bool {
        self.raised.load(Ordering::Acquire)
    }

    /// Whether no sentinel can be heard and a failover could be under way (claims are refused).
    pub(crate) fn is_blind(&self) -> bool {
        self.blind.load(Ordering::Acquire)
    }

    /// Returns once the watch listens to the sentinels (at once, but in a new store's first
    /// moments).
    pub(crate) async fn until_listening(&self) {
        while !self.listening.load(Ordering::Acquire) {
            let started = self.lowered.notified();
            if self.listening.load(Ordering::Acquire) {
                return;
            }
            started.await;
        }
    }

    pub(super) fn start_listening(&self) {
        self.listening.store(true, Ordering::Release);
        self.lowered.notify_waiters();
    }

    /// Returns once the fence is down (at once, almost always).
    pub(crate) async fn until_lowered(&self) {
        while self.is_raised() {
            let lowered = self.lowered.notified();
            if !self.is_raised() {
                return;
            }
            lowered.await;
        }
    }

    /// Returns once the fence is down, with a pass for the write about to go out: give it to
    /// [`raised_since`](Self::raised_since) once the write is answered.
    pub(crate) async fn pass(&self) -> u64 {
        loop {
            let pass = self.mark();
            if !self.is_raised() {
                return pass;
            }
            self.until_lowered().await;
        }
    }

    /// The pass of a write that checks [`is_raised`](Self::is_raised) itself, read before it: a
    /// raise after this read moves the count (`raise` sets `raised` first), and one before it
    /// shows as raised.
    pub(crate) fn mark(&self) -> u64 {
        self.raises.load(Ordering::Acquire)
    }

    /// Whether the fence was raised since `pass` was given (it may be down again by now).
    ///
    /// A write passes the fence, then waits for a connection, in the client's queue, in the
    /// socket, and on a loaded machine the store acts on the announcement late (seen 205 ms
    /// after the promotion, which the leading sentinel sends a tick after announcing it). The
    /// write can then land on the old master after the promotion, where a replica not
    /// reconfigured yet acknowledges it, and be thrown away with the old master's demotion. A
    /// write answered after a raise is not to be trusted; one answered before the store heard
    /// is, wrongly, unless every replica must acknowledge (the promoted one cannot).
    pub(crate) fn raised_since(&self, pass: u64) -> bool {
        self.raises.load(Ordering::Acquire) != pass
    }

    pub(super) fn raise(&self) {
        self.raised.store(true, Ordering::Release);
        self.raises.fetch_add(1, Ordering::AcqRel);
    }

    pub(super) fn lower(&self) {
        self.raised.store(false, Ordering::Release);
        self.lowered.notify_waiters();
    }
}

#[cfg(test)]
impl Fence {
    pub(crate) fn set_raised_by_test(&self, raised: bool) {
        if raised {
            self.raise();
        } else {
            self.lower();
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::time::Duration;

    use super::Fence;

    #[tokio::test]
    async fn writes_held_at_a_raised_fence_go_on_when_it_is_lowered() {
        let fence = Arc::new(Fence::default());
        fence.until_lowered().await; // down: at once
        fence.raise();
        let held = tokio::spawn({
            let fence = fence.clone();
            async move { fence.until_lowered().await }
        });
        tokio::time::sleep(Duration::from_millis(20)).await;
        assert!(!held.is_finished(), "a write went through a raised fence");
        fence.lower();
        tokio::time::timeout(Duration::from_secs(1), held)
            .await
            .expect("lowering the fence releases the held write")
            .unwrap();
    }
}
