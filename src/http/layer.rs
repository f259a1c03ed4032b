//! [`IdempotencyLayer`]: the configuration, and what wraps a service.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::header::{HeaderName, SET_COOKIE};
use http::{request, response, Method, StatusCode};

use crate::coordinator::{Coordinator, Error, ShutdownHandle};
use crate::http::config::{handler_timeout_error, rejection_status_error, Config};
use crate::http::stored;
use crate::key::{IdempotencyKey, RecordKey};
use crate::reconciliation::NotStored;
use crate::store::{InFlightRecord, RecordState, Store};

/// A tower [`Layer`](tower_layer::Layer) that makes a service safe to retry: see the [crate docs](crate) for the
/// behaviour, and each `with_*` setter for a setting and its default.
///
/// Clones share the store, the bound on running requests and one [`ShutdownHandle`]: build one
/// layer, then clone and adjust it per route. A clone given its own `with_max_in_flight` gets
/// a bound of its own but stays under the same shutdown; layers over other stores join it with
/// [`with_shutdown_handle`](Self::with_shutdown_handle).
///
/// ```
/// use std::time::Duration;
/// use tower_idempotency::{IdempotencyLayer, MemoryStore};
///
/// let layer = IdempotencyLayer::new(MemoryStore::new())
///     .with_key_required(false)
///     .with_retention(Duration::from_secs(3600));
/// # let _ = layer;
/// ```
#[derive(Clone)]
pub struct IdempotencyLayer {
    pub(crate) coordinator: Coordinator,
    pub(crate) config: Arc<Config>,
}

impl std::fmt::Debug for IdempotencyLayer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("IdempotencyLayer")
            .field("coordinator", &self.coordinator)
            .field("methods", &self.config.methods)
            .field("key_required", &self.config.key_required)
            .field("body_limit", &self.config.body_limit)
            .field("response_limit", &self.config.response_limit)
            .field("fail_open", &self.config.fail_open)
            .field("handler_timeout", &self.config.handler_timeout)
            .field("stream_timeout", &self.config.stream_timeout())
            .field("max_wait", &self.config.max_wait)
            .field("default_wait", &self.config.default_wait)
            .finish_non_exhaustive()
    }
}

