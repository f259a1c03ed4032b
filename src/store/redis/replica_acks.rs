//! Waiting for replicas to acknowledge a claim or a completion (`WAIT`), for
//! [`RedisStore::with_replica_acks`](crate::RedisStore::with_replica_acks).
//!
//! Redis replicates asynchronously: a master acknowledges a write before any replica has it, so a
//! replica promoted after the master dies (or one promoted while the old master still takes
//! writes, as during a Sentinel failover) can lack a claim or a completion the old master
//! acknowledged, and a retry of that key runs the operation again. `WAIT n timeout` answers how
//! many replicas have everything the connection wrote so far. Three constraints shape this module:
//!
//! - `WAIT` cannot run inside a script, so it is a second command, sent to the node that holds
//!   the record (its hash slot, on a Cluster);
//! - it counts the writes of *its own connection* and blocks that connection until it answers,
//!   so it cannot share the multiplexed connection every other request uses: each waiting call
//!   borrows a connection of its own from a small exclusive pool, writes, and waits on it;
//! - a completion that is not acknowledged in time must outlast a failover: the handler's answer
//!   goes back to the client, and a background task keeps completing the record (on whichever
//!   node is master by then) and waiting until the replicas have it.
//!
//! A `WAIT` is only as good as the connection it runs on. fred sends an unanswered command again
//! after a reconnect, and a reconnect can also fall between a write and the `WAIT` behind it (the
//! store forces some itself: a Sentinel switch, the heartbeat replacing a silent connection). On a
//! new connection `WAIT` counts nothing written there, and Redis 7.2 and later (Valkey too) answer
//! it at once with every online replica: an unreplicated write would read as acknowledged. So a
//! `WAIT` here is sent at most once (never again after a reconnect), each connection is named
//! (`CLIENT SETNAME <marker>`, a name no other connection ever bears) ahead of the first write a
//! `WAIT` must count, and the `WAIT` goes out in one pipeline with `CLIENT GETNAME` behind it. Commands of a connection run in order and
//! a connection that closed never comes back, so the name read after the `WAIT` is the marker only
//! if the write, the `WAIT` and the name check all ran on the connection the marker named. Any
//! other answer (another name, none, an error) counts as *not* acknowledged.
//!
//! With [`ReplicaAcks::fsync`] the wait is `WAITAOF 1 n timeout` (Redis and Valkey 7.2 and
//! later) instead: the master and `n` replicas must have written the writes to their
//! append-only files, so that a restart of every node loses nothing either.

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use fred::clients::{Client, ExclusivePool};
use fred::interfaces::{ClientLike, EventInterface};
use fred::types::config::Options;
use fred::types::{ClusterHash, CustomCommand, Value};
use tokio::sync::OwnedMutexGuard;
use tokio::time::Instant;

use super::connection::unavailable;
use super::liveness::{self, Heartbeat, Pace, Watched};
use crate::key::RecordKey;
use crate::store::error::StoreError;
use crate::store::record::OwnerToken;
use crate::sync::lock;
use crate::telemetry::Connection as Role;

const DEFAULT_TIMEOUT: Duration = Duration::from_millis(500);
const DEFAULT_CONNECTIONS: usize = 32;
const DEFAULT_RETRY_FOR: Duration = Duration::from_secs(60);

/// How many replicas must acknowledge a claim and a completion, and for how long to wait: the
/// durability option of [`RedisStore::with_replica_acks`](crate::RedisStore::with_replica_acks).
///
/// Defaults: a 500 ms timeout per `WAIT`, 32 connections for waiting calls, completions kept
/// trying for 60 s, and replicas that received a write count (no [`fsync`](ReplicaAcks::fsync)).
///
/// ```
/// use std::time::Duration;
/// use tower_idempotency::ReplicaAcks;
///
/// let acks = ReplicaAcks::new(1)
///     .timeout(Duration::from_millis(250))
///     .connections(64)
///     .retry_completions_for(Duration::from_secs(120));
/// assert_eq!(acks.replicas(), 1);
/// assert!(!acks.is_fsync());
/// ```
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ReplicaAcks {
    replicas: u32,
    timeout: Duration,
    connections: usize,
    retry_for: Duration,
    fsync: bool,
}

impl ReplicaAcks {
    /// Claims and completions wait until `replicas` replicas have them.
    pub fn new(replicas: u32) -> Self {
        Self {
            replicas,
            timeout: DEFAULT_TIMEOUT,
            connections: DEFAULT_CONNECTIONS,
            retry_for: DEFAULT_RETRY_FOR,
            fsync: false,
        }
    }

