//! The durability option's claim and completion ([`RedisStore::with_replica_acks`]): each on a
//! connection of its own, waiting there until the replicas (or the master's disk) have it.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use fred::clients::Client;
use fred::interfaces::ClientLike;
use fred::types::config::Options;
use fred::types::{ClusterHash, CustomCommand, Value};

use super::coalesce::{ScriptCall, ScriptText};
use super::commands::{renew_args, wait_args, Claimant, CompletionCall};
use super::connection::{self, worth_retrying};
use super::record;
use super::replica_acks::{keep_completing, name_check, Acked, Completion, GaveUp, Marker, Waiter};
use super::scripts::{as_flag, into_bytes, millis, COMPLETE, RELEASE, RENEW, WAIT};
use super::store::{RedisStore, DEFAULT_COMMAND_TIMEOUT};
use crate::fingerprint::Fingerprint;
use crate::key::RecordKey;
use crate::reconciliation::{self, ReconciliationKind};
use crate::replay_cache::ReplayCache;
use crate::store::error::{FailingOver, StoreError, Unacknowledged};
use crate::store::record::{ClaimOutcome, OwnerToken};

/// The answers of the writes sent with a WAIT behind them, and what the WAIT said.
type WrittenThenWaited = (Vec<Result<Value, fred::error::Error>>, Result<Acked, StoreError>);

/// The durability option's claim and completion ([`RedisStore::with_replica_acks`]).
impl RedisStore {
    /// Claims on a connection of its own, then waits there until the replicas have the claim.
    /// Anything but a new (or re-sent) claim is answered at once: only a claim needs to survive.
    /// Refused at a raised Sentinel fence, and when one was raised before the replicas answered.
    pub(super) async fn claim_acknowledged(
        &self,
        waiter: &Waiter,
        claimant: Claimant,
        key: &RecordKey,
        fingerprint: &Fingerprint,
        owner: &OwnerToken,
        lease: Duration,
    ) -> Result<ClaimOutcome, StoreError> {
        let pass = self.refuse_claims_during_failover().await?;
        let epoch = self.cache.as_deref().map(ReplayCache::epoch);
        // The lease's end as written, no later than the record's deadline says.
        let mut sent = tokio::time::Instant::now();
        let fresh = record::in_flight(owner, fingerprint, lease)?;
        let client = waiter.acquire().await;
        let (marker, unnamed) = waiter.marker(&client);
        let name = unnamed.then_some(&marker);
        let answer = self
            .claim_marked(&client, name, claimant, key, fresh, lease)
            .await?;
        if answer != Value::Null {
            let existing = into_bytes(answer)
                .ok_or_else(|| StoreError::Corrupt("unexpected answer to the claim".into()))?;
            let outcome = self.found(key, &existing, fingerprint, Some(owner), lease, epoch)?;
            if outcome != ClaimOutcome::Claimed {
                return Ok(outcome);
            }
            // This claim, re-sent after a dropped connection: it was written on another
            // connection, and WAIT counts only this one's writes. Renewing it here writes it again.
            sent = tokio::time::Instant::now();
            let args = renew_args(owner, lease)?;
            if !as_flag("renew", self.run_on(&client, &RENEW, key, &args).await?)? {
                return Err(StoreError::Unavailable(
                    "the claim expired while it was re-sent; retry".into(),
                ));
            }
        }
        waiter.lease_written(owner, Some(sent + lease));
        // A reconnect between the claim and here, or during the WAIT, fails the check behind
        // the WAIT: the claim counts as not acknowledged, and is released below.
        let error = match waiter.wait(&client, &self.redis_key(key), &marker).await {
            // Acknowledged, perhaps by a replica of a master being replaced: see
            // `Fence::raised_since`.
            Ok(acked) if acked.enough() && self.fence_raised_since(pass) => self.failover_began(key),
            Ok(acked) if acked.enough() => return Ok(ClaimOutcome::Claimed),
            Ok(acked) => acked.into_error(),
            Err(error) => StoreError::Unavailable(Box::new(Unacknowledged(error))),
        };
        // Nobody may run on a claim a failover can lose. The release follows the claim to the
        // replicas; the coordinator also queues one, in case this one fails.
        let head = record::head(owner)?;
        waiter.forget_lease(owner);
        if let Err(release_error) = self.run_on(&client, &RELEASE, key, &[Value::Bytes(head)]).await {
            tracing::debug!(?key, %release_error, "could not release an unacknowledged claim");
        }
        tracing::warn!(?key, %error, "a claim not acknowledged (in time, or before a failover began); released it (503)");
        Err(error)
    }

