//! Noticing a Redis connection that died without a word, and replacing it: the one place that
//! sets how every connection of a `RedisStore` is kept alive.
//!
//! A flow can die with no FIN or RST: a cloud load balancer's idle timeout (AWS NLB 350 s, Azure
//! LB 4 min), a NAT or conntrack flush, a partition, a host that crashed. fred notices nothing
//! by itself then: a command times out, the connection stays, and the next command waits on it
//! too, until the kernel gives up on the socket (about 15 minutes with Linux's `tcp_retries2`).
//! fred's own unresponsive check does not help under load: it measures from the *latest* write,
//! so a steady stream of commands keeps a dead connection looking fresh. And an idle subscriber
//! (pub/sub, Sentinel events) is never told at all.
//!
//! So every connection the store uses gets:
//!
//! - a **heartbeat**: a `PING` every [`DEFAULT_INTERVAL`] (the store's
//!   [`with_heartbeat`](crate::RedisStore::with_heartbeat), shared by all its heartbeats as a
//!   [`Pace`]), bounded by [`HEARTBEAT_TIMEOUT`].
//!   A ping unanswered in time marks the connection silent (logged once, counted in
//!   `idempotency_connection_events_total`), tells what depends on it (a replay cache goes dark,
//!   waiters read their records), and replaces the connection (`force_reconnection`; fred
//!   opens a new one, which a load balancer routes like any new flow). The first ping answered
//!   afterwards marks it back. The pings also keep the flow from ever being idle, so an idle
//!   timeout on the way never fires. This is the bound on unanswered commands: a connection
//!   that answers nothing for [`HEARTBEAT_TIMEOUT`] is replaced within the interval plus
//!   [`HEARTBEAT_TIMEOUT`] (3 s by default).
//! - **TCP keepalive** (first probe after 10 s idle, then every 2 s, 3 probes) and, on Linux,
//!   **`TCP_USER_TIMEOUT`** (10 s): the kernel closes a socket whose data stays unacknowledged,
//!   a second line behind the heartbeat for when the process itself is starved.
//!
//! The TCP settings are options of a fred client's `ConnectionConfig`, fixed when the client is
//! built: [`configure`] applies them to the clients the store builds, and to a client handed to
//! [`RedisStore::new`](crate::RedisStore::new) only if its owner built it with
//! [`RedisStore::configure_liveness`](crate::RedisStore::configure_liveness). The heartbeat runs
//! on every client, the owner's included.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use fred::clients::{Client, ExclusivePool};
use fred::interfaces::ClientLike;
use fred::socket2::TcpKeepalive;
use fred::types::config::{ConnectionConfig, Options};
use fred::types::Value;
use tokio::sync::watch;
use tokio::task::JoinHandle;

use crate::telemetry::{self, Connection, ConnectionEvent};

/// How often each connection is pinged, unless the store says otherwise.
pub(crate) const DEFAULT_INTERVAL: Duration = Duration::from_secs(1);
/// How long a ping may go unanswered before its connection is taken for dead and replaced.
pub(crate) const HEARTBEAT_TIMEOUT: Duration = Duration::from_secs(2);
/// How long a reconnection may take before the heartbeat goes on pinging (and tries again).
const RECONNECT_TIMEOUT: Duration = Duration::from_secs(5);

const KEEPALIVE_IDLE: Duration = Duration::from_secs(10);
const KEEPALIVE_INTERVAL: Duration = Duration::from_secs(2);
#[cfg(any(
    target_os = "android",
    target_os = "fuchsia",
    target_os = "linux",
    target_os = "macos"
))]
const KEEPALIVE_RETRIES: u32 = 3;
#[cfg(any(target_os = "android", target_os = "fuchsia", target_os = "linux"))]
const USER_TIMEOUT: Duration = Duration::from_secs(10);

