//! [`TransactionalClaim`]: a claimed request's claim, handed to its handler so the handler can
//! store its response in its own database transaction.

use std::sync::Arc;

use bytes::Bytes;
use http::Response;
use http_body::Body;
use http_body_util::BodyExt;

use crate::http::body::BoxError;
use crate::http::config::Config;
use crate::store::ClaimTicket;

/// The claim of the request being handled, for storing the response in the handler's own
/// transaction, together with its business writes. In the request's extensions of every claimed
/// request when the layer is built
/// [`with_transactional_completion`](crate::IdempotencyLayer::with_transactional_completion);
/// axum handlers take it with `Extension<TransactionalClaim>`.
///
/// The handler [encodes](TransactionalClaim::encode_response) the response it is about to
/// return (what `IntoResponse::into_response` gives, in axum), as the layer would store it, and completes the [ticket](TransactionalClaim::ticket) in its
/// transaction (`PostgresStore::complete_in`) before it commits. After the commit the layer
/// finds the record completed and stores nothing; if the transaction rolls back instead, the
/// layer stores the response (or releases the key) as it does for any handler.
///
/// ```
/// use std::convert::Infallible;
/// use bytes::Bytes;
/// use http::{Request, Response, StatusCode};
/// use http_body_util::Full;
/// use tower::{Service, ServiceBuilder, ServiceExt};
/// use tower_idempotency::{IdempotencyLayer, MemoryStore, RequestBody, TransactionalClaim};
///
/// async fn handler(request: Request<RequestBody<Full<Bytes>>>) -> Result<Response<Full<Bytes>>, Infallible> {
///     let claim = request.extensions().get::<TransactionalClaim>().expect("a claimed request");
///     let response = Response::builder().status(StatusCode::CREATED).body(Full::from("{\"id\":7}")).unwrap();
///     // In a real handler: store.complete_in(&mut transaction, claim.ticket(), payload), then commit.
///     let (response, payload) = claim.encode_response(response).await.expect("a body that does not fail");
///     assert!(!payload.expect("a 201 under the cap is stored").is_empty());
///     Ok(response)
/// }
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() {
/// let layer = IdempotencyLayer::new(MemoryStore::new()).with_transactional_completion(true);
/// let mut service = ServiceBuilder::new().layer(layer).service_fn(handler);
/// let request = Request::post("/orders").header("idempotency-key", "o-1").body(Full::from("{}")).unwrap();
/// let response = service.ready().await.unwrap().call(request).await.unwrap();
/// assert_eq!(response.status(), StatusCode::CREATED);
/// # }
/// ```
#[derive(Clone)]
pub struct TransactionalClaim {
    ticket: ClaimTicket,
    config: Arc<Config>,
}

impl std::fmt::Debug for TransactionalClaim {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TransactionalClaim")
            .field("ticket", &self.ticket)
            .finish_non_exhaustive()
    }
}

impl TransactionalClaim {
    pub(crate) fn new(ticket: ClaimTicket, config: Arc<Config>) -> Self {
        Self { ticket, config }
    }

    /// The claim to complete in the handler's transaction.
    pub fn ticket(&self) -> &ClaimTicket {
        &self.ticket
    }

    /// `response` as the layer stores it for replays (its status, the headers the layer keeps,
    /// its body), or `None` when the layer would not store it: an answer its cacheable rule
    /// turns down (a 5xx, say), or a body over its response limit. For `None`, do not complete
    /// the claim in the transaction: return the response and the layer releases the key, or
    /// keeps it as not replayable, as configured.
    ///
    /// The handler must then return this same response, so that the first client and the
    /// retries get the same answer.
    ///
    /// ```
    /// use bytes::Bytes;
    /// use http::{Response, StatusCode};
    /// use tower_idempotency::TransactionalClaim;
    ///
    /// fn stored(claim: &TransactionalClaim) -> Option<Bytes> {
    ///     let failed = Response::builder().status(StatusCode::BAD_GATEWAY).body(Bytes::new()).unwrap();
    ///     assert_eq!(claim.encode(&failed), None, "a 5xx is not stored, so a retry runs again");
    ///     let created = Response::builder().status(StatusCode::CREATED).body(Bytes::from("{}")).unwrap();
    ///     claim.encode(&created)
    /// }
    /// ```
    pub fn encode<B: AsRef<[u8]>>(&self, response: &Response<B>) -> Option<Bytes> {
        let body = response.body().as_ref();
        let config = &self.config;
        if body.len() > config.response_limit {
            return None;
        }
        // The cacheable rule reads response parts; these carry what it looks at (status,
        // version, headers), not the extensions, which a response need not be able to clone.
        let mut head = Response::new(());
        *head.status_mut() = response.status();
        *head.version_mut() = response.version();
        *head.headers_mut() = response.headers().clone();
        let (parts, ()) = head.into_parts();
        if !(config.cacheable)(&parts) {
            return None;
        }
        let mut stored = config.stored_response(&parts, body.len());
        // Within the limit: checked above.
        stored.push(body);
        Some(stored.finish(None).0)
    }