    /// The claim's write (`SET key <record> NX PX <lease> GET`, or for a waiter `wait.lua`: see
    /// [`set_if_absent`](Self::set_if_absent)) on `client`'s connection, behind `CLIENT SETNAME
    /// <name>` in the same round trip if the connection is to be named, so that the WAIT after
    /// it can tell that it runs on the claim's connection (see `replica_acks`). Answers `nil`
    /// (claimed) or the record found.
    async fn claim_marked(
        &self,
        client: &Client,
        name: Option<&Marker>,
        claimant: Claimant,
        key: &RecordKey,
        record: Bytes,
        lease: Duration,
    ) -> Result<Value, StoreError> {
        let redis_key = self.redis_key(key);
        let write = |text| match claimant {
            Claimant::Waiter => {
                let args = wait_args(record.clone(), lease);
                ScriptCall::new(text, Value::from(redis_key.clone()), &args, false).into_parts()
            }
            Claimant::Caller => (
                CustomCommand::new_static("SET", ClusterHash::FirstKey, false),
                vec![
                    Value::from(redis_key.clone()),
                    Value::Bytes(record.clone()),
                    Value::from_static_str("NX"),
                    Value::from_static_str("PX"),
                    millis(lease),
                    Value::from_static_str("GET"),
                ],
            ),
        };
        let send = |text| {
            self.marked(
                client,
                name,
                &redis_key,
                vec![write(text)],
                Vec::new(),
                &self.options,
            )
        };
        let answer = match send(ScriptText::Sha1(WAIT.sha1)).await.pop() {
            Some(Err(error)) if error.details().starts_with("NOSCRIPT") => {
                send(ScriptText::Source(WAIT.source)).await.pop()
            }
            answer => answer,
        };
        let answer = answer.ok_or_else(|| StoreError::Corrupt("no answer to the claim".into()))?;
        answer.map_err(|error| self.failed_on_record(error))
    }