    /// Also waits until the master and the replicas have written each claim and completion to
    /// their append-only files (`WAITAOF 1 <replicas> <timeout>` instead of `WAIT`), so that no
    /// acknowledged write is lost even if every node restarts at once (default: off, replicas
    /// that received a write count).
    ///
    /// Needs Redis or Valkey 7.2 or later and `appendonly yes` on the master and on the replicas
    /// that count: [`RedisStore::with_replica_acks`](crate::RedisStore::with_replica_acks)
    /// refuses a server without `WAITAOF` or a master without an append-only file (on a Cluster,
    /// it asks one master), and a replica without one never acknowledges (every claim is
    /// answered 503). Each wait then lasts until
    /// the next fsync: at once with `appendfsync always`, up to a second with `everysec`
    /// (Redis's default), so set the [`timeout`](ReplicaAcks::timeout) to match.
    ///
    /// ```
    /// use std::time::Duration;
    /// use tower_idempotency::ReplicaAcks;
    ///
    /// let acks = ReplicaAcks::new(1).fsync(true).timeout(Duration::from_millis(1500));
    /// assert!(acks.is_fsync());
    /// ```
    pub fn fsync(mut self, fsync: bool) -> Self {
        self.fsync = fsync;
        self
    }

    /// Whether the writes must also be on the nodes' disks ([`fsync`](ReplicaAcks::fsync)).
    pub fn is_fsync(&self) -> bool {
        self.fsync
    }

    /// How long one `WAIT` (or `WAITAOF`) may take (default 500 ms). A claim not acknowledged by
    /// then is released and answered 503. Keep the command timeout plus this under the layer's
    /// store timeout (2 s by default), or the layer gives up on the claim first (also a 503, but
    /// run unprotected with fail-open, as a store that did not answer).
    pub fn timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    /// How many connections waiting calls may use at once (default 32, at least 1). Each claim
    /// and completion holds one for a round trip and the replicas' acknowledgement; calls beyond
    /// this many queue for a free one.
    pub fn connections(mut self, connections: usize) -> Self {
        self.connections = connections.max(1);
        self
    }

    /// How long a completion that the replicas did not acknowledge in time is retried in the
    /// background (default 60 s), at most: the retries also end when the claim's lease ends (as
    /// this process last wrote it, moved on by a renewal wherever the claim is still in flight),
    /// since a replica promoted after that holds no claim to complete. Make it, and the lease,
    /// longer than your failover takes to detect a dead master and promote a replica
    /// (Sentinel's `down-after-milliseconds` plus the failover; Cluster's `cluster-node-timeout`
    /// plus the election), so that a retry reaches the new master while the claim it inherited
    /// is still held.
    pub fn retry_completions_for(mut self, retry_for: Duration) -> Self {
        self.retry_for = retry_for;
        self
    }

    /// The number of replicas that must acknowledge.
    pub fn replicas(&self) -> u32 {
        self.replicas
    }

    pub(super) fn retry_for(&self) -> Duration {
        self.retry_for
    }
}

/// Forgets the name of the client `id`'s connection each time the client connects again (a
/// Sentinel switch, the heartbeat, fred after a drop): the new connection bears none, so the next
/// write names it. Before, the first `WAIT` on each of the pool's connections after a failover
/// failed its name check: a claim answered 503, a completion sent to the background, where each
/// attempt could take another such connection (seven in a row, its result given up).
async fn forget_name_on_reconnect(
    id: String,
    mut reconnects: tokio::sync::broadcast::Receiver<fred::types::config::Server>,
    names: Arc<Mutex<HashMap<String, Marker>>>,
) {
    use tokio::sync::broadcast::error::RecvError;

    loop {
        match reconnects.recv().await {
            Ok(_) | Err(RecvError::Lagged(_)) => {
                lock(&names).remove(&id);
            }
            Err(RecvError::Closed) => return,
        }
    }
}

/// The exclusive connections waiting calls run on, and the settings they wait with.
pub(super) struct Waiter {
    pool: ExclusivePool,
    /// Pings each connection when free, replacing one that went silent.
    _heartbeat: Heartbeat,
    pub(super) acks: ReplicaAcks,
    /// The options of a call that ends with a `WAIT`: the store's command timeout plus the wait.
    wait_options: Options,
    /// The claims whose completion a background task owns now: one task per claim.
    completing: Mutex<HashSet<([u8; 32], OwnerToken)>>,
    /// When the lease of each claim this process holds ends, as it last wrote it: what bounds a
    /// background completion ([`keep_completing`]).
    leases: Mutex<Leases>,
    /// The name each client's connection was given (by fred's client id), until a check finds
    /// it gone or the client connects again: a connection is named once, not at every write
    /// (each `CLIENT SETNAME` is one more socket write, and a read for Redis).
    names: Arc<Mutex<HashMap<String, Marker>>>,
    /// Forget a client's name when it connects again (`forget_names_on_reconnect`).
    forgetting: Vec<tokio::task::JoinHandle<()>>,
}

