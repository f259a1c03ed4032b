//! [`Idempotency`]: the service, a thin adapter from HTTP to the [`Coordinator`].

use std::future::Future;
use std::panic::AssertUnwindSafe;
use std::pin::Pin;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use futures_util::FutureExt;
use http::header::{AUTHORIZATION, COOKIE};
use http::{request, HeaderMap, Request, Response};
use http_body::Body;
use tower_layer::Layer;
use tower_service::Service;
use tracing::{Instrument, Span};

use crate::coordinator::{Begin, Claim, Coordinator, Error};
use crate::http::body::{collect_limited, BoxError, Collected, RequestBody};
use crate::http::config::Config;
use crate::http::future::{Answer, ResponseFuture, Step};
use crate::http::grpc;
use crate::http::layer::IdempotencyLayer;
use crate::http::prefer::Wait;
use crate::http::replay;
use crate::http::response::Rejection;
use crate::http::response_body::ResponseBody;
use crate::http::response_body::{capture, declared_length, release, settle_not_stored, Captured, Storing};
use crate::http::retry_after::retry_after;
use crate::http::stored::{self, Decoded};
use crate::http::transactional::TransactionalClaim;
use crate::key::{IdempotencyKey, KeyError, RecordKey};
use crate::reconciliation::NotStored;
use crate::store::StoreError;
use crate::telemetry::{self, Named, RequestOutcome, SetupWarning};

/// The middleware [`IdempotencyLayer`] builds; see the [crate docs](crate).
///
/// ```
/// use std::convert::Infallible;
/// use bytes::Bytes;
/// use http::{Request, Response};
/// use http_body_util::Full;
/// use tower_idempotency::{Idempotency, IdempotencyLayer, MemoryStore, RequestBody};
///
/// let handler = tower::service_fn(|_: Request<RequestBody<Full<Bytes>>>| async {
///     Ok::<_, Infallible>(Response::new(Full::new(Bytes::from("ok"))))
/// });
/// let service = Idempotency::new(handler, IdempotencyLayer::new(MemoryStore::new()));
/// # let _ = service;
/// ```
///
/// The inner service receives `Request<RequestBody<ReqBody>>` and may answer with any body. The
/// handler runs in the request's own future; if the client hangs up once the key is claimed, that
/// future is moved to a Tokio task of its own to finish, so its future and body must be
/// `Send + 'static`.
#[derive(Clone, Debug)]
pub struct Idempotency<S> {
    inner: S,
    layer: IdempotencyLayer,
}

// Here rather than beside the layer: the service holds the layer's settings, so the layer
// naming its service would make the two files import each other.
impl<S> Layer<S> for IdempotencyLayer {
    type Service = Idempotency<S>;

    fn layer(&self, inner: S) -> Self::Service {
        Idempotency::new(inner, self.clone())
    }
}

impl<S> Idempotency<S> {
    /// Wraps `inner` with the settings of `layer`.
    pub fn new(inner: S, layer: IdempotencyLayer) -> Self {
        Self { inner, layer }
    }

    /// The wrapped service.
    pub fn get_ref(&self) -> &S {
        &self.inner
    }
}

impl<S, ReqBody, ResBody> Service<Request<ReqBody>> for Idempotency<S>
where
    S: Service<Request<RequestBody<ReqBody>>, Response = Response<ResBody>> + Clone + Send + 'static,
    S::Future: Send + 'static,
    S::Error: Send + 'static,
    ReqBody: Body<Data = Bytes> + Send + 'static,
    ResBody: Body<Data = Bytes, Error: Into<BoxError>> + Send + 'static,
{
    type Response = Response<ResponseBody<ResBody>>;
    type Error = S::Error;
    type Future = ResponseFuture<S::Future, ResBody, S::Error>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: Request<ReqBody>) -> Self::Future {
        call_with(&mut self.inner, &self.layer, request)
    }
}

