//! The store's commands: the claim as one native `SET … NX GET`, the owner-checked transitions
//! as scripts (EVALSHA, reloaded on NOSCRIPT), what their answers mean, and the [`Store`]
//! implementation built on them.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use fred::clients::Client;
use fred::interfaces::{ClientLike, KeysInterface};
use fred::types::{ClusterHash, CustomCommand, Value};

use super::coalesce::{Command, ScriptCall, ScriptText};
use super::connection::store_reconnect_policy;
use super::notices::{settled_channel, Notices};
use super::record::{self, digest_from_hex};
use super::scripts::{
    as_flag, into_bytes, lease_millis, millis, unexpected, Script, COMPLETE, INSPECT, PURGE, RELEASE, RENEW,
    WAIT,
};
use super::store::{RedisStore, DEFAULT_COMMAND_TIMEOUT};
use crate::fingerprint::Fingerprint;
use crate::key::RecordKey;
use crate::replay_cache::ReplayCache;
use crate::store::contract::{KeyWatch, Store, StoreFuture};
use crate::store::error::StoreError;
use crate::store::record::{
    newer_record, ClaimOutcome, InFlightRecord, Oldest, OwnerToken, RecordInfo, RecordState,
};

impl RedisStore {
    /// What a claim (or a peek, without an `owner`) found in the record `existing`. A completed
    /// record is offered to the replay cache, if the cache heard no purge since `epoch`.
    pub(super) fn found(
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
            return newer_record(key, u32::from(version), owner, lease);
        }
        let found = record::parse(existing).map_err(StoreError::Corrupt)?;
        let ours = owner.is_some_and(|owner| found.owner == owner.as_str().as_bytes());
        let outcome = if found.state == record::IN_FLIGHT && ours {
            // This claim, re-sent by the client library after a dropped connection.
            ClaimOutcome::Claimed
        } else if found.fingerprint != *fingerprint.as_bytes() {
            ClaimOutcome::mismatch(fingerprint, found.policy)
        } else if found.state == record::IN_FLIGHT {
            ClaimOutcome::InFlight {
                lease_left: found.time_left.min(lease),
            }
        } else {
            if let (Some(cache), Some(epoch)) = (&self.cache, epoch) {
                let payload = found.payload.clone();
                let stored = found.stored_fingerprint();
                cache.insert(epoch, *key.digest(), stored, payload, found.time_left);
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
    pub(super) fn bound_copy(&self, cache: &Arc<ReplayCache>, key: &RecordKey) {
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

    /// [`Store::claim`] and [`Store::claim_waiting`].
    async fn claim_as(
        &self,
        claimant: Claimant,
        key: &RecordKey,
        fingerprint: &Fingerprint,
        owner: &OwnerToken,
        lease: Duration,
    ) -> Result<ClaimOutcome, StoreError> {
        self.keep_alive();
        if let Some(waiter) = &self.acks {
            // Boxed, like the other rare paths: inline, its state would size every claim.
            let acknowledged = self.claim_acknowledged(waiter, claimant, key, fingerprint, owner, lease);
            return Box::pin(acknowledged).await;
        }
        let pass = self.refuse_claims_during_failover().await?;
        let epoch = self.cache.as_deref().map(ReplayCache::epoch);
        let fresh = record::in_flight(owner, fingerprint, lease)?;
        let client = self.connection.client();
        let existing = match self.set_if_absent(client, claimant, key, fresh, lease).await? {
            Value::Null if self.fence_raised_since(pass) => return Err(self.failover_began(key)),
            Value::Null => return Ok(ClaimOutcome::Claimed),
            value => into_bytes(value)
                .ok_or_else(|| StoreError::Corrupt("unexpected answer to the claim".into()))?,
        };
        let outcome = self.found(key, &existing, fingerprint, Some(owner), lease, epoch)?;
        if outcome == ClaimOutcome::Claimed && self.fence_raised_since(pass) {
            // This claim, re-sent (the record is the one its first copy wrote), answered after
            // a failover began.
            return Err(self.failover_began(key));
        }
        Ok(outcome)
    }

    /// The claim's write: `SET key <record> NX PX <lease> GET`, or for a waiter `wait.lua`, which
    /// also marks another owner's in-flight record it finds. Answers `nil` (claimed) or the
    /// record found.
    pub(super) async fn set_if_absent(
        &self,
        client: &Client,
        claimant: Claimant,
        key: &RecordKey,
        record: Bytes,
        lease: Duration,
    ) -> Result<Value, StoreError> {
        if claimant == Claimant::Waiter {
            return self.run_on(client, &WAIT, key, &wait_args(record, lease)).await;
        }
        let set = Command::SetIfAbsent {
            key: self.redis_key(key).into(),
            value: record,
            lease_ms: lease_millis(lease),
        };
        let sent = self.coalescer.send(client, &self.options, set).await;
        sent.map_err(|e| self.failed_on_record(e))
    }

    /// Runs `script` on the record's key: EVALSHA, then EVAL if the server lost its script cache.
    pub(super) async fn run(
        &self,
        script: &Script,
        key: &RecordKey,
        args: &[Value],
    ) -> Result<Value, StoreError> {
        self.run_on(self.connection.client(), script, key, args).await
    }

    /// `purge.lua`'s arguments for `key`: the channel and message of the caches' invalidation,
    /// then what the key holds now (its first bytes, cut at the end of the owner for a record;
    /// or that it holds another type), so that the script deletes only that. A purge checks no
    /// owner, and fred sends an unanswered command again after a reconnect: without this, a
    /// purge sent again late would delete a claim made after it. One more round trip, on the
    /// operators' path only.
    pub(super) async fn purge_args(&self, key: &RecordKey) -> Result<[Value; 4], StoreError> {
        // A record's head is at most 6 bytes, an owner of up to 255 and its state.
        const HEAD: i64 = 6 + 255;
        let (kind, held) = match self.getrange(Value::from(self.redis_key(key)), HEAD).await? {
            Some(start) => {
                // A record: up to the end of its owner, which a completion since leaves as it is.
                let owner_ends = (start.starts_with(&record::LAYOUT_PREFIX)
                    || start.starts_with(&record::UNTAGGED_LAYOUT_PREFIX))
                .then(|| record::head_len(&start).map(|len| len - 9))
                .flatten()
                .filter(|&end| end <= start.len());
                (
                    "string",
                    owner_ends.map_or(start.clone(), |end| start.slice(..end)),
                )
            }
            None => ("other", Bytes::new()),
        };
        Ok([
            Value::from(self.purge_channel()),
            Value::from(key.digest_hex()),
            Value::from_static_str(kind),
            Value::Bytes(held),
        ])
    }

    /// [`run`](Self::run) on `client`.
    pub(super) async fn run_on(
        &self,
        client: &Client,
        script: &Script,
        key: &RecordKey,
        args: &[Value],
    ) -> Result<Value, StoreError> {
        let options = &self.options;
        let redis_key = Value::from(self.redis_key(key));
        // The durability option's completions each have a connection of their own, where nothing
        // could be merged with them: a trip through the coalescing task would buy nothing.
        let mergeable = script.per_record && self.acks.is_none();
        let send = |text| {
            let call = ScriptCall::new(text, redis_key.clone(), args, mergeable);
            self.coalescer.send(client, options, Command::Script(call))
        };
        let sent = match send(ScriptText::Sha1(script.sha1)).await {
            Err(error) if error.details().starts_with("NOSCRIPT") => {
                tracing::debug!(
                    script = script.name,
                    "script missing on the server; reloading it with EVAL"
                );
                send(ScriptText::Source(script.source)).await
            }
            sent => sent,
        };
        sent.map_err(|e| self.failed(e))
    }
}

impl Store for RedisStore {
    fn cached(&self, key: &RecordKey, fingerprint: &Fingerprint) -> Option<ClaimOutcome> {
        let copy = self.cache.as_deref()?.get(key.digest())?;
        Some(if copy.fingerprint == *fingerprint {
            ClaimOutcome::Completed(copy.payload)
        } else {
            ClaimOutcome::mismatch(fingerprint, copy.fingerprint.policy())
        })
    }

    fn claim<'a>(
        &'a self,
        key: &'a RecordKey,
        fingerprint: &'a Fingerprint,
        owner: &'a OwnerToken,
        lease: Duration,
    ) -> StoreFuture<'a, ClaimOutcome> {
        Box::pin(self.claim_as(Claimant::Caller, key, fingerprint, owner, lease))
    }

    /// `wait.lua`: the claim, and the mark on another owner's in-flight record it finds, in one
    /// step (the lowest bit of its in-flight deadline), so that record's completion or release
    /// tells the waiters.
    fn claim_waiting<'a>(
        &'a self,
        key: &'a RecordKey,
        fingerprint: &'a Fingerprint,
        owner: &'a OwnerToken,
        lease: Duration,
    ) -> StoreFuture<'a, ClaimOutcome> {
        Box::pin(self.claim_as(Claimant::Waiter, key, fingerprint, owner, lease))
    }

    fn peek<'a>(
        &'a self,
        key: &'a RecordKey,
        fingerprint: &'a Fingerprint,
    ) -> StoreFuture<'a, Option<ClaimOutcome>> {
        Box::pin(async move {
            let epoch = self.cache.as_deref().map(ReplayCache::epoch);
            let get = Command::Get {
                key: self.redis_key(key).into(),
            };
            let sent = self
                .coalescer
                .send(self.connection.client(), &self.options, get)
                .await;
            let existing = match sent.map_err(|e| self.failed_on_record(e))? {
                Value::Null => return Ok(None),
                value => {
                    into_bytes(value).ok_or_else(|| StoreError::Corrupt("unexpected answer to GET".into()))?
                }
            };
            self.found(key, &existing, fingerprint, None, Duration::MAX, epoch)
                .map(Some)
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
            let completion = CompletionCall {
                head: record::head(owner)?,
                state: record::state_until(record::COMPLETED, retention),
                payload,
                retention,
            };
            match &self.acks {
                // Written again, on the new master, if a failover began while it was on its way
                // (see `Fence::raised_since`): a completed record by this owner is written again.
                None => loop {
                    let pass = self.fence_pass().await;
                    let completed = self.run(&COMPLETE, key, &completion.script_args()).await?;
                    let done = as_flag("complete", completed)?;
                    if !self.fence_raised_since(pass) {
                        return Ok(done);
                    }
                    tracing::info!(?key, "a failover began while a completion was on its way; completing again once it is over");
                },
                Some(waiter) => {
                    let acknowledged = self.complete_acknowledged(waiter, key, owner, completion);
                    Box::pin(acknowledged).await
                }
            }
        })
    }

    fn release<'a>(&'a self, key: &'a RecordKey, owner: &'a OwnerToken) -> StoreFuture<'a, bool> {
        Box::pin(async move {
            let head = record::head(owner)?;
            self.after_failover().await;
            let released = self.run(&RELEASE, key, &[Value::Bytes(head)]).await;
            if let Some(waiter) = &self.acks {
                waiter.forget_lease(owner);
            }
            as_flag("release", released?)
        })
    }

    fn renew<'a>(
        &'a self,
        key: &'a RecordKey,
        owner: &'a OwnerToken,
        lease: Duration,
    ) -> StoreFuture<'a, bool> {
        Box::pin(async move {
            // The lease's end as written, no later than the record's deadline says.
            let sent = tokio::time::Instant::now();
            let args = renew_args(owner, lease)?;
            self.after_failover().await;
            let renewed = as_flag("renew", self.run(&RENEW, key, &args).await?)?;
            if let Some(waiter) = &self.acks {
                waiter.lease_written(owner, renewed.then_some(sent + lease));
            }
            Ok(renewed)
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
    /// store's subscriber connection, opened with the first waiter. A completion or release
    /// publishes on it (`SPUBLISH`) only for a record marked as waited for, which a waiter's
    /// every read marks ([`claim_waiting`](Store::claim_waiting), `wait.lua`); a purge always
    /// publishes. Waiters on one key share one subscription.
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
            let args = self.purge_args(key).await?;
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
                let mut page = match tokio::time::timeout(timeout, pages.next()).await {
                    Err(_) => return Err(StoreError::Timeout(timeout)),
                    Ok(None) => break,
                    Ok(Some(page)) => page.map_err(|e| self.failed(e))?,
                };
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

    /// While the Sentinel fence is up (see `sentinel`): until it is lowered.
    fn writes_held(&self) -> Option<StoreFuture<'_, ()>> {
        let fence = self.fence().filter(|fence| fence.is_raised())?;
        Some(Box::pin(async move {
            fence.until_lowered().await;
            Ok(())
        }))
    }
}

