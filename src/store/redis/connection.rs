//! The connections the store opens and keeps: a client or pool, reconnecting clients that have
//! no reconnect policy, quitting the clients it made, the settings it connects with, and how a
//! failed command becomes a [`StoreError`].

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use fred::clients::{Client, Pool};
use fred::interfaces::ClientLike;
use fred::types::config::{Options, ReconnectPolicy};
use fred::types::{ClusterHash, CustomCommand, Value};

use crate::store::error::StoreError;

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
pub(super) enum Connection {
    Client(Client),
    Pool(Pool),
}

impl Connection {
    pub(super) fn client(&self) -> &Client {
        match self {
            Connection::Client(client) => client,
            Connection::Pool(pool) => pool.next(),
        }
    }

    pub(super) fn clients(&self) -> &[Client] {
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
pub(super) async fn revive(clients: Vec<Client>, reviving: Arc<AtomicBool>) {
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

/// `options` for a command sent at most once: fred sends an unanswered command again after a
/// reconnect (up to its attempts), which is harmless for most of this store's commands (every
/// transition but the claim checks the owner token, a claim re-sent finds its own record, and
/// a purge deletes only what its caller read at the key: `purge_args`), but not for these,
/// each sent with these options:
///
/// - `WAIT` and `WAITAOF` (`replica_acks.rs`), and the `CLIENT GETNAME` behind each: on a new
///   connection a `WAIT` counts nothing written there and answers at once, so an unreplicated
///   write would read as acknowledged.
///
/// Such a command whose connection drops before its answer fails, and its caller takes the
/// write as not acknowledged. (Not for writes: fred counts following a Cluster's `MOVED` as an
/// attempt, so a write sent once could not follow a failover.)
pub(super) fn sent_once(options: &Options) -> Options {
    Options {
        max_attempts: Some(1),
        ..options.clone()
    }
}

pub(super) fn unavailable(error: impl std::error::Error + Send + Sync + 'static) -> StoreError {
    StoreError::Unavailable(Box::new(error))
}

pub(super) fn from_fred(error: fred::error::Error, options: &Options) -> StoreError {
    match error.kind() {
        fred::error::ErrorKind::Timeout => StoreError::Timeout(options.timeout.unwrap_or_default()),
        // Also inside a script, where the reply wraps the server's `OOM` error.
        _ if error.details().contains("OOM command not allowed") => unavailable(OutOfMemory(error)),
        _ => unavailable(error),
    }
}

/// Reconnect forever, with backoff from 1 ms to 2 s.
pub(super) fn store_reconnect_policy() -> ReconnectPolicy {
    ReconnectPolicy::new_exponential(0, 1, 2_000, 2)
}

/// Whether `url`'s scheme asks for TLS (`rediss`, `rediss-cluster`, `rediss-sentinel`, and
/// their `valkeys` spellings).
pub(super) fn asks_for_tls(url: &str) -> bool {
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
pub(super) async fn warn_if_records_can_be_evicted(client: &Client) {
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
             noeviction (docs/running-redis.md)"
        ),
        None => tracing::debug!("INFO memory names no maxmemory_policy; not checked"),
    }
}

/// The `maxmemory_policy` field of an `INFO memory` answer.
pub(super) fn eviction_policy(info: &str) -> Option<&str> {
    info.lines()
        .find_map(|line| line.strip_prefix("maxmemory_policy:"))
        .map(str::trim)
}

/// Whether another attempt may succeed where this one failed: not for data this store cannot
/// read, which another attempt would read again.
pub(super) fn worth_retrying(error: &StoreError) -> bool {
    !matches!(error, StoreError::Corrupt(_) | StoreError::TooLarge { .. })
}
