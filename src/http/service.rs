//! [`Idempotency`]: the service, a thin adapter from HTTP to the [`Coordinator`].

use std::future::Future;
use std::panic::AssertUnwindSafe;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use futures_util::FutureExt;
use http::header::{CONTENT_TYPE, HOST};
use http::{request, HeaderMap, Request, Response};
use http_body::Body;
use tower_service::Service;

use crate::coordinator::{Begin, Claim, Coordinator, Error};
use crate::http::body::{collect_limited, BoxError, Collected, RequestBody, ResponseBody};
use crate::http::capture::{capture, declared_length, release, settle_not_stored, Captured, Storing};
use crate::http::config::Config;
use crate::http::future::{BoxFuture, ResponseFuture};
use crate::http::grpc;
use crate::http::replay::{self, Decoded, NotStored};
use crate::http::response::{retry_after, Rejection};
use crate::http::transactional::TransactionalClaim;
use crate::store::StoreError;
use crate::{Fingerprint, IdempotencyKey, IdempotencyLayer, KeyError, RecordKey};

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
    ResBody: Body<Data = Bytes> + Send + 'static,
    ResBody::Error: Into<BoxError>,
{
    type Response = Response<ResponseBody<ResBody>>;
    type Error = S::Error;
    type Future = ResponseFuture<S::Future, ResBody, S::Error>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: Request<ReqBody>) -> Self::Future {
        let config = &self.layer.config;
        let guarded = request.extensions().get::<Guarded>().is_some();
        if guarded || !config.methods.contains(request.method()) {
            return ResponseFuture::passthrough(self.inner.call(request.map(RequestBody::streaming)));
        }
        let key = match key_from_headers(request.headers(), config) {
            Ok(Some(key)) => key,
            Ok(None) if !config.key_required => {
                return ResponseFuture::passthrough(self.inner.call(request.map(RequestBody::streaming)));
            }
            Ok(None) => {
                let grpc = grpc::is_grpc_request(request.headers());
                return ResponseFuture::ready(Rejection::MissingKey.respond(&config.key_header, grpc));
            }
            Err(error) => {
                let grpc = grpc::is_grpc_request(request.headers());
                let rejection = Rejection::InvalidKey(error).respond(&config.key_header, grpc);
                return ResponseFuture::ready(rejection);
            }
        };
        let (mut parts, body) = request.into_parts();
        parts.extensions.insert(Guarded);
        let scope = match &config.scope {
            Some(scope) => match scope(&parts) {
                Some(scope) => Some(scope),
                None => {
                    let grpc = grpc::is_grpc_request(&parts.headers);
                    return ResponseFuture::ready(Rejection::MissingScope.respond(&config.key_header, grpc));
                }
            },
            None => None,
        };
        let key = RecordKey::new(scope.as_deref(), key);
        // The ready service goes to the keyed request; a fresh clone waits for the next one.
        let clone = self.inner.clone();
        let inner = std::mem::replace(&mut self.inner, clone);
        let begin = begin_keyed(
            inner,
            self.layer.coordinator.clone(),
            config.clone(),
            key,
            parts,
            body,
        );
        ResponseFuture::keyed(Box::pin(begin), config.cancel_on_disconnect)
    }
}

/// Marks a request an outer idempotency layer already handles, so that nested layers (a
/// `route_layer` around a `MethodRouter::layer`, say) do not claim its key a second time and
/// find their own claim in flight.
#[derive(Clone, Copy)]
struct Guarded;

fn key_from_headers(headers: &HeaderMap, config: &Config) -> Result<Option<IdempotencyKey>, KeyError> {
    let mut values = headers.get_all(&config.key_header).iter();
    match (values.next(), values.next()) {
        (None, _) => Ok(None),
        (Some(value), None) => IdempotencyKey::parse_bytes(value.as_bytes()).map(Some),
        (Some(_), Some(_)) => Err(KeyError::Repeated),
    }
}

