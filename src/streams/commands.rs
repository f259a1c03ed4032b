//! The stream's Redis commands: the group, reading new entries, taking over idle ones, keeping a
//! held one, acknowledging and dead-lettering.

use std::future::Future;
use std::time::Duration;

use fred::clients::Client;
use fred::error::{Error, ErrorKind};
use fred::interfaces::{ClientLike, StreamsInterface, TransactionInterface};
use fred::types::Value;

use super::message::{entries, StreamMessage};
use crate::telemetry;

/// How long any one command to the stream's Redis (or the group of commands of one step) may
/// take, the consumer's and the publisher's: the client given may have no timeout of its own,
/// and neither may hang on a silent server, a consumer least of all while it stops. A blocking
/// read waits 200 ms of it.
const COMMAND_TIMEOUT: Duration = Duration::from_secs(5);

/// `command`, or a timeout error after [`COMMAND_TIMEOUT`].
pub(super) async fn bounded<T>(command: impl Future<Output = Result<T, Error>>) -> Result<T, Error> {
    match tokio::time::timeout(COMMAND_TIMEOUT, command).await {
        Ok(answer) => answer,
        Err(_) => Err(Error::new(
            ErrorKind::Timeout,
            format!("the stream's Redis did not answer in {COMMAND_TIMEOUT:?}"),
        )),
    }
}

/// The stream, its group, this consumer's name and the dead-letter stream: what every command
/// names.
#[derive(Clone, Debug)]
pub(super) struct Names {
    pub(super) stream: String,
    pub(super) group: String,
    pub(super) consumer: String,
    pub(super) dead_letter: String,
}

/// The group, created reading from the stream's start (with `MKSTREAM`) if missing; a group
/// that exists (`BUSYGROUP`, another consumer made it first) is used as it is. On a Cluster, the
/// stream and its dead-letter stream must share a slot, or every dead-lettering would fail with
/// `CROSSSLOT`: refused here, at the start.
pub(super) async fn prepare(redis: &Client, names: &Names) -> Result<(), Error> {
    let slot = fred::util::redis_keyslot;
    if redis.is_clustered() && slot(names.stream.as_bytes()) != slot(names.dead_letter.as_bytes()) {
        return Err(Error::new(
            ErrorKind::InvalidArgument,
            format!(
                "the stream {:?} and its dead-letter stream {:?} are in different Cluster slots; \
                 give the stream a hash tag (`{{{}}}`, whose dead-letter stream is `{{{}}}:dead`)",
                names.stream, names.dead_letter, names.stream, names.stream
            ),
        ));
    }
    match bounded(redis.xgroup_create::<Value, _, _, _>(&names.stream, &names.group, "0", true)).await {
        Err(error) if !error.details().starts_with("BUSYGROUP") => Err(error),
        _ => Ok(()),
    }
}

/// Up to `count` entries pending on other consumers for longer than `idle` (`XAUTOCLAIM`, from
/// `cursor`, which it moves on), each with its delivery count. The reply's third element lists
/// entries pending in the group but deleted or trimmed from the stream: the server drops them
/// from the pending list, so they are logged and counted here, or they would vanish unseen.
pub(super) async fn take_over(
    redis: &Client,
    names: &Names,
    idle: Duration,
    cursor: &mut String,
    count: usize,
) -> Result<Vec<StreamMessage>, Error> {
    // Typed `xautoclaim_values` drops the third element: read the raw reply.
    let reply: Value = bounded(redis.xautoclaim(
        &names.stream,
        &names.group,
        &names.consumer,
        idle.as_millis() as u64,
        cursor.as_str(),
        Some(count as u64),
        false,
    ))
    .await?;
    let mut reply = reply.into_array().into_iter();
    let next = reply.next().and_then(|next| next.into_string());
    *cursor = next.unwrap_or_else(|| "0-0".to_owned());
    let claimed = entries(reply.next().unwrap_or(Value::Null));
    let deleted: Vec<String> = (reply.next().unwrap_or(Value::Null).into_array().into_iter())
        .filter_map(|id| id.into_string())
        .collect();
    if !deleted.is_empty() {
        tracing::warn!(
            stream = %names.stream,
            group = %names.group,
            entries = ?deleted,
            "entries pending in the group were deleted or trimmed from the stream before they were processed; they are gone"
        );
        telemetry::stream_entries_deleted(deleted.len() as u64);
    }
    let mut messages = Vec::with_capacity(claimed.len());
    for (entry, fields) in claimed {
        let deliveries = deliveries(redis, names, &entry).await?;
        messages.push(StreamMessage::new(entry, fields, deliveries, true));
    }
    Ok(messages)
}

