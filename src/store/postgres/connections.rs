//! The connections the PostgreSQL store runs its statements on: taken from its pool, and held
//! for up to [`HOLD`] between statements.
//!
//! sqlx's pool tests every connection given back to it with a round trip of its own (a `Sync`,
//! answered by `ReadyForQuery`) before another caller may take it. For a store whose every
//! transition is one short statement, that doubles the round trips, the socket writes, and the
//! wake-ups of the database's backend process. So a connection whose statement succeeded is held
//! here for the store's next statement instead, and goes back to the pool once [`HOLD`] has
//! passed since the store took it: at the end of a statement, or from a task that gives back the
//! ones left unused. The pool's other users (a handler's own transaction) so wait at most about
//! [`HOLD`] for a connection the store holds, and the pool's own limits (`max_lifetime`,
//! `idle_timeout`) still apply to every connection.
//!
//! sqlx's release test has no bound: given a connection to a peer that went silent, it would hold
//! one of the pool's permits for as long as the kernel keeps retrying (many minutes). So this
//! store never hands the pool a connection it has not just seen answer:
//! - one given back after its [`HOLD`], or after an error or a statement dropped mid-way (its
//!   caller gave up), is tested here first, within the store's timeout, and closed if it does not
//!   answer;
//! - one whose statement reached the store's timeout is closed at once.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError, Weak};
use std::time::Duration;

use sqlx::pool::PoolConnection;
use sqlx::postgres::{PgConnection, PgPool};
use sqlx::{Connection, Postgres};
use tokio::sync::Notify;
use tokio::time::Instant;

use crate::sync::lock;

/// How long the store holds a connection it took from the pool before giving it back.
pub(super) const HOLD: Duration = Duration::from_millis(100);

/// The pool and the connections the store holds, shared by the store's clones.
#[derive(Clone)]
pub(super) struct Connections {
    pool: PgPool,
    held: Arc<Held>,
}

struct Held {
    /// Unused for now, newest last: a statement takes the one used most recently. Taken with
    /// `sync::lock`: nothing that runs under it can panic halfway through a change.
    idle: Mutex<Vec<Idle>>,
    /// Told when a connection is put in `idle`, for statements waiting on the pool.
    returned: Notify,
    /// A task that gives back the connections past their [`HOLD`] is running.
    returning: AtomicBool,
    /// The pool's `max_connections`.
    max_connections: u32,
    /// What a connection is tested within before it goes back to the pool.
    checks: Checks,
}

/// How a connection leaving this store is tested or closed.
#[derive(Clone, Copy)]
struct Checks {
    /// The store's command timeout.
    within: Duration,
    /// The pool has `min_connections`: sqlx then starts a task for each connection that leaves
    /// it, which it cannot do outside a runtime.
    replaces_closed: bool,
}

struct Idle {
    connection: PoolConnection<Postgres>,
    /// When the store took it from the pool.
    taken: Instant,
}

impl Connections {
    /// Connections from `pool`, tested within `within` before they go back to it.
    pub(super) fn new(pool: PgPool, within: Duration) -> Self {
        let checks = Checks {
            within,
            replaces_closed: pool.options().get_min_connections() > 0,
        };
        Self {
            held: Arc::new(Held {
                idle: Mutex::new(Vec::new()),
                returned: Notify::new(),
                returning: AtomicBool::new(false),
                max_connections: pool.options().get_max_connections(),
                checks,
            }),
            pool,
        }
    }

    pub(super) fn pool(&self) -> &PgPool {
        &self.pool
    }

    /// A loan for one statement: [`Lent::connection`] fills it.
    pub(super) fn lend(&self) -> Lent<'_> {
        Lent {
            connections: self,
            connection: None,
        }
    }

    /// The connection used most recently, or one from the pool; while the pool has none to
    /// give, also the first one a statement of this store is done with.
    async fn take(&self) -> Result<Idle, sqlx::Error> {
        if let Some(idle) = self.held.take_idle(&self.pool) {
            return Ok(idle);
        }
        if self.pool.size() < self.held.max_connections {
            // The pool can open one: wait for it, for a connection given up on while it opens
            // is closed (and opening one is the database's most costly work).
            let connection = self.pool.acquire().await?;
            return Ok(Idle {
                connection,
                taken: Instant::now(),
            });
        }
        // Every connection is out: the first one given back, to the pool or to this store.
        // Leaving the pool's queue costs nothing.
        let acquiring = self.pool.acquire();
        tokio::pin!(acquiring);
        loop {
            let returned = self.held.returned.notified();
            tokio::pin!(returned);
            // Registered before the check below, so a connection put back in between wakes it.
            returned.as_mut().enable();
            if let Some(idle) = self.held.take_idle(&self.pool) {
                return Ok(idle);
            }
            tokio::select! {
                biased;
                acquired = &mut acquiring => {
                    return Ok(Idle { connection: acquired?, taken: Instant::now() });
                }
                () = &mut returned => {}
            }
        }
    }

    /// Holds `idle` for the next statement, or gives it back if its [`HOLD`] is over.
    fn keep(&self, idle: Idle) {
        if self.pool.is_closed() {
            return; // dropped: the closed pool closes it
        }
        if idle.taken.elapsed() >= HOLD {
            return give_back(idle.connection, self.held.checks);
        }
        lock(&self.held.idle).push(idle);
        self.held.returned.notify_one();
        if !self.held.returning.swap(true, Ordering::AcqRel) {
            tokio::spawn(give_back_when_held_too_long(Arc::downgrade(&self.held)));
        }
    }
}