/// Sets TCP keepalive and (on Linux) `TCP_USER_TIMEOUT` on `connection`.
pub(crate) fn configure(connection: &mut ConnectionConfig) {
    // The heartbeat keeps a connection from idling, so these probes matter only when the
    // heartbeat itself is stalled.
    let keepalive = TcpKeepalive::new()
        .with_time(KEEPALIVE_IDLE)
        .with_interval(KEEPALIVE_INTERVAL);
    #[cfg(any(
        target_os = "android",
        target_os = "fuchsia",
        target_os = "linux",
        target_os = "macos"
    ))]
    let keepalive = keepalive.with_retries(KEEPALIVE_RETRIES);
    connection.tcp.keepalive = Some(keepalive);
    #[cfg(any(target_os = "android", target_os = "fuchsia", target_os = "linux"))]
    {
        connection.tcp.user_timeout = Some(USER_TIMEOUT);
    }
}

/// `base`'s connection settings with the liveness settings applied: for every client the store
/// builds beside `base`.
pub(super) fn connection_config(base: &Client) -> ConnectionConfig {
    let mut connection = base.connection_config().clone();
    configure(&mut connection);
    connection
}

/// How often a store's heartbeats ping, shared by all of them and read at every beat, so a
/// change reaches the heartbeats already running.
#[derive(Debug)]
pub(crate) struct Pace {
    /// Milliseconds between pings; 0: no pings.
    interval_ms: AtomicU64,
}

impl Default for Pace {
    fn default() -> Self {
        Self {
            interval_ms: AtomicU64::new(millis(DEFAULT_INTERVAL)),
        }
    }
}

impl Pace {
    /// The interval between pings (`None`: no pings).
    pub(crate) fn interval(&self) -> Option<Duration> {
        match self.interval_ms.load(Ordering::Acquire) {
            0 => None,
            millis => Some(Duration::from_millis(millis)),
        }
    }

    pub(crate) fn set(&self, interval: Option<Duration>) {
        let millis = interval.map_or(0, |interval| millis(interval).max(1));
        self.interval_ms.store(millis, Ordering::Release);
    }

    /// How old a feed's latest answered ping may be while what it feeds is trusted: the
    /// interval, plus a second for the ping's own way and a late beat (`None`: no pings, so no
    /// bound can be kept).
    pub(crate) fn pulse_bound(&self) -> Option<Duration> {
        self.interval().map(|interval| interval + Duration::from_secs(1))
    }
}

fn millis(duration: Duration) -> u64 {
    u64::try_from(duration.as_millis()).unwrap_or(u64::MAX)
}

/// The clients one heartbeat watches.
pub(super) enum Watched {
    /// Clients that run commands side by side (the command client or pool, subscribers).
    Shared(Vec<Client>),
    /// Clients that one call holds at a time (the durability option's): each is pinged when
    /// free, so a ping never queues behind a `WAIT` that blocks its connection.
    Exclusive(ExclusivePool),
}

/// Told when each answered ping was sent: every message published before then has been
/// delivered on that connection (a connection answers in order).
pub(super) type OnAnswer = Arc<dyn Fn(tokio::time::Instant) + Send + Sync>;

/// A running heartbeat; stops when dropped.
pub(super) struct Heartbeat {
    task: JoinHandle<()>,
    silences: watch::Receiver<u64>,
    silent: Arc<[AtomicBool]>,
}

impl Drop for Heartbeat {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl Heartbeat {
    /// Starts pinging `watched` at `pace`, counted and logged as `connection`.
    pub(super) fn start(connection: Connection, watched: Watched, pace: Arc<Pace>) -> Self {
        Self::start_with(connection, watched, pace, None)
    }

    /// [`start`](Self::start), calling `on_answer` with the time each answered ping was sent.
    pub(super) fn start_with(
        connection: Connection,
        watched: Watched,
        pace: Arc<Pace>,
        on_answer: Option<OnAnswer>,
    ) -> Self {
        let count = match &watched {
            Watched::Shared(clients) => clients.len(),
            Watched::Exclusive(pool) => pool.size(),
        };
        let silent: Arc<[AtomicBool]> = (0..count).map(|_| AtomicBool::new(false)).collect();
        let (silenced, silences) = watch::channel(0);
        let task = tokio::spawn(beat(
            connection,
            watched,
            pace,
            silent.clone(),
            silenced,
            on_answer,
        ));
        Self {
            task,
            silences,
            silent,
        }
    }

    /// Changes each time one of the watched connections goes silent.
    pub(super) fn silences(&self) -> watch::Receiver<u64> {
        self.silences.clone()
    }

