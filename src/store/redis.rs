//! The shared store: Redis (standalone, with replicas, or Cluster) through `fred`.

use std::sync::{Arc, LazyLock};
use std::time::Duration;

use bytes::Bytes;
use fred::clients::{Client, Pool};
use fred::interfaces::{ClientLike, KeysInterface, LuaInterface};
use fred::types::config::{Config, Options, ReconnectPolicy};
use fred::types::{Builder, ClusterHash, CustomCommand, Value};

use super::{
    ClaimOutcome, OwnerToken, RecordInfo, RecordState, Store, StoreError, StoreFuture, RECORD_VERSION,
};
use crate::{Fingerprint, RecordKey};

const DEFAULT_PREFIX: &str = "idempotency";
const DEFAULT_COMMAND_TIMEOUT: Duration = Duration::from_secs(2);

/// One Lua script: its source, embedded at compile time, and its SHA-1 for EVALSHA.
struct Script {
    name: &'static str,
    source: &'static str,
    sha1: String,
}

impl Script {
    fn new(name: &'static str, source: &'static str) -> Self {
        let sha1 = fred::types::scripts::Script::from_lua(source).sha1().to_string();
        Self { name, source, sha1 }
    }
}

static CLAIM: LazyLock<Script> =
    LazyLock::new(|| Script::new("claim", include_str!("../../scripts/claim.lua")));
static COMPLETE: LazyLock<Script> =
    LazyLock::new(|| Script::new("complete", include_str!("../../scripts/complete.lua")));
static RELEASE: LazyLock<Script> =
    LazyLock::new(|| Script::new("release", include_str!("../../scripts/release.lua")));
static RENEW: LazyLock<Script> =
    LazyLock::new(|| Script::new("renew", include_str!("../../scripts/renew.lua")));
static INSPECT: LazyLock<Script> =
    LazyLock::new(|| Script::new("inspect", include_str!("../../scripts/inspect.lua")));

/// A [`Store`] in Redis: one hash per record, every transition one Lua script (EVALSHA, reloaded
/// by EVAL when the server answers NOSCRIPT after a restart, a failover or `SCRIPT FLUSH`).
///
/// Works with Redis 6.2 and later, standalone, with replicas, or as a Cluster: a record is a
/// single key, so each script touches one slot. Every key it writes has a TTL. Every command
/// carries a timeout (default 2 s), so a command abandoned during an outage is not sent late.
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
}

impl std::fmt::Debug for RedisStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedisStore")
            .field("prefix", &self.prefix)
            .field("command_timeout", &self.options.timeout)
            .finish_non_exhaustive()
    }
}

