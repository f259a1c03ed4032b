//! The shared store: Redis (standalone, with replicas, or Cluster) through `fred`: the
//! [`RedisStore`] type, how it is built and configured.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use fred::clients::{Client, Pool};
use fred::interfaces::{ClientLike, LuaInterface, PubsubInterface};
use fred::types::config::{Config, ConnectionConfig, Options};
use fred::types::Builder;

use super::cache_feed::PurgeFeed;
use super::coalesce::Coalescer;
use super::connection::{
    asks_for_tls, from_fred, revive, store_reconnect_policy, unavailable, warn_if_records_can_be_evicted,
    Connection, Quit,
};
use super::liveness::{self, Heartbeat, Pace, Watched};
use super::notices::Notices;
use super::replica_acks::{ReplicaAcks, Waiter};
use super::scripts::{COMPLETE, INSPECT, PURGE, RELEASE, RENEW};
use super::sentinel::{self, Fence, SwitchWatch};
use crate::key::RecordKey;
use crate::replay_cache::ReplayCache;
use crate::store::error::{FailingOver, SentinelsUnheard, StoreError};
use crate::telemetry::Connection as Role;

pub(super) const DEFAULT_PREFIX: &str = "idempotency";
pub(super) const DEFAULT_COMMAND_TIMEOUT: Duration = liveness::DEFAULT_COMMAND_TIMEOUT;

/// A [`Store`](crate::Store) in Redis: one string key per record, every transition one round trip.
///
/// The claim, the one call every request makes, is a native command (`SET key <record> NX PX
/// <lease> GET`): it creates the in-flight record or hands back what is there, with no script to
/// run or reload. The owner-checked transitions (complete, release, renew) are Lua scripts
/// (EVALSHA, reloaded by EVAL when the server answers NOSCRIPT after a restart, a failover or
/// `SCRIPT FLUSH`).
/// Calls made while others are outstanding (concurrent requests) are handed to fred together, so
/// they share socket writes, and completions made together are one script call (not on a
/// Cluster); a lone call is sent at once.
///
/// Needs Redis 7.0 or later (`SET` with both `NX` and `GET`), standalone, with replicas, or as a
/// Cluster: a record is a single key, so each call touches one slot. Every key it writes has a
/// TTL. Every command carries a timeout (default 2 s), so a command abandoned during an outage is
/// not sent late.
///
/// ```no_run
/// use tower_idempotency::{IdempotencyLayer, RedisStore};
///
/// # async fn run() -> Result<(), Box<dyn std::error::Error>> {
/// let store = RedisStore::connect("redis://127.0.0.1:6379").await?;
/// let layer = IdempotencyLayer::new(store);
/// # let _ = layer; Ok(()) }
/// ```
#[derive(Clone)]
pub struct RedisStore {
    pub(super) connection: Connection,
    pub(super) prefix: Arc<str>,
    pub(super) options: Options,
    pub(super) cache: Option<Arc<ReplayCache>>,
    /// Keeps the cache's invalidation listener running while any clone of the store lives.
    pub(super) _listener: Option<Arc<Listener>>,
    /// The client [`connect`](RedisStore::connect) opened, quit with the last store clone.
    pub(super) _own_client: Option<Arc<Quit>>,
    /// The failover watch of a Sentinel-configured store (see `sentinel`), kept running
    /// while any clone of the store lives.
    pub(super) switch_watch: Option<Arc<SwitchWatch>>,
    /// Set while a task reconnects clients that fred will not reconnect by itself.
    pub(super) reviving: Arc<AtomicBool>,
    /// The durability option: claims and completions wait for replicas on connections of their
    /// own ([`with_replica_acks`](RedisStore::with_replica_acks)).
    pub(super) acks: Option<Arc<Waiter>>,
    /// The subscriber connection of requests waiting for running ones ([`Store::watch`]),
    /// opened with the first waiter, shared by every clone.
    pub(super) notices: Arc<tokio::sync::OnceCell<Notices>>,
    /// Sends the claims, completions and other record commands, coalescing concurrent ones
    /// into one write (see `coalesce`).
    pub(super) coalescer: Arc<Coalescer>,
    /// Pings the command connection(s), replacing one that goes silent (see `liveness`);
    /// started with the store inside a runtime, else with its first claim.
    pub(super) heartbeat: Arc<OnceLock<Heartbeat>>,
    /// How often every heartbeat of the store pings ([`with_heartbeat`](RedisStore::with_heartbeat)),
    /// and how long a ping may go unanswered ([`with_silence_threshold`](RedisStore::with_silence_threshold)).
    pub(super) pace: Arc<Pace>,
    /// Whether the command client or pool is the owner's ([`new`](RedisStore::new),
    /// [`from_pool`](RedisStore::from_pool)): then it also carries the owner's commands, and the
    /// heartbeat replaces a silent connection of it only if fred would not send them again.
    pub(super) borrowed: bool,
}

