//! The shared store: Redis (standalone, with replicas, or Cluster) through `fred`.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, LazyLock, OnceLock};
use std::time::Duration;

use bytes::Bytes;
use fred::clients::{Client, Pool};
use fred::interfaces::{ClientLike, EventInterface, KeysInterface, LuaInterface, PubsubInterface};
use fred::types::config::{Config, ConnectionConfig, Options, ReconnectPolicy};
use fred::types::{Builder, ClusterHash, CustomCommand, Value};

use super::redis_coalesce::{Coalescer, Command, ScriptCall, ScriptText};
use super::redis_liveness::{self, Heartbeat, Pace, Watched};
use super::redis_notices::{settled_channel, Notices};
use super::replica_acks::{keep_completing, Acked, Completion, GaveUp, ReplicaAcks, Unacknowledged, Waiter};
use super::sentinel_watch::{self, Fence, SwitchWatch};
use super::{
    ClaimOutcome, InFlightRecord, KeyWatch, Oldest, OwnerToken, RecordInfo, RecordState, Store, StoreError,
    StoreFuture,
};
use crate::reconciliation::{self, ReconciliationKind};
use crate::replay_cache::ReplayCache;
use crate::telemetry::{self, Connection as Role, ConnectionEvent};
use crate::{Fingerprint, RecordKey};

const DEFAULT_PREFIX: &str = "idempotency";
const DEFAULT_COMMAND_TIMEOUT: Duration = Duration::from_secs(2);

/// One Lua script: its source, embedded at compile time, and its SHA-1 for EVALSHA.
struct Script {
    name: &'static str,
    source: &'static str,
    /// Leaked once per script per process, so every call can pass it without a copy.
    sha1: &'static str,
    /// Takes any number of records in one call (complete.lua): calls made at the same time are
    /// merged into one (`redis_coalesce`).
    per_record: bool,
}

impl Script {
    fn new(name: &'static str, source: &'static str) -> Self {
        let sha1 = fred::types::scripts::Script::from_lua(source).sha1().to_string();
        Self {
            name,
            source,
            sha1: Box::leak(sha1.into_boxed_str()),
            per_record: false,
        }
    }

    fn per_record(self) -> Self {
        Self {
            per_record: true,
            ..self
        }
    }
}

static COMPLETE: LazyLock<Script> =
    LazyLock::new(|| Script::new("complete", include_str!("../../scripts/complete.lua")).per_record());
static RELEASE: LazyLock<Script> =
    LazyLock::new(|| Script::new("release", include_str!("../../scripts/release.lua")));
static RENEW: LazyLock<Script> =
    LazyLock::new(|| Script::new("renew", include_str!("../../scripts/renew.lua")));
static PURGE: LazyLock<Script> =
    LazyLock::new(|| Script::new("purge", include_str!("../../scripts/purge.lua")));
static INSPECT: LazyLock<Script> =
    LazyLock::new(|| Script::new("inspect", include_str!("../../scripts/inspect.lua")));

/// A [`Store`] in Redis: one string key per record, every transition one round trip.
///
/// The claim, the one call every request makes, is a native command (`SET key <record> NX PX
/// <lease> GET`): it creates the in-flight record or hands back what is there, with no script to
/// run or reload. The owner-checked transitions (complete, release, renew) are Lua scripts (EVALSHA,
/// reloaded by EVAL when the server answers NOSCRIPT after a restart, a failover or `SCRIPT FLUSH`).
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
    connection: Connection,
    prefix: Arc<str>,
    options: Options,
    cache: Option<Arc<ReplayCache>>,
    /// Keeps the cache's invalidation listener running while any clone of the store lives.
    _listener: Option<Arc<Listener>>,
    /// The client [`connect`](RedisStore::connect) opened, quit with the last store clone.
    _own_client: Option<Arc<Quit>>,
    /// The failover watch of a Sentinel-configured store (see `sentinel_watch`), kept running
    /// while any clone of the store lives.
    switch_watch: Option<Arc<SwitchWatch>>,
    /// Set while a task reconnects clients that fred will not reconnect by itself.
    reviving: Arc<AtomicBool>,
    /// The durability option: claims and completions wait for replicas on connections of their
    /// own ([`with_replica_acks`](RedisStore::with_replica_acks)).
    acks: Option<Arc<Waiter>>,
    /// The subscriber connection of requests waiting for running ones ([`Store::watch`]),
    /// opened with the first waiter, shared by every clone.
    notices: Arc<tokio::sync::OnceCell<Notices>>,
    /// Sends the claims, completions and other record commands, coalescing concurrent ones
    /// into one write (see `redis_coalesce`).
    coalescer: Arc<Coalescer>,
    /// Pings the command connection(s), replacing one that goes silent (see `redis_liveness`);
    /// started with the store inside a runtime, else with its first claim.
    heartbeat: Arc<OnceLock<Heartbeat>>,
    /// How often every heartbeat of the store pings ([`with_heartbeat`](RedisStore::with_heartbeat)).
    pace: Arc<Pace>,
}

/// The task that feeds a replay cache its invalidations, and its subscriber connection; both
/// stopped with the last store clone.
struct Listener {
    task: tokio::task::JoinHandle<()>,
    _heartbeat: Heartbeat,
    _subscriber: Quit,
}

impl Drop for Listener {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// A client the store made itself (the one [`RedisStore::connect`] opens, a replay cache's
/// subscriber, the waiting requests' subscriber, the Sentinel watch's), told to quit when the last
/// clone of the store is dropped. fred keeps a client's connection task running, and
/// reconnecting, until it is told to quit, whether or not a handle to the client is left. A
/// client handed to [`RedisStore::new`] or [`RedisStore::from_pool`] stays its owner's.
pub(super) struct Quit(pub(super) Client);

impl Drop for Quit {
    fn drop(&mut self) {
        if let Ok(runtime) = tokio::runtime::Handle::try_current() {
            let client = self.0.clone();
            runtime.spawn(async move { client.quit().await });
        }
    }
}

#[derive(Clone)]
enum Connection {
    Client(Client),
    Pool(Pool),
}

impl Connection {
    fn client(&self) -> &Client {
        match self {
            Connection::Client(client) => client,
            Connection::Pool(pool) => pool.next(),
        }
    }