/// The layer's work for one request, with `layer`'s settings: [`Idempotency`] calls it with its
/// own, a [`PolicyService`](crate::PolicyService) with those of the endpoint the request is for.
#[inline]
pub(crate) fn call_with<S, ReqBody, ResBody>(
    inner: &mut S,
    layer: &IdempotencyLayer,
    request: Request<ReqBody>,
) -> ResponseFuture<S::Future, ResBody, S::Error>
where
    S: Service<Request<RequestBody<ReqBody>>, Response = Response<ResBody>> + Clone + Send + 'static,
    S::Future: Send + 'static,
    S::Error: Send + 'static,
    ReqBody: Body<Data = Bytes> + Send + 'static,
    ResBody: Body<Data = Bytes, Error: Into<BoxError>> + Send + 'static,
{
    let config = &layer.config;
    let named = layer.coordinator.named();
    let guarded = request.extensions().get::<Guarded>().is_some();
    if guarded
        || !config.methods.contains(request.method())
        || (config.exempt_grpc_services && grpc::is_grpc_service(request.uri().path()))
    {
        return ResponseFuture::passthrough(inner.call(request.map(RequestBody::streaming)));
    }
    // Refused before the store is asked: counted, and answered at once.
    let refuse = |rejection: Rejection, headers: &HeaderMap| {
        telemetry::outcome(RequestOutcome::Rejected, named);
        let response = rejection.respond(&config.key_header, grpc::is_grpc_request(headers), named);
        ResponseFuture::ready(mark(response, RequestOutcome::Rejected))
    };
    let key = match key_from_headers(request.headers(), config) {
        Ok(Some(key)) => key,
        Ok(None) if !config.key_required => {
            return ResponseFuture::passthrough(inner.call(request.map(RequestBody::streaming)));
        }
        Ok(None) => return refuse(Rejection::MissingKey, request.headers()),
        Err(error) => return refuse(Rejection::InvalidKey(error), request.headers()),
    };
    let (mut parts, body) = request.into_parts();
    parts.extensions.insert(Guarded);
    let scope = match &config.scope {
        Some(scope) => match scope(&parts) {
            Some(scope) => Some(scope),
            None => return refuse(Rejection::MissingScope, &parts.headers),
        },
        None => {
            // Looked at only until this layer has warned, and never when unscoped on purpose.
            if !config.unscoped_on_purpose && !config.warned_unscoped_credentials.load(Ordering::Relaxed) {
                // Two lookups of standard header names, for unscoped layers only, until it warned.
                let credentials = [AUTHORIZATION, COOKIE]
                    .into_iter()
                    .find(|name| parts.headers.contains_key(name));
                if let Some(header) = credentials {
                    warn_unscoped_credentials(&parts, header, config, named);
                }
            }
            None
        }
    };
    let key = RecordKey::new(scope.as_deref(), key);
    // Everything the keyed request does, handler included, runs in this span; a run detached
    // when the client leaves takes it along.
    let span = telemetry::request_span(&key);
    // The ready service goes to the keyed request; a fresh clone waits for the next one.
    let clone = inner.clone();
    let inner = std::mem::replace(inner, clone);
    let begin = begin_keyed(
        inner,
        layer.coordinator.clone(),
        config.clone(),
        key,
        parts,
        body,
        span.clone(),
    );
    ResponseFuture::keyed(Box::pin(begin.instrument(span)), config.cancel_on_disconnect)
}

/// Warns, once per layer, that an unscoped layer sees requests with credentials (`header`): its
/// replays are answered before the handler runs, so before any authentication the handler does,
/// and the keys of every caller share one namespace.
#[cold]
#[inline(never)]
fn warn_unscoped_credentials(
    parts: &request::Parts,
    header: http::HeaderName,
    config: &Config,
    named: Option<&telemetry::Named>,
) {
    if config.warned_unscoped_credentials.swap(true, Ordering::Relaxed) {
        return;
    }
    telemetry::setup_warning(SetupWarning::UnscopedCredentials, named);
    tracing::warn!(
        method = %parts.method,
        path = parts.uri.path(),
        %header,
        "an idempotency layer without a scope sees requests with credentials: a replay is answered \
         before the handler runs, so before any authentication in the handler, and any caller who \
         sends another's key and body gets that caller's stored response. Put the layer inside \
         the authentication and scope keys by what it found (with_scope(Scope::extension::<T>(..))), \
         or declare a single-tenant layer with without_scope(). Logged once per layer"
    );
}

/// Marks a request an outer idempotency layer already handles, so that nested layers (a
/// `route_layer` around a `MethodRouter::layer`, say) do not claim its key a second time and
/// find their own claim in flight.
#[derive(Clone, Copy)]
pub(crate) struct Guarded;