impl RedisStore {
    /// A store over a connected (or connecting) `fred` client.
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
        Self::with_connection(Connection::Client(client))
    }

    /// A store over a `fred` pool; each call goes to the pool's next client.
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
        Self::with_connection(Connection::Pool(pool))
    }

    fn with_connection(connection: Connection) -> Self {
        Self {
            connection,
            prefix: Arc::from(DEFAULT_PREFIX),
            options: Options {
                timeout: Some(DEFAULT_COMMAND_TIMEOUT),
                ..Options::default()
            },
        }
    }

    /// Connects to `url` (`redis://`, `rediss://`, `redis-cluster://`, `redis-sentinel://`) with
    /// settings suited to this store: reconnect forever with backoff (1 ms to 2 s), connect
    /// timeout 2 s, commands re-sent at most 3 times over a dropped connection.
    ///
    /// ```no_run
    /// use tower_idempotency::RedisStore;
    /// # async fn run() -> Result<(), tower_idempotency::StoreError> {
    /// let store = RedisStore::connect("redis://127.0.0.1:6379").await?;
    /// # let _ = store; Ok(()) }
    /// ```
    pub async fn connect(url: &str) -> Result<Self, StoreError> {
        let config = Config::from_url(url).map_err(unavailable)?;
        let client = Builder::from_config(config)
            .with_connection_config(|connection| {
                connection.connection_timeout = Duration::from_secs(2);
                connection.internal_command_timeout = Duration::from_secs(2);
                connection.max_command_attempts = 3;
            })
            .with_performance_config(|performance| {
                performance.default_command_timeout = DEFAULT_COMMAND_TIMEOUT;
            })
            .set_policy(ReconnectPolicy::new_exponential(0, 1, 2_000, 2))
            .build()
            .map_err(unavailable)?;
        client.init().await.map_err(unavailable)?;
        Ok(Self::new(client))
    }

    /// Prefixes every key this store writes (default: `idempotency`). Keys look like
    /// `idempotency:{<sha256 of scope and key>}`.
    ///
    /// ```no_run
    /// # use tower_idempotency::RedisStore;
    /// # async fn run(client: fred::clients::Client) {
    /// let store = RedisStore::new(client).with_prefix("payments-api:idem");
    /// # }
    /// ```
    pub fn with_prefix(mut self, prefix: impl Into<String>) -> Self {
        self.prefix = Arc::from(prefix.into());
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

    /// Loads every script on every node (`SCRIPT LOAD`), so the first requests need no reload.
    /// Optional: a missing script is loaded on first use.
    pub async fn load_scripts(&self) -> Result<(), StoreError> {
        let client = self.connection.client();
        for script in [&*CLAIM, &*COMPLETE, &*RELEASE, &*RENEW, &*INSPECT] {
            client
                .script_load_cluster::<(), _>(script.source)
                .await
                .map_err(unavailable)?;
        }
        Ok(())
    }

    /// The Redis key of a record.
    pub fn redis_key(&self, key: &RecordKey) -> String {
        format!("{}:{{{}}}", self.prefix, key.digest_hex())
    }

    /// Runs `script` on the record's key: EVALSHA, then EVAL if the server lost its script cache.
    async fn run(&self, script: &Script, key: &RecordKey, args: Vec<Value>) -> Result<Value, StoreError> {
        let redis_key = self.redis_key(key);
        // The slot is computed here so the command is routed by the record key, not by the SHA-1.
        let slot = fred::util::redis_keyslot(redis_key.as_bytes());
        let client = self.connection.client().with_options(&self.options);
        let mut command = Vec::with_capacity(args.len() + 3);
        command.push(Value::from(script.sha1.as_str()));
        command.push(Value::from(1_i64));
        command.push(Value::from(redis_key));
        command.extend(args);

        let evalsha = CustomCommand::new_static("EVALSHA", ClusterHash::Custom(slot), false);
        match client.custom::<Value, Value>(evalsha, command.clone()).await {
            Err(error) if error.details().starts_with("NOSCRIPT") => {
                tracing::debug!(
                    script = script.name,
                    "script missing on the server; reloading it with EVAL"
                );
                command[0] = Value::from(script.source);
                let eval = CustomCommand::new_static("EVAL", ClusterHash::Custom(slot), false);
                client
                    .custom::<Value, Value>(eval, command)
                    .await
                    .map_err(|e| from_fred(e, &self.options))
            }
            result => result.map_err(|e| from_fred(e, &self.options)),
        }
    }
}

fn unavailable(error: impl std::error::Error + Send + Sync + 'static) -> StoreError {
    StoreError::Unavailable(Box::new(error))
}

fn from_fred(error: fred::error::Error, options: &Options) -> StoreError {
    match error.kind() {
        fred::error::ErrorKind::Timeout => StoreError::Timeout(options.timeout.unwrap_or_default()),
        _ => unavailable(error),
    }
}

fn millis(duration: Duration) -> Value {
    // A lease of 0 ms would make PEXPIRE delete the key at once.
    Value::from(i64::try_from(duration.as_millis()).unwrap_or(i64::MAX).max(1))
}