    /// `CLIENT SETNAME <name>` if given, then `commands`, then `sent_once`, in one pipeline on
    /// `client`'s connection (to the node holding `redis_key`; fred writes them in that order
    /// without waiting for an answer), with `options`. The writes may be sent again (fred after a
    /// reconnect, or to follow a cluster's `MOVED`): harmless for them, and the name check tells;
    /// `sent_once` never are (`connection::sent_once`). Answers each command's answer, in order
    /// (a failed `SETNAME` fails the WAIT's check later, not these).
    async fn marked(
        &self,
        client: &Client,
        name: Option<&Marker>,
        redis_key: &str,
        commands: Vec<(CustomCommand, Vec<Value>)>,
        sent_once: Vec<(CustomCommand, Vec<Value>)>,
        options: &Options,
    ) -> Vec<Result<Value, fred::error::Error>> {
        let pipeline = client.pipeline();
        let count = commands.len() + sent_once.len();
        let once = connection::sent_once(options);
        let naming = name.map(|name| name.command(redis_key));
        let named = usize::from(naming.is_some());
        let writes = naming.into_iter().chain(commands);
        let commands = writes
            .map(|command| (command, options))
            .chain(sent_once.into_iter().map(|command| (command, &once)));
        for ((command, args), options) in commands {
            // Queued in memory: these answer at once.
            let queued: Result<(), _> = pipeline.with_options(options).custom(command, args).await;
            if let Err(error) = queued {
                return vec![Err(error); count];
            }
        }
        let mut answers = pipeline.try_all::<Value>().await;
        if answers.len() == count + named {
            return answers.split_off(named);
        }
        // fred answers a pipeline that failed as a whole with one error.
        let error = match answers.pop() {
            Some(Err(error)) => error,
            _ => fred::error::Error::new(fred::error::ErrorKind::Unknown, "no answer to the pipeline"),
        };
        vec![Err(error); count]
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
    pub(super) async fn complete_acknowledged(
        &self,
        waiter: &Arc<Waiter>,
        key: &RecordKey,
        owner: &OwnerToken,
        call: CompletionCall,
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
        let hook = reconciliation::in_force();
        // The lease the claim has, as this process last wrote it (the claim, or its last
        // renewal): a replica that lacks the completion, and so one a failover promotes, holds
        // the claim by that lease. The background retries are bounded by it, and renew it.
        let lease_left = waiter.lease_left(owner);
        let owner = owner.clone();
        let completing = async move {
            let _owned = owned;
            let payload = Some(call.payload.clone());
            let tell = |kind| reconciliation::report(hook.as_ref(), kind, &record, &owner, payload.as_ref());
            let first = store.complete_once_acknowledged(&waiter, &record, &call).await;
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
                let attempt = || store.complete_once_acknowledged(&waiter, &record, &call);
                // Renewed on the store's own connection, where the claim is still in flight.
                let renew = |lease| crate::store::contract::Store::renew(&store, &record, &owner, lease);
                match keep_completing(&record, retry_for, lease_left, attempt, renew).await {
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
    pub(super) async fn complete_once_acknowledged(
        &self,
        waiter: &Waiter,
        key: &RecordKey,
        call: &CompletionCall,
    ) -> Result<Completion, StoreError> {
        let pass = self.fence_pass().await;
        let client = waiter.acquire().await;
        let (completed, acked) = self.complete_then_wait(waiter, &client, key, call).await?;
        if self.fence_raised_since(pass) {
            // Acknowledged or not, perhaps on a master being replaced (see
            // `Fence::raised_since`): written again on the new master.
            tracing::info!(
                ?key,
                "a failover began while a completion was on its way; completing again once it is over"
            );
            return Ok(Completion::NotAcknowledged(StoreError::Unavailable(Box::new(
                FailingOver,
            ))));
        }
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
    pub(super) async fn complete_then_wait(
        &self,
        waiter: &Waiter,
        client: &Client,
        key: &RecordKey,
        call: &CompletionCall,
    ) -> Result<(Value, Result<Acked, StoreError>), StoreError> {
        let redis_key = self.redis_key(key);
        let args = call.script_args();
        let write = |text| {
            let call = ScriptCall::new(text, Value::from(redis_key.clone()), &args, false);
            self.write_then_wait(waiter, client, &redis_key, vec![call.into_parts()])
        };
        let (mut written, mut acked) = write(ScriptText::Sha1(COMPLETE.sha1)).await?;
        if matches!(written.first(), Some(Err(error)) if error.details().starts_with("NOSCRIPT")) {
            // The server lost its scripts (a failover, a flush): the same, by source.
            (written, acked) = write(ScriptText::Source(COMPLETE.source)).await?;
        }
        let completed = written
            .pop()
            .ok_or_else(|| StoreError::Corrupt("unexpected answer to the completion".into()))?;
        Ok((completed.map_err(|error| self.failed(error))?, acked))
    }

    /// `CLIENT SETNAME <marker>`, `writes`, the WAIT and `CLIENT GETNAME`, in one round trip on
    /// `client`'s connection ([`marked`](Self::marked)), so the WAIT counts the writes, and the
    /// name read behind it says whether it ran on their connection (see `replica_acks`), bounded
    /// by the wait's timeout; the WAIT and the name check are sent once. Answers the answers
    /// of `writes`, and what the WAIT said (an error if it ran on another connection than theirs).
    async fn write_then_wait(
        &self,
        waiter: &Waiter,
        client: &Client,
        redis_key: &str,
        writes: Vec<(CustomCommand, Vec<Value>)>,
    ) -> Result<WrittenThenWaited, StoreError> {
        let (marker, unnamed) = waiter.marker(client);
        let wait = vec![waiter.wait_command(redis_key), name_check(redis_key)];
        let options = waiter.wait_options();
        let name = unnamed.then_some(&marker);
        let mut answers = self.marked(client, name, redis_key, writes, wait, options).await;
        let (named, waited) = (answers.pop(), answers.pop());
        let acked = waiter.checked(&marker, waited, named);
        if acked.is_err() {
            waiter.forget_name(client);
        }
        Ok((answers, acked))
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use fred::interfaces::ClientLike;

    use super::super::commands::Claimant;
    use super::super::fence_tests::Server;
    use super::super::{record, RedisStore, ReplicaAcks};
    use crate::{Fingerprint, IdempotencyKey, OwnerToken, RecordKey, StoreError};

    /// A store on `server` with the durability option `acks` (requiring no replica: the
    /// server has none), and its waiter.
    async fn store_waiting_for_no_replica(
        server: &Server,
        acks: ReplicaAcks,
    ) -> (RedisStore, std::sync::Arc<super::Waiter>) {
        let store = RedisStore::connect(&server.url())
            .await
            .expect("connect")
            .with_replica_acks(acks)
            .await
            .expect("the waiting connections");
        let waiter = store.acks.clone().expect("the durability option");
        (store, waiter)
    }

    /// The check behind every `WAIT`: a claim written on one connection, then the connection
    /// replaced (as the heartbeat or a Sentinel switch replaces one, or fred after a drop) before
    /// the `WAIT` is sent. The `WAIT` runs on the new connection, where it counts nothing (with
    /// no replica required it answers at once, as Redis 7.2 and later answer a new connection's
    /// `WAIT` with every online replica), and the name read behind it says so: not acknowledged.
    /// Without the replacement the same `WAIT` counts. Fails if the name is not checked.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_wait_on_a_connection_replaced_since_its_write_is_not_acknowledged() {
        let server = Server::start();
        let (store, waiter) = store_waiting_for_no_replica(&server, ReplicaAcks::new(0)).await;
        let lease = Duration::from_secs(30);
        let fingerprint = Fingerprint::new([b"{}".as_slice()]);
        for replaced in [false, true] {
            let key = RecordKey::new(
                None,
                IdempotencyKey::parse(&format!("replaced-{replaced}")).expect("a key"),
            );
            let owner = OwnerToken::generate();
            let claim = record::in_flight(&owner, &fingerprint, lease).expect("a record");
            let client = waiter.acquire().await;
            let (marker, unnamed) = waiter.marker(&client);
            let claimed = store
                .claim_marked(
                    &client,
                    unnamed.then_some(&marker),
                    Claimant::Caller,
                    &key,
                    claim,
                    lease,
                )
                .await
                .expect("the claim");
            assert_eq!(claimed, fred::types::Value::Null, "a new key is claimed");
            if replaced {
                client.force_reconnection().await.expect("a new connection");
            }
            let acked = waiter.wait(&client, &store.redis_key(&key), &marker).await;
            match (replaced, acked) {
                (false, Ok(acked)) => assert!(acked.enough(), "no replica is required"),
                (true, Err(StoreError::Unavailable(error))) => {
                    assert!(error.to_string().contains("replaced"), "{error}")
                }
                (replaced, acked) => panic!("replaced: {replaced}, WAIT answered {acked:?}"),
            }
        }
    }

    /// A connection replaced before its write (as a Sentinel switch or the heartbeat replaces
    /// one) is named again by that write, so its `WAIT` counts. Before, the waiter remembered the
    /// old connection's name and sent none, the check behind the `WAIT` read none, and the
    /// claim was answered 503: after a failover, once on each connection of the pool (and a
    /// completion's background attempts, each on another one, gave its result up in a storm).
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_connection_replaced_before_its_write_is_named_again() {
        use crate::{ClaimOutcome, Store};

        let server = Server::start();
        // One connection: the one replaced is the one the next claim takes.
        let acks = ReplicaAcks::new(0).connections(1);
        let (store, waiter) = store_waiting_for_no_replica(&server, acks).await;
        let (lease, fingerprint) = (Duration::from_secs(30), Fingerprint::new([b"{}".as_slice()]));
        let key = |name: &str| RecordKey::new(None, IdempotencyKey::parse(name).expect("a key"));
        let (first, second) = (key("first"), key("second"));
        let (first_owner, second_owner) = (OwnerToken::generate(), OwnerToken::generate());
        let claimed = store.claim(&first, &fingerprint, &first_owner, lease).await;
        assert_eq!(claimed.expect("the first claim"), ClaimOutcome::Claimed);

        let client = waiter.acquire().await;
        assert!(waiter.is_named(&client), "the first claim named the connection");
        client.force_reconnection().await.expect("a new connection");
        // fred tells of the new connection a moment later.
        let told = tokio::time::Instant::now() + Duration::from_secs(1);
        while waiter.is_named(&client) && tokio::time::Instant::now() < told {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        drop(client);
        let claimed = store.claim(&second, &fingerprint, &second_owner, lease).await;
        assert!(
            matches!(claimed, Ok(ClaimOutcome::Claimed)),
            "the claim on the new connection: {claimed:?}"
        );
    }
}