fn key_from_headers(headers: &HeaderMap, config: &Config) -> Result<Option<IdempotencyKey>, KeyError> {
    let mut values = headers.get_all(&config.key_header).iter();
    match (values.next(), values.next()) {
        (None, _) => Ok(None),
        (Some(value), None) => IdempotencyKey::parse_bytes(value.as_bytes()).map(Some),
        (Some(_), Some(_)) => Err(KeyError::Repeated),
    }
}

/// Reads the body, fingerprints the request and claims its key, in the request's own future: a
/// client that leaves before the claim answers cancels all of it (a claim still on its way is
/// released in the background by the coordinator). Only a claimed request goes on to
/// [`run_claimed`], the one part that costs a detached future. Counts the request's outcome
/// and writes it in `span`, the request's.
///
/// An `async` block rather than an `async fn`: an `async fn` keeps every argument twice in its
/// state (as passed, and moved into its body), and this state is the one allocation every keyed
/// request makes. Kept under 1 KiB, glibc's malloc serves it from the thread's own cache instead
/// of its arena, whose lock both worker threads take.
#[allow(clippy::manual_async_fn)]
fn begin_keyed<S, ReqBody, ResBody>(
    inner: S,
    coordinator: Coordinator,
    config: Arc<Config>,
    key: RecordKey,
    parts: request::Parts,
    body: ReqBody,
    span: Span,
) -> impl Future<Output = Step<ResBody, S::Error>>
where
    S: Service<Request<RequestBody<ReqBody>>, Response = Response<ResBody>> + Send + 'static,
    S::Future: Send + 'static,
    S::Error: Send + 'static,
    ReqBody: Body<Data = Bytes> + Send + 'static,
    ResBody: Body<Data = Bytes, Error: Into<BoxError>> + Send + 'static,
{
    async move {
        // Whether this is a gRPC call (its rejections must speak gRPC) is looked up where it is
        // needed, not kept across the awaits: that byte would cost this state 16. The rejections
        // of a body are made in a block of their own, which ends before the claim: what it holds
        // (the closure's references) is then not kept beside the claim's state.
        let (body, fingerprint) = {
            let reject = |outcome: RequestOutcome, rejection: Rejection| {
                let named = coordinator.named();
                telemetry::finish(&span, outcome, named);
                let response =
                    rejection.respond(&config.key_header, grpc::is_grpc_request(&parts.headers), named);
                Step::Done(Ok(mark(response, outcome)))
            };
            let too_large = Rejection::BodyTooLarge {
                limit: config.body_limit,
            };
            if declared_length(&parts.headers).is_some_and(|len| len > config.body_limit as u64) {
                return reject(RequestOutcome::Rejected, too_large);
            }
            let body = match collect_limited(body, config.body_limit).await {
                Collected::Complete { data, .. } => data,
                Collected::TooLarge { .. } => return reject(RequestOutcome::Rejected, too_large),
                Collected::Failed { .. } => {
                    return reject(RequestOutcome::Rejected, Rejection::BodyUnreadable)
                }
            };
            let fingerprint = config.fingerprint.fingerprint(&parts, &body);
            (body, fingerprint)
        };

        let mut begun = coordinator.begin_driven(&key, &fingerprint).await;
        // Only a request that found its key in flight looks for a wish to wait: a fresh claim, a
        // replay or a mismatch reads no header for it.
        let mut waited = None;
        if let Ok(Begin::InFlight { lease_left }) = begun {
            if let Some(wait) = Wait::for_request(&parts.headers, &config) {
                // Boxed: the wait's state stays out of every keyed request's future.
                let waiting = coordinator.wait_driven(&key, &fingerprint, wait.wait, lease_left);
                let (waited_for, did_wait) = Box::pin(waiting).await;
                begun = waited_for;
                waited = did_wait.then_some(wait);
                if did_wait {
                    // Counted besides the outcome the request ends with (its replay, say).
                    telemetry::waited(coordinator.named());
                }
            }
        }
        // Made only now, so that the claim's state does not hold the request beside its parts.
        let grpc = grpc::is_grpc_request(&parts.headers);
        let mut request = Request::from_parts(parts, RequestBody::buffered(body));
        if config.key_in_extensions {
            request.extensions_mut().insert(key.clone());
        }
        let step = proceed(inner, &coordinator, config, &key, request, begun, span, grpc);
        match waited {
            None => step,
            Some(wait) => mark_waited(step, wait),
        }
    }
}

