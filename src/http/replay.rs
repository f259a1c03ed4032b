//! A replay: the stored response, sent again with `Idempotent-Replayed: true`.

use http::header::{HeaderName, HeaderValue};
use http::Response;

use crate::http::response_body::ResponseBody;
use crate::http::stored::Stored;

/// The header added to every replayed response, as Stripe does.
///
/// ```
/// assert_eq!(tower_idempotency::IDEMPOTENT_REPLAYED.as_str(), "idempotent-replayed");
/// ```
pub const IDEMPOTENT_REPLAYED: HeaderName = HeaderName::from_static("idempotent-replayed");

/// The response a retry gets: the stored one, plus `Idempotent-Replayed: true`.
pub(crate) fn into_response<B>(stored: Stored) -> Response<ResponseBody<B>> {
    let mut response = Response::new(ResponseBody::with_trailers(stored.body, stored.trailers));
    *response.status_mut() = stored.status;
    *response.headers_mut() = stored.headers;
    response
        .headers_mut()
        .insert(IDEMPOTENT_REPLAYED, HeaderValue::from_static("true"));
    response
}
