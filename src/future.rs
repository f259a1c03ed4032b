//! [`ResponseFuture`]: what [`Idempotency`](crate::Idempotency) returns.

use std::future::Future;
use std::pin::Pin;
use std::task::{ready, Context, Poll};

use http::Response;
use pin_project_lite::pin_project;

use crate::body::ResponseBody;

pub(crate) type BoxFuture<T> = Pin<Box<dyn Future<Output = T> + Send>>;

pin_project! {
    /// The response future of [`Idempotency`](crate::Idempotency).
    ///
    /// A request the layer does not cover is the inner future, unboxed; a rejection decided from
    /// the headers alone is ready at once; a keyed request is a boxed future (it awaits the
    /// store, which costs far more than the allocation).
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
        Keyed { future: BoxFuture<Result<Response<ResponseBody<B>>, E>> },
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

    pub(crate) fn keyed(future: BoxFuture<Result<Response<ResponseBody<B>>, E>>) -> Self {
        Self {
            kind: Kind::Keyed { future },
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

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        match self.project().kind.project() {
            KindProj::Passthrough { future } => {
                let response = ready!(future.poll(cx))?;
                Poll::Ready(Ok(response.map(ResponseBody::streaming)))
            }
            KindProj::Ready { response } => match response.take() {
                Some(response) => Poll::Ready(Ok(response)),
                None => panic!("ResponseFuture polled after completion"),
            },
            KindProj::Keyed { future } => future.as_mut().poll(cx),
        }
    }
}
