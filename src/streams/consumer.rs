//! The consumer: settings, and the loop that reads, takes over, runs each message once and
//! disposes of it.

use std::future::{Future, IntoFuture};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use bytes::Bytes;
use fred::clients::Client;
use fred::error::{Error as RedisError, ErrorKind};
use fred::interfaces::ClientLike;
use fred::types::config::{Config, ReconnectPolicy};
use fred::types::Builder;
use futures_util::stream::{FuturesUnordered, StreamExt};
use futures_util::FutureExt;
use tokio::sync::watch;

use super::commands::{self, Names};
use super::message::StreamMessage;
use super::outcome::{Failure, StreamEvent, StreamOutcome};
use crate::coordinator::{Coordinator, Disposition, Error, Once};
use crate::fingerprint::Fingerprint;
use crate::key::RecordKey;
use crate::store::redis::RedisStore;
use crate::store::{ClaimTicket, StoreError};
use crate::telemetry;

/// How long one `XREADGROUP` waits for new entries: how soon a takeover or a free place is
/// looked at again when the stream is quiet.
const READ_BLOCK: Duration = Duration::from_millis(200);
/// The pause after a failed read before the next one.
const READ_RETRY: Duration = Duration::from_millis(200);
/// How long [`StreamConsumer::connect_redis`]'s client waits for a connection.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(2);
/// [`StreamConsumer::connect_redis`]'s client's own bound on a command: the consumer's reads
/// block 200 ms at most, so 5 s without an answer is a dead connection.
const COMMAND_TIMEOUT: Duration = Duration::from_secs(5);

type Observer = Arc<dyn Fn(&StreamEvent<'_>) + Send + Sync>;
type Validation = Arc<dyn Fn(&StreamMessage) -> Result<(), String> + Send + Sync>;

/// A Redis Streams consumer in a consumer group that applies each message's effect once per
/// key, over a [`Coordinator`] (crate feature `streams`): [`run`](StreamConsumer::run) it with
/// the effect. The whole program, what it does with each message, the field mapping and what
/// trimming costs: the guide [Queue consumers](crate::guide::queue_consumers).
#[derive(Clone)]
pub struct StreamConsumer {
    redis: Client,
    coordinator: Coordinator,
    names: Names,
    id_field: Arc<str>,
    fingerprint_fields: Option<Vec<String>>,
    scope: Option<String>,
    max_deliveries: u64,
    in_hand: usize,
    validation: Option<Validation>,
    observer: Option<Observer>,
}

impl std::fmt::Debug for StreamConsumer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StreamConsumer")
            .field("names", &self.names)
            .field("id_field", &self.id_field)
            .field("max_deliveries", &self.max_deliveries)
            .field("in_hand", &self.in_hand)
            .finish_non_exhaustive()
    }
}

impl StreamConsumer {
    /// A consumer of `stream` in `group`, reading with `redis` (a connected `fred` client with a
    /// reconnect policy, such as [`connect_redis`](Self::connect_redis) makes; the store may be
    /// another server, or PostgreSQL), its effects guarded by `coordinator`, whose lease is also
    /// how long an entry stays pending on a silent consumer before another takes it over. The
    /// dead-letter stream is `<stream>:dead`; on a Cluster name the stream with a hash tag
    /// (`{payments}`) so that both share a slot.
    pub fn new(
        redis: Client,
        coordinator: Coordinator,
        stream: impl Into<String>,
        group: impl Into<String>,
    ) -> Self {
        let stream = stream.into();
        Self {
            redis,
            coordinator,
            names: Names {
                dead_letter: format!("{stream}:dead"),
                stream,
                group: group.into(),
                consumer: crate::coordinator::default_consumer_name(),
            },
            id_field: Arc::from("id"),
            fingerprint_fields: None,
            scope: None,
            max_deliveries: 5,
            in_hand: 1,
            validation: None,
            observer: None,
        }
    }

