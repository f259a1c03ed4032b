//! One timer kept due on the runtime while store calls are made, so that the timers those calls
//! set never wake the thread parked in the I/O driver.
//!
//! Every call to the store is bounded by a timer (the store timeout), and `fred` sets one more
//! per command (its command timeout); a claim that runs also sets one for its lease's renewal.
//! Tokio's time driver wakes the worker parked in the I/O driver whenever a timer is registered
//! whose deadline comes before the driver's next scheduled wake-up, or when none is scheduled:
//! an `eventfd` write, and an `epoll_wait` more for the woken thread. On a quiet runtime (one
//! request at a time) that was every such timer: `perf stat` counted 2.04 of those writes and
//! 3.02 `epoll_wait`s per Redis replay. While a timer of this anchor is always due within
//! [`PERIOD`], a deadline further out than that is filed without waking anyone: 0.04 writes and
//! 2.08 `epoll_wait`s (`bench/profile.md`, "A timer kept due").
//!
//! A deadline nearer than [`PERIOD`] (a store timeout under about a second) wakes the driver as
//! before. The anchor costs one timer firing per [`PERIOD`] while calls come, and nothing once
//! they stop: a period without a call ends its task, and the next call starts another. It lives
//! on the runtime of the call that started it; a coordinator used from several runtimes anchors
//! one of them at a time.

use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::{Arc, Weak};
use std::time::Duration;

/// How often the anchor's timer fires while calls come: below the default store timeout (2 s),
/// `fred`'s command timeout (2 s) and the default lease's renewal (10 s).
pub(crate) const PERIOD: Duration = Duration::from_secs(1);

/// No task runs.
const IDLE: u8 = 0;
/// A task runs, and no call came since its timer last fired.
const RUNNING: u8 = 1;
/// A task runs, and a call came since its timer last fired.
const USED: u8 = 2;

/// Shared by a coordinator and its clones; see the module's documentation.
#[derive(Debug, Default)]
pub(crate) struct WakeAnchor {
    state: AtomicU8,
    /// How many tasks were started, for the tests.
    #[cfg(test)]
    starts: std::sync::atomic::AtomicUsize,
}

impl WakeAnchor {
    /// Notes a call, and starts the anchor's task on the current runtime if none runs. Once it
    /// runs, this is one load of a value written about once per [`PERIOD`].
    pub(crate) fn touch(self: &Arc<Self>) {
        loop {
            match self.state.load(Ordering::Relaxed) {
                USED => return,
                RUNNING => {
                    // Fails only if the task just stopped (IDLE: start another) or a racing call
                    // marked it (USED).
                    if self.swap_state(RUNNING, USED) {
                        return;
                    }
                }
                _ => {
                    if !self.swap_state(IDLE, USED) {
                        continue;
                    }
                    let Ok(runtime) = tokio::runtime::Handle::try_current() else {
                        self.state.store(IDLE, Ordering::Relaxed);
                        return;
                    };
                    runtime.spawn(keep_due(Running(Arc::downgrade(self))));
                    #[cfg(test)]
                    self.starts.fetch_add(1, Ordering::Relaxed);
                    return;
                }
            }
        }
    }

    fn swap_state(&self, from: u8, to: u8) -> bool {
        self.state
            .compare_exchange(from, to, Ordering::Relaxed, Ordering::Relaxed)
            .is_ok()
    }

    #[cfg(test)]
    pub(crate) fn is_running(&self) -> bool {
        self.state.load(Ordering::Relaxed) != IDLE
    }

    #[cfg(test)]
    fn starts(&self) -> usize {
        self.starts.load(Ordering::Relaxed)
    }
}

/// The anchor's task, however it ends: returned, dropped with its runtime, or its coordinator
/// gone. Marks the anchor idle when dropped, so that a later call starts a task again (and a
/// runtime shut down under a running task does not leave the anchor marked as running).
struct Running(Weak<WakeAnchor>);

