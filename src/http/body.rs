//! The request body the layer hands on, and reading a body into memory within a limit.

use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::{Bytes, BytesMut};
use http::HeaderMap;
use http_body::{Body, Frame, SizeHint};
use http_body_util::BodyExt;
use pin_project_lite::pin_project;

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
    let trailers = loop {
        match body.frame().await {
            None => break None,
            Some(Err(error)) => {
                return Collected::Failed {
                    prefix: buffer.finish(),
                    error,
                }
            }
            Some(Ok(frame)) => match frame.into_data() {
                Ok(chunk) => {
                    let over = buffer.len() + chunk.len() > limit;
                    buffer.push(chunk);
                    if over {
                        return Collected::TooLarge {
                            prefix: buffer.finish(),
                            rest: body,
                        };
                    }
                }
                // Trailers end the body.
                Err(frame) => break frame.into_trailers().ok(),
            },
        }
    };
    Collected::Complete {
        data: buffer.finish(),
        trailers,
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