/// Tells the client of a request that waited that it did, on whatever it gets.
fn mark_waited<B: Send + 'static, E: Send + 'static>(step: Step<B, E>, wait: Wait) -> Step<B, E> {
    let marked = move |mut answer: Answer<B, E>| {
        if let Ok(response) = &mut answer {
            wait.mark(response);
        }
        answer
    };
    match step {
        Step::Done(answer) => Step::Done(marked(answer)),
        Step::Run(run) => Step::Run(Box::pin(run.map(marked))),
        Step::Unprotected(run) => Step::Unprotected(Box::pin(run.map(marked))),
    }
}

/// Answers a keyed request from what its claim found: a replay, a rejection, a fail-open run,
/// or, claimed, the run of its handler.
// The request's parts travel separately because the wait between the claim and this may have
// replaced the claim's answer; bundling them would only move the count into a struct.
#[allow(clippy::too_many_arguments)]
fn proceed<S, ReqBody, ResBody>(
    inner: S,
    coordinator: &Coordinator,
    config: Arc<Config>,
    key: &RecordKey,
    mut request: Request<RequestBody<ReqBody>>,
    begun: Result<Begin, Error>,
    span: Span,
    grpc: bool,
) -> Step<ResBody, S::Error>
where
    S: Service<Request<RequestBody<ReqBody>>, Response = Response<ResBody>> + Send + 'static,
    S::Future: Send + 'static,
    S::Error: Send + 'static,
    ReqBody: Body<Data = Bytes> + Send + 'static,
    ResBody: Body<Data = Bytes, Error: Into<BoxError>> + Send + 'static,
{
    let named = coordinator.named();
    let reject = |outcome: RequestOutcome, rejection: Rejection| {
        telemetry::finish(&span, outcome, named);
        let response = rejection.respond(&config.key_header, grpc, named);
        Step::Done(Ok(mark(response, outcome)))
    };
    let status = config.mismatch_status;
    let claim = match begun {
        Ok(Begin::Claimed(claim)) => claim,
        Ok(Begin::Completed(payload)) => {
            let (outcome, step) = replay_stored(key, &payload, &config, grpc, named);
            telemetry::finish(&span, outcome, named);
            return step;
        }
        Ok(Begin::InFlight { lease_left }) => {
            let retry_after = retry_after(config.typical_duration.get(), lease_left);
            return reject(RequestOutcome::InFlight, Rejection::InFlight { retry_after });
        }
        Ok(Begin::Mismatch) => return reject(RequestOutcome::Mismatch, Rejection::Mismatch { status }),
        Ok(Begin::PolicyMismatch) => {
            return reject(
                RequestOutcome::PolicyMismatch,
                Rejection::PolicyMismatch { status },
            )
        }
        Err(Error::Store(StoreError::Corrupt(reason))) => {
            tracing::error!(?key, %reason, "the record at this key is unreadable; not running the handler");
            return reject(RequestOutcome::Unreadable, Rejection::UnreadableRecord);
        }
        Err(Error::Store(error)) if error.is_fence() => {
            // The store is up and refused on purpose (a failover under way, or replicas that do
            // not have the claim): a claim made now could be lost, so nothing runs, fail-open or not.
            tracing::warn!(?key, %error, "the store refused the claim to protect it from a failover; refusing the request");
            return reject(RequestOutcome::Fenced, Rejection::StoreUnavailable);
        }
        Err(Error::Store(error)) if config.fail_open => {
            // Counted like a claimed run, so the bound holds and a shutdown waits for it.
            let Ok(slot) = coordinator.slot() else {
                return reject(RequestOutcome::Overloaded, Rejection::Overloaded);
            };
            if let Some(held_back) = config.store_outage_log.admit() {
                tracing::warn!(
                    ?key, %error, held_back,
                    "idempotency store unavailable; running the handler unprotected (fail-open); \
                     logged once per 10 s, held_back: those since the last"
                );
            }
            telemetry::finish(&span, RequestOutcome::FailOpen, named);
            let mut inner = inner;
            let run = async move {
                let answer = inner.call(request).await;
                drop(slot);
                answer.map(|response| mark(response.map(ResponseBody::streaming), RequestOutcome::FailOpen))
            };
            return Step::Unprotected(Box::pin(run.instrument(span)));
        }
        Err(error @ Error::Store(_)) => {
            if let Some(held_back) = config.store_outage_log.admit() {
                tracing::warn!(
                    ?key, %error, held_back,
                    "idempotency store unavailable; refusing the request (fail-closed); \
                     logged once per 10 s, held_back: those since the last"
                );
            }
            return reject(error.outcome(), Rejection::StoreUnavailable);
        }
        Err(error) => return reject(error.outcome(), Rejection::Overloaded),
    };
    telemetry::finish(&span, RequestOutcome::Executed, named);
    if config.transactional_completion {
        let handed = TransactionalClaim::new(claim.ticket(), config.clone());
        request.extensions_mut().insert(handed);
    }
    let run = run_claimed(inner, claim, config, request, grpc)
        .map(|answer| answer.map(|response| mark(response, RequestOutcome::Executed)));
    Step::Run(Box::pin(run.instrument(span)))
}

