//! The response body the layer hands on ([`ResponseBody`]), and capturing a claimed request's
//! response: stored whole before it is sent, stored as it streams to the client ([`Storing`], a
//! kind of response body, hence one file), or recorded as *not stored*, so that a retry is never
//! run a second time because the first response could not be kept.

use std::future::Future;
use std::pin::Pin;
use std::task::{ready, Context, Poll};

use bytes::Bytes;
use http::header::CONTENT_LENGTH;
use http::{response, HeaderMap, Response, StatusCode};
use http_body::{Body, Frame, SizeHint};
use pin_project_lite::pin_project;
use tokio::sync::oneshot;
use tokio::task::JoinHandle;
use tracing::Instrument;

use crate::coordinator::Claim;
use crate::http::body::{collect_limited, BoxError, Collected};
use crate::http::config::Config;
use crate::http::grpc::{self, GrpcCacheableFn, Outcome};
use crate::http::stored::{self, StoredResponse};
use crate::reconciliation::NotStored;

pin_project! {
    /// The response body the layer returns: the inner service's body, streamed on or buffered,
    /// a replayed body, or a problem document.
    ///
    /// ```
    /// use http::StatusCode;
    /// use http_body_util::{BodyExt, Full};
    /// use tower_idempotency::{Rejection, ResponseBody};
    ///
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() {
    /// let response = Rejection::MissingKey.into_response::<Full<bytes::Bytes>>();
    /// assert_eq!(response.status(), StatusCode::BAD_REQUEST);
    /// let body: ResponseBody<_> = response.into_body();
    /// let json = body.collect().await.unwrap().to_bytes();
    /// assert!(json.starts_with(b"{\"type\":"));
    /// # }
    /// ```
    pub struct ResponseBody<B> {
        #[pin]
        kind: ResponseKind<B>,
    }
}

pin_project! {
    #[project = ResponseKindProj]
    enum ResponseKind<B> {
        Buffered { data: Option<Bytes>, trailers: Option<HeaderMap>, error: Option<BoxError> },
        Resumed { prefix: Option<Bytes>, rest: Pin<Box<B>> },
        Streaming { #[pin] body: B },
        Storing { storing: Storing<B> },
    }
}

impl<B> ResponseBody<B> {
    pub(crate) fn full(data: Bytes) -> Self {
        Self::buffered(data, None, None)
    }

    pub(crate) fn with_trailers(data: Bytes, trailers: Option<HeaderMap>) -> Self {
        Self::buffered(data, trailers, None)
    }

    /// A body of unknown length stored as it streams; see [`Storing`].
    pub(crate) fn storing(storing: Storing<B>) -> Self {
        Self {
            kind: ResponseKind::Storing { storing },
        }
    }

    fn buffered(data: Bytes, trailers: Option<HeaderMap>, error: Option<BoxError>) -> Self {
        let data = (!data.is_empty()).then_some(data);
        Self {
            kind: ResponseKind::Buffered {
                data,
                trailers,
                error,
            },
        }
    }

    pub(crate) fn streaming(body: B) -> Self {
        Self {
            kind: ResponseKind::Streaming { body },
        }
    }

    fn resumed(prefix: Bytes, rest: Pin<Box<B>>) -> Self {
        Self {
            kind: ResponseKind::Resumed {
                prefix: (!prefix.is_empty()).then_some(prefix),
                rest,
            },
        }
    }
}

impl<B> std::fmt::Debug for ResponseBody<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ResponseBody").finish_non_exhaustive()
    }
}