/// What makes two requests the same request: method, authority (the URI's, else `Host`), path
/// and query, `Content-Type` and body. The authority keeps tenants told apart by host name from
/// colliding on one key; it is normalised first, so a retry that spells the same host another
/// way is still the same request.
fn fingerprint(parts: &request::Parts, content_type: &[u8], body: &[u8]) -> Fingerprint {
    let authority = match parts.uri.authority() {
        Some(authority) => authority.as_str().as_bytes(),
        None => parts.headers.get(HOST).map_or(&[][..], |v| v.as_bytes()),
    };
    let authority = normalized_authority(authority);
    let path_and_query = parts.uri.path_and_query().map_or("/", |pq| pq.as_str());
    Fingerprint::new([
        parts.method.as_str().as_bytes(),
        &authority,
        path_and_query.as_bytes(),
        content_type,
        body,
    ])
}

/// `host[:port]` as DNS and HTTP treat it: host names are case-insensitive, `example.com.` is
/// `example.com`, and `:80` and `:443` are the default ports (the layer cannot tell the scheme, and
/// a server answers one of them per name). Borrows when there is nothing to change, as for nearly
/// every request.
fn normalized_authority(raw: &[u8]) -> std::borrow::Cow<'_, [u8]> {
    // Split off the port: after the last `:`, unless that `:` is inside an IPv6 literal.
    let (host, port) = match raw.iter().rposition(|&b| b == b':') {
        Some(colon) if !raw[colon..].contains(&b']') && raw[colon + 1..].iter().all(u8::is_ascii_digit) => {
            (&raw[..colon], Some(&raw[colon + 1..]))
        }
        _ => (raw, None),
    };
    let port = port.filter(|port| *port != b"80" && *port != b"443");
    let host = host.strip_suffix(b".").unwrap_or(host);
    let unchanged = host.len() + port.map_or(0, |p| p.len() + 1) == raw.len();
    if unchanged && !host.iter().any(u8::is_ascii_uppercase) {
        return std::borrow::Cow::Borrowed(raw);
    }
    let mut normalized = host.to_ascii_lowercase();
    if let Some(port) = port {
        normalized.push(b':');
        normalized.extend_from_slice(port);
    }
    std::borrow::Cow::Owned(normalized)
}

type Answer<B, E> = Result<Response<ResponseBody<B>>, E>;

/// Where a keyed request stands once its claim has answered.
// A `Step` is moved once, out of the boxed future; boxing the response would cost an allocation
// on every answer instead.
#[allow(clippy::large_enum_variant)]
pub(crate) enum Step<B, E> {
    /// The answer is known: a replay, a rejection, or an unprotected (fail-open) run.
    Done(Answer<B, E>),
    /// The key is ours: this runs the handler and stores or releases its answer. It must run to
    /// its end even if the client leaves, so the response future detaches it rather than drop it.
    Run(BoxFuture<Answer<B, E>>),
}

