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
//!   [`Pace`]), each connection on a beat of its own (a slow ping or a slow replacement delays
//!   no other connection's pings). A ping unanswered for the *silence threshold* marks the
//!   connection silent (logged once, counted in `idempotency_connection_events_total`), tells
//!   what depends on it (a replay cache goes dark, waiters read their records), and replaces the
//!   connection (`force_reconnection`; fred opens a new one, which a load balancer routes like
//!   any new flow). The first ping answered afterwards marks it back. The pings also keep the
//!   flow from ever being idle, so an idle timeout on the way never fires.
//! - **TCP keepalive** (first probe after 10 s idle, then every 2 s, 3 probes) and, on Linux,
//!   **`TCP_USER_TIMEOUT`** (10 s): the kernel closes a socket whose data stays unacknowledged,
//!   a second line behind the heartbeat for when the process itself is starved.
//!
//! Slow is not dead. Replacing a connection makes fred send its unanswered commands again on the
//! new one, and empties every replay cache it feeds; across a fleet, a threshold that a latency
//! spike crosses is a reconnect storm. So the threshold follows the command timeout: by default
//! it is the command timeout plus [`SILENCE_MARGIN`] (3 s with the default 2 s), so a spike that
//! the store's own commands survive never replaces a connection
//! ([`with_silence_threshold`](crate::RedisStore::with_silence_threshold) sets it). And a ping
//! whose deadline this process noticed late (a pause of the process, CPU starvation: its clock
//! ran while it could not read the answer) proves nothing: it is sent once more before the
//! connection is taken for dead. A connection that answers nothing is replaced within the
//! interval plus the threshold (4 s by default), twice the threshold if this process stalled.
//!
//! On Redis Cluster a client holds a connection to every master, and a keyless `PING` goes to
//! whichever comes first, while a feed's subscriptions sit elsewhere (a `SUBSCRIBE` on the master
//! of a slot of the client's id, an `SSUBSCRIBE` on its channel's master). So a feed's client
//! (the replay cache's, the waiters') is pinged on every master's connection and answers only if
//! all do: its pulse proves the connection its subscriptions are on. The command client keeps
//! one ping: fred replaces a Cluster client whole (every master reconnected, the commands in
//! flight on all of them sent again), so one stalled master would cost every other master's
//! commands a reconnect at each beat while it stalls; a dead flow to one master is closed by
//! `TCP_USER_TIMEOUT` instead.
//!
//! A client its owner handed to [`RedisStore::new`](crate::RedisStore::new) or
//! [`from_pool`](crate::RedisStore::from_pool) also carries the owner's commands (an `INCR`, a
//! `BLPOP`), which fred would send again on the new connection: such a client is replaced only
//! when fred would re-send nothing (no reconnect policy, or `max_command_attempts` at most 1);
//! otherwise its silence is reported and the kernel's `TCP_USER_TIMEOUT` (with
//! [`RedisStore::configure_liveness`](crate::RedisStore::configure_liveness)) closes it.
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
/// The store's command timeout unless it says otherwise, which the silence threshold follows.
pub(crate) const DEFAULT_COMMAND_TIMEOUT: Duration = Duration::from_secs(2);
/// How much longer than the command timeout a ping may go unanswered, by default, before its
/// connection is taken for dead: a spike the commands survive (their answers come within the
/// command timeout) leaves the pings this much to spare for their own way and a late beat.
pub(crate) const SILENCE_MARGIN: Duration = Duration::from_secs(1);
/// How long a subscription may go unanswered before it is tried again (a replay cache's feed
/// resubscribing on a new connection).
pub(crate) const SUBSCRIBE_TIMEOUT: Duration = Duration::from_secs(2);
/// How much later than its deadline an unanswered ping may be noticed before the lateness is
/// taken for a stall of this process rather than silence of the connection (timers of a busy
/// but running process fire within a few milliseconds).
const STALL_SLACK: Duration = Duration::from_millis(200);
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

/// How often a store's heartbeats ping, and how long a ping may go unanswered: shared by all of
/// them and read at every beat, so a change reaches the heartbeats already running.
#[derive(Debug)]
pub(crate) struct Pace {
    /// Milliseconds between pings; 0: no pings.
    interval_ms: AtomicU64,
    /// The store's command timeout, in milliseconds, which the default threshold follows.
    command_timeout_ms: AtomicU64,
    /// The silence threshold the store set, in milliseconds; 0: the command timeout plus
    /// [`SILENCE_MARGIN`].
    threshold_ms: AtomicU64,
}