impl Held {
    fn take_idle(&self, pool: &PgPool) -> Option<Idle> {
        if pool.is_closed() {
            return None;
        }
        lock(&self.idle).pop()
    }

    /// Takes out the connections past their [`HOLD`], and says when the next one will be.
    fn past_hold(&self, now: Instant) -> (Vec<Idle>, Option<Instant>) {
        let mut idle = lock(&self.idle);
        let (past, kept) = std::mem::take(&mut *idle)
            .into_iter()
            .partition(|held| held.taken + HOLD <= now);
        *idle = kept;
        let next = idle.iter().map(|kept| kept.taken + HOLD).min();
        (past, next)
    }
}

/// Gives back each held connection once its [`HOLD`] is over; ends when the store holds none,
/// or is dropped.
async fn give_back_when_held_too_long(held: Weak<Held>) {
    loop {
        let Some(strong) = held.upgrade() else {
            return;
        };
        let (past, next) = strong.past_hold(Instant::now());
        for idle in past {
            give_back(idle.connection, strong.checks);
        }
        match next {
            Some(next) => {
                drop(strong);
                tokio::time::sleep_until(next).await;
            }
            None => {
                strong.returning.store(false, Ordering::Release);
                // A connection held between the check and the store above started no task.
                if lock(&strong.idle).is_empty() || strong.returning.swap(true, Ordering::AcqRel) {
                    return;
                }
            }
        }
    }
}

/// Gives `connection` back to the pool if it answers a test within the store's timeout, and
/// closes it if not.
fn give_back(connection: PoolConnection<Postgres>, checks: Checks) {
    let Ok(runtime) = tokio::runtime::Handle::try_current() else {
        return close_now(connection, checks);
    };
    runtime.spawn(async move {
        let mut connection = connection;
        match tokio::time::timeout(checks.within, connection.ping()).await {
            Ok(Ok(())) => drop(connection), // to the pool, which tests it once more
            Ok(Err(_)) | Err(_) => close_now(connection, checks),
        }
    });
}

/// Closes `connection` without a word to the server, and frees its place in the pool at once.
fn close_now(connection: PoolConnection<Postgres>, checks: Checks) {
    if checks.replaces_closed && tokio::runtime::Handle::try_current().is_err() {
        // The pool would start a task to replace it, and panic with no runtime to start it on.
        // That is only a store dropped after its runtime: the process is ending.
        std::mem::forget(connection);
        return;
    }
    // `detach` frees the pool's permit and count; the connection's socket closes as it drops.
    drop(connection.detach());
}

impl Drop for Held {
    fn drop(&mut self) {
        let idle = std::mem::take(self.idle.get_mut().unwrap_or_else(PoisonError::into_inner));
        for kept in idle {
            give_back(kept.connection, self.checks);
        }
    }
}

/// One statement's connection. Held for the next statement after [`done`](Lent::done), closed
/// after [`timed_out`](Lent::timed_out), and tested when dropped otherwise (after an error, or
/// mid-statement): held if it answers, closed if not.
pub(super) struct Lent<'a> {
    connections: &'a Connections,
    connection: Option<Idle>,
}

impl Lent<'_> {
    /// The connection for this statement.
    pub(super) async fn connection(&mut self) -> Result<&mut PgConnection, sqlx::Error> {
        let idle = match &mut self.connection {
            Some(idle) => idle,
            empty => empty.insert(self.connections.take().await?),
        };
        Ok(&mut *idle.connection)
    }

    /// The statement succeeded: hold its connection.
    pub(super) fn done(mut self) {
        if let Some(idle) = self.connection.take() {
            self.connections.keep(idle);
        }
    }

    /// The statement timed out: close its connection.
    pub(super) fn timed_out(mut self) {
        if let Some(idle) = self.connection.take() {
            close_now(idle.connection, self.connections.held.checks);
        }
    }
}

impl Drop for Lent<'_> {
    /// After an error or mid-statement: the connection may be broken, or still have the
    /// statement's answer coming, which a test reads to its end.
    fn drop(&mut self) {
        let Some(mut idle) = self.connection.take() else {
            return;
        };
        let checks = self.connections.held.checks;
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return close_now(idle.connection, checks);
        };
        let connections = self.connections.clone();
        runtime.spawn(async move {
            match tokio::time::timeout(checks.within, idle.connection.ping()).await {
                Ok(Ok(())) => connections.keep(idle),
                Ok(Err(_)) | Err(_) => close_now(idle.connection, checks),
            }
        });
    }
}