    /// [`encode`](Self::encode) for a response of any body type, such as the one axum's
    /// `IntoResponse::into_response` gives: reads the body into one buffer and hands the response
    /// back, with that buffer as its body, together with what to store (`None` when the layer
    /// would not store it). Return the response it gives back.
    ///
    /// The body must be one the handler has in hand (JSON, a short page), not an endless
    /// stream: it is read to its end. One whose size hint already says it is over the layer's
    /// response limit is handed back unread, with `None`. A body that fails is an error (answer
    /// 500: the layer does not store it, so a retry runs again). Trailers, if the body has any,
    /// are dropped, from the response as from what is stored.
    ///
    /// ```
    /// use bytes::Bytes;
    /// use http::{Response, StatusCode};
    /// use http_body_util::Full;
    /// use tower_idempotency::{BoxError, TransactionalClaim};
    ///
    /// async fn stored(claim: &TransactionalClaim) -> Result<Option<Bytes>, BoxError> {
    ///     let created = Response::builder().status(StatusCode::CREATED).body(Full::new(Bytes::from("{}")))?;
    ///     let (response, payload) = claim.encode_response(created).await?;
    ///     assert_eq!(response.status(), StatusCode::CREATED, "the same response, to return");
    ///     Ok(payload)
    /// }
    /// ```
    pub async fn encode_response<B>(
        &self,
        response: Response<B>,
    ) -> Result<(Response<B>, Option<Bytes>), BoxError>
    where
        B: Body<Error: Into<BoxError>> + From<Bytes>,
    {
        if response.body().size_hint().lower() > self.config.response_limit as u64 {
            return Ok((response, None));
        }
        let (parts, body) = response.into_parts();
        let body = body.collect().await.map_err(Into::into)?.to_bytes();
        let response = Response::from_parts(parts, body);
        let payload = self.encode(&response);
        Ok((response.map(B::from), payload))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::http::stored::{decode, Decoded};
    use crate::{IdempotencyKey, RecordKey};

    fn claim(config: Config) -> TransactionalClaim {
        let coordinator = crate::Coordinator::new(crate::MemoryStore::new());
        let key = RecordKey::new(None, IdempotencyKey::parse("k").unwrap());
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        let ticket = runtime.block_on(async {
            match coordinator
                .begin(&key, &crate::Fingerprint::new([b"x".as_slice()]))
                .await
            {
                Ok(crate::Begin::Claimed(claim)) => {
                    let ticket = claim.ticket();
                    claim.release().await.unwrap();
                    ticket
                }
                other => panic!("{other:?}"),
            }
        });
        TransactionalClaim::new(ticket, Arc::new(config))
    }

    #[test]
    fn encodes_as_the_layer_stores_leaving_out_the_unstored_headers() {
        let claim = claim(Config::default());
        let response = Response::builder()
            .status(201)
            .header("content-type", "application/json")
            .header("set-cookie", "session=secret")
            .header("x-multi", "one")
            .header("x-multi", "two")
            .body(Bytes::from_static(b"{\"id\":1}"))
            .unwrap();
        let payload = claim.encode(&response).expect("stored");
        let Ok(Decoded::Response(stored)) = decode(&payload) else {
            panic!("a stored response");
        };
        assert_eq!(stored.status, 201);
        assert_eq!(&stored.body[..], b"{\"id\":1}");
        assert!(stored.headers.get("set-cookie").is_none());
        assert_eq!(stored.headers.get_all("x-multi").iter().count(), 2);
    }

    #[test]
    fn answers_the_layer_would_not_store_are_not_encoded() {
        let claim = claim(Config {
            response_limit: 4,
            ..Config::default()
        });
        let status = |code: u16, body: &'static [u8]| {
            Response::builder()
                .status(code)
                .body(Bytes::from_static(body))
                .unwrap()
        };
        assert!(claim.encode(&status(500, b"")).is_none());
        assert!(claim.encode(&status(429, b"")).is_none());
        assert!(claim.encode(&status(201, b"12345")).is_none(), "over the limit");
        assert!(claim.encode(&status(201, b"1234")).is_some());
    }

    #[test]
    fn a_response_of_any_body_is_read_and_handed_back_with_its_encoding() {
        let claim = claim(Config {
            response_limit: 4,
            ..Config::default()
        });
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        let body = |bytes: &'static [u8]| http_body_util::Full::new(Bytes::from_static(bytes));
        let response = Response::builder().status(201).body(body(b"1234")).unwrap();
        let (response, payload) = runtime.block_on(claim.encode_response(response)).unwrap();
        assert_eq!(
            payload,
            claim.encode(&Response::builder().status(201).body(b"1234").unwrap())
        );
        assert!(payload.is_some());
        let handed_back = runtime
            .block_on(response.into_body().collect())
            .unwrap()
            .to_bytes();
        assert_eq!(&handed_back[..], b"1234");
        // Over the limit by its size hint: handed back unread, nothing to store.
        let response = Response::builder().status(201).body(body(b"12345")).unwrap();
        let (response, payload) = runtime.block_on(claim.encode_response(response)).unwrap();
        assert_eq!(payload, None);
        let handed_back = runtime
            .block_on(response.into_body().collect())
            .unwrap()
            .to_bytes();
        assert_eq!(&handed_back[..], b"12345");
    }
}