impl Default for Pace {
    fn default() -> Self {
        Self {
            interval_ms: AtomicU64::new(millis(DEFAULT_INTERVAL)),
            command_timeout_ms: AtomicU64::new(millis(DEFAULT_COMMAND_TIMEOUT)),
            threshold_ms: AtomicU64::new(0),
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

    /// Follows the store's command timeout (`None`: the store sets none, so the default's).
    pub(crate) fn set_command_timeout(&self, timeout: Option<Duration>) {
        let timeout = timeout.unwrap_or(DEFAULT_COMMAND_TIMEOUT);
        self.command_timeout_ms.store(millis(timeout), Ordering::Release);
    }

    /// Sets the silence threshold (`None`: the command timeout plus [`SILENCE_MARGIN`]).
    pub(crate) fn set_threshold(&self, threshold: Option<Duration>) {
        let millis = threshold.map_or(0, |threshold| millis(threshold).max(1));
        self.threshold_ms.store(millis, Ordering::Release);
    }

    /// How long a ping may go unanswered before its connection is taken for dead.
    pub(crate) fn threshold(&self) -> Duration {
        match self.threshold_ms.load(Ordering::Acquire) {
            0 => Duration::from_millis(self.command_timeout_ms.load(Ordering::Acquire)) + SILENCE_MARGIN,
            millis => Duration::from_millis(millis),
        }
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
    /// Clients of the store's own that run commands side by side (the command client
    /// [`connect`](crate::RedisStore::connect) opens, subscribers).
    Shared(Vec<Client>),
    /// Clients their owner handed to the store ([`new`](crate::RedisStore::new),
    /// [`from_pool`](crate::RedisStore::from_pool)), which carry the owner's commands too:
    /// pinged like the others, but replaced only if fred would send none of those commands
    /// again on the new connection ([`resends`]).
    Borrowed(Vec<Client>),
    /// Clients that one call holds at a time (the durability option's): each is pinged when
    /// free, so a ping never queues behind a `WAIT` that blocks its connection.
    Exclusive(ExclusivePool),
}

impl Watched {
    fn len(&self) -> usize {
        match self {
            Watched::Shared(clients) | Watched::Borrowed(clients) => clients.len(),
            Watched::Exclusive(pool) => pool.size(),
        }
    }
}

/// Whether fred sends a command of `client`'s again on a new connection when the one it was
/// written on is replaced: it does with a reconnect policy and more than one attempt per command
/// (fred's default is 3); without a policy, or with one attempt, it fails such a command instead.
pub(super) fn resends(client: &Client) -> bool {
    client.client_reconnect_policy().is_some() && client.connection_config().max_command_attempts > 1
}

/// Warns when the heartbeat will not replace a silent connection of clients handed to the store
/// (fred would re-send their owner's commands) and nothing else closes one soon (no
/// `TCP_USER_TIMEOUT`): a connection that died without a word would stay until the kernel gives
/// up on it, about 15 minutes.
pub(super) fn warn_if_unreplaceable(clients: &[Client]) {
    let Some(client) = clients.iter().find(|client| resends(client)) else {
        return;
    };
    if client.connection_config().tcp.user_timeout.is_none() {
        tracing::warn!(
            max_command_attempts = client.connection_config().max_command_attempts,
            "this fred client re-sends unanswered commands after a reconnect, so the store will not \
             replace its connection when it goes silent (that would send your own commands twice), \
             and nothing else closes a connection that died without a word for about 15 minutes: \
             build the client with `.with_connection_config(RedisStore::configure_liveness)` (the \
             kernel then closes it within 10 s), and with `max_command_attempts = 1` to have the \
             store replace it within the heartbeat's bound"
        );
    }
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
        let silent: Arc<[AtomicBool]> = (0..watched.len()).map(|_| AtomicBool::new(false)).collect();
        let (silenced, silences) = watch::channel(0);
        let beat = Beat {
            connection,
            watched,
            pace,
            silent: silent.clone(),
            silenced,
            on_answer,
        };
        let task = tokio::spawn(beat.run());
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

/// What one heartbeat task watches, and whom it tells.
struct Beat {
    connection: Connection,
    watched: Watched,
    pace: Arc<Pace>,
    silent: Arc<[AtomicBool]>,
    silenced: watch::Sender<u64>,
    on_answer: Option<OnAnswer>,
}

impl Beat {
    /// Every watched connection on a beat of its own: a ping that takes its whole threshold, or
    /// a replacement that takes seconds, holds back no other connection's pings (with one beat
    /// for all, one slow connection left every other unproven for as long).
    async fn run(self) {
        futures_util::future::join_all((0..self.watched.len()).map(|index| self.keep(index))).await;
    }

    /// Pings the `index`th watched connection at the pace, for as long as the heartbeat runs.
    async fn keep(&self, index: usize) {
        let silent = &self.silent[index];
        let mut next = tokio::time::Instant::now();
        loop {
            tokio::time::sleep_until(next).await;
            let Some(interval) = self.pace.interval() else {
                // Off: look again in a while, in case it is turned back on.
                next += DEFAULT_INTERVAL;
                silent.store(false, Ordering::Release);
                continue;
            };
            next = tokio::time::Instant::now() + interval;
            let threshold = self.pace.threshold();
            let (mut answered, mut sent) = self.ping(index, threshold).await;
            if matches!(answered, Ping::Unanswered) && sent.elapsed() > threshold + STALL_SLACK {
                // The deadline was noticed late: this process was stalled, and the answer may be
                // waiting unread in the socket. Only a wait this process watched proves silence.
                tracing::debug!(
                    connection = self.connection.as_str(),
                    late = ?sent.elapsed().saturating_sub(threshold),
                    "a ping's deadline was noticed late (this process stalled); pinging again"
                );
                (answered, sent) = self.ping(index, threshold).await;
            }
            match answered {
                Ping::Answered => {
                    if let Some(on_answer) = &self.on_answer {
                        on_answer(sent);
                    }
                    if silent.swap(false, Ordering::AcqRel) {
                        tracing::info!(
                            connection = self.connection.as_str(),
                            event = ConnectionEvent::Restored.as_str(),
                            "a Redis connection that went silent is answering again"
                        );
                        telemetry::connection_event(self.connection, ConnectionEvent::Restored);
                    }
                }
                Ping::Failed => {} // fred knows: it is reconnecting by its policy
                Ping::Unanswered => self.silent(index, threshold).await,
            }
        }
    }

    /// Pings the `index`th connection, bounded by `threshold`: how it went, and when it was sent.
    async fn ping(&self, index: usize, threshold: Duration) -> (Ping, tokio::time::Instant) {
        match &self.watched {
            Watched::Shared(clients) | Watched::Borrowed(clients) => {
                let sent = tokio::time::Instant::now();
                (answers(&clients[index], threshold, self.every_node()).await, sent)
            }
            Watched::Exclusive(pool) => {
                let client = pool.clients()[index].lock().await;
                // From when it holds the connection: waiting for a call to finish is not silence.
                let sent = tokio::time::Instant::now();
                (answers(&client, threshold, self.every_node()).await, sent)
            }
        }
    }

    /// Whether each of a Cluster client's connections is pinged: a feed's (the replay cache's
    /// subscriber, the waiters'), whose subscriptions can be on any master, and whose pulse
    /// must prove each of them. The command client keeps one ping: fred replaces a Cluster
    /// client whole, so one stalled master would cost every other master's commands a
    /// reconnect (and their re-sending) while it stalls (a dead flow to one master is closed by
    /// `TCP_USER_TIMEOUT` instead).
    fn every_node(&self) -> bool {
        matches!(self.connection, Connection::ReplayCache | Connection::Notices)
    }

    /// The `index`th connection answered no ping for `threshold`: says so, and replaces it
    /// unless that would send its owner's commands again.
    async fn silent(&self, index: usize, threshold: Duration) {
        let client = match &self.watched {
            Watched::Shared(clients) | Watched::Borrowed(clients) => clients[index].clone(),
            Watched::Exclusive(pool) => pool.clients()[index].lock().await.clone(),
        };
        let replaceable = !matches!(self.watched, Watched::Borrowed(_)) || !resends(&client);
        if !self.silent[index].swap(true, Ordering::AcqRel) {
            let why = match replaceable {
                true => {
                    "a Redis connection answered no PING in time; taking it for dead and opening a new one"
                }
                false => {
                    "a Redis connection of a client handed to the store answered no PING in time; not \
                     replacing it, since fred would send the owner's unanswered commands again on a new \
                     one (a reconnect policy and max_command_attempts > 1); the kernel closes it \
                     (within 10 s with RedisStore::configure_liveness)"
                }
            };
            tracing::warn!(
                connection = self.connection.as_str(),
                event = ConnectionEvent::Silent.as_str(),
                ?threshold,
                "{why}"
            );
            telemetry::connection_event(self.connection, ConnectionEvent::Silent);
        }
        self.silenced.send_modify(|count| *count += 1);
        if replaceable {
            replace(&client).await;
        }
    }
}

/// A ping's answer, from the best to the worst.
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Ping {
    Answered,
    /// Refused at once: the client knows its connection is down (and is reconnecting).
    Failed,
    /// No answer within the threshold: the connection may be dead without anyone knowing.
    Unanswered,
}

/// Pings `client` within `threshold`. A Cluster client holds a connection to every master, and
/// what a feed carries is spread over them (a `SUBSCRIBE` goes to the master of a slot of the
/// client's id, an `SSUBSCRIBE` to its channel's master), while a keyless `PING` goes to
/// whichever connection comes first: with `every_node`, every connection is pinged, and the
/// client answers only if all do.
async fn answers(client: &Client, threshold: Duration, every_node: bool) -> Ping {
    let options = Options {
        timeout: Some(threshold),
        max_attempts: Some(1),
        ..Options::default()
    };
    let masters = match every_node && client.is_clustered() {
        true => client.active_connections(),
        false => Vec::new(),
    };
    if masters.is_empty() {
        return ping(client, &options).await;
    }
    let pings = masters.into_iter().map(|master| {
        let options = Options {
            cluster_node: Some(master),
            ..options.clone()
        };
        async move { ping(client, &options).await }
    });
    let answers = futures_util::future::join_all(pings).await;
    // The worst answer speaks for the client: one silent master is a silent feed.
    answers.into_iter().max().unwrap_or(Ping::Answered)
}

async fn ping(client: &Client, options: &Options) -> Ping {
    // `Value`: on a subscribed RESP2 connection the answer is `["pong", ""]`, not `PONG`.
    match client.with_options(options).ping::<Value>(None).await {
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