impl<B> Body for ResponseBody<B>
where
    B: Body<Data = Bytes, Error: Into<BoxError>>,
{
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        match self.project().kind.project() {
            ResponseKindProj::Buffered {
                data,
                trailers,
                error,
            } => {
                if let Some(data) = data.take() {
                    return Poll::Ready(Some(Ok(Frame::data(data))));
                }
                if let Some(error) = error.take() {
                    return Poll::Ready(Some(Err(error)));
                }
                Poll::Ready(trailers.take().map(|t| Ok(Frame::trailers(t))))
            }
            ResponseKindProj::Resumed { prefix, rest } => {
                if let Some(prefix) = prefix.take() {
                    return Poll::Ready(Some(Ok(Frame::data(prefix))));
                }
                rest.as_mut().poll_frame(cx).map_err(Into::into)
            }
            ResponseKindProj::Streaming { body } => body.poll_frame(cx).map_err(Into::into),
            ResponseKindProj::Storing { storing } => storing.poll_frame(cx),
        }
    }

    fn is_end_stream(&self) -> bool {
        match &self.kind {
            ResponseKind::Buffered {
                data,
                trailers,
                error,
            } => data.is_none() && trailers.is_none() && error.is_none(),
            ResponseKind::Resumed { prefix, rest } => prefix.is_none() && rest.is_end_stream(),
            ResponseKind::Streaming { body } => body.is_end_stream(),
            ResponseKind::Storing { storing } => storing.is_end_stream(),
        }
    }

    fn size_hint(&self) -> SizeHint {
        match &self.kind {
            ResponseKind::Buffered { data, .. } => {
                SizeHint::with_exact(data.as_ref().map_or(0, |d| d.len() as u64))
            }
            ResponseKind::Resumed { prefix, rest } => {
                let extra = prefix.as_ref().map_or(0, |p| p.len() as u64);
                let inner = rest.size_hint();
                let mut hint = SizeHint::new();
                hint.set_lower(inner.lower() + extra);
                if let Some(upper) = inner.upper() {
                    hint.set_upper(upper + extra);
                }
                hint
            }
            ResponseKind::Streaming { body } => body.size_hint(),
            ResponseKind::Storing { storing } => storing.size_hint(),
        }
    }
}

impl<B: Body<Error: Into<BoxError>>> Collected<B> {
    /// Turns what was read back into a body that yields exactly what the original would have.
    pub(crate) fn into_response_body(self) -> ResponseBody<B> {
        match self {
            Collected::Complete { data, trailers } => ResponseBody::buffered(data, trailers, None),
            Collected::TooLarge { prefix, rest } => ResponseBody::resumed(prefix, rest),
            Collected::Failed { prefix, error } => ResponseBody::buffered(prefix, None, Some(error.into())),
        }
    }
}

/// What became of a handler's response once its head was in.
pub(crate) enum Captured<B> {
    /// Read whole within the cap: store the payload, send the response (whose body is a slice
    /// of the payload, so a large body is held once).
    Stored(Response<ResponseBody<B>>, Bytes),
    /// The cacheable rule says a retry should run again (a 5xx, say): release the key.
    NotCacheable(Response<ResponseBody<B>>),
    /// It could not be stored: the key is kept completed as not replayable (or released, if the
    /// layer is configured so).
    NotStored(Response<ResponseBody<B>>, NotStored),
    /// Of unknown length: it is stored as it streams to the client, by a [`Storing`] body that
    /// takes over the claim; with the rule its `grpc-status` must pass at the end, for a gRPC
    /// response.
    Streaming(response::Parts, B, StoredResponse, Option<GrpcCacheableFn>),
}