/// The task that feeds a replay cache its invalidations, and its subscriber connection; both
/// stopped with the last store clone.
pub(super) struct Listener {
    task: tokio::task::JoinHandle<()>,
    _heartbeat: Heartbeat,
    _subscriber: Quit,
}

impl Drop for Listener {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl std::fmt::Debug for RedisStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedisStore")
            .field("prefix", &self.prefix)
            .field("command_timeout", &self.options.timeout)
            .field("replay_cache", &self.cache.is_some())
            .finish_non_exhaustive()
    }
}

impl RedisStore {
    /// A store over a connected (or connecting) `fred` client.
    ///
    /// The store pings the client's connection once a second. When it answers no ping for the
    /// [silence threshold](Self::with_silence_threshold) (3 s by default) the store reports it
    /// (a warning and `idempotency_connection_events_total{event="silent"}`) and replaces it,
    /// but only if fred would send none of your commands again on the new connection: a client
    /// with a reconnect policy and `max_command_attempts` above 1 (fred's default is 3) re-sends
    /// every unanswered command after a reconnect, your own `INCR` or `LPUSH` included, so such a
    /// client is never replaced by the store; build it with
    /// [`configure_liveness`](Self::configure_liveness), whose `TCP_USER_TIMEOUT` has the kernel
    /// close a connection that died without a word within about 10 s (fred then reconnects by
    /// your policy). To have the store replace it within the heartbeat's bound instead, build
    /// it with `max_command_attempts = 1`, as below. The store logs a warning when it gets a
    /// client that it will not replace and that has no `TCP_USER_TIMEOUT`.
    ///
    /// A client built without a reconnect policy (fred's default) would stay disconnected after
    /// a Redis restart; the store notices the first command that times out or fails on the
    /// connection, logs a warning, and reconnects such clients itself (checking them with PING,
    /// backoff 10 ms to 2 s). Keep the command timeout ([`with_command_timeout`](Self::with_command_timeout))
    /// at or below the layer's store timeout, so the store sees the failure.
    ///
    /// ```no_run
    /// use fred::prelude::*;
    /// use tower_idempotency::RedisStore;
    ///
    /// # async fn run() -> Result<(), fred::error::Error> {
    /// let client = Builder::from_config(Config::from_url("redis://127.0.0.1:6379")?)
    ///     .with_connection_config(|connection| {
    ///         RedisStore::configure_liveness(connection);
    ///         connection.max_command_attempts = 1;
    ///     })
    ///     .set_policy(ReconnectPolicy::new_exponential(0, 1, 2_000, 2))
    ///     .build()?;
    /// client.init().await?;
    /// let store = RedisStore::new(client);
    /// # let _ = store; Ok(()) }
    /// ```
    pub fn new(client: Client) -> Self {
        liveness::warn_if_unreplaceable(std::slice::from_ref(&client));
        Self::with_connection(Connection::Client(client), Arc::default(), true)
    }

    /// A store over a `fred` pool; each call goes to the pool's next client. Pool clients without
    /// a reconnect policy are reconnected by the store, and a silent one is replaced only if
    /// fred would send none of your commands again, as for [`new`](Self::new).
    ///
    /// ```no_run
    /// use fred::prelude::*;
    /// use tower_idempotency::RedisStore;
    ///
    /// # async fn run() -> Result<(), fred::error::Error> {
    /// let pool = Builder::from_config(Config::from_url("redis://127.0.0.1:6379")?).build_pool(4)?;
    /// pool.init().await?;
    /// let store = RedisStore::from_pool(pool);
    /// # let _ = store; Ok(()) }
    /// ```
    pub fn from_pool(pool: Pool) -> Self {
        liveness::warn_if_unreplaceable(pool.clients());
        Self::with_connection(Connection::Pool(pool), Arc::default(), true)
    }