    /// A connected `fred` client for a consumer or a [`StreamPublisher`](crate::StreamPublisher),
    /// from a `redis://`, `rediss://`, `redis-sentinel://` or `redis-cluster://` URL, that
    /// reconnects after a dropped connection, forever (10 ms doubling to 1 s): fred's own
    /// default is not to reconnect, and a consumer whose client does not stops reading for good
    /// at the first dropped connection (a Redis restart, a failover, a network flow dropped).
    /// A connection attempt waits 2 s at most, and a command 5 s (the consumer bounds
    /// its own commands so anyway; this bounds the effect's, when it writes with this client).
    /// Its sockets get the store's TCP keepalive and, on Linux, `TCP_USER_TIMEOUT`
    /// ([`RedisStore::configure_liveness`]): a flow a load balancer dropped without a word is
    /// closed by the kernel within seconds, and the client reconnects, where it would otherwise
    /// wait on the dead socket for about 15 minutes.
    /// Build your own with a [`ReconnectPolicy`](fred::types::config::ReconnectPolicy) for
    /// other settings. Errs if the URL does not parse, asks for TLS in a build without the
    /// crate feature `tls`, or the server cannot be reached.
    ///
    /// ```no_run
    /// # async fn run() -> Result<(), Box<dyn std::error::Error>> {
    /// let redis = tower_idempotency::StreamConsumer::connect_redis("redis://127.0.0.1:6379").await?;
    /// # Ok(()) }
    /// ```
    pub async fn connect_redis(url: &str) -> Result<Client, RedisError> {
        let scheme = url.split_once("://").map_or("", |(scheme, _)| scheme);
        if !cfg!(feature = "tls") && (scheme.starts_with("rediss") || scheme.starts_with("valkeys")) {
            // fred would connect in plain text, sending the password in the clear.
            return Err(RedisError::new(
                ErrorKind::Config,
                "this URL asks for TLS, but tower-idempotency was built without its `tls` feature",
            ));
        }
        let redis = Builder::from_config(Config::from_url(url)?)
            .with_connection_config(|connection| {
                connection.connection_timeout = CONNECT_TIMEOUT;
                RedisStore::configure_liveness(connection);
            })
            .with_performance_config(|performance| performance.default_command_timeout = COMMAND_TIMEOUT)
            .set_policy(ReconnectPolicy::new_exponential(0, 10, 1_000, 2))
            .build()?;
        redis.init().await?;
        Ok(redis)
    }

    /// This consumer's name in the group (default:
    /// [`default_consumer_name`](crate::default_consumer_name), the host name and the process
    /// id). Two live consumers must not share one.
    pub fn with_consumer_name(mut self, name: impl Into<String>) -> Self {
        self.names.consumer = name.into();
        self
    }

    /// The dead-letter stream (default `<stream>:dead`).
    pub fn with_dead_letter_stream(mut self, stream: impl Into<String>) -> Self {
        self.names.dead_letter = stream.into();
        self
    }

    /// The field whose value is the idempotency key (default `id`). A message without it, or
    /// whose value is not a valid key, is dead-lettered (`bad id: …`).
    pub fn with_id_field(mut self, field: impl Into<String>) -> Self {
        self.id_field = Arc::from(field.into());
        self
    }

    /// The fields that make two messages with one key the same message, in this order
    /// (default: every field but the id field, in any order). A key seen again with other
    /// values there is dead-lettered (`mismatch: this id came before with another amount`,
    /// naming the fields named here; `… with other fields` by default); fields left out (a
    /// trace id, a timestamp) may differ between duplicates.
    pub fn with_fingerprint_fields<I, S>(mut self, fields: I) -> Self
    where
        I: IntoIterator<Item = S>,
        S: Into<String>,
    {
        self.fingerprint_fields = Some(fields.into_iter().map(Into::into).collect());
        self
    }

    /// A scope for the record keys (default none), so that two streams whose ids may collide
    /// keep apart in one store.
    pub fn with_scope(mut self, scope: impl Into<String>) -> Self {
        self.scope = Some(scope.into());
        self
    }

    /// A message delivered more times than this is dead-lettered without running (default 5):
    /// one that fails every time, or kills its consumer. A live consumer keeps the entries it
    /// runs from takeovers however long they take, so only a failure, a death or a stall of
    /// more than a lease counts a delivery; a store outage costs none.
    pub fn with_max_deliveries(mut self, deliveries: u64) -> Self {
        self.max_deliveries = deliveries.max(1);
        self
    }

    /// How many messages this consumer holds at once (default 1): read and taken over only as
    /// places free up, run concurrently. Each place may hold a message through a store outage.
    pub fn with_in_hand(mut self, messages: usize) -> Self {
        self.in_hand = messages.max(1);
        self
    }

    /// A check of each message's fields before its key is claimed (default: none): a message
    /// it refuses is dead-lettered at once with the reason it gives, without a round trip to
    /// the store, even while the store is down, and without running, replaying or holding
    /// anything under its key. Checked after the bound on deliveries and the id field.
    ///
    /// ```no_run
    /// # fn consumer(consumer: tower_idempotency::StreamConsumer) -> tower_idempotency::StreamConsumer {
    /// // Refused: `bad amount: "lots" is not an integer`.
    /// consumer.with_validation(|message| Ok(message.parse_field::<i64>("amount", "an integer").map(drop)?))
    /// # }
    /// ```
    pub fn with_validation(
        mut self,
        validation: impl Fn(&StreamMessage) -> Result<(), String> + Send + Sync + 'static,
    ) -> Self {
        self.validation = Some(Arc::new(validation));
        self
    }