impl Drop for Running {
    fn drop(&mut self) {
        if let Some(anchor) = self.0.upgrade() {
            anchor.state.store(IDLE, Ordering::Relaxed);
        }
    }
}

async fn keep_due(running: Running) {
    loop {
        tokio::time::sleep(PERIOD).await;
        let Some(anchor) = running.0.upgrade() else {
            return;
        };
        // Used since the last firing: keep a timer due. Unused for a whole period: stop (the
        // drop of `running` marks it idle); a call racing this finds it idle and starts another.
        if !anchor.swap_state(USED, RUNNING) {
            return;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    async fn settle() {
        for _ in 0..10 {
            tokio::task::yield_now().await;
        }
    }

    fn alive_tasks() -> usize {
        tokio::runtime::Handle::current().metrics().num_alive_tasks()
    }

    #[tokio::test(start_paused = true)]
    async fn runs_while_calls_come_and_stops_a_period_after_the_last() {
        let anchor = Arc::new(WakeAnchor::default());
        assert!(!anchor.is_running());
        anchor.touch();
        settle().await;
        assert_eq!((anchor.starts(), alive_tasks()), (1, 1));
        // Calls at 0.3, 0.6, … 1.8 periods; the task's timer fires at 1, 2, 3.
        for _ in 0..6 {
            tokio::time::sleep(PERIOD * 3 / 10).await;
            anchor.touch();
        }
        settle().await;
        assert_eq!(
            (anchor.starts(), alive_tasks()),
            (1, 1),
            "one task the whole time"
        );
        // At 2 it finds the calls made since 1, and goes on.
        tokio::time::sleep(PERIOD * 4 / 10).await;
        settle().await;
        assert!(anchor.is_running(), "calls came in the last period");
        assert_eq!(alive_tasks(), 1);
        // At 3 it finds none since 2, and stops.
        tokio::time::sleep(PERIOD).await;
        settle().await;
        assert!(!anchor.is_running(), "no call for a whole period");
        assert_eq!(alive_tasks(), 0);
        anchor.touch();
        settle().await;
        assert_eq!(
            (anchor.starts(), alive_tasks()),
            (2, 1),
            "a later call starts it again"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn one_task_at_a_time() {
        let anchor = Arc::new(WakeAnchor::default());
        for _ in 0..100 {
            anchor.touch();
        }
        settle().await;
        assert_eq!((anchor.starts(), alive_tasks()), (1, 1));
    }

    #[tokio::test(start_paused = true)]
    async fn ends_with_its_coordinator() {
        let anchor = Arc::new(WakeAnchor::default());
        anchor.touch();
        settle().await;
        assert_eq!(alive_tasks(), 1);
        drop(anchor);
        tokio::time::sleep(PERIOD + PERIOD / 10).await;
        settle().await;
        assert_eq!(alive_tasks(), 0);
    }

    #[test]
    fn a_runtime_shut_down_under_it_leaves_it_idle_and_a_later_runtime_starts_it_again() {
        let anchor = Arc::new(WakeAnchor::default());
        let first = tokio::runtime::Builder::new_current_thread()
            .enable_time()
            .build()
            .expect("a runtime");
        first.block_on(async { anchor.touch() });
        assert!(anchor.is_running());
        drop(first);
        assert!(!anchor.is_running(), "its task was dropped with the runtime");
        let second = tokio::runtime::Builder::new_current_thread()
            .enable_time()
            .build()
            .expect("a runtime");
        second.block_on(async {
            anchor.touch();
            settle().await;
            assert_eq!(alive_tasks(), 1);
        });
        assert_eq!(anchor.starts(), 2);
    }

    #[test]
    fn outside_a_runtime_it_does_nothing() {
        let anchor = Arc::new(WakeAnchor::default());
        anchor.touch();
        assert!(!anchor.is_running());
    }
}