    fn with_connection(connection: Connection, pace: Arc<Pace>, borrowed: bool) -> Self {
        let store = Self {
            connection,
            prefix: Arc::from(DEFAULT_PREFIX),
            options: Options {
                timeout: Some(DEFAULT_COMMAND_TIMEOUT),
                ..Options::default()
            },
            cache: None,
            _listener: None,
            _own_client: None,
            switch_watch: None,
            reviving: Arc::new(AtomicBool::new(false)),
            acks: None,
            notices: Arc::default(),
            coalescer: Arc::default(),
            heartbeat: Arc::default(),
            pace,
            borrowed,
        };
        if tokio::runtime::Handle::try_current().is_ok() {
            store.keep_alive();
        }
        store
    }

    /// Starts the command connection's heartbeat, once (an atomic load after that).
    pub(super) fn keep_alive(&self) {
        self.heartbeat.get_or_init(|| {
            let clients = self.connection.clients().to_vec();
            let watched = if self.borrowed {
                Watched::Borrowed(clients)
            } else {
                Watched::Shared(clients)
            };
            Heartbeat::start(Role::Commands, watched, self.pace.clone())
        });
    }

    /// Sets TCP keepalive and, on Linux, `TCP_USER_TIMEOUT` on a fred connection config: what
    /// [`connect`](Self::connect) sets on every connection it opens, for a client you build
    /// yourself and hand to [`new`](Self::new) or [`from_pool`](Self::from_pool).
    ///
    /// The store pings every connection it uses once a second, yours included, and replaces one
    /// that answers no ping within the [silence threshold](Self::with_silence_threshold); but
    /// not yours if fred would send your unanswered commands again on the new connection (see
    /// [`new`](Self::new)). These socket options are a second line the kernel keeps (a socket
    /// whose data goes unacknowledged for 10 s is closed; an idle one is probed after 10 s), the
    /// only one for a client the store does not replace, and they can only be set when the
    /// client is built.
    ///
    /// ```no_run
    /// use fred::prelude::*;
    /// use tower_idempotency::RedisStore;
    ///
    /// # async fn run() -> Result<(), fred::error::Error> {
    /// let client = Builder::from_config(Config::from_url("redis://127.0.0.1:6379")?)
    ///     .with_connection_config(RedisStore::configure_liveness)
    ///     .set_policy(ReconnectPolicy::new_exponential(0, 1, 2_000, 2))
    ///     .build()?;
    /// client.init().await?;
    /// let store = RedisStore::new(client);
    /// # let _ = store; Ok(()) }
    /// ```
    pub fn configure_liveness(connection: &mut ConnectionConfig) {
        liveness::configure(connection);
    }

    /// [`failed`](Self::failed), for a command on a record's key: one that holds another type
    /// is no failure of the store but a record it cannot read.
    pub(super) fn failed_on_record(&self, error: fred::error::Error) -> StoreError {
        if error.details().starts_with("WRONGTYPE") {
            return StoreError::Corrupt("the key holds something other than a record".into());
        }
        self.failed(error)
    }

    /// Maps a failed command to a store error. A failure may mean the connection is gone for
    /// good: a client built without a reconnect policy (fred's default, as `Builder` makes it)
    /// stays disconnected after a Redis restart, so this store reconnects it itself.
    pub(super) fn failed(&self, error: fred::error::Error) -> StoreError {
        use fred::error::ErrorKind;
        let connection_trouble = matches!(
            error.kind(),
            ErrorKind::Timeout | ErrorKind::IO | ErrorKind::Canceled
        );
        if connection_trouble {
            let orphans: Vec<Client> = (self.connection.clients().iter())
                .filter(|client| client.client_reconnect_policy().is_none())
                .cloned()
                .collect();
            if !orphans.is_empty() && !self.reviving.swap(true, Ordering::AcqRel) {
                match tokio::runtime::Handle::try_current() {
                    Ok(runtime) => {
                        tracing::warn!(
                            %error,
                            "a Redis client without a reconnect policy failed; checking and reconnecting it \
                             (give the client a ReconnectPolicy, as RedisStore::connect does, to have fred do it)"
                        );
                        runtime.spawn(revive(orphans, self.reviving.clone()));
                    }
                    Err(_) => self.reviving.store(false, Ordering::Release),
                }
            }
        }
        from_fred(error, &self.options)
    }