impl Drop for Waiter {
    fn drop(&mut self) {
        self.forgetting.iter().for_each(tokio::task::JoinHandle::abort);
        // fred's connection tasks outlive the client handles: close the connections.
        if let Ok(runtime) = tokio::runtime::Handle::try_current() {
            let pool = self.pool.clone();
            runtime.spawn(async move { pool.quit().await });
        }
    }
}

impl Waiter {
    /// Connects `acks.connections` clients with `base`'s settings (and a reconnect policy, which
    /// `base` may lack), each holding connections of its own.
    pub(super) async fn connect(
        base: &Client,
        acks: ReplicaAcks,
        command_options: &Options,
        policy: fred::types::config::ReconnectPolicy,
        pace: Arc<Pace>,
    ) -> Result<Arc<Self>, StoreError> {
        let pool = ExclusivePool::new(
            base.client_config(),
            Some(base.perf_config()),
            Some(liveness::connection_config(base)),
            Some(base.client_reconnect_policy().unwrap_or(policy)),
            acks.connections,
        )
        .map_err(unavailable)?;
        pool.init().await.map_err(unavailable)?;
        if acks.fsync {
            // Refuse now what every claim would otherwise fail on: no `WAITAOF` (before 7.2), or
            // no append-only file on the master. On a connection that wrote nothing yet it
            // answers at once.
            let probe = CustomCommand::new_static("WAITAOF", ClusterHash::Random, false);
            let args = vec![Value::from(1), Value::from(0), Value::from(1000)];
            let client = pool.acquire().await;
            if let Err(error) = client.custom::<Value, Value>(probe, args).await {
                return Err(StoreError::Unavailable(
                    format!(
                        "ReplicaAcks::fsync needs WAITAOF (Redis or Valkey 7.2 and later) and \
                         `appendonly yes` on the master: {error}"
                    )
                    .into(),
                ));
            }
        }
        let command_timeout = command_options.timeout.unwrap_or(Duration::from_secs(2));
        let wait_options = Options {
            timeout: Some(command_timeout + acks.timeout),
            ..command_options.clone()
        };
        let client = pool.acquire().await;
        if let Err(error) = names_connections(&client, &wait_options).await {
            return Err(StoreError::Unavailable(
                format!(
                    "RedisStore::with_replica_acks needs CLIENT SETNAME and CLIENT GETNAME (it names \
                     each connection it waits on, to tell that a WAIT runs on its write's \
                     connection); allow them to this user: {error}"
                )
                .into(),
            ));
        }
        warn_if_fewer_than_the_replicas(&client, acks.replicas).await;
        drop(client);
        let heartbeat = Heartbeat::start(Role::ReplicaAcks, Watched::Exclusive(pool.clone()), pace);
        let names = Arc::default();
        let mut forgetting = Vec::with_capacity(pool.size());
        for client in pool.clients() {
            let client = client.lock().await;
            let reconnects = client.reconnect_rx();
            let forget = forget_name_on_reconnect(client.id().to_owned(), reconnects, Arc::clone(&names));
            forgetting.push(tokio::spawn(forget));
        }
        Ok(Arc::new(Self {
            _heartbeat: heartbeat,
            pool,
            acks,
            wait_options,
            completing: Mutex::default(),
            leases: Mutex::default(),
            names,
            forgetting,
        }))
    }

    /// Handles on every client of the pool (they share their connections with the pool's), so
    /// that a Sentinel switch can reconnect them.
    pub(super) async fn clients(&self) -> Vec<Client> {
        let mut clients = Vec::with_capacity(self.pool.size());
        for client in self.pool.clients() {
            clients.push(client.lock().await.clone());
        }
        clients
    }

    /// A connection no other call uses until the guard is dropped.
    pub(super) async fn acquire(&self) -> OwnedMutexGuard<Client> {
        self.pool.acquire().await
    }

    /// Waits until the replicas have every write `client` sent to the node holding `redis_key`
    /// since it named its connection `marker` (and, with `fsync`, until they and the master have
    /// it on disk), or the timeout passes. Answers whether that happened, and how many replicas
    /// acknowledged; a connection that is no longer the one `marker` named is an error (its
    /// `WAIT` counted another connection's writes).
    pub(super) async fn wait(
        &self,
        client: &Client,
        redis_key: &str,
        marker: &Marker,
    ) -> Result<Acked, StoreError> {
        let pipeline = client.pipeline();
        // Never sent again after a reconnect: see the module's docs.
        let options = &super::connection::sent_once(&self.wait_options);
        for (command, args) in [self.wait_command(redis_key), name_check(redis_key)] {
            let queued: Result<(), _> = pipeline.with_options(options).custom(command, args).await;
            queued.map_err(unavailable)?;
        }
        let mut answers = pipeline.try_all::<Value>().await.into_iter();
        let acked = self.checked(marker, answers.next(), answers.next());
        if acked.is_err() {
            self.forget_name(client);
        }
        acked
    }