/// Reads the body, fingerprints the request and claims its key, in the request's own future: a
/// client that leaves before the claim answers cancels all of it (a claim still on its way is
/// released in the background by the coordinator). Only a claimed request goes on to
/// [`run_claimed`], the one part that costs a detached future.
async fn begin_keyed<S, ReqBody, ResBody>(
    mut inner: S,
    coordinator: Coordinator,
    config: Arc<Config>,
    key: RecordKey,
    parts: request::Parts,
    body: ReqBody,
) -> Step<ResBody, S::Error>
where
    S: Service<Request<RequestBody<ReqBody>>, Response = Response<ResBody>> + Send + 'static,
    S::Future: Send + 'static,
    S::Error: Send + 'static,
    ReqBody: Body<Data = Bytes> + Send + 'static,
    ResBody: Body<Data = Bytes> + Send + 'static,
    ResBody::Error: Into<BoxError>,
{
    // The one look at the `Content-Type`, shared by the fingerprint and the rejections, which
    // must speak gRPC to a gRPC client.
    let content_type = parts.headers.get(CONTENT_TYPE);
    let grpc = grpc::is_grpc(content_type);
    let content_type = content_type.map_or(&[][..], |v| v.as_bytes());
    let reject = |rejection: Rejection| Step::Done(Ok(rejection.respond(&config.key_header, grpc)));
    let too_large = Rejection::BodyTooLarge {
        limit: config.body_limit,
    };
    if declared_length(&parts.headers).is_some_and(|len| len > config.body_limit as u64) {
        return reject(too_large);
    }
    let body = match collect_limited(body, config.body_limit).await {
        Collected::Complete { data, .. } => data,
        Collected::TooLarge { .. } => return reject(too_large),
        Collected::Failed { .. } => return reject(Rejection::BodyUnreadable),
    };
    let fingerprint = fingerprint(&parts, content_type, &body);
    let mut request = Request::from_parts(parts, RequestBody::buffered(body));

    let claim = match coordinator.begin_driven(&key, &fingerprint).await {
        Ok(Begin::Claimed(claim)) => claim,
        Ok(Begin::Completed(payload)) => {
            return replay_stored(&key, &payload, &config, grpc);
        }
        Ok(Begin::InFlight { lease_left }) => {
            return reject(Rejection::InFlight {
                retry_after: retry_after(config.typical_duration.get(), lease_left),
            });
        }
        Ok(Begin::Mismatch) => {
            return reject(Rejection::Mismatch {
                status: config.mismatch_status,
            })
        }
        Err(Error::Store(StoreError::Corrupt(reason))) => {
            tracing::error!(?key, %reason, "the record at this key is unreadable; not running the handler");
            return reject(Rejection::UnreadableRecord);
        }
        Err(Error::Store(error)) if config.fail_open => {
            // Counted like a claimed run, so the bound holds and a shutdown waits for it.
            let Ok(slot) = coordinator.slot() else {
                return reject(Rejection::Overloaded);
            };
            tracing::warn!(?key, %error, "idempotency store unavailable; running the handler unprotected (fail-open)");
            let answer = inner.call(request).await;
            drop(slot);
            return Step::Done(answer.map(|response| response.map(ResponseBody::streaming)));
        }
        Err(Error::Store(error)) => {
            tracing::warn!(?key, %error, "idempotency store unavailable; refusing the request (fail-closed)");
            return reject(Rejection::StoreUnavailable);
        }
        Err(_) => return reject(Rejection::Overloaded),
    };
    if config.transactional_completion {
        let handed = TransactionalClaim::new(claim.ticket(), config.clone());
        request.extensions_mut().insert(handed);
    }
    Step::Run(Box::pin(run_claimed(inner, claim, config, request, grpc)))
}

/// The stored response, replayed. A key whose response was not stored is answered so; a
/// payload from a newer release (a rolling upgrade under way) like a request in flight, to be
/// retried; one that cannot be decoded 500, never replayed.
fn replay_stored<B, E>(key: &RecordKey, payload: &Bytes, config: &Config, grpc: bool) -> Step<B, E> {
    let rejection = match replay::decode(payload) {
        Ok(Decoded::Response(stored)) => {
            tracing::debug!(?key, "replaying the stored response");
            return Step::Done(Ok(replay::into_response(stored)));
        }
        Ok(Decoded::NotStored { why, .. }) => Rejection::ResponseNotStored {
            status: config.not_stored_status,
            why,
        },
        Ok(Decoded::Newer { version }) => {
            tracing::info!(
                ?key,
                version,
                "record written by a newer release; answering as if in flight"
            );
            Rejection::InFlight {
                retry_after: Duration::from_secs(1),
            }
        }
        Err(reason) => {
            tracing::error!(?key, %reason, "stored response unreadable; not replaying it");
            Rejection::UnreadableRecord
        }
    };
    Step::Done(Ok(rejection.respond(&config.key_header, grpc)))
}