fn owner_value(owner: &OwnerToken) -> Value {
    Value::from(owner.as_str())
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

fn tag(value: &Value) -> Option<Vec<u8>> {
    value.as_bytes().map(<[u8]>::to_vec)
}

fn into_payload(value: Value) -> Bytes {
    match value {
        Value::Bytes(bytes) => bytes,
        other => other.into_bytes().unwrap_or_default(),
    }
}

impl Store for RedisStore {
    fn claim<'a>(
        &'a self,
        key: &'a RecordKey,
        fingerprint: &'a Fingerprint,
        owner: &'a OwnerToken,
        lease: Duration,
    ) -> StoreFuture<'a, ClaimOutcome> {
        Box::pin(async move {
            let args = vec![
                owner_value(owner),
                Value::Bytes(Bytes::copy_from_slice(fingerprint.as_bytes())),
                millis(lease),
                Value::from(i64::from(RECORD_VERSION)),
            ];
            let answer = self.run(&CLAIM, key, args).await?;
            let mut fields = answer.clone().into_array().into_iter();
            let (Some(kind), detail) = (fields.next(), fields.next()) else {
                return Err(unexpected("claim", &answer));
            };
            match (tag(&kind).as_deref(), detail) {
                (Some(b"claimed"), None) => Ok(ClaimOutcome::Claimed),
                (Some(b"completed"), Some(payload)) => Ok(ClaimOutcome::Completed(into_payload(payload))),
                (Some(b"in_flight"), Some(left)) => match left.as_i64() {
                    Some(ms) if ms >= 0 => Ok(ClaimOutcome::InFlight {
                        lease_left: Duration::from_millis(ms as u64),
                    }),
                    _ => Err(unexpected("claim", &answer)),
                },
                (Some(b"mismatch"), None) => Ok(ClaimOutcome::Mismatch),
                (Some(b"corrupt"), Some(reason)) => Err(StoreError::Corrupt(
                    reason.as_str().map(|s| s.into_owned()).unwrap_or_default(),
                )),
                _ => Err(unexpected("claim", &answer)),
            }
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
            let args = vec![owner_value(owner), Value::Bytes(payload), millis(retention)];
            as_flag("complete", self.run(&COMPLETE, key, args).await?)
        })
    }

    fn release<'a>(&'a self, key: &'a RecordKey, owner: &'a OwnerToken) -> StoreFuture<'a, bool> {
        Box::pin(async move {
            as_flag(
                "release",
                self.run(&RELEASE, key, vec![owner_value(owner)]).await?,
            )
        })
    }

    fn renew<'a>(
        &'a self,
        key: &'a RecordKey,
        owner: &'a OwnerToken,
        lease: Duration,
    ) -> StoreFuture<'a, bool> {
        Box::pin(async move {
            as_flag(
                "renew",
                self.run(&RENEW, key, vec![owner_value(owner), millis(lease)])
                    .await?,
            )
        })
    }

    fn inspect<'a>(&'a self, key: &'a RecordKey) -> StoreFuture<'a, Option<RecordInfo>> {
        Box::pin(async move {
            let answer = self
                .run(&INSPECT, key, vec![Value::from(i64::from(RECORD_VERSION))])
                .await?;
            let fields = answer.clone().into_array();
            let mut fields = fields.into_iter();
            let (kind, second, third) = (fields.next(), fields.next(), fields.next());
            let Some(kind) = kind else { return Ok(None) };
            let state = match tag(&kind).as_deref() {
                Some(b"in_flight") => RecordState::InFlight,
                Some(b"completed") => RecordState::Completed,
                Some(b"corrupt") => {
                    let reason = second
                        .and_then(|r| r.as_str().map(|s| s.into_owned()))
                        .unwrap_or_default();
                    return Err(StoreError::Corrupt(reason));
                }
                _ => return Err(unexpected("inspect", &answer)),
            };
            let ttl = second
                .and_then(|v| v.as_i64())
                .ok_or_else(|| unexpected("inspect", &answer))?;
            let payload = third.filter(|v| !v.is_null()).map(into_payload);
            Ok(Some(RecordInfo::new(
                state,
                Duration::from_millis(ttl.max(0) as u64),
                payload,
            )))
        })
    }

    fn purge<'a>(&'a self, key: &'a RecordKey) -> StoreFuture<'a, bool> {
        Box::pin(async move {
            let client = self.connection.client().with_options(&self.options);
            let deleted: i64 = client
                .del(self.redis_key(key))
                .await
                .map_err(|e| from_fred(e, &self.options))?;
            Ok(deleted > 0)
        })
    }
}