/// Reads the handler's response, as far as the storage cap allows, into what the client gets
/// and what is stored.
///
/// A body whose length is known up front (`Content-Length`, or an exact size hint) and fits the
/// cap is read whole and stored before the response is sent; one known to be over the cap is
/// sent on and recorded as not stored; one of unknown length (a compression layer inside this
/// one, a proxied chunked upstream) is sent as it comes and stored as it passes.
///
/// A gRPC response's outcome is its `grpc-status`: in the headers of a trailers-only response,
/// decided at once; otherwise in the trailers, so the decision waits for the end of the body.
pub(crate) async fn capture<B>(response: Response<B>, config: &Config) -> Captured<B>
where
    B: Body<Data = Bytes, Error: Into<BoxError>>,
{
    let (parts, body) = response.into_parts();
    let not_cacheable =
        |parts, body| Captured::NotCacheable(Response::from_parts(parts, ResponseBody::streaming(body)));
    if !(config.cacheable)(&parts) {
        return not_cacheable(parts, body);
    }
    let status_at_end = match grpc::outcome(&parts.headers) {
        Outcome::NotGrpc => None,
        Outcome::Known(code) if (config.grpc_cacheable)(code) => None,
        Outcome::Known(_) => return not_cacheable(parts, body),
        Outcome::AtEnd => Some(&config.grpc_cacheable),
    };
    let limit = config.response_limit;
    match declared_length(&parts.headers).or(body.size_hint().exact()) {
        None => {
            let record = config.stored_response(&parts, 0);
            return Captured::Streaming(parts, body, record, status_at_end.cloned());
        }
        Some(len) if len > limit as u64 => {
            let response = Response::from_parts(parts, ResponseBody::streaming(body));
            return Captured::NotStored(response, NotStored::TooLarge);
        }
        Some(_) => {}
    }
    match collect_limited(body, limit).await {
        Collected::Complete { data, trailers } => {
            if status_at_end.is_some_and(|rule| !grpc::cacheable_at_end(trailers.as_ref(), rule)) {
                let body = ResponseBody::with_trailers(data, trailers);
                return Captured::NotCacheable(Response::from_parts(parts, body));
            }
            let mut stored = config.stored_response(&parts, data.len());
            // Within the limit by construction: `collect_limited` read no more than it.
            stored.push(&data);
            drop(data);
            let (payload, body) = stored.finish(trailers.as_ref());
            // The client gets the stored copy of the body, so a large body is held once, not twice.
            let body = ResponseBody::with_trailers(payload.slice(body), trailers);
            Captured::Stored(Response::from_parts(parts, body), payload)
        }
        collected => {
            let why = match &collected {
                Collected::Failed { .. } => NotStored::BodyFailed,
                _ => NotStored::TooLarge,
            };
            Captured::NotStored(Response::from_parts(parts, collected.into_response_body()), why)
        }
    }
}

pub(crate) fn declared_length(headers: &HeaderMap) -> Option<u64> {
    headers.get(CONTENT_LENGTH)?.to_str().ok()?.parse().ok()
}

/// Releases a claim whose answer is not to be stored, so a retry runs the handler again.
pub(crate) async fn release(claim: Claim) {
    let key = claim.key().clone();
    if let Err(error) = claim.release().await {
        tracing::warn!(?key, %error, "could not release the key at once; retrying in the background");
    }
}

/// Settles a claim whose response was not stored: keeps the key completed as not replayable, so
/// a retry is told so rather than run again, or releases it when the layer is configured to.
pub(crate) async fn settle_not_stored(
    claim: Claim,
    why: NotStored,
    status: Option<StatusCode>,
    release: bool,
) {
    let key = claim.key().clone();
    claim.report_not_stored(why);
    if release {
        tracing::warn!(?key, %why, "response not stored; the key is released, so a retry runs the handler again");
        self::release(claim).await;
    } else {
        tracing::warn!(?key, %why, "response not stored; the key is kept as not replayable for its retention");
        // Errors are logged by `complete`.
        let _ = claim.complete(stored::encode_not_stored(why, status)).await;
    }
}

/// What the body tells the task holding its claim once it has ended.
enum Settle {
    /// Store this payload (the encoded response).
    Store(Bytes),
    /// Release the key: the response is not to be stored (a gRPC status the rule refuses).
    Release,
    /// The response could not be stored.
    NotStored(NotStored),
}