    /// Called for each message taken in hand and for what became of it (default: none), on
    /// the consumer's task: keep it short. For logs of your own; metrics are recorded anyway.
    pub fn with_observer(mut self, observer: impl Fn(&StreamEvent<'_>) + Send + Sync + 'static) -> Self {
        self.observer = Some(Arc::new(observer));
        self
    }

    /// The consumer's name in the group.
    pub fn consumer_name(&self) -> &str {
        &self.names.consumer
    }

    /// Makes the group ready, as [`run`](StreamConsumer::run) does first: creates it if missing
    /// (reading from the stream's start); on a Cluster, refuses a stream and a dead-letter
    /// stream in different slots. For a program that reports itself started only once it can
    /// consume; calling it is optional.
    pub async fn prepare(&self) -> Result<(), RedisError> {
        commands::prepare(&self.redis, &self.names).await
    }

    /// Consumes until `shutdown` completes, running `effect` once per key for each message.
    ///
    /// The group is created if missing (reading from the stream's start). Entries idle for
    /// longer than the lease (their consumer dead or stalled) are taken over first, then new
    /// ones read. `effect` gets the message and the claim's ticket (for
    /// `PostgresStore::complete_in`; ignore it otherwise), and answers the result to store
    /// (acknowledge; a duplicate gets it back without running), or a [`Failure`].
    ///
    /// When `shutdown` completes, no new read starts (one under way, 200 ms at most, ends and
    /// what it took is handled); each message in hand whose effect has started finishes, and
    /// one not started yet (held through a store outage, or a takeover waiting for another
    /// consumer's claim) is given up and left pending; then this returns. Nothing is
    /// acknowledged before its effect finished. Every command to the stream's Redis is bounded
    /// (5 s), whatever the client's own timeout. Errs only if the group cannot be made ready.
    pub async fn run<S, H, Fut>(&self, shutdown: S, effect: H) -> Result<(), RedisError>
    where
        S: Future<Output = ()>,
        H: Fn(StreamMessage, ClaimTicket) -> Fut + Sync,
        Fut: Future<Output = Result<Bytes, Failure>> + Send,
    {
        self.prepare().await?;
        let (stop, stopped) = watch::channel(false);
        let mut shutdown = std::pin::pin!(shutdown.fuse());
        let mut in_hand = FuturesUnordered::new();
        let mut cursor = "0-0".to_owned();
        // A read is never cancelled: what it took would sit pending on this consumer until a
        // takeover. It is kept across turns of the loop and finishes within `READ_BLOCK`.
        let mut reading = None;
        loop {
            let stopping = *stopped.borrow();
            if reading.is_none() && !stopping && in_hand.len() < self.in_hand {
                let places = self.in_hand - in_hand.len();
                reading = Some(Box::pin(self.next(places, std::mem::take(&mut cursor))));
            }
            if stopping && reading.is_none() && in_hand.is_empty() {
                return Ok(());
            }
            tokio::select! {
                () = &mut shutdown, if !stopping => {
                    let _ = stop.send(true);
                }
                Some(()) = in_hand.next(), if !in_hand.is_empty() => {}
                (next_cursor, messages) = async {
                    match reading.as_mut() {
                        Some(read) => read.await,
                        None => std::future::pending().await,
                    }
                }, if reading.is_some() => {
                    reading = None;
                    cursor = next_cursor;
                    for message in messages {
                        let message = message.with_id_field(&self.id_field);
                        in_hand.push(self.handle(message, &effect, stopped.clone()));
                    }
                }
            }
        }
    }

    /// Up to `places` messages: entries idle on other consumers for a lease first, else new
    /// ones. A failed read is logged and answers nothing, after a pause.
    async fn next(&self, places: usize, mut cursor: String) -> (String, Vec<StreamMessage>) {
        let lease = self.coordinator.lease();
        let read = async {
            let taken = commands::take_over(&self.redis, &self.names, lease, &mut cursor, places).await?;
            if !taken.is_empty() {
                return Ok(taken);
            }
            commands::read_new(&self.redis, &self.names, places, READ_BLOCK).await
        };
        match read.await {
            Ok(messages) => (cursor, messages),
            Err(error) if error.details().starts_with("NOGROUP") => {
                // The group went with its stream (a Redis restarted without persistence, a
                // failover to a replica that never had them, a `DEL`), or was destroyed: made
                // again from the stream's start, since a stream made again holds only what came
                // after, none of which may be skipped. Before, the consumer read nothing more.
                tracing::error!(stream = %self.names.stream, group = %self.names.group, %error,
                    "the consumer group is gone; creating it again, reading from the stream's start");
                if let Err(error) = commands::prepare(&self.redis, &self.names).await {
                    tracing::warn!(stream = %self.names.stream, %error, "creating the consumer group again failed; trying again");
                    tokio::time::sleep(READ_RETRY).await;
                }
                (String::from("0-0"), Vec::new())
            }
            Err(error) => {
                tracing::warn!(stream = %self.names.stream, %error, "reading the stream failed; trying again");
                tokio::time::sleep(READ_RETRY).await;
                (cursor, Vec::new())
            }
        }
    }

    /// While a message runs, waits for another consumer's claim or is held through a store
    /// outage, its entry's idle time is reset every third of a lease, so that no live
    /// consumer's message is taken over: only a dead or stalled consumer's is, and each delivery
    /// counted is a real one.
    async fn keep_in_hand(&self, entry: &str, lease: Duration) -> std::convert::Infallible {
        loop {
            tokio::time::sleep(lease / 3).await;
            commands::keep(&self.redis, &self.names, entry).await;
        }
    }

    /// One `once` for the message. A stop while it waits for another consumer's claim (a
    /// takeover's wait, up to a lease) gives the message up at once, before its effect starts:
    /// nothing ran, a claim taken is released, and the message is left pending. Once the effect
    /// has started, it is carried to its end.
    async fn attempt<H, Fut>(
        &self,
        (key, fingerprint): (&RecordKey, &Fingerprint),
        message: &StreamMessage,
        effect: &H,
        wait: Duration,
        stopped: watch::Receiver<bool>,
        returned: &OnceLock<Instant>,
    ) -> Once<Bytes, Failure>
    where
        H: Fn(StreamMessage, ClaimTicket) -> Fut + Sync,
        Fut: Future<Output = Result<Bytes, Failure>> + Send,
    {
        let started = AtomicBool::new(false);
        let mut once = (self.coordinator)
            .once_with_ticket(key, fingerprint, |ticket| {
                started.store(true, Ordering::Release);
                let effect = effect(message.clone(), ticket);
                async move {
                    let result = effect.await;
                    let _ = returned.set(Instant::now());
                    result
                }
            })
            .wait(wait)
            .into_future();
        if wait.is_zero() {
            return once.await;
        }
        // The guard `wait_for` answers is dropped at once: it must not live across an await.
        let stop = until_stopping(stopped);
        tokio::select! {
            answer = &mut once => answer,
            () = stop => {
                if started.load(Ordering::Acquire) {
                    once.await
                } else {
                    Once::Unavailable(Error::ShuttingDown)
                }
            }
        }
    }

    fn observe(&self, event: StreamEvent<'_>) {
        if let Some(observer) = &self.observer {
            observer(&event);
        }
    }

    /// One message, from taking it in hand to acknowledging, dead-lettering or leaving it.
    async fn handle<H, Fut>(&self, message: StreamMessage, effect: &H, stopped: watch::Receiver<bool>)
    where
        H: Fn(StreamMessage, ClaimTicket) -> Fut + Sync,
        Fut: Future<Output = Result<Bytes, Failure>> + Send,
    {
        let started = Instant::now();
        self.observe(StreamEvent::Received(&message));
        let outcome = self.outcome(&message, effect, stopped).await;
        telemetry::stream_message(outcome.metric());
        self.observe(StreamEvent::Handled {
            message: &message,
            outcome: &outcome,
            took: started.elapsed(),
        });
        match &outcome {
            StreamOutcome::Ran { .. } | StreamOutcome::Replayed(_) => {
                commands::ack(&self.redis, &self.names, message.entry()).await
            }
            StreamOutcome::DeadLettered { reason } => {
                commands::dead_letter(&self.redis, &self.names, &message, reason).await
            }
            // A stream has no delayed redelivery: left pending, the message goes to whichever
            // consumer finds it idle for a lease, when the claim that held it has ended at the
            // latest.
            StreamOutcome::InFlight { .. } | StreamOutcome::Failed(_) | StreamOutcome::Unavailable(_) => {}
        }
    }

    async fn outcome<H, Fut>(
        &self,
        message: &StreamMessage,
        effect: &H,
        stopped: watch::Receiver<bool>,
    ) -> StreamOutcome
    where
        H: Fn(StreamMessage, ClaimTicket) -> Fut + Sync,
        Fut: Future<Output = Result<Bytes, Failure>> + Send,
    {
        let dead = |reason: String| StreamOutcome::DeadLettered { reason };
        if message.deliveries() > self.max_deliveries {
            return dead(format!(
                "delivered {} times, more than the bound on deliveries ({})",
                message.deliveries(),
                self.max_deliveries
            ));
        }
        let key = match message.key(self.scope.as_deref()) {
            Ok(key) => key,
            Err(reason) => return dead(reason),
        };
        if let Some(Err(reason)) = self.validation.as_ref().map(|validate| validate(message)) {
            return dead(reason);
        }
        let fingerprint = message.fingerprint(self.fingerprint_fields.as_deref());
        // Taken over from a consumer that may have died: wait for its claim's lease rather
        // than leave the message for another lease.
        let wait = if message.is_takeover() {
            self.coordinator.lease()
        } else {
            Duration::ZERO
        };
        // While the store does not answer nothing can run: the message is held in hand and
        // tried again (`Once::hold_through_outage`'s loop) rather than left pending, where each
        // takeover counts a delivery and an outage would dead-letter every message it meets.
        // Its entry is kept from takeovers meanwhile, pauses included.
        let entry = message.entry();
        let id = message.id().unwrap_or_default();
        let stop = until_stopping(stopped.clone());
        let held = |answer: &Once<Bytes, Failure>, pause: Duration| match answer {
            Once::Unavailable(error) => {
                tracing::warn!(msg = %entry, id = ?id, %error, ?pause, "the store is unavailable; holding the message and trying again")
            }
            _ => tracing::debug!(msg = %entry, id = ?id, "in flight after the outage; holding the message"),
        };
        let returned = OnceLock::new();
        let try_once = || {
            let stopped = stopped.clone();
            self.attempt((&key, &fingerprint), message, effect, wait, stopped, &returned)
        };
        let holding = Once::hold(try_once, stop, held);
        let keeping = self.keep_in_hand(entry, self.coordinator.lease());
        let answer = tokio::select! {
            answer = holding => answer,
            never = keeping => match never {},
        };
        let stored_in = returned.get().map_or(Duration::ZERO, Instant::elapsed);
        disposed(answer, stored_in, || self.mismatch())
    }

    /// The dead-letter reason of a mismatch, naming the fingerprint's fields when they were
    /// named (`with another amount`).
    fn mismatch(&self) -> String {
        let what = match self.fingerprint_fields.as_deref() {
            Some([field]) => format!("another {field}"),
            Some(fields) if !fields.is_empty() => format!("other values of {}", fields.join(", ")),
            _ => "other fields".to_owned(),
        };
        format!("mismatch: this id came before with {what}")
    }
}

/// Ends once the consumer is stopping.
async fn until_stopping(mut stopped: watch::Receiver<bool>) {
    let _ = stopped.wait_for(|stopping| *stopping).await;
}

/// What `once` answered, as what becomes of the message; `stored_in` is the time from the
/// effect's return to now, `mismatch` the reason to dead-letter a mismatch under.
fn disposed(
    answer: Once<Bytes, Failure>,
    stored_in: Duration,
    mismatch: impl FnOnce() -> String,
) -> StreamOutcome {
    let dead_letter = answer.disposition() == Disposition::DeadLetter;
    match answer {
        Once::Ran(result) => StreamOutcome::Ran {
            result,
            not_stored: None,
            stored_in,
        },
        Once::NotStored { result, error } => StreamOutcome::Ran {
            result,
            not_stored: Some(error),
            stored_in,
        },
        Once::Replayed(result) => StreamOutcome::Replayed(result),
        Once::InFlight { retry_after } => StreamOutcome::InFlight { retry_after },
        Once::Mismatch => StreamOutcome::DeadLettered { reason: mismatch() },
        Once::Failed(Failure::Retry(error)) => StreamOutcome::Failed(error),
        Once::Failed(Failure::DeadLetter(reason)) => StreamOutcome::DeadLettered { reason },
        Once::Unavailable(error @ Error::Store(StoreError::Corrupt(_))) => StreamOutcome::DeadLettered {
            reason: format!("unreadable record: {error}"),
        },
        // Whatever else `Once::disposition` dead-letters, under the error's own words.
        Once::Unavailable(error) if dead_letter => StreamOutcome::DeadLettered {
            reason: error.to_string(),
        },
        Once::Unavailable(error) => StreamOutcome::Unavailable(error),
    }
}