    /// The options of a call that ends with a wait: the command timeout plus the wait's (the
    /// wait itself is to be sent once: `connection::sent_once`).
    pub(super) fn wait_options(&self) -> &Options {
        &self.wait_options
    }

    /// The name `client`'s connection bears, and whether it is yet to be given
    /// (`CLIENT SETNAME`, ahead of the write): a new name when no check has seen the last one
    /// since it was given. See [`Marker`].
    pub(super) fn marker(&self, client: &Client) -> (Marker, bool) {
        let mut names = lock(&self.names);
        match names.get(client.id()) {
            Some(marker) => (marker.clone(), false),
            None => {
                let marker = Marker::new();
                names.insert(client.id().to_owned(), marker.clone());
                (marker, true)
            }
        }
    }

    /// Whether `client`'s connection is named (a test's look, which names nothing).
    #[cfg(test)]
    pub(super) fn is_named(&self, client: &Client) -> bool {
        lock(&self.names).contains_key(client.id())
    }

    /// Forgets the name of `client`'s connection (a check did not find it, or could not look):
    /// the next write names its connection anew.
    pub(super) fn forget_name(&self, client: &Client) {
        lock(&self.names).remove(client.id());
    }

    /// What a `WAIT` and the [`name_check`] behind it answered: the replicas' count, if the
    /// connection still bore `marker`.
    pub(super) fn checked(
        &self,
        marker: &Marker,
        waited: Option<Result<Value, fred::error::Error>>,
        named: Option<Result<Value, fred::error::Error>>,
    ) -> Result<Acked, StoreError> {
        let (Some(waited), Some(named)) = (waited, named) else {
            return Err(StoreError::Corrupt("no answer to WAIT".into()));
        };
        let acked = self.acked(waited.map_err(unavailable)?)?;
        match named.map_err(unavailable)? {
            Value::String(name) if name.as_bytes() == marker.0.as_bytes() => Ok(acked),
            Value::Bytes(name) if name == marker.0.as_bytes() => Ok(acked),
            other => Err(StoreError::Unavailable(Box::new(ConnectionReplaced {
                found: format!("{other:?}"),
            }))),
        }
    }

    /// The `WAIT` (or `WAITAOF`) for the writes to the node holding `redis_key`. Send it once
    /// (`connection::sent_once`), with [`name_check`] behind it.
    pub(super) fn wait_command(&self, redis_key: &str) -> (CustomCommand, Vec<Value>) {
        let timeout_ms = i64::try_from(self.acks.timeout.as_millis()).unwrap_or(i64::MAX);
        let replicas = Value::from(i64::from(self.acks.replicas));
        let (name, args) = if self.acks.fsync {
            ("WAITAOF", vec![Value::from(1), replicas, Value::from(timeout_ms)])
        } else {
            ("WAIT", vec![replicas, Value::from(timeout_ms)])
        };
        (
            CustomCommand::new_static(name, on_node_of(redis_key), false),
            args,
        )
    }

    /// What the answer to [`wait_command`](Waiter::wait_command) says.
    pub(super) fn acked(&self, answer: Value) -> Result<Acked, StoreError> {
        let name = if self.acks.fsync { "WAITAOF" } else { "WAIT" };
        let count = |value: &Value| value.as_i64().and_then(|n| u32::try_from(n).ok());
        // `WAIT` answers the replicas' count; `WAITAOF` the master's (0 or 1) and the replicas'.
        let counts = match &answer {
            Value::Array(counts) if self.acks.fsync => match counts.as_slice() {
                [master, replicas] => count(master).zip(count(replicas)),
                _ => None,
            },
            single if !self.acks.fsync => count(single).map(|replicas| (1, replicas)),
            _ => None,
        };
        let (master, acknowledged) =
            counts.ok_or_else(|| StoreError::Corrupt(format!("unexpected answer to {name}: {answer:?}")))?;
        Ok(Acked {
            acknowledged,
            wanted: self.acks.replicas,
            on_master: master >= 1,
        })
    }
}

