//! Telemetry, in one place: the counters, histogram and gauge recorded through the `metrics`
//! facade (crate feature `metrics`), and the tracing span of a keyed request.
//!
//! The rest of the crate calls the small functions here. Without the feature they are empty and
//! inline to nothing. With it, a metric is recorded through whatever recorder the application
//! installed (an exporter), and through the facade's no-op recorder otherwise: one thread-local
//! read and one atomic load per call. Every label is a string literal, so each call site names a
//! `static` key the facade hashed at compile time: no allocation, no formatting per request. A
//! named coordinator (`with_name`, also the layer's) adds a `name` label to each of its metrics:
//! its keys are built and hashed once, when the name is set ([`Named`]), and each call picks one
//! by index, so a name costs no allocation either.
//!
//! The span costs one check of the callsite's cached interest when no subscriber wants it; its
//! fields (hashes of the scope and key) are computed only for a subscriber that does. Store calls
//! are timed only when someone will read the time: an installed recorder or an interested
//! subscriber.
//!
//! Every name, type and label is listed in docs/metrics-and-tracing.md.

use std::sync::Arc;
use std::time::Duration;

use tracing::field::Empty;
use tracing::Span;

use crate::key::RecordKey;
use crate::key::{scope_digest, short_hex};

/// The target of the request span and of the check that store timings are wanted, so one
/// filter directive (`tower_idempotency=…`) governs both.
const TARGET: &str = "tower_idempotency";