/// The body of a response of unknown length whose key is still claimed: it passes every frame
/// on as it comes and keeps a copy up to the cap, then has the claim completed when the body
/// ends (before the client sees the end), with trailers; a gRPC response whose `grpc-status` the
/// rule refuses releases it instead. A body over the cap, or one that fails, settles the claim
/// as not stored at that point and streams on.
///
/// The claim itself is held by a task of its own ([`hold`]), which renews its lease and bounds
/// how long it is held: a body that has not ended by the stream timeout (a stalled upstream, a
/// client that stopped reading, an endless stream) has its claim settled as not stored there
/// and then, whether or not anyone polls the body; the body streams on to its client, no longer
/// copied.
///
/// Dropped before it has settled (the client left), it carries on in a task of its own, which
/// reads the rest and stores it as if the client were there, until the claim is settled (the
/// end, the cap, or the stream timeout: nothing is read past that), unless the layer cancels on
/// disconnect (the claim is then released).
pub(crate) struct Storing<B> {
    /// The handler's body, until it has ended.
    body: Option<Pin<Box<B>>>,
    /// The copy, until it is stored or found too large.
    record: Option<StoredResponse>,
    /// For a gRPC response, the rule its `grpc-status` (in the trailers) must pass to be stored.
    status_rule: Option<GrpcCacheableFn>,
    /// The way to the task holding the claim, and that task, until the key is settled (or the
    /// task settled it at the stream timeout and closed the way).
    holder: Option<(oneshot::Sender<Settle>, JoinHandle<()>)>,
    /// The holder settling the claim as told; the client's next frame waits for it.
    settling: Option<JoinHandle<()>>,
    /// What to hand the client once `settling` is done: a frame, or the end.
    then: Option<Option<Result<Frame<Bytes>, BoxError>>>,
    /// Set unless the layer cancels on disconnect; carries the `Send + 'static` bounds a spawn
    /// needs, so this type needs none.
    detach: Option<fn(Storing<B>)>,
    span: tracing::Span,
}

impl<B> Storing<B>
where
    B: Body<Data = Bytes, Error: Into<BoxError>>,
{
    /// Takes over `claim`, handing it to a task that renews its lease until the body ends or
    /// the stream timeout passes. Needs a Tokio runtime.
    pub(crate) fn new(
        body: B,
        record: StoredResponse,
        status: StatusCode,
        status_rule: Option<GrpcCacheableFn>,
        claim: Claim,
        config: &Config,
    ) -> Self
    where
        B: Send + 'static,
    {
        let deadline = tokio::time::Instant::now().checked_add(config.stream_timeout());
        let (orders, received) = oneshot::channel();
        let holding = hold(claim, received, deadline, status, config.release_not_stored);
        let span = tracing::Span::current();
        let holder = tokio::spawn(holding.instrument(span.clone()));
        Self {
            body: Some(Box::pin(body)),
            record: Some(record),
            status_rule,
            holder: Some((orders, holder)),
            settling: None,
            then: None,
            detach: (!config.cancel_on_disconnect).then_some(drain_detached::<B> as fn(_)),
            span,
        }
    }

    /// Notices a claim its holder settled at the stream timeout: the copy is dropped, and the
    /// body streams on uncopied. Registers for that wake-up otherwise.
    fn notice_timeout(&mut self, cx: &mut Context<'_>) {
        if let Some((orders, _)) = &mut self.holder {
            if orders.poll_closed(cx).is_ready() {
                self.holder = None;
                self.record = None;
            }
        }
    }

    pub(crate) fn poll_frame(
        &mut self,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        self.notice_timeout(cx);
        loop {
            if let Some(settling) = &mut self.settling {
                // The holder logs what it could not do; a panic in it has nothing left to settle.
                let _ = ready!(Pin::new(settling).poll(cx));
                self.settling = None;
                match self.then.take() {
                    Some(next) => return Poll::Ready(next),
                    None => continue,
                }
            }
            let Some(body) = &mut self.body else {
                return Poll::Ready(None);
            };
            let next = match ready!(body.as_mut().poll_frame(cx)) {
                None => {
                    self.body = None;
                    self.settle(Ok(None));
                    None
                }
                Some(Err(error)) => {
                    self.body = None;
                    self.settle(Err(NotStored::BodyFailed));
                    Some(Err(error.into()))
                }
                Some(Ok(frame)) => match frame.data_ref() {
                    Some(data) => {
                        let kept = self.record.as_mut().is_none_or(|record| record.push(data));
                        if !kept {
                            self.settle(Err(NotStored::TooLarge));
                        }
                        Some(Ok(frame))
                    }
                    None => {
                        // Trailers end the body.
                        self.body = None;
                        self.settle(Ok(frame.trailers_ref()));
                        Some(Ok(frame))
                    }
                },
            };
            if self.settling.is_none() {
                return Poll::Ready(next);
            }
            self.then = Some(next);
        }
    }

    /// Has the claim settled, if it is still held: the copy stored with `trailers`, or recorded
    /// as not stored, and so on.
    fn settle(&mut self, outcome: Result<Option<&HeaderMap>, NotStored>) {
        let Some((orders, holder)) = self.holder.take() else {
            return;
        };
        let record = self.record.take();
        let order = match (outcome, record) {
            (Ok(trailers), Some(_))
                if self
                    .status_rule
                    .as_ref()
                    .is_some_and(|rule| !grpc::cacheable_at_end(trailers, rule)) =>
            {
                Settle::Release
            }
            (Ok(trailers), Some(record)) => Settle::Store(record.finish(trailers).0),
            (outcome, _) => Settle::NotStored(outcome.err().unwrap_or(NotStored::TooLarge)),
        };
        // Refused only if the holder settled the claim at the stream timeout meanwhile; its
        // task is then (nearly) done, and waiting for it costs nothing.
        let _ = orders.send(order);
        self.settling = Some(holder);
    }

    pub(crate) fn is_end_stream(&self) -> bool {
        self.body.is_none() && self.settling.is_none() && self.then.is_none()
    }

    pub(crate) fn size_hint(&self) -> SizeHint {
        match &self.body {
            Some(body) => body.size_hint(),
            None => SizeHint::with_exact(0),
        }
    }
}