/// A name for one connection: `CLIENT SETNAME <marker>` goes out ahead of the first write on it
/// that a `WAIT` must count, `CLIENT GETNAME` just after every `WAIT`, and the `WAIT` counts the
/// writes only if the name read is the marker (see the module's docs). Unique in this process,
/// and no connection of this process is ever named the same twice: a new connection, which
/// carries no name or fred's, never passes for the old one. Once a check does not find it, the
/// client's next write names its connection anew ([`Waiter::marker`]).
#[derive(Clone)]
pub(super) struct Marker(String);

impl Marker {
    fn new() -> Self {
        static NEXT: AtomicU64 = AtomicU64::new(0);
        Self(format!(
            "tower-idempotency-acked-{}",
            NEXT.fetch_add(1, Ordering::Relaxed)
        ))
    }

    /// `CLIENT SETNAME <marker>` on the connection to the node holding `redis_key`.
    pub(super) fn command(&self, redis_key: &str) -> (CustomCommand, Vec<Value>) {
        (
            CustomCommand::new_static("CLIENT", on_node_of(redis_key), false),
            vec![Value::from_static_str("SETNAME"), Value::from(self.0.as_str())],
        )
    }
}

/// `CLIENT GETNAME` on the connection to the node holding `redis_key`.
/// Warns (once, at setup) when the master has more replicas than `required`: a failover may
/// promote one that did not acknowledge a write the store counted durable, and lose it (a
/// Sentinel picks by `replica-priority`, then by replication offsets it may have read seconds
/// earlier; a replica that lags at the promotion lacks what the others acknowledged). Only
/// waiting for every replica survives any promotion (issue 36: seen in the Sentinel history
/// run with one of two replicas required). On a Cluster this asks one master.
async fn warn_if_fewer_than_the_replicas(client: &Client, required: u32) {
    let info = CustomCommand::new_static("INFO", ClusterHash::Random, false);
    let replicas = match client
        .custom::<String, Value>(info, vec![Value::from_static_str("replication")])
        .await
    {
        Ok(text) => connected_replicas(&text),
        Err(error) => {
            tracing::debug!(%error, "could not count the replicas with INFO; not checked");
            return;
        }
    };
    if let Some(replicas) = replicas.filter(|&replicas| replicas > required) {
        tracing::warn!(
            replicas,
            required,
            "ReplicaAcks requires {required} of the master's {replicas} replicas: a failover that \
             promotes one that did not acknowledge loses what the store counted durable, and a \
             key can run twice; require every replica (ReplicaAcks::new({replicas})) for any \
             promotion to keep it (docs/topologies-and-failover.md)"
        );
        crate::telemetry::setup_warning(crate::telemetry::SetupWarning::FewerAcksThanReplicas, None);
    }
}

/// `connected_slaves` of an `INFO replication` answer.
fn connected_replicas(info: &str) -> Option<u32> {
    info.lines()
        .find_map(|line| line.strip_prefix("connected_slaves:"))
        .and_then(|count| count.trim().parse().ok())
}

pub(super) fn name_check(redis_key: &str) -> (CustomCommand, Vec<Value>) {
    (
        CustomCommand::new_static("CLIENT", on_node_of(redis_key), false),
        vec![Value::from_static_str("GETNAME")],
    )
}

/// On a Cluster, the node of the record's slot: the node its write went to. A standalone or
/// Sentinel client ignores the slot.
fn on_node_of(redis_key: &str) -> ClusterHash {
    ClusterHash::Custom(fred::util::redis_keyslot(redis_key.as_bytes()))
}

/// Checks, when the store connects, that this user may name its connections (an ACL can deny
/// `CLIENT`): without it no `WAIT` could be told from one on another connection.
async fn names_connections(client: &Client, options: &Options) -> Result<(), fred::error::Error> {
    let marker = Marker::new();
    let pipeline = client.pipeline();
    for (command, args) in [marker.command(""), name_check("")] {
        pipeline
            .with_options(options)
            .custom::<(), _>(command, args)
            .await?;
    }
    let answers = pipeline.try_all::<Value>().await;
    for answer in answers {
        answer?;
    }
    Ok(())
}

/// A `WAIT` ran on a connection other than its write's: a reconnect came between them.
#[derive(Debug, thiserror::Error)]
#[error(
    "the connection was replaced between a write and its WAIT (the name read after the WAIT was \
     {found}), so the WAIT did not count the write: not acknowledged"
)]
pub(super) struct ConnectionReplaced {
    found: String,
}

impl Waiter {
    /// The completion of `owner`'s claim on `key` for the caller to hand to a background task,
    /// unless a task owns it already (`None`): a caller that stopped waiting for a slow first
    /// attempt (the coordinator's store timeout) and tries again must not start a second one.
    pub(super) fn own_completion(
        self: &Arc<Self>,
        key: &RecordKey,
        owner: &OwnerToken,
    ) -> Option<OwnedCompletion> {
        let claim = (*key.digest(), owner.clone());
        let mut completing = lock(&self.completing);
        if completing.contains(&claim) {
            return None;
        }
        completing.insert(claim.clone());
        Some(OwnedCompletion {
            waiter: self.clone(),
            claim,
        })
    }
}