/// `wait.lua`'s arguments: the in-flight `record` to write, its lease, and the layouts' prefixes
/// by which it knows a record.
pub(super) fn wait_args(record: Bytes, lease: Duration) -> [Value; 4] {
    [
        Value::Bytes(record),
        millis(lease),
        Value::Bytes(Bytes::from_static(&record::LAYOUT_PREFIX)),
        Value::Bytes(Bytes::from_static(&record::UNTAGGED_LAYOUT_PREFIX)),
    ]
}

/// `renew.lua`'s arguments: the owner's head, and the new lease's state and length.
pub(super) fn renew_args(owner: &OwnerToken, lease: Duration) -> Result<[Value; 3], StoreError> {
    Ok([
        Value::Bytes(record::head(owner)?),
        Value::Bytes(record::state_until(record::IN_FLIGHT, lease)),
        millis(lease),
    ])
}

/// Who claims: a caller (`SET … NX GET`), or a request waiting for the key (`wait.lua`, which
/// marks the in-flight record it finds as waited for).
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(super) enum Claimant {
    Caller,
    Waiter,
}

/// A completion's parts: complete.lua's arguments for one record.
pub(super) struct CompletionCall {
    /// The owner's head (magic, version, owner).
    pub(super) head: Bytes,
    /// `'C'` and the retention's deadline.
    pub(super) state: Bytes,
    pub(super) payload: Bytes,
    pub(super) retention: Duration,
}

