//! Concurrent commands to Redis sent in shared socket writes.
//!
//! fred writes a command without flushing its socket only while more commands wait in its queue,
//! and flushes after every script and custom command whatever waits. Under load that queue is
//! nearly always empty: a request hands fred its command, fred's connection task is woken into
//! the same worker's next slot and writes that command alone. So at 32 concurrent requests
//! nearly every claim and every completion cost a `writev` of its own here and a read of its own
//! in Redis: the largest cost of a request after the round trip itself (`bench/profile.md`).
//!
//! A [`Coalescer`] sends a command directly when no other is outstanding, so a lone request
//! (concurrency 1) pays nothing. Otherwise it queues the command for one task which steps back
//! once behind the tasks already ready on its worker (the requests about to send theirs), then
//! hands fred everything queued in one go: first the commands fred feeds without a flush (the
//! claim is fred's own `SET`), then the completions, merged into one call of the completion
//! script per connection (complete.lua takes any number of records), since fred would write each
//! script call alone. A batch of claims, replays and completions thus leaves in one write.
//! Other scripts are sent directly: they are rare, and fred writes them alone anyway; so are
//! completions on a Cluster, where every record's key has a slot of its own. Each command keeps
//! its own answer, timeout and retries. A command whose caller gives up after
//! queueing it is still sent, as it would be once fred had it, but with only what is left of
//! its timeout: fred's timeout starts when fred takes the command, and a command that waited in
//! the queue would otherwise get a whole new one, and could be sent after the layer, whose own
//! bound started with the call, has given up on it. One whose timeout ran out in the queue is
//! answered as timed out and never sent.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock};

use bytes::Bytes;
use fred::clients::Client;
use fred::error::{Error, ErrorKind};
use fred::interfaces::{ClientLike, KeysInterface};
use fred::types::config::Options;
use fred::types::{ClusterHash, CustomCommand, Expiration, Key, SetOptions, Value};
use futures_util::stream::{FuturesUnordered, StreamExt};
use tokio::sync::{mpsc, oneshot};

/// A command to send.
pub(crate) enum Command {
    /// `SET key value NX PX lease GET`, through fred's own `SET`: fred flushes its socket after
    /// every custom command and script, but not after a `SET` with more queued behind it.
    SetIfAbsent { key: Key, value: Bytes, lease_ms: i64 },
    /// `GET key`.
    Get { key: Key },
    /// A call of one of the crate's scripts on one record.
    Script(ScriptCall),
}

