//! The request and response body types the layer hands on, and bounded buffering.

use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::{Bytes, BytesMut};
use http::HeaderMap;
use http_body::{Body, Frame, SizeHint};
use http_body_util::BodyExt;
use pin_project_lite::pin_project;

use crate::http::capture::Storing;

/// A boxed error, as tower and axum use them.
///
/// ```
/// let error: tower_idempotency::BoxError = "went wrong".into();
/// assert_eq!(error.to_string(), "went wrong");
/// ```
pub type BoxError = Box<dyn std::error::Error + Send + Sync>;

pin_project! {
    /// The request body the inner service receives: the client's body, untouched when the layer
    /// passes the request through, or the bytes the layer buffered to fingerprint it.
    ///
    /// ```
    /// use std::convert::Infallible;
    /// use bytes::Bytes;
    /// use http::{Request, Response};
    /// use http_body_util::{BodyExt, Full};
    /// use tower_idempotency::RequestBody;
    ///
    /// // An inner service reads it like any other body.
    /// async fn handle(request: Request<RequestBody<Full<Bytes>>>) -> Result<Response<Full<Bytes>>, Infallible> {
    ///     let body = request.into_body().collect().await?.to_bytes();
    ///     Ok(Response::new(Full::new(body)))
    /// }
    /// # let _ = handle;
    /// ```
    pub struct RequestBody<B> {
        #[pin]
        kind: RequestKind<B>,
    }
}

pin_project! {
    #[project = RequestKindProj]
    enum RequestKind<B> {
        Buffered { data: Option<Bytes> },
        Streaming { #[pin] body: B },
    }
}

impl<B> RequestBody<B> {
    pub(crate) fn buffered(data: Bytes) -> Self {
        Self {
            kind: RequestKind::Buffered {
                data: (!data.is_empty()).then_some(data),
            },
        }
    }

    pub(crate) fn streaming(body: B) -> Self {
        Self {
            kind: RequestKind::Streaming { body },
        }
    }
}

impl<B> std::fmt::Debug for RequestBody<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RequestBody").finish_non_exhaustive()
    }
}

impl<B> Body for RequestBody<B>
where
    B: Body<Data = Bytes>,
{
    type Data = Bytes;
    type Error = B::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, B::Error>>> {
        match self.project().kind.project() {
            RequestKindProj::Buffered { data } => Poll::Ready(data.take().map(|d| Ok(Frame::data(d)))),
            RequestKindProj::Streaming { body } => body.poll_frame(cx),
        }
    }

    fn is_end_stream(&self) -> bool {
        match &self.kind {
            RequestKind::Buffered { data } => data.is_none(),
            RequestKind::Streaming { body } => body.is_end_stream(),
        }
    }

    fn size_hint(&self) -> SizeHint {
        match &self.kind {
            RequestKind::Buffered { data } => {
                SizeHint::with_exact(data.as_ref().map_or(0, |d| d.len() as u64))
            }
            RequestKind::Streaming { body } => body.size_hint(),
        }
    }
}

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
    B: Body<Data = Bytes>,
    B::Error: Into<BoxError>,
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

/// A body read as far as a limit allows.
pub(crate) enum Collected<B: Body> {
    /// All of it, within the limit.
    Complete {
        data: Bytes,
        trailers: Option<HeaderMap>,
    },
    /// More than the limit: what was read, and the rest, unread.
    TooLarge { prefix: Bytes, rest: Pin<Box<B>> },
    /// The body failed after `prefix`.
    Failed { prefix: Bytes, error: B::Error },
}

impl<B: Body> Collected<B> {
    /// Turns what was read back into a body that yields exactly what the original would have.
    pub(crate) fn into_response_body(self) -> ResponseBody<B>
    where
        B::Error: Into<BoxError>,
    {
        match self {
            Collected::Complete { data, trailers } => ResponseBody::buffered(data, trailers, None),
            Collected::TooLarge { prefix, rest } => ResponseBody::resumed(prefix, rest),
            Collected::Failed { prefix, error } => ResponseBody::buffered(prefix, None, Some(error.into())),
        }
    }
}

