//! Every HTTP-side setting of the layer, with its default, in one place.

use std::sync::atomic::AtomicBool;
use std::sync::Arc;
use std::time::Duration;

use crate::http::fingerprint::FingerprintPolicy;
use crate::http::grpc::{default_grpc_cacheable, GrpcCacheableFn};
use crate::http::retry_after::TypicalDuration;
use crate::http::stored::StoredResponse;

use http::header::{self, HeaderName};
use http::{request, response, Method, StatusCode};

pub(crate) type ScopeFn = Arc<dyn Fn(&request::Parts) -> Option<String> + Send + Sync>;
pub(crate) type CacheableFn = Arc<dyn Fn(&response::Parts) -> bool + Send + Sync>;

pub(crate) const MIB: usize = 1024 * 1024;

/// A minute: past the timeouts of most clients and proxies in front of a service (so its
/// client has given up anyway), and far past what a create-this-resource handler takes.
pub(crate) const DEFAULT_HANDLER_TIMEOUT: Duration = Duration::from_secs(60);

/// The shortest handler timeout the layer takes: below it, ordinary handlers (a database round
/// trip across zones, a payment provider's call) would be cancelled and their keys kept as not
/// replayable, a setting that can only hurt.
pub(crate) const MIN_HANDLER_TIMEOUT: Duration = Duration::from_millis(100);

/// Why `status` cannot be the status of a rejection (a mismatch, a response not stored), if it
/// cannot: only 4xx and 5xx tell a client its request was not served; a 2xx reads as success,
/// a 3xx as a redirect, a 1xx as an interim answer.
pub(crate) fn rejection_status_error(status: StatusCode) -> Option<String> {
    (!status.is_client_error() && !status.is_server_error()).then(|| {
        format!(
            "status {} cannot answer a refused request: a client reads it as {}; use a 4xx or 5xx status",
            status.as_u16(),
            if status.is_success() {
                "success"
            } else if status.is_redirection() {
                "a redirect"
            } else {
                "an interim answer"
            }
        )
    })
}

/// Why `timeout` cannot be a handler timeout, if it cannot.
pub(crate) fn handler_timeout_error(timeout: Duration) -> Option<String> {
    (timeout < MIN_HANDLER_TIMEOUT).then(|| {
        format!(
            "a handler timeout of {timeout:?} is under {MIN_HANDLER_TIMEOUT:?}: handlers would be \
             cancelled and their keys kept as not replayable"
        )
    })
}

#[derive(Clone)]
pub(crate) struct Config {
    pub(crate) methods: Vec<Method>,
    pub(crate) key_header: HeaderName,
    pub(crate) key_required: bool,
    pub(crate) body_limit: usize,
    pub(crate) response_limit: usize,
    pub(crate) fail_open: bool,
    pub(crate) scope: Option<ScopeFn>,
    /// No scope, and chosen so (`without_scope`): requests with credentials are not warned of.
    pub(crate) unscoped_on_purpose: bool,
    /// Set once this layer, unscoped, has seen a keyed request with credentials and warned of
    /// it: checked first, so the headers are looked at only until then. A reconfigured layer
    /// starts its own, clones share it.
    pub(crate) warned_unscoped_credentials: Arc<AtomicBool>,
    /// Store outages logged at most once per interval, by every clone of the layer.
    pub(crate) store_outage_log: Arc<crate::telemetry::Throttled>,
    pub(crate) cacheable: CacheableFn,
    /// For gRPC responses, which `grpc-status` codes are stored (on top of `cacheable`).
    pub(crate) grpc_cacheable: GrpcCacheableFn,
    pub(crate) mismatch_status: StatusCode,
    pub(crate) unstored_headers: Vec<HeaderName>,
    pub(crate) cancel_on_disconnect: bool,
    /// Release the key of a response that could not be stored, instead of keeping it as not
    /// replayable.
    pub(crate) release_not_stored: bool,
    /// The status a retry gets for a key whose response was not stored.
    pub(crate) not_stored_status: StatusCode,
    /// The longest a handler may take to give its response head.
    pub(crate) handler_timeout: Duration,
    /// The longest a claim is held while a body of unknown length streams, from its head;
    /// `None`: the handler timeout.
    pub(crate) stream_timeout: Option<Duration>,
    /// Hand each claimed request's claim to its handler, for a completion in its transaction.
    pub(crate) transactional_completion: bool,
    /// Which parts of a request count in its fingerprint.
    pub(crate) fingerprint: FingerprintPolicy,
    /// Put each keyed request's [`RecordKey`](crate::RecordKey) in its extensions.
    pub(crate) key_in_extensions: bool,
    /// The longest a request whose key is in flight may wait for the running one (zero: none
    /// waits).
    pub(crate) max_wait: Duration,
    /// How long such a request waits when it does not say (`Prefer: wait=N`).
    pub(crate) default_wait: Duration,
    /// How long this layer's handlers take, for `Retry-After`; a reconfigured layer starts its
    /// own (its handlers may differ), clones share it.
    pub(crate) typical_duration: Arc<TypicalDuration>,
    /// Let calls to gRPC's own services (`/grpc.…`: health, reflection) pass untouched.
    pub(crate) exempt_grpc_services: bool,
}