impl<B> Storing<B> {
    /// Whether the claim is settled (stored, released, or not stored) and nothing is owed to it.
    fn is_settled(&self) -> bool {
        self.holder.is_none() && self.settling.is_none()
    }
}

impl<B> Drop for Storing<B> {
    fn drop(&mut self) {
        if let (false, Some(detach)) = (self.is_settled(), self.detach.take()) {
            detach(Storing {
                body: self.body.take(),
                record: self.record.take(),
                status_rule: self.status_rule.take(),
                holder: self.holder.take(),
                settling: self.settling.take(),
                then: None,
                detach: None,
                span: self.span.clone(),
            });
        }
        // Otherwise a holder still waiting finds its orders gone and releases the key.
    }
}

/// Holds a streamed response's claim: renews its lease, and settles it as the body says once
/// it has ended, or as not stored at `deadline` (the stream timeout), then closing `orders` so
/// the body stops copying and a drain whose client left stops reading.
async fn hold(
    claim: Claim,
    mut orders: oneshot::Receiver<Settle>,
    deadline: Option<tokio::time::Instant>,
    status: StatusCode,
    release_not_stored: bool,
) {
    let ordered = {
        let waiting = std::pin::pin!(async {
            match deadline {
                Some(deadline) => tokio::time::timeout_at(deadline, &mut orders).await.ok(),
                None => Some((&mut orders).await),
            }
        });
        claim.keep_alive(waiting).await
    };
    let order = match ordered {
        Some(order) => order.ok(),
        None => {
            orders.close();
            // An order sent just as the time ran out is still followed.
            match orders.try_recv() {
                Ok(order) => Some(order),
                Err(_) => {
                    tracing::warn!(
                        key = ?claim.key(),
                        "the streamed response did not end within the stream timeout; it streams on, not stored"
                    );
                    Some(Settle::NotStored(NotStored::TimedOut))
                }
            }
        }
    };
    match order {
        Some(Settle::Store(payload)) => {
            // Errors are logged by `complete`.
            let _ = claim.complete(payload).await;
        }
        Some(Settle::Release) => {
            tracing::debug!(key = ?claim.key(), "gRPC status not to be stored; the key is released");
            release(claim).await;
        }
        Some(Settle::NotStored(why)) => settle_not_stored(claim, why, Some(status), release_not_stored).await,
        // The body was dropped unsettled and not drained: the layer cancels on disconnect.
        None => release(claim).await,
    }
}