/// How a script call names its script: `EVALSHA` with its SHA-1, or `EVAL` with its source (to
/// load it again after a `NOSCRIPT`).
#[derive(Clone, Copy, PartialEq, Eq)]
pub(crate) enum ScriptText {
    Sha1(&'static str),
    Source(&'static str),
}

/// `EVALSHA sha 1 key arg…` (or `EVAL source 1 key arg…`): the one place these are built.
pub(crate) struct ScriptCall {
    script: ScriptText,
    /// Everything after the command's name: the SHA-1 or source, 1, the key, the arguments.
    args: Vec<Value>,
    /// Whether calls queued together for one connection may go as one call for many records,
    /// `EVALSHA sha n key… arg…`, answered with one value per record (complete.lua): fred writes
    /// every script call in a write of its own, so one call for many records is one write.
    mergeable: bool,
}

/// Where a script call's key is in [`ScriptCall::args`]; the record's arguments follow it.
const KEY_AT: usize = 2;

impl ScriptCall {
    pub(crate) fn new(script: ScriptText, key: Value, args: &[Value], mergeable: bool) -> Self {
        let text = match script {
            ScriptText::Sha1(text) | ScriptText::Source(text) => text,
        };
        let mut all = Vec::with_capacity(KEY_AT + 1 + args.len());
        all.push(Value::from_static_str(text));
        all.push(Value::Integer(1));
        all.push(key);
        all.extend_from_slice(args);
        Self {
            script,
            args: all,
            // Only by SHA-1: a call by source is the rare reload after a script flush.
            mergeable: mergeable && matches!(script, ScriptText::Sha1(_)),
        }
    }

    /// The command and its arguments, to send on a connection's own (in a pipeline).
    pub(crate) fn into_parts(self) -> (CustomCommand, Vec<Value>) {
        (self.command(), self.args)
    }

    /// The command, routed to the slot of its first key (argument 2), not to that of the SHA-1
    /// or source (the first argument, which fred would hash by default). fred hashes only when
    /// it routes, so a standalone server pays nothing for it.
    fn command(&self) -> CustomCommand {
        let name = match self.script {
            ScriptText::Sha1(_) => "EVALSHA",
            ScriptText::Source(_) => "EVAL",
        };
        CustomCommand::new_static(name, ClusterHash::Offset(KEY_AT), false)
    }
}

/// At most this many records in one merged script call, and at most [`MAX_MERGED_BYTES`] of
/// arguments: a script blocks Redis while it runs, and a retry resends the whole call.
const MAX_MERGED: usize = 32;
const MAX_MERGED_BYTES: usize = 64 * 1024;

impl Command {
    /// Whether nothing could share this command's write: fred flushes its socket after every
    /// script call, and on a Cluster every record has a slot of its own (its key's hash tag), so
    /// no two calls could be one.
    fn is_sent_alone(&self, client: &Client) -> bool {
        match self {
            Command::Script(call) => !call.mergeable || client.is_clustered(),
            Command::SetIfAbsent { .. } | Command::Get { .. } => false,
        }
    }

    /// Sends the command and waits for its answer.
    ///
    /// Each fred call is boxed where it is made: a fred command's future is about 6.8 KB, and
    /// inline it would size this future, and every future holding it (the coalescing task's
    /// sends, each store future around a direct send). Every such future is moved to the heap
    /// once (boxed, or pushed to the coalescing task's set): with the calls inline (and a
    /// compare-and-set arm, since removed, that held two) that copied 14 KB per command, claims
    /// and replays too (`memmove` took 9.8 % of the app server's CPU); boxed, each call copies
    /// its own future once (7.2 %).
    async fn send(self, client: &Client, options: &Options) -> Result<Value, Error> {
        let client = client.with_options(options);
        match self {
            Command::SetIfAbsent { key, value, lease_ms } => {
                let expiry = Some(Expiration::PX(lease_ms));
                Box::pin(client.set(key, value, expiry, Some(SetOptions::NX), true)).await
            }
            Command::Get { key } => Box::pin(client.get(key)).await,
            Command::Script(call) => Box::pin(client.custom(call.command(), call.args)).await,
        }
    }
}

/// One command on its way to the coalescing task.
struct Job {
    client: Client,
    options: Options,
    command: Command,
    answer: oneshot::Sender<Result<Value, Error>>,
    /// When the caller handed it over: its timeout runs from then.
    queued_at: tokio::time::Instant,
}

impl Job {
    async fn run(self) {
        let result = match time_left(&self.options, self.queued_at) {
            Ok(options) => self.command.send(&self.client, &options).await,
            Err(timed_out) => Err(timed_out),
        };
        // The caller may have gone (a client hung up); the command ran all the same.
        let _ = self.answer.send(result);
    }
}

/// `options` with its timeout shortened by the time since `queued_at`, or a timeout error if
/// none is left: the command must not be sent later than it would have been without the queue.
fn time_left(options: &Options, queued_at: tokio::time::Instant) -> Result<Options, Error> {
    let Some(timeout) = options.timeout else {
        return Ok(options.clone());
    };
    match timeout.checked_sub(queued_at.elapsed()) {
        Some(left) if !left.is_zero() => {
            let mut options = options.clone();
            options.timeout = Some(left);
            Ok(options)
        }
        _ => Err(Error::new(
            ErrorKind::Timeout,
            "the command's timeout ran out while it was queued to share a write; not sent",
        )),
    }
}

/// Sends commands to Redis, coalescing those that arrive together into one write.
/// Shared by every clone of a store.
#[derive(Default)]
pub(crate) struct Coalescer {
    /// Commands sent through this coalescer and not yet answered.
    outstanding: Arc<AtomicUsize>,
    /// The coalescing task's queue, started with the first command that finds another
    /// outstanding (so within a runtime).
    queue: OnceLock<mpsc::UnboundedSender<Job>>,
}

/// Counts a command as outstanding until it is answered or abandoned.
struct Outstanding(Arc<AtomicUsize>);

impl Drop for Outstanding {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}

impl Coalescer {
    /// Sends `command` on `client` with `options`: at once when no other command is outstanding
    /// or when fred would write it alone anyway, else together with the commands that are ready
    /// at the same time.
    pub(crate) async fn send(
        &self,
        client: &Client,
        options: &Options,
        command: Command,
    ) -> Result<Value, Error> {
        let others = self.outstanding.fetch_add(1, Ordering::Relaxed);
        let _outstanding = Outstanding(self.outstanding.clone());
        // Not boxed here: `Command::send` boxes its fred call, so its own future is small.
        if others == 0 || command.is_sent_alone(client) {
            return command.send(client, options).await;
        }
        let (answer, answered) = oneshot::channel();
        let job = Job {
            client: client.clone(),
            options: options.clone(),
            command,
            answer,
            queued_at: tokio::time::Instant::now(),
        };
        let queue = self.queue.get_or_init(|| {
            let (queue, jobs) = mpsc::unbounded_channel();
            // fred runs on tokio, so a runtime is there; should a caller poll from elsewhere,
            // the queue stays closed and every command goes directly.
            if let Ok(runtime) = tokio::runtime::Handle::try_current() {
                runtime.spawn(coalesce(jobs));
            }
            queue
        });
        if let Err(mpsc::error::SendError(job)) = queue.send(job) {
            // No task (its runtime shut down, or there was none): send this one directly.
            return job.command.send(&job.client, &job.options).await;
        }
        answered
            .await
            .unwrap_or_else(|_| Err(Error::new(ErrorKind::Canceled, "the coalescing task stopped")))
    }
}

/// The coalescing task: runs until every sender (every clone of the store) is gone and every
/// command it took has been answered.
async fn coalesce(mut jobs: mpsc::UnboundedReceiver<Job>) {
    let mut running = FuturesUnordered::new();
    loop {
        tokio::select! {
            biased;
            // First drive the commands taken: the new ones reach fred together here.
            Some(()) = running.next(), if !running.is_empty() => {}
            job = jobs.recv() => {
                let Some(job) = job else { break };
                // Let the requests that are ready to run queue their commands first.
                YieldOnce(false).await;
                let mut batch = vec![job];
                while let Ok(job) = jobs.try_recv() {
                    batch.push(job);
                }
                for send in plan(batch) {
                    running.push(send.run());
                }
            }
        }
    }
    while running.next().await.is_some() {}
}

/// What the coalescing task hands fred for one or more commands.
enum Send {
    One(Job),
    Merged(Merged),
}

impl Send {
    async fn run(self) {
        match self {
            Send::One(job) => job.run().await,
            Send::Merged(merged) => merged.run().await,
        }
    }
}

/// Mergeable calls of one script, for one connection, sent as one call.
struct Merged {
    client: Client,
    options: Options,
    /// When the first of its records was queued, the one with the least time left.
    queued_at: tokio::time::Instant,
    records: Vec<MergedRecord>,
    /// The size of the records' keys and arguments, bounded by [`MAX_MERGED_BYTES`].
    bytes: usize,
}

struct MergedRecord {
    call: ScriptCall,
    answer: oneshot::Sender<Result<Value, Error>>,
}

/// The order fred gets a batch in: the commands it feeds without a flush first, so that the
/// write the first script flushes carries them too; then the mergeable script calls, merged.
fn plan(batch: Vec<Job>) -> Vec<Send> {
    let mut sends = Vec::with_capacity(batch.len());
    let mut merged: Vec<Merged> = Vec::new();
    for job in batch {
        let Job {
            client,
            options,
            command: Command::Script(call),
            answer,
            queued_at,
        } = job
        else {
            sends.push(Send::One(job));
            continue;
        };
        let record = MergedRecord { call, answer };
        if !record.call.mergeable {
            sends.push(Send::One(record.alone(client, options, queued_at)));
            continue;
        }
        let bytes = record.call.args[KEY_AT..]
            .iter()
            .map(argument_size)
            .sum::<usize>();
        let script = record.call.script;
        let joins = |m: &&mut Merged| {
            m.records[0].call.script == script
                && m.records.len() < MAX_MERGED
                && m.bytes + bytes <= MAX_MERGED_BYTES
                && m.client.id() == client.id()
        };
        match merged.iter_mut().find(joins) {
            Some(m) => {
                m.bytes += bytes;
                m.queued_at = m.queued_at.min(queued_at);
                m.records.push(record);
            }
            None => merged.push(Merged {
                client,
                options,
                queued_at,
                records: vec![record],
                bytes,
            }),
        }
    }
    sends.extend(merged.into_iter().map(Send::Merged));
    sends
}

/// About what an argument adds to a command, for [`MAX_MERGED_BYTES`].
fn argument_size(value: &Value) -> usize {
    value.as_bytes().map_or(8, <[u8]>::len)
}

impl Merged {
    async fn run(self) {
        let Merged {
            client,
            options,
            queued_at,
            mut records,
            ..
        } = self;
        if records.len() == 1 {
            let Some(record) = records.pop() else {
                return;
            };
            return record.alone(client, options, queued_at).run().await;
        }
        let options = match time_left(&options, queued_at) {
            Ok(options) => options,
            Err(timed_out) => return fail_all(records, &timed_out),
        };
        // `EVALSHA sha n key… arg…`, from the first call's SHA-1, every call's key, then every
        // call's arguments, in the same order.
        let count = records.len();
        let custom = records[0].call.command();
        let mut command = Vec::with_capacity(KEY_AT + count * records[0].call.args.len());
        command.push(records[0].call.args[0].clone());
        command.push(Value::Integer(count as i64));
        for record in &mut records {
            command.push(std::mem::replace(&mut record.call.args[KEY_AT], Value::Null));
        }
        for record in &mut records {
            command.extend(record.call.args.drain(KEY_AT + 1..));
        }
        // Boxed, as in `Command::send`.
        let answered = Box::pin(client.with_options(&options).custom(custom, command)).await;
        match answered {
            Ok(Value::Array(answers)) if answers.len() == count => {
                for (record, answer) in records.into_iter().zip(answers) {
                    // The caller may have gone (a client hung up); the command ran all the same.
                    let _ = record.answer.send(Ok(answer));
                }
            }
            Ok(other) => {
                let unexpected = format!("{count} records in one script call, answered with {other:?}");
                fail_all(records, &Error::new(ErrorKind::Protocol, unexpected));
            }
            // Every record's error (a NOSCRIPT too): each caller retries, or falls back to EVAL,
            // on its own.
            Err(error) => fail_all(records, &error),
        }
    }
}

/// Answers every record of a merged call with `error`.
fn fail_all(records: Vec<MergedRecord>, error: &Error) {
    for record in records {
        let _ = record.answer.send(Err(error.clone()));
    }
}

impl MergedRecord {
    /// This record's call as a job of its own, sent as it came.
    fn alone(self, client: Client, options: Options, queued_at: tokio::time::Instant) -> Job {
        let command = Command::Script(self.call);
        Job {
            client,
            options,
            command,
            answer: self.answer,
            queued_at,
        }
    }
}

/// Goes to the back of the worker's run queue once: a task woken while it runs is queued behind
/// the ready ones. `tokio::task::yield_now` would wait for the worker's next poll of its I/O
/// driver, a system call per batch.
struct YieldOnce(bool);

impl std::future::Future for YieldOnce {
    type Output = ();

    fn poll(mut self: std::pin::Pin<&mut Self>, cx: &mut std::task::Context<'_>) -> std::task::Poll<()> {
        if self.0 {
            return std::task::Poll::Ready(());
        }
        self.0 = true;
        cx.waker().wake_by_ref();
        std::task::Poll::Pending
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    fn with_timeout(timeout: Duration) -> Options {
        Options {
            timeout: Some(timeout),
            ..Options::default()
        }
    }

    /// A command that waited in the queue keeps only what is left of its timeout, so it is never
    /// sent after the caller's own bound, which started with the call, has run out.
    #[tokio::test(start_paused = true)]
    async fn a_queued_command_keeps_only_what_is_left_of_its_timeout() {
        let queued_at = tokio::time::Instant::now();
        tokio::time::advance(Duration::from_millis(1_500)).await;
        let left = time_left(&with_timeout(Duration::from_secs(2)), queued_at).map(|o| o.timeout);
        assert_eq!(left.ok(), Some(Some(Duration::from_millis(500))));
        tokio::time::advance(Duration::from_millis(500)).await;
        let error = time_left(&with_timeout(Duration::from_secs(2)), queued_at).err();
        assert_eq!(error.map(|e| e.kind().clone()), Some(ErrorKind::Timeout));
        let unbounded = time_left(&Options::default(), queued_at).map(|o| o.timeout);
        assert_eq!(unbounded.ok(), Some(None), "no timeout set: none made up");
    }

    /// The futures that are moved to the heap per command (the coalescing task's sends, and
    /// `Command::send` inside every store future) hold no fred future inline: with one, each
    /// command copied its 6.8 KB on the way.
    #[test]
    fn no_fred_future_is_held_inline() {
        let client = Client::default();
        let options = Options::default();
        let script = || {
            let call = ScriptCall::new(ScriptText::Sha1("sha"), Value::from("k"), &[], true);
            Command::Script(call)
        };
        let commands = [
            Command::SetIfAbsent {
                key: "k".into(),
                value: Bytes::from_static(b"v"),
                lease_ms: 1,
            },
            Command::Get { key: "k".into() },
            script(),
        ];
        let fred_call = std::mem::size_of_val(&client.get::<Value, _>("k"));
        assert!(
            fred_call > 4096,
            "fred's futures are large ({fred_call} B): the reason for this test"
        );
        for command in commands {
            let sent = std::mem::size_of_val(&command.send(&client, &options));
            assert!(sent < fred_call / 4, "Command::send's future: {sent} B");
        }
        let (answer, _answered) = oneshot::channel();
        let job = Job {
            client: client.clone(),
            options,
            command: script(),
            answer,
            queued_at: tokio::time::Instant::now(),
        };
        let run = std::mem::size_of_val(&Send::One(job).run());
        assert!(run < fred_call / 2, "a coalesced send's future: {run} B");
    }

    /// One whose timeout ran out in the queue is answered as timed out, and never reaches fred
    /// (here a client that was never connected, which would answer otherwise).
    #[tokio::test(start_paused = true)]
    async fn a_command_whose_timeout_ran_out_in_the_queue_is_not_sent() {
        let (answer, answered) = oneshot::channel();
        let job = Job {
            client: Client::default(),
            options: with_timeout(Duration::from_secs(2)),
            command: Command::Get { key: "k".into() },
            answer,
            queued_at: tokio::time::Instant::now(),
        };
        tokio::time::advance(Duration::from_secs(3)).await;
        job.run().await;
        let error = answered.await.expect("answered").expect_err("an error");
        assert_eq!(error.kind(), &ErrorKind::Timeout);
        assert!(error.details().contains("queued"), "{error}");
    }
}
