//! [`ResponseFuture`]: what [`Idempotency`](crate::Idempotency) returns.

use std::future::Future;
use std::pin::Pin;
use std::task::{ready, Context, Poll};

use http::Response;
use pin_project_lite::pin_project;

use crate::http::response_body::ResponseBody;

pub(crate) type BoxFuture<T> = Pin<Box<dyn Future<Output = T> + Send>>;

pub(crate) type Answer<B, E> = Result<Response<ResponseBody<B>>, E>;

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
    /// The store is down and the layer fails open: this runs the handler with no claim. Nothing
    /// is stored, so a client that leaves cancels it, as any unprotected request.
    Unprotected(BoxFuture<Answer<B, E>>),
}

pin_project! {
    /// The response future of [`Idempotency`](crate::Idempotency).
    ///
    /// A request the layer does not cover is the inner future, unboxed; a rejection decided from
    /// the headers alone is ready at once; a keyed request is a boxed future (it awaits the
    /// store, which costs far more than the allocation). Once a keyed request has claimed its key,
    /// dropping this future (the client hung up) does not cancel the handler: the rest of the
    /// work moves to a Tokio task of its own, so its answer is stored for the retry (unless
    /// `with_cancel_on_disconnect`).
    ///
    /// ```
    /// use std::convert::Infallible;
    /// use bytes::Bytes;
    /// use http::{Request, Response};
    /// use http_body_util::Full;
    /// use tower::{Service, ServiceExt};
    /// use tower_idempotency::{IdempotencyLayer, MemoryStore, RequestBody};
    ///
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() {
    /// let handler = tower::service_fn(|_: Request<RequestBody<Full<Bytes>>>| async {
    ///     Ok::<_, Infallible>(Response::new(Full::new(Bytes::from("ok"))))
    /// });
    /// let mut service = tower::ServiceBuilder::new().layer(IdempotencyLayer::new(MemoryStore::new())).service(handler);
    /// // A GET is not covered: its future is the handler's, unboxed.
    /// let future = service.ready().await.unwrap().call(Request::get("/").body(Full::default()).unwrap());
    /// assert_eq!(future.await.unwrap().status(), 200);
    /// # }
    /// ```
    pub struct ResponseFuture<F, B, E> {
        #[pin]
        kind: Kind<F, B, E>,
    }
}

pin_project! {
    #[project = KindProj]
    enum Kind<F, B, E> {
        Passthrough { #[pin] future: F },
        Ready { response: Option<Response<ResponseBody<B>>> },
        Begin { future: BoxFuture<Step<B, E>>, detach: Option<fn(BoxFuture<Answer<B, E>>, tracing::Span)> },
        Run { run: Detachable<Answer<B, E>> },
    }
}

impl<F, B, E> ResponseFuture<F, B, E> {
    pub(crate) fn passthrough(future: F) -> Self {
        Self {
            kind: Kind::Passthrough { future },
        }
    }

    pub(crate) fn ready(response: Response<ResponseBody<B>>) -> Self {
        Self {
            kind: Kind::Ready {
                response: Some(response),
            },
        }
    }

    /// A keyed request: `begin` reads, fingerprints and claims; if it claims, the run it hands
    /// back is detached when this future is dropped, unless `cancel_on_disconnect`.
    pub(crate) fn keyed(begin: BoxFuture<Step<B, E>>, cancel_on_disconnect: bool) -> Self
    where
        B: Send + 'static,
        E: Send + 'static,
    {
        // The function pointer carries the `Send + 'static` bounds the spawn needs, so the
        // future's type (and its `Drop`) need none.
        let detach = (!cancel_on_disconnect).then_some(spawn_detached::<Answer<B, E>> as fn(_, _));
        Self {
            kind: Kind::Begin {
                future: begin,
                detach,
            },
        }
    }
}

impl<F, B, E> std::fmt::Debug for ResponseFuture<F, B, E> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ResponseFuture").finish_non_exhaustive()
    }
}

impl<F, B, E> Future for ResponseFuture<F, B, E>
where
    F: Future<Output = Result<Response<B>, E>>,
{
    type Output = Result<Response<ResponseBody<B>>, E>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        loop {
            let run = match self.as_mut().project().kind.project() {
                KindProj::Passthrough { future } => {
                    let response = ready!(future.poll(cx))?;
                    return Poll::Ready(Ok(response.map(ResponseBody::streaming)));
                }
                KindProj::Ready { response } => match response.take() {
                    Some(response) => return Poll::Ready(Ok(response)),
                    None => panic!("ResponseFuture polled after completion"),
                },
                KindProj::Begin { future, detach } => match ready!(future.as_mut().poll(cx)) {
                    Step::Done(answer) => return Poll::Ready(answer),
                    Step::Unprotected(run) => Detachable {
                        future: Some(run),
                        detach: None,
                        span: None,
                    },
                    Step::Run(run) => Detachable {
                        future: Some(run),
                        detach: *detach,
                        // Polled here, the run is inside whatever span the request's future is
                        // instrumented with; a detached run takes that span along.
                        span: detach.map(|_| tracing::Span::current()),
                    },
                },
                KindProj::Run { run } => return run.poll(cx),
            };
            self.as_mut().project().kind.set(Kind::Run { run });
        }
    }
}

/// A boxed future that, dropped before it finishes, is moved to a task of its own to finish
/// (when `detach` is set) instead of being cancelled.
struct Detachable<T> {
    future: Option<BoxFuture<T>>,
    detach: Option<fn(BoxFuture<T>, tracing::Span)>,
    /// The request's span, for the task a detached run continues in.
    span: Option<tracing::Span>,
}

impl<T> Detachable<T> {
    fn poll(&mut self, cx: &mut Context<'_>) -> Poll<T> {
        let Some(future) = self.future.as_mut() else {
            panic!("ResponseFuture polled after completion");
        };
        let output = ready!(future.as_mut().poll(cx));
        self.future = None;
        Poll::Ready(output)
    }
}

impl<T> Drop for Detachable<T> {
    fn drop(&mut self) {
        if let (Some(future), Some(detach)) = (self.future.take(), self.detach) {
            detach(future, self.span.take().unwrap_or_else(tracing::Span::none));
        }
    }
}

fn spawn_detached<T: Send + 'static>(future: BoxFuture<T>, span: tracing::Span) {
    use tracing::Instrument;
    match tokio::runtime::Handle::try_current() {
        Ok(runtime) => {
            runtime.spawn(future.instrument(span));
        }
        // Dropping it drops its claim, which logs that it cannot be released without a runtime.
        Err(_) => tracing::warn!("no Tokio runtime to finish a claimed request whose client left"),
    }
}