impl Default for Config {
    fn default() -> Self {
        Self {
            methods: vec![Method::POST, Method::PATCH],
            key_header: HeaderName::from_static("idempotency-key"),
            key_required: true,
            body_limit: MIB,
            response_limit: MIB,
            fail_open: false,
            scope: None,
            unscoped_on_purpose: false,
            warned_unscoped_credentials: Arc::default(),
            store_outage_log: Arc::default(),
            cacheable: Arc::new(default_cacheable),
            grpc_cacheable: Arc::new(default_grpc_cacheable),
            mismatch_status: StatusCode::CONFLICT,
            unstored_headers: default_unstored_headers(),
            cancel_on_disconnect: false,
            release_not_stored: false,
            not_stored_status: StatusCode::CONFLICT,
            handler_timeout: DEFAULT_HANDLER_TIMEOUT,
            stream_timeout: None,
            transactional_completion: false,
            fingerprint: FingerprintPolicy::default(),
            key_in_extensions: false,
            max_wait: Duration::ZERO,
            default_wait: Duration::ZERO,
            typical_duration: Arc::default(),
            exempt_grpc_services: true,
        }
    }
}

impl Config {
    /// The bound in force on holding a claim while its body streams.
    pub(crate) fn stream_timeout(&self) -> Duration {
        self.stream_timeout.unwrap_or(self.handler_timeout)
    }

    /// A copy of a response with `parts` as this layer stores it (the headers it keeps, up to
    /// its response limit), for a body of about `expected` bytes.
    pub(crate) fn stored_response(&self, parts: &response::Parts, expected: usize) -> StoredResponse {
        let keep = |name: &HeaderName| !self.unstored_headers.contains(name);
        StoredResponse::start(parts.status, &parts.headers, keep, expected, self.response_limit)
    }
}

/// The default test of whether a handler's answer may be stored and replayed: everything but
/// 5xx, 401, 403, 408, 409, 425 and 429 (answers a retry may well change: 401 and 403 are given
/// before the operation starts, and a retry with fixed credentials under the same key must run),
/// and answers the handler marked `Cache-Control: no-store`.
///
/// ```
/// use http::{Response, StatusCode};
/// use tower_idempotency::default_cacheable;
///
/// let (created, _) = Response::builder().status(StatusCode::CREATED).body(()).unwrap().into_parts();
/// let (busy, _) = Response::builder().status(StatusCode::TOO_MANY_REQUESTS).body(()).unwrap().into_parts();
/// let (private, _) = Response::builder().header("cache-control", "private, no-store").body(()).unwrap().into_parts();
/// assert!(default_cacheable(&created));
/// assert!(!default_cacheable(&busy));
/// let (denied, _) = Response::builder().status(StatusCode::FORBIDDEN).body(()).unwrap().into_parts();
/// assert!(!default_cacheable(&denied));
/// assert!(!default_cacheable(&private));
/// ```
pub fn default_cacheable(parts: &response::Parts) -> bool {
    let status = parts.status;
    let transient = status.is_server_error()
        || matches!(
            status,
            StatusCode::UNAUTHORIZED
                | StatusCode::FORBIDDEN
                | StatusCode::REQUEST_TIMEOUT
                | StatusCode::CONFLICT
                | StatusCode::TOO_EARLY
                | StatusCode::TOO_MANY_REQUESTS
        );
    let no_store = parts.headers.get_all(header::CACHE_CONTROL).iter().any(|value| {
        let mut directives = value.to_str().unwrap_or_default().split(',');
        directives.any(|directive| directive.trim().eq_ignore_ascii_case("no-store"))
    });
    !transient && !no_store
}

/// The headers never stored nor replayed by default: `Set-Cookie` (a session must not be handed to
/// whoever retries) and the hop-by-hop headers of RFC 9110 §7.6.1.
///
/// ```
/// use http::header::SET_COOKIE;
/// assert!(tower_idempotency::default_unstored_headers().contains(&SET_COOKIE));
/// ```
pub fn default_unstored_headers() -> Vec<HeaderName> {
    vec![
        header::SET_COOKIE,
        header::CONNECTION,
        HeaderName::from_static("keep-alive"),
        HeaderName::from_static("proxy-connection"),
        header::PROXY_AUTHENTICATE,
        header::TE,
        header::TRAILER,
        header::TRANSFER_ENCODING,
        header::UPGRADE,
    ]
}