    /// Keeps copies of completed records in this process, up to `max_bytes`, so repeats of a key
    /// are replayed (or answered as a mismatch) with no round trip to Redis (default: off).
    ///
    /// A completed record never changes until its retention ends or it is purged, so a copy is
    /// safe to serve if it never outlives the record's retention (it does not: the record carries
    /// its deadline) and every purge reaches it. Purges go through
    /// [`purge`](crate::Store::purge) (`IdempotencyLayer::purge`, `Coordinator::purge`), which
    /// publishes the purged record on the `<prefix>:purged` channel; every store with a cache
    /// listens on it over a connection of its own and drops its copy. While that connection is
    /// down no copy is served (purges could be missed), and every copy is dropped when it is back.
    /// A record deleted by hand (`DEL`) is not seen: publish its digest on the channel too.
    ///
    /// A copy is made when a repeat is answered from Redis, so the second repeat on an instance is
    /// the first served from memory, and lives for the record's `PTTL` as read then, on this
    /// instance's clocks. The listening connection is pinged like the store's others: a copy is
    /// served only while it answered a ping sent in the last 2 s, so a purge reaches the cache
    /// within that even over a connection that died without a word. Call after
    /// [`with_prefix`](RedisStore::with_prefix), which refuses to change the prefix of a store
    /// with a cache.
    ///
    /// ```no_run
    /// # use tower_idempotency::RedisStore;
    /// # async fn run() -> Result<(), tower_idempotency::StoreError> {
    /// let store = RedisStore::connect("redis://127.0.0.1:6379")
    ///     .await?
    ///     .with_replay_cache(64 * 1024 * 1024)
    ///     .await?;
    /// # let _ = store; Ok(()) }
    /// ```
    pub async fn with_replay_cache(mut self, max_bytes: usize) -> Result<Self, StoreError> {
        // A copy is served only while the feed answered a ping sent in the last interval and a
        // second: a purge reaches it within that even if the feed's connection died without a
        // word and nobody has noticed yet.
        let cache = Arc::new(ReplayCache::new(max_bytes));
        cache.set_pulse_bound(self.pace.pulse_bound());
        // A connection of its own, with the client's settings; one that reconnects even when the
        // client was built without a reconnect policy (fred's default).
        let base = self.connection.client();
        let subscriber = Builder::from_config(base.client_config())
            .set_connection_config(liveness::connection_config(base))
            .set_performance_config(base.perf_config())
            .set_policy(
                base.client_reconnect_policy()
                    .unwrap_or_else(store_reconnect_policy),
            )
            .build()
            .map_err(unavailable)?;
        subscriber.init().await.map_err(unavailable)?;
        let channel = self.purge_channel();
        subscriber.subscribe(channel.clone()).await.map_err(unavailable)?;
        cache.set_live(true);
        let pulse: liveness::OnAnswer = {
            let cache = cache.clone();
            Arc::new(move |sent| cache.heard(sent))
        };
        let heartbeat = Heartbeat::start_with(
            Role::ReplayCache,
            Watched::Shared(vec![subscriber.clone()]),
            self.pace.clone(),
            Some(pulse),
        );
        let feed = PurgeFeed {
            subscriber: subscriber.clone(),
            channel,
            cache: cache.clone(),
            silences: heartbeat.silences(),
        };
        let task = tokio::spawn(feed.listen());
        if let Some(watch) = &self.switch_watch {
            // A purge is published on the master; after a switch the old one may be gone.
            watch.also_reconnect(vec![subscriber.clone()]);
        }
        self.cache = Some(cache);
        self._listener = Some(Arc::new(Listener {
            task,
            _heartbeat: heartbeat,
            _subscriber: Quit(subscriber),
        }));
        Ok(self)
    }

    /// The channel purges are published on, for replay caches.
    pub(super) fn purge_channel(&self) -> String {
        format!("{}:purged", self.prefix)
    }