/// Runs the handler under a claim, renewing its lease meanwhile and bounding the time to its
/// response head, then stores its answer (now, or as it streams), keeps the key as not
/// replayable, or releases it. `grpc`: the request is a gRPC call, answered so if the layer must.
async fn run_claimed<S, ReqBody, ResBody>(
    mut inner: S,
    mut claim: Claim,
    config: Arc<Config>,
    request: Request<RequestBody<ReqBody>>,
    grpc: bool,
) -> Answer<ResBody, S::Error>
where
    S: Service<Request<RequestBody<ReqBody>>, Response = Response<ResBody>>,
    ResBody: Body<Data = Bytes> + Send + 'static,
    ResBody::Error: Into<BoxError>,
{
    let started = tokio::time::Instant::now();
    let work = AssertUnwindSafe(async {
        let response = inner.call(request).await?;
        Ok(capture(response, &config).await)
    })
    .catch_unwind();
    let produced = claim
        .keep_alive(within(started.checked_add(config.handler_timeout), work))
        .await;
    config.typical_duration.record(started.elapsed());
    let release_not_stored = config.release_not_stored;
    match produced {
        Some(Ok(Ok(Captured::Stored(response, payload)))) => {
            // Errors are logged by `complete`; the client gets its response either way.
            let _ = claim.complete(payload).await;
            Ok(response)
        }
        Some(Ok(Ok(Captured::Streaming(parts, body, record, status_rule)))) => {
            // The body outlives this future: its lease is renewed by a task from now on.
            claim.renew_in_background();
            let storing = Storing::new(body, record, parts.status, status_rule, claim, &config);
            Ok(Response::from_parts(parts, ResponseBody::storing(storing)))
        }
        Some(Ok(Ok(Captured::NotStored(response, why)))) => {
            settle_not_stored(claim, why, Some(response.status()), release_not_stored).await;
            Ok(response)
        }
        Some(Ok(Ok(Captured::NotCacheable(response)))) => {
            release(claim).await;
            Ok(response)
        }
        Some(Ok(Err(error))) => {
            release(claim).await;
            Err(error)
        }
        Some(Err(_panic)) => {
            tracing::error!(key = ?claim.key(), "the handler panicked; its key is released");
            release(claim).await;
            Ok(Rejection::HandlerPanicked.respond(&config.key_header, grpc))
        }
        None => {
            let after = config.handler_timeout;
            tracing::warn!(key = ?claim.key(), ?after, "the handler gave no response in time; cancelled");
            settle_not_stored(claim, NotStored::TimedOut, None, release_not_stored).await;
            Ok(Rejection::HandlerTimedOut { after }.respond(&config.key_header, grpc))
        }
    }
}

/// `work`'s output, or `None` if it is not done by `deadline` (never, without one). The timer
/// is set only if `work` is not done at its first poll, so a quick handler costs none.
async fn within<F: Future>(deadline: Option<tokio::time::Instant>, work: F) -> Option<F::Output> {
    let mut work = std::pin::pin!(work);
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

#[cfg(test)]
mod tests {
    #[test]
    fn authorities_that_name_the_same_host_normalise_alike() {
        let norm =
            |raw: &str| String::from_utf8(super::normalized_authority(raw.as_bytes()).into_owned()).unwrap();
        for same in [
            "API.Example.com",
            "api.example.com.",
            "api.example.com:443",
            "Api.Example.Com.:80",
        ] {
            assert_eq!(norm(same), "api.example.com", "{same}");
        }
        assert_eq!(norm("api.example.com:8080"), "api.example.com:8080");
        assert_eq!(norm("API.example.com.:8443"), "api.example.com:8443");
        assert_eq!(norm("[::1]:443"), "[::1]");
        assert_eq!(norm("[::1]"), "[::1]");
        assert_eq!(norm("[2001:DB8::1]:8080"), "[2001:db8::1]:8080");
        assert_eq!(norm(""), "");
        assert!(matches!(
            super::normalized_authority(b"api.example.com:8080"),
            std::borrow::Cow::Borrowed(_)
        ));
    }
}