/// Declares an enum of metric labels: each variant with its label, then `ALL` (every variant in
/// declaration order, so `variant as usize` indexes it) and `as_str` (the label), documented by
/// the doc comment given for it.
macro_rules! labels {
    (
        $(#[$meta:meta])*
        $vis:vis enum $name:ident { $($(#[$variant_meta:meta])* $variant:ident => $label:literal,)* }
        $(#[$as_str_meta:meta])*
        $as_str_vis:vis fn as_str;
    ) => {
        $(#[$meta])*
        $vis enum $name { $($(#[$variant_meta])* $variant,)* }

        // Not every build records under every label.
        #[allow(dead_code)]
        impl $name {
            /// Every variant, in declaration order (`variant as usize` indexes it).
            pub(crate) const ALL: [$name; [$($label),*].len()] = [$($name::$variant),*];

            $(#[$as_str_meta])*
            $as_str_vis const fn as_str(self) -> &'static str {
                match self {
                    $($name::$variant => $label,)*
                }
            }
        }
    };
}

labels! {
    /// What the layer did with a keyed request: put in the extensions of every response it hands
    /// on for one (the handler's, a replay, a rejection), so that a layer outside it (tower-http's
    /// `TraceLayer`, a metrics layer, a log line) can label by it without parsing headers.
    ///
    /// Its [`as_str`](Self::as_str) is the `outcome` label of `idempotency_requests_total` and the
    /// `outcome` field of the request span. A rejection also carries its [`Rejection`](crate::Rejection)
    /// (why, and what the client is told) in the same extensions. A request the layer let pass
    /// untouched (no key where none is required, a method it does not guard) carries none.
    ///
    /// ```
    /// # use std::convert::Infallible;
    /// # use bytes::Bytes;
    /// # use http::{Request, Response};
    /// # use http_body_util::Full;
    /// use tower::{Service, ServiceBuilder, ServiceExt};
    /// use tower_idempotency::{IdempotencyLayer, MemoryStore, RequestBody, RequestOutcome};
    ///
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() {
    /// let mut service = ServiceBuilder::new()
    ///     .layer(IdempotencyLayer::new(MemoryStore::new()))
    ///     .service_fn(|_: Request<RequestBody<Full<Bytes>>>| async {
    ///         Ok::<_, Infallible>(Response::new(Full::from("done")))
    ///     });
    /// let request = || Request::post("/orders").header("idempotency-key", "k1").body(Full::from("{}")).unwrap();
    /// let first = service.ready().await.unwrap().call(request()).await.unwrap();
    /// let retry = service.ready().await.unwrap().call(request()).await.unwrap();
    /// assert_eq!(first.extensions().get(), Some(&RequestOutcome::Executed));
    /// assert_eq!(retry.extensions().get::<RequestOutcome>().map(|o| o.as_str()), Some("replayed"));
    /// # }
    /// ```
    #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
    #[non_exhaustive]
    pub enum RequestOutcome {
        /// The key was claimed and the handler ran (its response; or the layer's 500 or 504 if it
        /// panicked or timed out, with that [`Rejection`](crate::Rejection)).
        Executed => "executed",
        /// The stored response was replayed; the handler did not run.
        Replayed => "replayed",
        /// Another request holds the key: 409 with `Retry-After` (or a record of a newer release).
        InFlight => "in_flight",
        /// The key was used with a different request.
        Mismatch => "mismatch",
        /// The key's record was stored under another fingerprint policy: the two requests cannot
        /// be compared, and nothing was replayed or run.
        PolicyMismatch => "policy_mismatch",
        /// The key ran before, but its response was not stored: it is not replayable.
        NotStored => "not_stored",
        /// Refused before the store was asked: no key, an invalid key, no scope, a body too large
        /// or unreadable, no endpoint.
        Rejected => "rejected",
        /// The store failed or timed out: 503, nothing run.
        StoreError => "store_error",
        /// The store refused the claim on purpose during a failover, or its replicas did not
        /// acknowledge it: 503, nothing run.
        Fenced => "fenced",
        /// The store failed and the handler ran unprotected (`with_fail_open(true)`).
        FailOpen => "fail_open",
        /// At the bound on running requests, or shutting down: 503, nothing claimed.
        Overloaded => "overloaded",
        /// The record at the key cannot be read: 500, nothing run.
        Unreadable => "unreadable",
    }

    /// The outcome's name, as metrics and the request span spell it: `executed`, `replayed`,
    /// `in_flight`, `mismatch`, `policy_mismatch`, `not_stored`, `rejected`, `store_error`, `fenced`,
    /// `fail_open`, `overloaded`, `unreadable`.
    pub fn as_str;
}

impl std::fmt::Display for RequestOutcome {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// The `kind` label of a rejection sent (`idempotency_rejections_total`): one per
/// [`Rejection`](crate::Rejection) variant, which names its own.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum RejectionKind {
    MissingKey,
    InvalidKey,
    BodyTooLarge,
    BodyUnreadable,
    InFlight,
    Mismatch,
    PolicyMismatch,
    StoreUnavailable,
    UnreadableRecord,
    Overloaded,
    HandlerPanicked,
    MissingScope,
    ResponseNotStored,
    HandlerTimedOut,
    NoEndpoint,
}

impl RejectionKind {
    /// Every kind's label, in declaration order (`kind as usize` indexes it): the variant's
    /// name, which is also the [`Rejection`](crate::Rejection)'s and the end of its problem type.
    pub(crate) const LABELS: [&'static str; 15] = [
        "MissingKey",
        "InvalidKey",
        "BodyTooLarge",
        "BodyUnreadable",
        "InFlight",
        "Mismatch",
        "PolicyMismatch",
        "StoreUnavailable",
        "UnreadableRecord",
        "Overloaded",
        "HandlerPanicked",
        "MissingScope",
        "ResponseNotStored",
        "HandlerTimedOut",
        "NoEndpoint",
    ];
}

labels! {
    /// The `kind` label of a reconciliation event (`idempotency_reconciliation_events_total`): one
    /// per [`ReconciliationKind`](crate::ReconciliationKind) variant, which names its own.
    #[derive(Clone, Copy, Debug, PartialEq, Eq)]
    pub(crate) enum EventKind {
        CompletionFailed => "completion_failed",
        NotStorable => "not_storable",
        ClaimLost => "claim_lost",
        ReplicationAbandoned => "replication_abandoned",
        LostBeforeReplicated => "lost_before_replicated",
    }

    /// The label value.
    fn as_str;
}

labels! {
    /// A store operation: the `op` label of `idempotency_store_duration_seconds` and the span's
    /// `store_<op>_us` field.
    #[derive(Clone, Copy, Debug, PartialEq, Eq)]
    pub(crate) enum StoreOp {
        Claim => "claim",
        Peek => "peek",
        Complete => "complete",
        Release => "release",
        Renew => "renew",
        Inspect => "inspect",
        Purge => "purge",
        /// Subscribing to a key's settlement, for a request that waits (`Store::watch`).
        Watch => "watch",
    }

    /// The `op` label value.
    fn as_str;
}

impl StoreOp {
    /// The span field its time goes to, if a request's span has one.
    fn span_field(self) -> Option<&'static str> {
        match self {
            StoreOp::Claim => Some("store_claim_us"),
            StoreOp::Peek => Some("store_peek_us"),
            StoreOp::Complete => Some("store_complete_us"),
            StoreOp::Release => Some("store_release_us"),
            StoreOp::Renew => Some("store_renew_us"),
            StoreOp::Inspect | StoreOp::Purge | StoreOp::Watch => None,
        }
    }
}

/// The `name` label of a named coordinator's (layer's) metrics, with every key it records
/// under, built and hashed once when the name is set: recording under a name costs what
/// recording under literal labels does, a lookup, with no allocation nor formatting.
pub(crate) struct Named {
    name: Arc<str>,
    #[cfg(feature = "metrics")]
    keys: recorded::Keys,
}

impl Named {
    pub(crate) fn new(name: Arc<str>) -> Arc<Self> {
        Arc::new(Self {
            #[cfg(feature = "metrics")]
            keys: recorded::Keys::new(Some(&name)),
            name,
        })
    }

    /// The label's value.
    pub(crate) fn name(&self) -> &str {
        &self.name
    }
}

/// Calls `recorded::$call` with the feature `metrics`; without it, only uses the arguments,
/// so the function around it inlines to nothing.
macro_rules! record {
    ($call:ident($($arg:expr),*)) => {{
        #[cfg(feature = "metrics")]
        recorded::$call($($arg),*);
        #[cfg(not(feature = "metrics"))]
        let _ = ($($arg),*);
    }};
}

/// Counts a request's outcome (`idempotency_requests_total`), under `named`'s name if given.
#[inline]
pub(crate) fn outcome(outcome: RequestOutcome, named: Option<&Named>) {
    record!(outcome(outcome, named));
}

/// Counts a request that waited for the request in flight to finish, instead of answering 409 at
/// once (`Prefer: wait`): `idempotency_requests_total{outcome="waited"}`, besides the outcome it
/// ends with.
#[inline]
pub(crate) fn waited(named: Option<&Named>) {
    record!(waited(named));
}

/// Counts a request's outcome and writes it into its span, and into an event of the span: a
/// `fmt` subscriber shows a span's fields only on the span's events (or, with `FmtSpan::CLOSE`,
/// when it closes), and a request answered at once has no other.
#[inline]
pub(crate) fn finish(span: &Span, outcome: RequestOutcome, named: Option<&Named>) {
    self::outcome(outcome, named);
    span.record("outcome", outcome.as_str());
    tracing::debug!(target: TARGET, parent: span, outcome = %outcome.as_str(), "idempotency outcome");
}

/// Counts a rejection sent, by kind (`idempotency_rejections_total`).
#[inline]
pub(crate) fn rejection(rejection: RejectionKind, named: Option<&Named>) {
    record!(rejection(rejection, named));
}

/// What a stream consumer did with a message: the `outcome` label of
/// `idempotency_stream_messages_total`.
#[cfg(feature = "streams")]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum StreamLabel {
    /// Ran here, acknowledged.
    Ran,
    /// A duplicate, acknowledged.
    Replayed,
    /// Another consumer holds the key: left pending.
    InFlight,
    /// The effect failed: left pending.
    Failed,
    /// The store did not answer, or the consumer stopped first: left pending.
    Unavailable,
    /// Dead-lettered and acknowledged.
    DeadLettered,
}

/// Counts what a stream consumer did with a message (`idempotency_stream_messages_total`).
#[cfg(feature = "streams")]
#[inline]
pub(crate) fn stream_message(outcome: StreamLabel) {
    #[cfg(feature = "metrics")]
    {
        const NAME: &str = "idempotency_stream_messages_total";
        let counter = match outcome {
            StreamLabel::Ran => metrics::counter!(NAME, "outcome" => "ran"),
            StreamLabel::Replayed => metrics::counter!(NAME, "outcome" => "replayed"),
            StreamLabel::InFlight => metrics::counter!(NAME, "outcome" => "in_flight"),
            StreamLabel::Failed => metrics::counter!(NAME, "outcome" => "failed"),
            StreamLabel::Unavailable => metrics::counter!(NAME, "outcome" => "unavailable"),
            StreamLabel::DeadLettered => metrics::counter!(NAME, "outcome" => "dead_lettered"),
        };
        counter.increment(1);
    }
    #[cfg(not(feature = "metrics"))]
    let _ = outcome;
}

/// Counts entries a stream consumer found pending but deleted or trimmed from the stream before
/// they were processed (`XAUTOCLAIM`'s third element; `idempotency_stream_entries_deleted_total`).
#[cfg(feature = "streams")]
#[inline]
pub(crate) fn stream_entries_deleted(entries: u64) {
    #[cfg(feature = "metrics")]
    metrics::counter!("idempotency_stream_entries_deleted_total").increment(entries);
    #[cfg(not(feature = "metrics"))]
    let _ = entries;
}

/// Counts a request that carries an idempotency key but matches no endpoint of a
/// `PolicyLayer`, passed through or refused (`idempotency_unmatched_requests_total`).
#[inline]
pub(crate) fn unmatched() {
    #[cfg(feature = "metrics")]
    metrics::counter!("idempotency_unmatched_requests_total").increment(1);
}

/// Counts a reconciliation event, whether or not a hook is installed
/// (`idempotency_reconciliation_events_total`).
#[inline]
pub(crate) fn reconciliation(kind: EventKind, named: Option<&Named>) {
    record!(reconciliation(kind, named));
}

/// One more (`+1.0`) or one fewer (`-1.0`) claimed operation running (`idempotency_running`).
#[inline]
pub(crate) fn running(delta: f64, named: Option<&Named>) {
    record!(running(delta, named));
}

#[cfg(feature = "redis")]
labels! {
    /// One of the connections a store keeps besides its requests' claims: the `connection` label of
    /// `idempotency_connection_events_total`.
    #[derive(Clone, Copy, Debug, PartialEq, Eq)]
    pub(crate) enum Connection {
        /// The connection (or pool) the store's commands go over.
        Commands => "commands",
        /// The durability option's connections (`ReplicaAcks`).
        ReplicaAcks => "replica_acks",
        /// The replay cache's purge feed.
        ReplayCache => "replay_cache",
        /// The subscriber that wakes waiting requests.
        Notices => "notices",
        /// The Sentinel failover watch's subscriptions.
        Sentinels => "sentinels",
    }

    /// The label value.
    pub(crate) fn as_str;
}

#[cfg(feature = "redis")]
labels! {
    /// A change of a connection's or a feed's state: the `event` label of
    /// `idempotency_connection_events_total`.
    #[derive(Clone, Copy, Debug, PartialEq, Eq)]
    pub(crate) enum ConnectionEvent {
        /// A heartbeat went unanswered: the connection is taken for dead and replaced.
        Silent => "silent",
        /// A connection that went silent answers again.
        Restored => "restored",
        /// What the connection feeds stopped: the replay cache serves nothing, the Sentinel watch
        /// hears no failover (claims are refused).
        FeedLost => "feed_lost",
        /// The feed is back (the replay cache starts empty).
        FeedBack => "feed_back",
    }

    /// The label value.
    pub(crate) fn as_str;
}

#[cfg(feature = "redis")]
/// Counts a change of a connection's state (`idempotency_connection_events_total`).
#[inline]
pub(crate) fn connection_event(connection: Connection, event: ConnectionEvent) {
    record!(connection_event(connection, event));
}

/// Counts a setup that can only be unsafe, found at run time and logged once per layer
/// (`idempotency_setup_warnings_total`): an unscoped layer whose requests carry credentials, a
/// durability option that requires fewer replicas than the master has. Under `named`'s name if
/// given, as every metric of a named layer.
#[inline]
pub(crate) fn setup_warning(kind: SetupWarning, named: Option<&Named>) {
    record!(setup_warning(kind, named));
}

labels! {
    /// What a setup warning is about: the `kind` label of `idempotency_setup_warnings_total`.
    #[derive(Clone, Copy, Debug, PartialEq, Eq)]
    pub(crate) enum SetupWarning {
        /// A layer without a scope saw a keyed request with `Authorization` or `Cookie`: replays are
        /// answered before the handler authenticates, and every caller shares one namespace of keys.
        UnscopedCredentials => "unscoped_credentials",
        /// A Redis store's durability option requires fewer acknowledgements than the master has
        /// replicas: a failover may promote one that did not acknowledge.
        #[cfg_attr(not(feature = "redis"), allow(dead_code))]
        FewerAcksThanReplicas => "fewer_acks_than_replicas",
    }

    /// The label value.
    fn as_str;
}

/// How often a warning that every request of an outage would repeat is logged.
pub(crate) const THROTTLED_LOG_INTERVAL: Duration = Duration::from_secs(10);

/// A warning that a store outage would log once per request, logged at most once per
/// [`THROTTLED_LOG_INTERVAL`] instead, with the number held back since the last one. Two
/// atomics, read only on the path that would have logged.
#[derive(Debug)]
pub(crate) struct Throttled {
    /// The clock this one's times count from (Tokio's, so tests can advance it).
    since: tokio::time::Instant,
    /// Milliseconds after `since` from which the next warning is logged (0: at once).
    next_at_ms: std::sync::atomic::AtomicU64,
    /// Warnings held back since the last one logged.
    held_back: std::sync::atomic::AtomicU64,
}

impl Default for Throttled {
    fn default() -> Self {
        Self {
            since: tokio::time::Instant::now(),
            next_at_ms: Default::default(),
            held_back: Default::default(),
        }
    }
}

impl Throttled {
    /// Whether to log this warning: `Some(held back since the last one)` at most once per
    /// interval, `None` (counted as held back) otherwise.
    pub(crate) fn admit(&self) -> Option<u64> {
        use std::sync::atomic::Ordering::Relaxed;
        let now = u64::try_from(self.since.elapsed().as_millis()).unwrap_or(u64::MAX);
        let next = self.next_at_ms.load(Relaxed);
        let interval = THROTTLED_LOG_INTERVAL.as_millis() as u64;
        if now >= next
            && self
                .next_at_ms
                .compare_exchange(next, now.saturating_add(interval).max(1), Relaxed, Relaxed)
                .is_ok()
        {
            return Some(self.held_back.swap(0, Relaxed));
        }
        self.held_back.fetch_add(1, Relaxed);
        None
    }
}

/// Times one store call, if anyone will read the time.
pub(crate) struct StoreTimer<'a> {
    op: StoreOp,
    started: Option<std::time::Instant>,
    named: Option<&'a Named>,
}

impl<'a> StoreTimer<'a> {
    #[inline]
    pub(crate) fn start(op: StoreOp, named: Option<&'a Named>) -> Self {
        let wanted = recorder_installed() || tracing::enabled!(target: TARGET, tracing::Level::DEBUG);
        Self {
            op,
            started: wanted.then(std::time::Instant::now),
            named,
        }
    }

    /// Records the time since [`start`](Self::start): in the histogram, and in the current span
    /// (a keyed request's, when the call is made for one).
    #[inline]
    pub(crate) fn finish(self) {
        if let Some(started) = self.started {
            store_call(self.op, started.elapsed(), self.named);
        }
    }
}

fn store_call(op: StoreOp, took: Duration, named: Option<&Named>) {
    record!(store_call(op, took, named));
    if let Some(field) = op.span_field() {
        Span::current().record(field, u64::try_from(took.as_micros()).unwrap_or(u64::MAX));
    }
}

/// Whether an application installed a metrics recorder. The facade does not say, so this asks
/// the recorder in force for its size: the facade's fallback is a zero-sized no-op, and every
/// exporter holds state. A recorder that is itself zero-sized gets every counter and the gauge,
/// but not the store timings.
#[inline]
fn recorder_installed() -> bool {
    #[cfg(feature = "metrics")]
    return metrics::with_recorder(|recorder| std::mem::size_of_val(recorder) != 0);
    #[cfg(not(feature = "metrics"))]
    false
}

/// The span of one keyed request. Its `scope` and `key` fields are hashes, never the raw values
/// (a key may be guessable, a scope may name a tenant): `key` is the first 16 hex digits of the
/// record's digest (which names the record in the store, e.g. in its Redis key), `scope` those of
/// a SHA-256 of the scope alone, so one tenant's requests can be grouped.
pub(crate) fn request_span(key: &RecordKey) -> Span {
    let span = tracing::debug_span!(
        target: TARGET,
        "idempotency",
        outcome = Empty,
        key = Empty,
        scope = Empty,
        store_claim_us = Empty,
        store_peek_us = Empty,
        store_complete_us = Empty,
        store_release_us = Empty,
        store_renew_us = Empty,
    );
    if !span.is_disabled() {
        let mut hex = [0u8; 16];
        span.record("key", short_hex(key.digest(), &mut hex));
        if let Some(scope) = key.scope() {
            let mut hex = [0u8; 16];
            span.record("scope", short_hex(&scope_digest(scope), &mut hex));
        }
    }
    span
}

/// The recording itself, through keys built and hashed once: a named coordinator's when its
/// name is set ([`Named`]), the unnamed ones at the first metric recorded. Recording picks one
/// by index, with no allocation nor formatting, as the facade's macros do with literal labels.
#[cfg(feature = "metrics")]
mod recorded {
    use std::sync::LazyLock;
    use std::time::Duration;

    use metrics::{counter, Key, Label, Level, Metadata, SharedString};

    #[cfg(feature = "redis")]
    use super::{Connection, ConnectionEvent};
    use super::{EventKind, Named, RejectionKind, RequestOutcome, StoreOp};

    const REQUESTS: &str = "idempotency_requests_total";
    const REJECTIONS: &str = "idempotency_rejections_total";
    const RECONCILIATION: &str = "idempotency_reconciliation_events_total";
    const STORE: &str = "idempotency_store_duration_seconds";
    const RUNNING: &str = "idempotency_running";

    /// What the facade's macros pass for a call site; one for every key built here.
    static METADATA: Metadata<'static> = Metadata::new(module_path!(), Level::INFO, Some(module_path!()));

    /// The keys of the metrics of coordinators (layers) without a name.
    static UNNAMED: LazyLock<Keys> = LazyLock::new(|| Keys::new(None));

    /// Every key a coordinator records under, indexed as the enums are declared.
    pub(super) struct Keys {
        requests: [Key; RequestOutcome::ALL.len()],
        waited: Key,
        rejections: [Key; RejectionKind::LABELS.len()],
        reconciliation: [Key; EventKind::ALL.len()],
        store: [Key; StoreOp::ALL.len()],
        running: Key,
    }

    impl Keys {
        /// The keys with `name` as their `name` label, if given.
        pub(super) fn new(name: Option<&std::sync::Arc<str>>) -> Self {
            let key = |metric: &'static str, label: Option<(&'static str, &'static str)>| {
                let name = name.map(|name| Label::new("name", SharedString::from(name.clone())));
                let labels = label.map(|(key, value)| Label::from_static_parts(key, value));
                Key::from_parts(metric, labels.into_iter().chain(name).collect::<Vec<_>>())
            };
            Self {
                requests: RequestOutcome::ALL
                    .map(|outcome| key(REQUESTS, Some(("outcome", outcome.as_str())))),
                waited: key(REQUESTS, Some(("outcome", "waited"))),
                rejections: RejectionKind::LABELS.map(|kind| key(REJECTIONS, Some(("kind", kind)))),
                reconciliation: EventKind::ALL.map(|kind| key(RECONCILIATION, Some(("kind", kind.as_str())))),
                store: StoreOp::ALL.map(|op| key(STORE, Some(("op", op.as_str())))),
                running: key(RUNNING, None),
            }
        }
    }

    fn keys(named: Option<&Named>) -> &Keys {
        named.map_or(&UNNAMED, |named| &named.keys)
    }

    fn count(key: &Key) {
        metrics::with_recorder(|recorder| recorder.register_counter(key, &METADATA).increment(1));
    }

    pub(super) fn outcome(outcome: RequestOutcome, named: Option<&Named>) {
        count(&keys(named).requests[outcome as usize]);
    }

    pub(super) fn waited(named: Option<&Named>) {
        count(&keys(named).waited);
    }

    pub(super) fn rejection(rejection: RejectionKind, named: Option<&Named>) {
        count(&keys(named).rejections[rejection as usize]);
    }

    pub(super) fn reconciliation(kind: EventKind, named: Option<&Named>) {
        count(&keys(named).reconciliation[kind as usize]);
    }

    #[cfg(feature = "redis")]
    pub(super) fn connection_event(connection: Connection, event: ConnectionEvent) {
        // Rare (a connection falling silent or coming back): its labels are built per call.
        let (connection, event) = (connection.as_str(), event.as_str());
        counter!("idempotency_connection_events_total", "connection" => connection, "event" => event)
            .increment(1);
    }

    pub(super) fn running(delta: f64, named: Option<&Named>) {
        let key = &keys(named).running;
        metrics::with_recorder(|recorder| recorder.register_gauge(key, &METADATA).increment(delta));
    }

    pub(super) fn setup_warning(kind: super::SetupWarning, named: Option<&Named>) {
        let kind = kind.as_str();
        // Once per layer at most: the name's label is built here, not kept among `Keys`.
        match named {
            Some(named) => counter!("idempotency_setup_warnings_total", "kind" => kind, "name" => named.name().to_owned()),
            None => counter!("idempotency_setup_warnings_total", "kind" => kind),
        }
        .increment(1)
    }

    pub(super) fn store_call(op: StoreOp, took: Duration, named: Option<&Named>) {
        let key = &keys(named).store[op as usize];
        metrics::with_recorder(|recorder| {
            recorder
                .register_histogram(key, &METADATA)
                .record(took.as_secs_f64())
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    #[cfg(feature = "metrics")]
    use crate::reconciliation::ReconciliationKind;

    #[test]
    fn short_hex_is_the_first_eight_bytes_in_lower_case() {
        let mut out = [0u8; 16];
        let digest: Vec<u8> = (0u8..16).map(|n| n * 17).chain([0; 16]).collect();
        assert_eq!(
            short_hex(&digest, &mut out),
            "00112233445566778899aabbccddeeff"[..16].to_owned()
        );
    }

    #[test]
    fn every_store_operation_but_operator_calls_has_a_span_field() {
        for op in StoreOp::ALL {
            let expected = !matches!(op, StoreOp::Inspect | StoreOp::Purge | StoreOp::Watch);
            assert_eq!(op.span_field().is_some(), expected, "{op:?}");
        }
    }

    /// Every key is picked by index (an enum variant's place in its table): recorded by an
    /// unnamed coordinator and by a named one, each metric carries the label its variant has,
    /// the name too if there is one, and nothing else; a rejection's label is its problem
    /// type's name, as the span's outcome field is the outcome's label.
    #[cfg(feature = "metrics")]
    #[test]
    fn metrics_carry_their_documented_labels_named_or_not() {
        use metrics_util::debugging::{DebugValue, DebuggingRecorder};

        for (index, outcome) in RequestOutcome::ALL.into_iter().enumerate() {
            assert_eq!(outcome as usize, index, "{outcome:?}");
        }
        for (index, op) in StoreOp::ALL.into_iter().enumerate() {
            assert_eq!(op as usize, index, "{op:?}");
        }
        let rejections = [
            crate::Rejection::MissingKey,
            crate::Rejection::BodyUnreadable,
            crate::Rejection::StoreUnavailable,
            crate::Rejection::UnreadableRecord,
            crate::Rejection::Overloaded,
            crate::Rejection::HandlerPanicked,
            crate::Rejection::MissingScope,
            crate::Rejection::NoEndpoint,
        ];
        let kinds = [
            (ReconciliationKind::ClaimLost, "claim_lost"),
            (ReconciliationKind::LostBeforeReplicated, "lost_before_replicated"),
            (
                ReconciliationKind::NotStorable {
                    why: crate::NotStored::TooLarge,
                },
                "not_storable",
            ),
        ];
        let payments = Named::new("payments".into());
        for named in [None, Some(&*payments)] {
            let recorder = DebuggingRecorder::new();
            let snapshotter = recorder.snapshotter();
            metrics::with_local_recorder(&recorder, || {
                for outcome in RequestOutcome::ALL {
                    self::outcome(outcome, named);
                }
                self::waited(named);
                for rejection in &rejections {
                    self::rejection(rejection.kind(), named);
                }
                for (kind, _) in &kinds {
                    self::reconciliation(kind.event_kind(), named);
                }
                for op in StoreOp::ALL {
                    store_call(op, Duration::from_millis(1), named);
                }
            });
            let recorded = snapshotter.snapshot().into_vec();
            let named_as = named.map(Named::name);
            let once = |metric: &str, label: &str, value: &str| {
                let mut expected = vec![(label.to_owned(), value.to_owned())];
                expected.extend(named.map(|named| ("name".to_owned(), named.name().to_owned())));
                recorded.iter().any(|(key, _, _, recorded)| {
                    let labels = key.key().labels();
                    let labels: Vec<_> = labels
                        .map(|l| (l.key().to_owned(), l.value().to_owned()))
                        .collect();
                    key.key().name() == metric
                        && labels == expected
                        && matches!(recorded, DebugValue::Counter(1) | DebugValue::Histogram(_))
                })
            };
            let labels = RequestOutcome::ALL.map(RequestOutcome::as_str);
            for label in labels.into_iter().chain(["waited"]) {
                assert!(
                    once("idempotency_requests_total", "outcome", label),
                    "{label} {named_as:?}"
                );
            }
            for rejection in &rejections {
                let name = rejection.problem_type();
                let name = name.rsplit('.').next().unwrap_or_default();
                let found = once("idempotency_rejections_total", "kind", name);
                assert!(found, "{rejection:?} {named_as:?}");
            }
            for (kind, label) in &kinds {
                let found = once("idempotency_reconciliation_events_total", "kind", label);
                assert!(found, "{kind:?} {named_as:?}");
            }
            for op in StoreOp::ALL {
                let found = once("idempotency_store_duration_seconds", "op", op.as_str());
                assert!(found, "{op:?} {named_as:?}");
            }
        }
    }

    #[cfg(all(feature = "metrics", feature = "redis"))]
    #[test]
    fn connection_events_are_counted_with_their_labels() {
        use metrics_util::debugging::{DebugValue, DebuggingRecorder};

        let recorder = DebuggingRecorder::new();
        let snapshotter = recorder.snapshotter();
        // The documented labels (docs/metrics-and-tracing.md), written out: `as_str` is what
        // the counter is labelled with.
        let connections = [
            (Connection::Commands, "commands"),
            (Connection::ReplicaAcks, "replica_acks"),
            (Connection::ReplayCache, "replay_cache"),
            (Connection::Notices, "notices"),
            (Connection::Sentinels, "sentinels"),
        ];
        let events = [
            (ConnectionEvent::Silent, "silent"),
            (ConnectionEvent::Restored, "restored"),
            (ConnectionEvent::FeedLost, "feed_lost"),
            (ConnectionEvent::FeedBack, "feed_back"),
        ];
        metrics::with_local_recorder(&recorder, || {
            for (connection, _) in connections {
                for (event, _) in events {
                    connection_event(connection, event);
                }
            }
        });
        let snapshot = snapshotter.snapshot().into_hashmap();
        for (connection, connection_label) in connections {
            for (event, event_label) in events {
                let found = snapshot.iter().any(|(key, (_, _, value))| {
                    let labels: Vec<_> = key.key().labels().map(|l| (l.key(), l.value())).collect();
                    key.key().name() == "idempotency_connection_events_total"
                        && labels.contains(&("connection", connection_label))
                        && labels.contains(&("event", event_label))
                        && *value == DebugValue::Counter(1)
                });
                assert!(found, "{connection:?} {event:?}");
            }
        }
    }
}