    fn clients(&self) -> &[Client] {
        match self {
            Connection::Client(client) => std::slice::from_ref(client),
            Connection::Pool(pool) => pool.clients(),
        }
    }
}

/// Reconnects `clients`, which have no reconnect policy (fred's default), until each answers a
/// PING, with backoff (10 ms doubling to 2 s); `reviving` is cleared at the end.
///
/// Without a policy fred's connection task ends when its connection drops, leaving commands
/// queued for a task that never comes. A client that still answers is left alone; one that does
/// not is handed a new connection task (`connect`, which retires the old one if it lingers).
async fn revive(clients: Vec<Client>, reviving: Arc<AtomicBool>) {
    let answers = |client: &Client| {
        let client = client.with_options(&Options {
            timeout: Some(Duration::from_millis(500)),
            max_attempts: Some(1),
            ..Options::default()
        });
        async move { client.ping::<()>(None).await.is_ok() }
    };
    let mut delay = Duration::from_millis(10);
    loop {
        let mut dead = 0;
        for client in &clients {
            if answers(client).await {
                continue;
            }
            let _connection_task = client.connect();
            if answers(client).await {
                tracing::info!("reconnected a Redis client that has no reconnect policy");
            } else {
                dead += 1;
            }
        }
        if dead == 0 {
            break;
        }
        tokio::time::sleep(delay).await;
        delay = (delay * 2).min(Duration::from_secs(2));
    }
    reviving.store(false, Ordering::Release);
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
    /// The store pings the client's connection once a second and replaces it when it answers
    /// nothing for 2 s (a flow dropped silently by the network); build the client with
    /// [`configure_liveness`](Self::configure_liveness) to add TCP keepalive and
    /// `TCP_USER_TIMEOUT`, which can only be set when a client is built.
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
    /// let client = Builder::from_config(Config::from_url("redis://127.0.0.1:6379")?).build()?;
    /// client.init().await?;
    /// let store = RedisStore::new(client);
    /// # let _ = store; Ok(()) }
    /// ```
    pub fn new(client: Client) -> Self {
        Self::with_connection(Connection::Client(client), Arc::default())
    }

    /// A store over a `fred` pool; each call goes to the pool's next client. Pool clients without
    /// a reconnect policy are reconnected by the store, as for [`new`](Self::new).
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
        Self::with_connection(Connection::Pool(pool), Arc::default())
    }