    /// Connects to `url` (`redis://`, `rediss://`, `redis-cluster://`, `redis-sentinel://`) with
    /// settings suited to this store: reconnect forever with backoff (1 ms to 2 s), connect
    /// timeout 2 s, commands re-sent at most 3 times over a dropped connection. Logs a warning
    /// when the server's `maxmemory-policy` is not `noeviction`, under which Redis may evict a
    /// running request's record.
    ///
    /// Sentinel: `redis-sentinel://[user:]password@host:port?node=host:port&…&sentinelServiceName=NAME`
    /// lists the sentinels; the URL's credentials are the data nodes', and the sentinels' own go
    /// in `sentinelUsername` and `sentinelPassword` (none if absent). After a failover, a master
    /// that is still reachable keeps acknowledging writes until the sentinels demote it, seconds
    /// later, and then throws them away. So the store listens to every sentinel (two connections
    /// each; also to those the URL's know of, when it names fewer than there are), refuses
    /// claims from the promotion until it is confirmed on the new master, and reconnects there as
    /// soon as one announces it; a write refused with `READONLY` (a demoted master) also makes it
    /// reconnect. See the guide's Sentinel section for what it does while no sentinel is heard.
    ///
    /// TLS URLs (`rediss://`, `rediss-cluster://`, `rediss-sentinel://`) need the crate feature
    /// `tls` (on by default); the server certificate is verified against the platform's trust
    /// store, or the certificates in `SSL_CERT_FILE` when it is set. Without the feature they are
    /// refused, never connected in plain text.
    ///
    /// ```no_run
    /// use tower_idempotency::RedisStore;
    /// # async fn run() -> Result<(), tower_idempotency::StoreError> {
    /// let store = RedisStore::connect("redis://127.0.0.1:6379").await?;
    /// # let _ = store; Ok(()) }
    /// ```
    pub async fn connect(url: &str) -> Result<Self, StoreError> {
        if !cfg!(feature = "tls") && asks_for_tls(url) {
            // fred would connect in plain text, sending the password in the clear.
            return Err(StoreError::Unavailable(
                "this URL asks for TLS, but tower-idempotency was built without its `tls` feature \
                 (on by default): enable it, or use a redis:// URL"
                    .into(),
            ));
        }
        let config = Config::from_url(url).map_err(unavailable)?;
        let client = Builder::from_config(config)
            .with_connection_config(|connection| {
                connection.connection_timeout = Duration::from_secs(2);
                connection.internal_command_timeout = Duration::from_secs(2);
                connection.max_command_attempts = 3;
                liveness::configure(connection);
            })
            .with_performance_config(|performance| {
                performance.default_command_timeout = DEFAULT_COMMAND_TIMEOUT;
            })
            .set_policy(store_reconnect_policy())
            .build()
            .map_err(unavailable)?;
        client.init().await.map_err(unavailable)?;
        let own_client = Arc::new(Quit(client.clone()));
        warn_if_records_can_be_evicted(&client).await;
        let pace = Arc::new(Pace::default());
        let switch_watch = match sentinel::watch(&client, store_reconnect_policy(), pace.clone()).await {
            Ok(watch) => watch.map(Arc::new),
            Err(error) => {
                tracing::warn!(%error, "cannot listen for +switch-master on the sentinels; the store follows a failover only once the old master refuses writes (READONLY)");
                None
            }
        };
        let mut store = Self::with_connection(Connection::Client(client), pace, false);
        store.switch_watch = switch_watch;
        store._own_client = Some(own_client);
        Ok(store)
    }

    /// Prefixes every key this store writes (default: `idempotency`). Keys look like
    /// `idempotency:{<sha256 of scope and key>}`.
    ///
    /// # Panics
    ///
    /// If `prefix` contains `{` or `}`: Redis Cluster hashes a key by its first `{…}`, so such a
    /// prefix would put every record in one slot. And if the store (or the store it was cloned
    /// from) already has a [replay cache](Self::with_replay_cache): the cache holds the records of
    /// one prefix and listens for the purges of that prefix alone, so a store with another prefix
    /// must not share it (it could replay or refuse with another namespace's record).
    ///
    /// ```no_run
    /// # use tower_idempotency::RedisStore;
    /// # async fn run(client: fred::clients::Client) {
    /// let store = RedisStore::new(client).with_prefix("payments-api:idem");
    /// # }
    /// ```
    pub fn with_prefix(mut self, prefix: impl Into<String>) -> Self {
        let prefix = prefix.into();
        assert!(
            !prefix.contains(['{', '}']),
            "RedisStore::with_prefix: the prefix {prefix:?} contains a brace; Redis Cluster would \
             hash every record by the braces in the prefix, putting all of them in one slot"
        );
        assert!(
            self.cache.is_none(),
            "RedisStore::with_prefix after with_replay_cache: the cache and its purge channel belong \
             to the prefix they were made with; call with_prefix first"
        );
        self.prefix = Arc::from(prefix);
        self
    }