/// A claim's completion, owned by the task that holds this until it ends.
pub(super) struct OwnedCompletion {
    waiter: Arc<Waiter>,
    claim: ([u8; 32], OwnerToken),
}

impl Drop for OwnedCompletion {
    fn drop(&mut self) {
        let mut completing = lock(&self.waiter.completing);
        completing.remove(&self.claim);
        drop(completing);
        // The claim is over (completed, or given up), whatever its renewals wrote meanwhile.
        self.waiter.forget_lease(&self.claim.1);
    }
}

impl Waiter {
    /// `owner`'s claim was written (claimed, or renewed) with a lease that ends at `ends`; `None`:
    /// it was found lost.
    pub(super) fn lease_written(&self, owner: &OwnerToken, ends: Option<Instant>) {
        let mut leases = lock(&self.leases);
        match ends {
            Some(ends) => leases.written(owner, ends),
            None => {
                leases.ends.remove(owner);
            }
        }
    }

    /// What is left of the lease of `owner`'s claim as this process last wrote it, if it
    /// remembers it (not for a claim made before the store was built, say).
    pub(super) fn lease_left(&self, owner: &OwnerToken) -> Option<Duration> {
        lock(&self.leases).left(owner)
    }

    /// `owner`'s claim is over (completed, released, or never acknowledged).
    pub(super) fn forget_lease(&self, owner: &OwnerToken) {
        self.lease_written(owner, None);
    }
}

/// When the lease of each claim ends, by owner (a token per claim), for the durability option
/// only: no other store keeps anything per claim.
#[derive(Default)]
struct Leases {
    ends: HashMap<OwnerToken, Instant>,
    /// The size at which ended leases are swept (a claim whose owner never completed nor
    /// released it: its future dropped mid-way). Doubles with the live entries, so a sweep costs
    /// a constant per insertion.
    sweep_at: usize,
}

/// The fewest entries at which [`Leases`] sweeps.
const FIRST_SWEEP: usize = 1024;

impl Leases {
    fn left(&self, owner: &OwnerToken) -> Option<Duration> {
        let ends = self.ends.get(owner)?;
        Some(ends.saturating_duration_since(Instant::now()))
    }

    fn written(&mut self, owner: &OwnerToken, ends: Instant) {
        self.ends.insert(owner.clone(), ends);
        if self.ends.len() >= self.sweep_at.max(FIRST_SWEEP) {
            let now = Instant::now();
            self.ends.retain(|_, ends| *ends > now);
            self.sweep_at = (self.ends.len() * 2).max(FIRST_SWEEP);
        }
    }
}

/// What a `WAIT` or `WAITAOF` answered.
#[derive(Clone, Copy, Debug)]
pub(super) struct Acked {
    pub(super) acknowledged: u32,
    pub(super) wanted: u32,
    /// Whether the master has the writes as required: always after `WAIT`; on its disk after
    /// `WAITAOF`.
    pub(super) on_master: bool,
}

impl Acked {
    pub(super) fn enough(self) -> bool {
        self.on_master && self.acknowledged >= self.wanted
    }

    pub(super) fn into_error(self) -> StoreError {
        if !self.on_master {
            return StoreError::NotFsynced;
        }
        StoreError::NotReplicated {
            acknowledged: self.acknowledged,
            wanted: self.wanted,
        }
    }
}

/// The outcome of one attempt to complete a record and have the replicas acknowledge it.
pub(super) enum Completion {
    /// Completed and acknowledged.
    Durable,
    /// Completed on the master, not (yet) acknowledged.
    NotAcknowledged(StoreError),
    /// The owner no longer holds the claim.
    Lost,
}

/// How [`keep_completing`] ended, when it did not end well.
pub(super) enum GaveUp {
    /// The claim was found lost.
    Lost,
    /// `retry_for` passed, or the claim's lease ended unrenewed; the last error.
    TimedOut(String),
}