    fn with_connection(connection: Connection, pace: Arc<Pace>) -> Self {
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
        };
        if tokio::runtime::Handle::try_current().is_ok() {
            store.keep_alive();
        }
        store
    }

    /// Starts the command connection's heartbeat, once (an atomic load after that).
    fn keep_alive(&self) {
        self.heartbeat.get_or_init(|| {
            let clients = self.connection.clients().to_vec();
            Heartbeat::start(Role::Commands, Watched::Shared(clients), self.pace.clone())
        });
    }

    /// Sets TCP keepalive and, on Linux, `TCP_USER_TIMEOUT` on a fred connection config: what
    /// [`connect`](Self::connect) sets on every connection it opens, for a client you build
    /// yourself and hand to [`new`](Self::new) or [`from_pool`](Self::from_pool).
    ///
    /// The store pings every connection it uses once a second, yours included, and replaces one
    /// that answers no ping within 2 s; that needs nothing from you. These socket options are a
    /// second line the kernel keeps (a socket whose data goes unacknowledged for 10 s is closed;
    /// an idle one is probed after 10 s), and they can only be set when the client is built.
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
        redis_liveness::configure(connection);
    }

    /// Maps a failed command to a store error. A failure may mean the connection is gone for
    /// good: a client built without a reconnect policy (fred's default, as `Builder` makes it)
    /// stays disconnected after a Redis restart, so this store reconnects it itself.
    fn failed(&self, error: fred::error::Error) -> StoreError {
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
            .set_connection_config(redis_liveness::connection_config(base))
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
        let pulse: redis_liveness::OnAnswer = {
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
    fn purge_channel(&self) -> String {
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
    /// later, and then throws them away. So the store listens for `+switch-master` on every
    /// sentinel (one connection each) and reconnects to the new master as soon as one announces
    /// it; a write refused with `READONLY` (a demoted master) also makes it reconnect.
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
                redis_liveness::configure(connection);
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
        let switch_watch = match sentinel_watch::watch(&client, store_reconnect_policy(), pace.clone()).await
        {
            Ok(watch) => watch.map(Arc::new),
            Err(error) => {
                tracing::warn!(%error, "cannot listen for +switch-master on the sentinels; the store follows a failover only once the old master refuses writes (READONLY)");
                None
            }
        };
        let mut store = Self::with_connection(Connection::Client(client), pace);
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
        self
    }

    /// How often the store pings each of its connections to find one that died without a word
    /// (default: every second; `None`: never). A connection that answers no ping within 2 s is
    /// replaced, so a dead one is found within the interval plus 2 s; a replay cache serves
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
    /// replicas as required and no more, losing one stops new claims (503) until it is back:
    /// require fewer than you run. Call after [`with_prefix`](RedisStore::with_prefix) and
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
    fn fence(&self) -> Option<&Fence> {
        self.switch_watch.as_deref().map(|watch| &*watch.fence)
    }

    /// Refuses a claim while a Sentinel failover is under way: the old master may take it and
    /// then throw it away.
    fn refuse_claims_during_failover(&self) -> Result<(), StoreError> {
        match self.fence() {
            Some(fence) if fence.is_raised() => {
                Err(StoreError::Unavailable(Box::new(sentinel_watch::FailingOver)))
            }
            Some(fence) if fence.is_blind() => Err(StoreError::Unavailable(Box::new(
                sentinel_watch::SentinelsUnheard,
            ))),
            _ => Ok(()),
        }
    }

    /// Holds an owner's write (complete, release, renew) while a Sentinel failover is under way,
    /// so that it goes to the new master.
    async fn after_failover(&self) {
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

    /// Claims with one native command: `SET key <in-flight record> NX PX <lease> GET` answers nil
    /// when it created the record, or the record that is there (and leaves it as it is).
    /// What a claim (or a peek, without an `owner`) found in the record `existing`. A completed
    /// record is offered to the replay cache, if the cache heard no purge since `epoch`.
    fn found(
        &self,
        key: &RecordKey,
        existing: &Bytes,
        fingerprint: &Fingerprint,
        owner: Option<&OwnerToken>,
        lease: Duration,
        epoch: Option<u64>,
    ) -> Result<ClaimOutcome, StoreError> {
        if let Some(version) = record::newer_version(existing) {
            let owner = record::owner(existing).unwrap_or_default();
            return crate::store::newer_record(key, u32::from(version), owner, lease);
        }
        let found = record::parse(existing).map_err(StoreError::Corrupt)?;
        let ours = owner.is_some_and(|owner| found.owner == owner.as_str().as_bytes());
        let outcome = if found.state == record::IN_FLIGHT && ours {
            // This claim, re-sent by the client library after a dropped connection.
            ClaimOutcome::Claimed
        } else if found.fingerprint != *fingerprint.as_bytes() {
            ClaimOutcome::Mismatch
        } else if found.state == record::IN_FLIGHT {
            ClaimOutcome::InFlight {
                lease_left: found.time_left.min(lease),
            }
        } else {
            if let (Some(cache), Some(epoch)) = (&self.cache, epoch) {
                let payload = found.payload.clone();
                cache.insert(epoch, *key.digest(), found.fingerprint, payload, found.time_left);
                self.bound_copy(cache, key);
            }
            ClaimOutcome::Completed(found.payload)
        };
        Ok(outcome)
    }

    /// Bounds the replay cache's copy of a completed record by the record's life in Redis: its
    /// `PTTL`, counted on this instance's clocks from before the `PTTL` was sent. The copy was
    /// kept until the deadline in the record, which another instance's clock wrote; a skew
    /// between the two would let the copy outlive the record. One `PTTL` per copy made (a key's
    /// first repeat on this instance), from a task of its own, so the replay does not wait.
    fn bound_copy(&self, cache: &Arc<ReplayCache>, key: &RecordKey) {
        let (cache, digest) = (cache.clone(), *key.digest());
        let client = self.connection.client().with_options(&self.options);
        let redis_key = self.redis_key(key);
        tokio::spawn(async move {
            let asked = tokio::time::Instant::now();
            let left = match client.pttl::<i64, _>(redis_key).await {
                Ok(millis) if millis > 0 => Some(Duration::from_millis(millis.unsigned_abs())),
                Ok(_) => None, // gone already, or no TTL (never written so by this crate)
                Err(error) => {
                    tracing::debug!(%error, "could not read a record's TTL; its copy is dropped");
                    None
                }
            };
            cache.shorten(&digest, left, asked);
        });
    }

    async fn set_if_absent(
        &self,
        client: &Client,
        key: &RecordKey,
        record: Bytes,
        lease: Duration,
    ) -> Result<Value, StoreError> {
        let set = Command::SetIfAbsent {
            key: self.redis_key(key).into(),
            value: record,
            lease_ms: lease_millis(lease),
        };
        self.coalescer
            .send(client, &self.options, set)
            .await
            .map_err(|e| match e.details() {
                details if details.starts_with("WRONGTYPE") => {
                    StoreError::Corrupt("the key holds something other than a record".into())
                }
                _ => self.failed(e),
            })
    }

    /// Runs `script` on the record's key: EVALSHA, then EVAL if the server lost its script cache.
    async fn run(&self, script: &Script, key: &RecordKey, args: &[Value]) -> Result<Value, StoreError> {
        self.run_on(self.connection.client(), script, key, args).await
    }

    /// [`run`](Self::run) on `client`.
    async fn run_on(
        &self,
        client: &Client,
        script: &Script,
        key: &RecordKey,
        args: &[Value],
    ) -> Result<Value, StoreError> {
        let redis_key = Value::from(self.redis_key(key));
        // The durability option's completions each have a connection of their own, where nothing
        // could be merged with them: a trip through the coalescing task would buy nothing.
        let mergeable = script.per_record && self.acks.is_none();
        let call = |text| ScriptCall::new(text, redis_key.clone(), args, mergeable);
        let evalsha = Command::Script(call(ScriptText::Sha1(script.sha1)));
        let sent = self.coalescer.send(client, &self.options, evalsha);
        match sent.await {
            Err(error) if error.details().starts_with("NOSCRIPT") => {
                tracing::debug!(
                    script = script.name,
                    "script missing on the server; reloading it with EVAL"
                );
                let eval = Command::Script(call(ScriptText::Source(script.source)));
                self.coalescer
                    .send(client, &self.options, eval)
                    .await
                    .map_err(|e| self.failed(e))
            }
            result => result.map_err(|e| self.failed(e)),
        }
    }
}

/// The durability option's claim and completion ([`RedisStore::with_replica_acks`]).
impl RedisStore {
    /// Claims on a connection of its own, then waits there until the replicas have the claim.
    /// Anything but a new (or re-sent) claim is answered at once: only a claim needs to survive.
    async fn claim_acknowledged(
        &self,
        waiter: &Waiter,
        key: &RecordKey,
        fingerprint: &Fingerprint,
        owner: &OwnerToken,
        lease: Duration,
    ) -> Result<ClaimOutcome, StoreError> {
        let epoch = self.cache.as_deref().map(ReplayCache::epoch);
        let fresh = record::in_flight(owner, fingerprint, lease)?;
        let client = waiter.acquire().await;
        let answer = self.set_if_absent(&client, key, fresh, lease).await?;
        if answer != Value::Null {
            let existing = into_bytes(answer)
                .ok_or_else(|| StoreError::Corrupt("unexpected answer to the claim".into()))?;
            let outcome = self.found(key, &existing, fingerprint, Some(owner), lease, epoch)?;
            if outcome != ClaimOutcome::Claimed {
                return Ok(outcome);
            }
            // This claim, re-sent after a dropped connection: it was written on another
            // connection, and WAIT counts only this one's writes. Renewing it here writes it again.
            let args = [
                Value::Bytes(record::head(owner)?),
                Value::Bytes(record::state_until(record::IN_FLIGHT, lease)),
                millis(lease),
            ];
            if !as_flag("renew", self.run_on(&client, &RENEW, key, &args).await?)? {
                return Err(StoreError::Unavailable(
                    "the claim expired while it was re-sent; retry".into(),
                ));
            }
        }
        let error = match waiter.wait(&client, &self.redis_key(key)).await {
            Ok(acked) if acked.enough() => return Ok(ClaimOutcome::Claimed),
            Ok(acked) => acked.into_error(),
            Err(error) => StoreError::Unavailable(Box::new(Unacknowledged(error))),
        };
        // Nobody may run on a claim a failover can lose. The release follows the claim to the
        // replicas; the coordinator also queues one, in case this one fails.
        let head = Value::Bytes(record::head(owner)?);
        if let Err(release_error) = self.run_on(&client, &RELEASE, key, &[head]).await {
            tracing::debug!(?key, %release_error, "could not release an unacknowledged claim");
        }
        tracing::warn!(?key, %error, "the replicas did not acknowledge a claim in time; released it (503)");
        Err(error)
    }

    /// Completes, and waits until the replicas have the completion. If they do not in time, or
    /// the attempt fails (the master died: its replica is not promoted yet), the result is still
    /// reported stored, so the caller answers with it, and the task that made the attempt keeps
    /// completing the record, on whichever node is master by then, until the replicas have it.
    /// The attempt runs in that task from the start, so a caller that stops waiting (the
    /// coordinator's store timeout) does not cancel it. If that task gives up, it tells the
    /// coordinator's reconciliation hook, which it takes along from the completion's task.
    ///
    /// One task per claim: a call for a claim whose completion a task owns already (the
    /// coordinator trying again after it stopped waiting for a slow first attempt) is answered
    /// stored at once, as that task stores it. And the caller waits for the first attempt at
    /// most the command timeout (an attempt can take longer: it waits at a Sentinel fence, or
    /// for a connection, and its WAIT has a timeout of its own on top); past it, the result is
    /// reported stored, and whatever the first attempt finds is the task's to report.
    async fn complete_acknowledged(
        &self,
        waiter: &Arc<Waiter>,
        key: &RecordKey,
        owner: &OwnerToken,
        args: Vec<Value>,
    ) -> Result<bool, StoreError> {
        let Some(owned) = waiter.own_completion(key, owner) else {
            tracing::debug!(
                ?key,
                "a background task owns this completion already; answering with the result"
            );
            return Ok(true);
        };
        let (report, first_outcome) = tokio::sync::oneshot::channel();
        let (store, waiter, record) = (self.clone(), waiter.clone(), key.clone());
        // The owner is cloned for a hook only; the count of give-ups needs none.
        let hook = reconciliation::in_force().map(|hook| (hook, owner.clone()));
        let completing = async move {
            let _owned = owned;
            let payload = match args.get(2) {
                Some(Value::Bytes(payload)) => Some(payload.clone()),
                _ => None,
            };
            let tell = |kind: ReconciliationKind| match &hook {
                Some((hook, owner)) => {
                    reconciliation::report(Some(hook), kind, &record, owner, payload.as_ref())
                }
                None => crate::telemetry::reconciliation(&kind, None),
            };
            let first = store.complete_once_acknowledged(&waiter, &record, &args).await;
            let retry = match &first {
                Ok(Completion::NotAcknowledged(_)) => true,
                Ok(Completion::Durable | Completion::Lost) => false,
                Err(error) => worth_retrying(error),
            };
            if let Err(first) = report.send(first) {
                // The caller was answered "stored" before this attempt ended: what it would have
                // reported, this task reports.
                match first {
                    Ok(Completion::Lost) => {
                        tracing::warn!(key = ?record, "claim lost before completion; the result is not stored");
                        tell(ReconciliationKind::ClaimLost);
                    }
                    Err(error) if !retry => {
                        tracing::error!(key = ?record, %error, "could not store the result; a retry after the lease ends will run the operation again");
                        tell(ReconciliationKind::CompletionFailed {
                            error: error.to_string(),
                        });
                    }
                    _ => {}
                }
            }
            if retry {
                let retry_for = waiter.acks.retry_for();
                let attempt = || store.complete_once_acknowledged(&waiter, &record, &args);
                match keep_completing(&record, retry_for, attempt).await {
                    None => {}
                    Some(GaveUp::Lost) => tell(ReconciliationKind::LostBeforeReplicated),
                    Some(GaveUp::TimedOut(error)) => tell(ReconciliationKind::ReplicationAbandoned { error }),
                }
            }
        };
        tokio::spawn(tracing::Instrument::in_current_span(completing));
        let waited = self.options.timeout.unwrap_or(DEFAULT_COMMAND_TIMEOUT);
        let error = match tokio::time::timeout(waited, first_outcome).await {
            Ok(Ok(Ok(Completion::Durable))) => return Ok(true),
            Ok(Ok(Ok(Completion::Lost))) => return Ok(false),
            Ok(Ok(Ok(Completion::NotAcknowledged(error)))) => error,
            Ok(Ok(Err(error))) if worth_retrying(&error) => error,
            Ok(Ok(Err(error))) => return Err(error),
            Ok(Err(_)) => return Err(StoreError::Unavailable("the completion task ended".into())),
            Err(_) => StoreError::Timeout(waited),
        };
        tracing::warn!(
            ?key, %error,
            "a completion is not on the replicas yet; answering with the result and completing it \
             again in the background until they have it"
        );
        Ok(true)
    }

    /// One completion (a completed record is written again: see complete.lua) and one WAIT, on
    /// a connection of their own.
    async fn complete_once_acknowledged(
        &self,
        waiter: &Waiter,
        key: &RecordKey,
        args: &[Value],
    ) -> Result<Completion, StoreError> {
        self.after_failover().await;
        let client = waiter.acquire().await;
        let (completed, acked) = self.complete_then_wait(waiter, &client, key, args).await?;
        if !as_flag("complete", completed)? {
            return Ok(Completion::Lost);
        }
        Ok(match acked {
            Ok(acked) if acked.enough() => Completion::Durable,
            Ok(acked) => Completion::NotAcknowledged(acked.into_error()),
            Err(error) => Completion::NotAcknowledged(error),
        })
    }

    /// The completion script and the WAIT behind it, in one round trip: fred's pipeline writes
    /// them in that order on `client`'s connection without waiting for the script's answer, so
    /// the WAIT counts the completion's writes. (The claim cannot do the same: a claim that
    /// finds a record writes nothing, and a WAIT behind it would hold a replay while the
    /// replicas lag.) The pipeline is bounded by its first command's timeout, set to the wait's.
    /// Answers the script's answer, and what the WAIT said.
    async fn complete_then_wait(
        &self,
        waiter: &Waiter,
        client: &Client,
        key: &RecordKey,
        args: &[Value],
    ) -> Result<(Value, Result<Acked, StoreError>), StoreError> {
        let redis_key = self.redis_key(key);
        let script = ScriptCall::new(
            ScriptText::Sha1(COMPLETE.sha1),
            Value::from(redis_key.clone()),
            args,
            false,
        );
        let (script, script_args) = script.into_parts();
        let (wait, wait_args) = waiter.wait_command(&redis_key);
        let pipeline = client.pipeline();
        // Queued in memory: these answer at once.
        let queued: Result<(), _> = (pipeline.with_options(waiter.wait_options()))
            .custom(script, script_args)
            .await;
        queued.map_err(|e| self.failed(e))?;
        let queued: Result<(), _> = pipeline.custom(wait, wait_args).await;
        queued.map_err(|e| self.failed(e))?;
        let mut answers = pipeline.try_all::<Value>().await.into_iter();
        let (completed, waited) = match (answers.next(), answers.next()) {
            (Some(completed), Some(waited)) => (completed, waited),
            (Some(Err(error)), None) => return Err(self.failed(error)),
            _ => return Err(StoreError::Corrupt("unexpected answer to the completion".into())),
        };
        match completed {
            Err(error) if error.details().starts_with("NOSCRIPT") => {
                // The server lost its scripts (a failover, a flush): load it, then wait.
                let completed = self.run_on(client, &COMPLETE, key, args).await?;
                Ok((completed, waiter.wait(client, &redis_key).await))
            }
            Err(error) => Err(self.failed(error)),
            Ok(completed) => {
                let acked = waited
                    .map_err(unavailable)
                    .and_then(|answer| waiter.acked(answer));
                Ok((completed, acked))
            }
        }
    }
}

/// Whether another attempt may succeed where this one failed: not for data this store cannot
/// read, which another attempt would read again.
fn worth_retrying(error: &StoreError) -> bool {
    !matches!(error, StoreError::Corrupt(_) | StoreError::TooLarge { .. })
}

pub(super) fn unavailable(error: impl std::error::Error + Send + Sync + 'static) -> StoreError {
    StoreError::Unavailable(Box::new(error))
}

fn from_fred(error: fred::error::Error, options: &Options) -> StoreError {
    match error.kind() {
        fred::error::ErrorKind::Timeout => StoreError::Timeout(options.timeout.unwrap_or_default()),
        // Also inside a script, where the reply wraps the server's `OOM` error.
        _ if error.details().contains("OOM command not allowed") => unavailable(OutOfMemory(error)),
        _ => unavailable(error),
    }
}

/// Reconnect forever, with backoff from 1 ms to 2 s.
fn store_reconnect_policy() -> ReconnectPolicy {
    ReconnectPolicy::new_exponential(0, 1, 2_000, 2)
}

/// Whether `url`'s scheme asks for TLS (`rediss`, `rediss-cluster`, `rediss-sentinel`, and
/// their `valkeys` spellings).
fn asks_for_tls(url: &str) -> bool {
    let scheme = url.split_once("://").map_or("", |(scheme, _)| scheme);
    let base = scheme.split('-').next().unwrap_or_default();
    base.eq_ignore_ascii_case("rediss") || base.eq_ignore_ascii_case("valkeys")
}

/// Redis refused a write because it reached `maxmemory` under the `noeviction` policy.
#[derive(Debug, thiserror::Error)]
#[error(
    "Redis is out of memory (maxmemory reached), so it refused to write the record: raise \
     maxmemory or shorten the retention ({0})"
)]
struct OutOfMemory(#[source] fred::error::Error);

/// Warns when the server may evict records: every record has a TTL, so under a `volatile-*` or
/// `allkeys-*` policy Redis can evict a running request's record and let a retry run the
/// handler again. Read from `INFO memory`, which managed services allow where `CONFIG` is often
/// disabled; a server that refuses `INFO` is not checked.
async fn warn_if_records_can_be_evicted(client: &Client) {
    let info = CustomCommand::new_static("INFO", ClusterHash::Random, false);
    let policy = match client
        .custom::<String, Value>(info, vec![Value::from_static_str("memory")])
        .await
    {
        Ok(text) => eviction_policy(&text).map(str::to_owned),
        Err(error) => {
            tracing::debug!(%error, "could not read maxmemory-policy with INFO; not checked");
            return;
        }
    };
    match policy.as_deref() {
        Some("noeviction") => {}
        Some(policy) => tracing::warn!(
            maxmemory_policy = policy,
            "Redis may evict idempotency records under maxmemory-policy {policy}: a running \
             request's record can be evicted and its key run twice; set maxmemory-policy \
             noeviction (README: Running Redis for this)"
        ),
        None => tracing::debug!("INFO memory names no maxmemory_policy; not checked"),
    }
}

/// The `maxmemory_policy` field of an `INFO memory` answer.
fn eviction_policy(info: &str) -> Option<&str> {
    info.lines()
        .find_map(|line| line.strip_prefix("maxmemory_policy:"))
        .map(str::trim)
}

fn millis(duration: Duration) -> Value {
    Value::from(lease_millis(duration))
}

fn lease_millis(duration: Duration) -> i64 {
    // A lease of 0 ms would make PEXPIRE delete the key at once.
    i64::try_from(duration.as_millis()).unwrap_or(i64::MAX).max(1)
}

fn unexpected(script: &str, value: &Value) -> StoreError {
    StoreError::Corrupt(format!("unexpected answer from the {script} script: {value:?}"))
}

fn as_flag(script: &str, value: Value) -> Result<bool, StoreError> {
    match value.as_i64() {
        Some(0) => Ok(false),
        Some(1) => Ok(true),
        _ => Err(unexpected(script, &value)),
    }
}

fn into_bytes(value: Value) -> Option<Bytes> {
    match value {
        Value::Bytes(bytes) => Some(bytes),
        Value::String(text) => Some(text.into_inner()),
        _ => None,
    }
}

/// The record layout: one Redis string.
///
/// ```text
/// "TIR" version(u8) | owner length (u16 BE) | owner | state: 'F' in flight, 'C' completed
///   | deadline (u64 BE, ms since the Unix epoch) | fingerprint (32 bytes) | payload
/// ```
///
/// The head (through the owner) is what the scripts compare, with the state byte after it, to
/// check ownership. The deadline is the lease's end in flight and the retention's end once
/// completed; the state and the deadline are rewritten together. The payload is appended on
/// completion, so a replay is a slice of the bytes `SET … GET` hands back.
mod record {
    use std::time::{Duration, SystemTime, UNIX_EPOCH};

    use bytes::{BufMut, Bytes, BytesMut};

    use crate::store::{OwnerToken, StoreError, RECORD_VERSION};
    use crate::Fingerprint;

    const MAGIC: &[u8; 3] = b"TIR";
    pub(super) const IN_FLIGHT: u8 = b'F';
    pub(super) const COMPLETED: u8 = b'C';

    /// The bytes through the owner: what only this claim's record starts with.
    pub(super) fn head(owner: &OwnerToken) -> Result<Bytes, StoreError> {
        let owner = owner.as_str().as_bytes();
        let len = u16::try_from(owner.len())
            .map_err(|_| StoreError::Unavailable("an owner token longer than 65 535 bytes".into()))?;
        let mut head = BytesMut::with_capacity(6 + owner.len());
        head.put_slice(MAGIC);
        head.put_u8(RECORD_VERSION as u8);
        head.put_u16(len);
        head.put_slice(owner);
        Ok(head.freeze())
    }

    /// A state byte and the deadline `from_now` away, as the scripts write them after the head.
    pub(super) fn state_until(state: u8, from_now: Duration) -> Bytes {
        let at = SystemTime::now() + from_now;
        let millis = at.duration_since(UNIX_EPOCH).map_or(0, |d| d.as_millis());
        let mut bytes = BytesMut::with_capacity(9);
        bytes.put_u8(state);
        bytes.put_u64(u64::try_from(millis).unwrap_or(u64::MAX));
        bytes.freeze()
    }

    /// A new in-flight record.
    pub(super) fn in_flight(
        owner: &OwnerToken,
        fingerprint: &Fingerprint,
        lease: Duration,
    ) -> Result<Bytes, StoreError> {
        let head = head(owner)?;
        let mut record = BytesMut::with_capacity(head.len() + 9 + 32);
        record.put_slice(&head);
        record.put_slice(&state_until(IN_FLIGHT, lease));
        record.put_slice(fingerprint.as_bytes());
        Ok(record.freeze())
    }

    /// A record as read back.
    pub(super) struct Parsed {
        pub(super) state: u8,
        pub(super) owner: Bytes,
        pub(super) fingerprint: [u8; 32],
        /// Time to the deadline by this instance's clock: lease left (in flight) or retention
        /// left (completed).
        pub(super) time_left: Duration,
        pub(super) payload: Bytes,
    }

    /// The layout version of a record written by a newer release than this one, if it is one.
    pub(super) fn newer_version(record: &Bytes) -> Option<u8> {
        let version = *record.strip_prefix(MAGIC)?.first()?;
        (u32::from(version) > RECORD_VERSION).then_some(version)
    }

    /// The owner of a record of any layout (every layout starts as this one does), if the
    /// record holds one.
    pub(super) fn owner(record: &Bytes) -> Option<&[u8]> {
        let len = usize::from(u16::from_be_bytes([*record.get(4)?, *record.get(5)?]));
        record.get(6..6 + len)
    }

    /// The state, owner and deadline of a record: what a listing needs, readable from the
    /// record's first [`head_len`] bytes.
    pub(super) struct Head {
        pub(super) state: u8,
        pub(super) owner: Bytes,
        /// Time to the deadline by this instance's clock.
        pub(super) time_left: Duration,
    }

    /// How many bytes of a record [`parse_head`] needs, read from its first 6 (`None` when
    /// `start` is shorter than that).
    pub(super) fn head_len(start: &[u8]) -> Option<usize> {
        let owner_len = usize::from(u16::from_be_bytes([*start.get(4)?, *start.get(5)?]));
        Some(6 + owner_len + 9)
    }

    pub(super) fn parse_head(record: &Bytes) -> Result<Head, String> {
        let take = |at: usize, len: usize| {
            record
                .get(at..at + len)
                .ok_or_else(|| "a truncated record".to_string())
        };
        if take(0, 3)? != MAGIC {
            return Err("the key holds a string that is not a record".into());
        }
        let version = take(3, 1)?[0];
        if u32::from(version) != RECORD_VERSION {
            return Err(format!(
                "record layout version {version}, this version reads {RECORD_VERSION}"
            ));
        }
        let owner_len = usize::from(u16::from_be_bytes([take(4, 1)?[0], take(5, 1)?[0]]));
        take(6, owner_len)?;
        let owner = record.slice(6..6 + owner_len);
        let at = 6 + owner_len;
        let state = take(at, 1)?[0];
        if state != IN_FLIGHT && state != COMPLETED {
            return Err("unknown record state".into());
        }
        let mut deadline = [0; 8];
        deadline.copy_from_slice(take(at + 1, 8)?);
        let deadline = UNIX_EPOCH + Duration::from_millis(u64::from_be_bytes(deadline));
        // Another instance's clock set the deadline: a skew shifts `Retry-After` and how long a
        // replay cache keeps a copy, never the record's own expiry (Redis's TTL).
        let time_left = deadline.duration_since(SystemTime::now()).unwrap_or_default();
        Ok(Head {
            state,
            owner,
            time_left,
        })
    }

    pub(super) fn parse(record: &Bytes) -> Result<Parsed, String> {
        let Head {
            state,
            owner,
            time_left,
        } = parse_head(record)?;
        let at = 6 + owner.len() + 9;
        let mut fingerprint = [0; 32];
        fingerprint.copy_from_slice(
            record
                .get(at..at + 32)
                .ok_or_else(|| "a truncated record".to_string())?,
        );
        let payload = record.slice(at + 32..);
        if state == IN_FLIGHT && !payload.is_empty() {
            return Err("an in-flight record with a payload".into());
        }
        Ok(Parsed {
            state,
            owner,
            fingerprint,
            time_left,
            payload,
        })
    }
}

/// A replay cache's invalidation feed: the purges published on `channel`, heard over
/// `subscriber`, a connection of the cache's own.
struct PurgeFeed {
    subscriber: Client,
    channel: String,
    cache: Arc<ReplayCache>,
    /// Changes each time the heartbeat finds the subscriber silent.
    silences: tokio::sync::watch::Receiver<u64>,
}

impl PurgeFeed {
    /// Feeds the cache the purges. Whenever the feed may have missed one (the connection failed,
    /// went silent, or came back) the cache goes dark, serving nothing, until the subscription is
    /// confirmed on a live connection; it then starts empty.
    async fn listen(mut self) {
        use tokio::sync::broadcast::error::RecvError;

        let mut messages = self.subscriber.message_rx();
        let mut errors = self.subscriber.error_rx();
        let mut reconnects = self.subscriber.reconnect_rx();
        let mut live = true;
        loop {
            let resubscribe = tokio::select! {
                message = messages.recv() => match message {
                    Ok(message) if *message.channel == *self.channel => {
                        let digest = message.value.as_bytes().and_then(digest_from_hex);
                        match digest {
                            Some(digest) => self.cache.invalidate(&digest),
                            None => tracing::warn!(?message.value, "unreadable message on the purge channel; ignored"),
                        }
                        false
                    }
                    Ok(_) => false,
                    Err(RecvError::Lagged(_)) => {
                        tracing::warn!("replay cache fell behind on purges; dropping every copy");
                        self.cache.set_live(false);
                        self.cache.set_live(live);
                        false
                    }
                    Err(RecvError::Closed) => {
                        self.cache.set_live(false);
                        return;
                    }
                },
                // An error may be stale by the time it is read (from before a reconnection): the
                // subscription is checked again rather than the cache left dark on its word.
                _ = errors.recv() => true,
                // Also after the heartbeat replaced a silent connection.
                _ = reconnects.recv() => true,
                silenced = self.silences.changed() => {
                    if silenced.is_err() {
                        self.cache.set_live(false);
                        return;
                    }
                    self.go_dark(&mut live);
                    false // the heartbeat is replacing the connection; its reconnection resubscribes
                }
            };
            if resubscribe {
                self.go_dark(&mut live);
                errors = errors.resubscribe();
                let subscribed = tokio::time::timeout(
                    redis_liveness::HEARTBEAT_TIMEOUT,
                    self.subscriber.subscribe(self.channel.clone()),
                )
                .await;
                match subscribed {
                    Ok(Ok(())) => {
                        self.cache.set_live(true);
                        live = true;
                        tracing::info!("the replay cache hears purges again; it starts empty");
                        telemetry::connection_event(Role::ReplayCache, ConnectionEvent::FeedBack);
                    }
                    Ok(Err(error)) => tracing::warn!(%error, "the replay cache cannot listen for purges; it serves nothing until it can"),
                    Err(_) => tracing::warn!("the replay cache's subscription went unanswered; it serves nothing until its connection is replaced"),
                }
            }
        }
    }

    /// Stops serving copies: purges may be missed from now on.
    fn go_dark(&self, live: &mut bool) {
        self.cache.set_live(false);
        if std::mem::replace(live, false) {
            tracing::warn!("the replay cache's purge feed is down; it serves nothing until the feed is back");
            telemetry::connection_event(Role::ReplayCache, ConnectionEvent::FeedLost);
        }
    }
}

fn digest_from_hex(hex: &[u8]) -> Option<[u8; 32]> {
    let mut digest = [0; 32];
    if hex.len() != 64 {
        return None;
    }
    for (byte, pair) in digest.iter_mut().zip(hex.chunks(2)) {
        *byte = u8::from_str_radix(std::str::from_utf8(pair).ok()?, 16).ok()?;
    }
    Some(digest)
}

impl Store for RedisStore {
    fn cached(&self, key: &RecordKey, fingerprint: &Fingerprint) -> Option<ClaimOutcome> {
        let copy = self.cache.as_deref()?.get(key.digest())?;
        Some(if copy.fingerprint == *fingerprint.as_bytes() {
            ClaimOutcome::Completed(copy.payload)
        } else {
            ClaimOutcome::Mismatch
        })
    }

    fn claim<'a>(
        &'a self,
        key: &'a RecordKey,
        fingerprint: &'a Fingerprint,
        owner: &'a OwnerToken,
        lease: Duration,
    ) -> StoreFuture<'a, ClaimOutcome> {
        Box::pin(async move {
            self.keep_alive();
            self.refuse_claims_during_failover()?;
            if let Some(waiter) = &self.acks {
                // Boxed, like the other rare paths: inline, its state would size every claim.
                let acknowledged = self.claim_acknowledged(waiter, key, fingerprint, owner, lease);
                return Box::pin(acknowledged).await;
            }
            let epoch = self.cache.as_deref().map(ReplayCache::epoch);
            let fresh = record::in_flight(owner, fingerprint, lease)?;
            let client = self.connection.client();
            let existing = match self.set_if_absent(client, key, fresh, lease).await? {
                Value::Null => return Ok(ClaimOutcome::Claimed),
                value => into_bytes(value)
                    .ok_or_else(|| StoreError::Corrupt("unexpected answer to the claim".into()))?,
            };
            self.found(key, &existing, fingerprint, Some(owner), lease, epoch)
        })
    }

    fn peek<'a>(
        &'a self,
        key: &'a RecordKey,
        fingerprint: &'a Fingerprint,
    ) -> StoreFuture<'a, Option<ClaimOutcome>> {
        Box::pin(async move {
            let epoch = self.cache.as_deref().map(ReplayCache::epoch);
            let client = self.connection.client();
            let get = Command::Get {
                key: self.redis_key(key).into(),
            };
            let existing =
                match (self.coalescer.send(client, &self.options, get).await).map_err(|e| {
                    match e.details() {
                        details if details.starts_with("WRONGTYPE") => {
                            StoreError::Corrupt("the key holds something other than a record".into())
                        }
                        _ => self.failed(e),
                    }
                })? {
                    Value::Null => return Ok(None),
                    value => into_bytes(value)
                        .ok_or_else(|| StoreError::Corrupt("unexpected answer to GET".into()))?,
                };
            let lease = Duration::MAX;
            Ok(Some(self.found(
                key,
                &existing,
                fingerprint,
                None,
                lease,
                epoch,
            )?))
        })
    }

    fn complete<'a>(
        &'a self,
        key: &'a RecordKey,
        owner: &'a OwnerToken,
        payload: Bytes,
        retention: Duration,
    ) -> StoreFuture<'a, bool> {
        Box::pin(async move {
            let args = [
                Value::Bytes(record::head(owner)?),
                Value::Bytes(record::state_until(record::COMPLETED, retention)),
                Value::Bytes(payload),
                millis(retention),
            ];
            match &self.acks {
                None => {
                    self.after_failover().await;
                    as_flag("complete", self.run(&COMPLETE, key, &args).await?)
                }
                Some(waiter) => {
                    let acknowledged = self.complete_acknowledged(waiter, key, owner, args.to_vec());
                    Box::pin(acknowledged).await
                }
            }
        })
    }

    fn release<'a>(&'a self, key: &'a RecordKey, owner: &'a OwnerToken) -> StoreFuture<'a, bool> {
        Box::pin(async move {
            let head = Value::Bytes(record::head(owner)?);
            self.after_failover().await;
            as_flag("release", self.run(&RELEASE, key, &[head]).await?)
        })
    }

    fn renew<'a>(
        &'a self,
        key: &'a RecordKey,
        owner: &'a OwnerToken,
        lease: Duration,
    ) -> StoreFuture<'a, bool> {
        Box::pin(async move {
            let args = [
                Value::Bytes(record::head(owner)?),
                Value::Bytes(record::state_until(record::IN_FLIGHT, lease)),
                millis(lease),
            ];
            self.after_failover().await;
            as_flag("renew", self.run(&RENEW, key, &args).await?)
        })
    }

    fn inspect<'a>(&'a self, key: &'a RecordKey) -> StoreFuture<'a, Option<RecordInfo>> {
        Box::pin(async move {
            let mut fields = match self.run(&INSPECT, key, &[]).await? {
                Value::Array(fields) => fields.into_iter(),
                other => return Err(unexpected("inspect", &other)),
            };
            let (Some(first), Some(second)) = (fields.next(), fields.next()) else {
                return Ok(None);
            };
            if let (Some(b"wrongtype"), Some(kind)) = (first.as_bytes(), second.as_str()) {
                return Err(StoreError::Corrupt(format!(
                    "the key holds a {kind}, not a record"
                )));
            }
            let (Some(stored), Some(ttl)) = (into_bytes(first), second.as_i64()) else {
                return Err(StoreError::Corrupt(
                    "unexpected answer from the inspect script".into(),
                ));
            };
            if let Some(version) = record::newer_version(&stored) {
                return Err(StoreError::Corrupt(format!(
                    "a record in layout version {version}, written by a newer release: inspect it with that release"
                )));
            }
            let found = record::parse(&stored).map_err(StoreError::Corrupt)?;
            let expires_in = Duration::from_millis(ttl.max(0) as u64);
            Ok(Some(if found.state == record::IN_FLIGHT {
                let owner = OwnerToken::from_string(String::from_utf8_lossy(&found.owner));
                RecordInfo::new(RecordState::InFlight, expires_in, None).with_owner(owner)
            } else {
                RecordInfo::new(RecordState::Completed, expires_in, Some(found.payload))
            }))
        })
    }

    /// Subscribes to the record's shard channel (`SSUBSCRIBE <record key>:settled`), on the
    /// store's subscriber connection, opened with the first waiter; the completion, release and
    /// purge scripts publish on it (`SPUBLISH`). Waiters on one key share one subscription.
    fn watch<'a>(&'a self, key: &'a RecordKey) -> StoreFuture<'a, Option<KeyWatch>> {
        Box::pin(async move {
            let timeout = self.options.timeout.unwrap_or(DEFAULT_COMMAND_TIMEOUT);
            let notices = self
                .notices
                .get_or_try_init(|| async {
                    let base = self.connection.client();
                    let notices =
                        Notices::connect(base, store_reconnect_policy(), timeout, self.pace.clone()).await?;
                    if let Some(watch) = &self.switch_watch {
                        watch.also_reconnect(vec![notices.client().clone()]);
                    }
                    Ok::<_, StoreError>(notices)
                })
                .await?;
            let channel = settled_channel(&self.redis_key(key));
            notices.watch(channel, timeout).await.map(Some)
        })
    }

    fn purge<'a>(&'a self, key: &'a RecordKey) -> StoreFuture<'a, bool> {
        Box::pin(async move {
            if let Some(cache) = &self.cache {
                cache.invalidate(key.digest());
            }
            let args = [Value::from(self.purge_channel()), Value::from(key.digest_hex())];
            as_flag("purge", self.run(&PURGE, key, &args).await?)
        })
    }

    /// `SCAN MATCH <prefix>:{*} COUNT 1000` (on every master of a Cluster), then the first
    /// bytes of each record found (`GETRANGE`, sent together: the payloads of completed
    /// records are not read). Every page and every read is bounded by the command timeout.
    fn in_flight<'a>(&'a self, older_than: Duration, limit: usize) -> StoreFuture<'a, Vec<InFlightRecord>> {
        Box::pin(async move {
            use fred::types::scan::Scanner;
            use futures_util::StreamExt;

            let client = self.connection.client();
            let pattern = format!("{}:{{*}}", glob_escape(&self.prefix));
            let mut pages = if client.is_clustered() {
                client.scan_cluster(pattern, Some(SCAN_COUNT), None).boxed()
            } else {
                client.scan(pattern, Some(SCAN_COUNT), None).boxed()
            };
            let timeout = self.options.timeout.unwrap_or(DEFAULT_COMMAND_TIMEOUT);
            let mut oldest = Oldest::new(older_than, limit);
            loop {
                let page = match tokio::time::timeout(timeout, pages.next()).await {
                    Err(_) => return Err(StoreError::Timeout(timeout)),
                    Ok(None) => break,
                    Ok(Some(page)) => page.map_err(|e| self.failed(e))?,
                };
                let mut page = page;
                let keys = page.take_results().unwrap_or_default();
                let heads = keys.iter().map(|name| self.record_head(name));
                for found in futures_util::future::join_all(heads).await {
                    if let Some((digest, owner, lease_left)) = found? {
                        oldest.offer(digest, owner, lease_left);
                    }
                }
                // Asks for the next page only now: the records of one page at a time are held.
                Scanner::next(page);
            }
            Ok(oldest.into_vec())
        })
    }

    /// While the Sentinel fence is up (see `sentinel_watch`): until it is lowered.
    fn writes_held(&self) -> Option<StoreFuture<'_, ()>> {
        let fence = self.fence().filter(|fence| fence.is_raised())?;
        Some(Box::pin(async move {
            fence.until_lowered().await;
            Ok(())
        }))
    }
}