    /// Bounds every command this store sends (default: 2 s). `fred` drops a command that has not
    /// been answered by then, so it is not sent late after a reconnect. Keep it at or below the
    /// layer's store timeout (also 2 s by default), which waits a little longer before giving up.
    /// The heartbeat's [silence threshold](Self::with_silence_threshold) follows it (the command
    /// timeout plus 1 s, unless set), for this store, its clones and the stores made from it.
    ///
    /// ```no_run
    /// # use std::time::Duration;
    /// # use tower_idempotency::RedisStore;
    /// # async fn run(client: fred::clients::Client) {
    /// let store = RedisStore::new(client).with_command_timeout(Duration::from_millis(500));
    /// # }
    /// ```
    pub fn with_command_timeout(mut self, timeout: Duration) -> Self {
        self.options.timeout = Some(timeout);
        self.pace.set_command_timeout(Some(timeout));
        self
    }

    /// How long a heartbeat's ping may go unanswered before its connection is taken for dead
    /// and replaced (default, and `None`: the [command timeout](Self::with_command_timeout) plus
    /// 1 s, so 3 s with the default command timeout).
    ///
    /// Slow is not dead: replacing a connection makes fred send its unanswered commands again,
    /// and empties the replay cache it feeds, so across a fleet a threshold that a latency spike
    /// crosses is a reconnect storm. With the default, a spike that leaves commands answered
    /// within the command timeout replaces nothing. A ping whose deadline this process noticed
    /// late (a pause of the process, CPU starvation) is sent once more before its connection is
    /// taken for dead. A connection that answers nothing is replaced within the
    /// [interval](Self::with_heartbeat) plus the threshold (4 s by default), twice the threshold
    /// when this process stalled meanwhile. A threshold below the command timeout finds a dead
    /// connection sooner, but replaces connections that a spike only slowed.
    ///
    /// Applies to every connection of the store and its clones, those already open included.
    ///
    /// ```no_run
    /// # use std::time::Duration;
    /// # use tower_idempotency::RedisStore;
    /// # async fn run(client: fred::clients::Client) {
    /// let store = RedisStore::new(client).with_silence_threshold(Some(Duration::from_secs(5)));
    /// # }
    /// ```
    pub fn with_silence_threshold(self, threshold: Option<Duration>) -> Self {
        self.pace.set_threshold(threshold);
        self
    }

    /// How often the store pings each of its connections to find one that died without a word
    /// (default: every second; `None`: never). A connection that answers no ping within the
    /// [silence threshold](Self::with_silence_threshold) (3 s by default) is replaced, so a dead
    /// one is found within the interval plus the threshold; a replay cache serves
    /// copies only while its listening connection answered a ping sent within the interval plus
    /// a second (with no pings it cannot tell, and serves copies until a failure is seen).
    ///
    /// Each ping is one `PING` per connection: with the durability option's 32 connections and
    /// the default, about 34 commands a second per instance. Applies to every connection of
    /// the store and its clones, those already open included.
    ///
    /// ```no_run
    /// # use std::time::Duration;
    /// # use tower_idempotency::RedisStore;
    /// # async fn run(client: fred::clients::Client) {
    /// let store = RedisStore::new(client).with_heartbeat(Some(Duration::from_secs(5)));
    /// # }
    /// ```
    pub fn with_heartbeat(self, interval: Option<Duration>) -> Self {
        self.pace.set(interval);
        if let Some(cache) = &self.cache {
            cache.set_pulse_bound(self.pace.pulse_bound());
        }
        self
    }