/// The stored response, replayed. A key whose response was not stored is answered so; a
/// payload from a newer release (a rolling upgrade under way) like a request in flight, to be
/// retried; one that cannot be decoded 500, never replayed.
fn replay_stored<B, E>(
    key: &RecordKey,
    payload: &Bytes,
    config: &Config,
    grpc: bool,
    named: Option<&Named>,
) -> (RequestOutcome, Step<B, E>) {
    let (outcome, rejection) = match stored::decode(payload) {
        Ok(Decoded::Response(mut stored)) => {
            tracing::debug!(?key, "replaying the stored response");
            // The list as configured now, not as it was when the response was stored: a header
            // added to it after an incident stops replaying at once.
            let unstored = &config.unstored_headers;
            if stored.headers.keys().any(|name| unstored.contains(name)) {
                for name in unstored {
                    stored.headers.remove(name);
                }
            }
            let replayed = mark(replay::into_response(stored), RequestOutcome::Replayed);
            return (RequestOutcome::Replayed, Step::Done(Ok(replayed)));
        }
        Ok(Decoded::NotStored { why, .. }) => (
            RequestOutcome::NotStored,
            Rejection::ResponseNotStored {
                status: config.not_stored_status,
                why,
            },
        ),
        Ok(Decoded::Newer { version }) => {
            tracing::info!(
                ?key,
                version,
                "record written by a newer release; answering as if in flight"
            );
            let retry_after = Duration::from_secs(1);
            (RequestOutcome::InFlight, Rejection::InFlight { retry_after })
        }
        Err(reason) => {
            tracing::error!(?key, %reason, "stored response unreadable; not replaying it");
            (RequestOutcome::Unreadable, Rejection::UnreadableRecord)
        }
    };
    let response = rejection.respond(&config.key_header, grpc, named);
    (outcome, Step::Done(Ok(mark(response, outcome))))
}

/// Runs the handler under a claim, renewing its lease meanwhile and bounding the time to its
/// response head, then stores its answer (now, or as it streams), keeps the key as not
/// replayable, or releases it. `grpc`: the request is a gRPC call, answered so if the layer must.
async fn run_claimed<S, ReqBody, ResBody>(
    mut inner: S,
    claim: Claim,
    config: Arc<Config>,
    request: Request<RequestBody<ReqBody>>,
    grpc: bool,
) -> Answer<ResBody, S::Error>
where
    S: Service<Request<RequestBody<ReqBody>>, Response = Response<ResBody>>,
    ResBody: Body<Data = Bytes, Error: Into<BoxError>> + Send + 'static,
{
    let started = tokio::time::Instant::now();
    // Pinned here, each future once: passed by value down the chain, each layer would hold a
    // copy of what it wraps, and the state of this future would be several times the handler's.
    // In a block of their own, so that their room is free again for the awaits below.
    let produced = {
        let work = std::pin::pin!(AssertUnwindSafe(async {
            let response = inner.call(request).await?;
            Ok(capture(response, &config).await)
        })
        .catch_unwind());
        let timed = std::pin::pin!(within(started.checked_add(config.handler_timeout), work));
        claim.keep_alive(timed).await
    };
    config.typical_duration.record(started.elapsed());
    let release_not_stored = config.release_not_stored;
    // The paths that do not store are boxed: inline, their futures (the largest here) would
    // size the state of every claimed request's future, stored or not.
    let not_stored = |claim, why, status| Box::pin(settle_not_stored(claim, why, status, release_not_stored));
    match produced {
        Some(Ok(Ok(Captured::Stored(response, payload)))) => {
            // Errors are logged by `complete`; the client gets its response either way.
            let _ = claim.complete(payload).await;
            Ok(response)
        }
        Some(Ok(Ok(Captured::Streaming(parts, body, record, status_rule)))) => {
            // The body outlives this future: a task holds its claim from now on.
            let storing = Storing::new(body, record, parts.status, status_rule, claim, &config);
            Ok(Response::from_parts(parts, ResponseBody::storing(storing)))
        }
        Some(Ok(Ok(Captured::NotStored(response, why)))) => {
            not_stored(claim, why, Some(response.status())).await;
            Ok(response)
        }
        Some(Ok(Ok(Captured::NotCacheable(response)))) => {
            Box::pin(release(claim)).await;
            Ok(response)
        }
        Some(Ok(Err(error))) => {
            Box::pin(release(claim)).await;
            Err(error)
        }
        Some(Err(_panic)) => {
            let named = claim.named();
            tracing::error!(key = ?claim.key(), "the handler panicked; its key is released");
            Box::pin(release(claim)).await;
            Ok(Rejection::HandlerPanicked.respond(&config.key_header, grpc, named.as_deref()))
        }
        None => {
            let after = config.handler_timeout;
            let named = claim.named();
            tracing::warn!(key = ?claim.key(), ?after, "the handler gave no response in time; cancelled");
            not_stored(claim, NotStored::TimedOut, None).await;
            let timed_out = Rejection::HandlerTimedOut { after };
            Ok(timed_out.respond_released(&config.key_header, grpc, named.as_deref(), release_not_stored))
        }
    }
}