impl CompletionCall {
    /// complete.lua's arguments for this record: the head, the state and the payload, from
    /// which the script builds the completed record with the fingerprint it finds (the payload
    /// goes as it is, not copied into one string here), and the retention.
    pub(super) fn script_args(&self) -> [Value; 4] {
        [
            Value::Bytes(self.head.clone()),
            Value::Bytes(self.state.clone()),
            Value::Bytes(self.payload.clone()),
            millis(self.retention),
        ]
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
        let Some(mut start) = self.first_bytes(name, GUESS).await? else {
            return Ok(None);
        };
        let cut = record::head_len(&start).filter(|&needed| needed > start.len() && start.len() == GUESS);
        if let Some(needed) = cut {
            let Some(whole) = self.first_bytes(name, needed).await? else {
                return Ok(None);
            };
            start = whole;
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
        let len = i64::try_from(len).unwrap_or(i64::MAX);
        let start = self.getrange(Value::from(name.clone()), len).await?;
        Ok(start.filter(|bytes| !bytes.is_empty()))
    }

    /// `GETRANGE key 0 len-1`: the first `len` bytes the key holds (none when it is gone), or
    /// `None` when it holds another type than a string.
    async fn getrange(&self, key: Value, len: i64) -> Result<Option<Bytes>, StoreError> {
        let client = self.connection.client().with_options(&self.options);
        let getrange = CustomCommand::new_static("GETRANGE", ClusterHash::FirstKey, false);
        let args = vec![key, Value::Integer(0), Value::Integer(len - 1)];
        match client.custom::<Value, Value>(getrange, args).await {
            Ok(value) => Ok(Some(into_bytes(value).unwrap_or_default())),
            Err(error) if error.details().starts_with("WRONGTYPE") => Ok(None),
            Err(error) => Err(self.failed(error)),
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::super::fence_tests::Server;
    use super::super::scripts::PURGE;
    use super::super::RedisStore;
    use crate::{ClaimOutcome, Fingerprint, IdempotencyKey, OwnerToken, RecordKey, Store};

    /// A purge that fred sends again late (its answer lost with its connection, the command
    /// re-sent on the next) runs after a newer claim on the key: it deletes nothing, since it
    /// deletes only what its caller read there. Before, `purge.lua` deleted whatever was there.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_purge_sent_again_late_deletes_no_newer_claim() {
        let server = Server::start();
        let store = RedisStore::connect(&server.url()).await.expect("connect");
        let key = RecordKey::new(None, IdempotencyKey::parse("purged-then-claimed").expect("a key"));
        let fingerprint = Fingerprint::new([b"{}".as_slice()]);
        let lease = Duration::from_secs(30);
        let claim = |owner: OwnerToken| {
            let store = store.clone();
            let key = key.clone();
            async move { store.claim(&key, &fingerprint, &owner, lease).await }
        };
        assert_eq!(
            claim(OwnerToken::generate()).await.expect("claim"),
            ClaimOutcome::Claimed
        );

        let args = store.purge_args(&key).await.expect("read the key");
        let purged = store.run(&PURGE, &key, &args).await.expect("purge");
        assert_eq!(
            purged,
            fred::types::Value::Integer(1),
            "the first purge deletes the claim"
        );
        let newer = OwnerToken::generate();
        assert_eq!(claim(newer.clone()).await.expect("claim"), ClaimOutcome::Claimed);
        // The same purge, sent again.
        let again = store.run(&PURGE, &key, &args).await.expect("purge again");
        assert_eq!(
            again,
            fred::types::Value::Integer(0),
            "a late purge deleted a newer claim"
        );
        assert!(
            matches!(claim(newer.clone()).await, Ok(ClaimOutcome::Claimed)),
            "the newer claim is still there (its owner finds its own record)"
        );
        // A purge made now deletes it, and one of a key holding another type still works.
        assert!(store.purge(&key).await.expect("purge"));
    }
}