/// Retries `attempt` with backoff (50 ms doubling to 1 s) until the completion is durable, the
/// claim is found lost, `retry_for` passes, or the claim's lease ends; logs how it ended, and
/// answers it unless durable.
///
/// `lease_left` is the lease the claim had at the start, as this process last wrote it (its
/// claim or its last renewal), if it remembers it: all that keeps the claim on a replica that
/// has not got the completion, and so on the replica a failover promotes. Past it such a
/// replica holds nothing to complete (the completion there finds the claim lost), so no retry
/// can save the result any more: what the master has, its replicas get from it or not at all.
/// Meanwhile `renew` is called with that length every third of it, after a failed attempt:
/// where the store answers with the claim still in flight for its owner (a completion that has
/// not reached the node that answers), the lease, and this bound, move on. A renewal never sets
/// a lease longer than the one left at the start, so a crash of this process blocks the key no
/// longer than the coordinator's lease would.
pub(super) async fn keep_completing<F, Fut, R, RFut>(
    key: &RecordKey,
    retry_for: Duration,
    lease_left: Option<Duration>,
    mut attempt: F,
    mut renew: R,
) -> Option<GaveUp>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<Completion, StoreError>>,
    R: FnMut(Duration) -> RFut,
    RFut: std::future::Future<Output = Result<bool, StoreError>>,
{
    let started = tokio::time::Instant::now();
    let give_up_at = started + retry_for;
    let mut lease_ends = lease_left.map(|left| started + left);
    let mut renewed_at = started;
    let mut delay = Duration::from_millis(50);
    let mut last_error = None;
    let mut attempts = 1;
    loop {
        let now = tokio::time::Instant::now();
        let ends = lease_ends.map_or(give_up_at, |lease_ends| lease_ends.min(give_up_at));
        if now >= ends {
            break;
        }
        // The last attempt goes as the lease ends, when the claim may still be there.
        tokio::time::sleep(delay.min(ends - now)).await;
        delay = (delay * 2).min(Duration::from_secs(1));
        attempts += 1;
        match attempt().await {
            Ok(Completion::Durable) => {
                tracing::info!(?key, attempts, after = ?started.elapsed(), "the replicas acknowledged the completion");
                return None;
            }
            Ok(Completion::Lost) => {
                tracing::error!(
                    ?key,
                    attempts,
                    "the claim was lost before the replicas acknowledged its completion (a failover \
                     dropped it, or its lease ran out meanwhile): a retry of this key runs the \
                     operation again"
                );
                return Some(GaveUp::Lost);
            }
            Ok(Completion::NotAcknowledged(error)) | Err(error) => last_error = Some(error),
        }
        let Some(lease) = lease_left else { continue };
        if tokio::time::Instant::now() < renewed_at + lease / 3 {
            continue;
        }
        let sent = tokio::time::Instant::now();
        match renew(lease).await {
            Ok(true) => {
                tracing::debug!(
                    ?key,
                    "the claim was still in flight where the store answered; lease renewed"
                );
                renewed_at = sent;
                lease_ends = lease_ends.map(|ends| ends.max(sent + lease));
            }
            // The usual case: the master has the completion, and the claim is no longer in
            // flight there. A renewal is tried again a third of the lease later, in case a
            // failover puts a node that still has it in flight in its place.
            Ok(false) => renewed_at = sent,
            Err(error) => {
                tracing::debug!(?key, %error, "could not renew the lease of a completion not yet acknowledged")
            }
        }
    }
    let last_error = last_error.map(|error| error.to_string()).unwrap_or_default();
    if lease_ends.is_some_and(|lease_ends| lease_ends < give_up_at) {
        tracing::error!(
            ?key, attempts, error = %last_error,
            "the replicas did not acknowledge the completion before the claim's lease ended, \
             after which a promoted replica holds nothing to complete: if the master fails over \
             before they have it, a retry of this key runs the operation again"
        );
    } else {
        tracing::error!(
            ?key, attempts, error = %last_error,
            "the replicas did not acknowledge the completion within {retry_for:?}: if the master \
             fails over before they have it, a retry of this key runs the operation again"
        );
    }
    Some(GaveUp::TimedOut(last_error))
}

#[cfg(test)]
mod tests {

    #[test]
    fn the_replicas_are_counted_from_info_replication() {
        let info = "# Replication\r\nrole:master\r\nconnected_slaves:2\r\nslave0:ip=127.0.0.1,port=1,state=online\r\n";
        assert_eq!(super::connected_replicas(info), Some(2));
        assert_eq!(super::connected_replicas("role:master\r\n"), None);
    }

    /// A claim's lease is remembered until the claim is over, and leases that ended are swept
    /// once their entries double (a claim whose owner never completed nor released it).
    #[tokio::test(start_paused = true)]
    async fn a_lease_is_forgotten_when_its_claim_ends_and_ended_ones_are_swept() {
        use crate::store::record::OwnerToken;
        use tokio::time::Instant;

        let mut leases = super::Leases::default();
        let owner = OwnerToken::generate();
        leases.written(&owner, Instant::now() + Duration::from_secs(30));
        assert_eq!(leases.left(&owner), Some(Duration::from_secs(30)));
        tokio::time::advance(Duration::from_secs(10)).await;
        assert_eq!(leases.left(&owner), Some(Duration::from_secs(20)));
        leases.ends.remove(&owner);
        assert_eq!(leases.left(&owner), None);
        for _ in 0..super::FIRST_SWEEP {
            leases.written(&OwnerToken::generate(), Instant::now());
        }
        assert!(leases.ends.is_empty(), "{} ended leases kept", leases.ends.len());
    }

    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::time::Duration;