/// Keys asked for per `SCAN` call: a step of about a millisecond of Redis's time.
const SCAN_COUNT: u32 = 1000;

/// `text` with the characters special to `SCAN MATCH` escaped.
fn glob_escape(text: &str) -> String {
    let mut escaped = String::with_capacity(text.len());
    for c in text.chars() {
        if matches!(c, '*' | '?' | '[' | ']' | '\\') {
            escaped.push('\\');
        }
        escaped.push(c);
    }
    escaped
}

impl RedisStore {
    /// The digest, owner and lease left of the record at `name` if it is in flight, from its
    /// first bytes, read with `GETRANGE` (twice for an owner token longer than 255 bytes).
    /// `None` for a completed record, one gone since the scan, or a key that holds no record
    /// this release reads.
    async fn record_head(
        &self,
        name: &fred::types::Key,
    ) -> Result<Option<([u8; 32], OwnerToken, Duration)>, StoreError> {
        const GUESS: usize = 6 + 255 + 9;
        let Some(digest) = name
            .as_bytes()
            .strip_prefix(self.prefix.as_bytes())
            .and_then(|rest| rest.strip_prefix(b":{"))
            .and_then(|rest| rest.strip_suffix(b"}"))
            .and_then(digest_from_hex)
        else {
            return Ok(None);
        };
        let mut start = match self.first_bytes(name, GUESS).await? {
            Some(start) => start,
            None => return Ok(None),
        };
        match record::head_len(&start) {
            Some(needed) if needed > start.len() && start.len() == GUESS => {
                start = match self.first_bytes(name, needed).await? {
                    Some(start) => start,
                    None => return Ok(None),
                };
            }
            _ => {}
        }
        match record::parse_head(&start) {
            Ok(head) if head.state == record::IN_FLIGHT => {
                let owner = String::from_utf8_lossy(&head.owner).into_owned();
                Ok(Some((digest, OwnerToken::from_string(owner), head.time_left)))
            }
            Ok(_) => Ok(None),
            Err(reason) => {
                tracing::debug!(key = ?name, %reason, "not listed: not a record this release reads");
                Ok(None)
            }
        }
    }

    /// `GETRANGE name 0 len-1`; `None` when the key is gone or holds something else than a string.
    async fn first_bytes(&self, name: &fred::types::Key, len: usize) -> Result<Option<Bytes>, StoreError> {
        let client = self.connection.client().with_options(&self.options);
        let getrange = CustomCommand::new_static("GETRANGE", ClusterHash::FirstKey, false);
        let args = vec![
            Value::from(name.clone()),
            Value::Integer(0),
            Value::Integer(i64::try_from(len).unwrap_or(i64::MAX) - 1),
        ];
        match client.custom::<Value, Value>(getrange, args).await {
            Ok(value) => Ok(into_bytes(value).filter(|bytes| !bytes.is_empty())),
            Err(error) if error.details().starts_with("WRONGTYPE") => Ok(None),
            Err(error) => Err(self.failed(error)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn unconnected() -> RedisStore {
        RedisStore::new(Builder::default_centralized().build().expect("a client"))
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

#[cfg(test)]
#[path = "redis_fence_tests.rs"]
mod fence_tests;