    /// Makes claims and completions wait until `acks.replicas()` replicas have them (`WAIT`),
    /// so that a failover cannot lose them: the durability option (default: off).
    ///
    /// Redis replicates asynchronously, so a replica promoted after its master dies, or during a
    /// Sentinel failover while the old master still takes writes, can lack a claim or a
    /// completion the master acknowledged; a retry of that key then runs the operation again.
    /// With this option:
    ///
    /// - a claim is answered only once the replicas have it; if they do not acknowledge it within
    ///   the timeout, the claim is released and the request answered 503 (retry later), never run;
    /// - a completion the replicas do not acknowledge in time still returns the handler's
    ///   response, and a background task keeps completing the record, on whichever node is
    ///   master by then, until they do (for [`ReplicaAcks::retry_completions_for`]), logging an
    ///   error if it gives up or finds the claim lost. One task per claim: the completion waits
    ///   for its first attempt at most the command timeout, then answers that the result is
    ///   stored (by the task, if not yet), and a completion of a claim whose task still runs
    ///   answers so at once.
    ///
    /// `WAIT` counts the writes of its own connection and blocks it while it waits, so waiting
    /// calls run on a pool of connections of their own ([`ReplicaAcks::connections`]); every
    /// other call keeps the shared connection. Replays, 409s and mismatches do not wait. Each
    /// claim and completion costs one more round trip plus the replicas' acknowledgement.
    ///
    /// `WAIT` counts replicas that received a write, not ones that wrote it to disk; with
    /// [`ReplicaAcks::fsync`] the store waits with `WAITAOF` (Redis and Valkey 7.2 and later)
    /// until the master and the replicas have it in their append-only files. With as many
    /// replicas as required and no more, losing one stops new claims (503) until it is back. Require
    /// every replica all the same: a failover may promote any of them, and one that did not
    /// acknowledge lacks what the store counted durable (a key then runs twice); the store
    /// warns as it starts when the master has more replicas than required. Call after [`with_prefix`](RedisStore::with_prefix) and
    /// [`with_command_timeout`](RedisStore::with_command_timeout).
    ///
    /// ```no_run
    /// use tower_idempotency::{RedisStore, ReplicaAcks};
    /// # async fn run() -> Result<(), tower_idempotency::StoreError> {
    /// let store = RedisStore::connect("redis-sentinel://127.0.0.1:26379?sentinelServiceName=main")
    ///     .await?
    ///     .with_replica_acks(ReplicaAcks::new(1))
    ///     .await?;
    /// # let _ = store; Ok(()) }
    /// ```
    pub async fn with_replica_acks(mut self, acks: ReplicaAcks) -> Result<Self, StoreError> {
        let base = self.connection.client();
        let waiter = Waiter::connect(
            base,
            acks,
            &self.options,
            store_reconnect_policy(),
            self.pace.clone(),
        )
        .await?;
        if let Some(watch) = &self.switch_watch {
            watch.also_reconnect(waiter.clients().await);
        }
        self.acks = Some(waiter);
        Ok(self)
    }

    /// Loads every script on every node (`SCRIPT LOAD`), so the first requests need no reload.
    /// Optional: a missing script is loaded on first use. Like [`connect`](RedisStore::connect),
    /// it logs a warning when the server's `maxmemory-policy` is not `noeviction` (a store built
    /// with [`new`](RedisStore::new) or [`from_pool`](RedisStore::from_pool) is checked here).
    pub async fn load_scripts(&self) -> Result<(), StoreError> {
        let client = self.connection.client();
        warn_if_records_can_be_evicted(client).await;
        for script in [&*COMPLETE, &*RELEASE, &*RENEW, &*PURGE, &*INSPECT] {
            client
                .script_load_cluster::<(), _>(script.source)
                .await
                .map_err(unavailable)?;
        }
        Ok(())
    }

    /// Raised while the sentinels fail the master over (a Sentinel-configured store only).
    pub(super) fn fence(&self) -> Option<&Fence> {
        self.switch_watch.as_deref().map(|watch| &*watch.fence)
    }

    /// Refuses a claim while a Sentinel failover is under way: the old master may take it and
    /// then throw it away. In a new store's first moments, waits first until it listens to the
    /// sentinels, so that no failover's announcement goes unheard (bounded by the coordinator's
    /// store timeout, as every store call is).
    /// Answers the claim's pass for [`fence_raised_since`](Self::fence_raised_since).
    pub(super) async fn refuse_claims_during_failover(&self) -> Result<Option<u64>, StoreError> {
        let Some(fence) = self.fence() else {
            return Ok(None);
        };
        fence.until_listening().await;
        let pass = fence.mark();
        if fence.is_raised() {
            Err(StoreError::Unavailable(Box::new(FailingOver)))
        } else if fence.is_blind() {
            Err(StoreError::Unavailable(Box::new(SentinelsUnheard)))
        } else {
            Ok(Some(pass))
        }
    }

    /// [`after_failover`](Self::after_failover), answering a pass for the write about to go out.
    pub(super) async fn fence_pass(&self) -> Option<u64> {
        Some(self.fence()?.pass().await)
    }

    /// What a claim answered after a failover began fails with (see
    /// [`fence_raised_since`](Self::fence_raised_since)): 503, as at the fence, and the
    /// coordinator releases it once the failover is over.
    pub(super) fn failover_began(&self, key: &RecordKey) -> StoreError {
        tracing::info!(
            ?key,
            "a failover began while a claim was on its way; refusing it (503)"
        );
        StoreError::Unavailable(Box::new(FailingOver))
    }