    use super::{keep_completing, Acked, Completion, GaveUp, StoreError};
    use crate::key::{IdempotencyKey, RecordKey};

    fn not_acknowledged() -> Result<Completion, StoreError> {
        Ok(Completion::NotAcknowledged(StoreError::NotReplicated {
            acknowledged: 0,
            wanted: 1,
        }))
    }

    fn key() -> RecordKey {
        RecordKey::new(None, IdempotencyKey::parse("unacknowledged").unwrap())
    }

    /// Replicas that never acknowledge, and renewals that find the claim no longer in flight (the
    /// master has the completion): the retries end as the lease left at the start ends, not after
    /// `retry_for` (60 s). Before, they went on for `retry_for` whatever the lease.
    #[tokio::test(start_paused = true)]
    async fn retries_end_with_the_lease_when_it_cannot_be_renewed() {
        let started = tokio::time::Instant::now();
        let renewals = AtomicUsize::new(0);
        let gave_up = keep_completing(
            &key(),
            Duration::from_secs(60),
            Some(Duration::from_secs(3)),
            || async { not_acknowledged() },
            |_| async {
                renewals.fetch_add(1, Ordering::SeqCst);
                Ok(false)
            },
        )
        .await;
        assert!(matches!(gave_up, Some(GaveUp::TimedOut(error)) if error.contains("acknowledged")));
        let took = started.elapsed();
        assert!(
            (Duration::from_secs(3)..Duration::from_millis(3100)).contains(&took),
            "{took:?}"
        );
        assert!(
            renewals.load(Ordering::SeqCst) >= 2,
            "renewed every third of the lease"
        );
    }

    /// Where the store answers with the claim still in flight, each renewal moves the end on:
    /// the retries go on past the lease left at the start, renewed with that length every third
    /// of it, until `retry_for`.
    #[tokio::test(start_paused = true)]
    async fn a_renewal_that_lands_keeps_the_retries_going_past_the_first_lease() {
        let started = tokio::time::Instant::now();
        let lengths = std::sync::Mutex::new(Vec::new());
        let gave_up = keep_completing(
            &key(),
            Duration::from_secs(10),
            Some(Duration::from_secs(3)),
            || async { Err(StoreError::Timeout(Duration::from_secs(2))) },
            |lease| {
                lengths.lock().unwrap().push(lease);
                async { Ok(true) }
            },
        )
        .await;
        assert!(matches!(gave_up, Some(GaveUp::TimedOut(_))));
        let took = started.elapsed();
        assert!(
            (Duration::from_secs(10)..Duration::from_millis(10100)).contains(&took),
            "{took:?}"
        );
        let lengths = lengths.into_inner().unwrap();
        assert!(lengths.len() >= 9, "{lengths:?}");
        assert!(lengths.iter().all(|lease| *lease == Duration::from_secs(3)));
    }

    /// The completion lands once the replicas answer: no give-up, however short the lease.
    #[tokio::test(start_paused = true)]
    async fn a_durable_completion_ends_the_retries() {
        let attempts = AtomicUsize::new(0);
        let gave_up = keep_completing(
            &key(),
            Duration::from_secs(60),
            Some(Duration::from_secs(3)),
            || async {
                match attempts.fetch_add(1, Ordering::SeqCst) {
                    0..=2 => not_acknowledged(),
                    _ => Ok(Completion::Durable),
                }
            },
            |_| async { Ok(false) },
        )
        .await;
        assert!(gave_up.is_none());
        assert_eq!(attempts.load(Ordering::SeqCst), 4);
    }

    /// A `WAITAOF` the replicas answered but the master's disk did not is not enough, and says
    /// which it lacked.
    #[test]
    fn the_master_disk_and_the_replicas_are_both_required() {
        let acked = |acknowledged, on_master| Acked {
            acknowledged,
            wanted: 1,
            on_master,
        };
        assert!(acked(1, true).enough());
        assert!(!acked(0, true).enough());
        assert!(!acked(1, false).enough());
        assert!(matches!(acked(1, false).into_error(), StoreError::NotFsynced));
        assert!(matches!(
            acked(0, true).into_error(),
            StoreError::NotReplicated {
                acknowledged: 0,
                wanted: 1
            }
        ));
    }
}