    /// Whether the `index`th watched client's latest ping went unanswered.
    pub(super) fn is_silent(&self, index: usize) -> bool {
        self.silent
            .get(index)
            .is_some_and(|silent| silent.load(Ordering::Acquire))
    }
}

async fn beat(
    connection: Connection,
    watched: Watched,
    pace: Arc<Pace>,
    silent: Arc<[AtomicBool]>,
    silenced: watch::Sender<u64>,
    on_answer: Option<OnAnswer>,
) {
    let mut next = tokio::time::Instant::now();
    loop {
        tokio::time::sleep_until(next).await;
        let Some(interval) = pace.interval() else {
            // Off: look again in a while, in case it is turned back on.
            next += DEFAULT_INTERVAL;
            silent
                .iter()
                .for_each(|silent| silent.store(false, Ordering::Release));
            continue;
        };
        next = tokio::time::Instant::now() + interval;
        let checks = (0..silent.len()).map(|index| {
            let (watched, silent, silenced, on_answer) = (&watched, &silent[index], &silenced, &on_answer);
            async move {
                let sent = tokio::time::Instant::now();
                let answered = match watched {
                    Watched::Shared(clients) => answers(&clients[index]).await,
                    Watched::Exclusive(pool) => {
                        let client = pool.clients()[index].lock().await;
                        answers(&client).await
                    }
                };
                match answered {
                    Ping::Answered => {
                        if let Some(on_answer) = on_answer {
                            on_answer(sent);
                        }
                        if silent.swap(false, Ordering::AcqRel) {
                            tracing::info!(
                                connection = connection.as_str(),
                                event = ConnectionEvent::Restored.as_str(),
                                "a Redis connection that went silent is answering again"
                            );
                            telemetry::connection_event(connection, ConnectionEvent::Restored);
                        }
                    }
                    Ping::Failed => {} // fred knows: it is reconnecting by its policy
                    Ping::Unanswered => {
                        if !silent.swap(true, Ordering::AcqRel) {
                            tracing::warn!(
                                connection = connection.as_str(),
                                event = ConnectionEvent::Silent.as_str(),
                                timeout = ?HEARTBEAT_TIMEOUT,
                                "a Redis connection answered no PING in time; taking it for dead and \
                                 opening a new one"
                            );
                            telemetry::connection_event(connection, ConnectionEvent::Silent);
                        }
                        silenced.send_modify(|count| *count += 1);
                        let client = match watched {
                            Watched::Shared(clients) => clients[index].clone(),
                            Watched::Exclusive(pool) => pool.clients()[index].lock().await.clone(),
                        };
                        replace(&client).await;
                    }
                }
            }
        });
        futures_util::future::join_all(checks).await;
    }
}

enum Ping {
    Answered,
    /// Refused at once: the client knows its connection is down (and is reconnecting).
    Failed,
    /// No answer within the timeout: the connection may be dead without anyone knowing.
    Unanswered,
}

async fn answers(client: &Client) -> Ping {
    let pinging = client.with_options(&Options {
        timeout: Some(HEARTBEAT_TIMEOUT),
        max_attempts: Some(1),
        ..Options::default()
    });
    // `Value`: on a subscribed RESP2 connection the answer is `["pong", ""]`, not `PONG`.
    match pinging.ping::<Value>(None).await {
        Ok(_) => Ping::Answered,
        Err(error) if *error.kind() == fred::error::ErrorKind::Timeout => Ping::Unanswered,
        Err(_) => Ping::Failed,
    }
}

/// Drops `client`'s connection and opens a new one.
async fn replace(client: &Client) {
    if client.client_reconnect_policy().is_none() {
        // Without a policy fred does not reconnect: a new connection task retires the old one.
        let _connection_task = client.connect();
        return;
    }
    match tokio::time::timeout(RECONNECT_TIMEOUT, client.force_reconnection()).await {
        Ok(Ok(())) => {}
        Ok(Err(error)) => {
            tracing::debug!(%error, "reconnecting a silent Redis connection failed; the reconnect policy retries")
        }
        Err(_) => {
            tracing::debug!("reconnecting a silent Redis connection takes long; the heartbeat tries again")
        }
    }
}