    /// Whether a failover began (the fence was raised) since a write got its `pass`: then the
    /// write, answered, may have landed on the old master after the promotion, acknowledged
    /// there by a replica not yet reconfigured, and be lost with its demotion (see
    /// `Fence::raised_since`).
    pub(super) fn fence_raised_since(&self, pass: Option<u64>) -> bool {
        matches!((self.fence(), pass), (Some(fence), Some(pass)) if fence.raised_since(pass))
    }

    /// Holds an owner's write (complete, release, renew) while a Sentinel failover is under way,
    /// so that it goes to the new master.
    pub(super) async fn after_failover(&self) {
        if let Some(fence) = self.fence() {
            fence.until_lowered().await;
        }
    }

    /// The Redis key of a record.
    pub fn redis_key(&self, key: &RecordKey) -> String {
        // Built at its exact length: fred then takes the buffer as it is, with no copy.
        let mut name = String::with_capacity(self.prefix.len() + 3 + 64);
        name.push_str(&self.prefix);
        name.push_str(":{");
        crate::key::push_hex(&mut name, key.digest());
        name.push('}');
        name
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::redis::connection::eviction_policy;

    fn unconnected() -> RedisStore {
        RedisStore::new(Builder::default_centralized().build().expect("a client"))
    }

    /// The store's claim futures, a caller's and a waiter's, hold no fred future inline (each
    /// is about 6.8 KB; see `coalesce`'s `no_fred_future_is_held_inline`), so a claim's future
    /// stays small to box and to move: every request makes one.
    #[test]
    fn a_claims_future_holds_no_fred_future_inline() {
        use crate::store::{OwnerToken, Store};
        use fred::interfaces::KeysInterface;
        let store = unconnected();
        let key = RecordKey::new(None, crate::IdempotencyKey::parse("k").expect("a key"));
        let fingerprint = crate::Fingerprint::new([b"body".as_slice()]);
        let owner = OwnerToken::generate();
        let client = store.connection.client().clone();
        let fred_call = std::mem::size_of_val(&client.get::<fred::types::Value, _>("k"));
        let lease = Duration::from_secs(30);
        let claim = store.claim(&key, &fingerprint, &owner, lease);
        let waiting = store.claim_waiting(&key, &fingerprint, &owner, lease);
        for (what, size) in [
            ("claim", std::mem::size_of_val(&*claim)),
            ("claim_waiting", std::mem::size_of_val(&*waiting)),
        ] {
            assert!(
                size < fred_call / 2,
                "{what}'s future: {size} B (a fred call: {fred_call} B)"
            );
        }
    }

    #[test]
    #[should_panic(expected = "contains a brace")]
    fn a_prefix_with_a_brace_is_refused() {
        let _ = unconnected().with_prefix("tenant-{a}");
    }

    #[test]
    fn tls_schemes_are_recognised() {
        for url in [
            "rediss://h:1",
            "rediss-cluster://h:1",
            "REDISS-SENTINEL://h",
            "valkeys://h",
        ] {
            assert!(asks_for_tls(url), "{url}");
        }
        for url in [
            "redis://h:1",
            "redis-cluster://h:1",
            "redis-sentinel://h",
            "h:6379",
            "",
        ] {
            assert!(!asks_for_tls(url), "{url}");
        }
    }

    /// Without the feature, fred would connect to a `rediss://` URL in plain text.
    #[cfg(not(feature = "tls"))]
    #[tokio::test]
    async fn without_the_tls_feature_a_tls_url_is_refused_naming_the_feature() {
        let error = RedisStore::connect("rediss://:secret@127.0.0.1:1")
            .await
            .unwrap_err();
        assert!(error.to_string().contains("`tls` feature"), "{error}");
    }

    #[test]
    fn the_eviction_policy_is_read_from_info_memory() {
        let info =
            "# Memory\r\nused_memory:1000\r\nmaxmemory_policy:allkeys-lru\r\nmem_fragmentation_ratio:1.2\r\n";
        assert_eq!(eviction_policy(info), Some("allkeys-lru"));
        assert_eq!(eviction_policy("# Memory\r\nused_memory:1\r\n"), None);
    }

    #[test]
    fn a_prefix_without_braces_names_the_keys() {
        let store = unconnected().with_prefix("payments:idem");
        let key = RecordKey::new(None, crate::IdempotencyKey::parse("k").unwrap());
        let name = store.redis_key(&key);
        assert_eq!(name, format!("payments:idem:{{{}}}", key.digest_hex()));
    }
}