/// Reads `body` into memory, never holding more than `limit` bytes of it.
pub(crate) async fn collect_limited<B>(body: B, limit: usize) -> Collected<B>
where
    B: Body<Data = Bytes>,
{
    // Room for the whole body at once when its size is known, so it is copied once and never
    // regrown (a regrowth holds the old and the new buffer together).
    let expected = usize::try_from(body.size_hint().lower())
        .unwrap_or(usize::MAX)
        .min(limit);
    let mut body = Box::pin(body);
    let mut buffer = Accumulator {
        expected,
        ..Accumulator::default()
    };
    loop {
        match body.frame().await {
            None => {
                return Collected::Complete {
                    data: buffer.finish(),
                    trailers: None,
                }
            }
            Some(Err(error)) => {
                return Collected::Failed {
                    prefix: buffer.finish(),
                    error,
                }
            }
            Some(Ok(frame)) => match frame.into_data() {
                Ok(chunk) => {
                    if buffer.len() + chunk.len() > limit {
                        buffer.push(chunk);
                        return Collected::TooLarge {
                            prefix: buffer.finish(),
                            rest: body,
                        };
                    }
                    buffer.push(chunk);
                }
                Err(frame) => {
                    // Trailers end the body.
                    let trailers = frame.into_trailers().ok();
                    return Collected::Complete {
                        data: buffer.finish(),
                        trailers,
                    };
                }
            },
        }
    }
}

/// Gathers chunks without copying when the body arrives in one piece, the common case.
#[derive(Default)]
struct Accumulator {
    /// The size to reserve when a second chunk arrives.
    expected: usize,
    first: Option<Bytes>,
    joined: Option<BytesMut>,
}

impl Accumulator {
    fn len(&self) -> usize {
        self.joined
            .as_ref()
            .map_or_else(|| self.first.as_ref().map_or(0, Bytes::len), BytesMut::len)
    }

    fn push(&mut self, chunk: Bytes) {
        if chunk.is_empty() {
            return;
        }
        if let Some(joined) = &mut self.joined {
            joined.extend_from_slice(&chunk);
        } else if let Some(first) = self.first.take() {
            let mut joined = BytesMut::with_capacity(self.expected.max(first.len() + chunk.len()));
            joined.extend_from_slice(&first);
            joined.extend_from_slice(&chunk);
            self.joined = Some(joined);
        } else {
            self.first = Some(chunk);
        }
    }

    fn finish(self) -> Bytes {
        match self.joined {
            Some(joined) => joined.freeze(),
            None => self.first.unwrap_or_default(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A body in chunks that declares its size up front, as hyper does with `Content-Length`.
    struct Chunked {
        chunks: std::collections::VecDeque<Bytes>,
        left: u64,
    }

    impl Body for Chunked {
        type Data = Bytes;
        type Error = std::convert::Infallible;

        fn poll_frame(
            mut self: Pin<&mut Self>,
            _: &mut Context<'_>,
        ) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
            let chunk = self.chunks.pop_front();
            if let Some(chunk) = &chunk {
                self.left -= chunk.len() as u64;
            }
            Poll::Ready(chunk.map(|c| Ok(Frame::data(c))))
        }

        fn size_hint(&self) -> SizeHint {
            SizeHint::with_exact(self.left)
        }
    }

    #[tokio::test]
    async fn a_body_of_known_size_is_gathered_into_one_allocation_never_regrown() {
        let chunk = Bytes::from(vec![7u8; 64 * 1024]);
        let body = Chunked {
            chunks: std::iter::repeat_n(chunk, 16).collect(),
            left: 1024 * 1024,
        };
        let Collected::Complete { data, .. } = collect_limited(body, 2 * 1024 * 1024).await else {
            panic!("the whole body fits the limit");
        };
        assert_eq!(data.len(), 1024 * 1024);
        // One buffer of the declared size: a regrown buffer would have been reallocated, and the
        // bytes would not all sit in the allocation made for the second chunk.
        let mut buffer = Accumulator {
            expected: 1024 * 1024,
            ..Accumulator::default()
        };
        buffer.push(Bytes::from(vec![1u8; 64 * 1024]));
        buffer.push(Bytes::from(vec![2u8; 64 * 1024]));
        let start = buffer.joined.as_ref().map(|j| j.as_ptr()).unwrap();
        for _ in 0..14 {
            buffer.push(Bytes::from(vec![3u8; 64 * 1024]));
        }
        let joined = buffer.joined.as_ref().unwrap();
        assert_eq!(joined.as_ptr(), start, "never reallocated");
        assert_eq!(joined.capacity(), 1024 * 1024);
    }
}