/// A record as [`IdempotencyLayer::inspect`] shows it.
///
/// ```
/// use http::StatusCode;
/// use tower_idempotency::{IdempotencyLayer, MemoryStore, RecordState};
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), tower_idempotency::Error> {
/// let layer = IdempotencyLayer::new(MemoryStore::new());
/// if let Some(record) = layer.inspect(Some("tenant-7"), "order-42").await? {
///     if record.state == RecordState::Completed && record.status == Some(StatusCode::INTERNAL_SERVER_ERROR) {
///         layer.purge(Some("tenant-7"), "order-42").await?;
///     }
/// }
/// # Ok(()) }
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct Inspection {
    /// In flight or completed.
    pub state: RecordState,
    /// Lease left (in flight) or retention left (completed).
    pub expires_in: Duration,
    /// The stored response's status (completed records), or the status the first client was
    /// sent when its response was not stored.
    pub status: Option<StatusCode>,
    /// Why the response was not stored, for a key kept as not replayable.
    pub not_stored: Option<NotStored>,
    /// The size of the stored payload in bytes (the response's status, headers kept, body and
    /// trailers, as stored); 0 in flight.
    pub stored_bytes: usize,
    /// The stored response's body. It may hold personal data: show it only when asked.
    pub body: Option<Bytes>,
}

impl IdempotencyLayer {
    /// A layer over `store` with every setting at its default.
    pub fn new(store: impl Store) -> Self {
        Self::from_coordinator(Coordinator::new(store))
    }

    /// A layer over an existing [`Coordinator`], sharing its store, lease, retention, timeout
    /// and in-flight bound.
    pub fn from_coordinator(coordinator: Coordinator) -> Self {
        Self {
            coordinator,
            config: Arc::new(Config::default()),
        }
    }

    fn config(mut self, change: impl FnOnce(&mut Config)) -> Self {
        let config = Arc::make_mut(&mut self.config);
        config.typical_duration = Arc::default();
        config.warned_unscoped_credentials = Arc::default();
        change(config);
        self
    }

    /// The methods the layer covers (default: `POST` and `PATCH`); others pass through untouched.
    ///
    /// ```
    /// # use http::Method;
    /// # use tower_idempotency::{IdempotencyLayer, MemoryStore};
    /// let layer = IdempotencyLayer::new(MemoryStore::new()).with_methods([Method::POST, Method::PUT, Method::DELETE]);
    /// # let _ = layer;
    /// ```
    pub fn with_methods(self, methods: impl IntoIterator<Item = Method>) -> Self {
        self.config(|c| c.methods = methods.into_iter().collect())
    }

    /// Whether a covered request must carry a key (default: `true`, answered with 400 if
    /// missing). When `false`, a request without a key passes through and nothing is stored.
    ///
    /// ```
    /// # use tower_idempotency::{IdempotencyLayer, MemoryStore};
    /// let layer = IdempotencyLayer::new(MemoryStore::new()).with_key_required(false);
    /// # let _ = layer;
    /// ```
    pub fn with_key_required(self, required: bool) -> Self {
        self.config(|c| c.key_required = required)
    }

    /// The header that carries the key (default: `Idempotency-Key`).
    ///
    /// ```
    /// # use http::HeaderName;
    /// # use tower_idempotency::{IdempotencyLayer, MemoryStore};
    /// let layer = IdempotencyLayer::new(MemoryStore::new()).with_key_header(HeaderName::from_static("x-request-key"));
    /// # let _ = layer;
    /// ```
    pub fn with_key_header(self, name: HeaderName) -> Self {
        self.config(|c| c.key_header = name)
    }

    /// The largest request body buffered for fingerprinting (default: 1 MiB). A larger one is
    /// answered 413, judged by `Content-Length` first, and never read past the limit.
    ///
    /// ```
    /// # use tower_idempotency::{IdempotencyLayer, MemoryStore};
    /// let layer = IdempotencyLayer::new(MemoryStore::new()).with_body_limit(64 * 1024);
    /// # let _ = layer;
    /// ```
    pub fn with_body_limit(self, bytes: usize) -> Self {
        self.config(|c| c.body_limit = bytes)
    }

    /// The largest response body stored for replay (default: 1 MiB). A larger response goes to
    /// the client unchanged and is not stored: its key is kept as *not replayable* for the
    /// retention period, so a retry is told so (see
    /// [`with_not_stored_status`](Self::with_not_stored_status)) and never runs the handler
    /// again, unless [`with_release_not_stored`](Self::with_release_not_stored). A warning is
    /// logged. A body of unknown length streams to the client and is stored as it passes, up to
    /// this limit.
    ///
    /// ```
    /// # use tower_idempotency::{IdempotencyLayer, MemoryStore};
    /// let layer = IdempotencyLayer::new(MemoryStore::new()).with_response_limit(256 * 1024);
    /// # let _ = layer;
    /// ```
    pub fn with_response_limit(self, bytes: usize) -> Self {
        self.config(|c| c.response_limit = bytes)
    }

    /// How long a running request holds its key without renewal (default: 30 s; at least 30 ms).
    /// It is renewed every third of it while the handler runs; a node that crashes blocks its keys
    /// this long at most. Over Redis Sentinel, keep it above 15 s: during a failover nothing
    /// renews a claim until the store is on the new master (up to 10 s; [Topologies and
    /// failover](crate::guide::topologies_and_failover)).
    ///
    /// ```
    /// # use std::time::Duration;
    /// # use tower_idempotency::{IdempotencyLayer, MemoryStore};
    /// let layer = IdempotencyLayer::new(MemoryStore::new()).with_lease(Duration::from_secs(10));
    /// # let _ = layer;
    /// ```
    pub fn with_lease(mut self, lease: Duration) -> Self {
        self.coordinator = self.coordinator.with_lease(lease);
        self
    }

    /// How long a stored response is replayed (default: 24 h, as Stripe).
    ///
    /// ```
    /// # use std::time::Duration;
    /// # use tower_idempotency::{IdempotencyLayer, MemoryStore};
    /// let layer = IdempotencyLayer::new(MemoryStore::new()).with_retention(Duration::from_secs(7 * 24 * 3600));
    /// # let _ = layer;
    /// ```
    pub fn with_retention(mut self, retention: Duration) -> Self {
        self.coordinator = self.coordinator.with_retention(retention);
        self
    }

    /// Bounds each store call (default: 2 s, plus 100 ms of grace so a store's own timeout fires
    /// first). A store that does not answer in time is treated as unavailable. With `RedisStore`,
    /// keep its command timeout at or below this.
    ///
    /// ```
    /// # use std::time::Duration;
    /// # use tower_idempotency::{IdempotencyLayer, MemoryStore};
    /// let layer = IdempotencyLayer::new(MemoryStore::new()).with_store_timeout(Duration::from_millis(250));
    /// # let _ = layer;
    /// ```
    pub fn with_store_timeout(mut self, timeout: Duration) -> Self {
        self.coordinator = self.coordinator.with_store_timeout(timeout);
        self
    }

    /// What to do when the store is unavailable (default: `false`, fail closed: 503, the handler
    /// does not run). With `true` the request runs unprotected and a warning is logged.
    ///
    /// ```
    /// # use tower_idempotency::{IdempotencyLayer, MemoryStore};
    /// let layer = IdempotencyLayer::new(MemoryStore::new()).with_fail_open(true);
    /// # let _ = layer;
    /// ```
    pub fn with_fail_open(self, fail_open: bool) -> Self {
        self.config(|c| c.fail_open = fail_open)
    }

    /// Scopes keys, for example per tenant or user (default: none, one namespace). The same key
    /// from two scopes names two records. A request for which `scope` answers `None` is refused
    /// with 500 ([`Rejection::MissingScope`](crate::Rejection::MissingScope)) rather than run
    /// unscoped. [`Scope`](crate::Scope) builds the common ones: a value in the request's
    /// extensions, a header, the host.
    ///
    /// **A replay is answered before the handler runs**, so before any authentication done in
    /// the handler (an axum extractor): whoever sends a key and body another caller sent gets
    /// that caller's stored response, unless the keys are scoped by who is calling. So place
    /// the layer inside (after) the layer that authenticates, and scope keys by what it found
    /// ([`Scope::extension`](crate::Scope::extension)). A layer without a scope that sees
    /// requests with `Authorization` or `Cookie` logs a warning once and counts it
    /// (`idempotency_setup_warnings_total`); a single-tenant service says it means no scope
    /// with [`without_scope`](Self::without_scope).
    ///
    /// ```
    /// # use tower_idempotency::{IdempotencyLayer, MemoryStore, Scope};
    /// #[derive(Clone)]
    /// struct TenantId(String);
    ///
    /// let layer = IdempotencyLayer::new(MemoryStore::new())
    ///     .with_scope(Scope::extension::<TenantId>(|tenant| tenant.0.clone()));
    /// # let _ = layer;
    /// ```
    ///
    /// Or any function of the request's head:
    ///
    /// ```
    /// # use tower_idempotency::{IdempotencyLayer, MemoryStore};
    /// #[derive(Clone)]
    /// struct TenantId(String);
    ///
    /// let layer = IdempotencyLayer::new(MemoryStore::new())
    ///     .with_scope(|parts| parts.extensions.get::<TenantId>().map(|t| t.0.clone()));
    /// # let _ = layer;
    /// ```
    pub fn with_scope<F>(self, scope: F) -> Self
    where
        F: Fn(&request::Parts) -> Option<String> + Send + Sync + 'static,
    {
        self.config(|c| {
            c.scope = Some(Arc::new(scope));
            c.unscoped_on_purpose = false;
        })
    }

    /// Declares that this layer has no scope on purpose (default: no scope, not declared): every
    /// caller's keys share one namespace, as in a single-tenant service, or one whose clients
    /// cannot learn each other's keys. Removes a scope set before, and silences the warning an
    /// unscoped layer logs when its requests carry credentials (see
    /// [`with_scope`](Self::with_scope)): a replay is still answered before the handler
    /// authenticates.
    ///
    /// ```
    /// # use tower_idempotency::{IdempotencyLayer, MemoryStore};
    /// let layer = IdempotencyLayer::new(MemoryStore::new()).without_scope();
    /// # let _ = layer;
    /// ```
    pub fn without_scope(self) -> Self {
        self.config(|c| {
            c.scope = None;
            c.unscoped_on_purpose = true;
        })
    }

    /// Sets or removes the scope function, for the policy file (whose `scope: none` is a
    /// declared choice, as [`without_scope`](Self::without_scope)).
    #[cfg_attr(not(feature = "policy"), allow(dead_code))]
    pub(crate) fn set_scope(self, scope: Option<crate::http::config::ScopeFn>) -> Self {
        self.config(|c| {
            c.unscoped_on_purpose = scope.is_none();
            c.scope = scope;
        })
    }

    /// Decides whether a handler's answer is stored (default: [`default_cacheable`](crate::default_cacheable):
    /// all but 5xx, 401, 403, 408, 409, 425, 429 and `Cache-Control: no-store`; 401 and 403
    /// are given before the operation starts, so a retry with fixed credentials must run). An
    /// answer not stored goes to the client unchanged and releases the key, so a retry runs the
    /// handler again.
    ///
    /// ```
    /// # use http::StatusCode;
    /// # use tower_idempotency::{default_cacheable, IdempotencyLayer, MemoryStore};
    /// // Store successes only.
    /// let layer = IdempotencyLayer::new(MemoryStore::new()).with_cacheable(|parts| parts.status.is_success());
    /// // Or the default, and a 403 too (a refusal this handler gives after the operation ran).
    /// let layer = IdempotencyLayer::new(MemoryStore::new())
    ///     .with_cacheable(|parts| parts.status == StatusCode::FORBIDDEN || default_cacheable(parts));
    /// # let _ = layer;
    /// ```
    pub fn with_cacheable<F>(self, cacheable: F) -> Self
    where
        F: Fn(&response::Parts) -> bool + Send + Sync + 'static,
    {
        self.config(|c| c.cacheable = Arc::new(cacheable))
    }

    /// Decides, for a gRPC response (`content-type: application/grpc…`), which `grpc-status`
    /// codes are stored (default: [`default_grpc_cacheable`](crate::default_grpc_cacheable):
    /// `OK`, `INVALID_ARGUMENT`, `NOT_FOUND`, `ALREADY_EXISTS`, `FAILED_PRECONDITION` and
    /// `OUT_OF_RANGE`). It is asked on top of [`with_cacheable`](Self::with_cacheable), which
    /// sees the HTTP head (status 200 for every gRPC outcome). The status comes in the trailers,
    /// so the decision is made when the body ends, before the client sees the end; in the headers
    /// of a trailers-only response, at once. A call that ends without a status is not stored. A
    /// call not stored releases its key, so a retry runs the handler again.
    ///
    /// ```
    /// # use tower_idempotency::{IdempotencyLayer, MemoryStore};
    /// // Store successful calls only.
    /// let layer = IdempotencyLayer::new(MemoryStore::new()).with_grpc_cacheable(|code| code == 0);
    /// # let _ = layer;
    /// ```
    pub fn with_grpc_cacheable<F>(self, cacheable: F) -> Self
    where
        F: Fn(i32) -> bool + Send + Sync + 'static,
    {
        self.config(|c| c.grpc_cacheable = Arc::new(cacheable))
    }

    /// Whether calls to gRPC's own services pass through untouched (default: `true`): every
    /// method of a service in the `grpc.` proto package, such as the health check
    /// (`/grpc.health.v1.Health/Check`, what Kubernetes' gRPC probes and load balancers call),
    /// server reflection (`/grpc.reflection.v1.ServerReflection/…` and `v1alpha`, what
    /// `grpcurl` calls) and channelz. They read state, their callers never send a key, and
    /// reflection is a bidirectional stream the layer would otherwise buffer: required keys
    /// there refuse every probe. With `false` they are covered like any other `POST`.
    ///
    /// The application's own read calls are the application's to name: see
    /// [`PolicyLayer`](crate::PolicyLayer), whose endpoints can be gRPC methods.
    ///
    /// ```
    /// # use tower_idempotency::{IdempotencyLayer, MemoryStore};
    /// let layer = IdempotencyLayer::new(MemoryStore::new()).with_exempt_grpc_services(false);
    /// # let _ = layer;
    /// ```
    pub fn with_exempt_grpc_services(self, exempt: bool) -> Self {
        self.config(|c| c.exempt_grpc_services = exempt)
    }

    /// The status for a key reused with a different request (default: 409, as Stripe; the IETF
    /// draft asks for 422).
    ///
    /// # Panics
    ///
    /// If `status` is not a 4xx or 5xx: a client would read the refusal as a success, a
    /// redirect or an interim answer. (The policy file refuses it when it is loaded.)
    ///
    /// ```
    /// # use http::StatusCode;
    /// # use tower_idempotency::{IdempotencyLayer, MemoryStore};
    /// let layer = IdempotencyLayer::new(MemoryStore::new()).with_mismatch_status(StatusCode::UNPROCESSABLE_ENTITY);
    /// # let _ = layer;
    /// ```
    pub fn with_mismatch_status(self, status: StatusCode) -> Self {
        if let Some(error) = rejection_status_error(status) {
            panic!("IdempotencyLayer::with_mismatch_status: {error}");
        }
        self.config(|c| c.mismatch_status = status)
    }

    /// The response headers never stored nor replayed (default:
    /// [`default_unstored_headers`](crate::default_unstored_headers): `Set-Cookie` and the
    /// hop-by-hop headers). Replaces the whole list; to add to it, use
    /// [`with_extra_unstored_headers`](Self::with_extra_unstored_headers). The list is applied
    /// to replays too: a header added to it stops being replayed at once, also from records
    /// stored before.
    ///
    /// # Panics
    ///
    /// If the list leaves out `Set-Cookie`: a stored `Set-Cookie` would hand the first caller's
    /// session to whoever retries with its key. A service that must set a cookie on a replay
    /// sets it in a layer outside this one.
    ///
    /// ```
    /// # use http::header::{HeaderName, SET_COOKIE};
    /// # use tower_idempotency::{IdempotencyLayer, MemoryStore};
    /// let layer = IdempotencyLayer::new(MemoryStore::new())
    ///     .with_unstored_headers([SET_COOKIE, HeaderName::from_static("x-request-id")]);
    /// # let _ = layer;
    /// ```
    pub fn with_unstored_headers(self, names: impl IntoIterator<Item = HeaderName>) -> Self {
        let names: Vec<HeaderName> = names.into_iter().collect();
        assert!(
            names.contains(&SET_COOKIE),
            "IdempotencyLayer::with_unstored_headers: the list leaves out Set-Cookie, which would then \
             be stored and replay the first caller's session to whoever retries its key; include \
             SET_COOKIE, or add to the current list with with_extra_unstored_headers"
        );
        self.config(|c| c.unstored_headers = names)
    }

    /// Adds to the response headers never stored nor replayed (default: none added to
    /// [`default_unstored_headers`](crate::default_unstored_headers)). Applied to replays too:
    /// after an incident, a header added here stops being replayed at once, also from records
    /// stored before.
    ///
    /// ```
    /// # use http::header::HeaderName;
    /// # use tower_idempotency::{IdempotencyLayer, MemoryStore};
    /// let layer = IdempotencyLayer::new(MemoryStore::new())
    ///     .with_extra_unstored_headers([HeaderName::from_static("x-request-id")]);
    /// # let _ = layer;
    /// ```
    pub fn with_extra_unstored_headers(self, names: impl IntoIterator<Item = HeaderName>) -> Self {
        self.config(|c| {
            for name in names {
                if !c.unstored_headers.contains(&name) {
                    c.unstored_headers.push(name);
                }
            }
        })
    }

    /// What happens when the client hangs up (the response future is dropped) while the handler
    /// runs (default: `false`: the handler runs to completion in its own task and its response
    /// is stored, so the retry gets the replay). With `true` the handler is cancelled and the
    /// key released, so the retry runs it again.
    ///
    /// ```
    /// # use tower_idempotency::{IdempotencyLayer, MemoryStore};
    /// let layer = IdempotencyLayer::new(MemoryStore::new()).with_cancel_on_disconnect(true);
    /// # let _ = layer;
    /// ```
    pub fn with_cancel_on_disconnect(self, cancel: bool) -> Self {
        self.config(|c| c.cancel_on_disconnect = cancel)
    }

    /// What a key whose response could not be stored (larger than the response limit, a body
    /// that failed part way, a handler past its timeout) becomes (default: `false`: it is kept
    /// completed as *not replayable* for the retention period, and a retry gets
    /// [`Rejection::ResponseNotStored`](crate::Rejection::ResponseNotStored), never a second
    /// run). With `true` the key is released instead, so a retry runs the handler again: choose
    /// it only for handlers that are safe to run twice. Either way a warning is logged.
    ///
    /// ```
    /// # use tower_idempotency::{IdempotencyLayer, MemoryStore};
    /// let layer = IdempotencyLayer::new(MemoryStore::new()).with_release_not_stored(true);
    /// # let _ = layer;
    /// ```
    pub fn with_release_not_stored(self, release: bool) -> Self {
        self.config(|c| c.release_not_stored = release)
    }

    /// The status a retry gets for a key whose first response was not stored (default: 409
    /// Conflict, as for any key the retry cannot use again).
    ///
    /// # Panics
    ///
    /// If `status` is not a 4xx or 5xx, as [`with_mismatch_status`](Self::with_mismatch_status).
    ///
    /// ```
    /// # use http::StatusCode;
    /// # use tower_idempotency::{IdempotencyLayer, MemoryStore};
    /// let layer = IdempotencyLayer::new(MemoryStore::new()).with_not_stored_status(StatusCode::UNPROCESSABLE_ENTITY);
    /// # let _ = layer;
    /// ```
    pub fn with_not_stored_status(self, status: StatusCode) -> Self {
        if let Some(error) = rejection_status_error(status) {
            panic!("IdempotencyLayer::with_not_stored_status: {error}");
        }
        self.config(|c| c.not_stored_status = status)
    }

    /// The longest a handler may take to give its response head (default: 60 s). Past it the
    /// handler is cancelled, the client gets
    /// [`Rejection::HandlerTimedOut`](crate::Rejection::HandlerTimedOut) (504), and the key is
    /// kept as not replayable (or released, see
    /// [`with_release_not_stored`](Self::with_release_not_stored)): a hung handler no longer
    /// holds its key and a running-request slot for ever. The clock covers the handler and the
    /// reading of a response body of known length; a body of unknown length is bounded by
    /// [`with_stream_timeout`](Self::with_stream_timeout) instead. `Duration::MAX` turns the
    /// bound off.
    ///
    /// # Panics
    ///
    /// If `timeout` is under 100 ms: ordinary handlers would be cancelled and their keys kept
    /// as not replayable. (The policy file refuses it when it is loaded.)
    ///
    /// ```
    /// # use std::time::Duration;
    /// # use tower_idempotency::{IdempotencyLayer, MemoryStore};
    /// let layer = IdempotencyLayer::new(MemoryStore::new()).with_handler_timeout(Duration::from_secs(20));
    /// # let _ = layer;
    /// ```
    pub fn with_handler_timeout(self, timeout: Duration) -> Self {
        if let Some(error) = handler_timeout_error(timeout) {
            panic!("IdempotencyLayer::with_handler_timeout: {error}");
        }
        self.config(|c| c.handler_timeout = timeout)
    }

    /// The longest a response body of unknown length (a compression layer inside this one, a
    /// proxied chunked upstream, server-sent events, a gRPC server stream) may hold its key
    /// while it streams, counted from its head (default: the
    /// [handler timeout](Self::with_handler_timeout), 60 s unless set). Past it the claim is
    /// settled as not stored, whether or not the client is reading: the key is kept as not
    /// replayable (or released, see [`with_release_not_stored`](Self::with_release_not_stored)),
    /// its lease renewal and its running-request slot end, and a retry gets
    /// [`Rejection::ResponseNotStored`](crate::Rejection::ResponseNotStored) (or runs) instead
    /// of the 409 `InFlight` of a key held for as long as the stream lasts. The client's
    /// response is not cut: it streams on to its end, no longer copied; if the client has left,
    /// the layer stops reading the body there. `Duration::MAX` turns the bound off.
    ///
    /// ```
    /// # use std::time::Duration;
    /// # use tower_idempotency::{IdempotencyLayer, MemoryStore};
    /// let layer = IdempotencyLayer::new(MemoryStore::new()).with_stream_timeout(Duration::from_secs(30));
    /// # let _ = layer;
    /// ```
    pub fn with_stream_timeout(self, timeout: Duration) -> Self {
        self.config(|c| c.stream_timeout = Some(timeout))
    }

    /// Hands each claimed request's claim to its handler (default: `false`): a
    /// [`TransactionalClaim`](crate::TransactionalClaim) in the request's extensions, with which
    /// a handler that writes to the store's database stores its response in its own transaction
    /// (`PostgresStore::complete_in`), so its business rows and the stored response commit or
    /// roll back together. The layer's own completion then finds the record completed and leaves
    /// it; after a rollback it stores or releases as usual. Off by default: it costs an
    /// allocation per claimed request that only such handlers need.
    ///
    /// ```
    /// # use tower_idempotency::{IdempotencyLayer, MemoryStore};
    /// let layer = IdempotencyLayer::new(MemoryStore::new()).with_transactional_completion(true);
    /// # let _ = layer;
    /// ```
    pub fn with_transactional_completion(self, enabled: bool) -> Self {
        self.config(|c| c.transactional_completion = enabled)
    }

    /// Which parts of a request count in its fingerprint, the test of "the same request" for a
    /// retry (default: [`FingerprintPolicy::new`](crate::FingerprintPolicy::new): method,
    /// authority, path and query, `Content-Type` as sent, and the body, as in earlier releases).
    ///
    /// ```
    /// # use tower_idempotency::{FingerprintPolicy, IdempotencyLayer, MemoryStore};
    /// let layer = IdempotencyLayer::new(MemoryStore::new())
    ///     .with_fingerprint(FingerprintPolicy::new().media_type_only());
    /// # let _ = layer;
    /// ```
    pub fn with_fingerprint(self, policy: crate::http::fingerprint::FingerprintPolicy) -> Self {
        self.config(|c| c.fingerprint = policy)
    }

    /// Puts each keyed request's [`RecordKey`] (its key and scope) in the request's extensions
    /// for the handler (default: `false`), to log it or to derive the idempotency key of a call
    /// downstream: [`RecordKey::digest_hex`] is unique per scope and key, so two tenants' equal
    /// keys never meet at a payment provider. Off by default: it costs an allocation per
    /// handled request that only such handlers need.
    ///
    /// ```
    /// # use tower_idempotency::{IdempotencyLayer, MemoryStore};
    /// let layer = IdempotencyLayer::new(MemoryStore::new()).with_key_in_extensions(true);
    /// // In an axum handler: `Extension(key): Extension<tower_idempotency::RecordKey>`.
    /// # let _ = layer;
    /// ```
    pub fn with_key_in_extensions(self, enabled: bool) -> Self {
        self.config(|c| c.key_in_extensions = enabled)
    }

    /// Bounds how many keyed requests may run their handler at once, fail-open runs included
    /// (default: 10 000); over it new keys are answered 503 and nothing is claimed, while a key
    /// already done still replays and one running still gets its 409 (one read of the store).
    /// Starts a new bound, with its own count, shared by the clones made afterwards; the layer
    /// stays under the same [`ShutdownHandle`], so a clone bounded per route is still stopped
    /// and waited for by one shutdown.
    ///
    /// ```
    /// # use tower_idempotency::{IdempotencyLayer, MemoryStore};
    /// let layer = IdempotencyLayer::new(MemoryStore::new()).with_max_in_flight(512);
    /// let exports = layer.clone().with_max_in_flight(4);
    /// assert_eq!(exports.shutdown_handle(), layer.shutdown_handle());
    /// ```
    pub fn with_max_in_flight(mut self, max: u32) -> Self {
        self.coordinator = self.coordinator.with_max_in_flight(max);
        self
    }

    /// Calls `hook` whenever a handler ran but its response is not, or may not stay, in the store
    /// (default: none): the response could not be stored (too large, its body failed, the handler
    /// timed out), the store did not take it, the claim was lost before it, or `RedisStore`'s
    /// replicas never acknowledged it. The event carries the key (scope and key), the owner
    /// token, what happened, and the encoded response if there was one: journal it to reconcile
    /// later. Sets the hook of the layer's [`Coordinator`] (see
    /// [`Coordinator::with_reconciliation`]), so clones made afterwards share it.
    ///
    /// ```
    /// # use tower_idempotency::{IdempotencyLayer, MemoryStore};
    /// let layer = IdempotencyLayer::new(MemoryStore::new()).with_reconciliation(|event| {
    ///     tracing::error!(key = ?event.key, kind = ?event.kind, "to reconcile");
    /// });
    /// # let _ = layer;
    /// ```
    pub fn with_reconciliation<F>(mut self, hook: F) -> Self
    where
        F: Fn(&crate::reconciliation::ReconciliationEvent) + Send + Sync + 'static,
    {
        self.coordinator = self.coordinator.with_reconciliation(hook);
        self
    }

    /// The longest a request whose key is in flight may wait for the running request, instead
    /// of the 409 `InFlight` it gets at once (default: zero, no request waits).
    ///
    /// A client asks with `Prefer: wait=N` (RFC 7240; `N` whole seconds), honoured up to this
    /// maximum and answered with `Preference-Applied: wait=<the seconds granted>` (what it
    /// asked for, cut to the maximum; not the time it waited). A waiting
    /// request gets the replay as soon as the running one completes, on whichever instance it
    /// runs (the store notifies: see [`Store::watch`]); if the running request releases its key
    /// (an answer not stored, a panic), the waiting one claims it and runs the handler itself;
    /// if the wait runs out, it gets the 409 `InFlight` it would have got at once. Waiters are
    /// bounded by [`with_max_waiters`](Self::with_max_waiters). A request that does not wait
    /// pays nothing for this.
    ///
    /// ```
    /// # use std::time::Duration;
    /// # use tower_idempotency::{IdempotencyLayer, MemoryStore};
    /// let layer = IdempotencyLayer::new(MemoryStore::new()).with_max_wait(Duration::from_secs(10));
    /// # let _ = layer;
    /// ```
    pub fn with_max_wait(self, max: Duration) -> Self {
        self.config(|c| {
            c.max_wait = max;
            c.default_wait = c.default_wait.min(max);
        })
    }

    /// How long a request whose key is in flight waits when its client does not say (no valid
    /// `Prefer: wait=N`; default: zero, it gets the 409 at once). Raises the
    /// [maximum](Self::with_max_wait) to `wait` if it is lower. A client still opts out with
    /// `Prefer: wait=0`. No `Preference-Applied` is sent for a wait the client did not ask for.
    ///
    /// ```
    /// # use std::time::Duration;
    /// # use tower_idempotency::{IdempotencyLayer, MemoryStore};
    /// let layer = IdempotencyLayer::new(MemoryStore::new()).with_default_wait(Duration::from_secs(5));
    /// # let _ = layer;
    /// ```
    pub fn with_default_wait(self, wait: Duration) -> Self {
        self.config(|c| {
            c.default_wait = wait;
            c.max_wait = c.max_wait.max(wait);
        })
    }

    /// Bounds how many requests may wait for a running request at once (default: 1 000; 0:
    /// none waits). Each
    /// holds its request body while it waits (up to the body limit). Over the bound a request
    /// that asks to wait gets the usual 409 `InFlight` with `Retry-After` at once, as if it had
    /// not asked: the key is in flight, and its client already knows how to retry that. Starts a
    /// new count, shared by the clones made afterwards.
    ///
    /// ```
    /// # use tower_idempotency::{IdempotencyLayer, MemoryStore};
    /// let layer = IdempotencyLayer::new(MemoryStore::new()).with_max_waiters(200);
    /// # let _ = layer;
    /// ```
    pub fn with_max_waiters(mut self, max: u32) -> Self {
        self.coordinator = self.coordinator.with_max_waiters(max);
        self
    }

    /// Names this layer in its metrics (default: none): each one it records carries a `name`
    /// label with this value, so two layers (over two stores, or on two routes) keep apart
    /// series that would otherwise merge; without a name no `name` label is recorded. The
    /// labelled keys are built once, here, so a named layer's metrics cost no allocation per
    /// request. Sets the name of the layer's [`Coordinator`] (see
    /// [`Coordinator::with_name`]); clones made afterwards share it, so name a per-route clone
    /// after cloning.
    ///
    /// ```
    /// # use tower_idempotency::{IdempotencyLayer, MemoryStore};
    /// let base = IdempotencyLayer::new(MemoryStore::new());
    /// let payments = base.clone().with_name("payments");
    /// let refunds = base.with_name("refunds");
    /// # let _ = (payments, refunds);
    /// ```
    pub fn with_name(mut self, name: impl Into<Arc<str>>) -> Self {
        self.coordinator = self.coordinator.with_name(name);
        self
    }

    /// A handle to stop taking new keys and wait for running handlers (see [`ShutdownHandle`]):
    /// this layer's, its clones' whatever their settings, and those of every layer or
    /// coordinator in the same group.
    pub fn shutdown_handle(&self) -> ShutdownHandle {
        self.coordinator.shutdown_handle()
    }

    /// Puts this layer in the shutdown group of `handle` (default: a group of its own, shared by
    /// its clones), so one [`ShutdownHandle::shutdown`] stops and waits for several layers at
    /// once: a layer over Redis and one over PostgreSQL in one service, say. See
    /// [`Coordinator::with_shutdown_handle`].
    ///
    /// ```
    /// # use tower_idempotency::{IdempotencyLayer, MemoryStore, ShutdownHandle};
    /// let shutdown = ShutdownHandle::new();
    /// let payments = IdempotencyLayer::new(MemoryStore::new()).with_shutdown_handle(&shutdown);
    /// let emails = IdempotencyLayer::new(MemoryStore::new()).with_shutdown_handle(&shutdown);
    /// // On SIGTERM: `shutdown.shutdown(deadline).await` stops both.
    /// # let _ = (payments, emails);
    /// ```
    pub fn with_shutdown_handle(mut self, handle: &ShutdownHandle) -> Self {
        self.coordinator = self.coordinator.with_shutdown_handle(handle);
        self
    }

    /// The coordinator this layer runs on.
    pub fn coordinator(&self) -> &Coordinator {
        &self.coordinator
    }

    /// Reads the record for `key` in `scope`, addressed as the layer addresses requests.
    ///
    /// ```
    /// # use tower_idempotency::{IdempotencyLayer, MemoryStore};
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), tower_idempotency::Error> {
    /// let layer = IdempotencyLayer::new(MemoryStore::new());
    /// assert!(layer.inspect(Some("tenant-7"), "order-42").await?.is_none());
    /// # Ok(()) }
    /// ```
    pub async fn inspect(&self, scope: Option<&str>, key: &str) -> Result<Option<Inspection>, Error> {
        let Some(key) = record_key(scope, key) else {
            return Ok(None);
        };
        let Some(info) = self.coordinator.inspect(&key).await? else {
            return Ok(None);
        };
        let decoded = info.payload.as_ref().map(stored::decode).transpose();
        let decoded = decoded.map_err(|reason| Error::Store(crate::store::StoreError::Corrupt(reason)))?;
        let status = decoded.as_ref().and_then(stored::Decoded::status);
        let (not_stored, body) = match decoded {
            Some(stored::Decoded::NotStored { why, .. }) => (Some(why), None),
            Some(stored::Decoded::Response(stored)) => (None, Some(stored.body)),
            Some(stored::Decoded::Newer { .. }) | None => (None, None),
        };
        Ok(Some(Inspection {
            state: info.state,
            expires_in: info.expires_in,
            status,
            stored_bytes: info.payload.as_ref().map_or(0, Bytes::len),
            not_stored,
            body,
        }))
    }

    /// Deletes the record for `key` in `scope` whatever its state, so the next request with that
    /// key runs the handler. Answers whether there was a record.
    ///
    /// ```
    /// # use tower_idempotency::{IdempotencyLayer, MemoryStore};
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), tower_idempotency::Error> {
    /// let layer = IdempotencyLayer::new(MemoryStore::new());
    /// assert!(!layer.purge(None, "order-42").await?);
    /// # Ok(()) }
    /// ```
    pub async fn purge(&self, scope: Option<&str>, key: &str) -> Result<bool, Error> {
        match record_key(scope, key) {
            Some(key) => self.coordinator.purge(&key).await,
            None => Ok(false),
        }
    }

    /// Lists the records in flight claimed at least `older_than` ago, the oldest first, at
    /// most `limit`: requests still running, or stuck until their lease ends. Records show
    /// their digest, never the key; see [`Coordinator::in_flight`] and [`Store::in_flight`].
    ///
    /// ```
    /// # use std::time::Duration;
    /// # use tower_idempotency::{IdempotencyLayer, MemoryStore};
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), tower_idempotency::Error> {
    /// let layer = IdempotencyLayer::new(MemoryStore::new());
    /// for record in layer.in_flight(Duration::from_secs(60), 100).await? {
    ///     println!("{} in flight for {:?}", record.digest_hex(), record.age);
    /// }
    /// # Ok(()) }
    /// ```
    pub async fn in_flight(&self, older_than: Duration, limit: usize) -> Result<Vec<InFlightRecord>, Error> {
        self.coordinator.in_flight(older_than, limit).await
    }
}

/// A key that is not valid can have no record.
fn record_key(scope: Option<&str>, key: &str) -> Option<RecordKey> {
    IdempotencyKey::parse(key)
        .ok()
        .map(|key| RecordKey::new(scope, key))
}
