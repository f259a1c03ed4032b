//! Concurrent commands to Redis sent in shared socket writes.
//!
//! fred writes a command without flushing its socket only while more commands wait in its queue,
//! and flushes after every script and custom command whatever waits. Under load that queue is
//! nearly always empty: a request hands fred its command, fred's connection task is woken into
//! the same worker's next slot and writes that command alone. So at 32 concurrent requests
//! nearly every claim cost a `writev` of its own here and a read of its own in Redis: the largest
//! cost of a request after the round trip itself (`bench/profile.md`).
//!
//! A [`Coalescer`] sends a command directly when no other is outstanding, so a lone request
//! (concurrency 1) pays nothing, and sends every script directly too: fred writes a script
//! alone whatever waits behind it, so queueing one would buy nothing but the hand-off (measured:
//! fresh keys 3–5% faster at c32 with the scripts sent directly). Otherwise it queues the command
//! for one task which steps back once behind the tasks already ready on its worker (the requests
//! about to send theirs), then hands fred everything queued in one go; the claim is fred's own
//! `SET`, which fred feeds without a flush, so a batch of claims and replays leaves in one write.
//! Each command keeps its own answer, timeout and retries. A command whose caller gives up after
//! queueing it is still sent, as it would be once fred had it.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock};

use bytes::Bytes;
use fred::clients::Client;
use fred::error::{Error, ErrorKind};
use fred::interfaces::{ClientLike, KeysInterface};
use fred::types::config::Options;
use fred::types::{CustomCommand, Expiration, Key, SetOptions, Value};
use futures_util::stream::{FuturesUnordered, StreamExt};
use tokio::sync::{mpsc, oneshot};

/// A command to send.
pub(crate) enum Command {
    /// `SET key value NX PX lease GET`, through fred's own `SET`: fred flushes its socket after
    /// every custom command and script, but not after a `SET` with more queued behind it.
    SetIfAbsent { key: Key, value: Bytes, lease_ms: i64 },
    /// `GET key`.
    Get { key: Key },
    /// Anything else (the scripts).
    Custom {
        command: CustomCommand,
        args: Vec<Value>,
    },
}

impl Command {
    /// Whether fred writes this command in a write of its own, whatever waits behind it: it
    /// flushes its socket after every script and custom command.
    fn is_flushed_alone(&self) -> bool {
        matches!(self, Command::Custom { .. })
    }

    async fn send(self, client: &Client, options: &Options) -> Result<Value, Error> {
        let client = client.with_options(options);
        match self {
            Command::SetIfAbsent { key, value, lease_ms } => {
                let expiry = Some(Expiration::PX(lease_ms));
                client.set(key, value, expiry, Some(SetOptions::NX), true).await
            }
            Command::Get { key } => client.get(key).await,
            Command::Custom { command, args } => client.custom(command, args).await,
        }
    }
}

/// One command on its way to the coalescing task.
struct Job {
    client: Client,
    options: Options,
    command: Command,
    answer: oneshot::Sender<Result<Value, Error>>,
}

impl Job {
    async fn run(self) {
        let result = self.command.send(&self.client, &self.options).await;
        // The caller may have gone (a client hung up); the command ran all the same.
        let _ = self.answer.send(result);
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
        if others == 0 || command.is_flushed_alone() {
            return command.send(client, options).await;
        }
        let (answer, answered) = oneshot::channel();
        let job = Job {
            client: client.clone(),
            options: options.clone(),
            command,
            answer,
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
                running.push(job.run());
                while let Ok(job) = jobs.try_recv() {
                    running.push(job.run());
                }
            }
        }
    }
    while running.next().await.is_some() {}
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