/// Reads the rest of a body whose client left, so its response is stored for the retry; stops
/// as soon as the claim is settled (stored, over the cap, failed, or past the stream timeout),
/// so an endless stream is not read for ever.
fn drain_detached<B>(mut storing: Storing<B>)
where
    B: Body<Data = Bytes, Error: Into<BoxError>> + Send + 'static,
{
    let span = storing.span.clone();
    let draining = std::future::poll_fn(move |cx| loop {
        storing.notice_timeout(cx);
        if storing.is_settled() {
            return Poll::Ready(());
        }
        if ready!(storing.poll_frame(cx)).is_none() {
            return Poll::Ready(());
        }
    });
    match tokio::runtime::Handle::try_current() {
        Ok(runtime) => {
            runtime.spawn(draining.instrument(span));
        }
        // Dropping it drops its orders; its holder releases the key.
        Err(_) => tracing::warn!("no Tokio runtime to finish storing a response whose client left"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use http_body_util::{BodyExt, Full};

    #[tokio::test]
    async fn a_stored_response_is_sent_from_the_stored_copy_not_a_second_one() {
        let body = Bytes::from(vec![9u8; 1024 * 1024]);
        let response = Response::builder()
            .status(201)
            .header(CONTENT_LENGTH, body.len())
            .body(Full::new(body))
            .unwrap();
        let Captured::Stored(response, payload) = capture(response, &Config::default()).await else {
            panic!("a 1 MiB response fits the default cap");
        };
        let sent = response.into_body().collect().await.unwrap().to_bytes();
        assert_eq!(sent.len(), 1024 * 1024);
        let stored = payload.as_ptr_range();
        assert!(
            stored.contains(&sent.as_ptr()),
            "the client's body is a slice of the stored payload"
        );
    }

    /// A gRPC response of known length (tonic's are of unknown length, and take the streaming
    /// path, which tests/grpc.rs covers): the decision waits for its trailers all the same.
    #[tokio::test]
    async fn a_grpc_response_of_known_length_is_stored_only_if_its_trailers_say_so() {
        use http::HeaderValue;
        use http_body_util::StreamBody;
        let respond = |status: Option<&'static str>| {
            let mut frames = vec![Ok::<_, std::convert::Infallible>(Frame::data(
                Bytes::from_static(b"\0\0\0\0\0"),
            ))];
            if let Some(status) = status {
                let trailers = HeaderMap::from_iter([(grpc::GRPC_STATUS, HeaderValue::from_static(status))]);
                frames.push(Ok(Frame::trailers(trailers)));
            }
            Response::builder()
                .header("content-type", "application/grpc")
                .header(CONTENT_LENGTH, 5)
                .body(StreamBody::new(futures_util::stream::iter(frames)))
                .unwrap()
        };
        let config = Config::default();
        for (status, stored) in [
            (Some("0"), true),
            (Some("5"), true),
            (Some("14"), false),
            (None, false),
        ] {
            let captured = capture(respond(status), &config).await;
            match captured {
                Captured::Stored(..) => assert!(stored, "{status:?} must not be stored"),
                Captured::NotCacheable(response) => {
                    assert!(!stored, "{status:?} must be stored");
                    // The client still gets the whole response, trailers included.
                    let collected = response.into_body().collect().await.unwrap();
                    let trailers = collected.trailers().map(|t| t[grpc::GRPC_STATUS].clone());
                    assert_eq!(trailers, status.map(HeaderValue::from_static));
                    assert_eq!(&collected.to_bytes()[..], b"\0\0\0\0\0");
                }
                _ => panic!("{status:?}: neither stored nor refused by the rule"),
            }
        }
        // A trailers-only response: decided from its headers, before its (empty) body is read.
        let trailers_only = Response::builder()
            .header("content-type", "application/grpc")
            .header("grpc-status", "14")
            .body(http_body_util::Empty::<Bytes>::new())
            .unwrap();
        assert!(matches!(
            capture(trailers_only, &config).await,
            Captured::NotCacheable(_)
        ));
    }
}