/// `work`'s output, or `None` if it is not done by `deadline` (never, without one). The timer
/// is set only if `work` is not done at its first poll, so a quick handler costs none.
async fn within<F: Future>(
    deadline: Option<tokio::time::Instant>,
    mut work: Pin<&mut F>,
) -> Option<F::Output> {
    let mut timer = None;
    std::future::poll_fn(|cx| {
        if let Poll::Ready(output) = work.as_mut().poll(cx) {
            return Poll::Ready(Some(output));
        }
        if let Some(deadline) = deadline {
            let timer = timer.get_or_insert_with(|| Box::pin(tokio::time::sleep_until(deadline)));
            if timer.as_mut().poll(cx).is_ready() {
                return Poll::Ready(None);
            }
        }
        Poll::Pending
    })
    .await
}

/// Puts `outcome` in `response`'s extensions, for the layers outside (see [`RequestOutcome`]).
pub(crate) fn mark<B>(mut response: Response<B>, outcome: RequestOutcome) -> Response<B> {
    response.extensions_mut().insert(outcome);
    response
}

#[cfg(test)]
mod tests {
    use std::convert::Infallible;

    use tower::util::BoxCloneSyncService;

    use super::*;
    use crate::MemoryStore;

    /// The largest request chunk glibc's malloc serves from a thread's own cache (its `tcache`);
    /// a larger one takes the lock of an arena that both worker threads use.
    const MALLOC_THREAD_CACHE_MAX: usize = 1032;

    /// Every keyed request allocates this state (boxed, with its span): it must stay within the
    /// thread cache, with a boxed service such as axum's router inside.
    #[test]
    fn the_state_every_keyed_request_allocates_stays_within_the_malloc_thread_cache() {
        type Inner = BoxCloneSyncService<
            Request<RequestBody<axum::body::Body>>,
            Response<axum::body::Body>,
            Infallible,
        >;
        let inner: Inner = BoxCloneSyncService::new(tower::service_fn(|_| async {
            Ok::<_, Infallible>(Response::new(axum::body::Body::empty()))
        }));
        let layer = IdempotencyLayer::new(MemoryStore::new());
        let (parts, body) = Request::post("/payments")
            .body(axum::body::Body::empty())
            .expect("a request")
            .into_parts();
        let key = RecordKey::new(None, IdempotencyKey::parse("k").expect("a key"));
        let begin = begin_keyed::<Inner, axum::body::Body, axum::body::Body>(
            inner,
            layer.coordinator.clone(),
            layer.config.clone(),
            key,
            parts,
            body,
            Span::none(),
        )
        .instrument(Span::none());
        let size = std::mem::size_of_val(&begin);
        assert!(
            size <= MALLOC_THREAD_CACHE_MAX,
            "a keyed request's state is {size} bytes, over the {MALLOC_THREAD_CACHE_MAX} that glibc \
             serves from a thread's cache"
        );
    }
}