/// The group's delivery count of `entry` (`XPENDING`), which `XAUTOCLAIM` has just raised.
async fn deliveries(redis: &Client, names: &Names, entry: &str) -> Result<u64, Error> {
    let pending: Vec<(String, String, u64, u64)> =
        bounded(redis.xpending(&names.stream, &names.group, (entry, entry, 1))).await?;
    Ok(pending.first().map_or(1, |(_, _, _, count)| *count))
}

/// Up to `count` new entries (`XREADGROUP … >`), waiting up to `block` for the first.
pub(super) async fn read_new(
    redis: &Client,
    names: &Names,
    count: usize,
    block: Duration,
) -> Result<Vec<StreamMessage>, Error> {
    let reply: Value = bounded(redis.xreadgroup(
        &names.group,
        &names.consumer,
        Some(count as u64),
        Some(block.as_millis() as u64),
        false,
        &names.stream,
        ">",
    ))
    .await?;
    // RESP2: [[stream, entries]]; RESP3: {stream: entries}. One stream was read.
    let list = match reply {
        Value::Null => return Ok(Vec::new()),
        Value::Map(map) => map.inner().into_values().next(),
        other => other
            .into_array()
            .into_iter()
            .next()
            .and_then(|s| s.into_array().into_iter().nth(1)),
    };
    Ok(entries(list.unwrap_or(Value::Null))
        .into_iter()
        .map(|(entry, fields)| StreamMessage::new(entry, fields, 1, false))
        .collect())
}

/// Keeps `entry` on this consumer while it is held through a store outage: `XCLAIM … JUSTID`
/// to itself resets the entry's idle time without counting a delivery, so no other consumer
/// takes it over meanwhile. If the stream's Redis is down too, nobody can take it over anyway.
pub(super) async fn keep(redis: &Client, names: &Names, entry: &str) {
    let kept: Result<Value, Error> = bounded(redis.xclaim(
        &names.stream,
        &names.group,
        &names.consumer,
        0,
        entry,
        None,
        None,
        None,
        false,
        true,
    ))
    .await;
    if let Err(error) = kept {
        tracing::debug!(msg = %entry, %error, "could not keep the held message (XCLAIM)");
    }
}

/// `XACK`. A failure leaves the message pending: another consumer takes it over and gets the
/// stored result.
pub(super) async fn ack(redis: &Client, names: &Names, entry: &str) {
    if let Err(error) = bounded(redis.xack::<i64, _, _, _>(&names.stream, &names.group, entry)).await {
        tracing::warn!(msg = %entry, %error, "XACK failed; the message will be delivered again");
    }
}

/// Adds the message to the dead-letter stream with its own fields plus `reason` and `entry`
/// (its entry id), and acknowledges it, in one `MULTI`: a crash leaves it either pending or
/// dead-lettered, never both. The two streams share a slot on a Cluster (see [`prepare`]).
pub(super) async fn dead_letter(redis: &Client, names: &Names, message: &StreamMessage, reason: &str) {
    let mut fields: Vec<(String, Value)> = (message.fields().iter())
        .map(|(name, value)| (name.clone(), Value::Bytes(value.clone())))
        .collect();
    fields.push(("reason".into(), reason.into()));
    fields.push(("entry".into(), message.entry().into()));
    let transaction = redis.multi();
    let queued = async {
        let () = transaction
            .xadd(&names.dead_letter, false, None, "*", fields)
            .await?;
        let () = transaction
            .xack(&names.stream, &names.group, message.entry())
            .await?;
        transaction.exec::<Value>(true).await
    };
    if let Err(error) = bounded(queued).await {
        tracing::warn!(msg = %message.entry(), %error, "could not dead-letter; the message will be delivered again");
    }
}
