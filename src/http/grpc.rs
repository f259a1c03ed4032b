//! gRPC over the same layer: a gRPC call is an HTTP/2 `POST` whose outcome is in its
//! `grpc-status`, sent in the trailers, or in the headers of a trailers-only response. So the
//! cacheable rule waits for that status, and rejections are answered as gRPC clients read them:
//! HTTP 200, `content-type: application/grpc`, `grpc-status`, a percent-encoded
//! `grpc-message`, and the kind in `grpc-status-details-bin`. Plain headers, a few hand-written
//! protobuf fields: no gRPC library is needed.
//!
//! Only what a rejection or the cacheable decision needs is looked at, and only there: a request
//! that is not rejected pays nothing for gRPC, and a claimed request one look at its response's
//! `Content-Type`.

use bytes::{BufMut, Bytes, BytesMut};
use http::header::{HeaderName, HeaderValue, CONTENT_TYPE};
use http::HeaderMap;

/// Decides whether a gRPC response with this `grpc-status` is stored.
pub(crate) type GrpcCacheableFn = std::sync::Arc<dyn Fn(i32) -> bool + Send + Sync>;

pub(crate) const GRPC_STATUS: HeaderName = HeaderName::from_static("grpc-status");
pub(crate) const GRPC_MESSAGE: HeaderName = HeaderName::from_static("grpc-message");
/// gRPC's rich error model: a `google.rpc.Status`, base64-encoded.
pub(crate) const GRPC_STATUS_DETAILS: HeaderName = HeaderName::from_static("grpc-status-details-bin");
/// How long a client with a retry policy waits before its next attempt (gRPC's A6 proposal).
pub(crate) const GRPC_RETRY_PUSHBACK_MS: HeaderName = HeaderName::from_static("grpc-retry-pushback-ms");

/// gRPC status codes, as in `google.rpc.Code`.
pub(crate) mod code {
    pub(crate) const OK: i32 = 0;
    pub(crate) const CANCELLED: i32 = 1;
    pub(crate) const INVALID_ARGUMENT: i32 = 3;
    pub(crate) const DEADLINE_EXCEEDED: i32 = 4;
    pub(crate) const NOT_FOUND: i32 = 5;
    pub(crate) const ALREADY_EXISTS: i32 = 6;
    pub(crate) const RESOURCE_EXHAUSTED: i32 = 8;
    pub(crate) const FAILED_PRECONDITION: i32 = 9;
    pub(crate) const ABORTED: i32 = 10;
    pub(crate) const OUT_OF_RANGE: i32 = 11;
    pub(crate) const UNIMPLEMENTED: i32 = 12;
    pub(crate) const INTERNAL: i32 = 13;
    pub(crate) const UNAVAILABLE: i32 = 14;
}

/// Whether a `Content-Type` is gRPC's: `application/grpc`, alone or followed by `+proto`,
/// `+json` or parameters. gRPC-Web (`application/grpc-web…`) is not: its trailers travel in the
/// body, where the layer does not look.
pub(crate) fn is_grpc(content_type: Option<&HeaderValue>) -> bool {
    const GRPC: &[u8] = b"application/grpc";
    let Some(value) = content_type else {
        return false;
    };
    let value = value.as_bytes();
    value.len() >= GRPC.len()
        && value[..GRPC.len()].eq_ignore_ascii_case(GRPC)
        && matches!(value.get(GRPC.len()), None | Some(b'+' | b';'))
}

/// Whether `path` calls one of gRPC's own services: a method of a service in the `grpc.` proto
/// package (`/grpc.health.v1.Health/Check`, `/grpc.reflection.v1.ServerReflection/…`,
/// `/grpc.channelz.v1.Channelz/…`). The package is reserved for gRPC's own services, which
/// read state or serve the infrastructure (probes, tools) and never carry an idempotency key.
/// One comparison of six bytes: the layer asks it of every covered request.
#[inline]
pub(crate) fn is_grpc_service(path: &str) -> bool {
    path.starts_with("/grpc.")
}

/// Whether a request is a gRPC call, so its rejections must speak gRPC.
pub(crate) fn is_grpc_request(headers: &HeaderMap) -> bool {
    is_grpc(headers.get(CONTENT_TYPE))
}

/// The `grpc-status` in `fields`: `None` if absent; an unreadable one reads as `UNKNOWN` (2), as
/// gRPC clients read it.
pub(crate) fn status_in(fields: &HeaderMap) -> Option<i32> {
    let value = fields.get(GRPC_STATUS)?;
    Some(value.to_str().ok().and_then(|s| s.parse().ok()).unwrap_or(2))
}

/// Whether a gRPC response whose status came at the end (in `trailers`) may be stored: one
/// that ended without a status failed (gRPC clients read it as an error) and is not.
pub(crate) fn cacheable_at_end(trailers: Option<&HeaderMap>, rule: &GrpcCacheableFn) -> bool {
    trailers.and_then(status_in).is_some_and(|code| rule(code))
}

/// What the cacheable rule can know of a handler's response from its head.
pub(crate) enum Outcome {
    /// Not a gRPC response: the HTTP rule alone decides.
    NotGrpc,
    /// A trailers-only response: its status is in its headers.
    Known(i32),
    /// A gRPC response whose status comes in the trailers, at the end of the body.
    AtEnd,
}

pub(crate) fn outcome(headers: &HeaderMap) -> Outcome {
    if !is_grpc(headers.get(CONTENT_TYPE)) {
        return Outcome::NotGrpc;
    }
    status_in(headers).map_or(Outcome::AtEnd, Outcome::Known)
}

/// The default test of whether a gRPC call's outcome may be stored and replayed, by its
/// `grpc-status`: the same reasoning as [`default_cacheable`](crate::default_cacheable) for
/// HTTP. Stored: answers a retry of the same call would get again. Not stored: failures a retry
/// may well not meet (the 5xx-like ones) and refusals given before the operation started (the
/// 401/403/408/429-like ones), so the retry runs.
///
/// | `grpc-status` | stored | like HTTP |
/// |---|---|---|
/// | 0 `OK` | yes | 2xx |
/// | 3 `INVALID_ARGUMENT`, 11 `OUT_OF_RANGE` | yes | 400 |
/// | 5 `NOT_FOUND` | yes | 404 |
/// | 6 `ALREADY_EXISTS` | yes | 409 for a resource that exists: a retry gets it again |
/// | 9 `FAILED_PRECONDITION` | yes | 400, 412 |
/// | 1 `CANCELLED` | no | 499, 408 |
/// | 2 `UNKNOWN`, 13 `INTERNAL`, 15 `DATA_LOSS` | no | 500 |
/// | 4 `DEADLINE_EXCEEDED` | no | 504 |
/// | 7 `PERMISSION_DENIED`, 16 `UNAUTHENTICATED` | no | 403, 401 |
/// | 8 `RESOURCE_EXHAUSTED` | no | 429 |
/// | 10 `ABORTED` | no | 409 for a concurrency conflict |
/// | 12 `UNIMPLEMENTED` | no | 501 (a rolling upgrade: another instance may have it) |
/// | 14 `UNAVAILABLE` | no | 503 |
/// | any other code, or none | no | |
///
/// ```
/// use tower_idempotency::default_grpc_cacheable;
///
/// assert!(default_grpc_cacheable(0)); // OK
/// assert!(default_grpc_cacheable(5)); // NOT_FOUND
/// assert!(!default_grpc_cacheable(14)); // UNAVAILABLE
/// assert!(!default_grpc_cacheable(16)); // UNAUTHENTICATED
/// ```
pub fn default_grpc_cacheable(code: i32) -> bool {
    matches!(
        code,
        code::OK
            | code::INVALID_ARGUMENT
            | code::NOT_FOUND
            | code::ALREADY_EXISTS
            | code::FAILED_PRECONDITION
            | code::OUT_OF_RANGE
    )
}

/// The few protobuf encodings `google.rpc.Status` needs, written out rather than taken from a
/// protobuf library the crate would otherwise not need.
pub(crate) mod proto {
    fn varint(out: &mut Vec<u8>, mut value: u64) {
        while value >= 0x80 {
            out.push((value as u8) | 0x80);
            value >>= 7;
        }
        out.push(value as u8);
    }

    /// A varint field (wire type 0).
    pub(crate) fn varint_field(out: &mut Vec<u8>, field: u64, value: u64) {
        varint(out, field << 3);
        varint(out, value);
    }

    /// A length-delimited field (wire type 2): bytes, a string or an embedded message.
    pub(crate) fn bytes(out: &mut Vec<u8>, field: u64, value: &[u8]) {
        varint(out, field << 3 | 2);
        varint(out, value.len() as u64);
        out.extend_from_slice(value);
    }

    pub(crate) fn string(out: &mut Vec<u8>, field: u64, value: &str) {
        bytes(out, field, value.as_bytes());
    }

    /// A `google.protobuf.Any` holding `message` of type `name`.
    pub(crate) fn any(name: &str, message: &[u8]) -> Vec<u8> {
        let mut any = Vec::new();
        string(&mut any, 1, &format!("type.googleapis.com/{name}"));
        bytes(&mut any, 2, message);
        any
    }
}

/// Standard base64 with padding, as gRPC's `-bin` metadata is sent.
pub(crate) fn base64(data: &[u8]) -> Bytes {
    const ALPHABET: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let mut out = BytesMut::with_capacity(data.len().div_ceil(3) * 4);
    for chunk in data.chunks(3) {
        let b = [chunk[0], *chunk.get(1).unwrap_or(&0), *chunk.get(2).unwrap_or(&0)];
        let n = u32::from(b[0]) << 16 | u32::from(b[1]) << 8 | u32::from(b[2]);
        let sextets = [n >> 18, n >> 12, n >> 6, n].map(|s| ALPHABET[(s & 63) as usize]);
        let kept = chunk.len() + 1;
        out.put_slice(&sextets[..kept]);
        out.put_slice(&b"=="[..4 - kept]);
    }
    out.freeze()
}

/// `grpc-message`'s encoding (gRPC over HTTP/2, "Responses"): every byte outside `%x20-%x7E`,
/// and `%` itself, becomes `%XX`.
pub(crate) fn percent_encode(text: &[u8]) -> Bytes {
    const HEX: &[u8; 16] = b"0123456789ABCDEF";
    let mut out = BytesMut::with_capacity(text.len());
    for &byte in text {
        if (0x20..=0x7e).contains(&byte) && byte != b'%' {
            out.put_u8(byte);
        } else {
            out.put_slice(&[b'%', HEX[usize::from(byte >> 4)], HEX[usize::from(byte & 0xf)]]);
        }
    }
    out.freeze()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::http::response::Rejection;

    #[test]
    fn grpc_content_types_are_recognised_and_grpc_web_is_not() {
        let is = |v: &'static str| is_grpc(Some(&HeaderValue::from_static(v)));
        assert!(is("application/grpc"));
        assert!(is("application/grpc+proto"));
        assert!(is("Application/GRPC+json"));
        assert!(is("application/grpc; charset=utf-8"));
        assert!(!is("application/grpc-web"));
        assert!(!is("application/grpc-web+proto"));
        assert!(!is("application/grpcx"));
        assert!(!is("application/json"));
        assert!(!is_grpc(None));
    }

    #[test]
    fn grpc_message_is_percent_encoded_as_the_spec_asks() {
        assert_eq!(&percent_encode(b"Retry in 1 s.")[..], b"Retry in 1 s.");
        assert_eq!(&percent_encode(b"100% caf\xc3\xa9\n")[..], b"100%25 caf%C3%A9%0A");
    }

    #[test]
    fn base64_is_the_standard_alphabet_with_padding() {
        assert_eq!(&base64(b"")[..], b"");
        assert_eq!(&base64(b"f")[..], b"Zg==");
        assert_eq!(&base64(b"fo")[..], b"Zm8=");
        assert_eq!(&base64(b"foo")[..], b"Zm9v");
        assert_eq!(&base64(b"foob")[..], b"Zm9vYg==");
        assert_eq!(&base64(&[0xfb, 0xff])[..], b"+/8=");
    }

    #[test]
    fn an_unreadable_status_reads_as_unknown() {
        let mut fields = HeaderMap::new();
        assert_eq!(status_in(&fields), None);
        fields.insert(GRPC_STATUS, HeaderValue::from_static("14"));
        assert_eq!(status_in(&fields), Some(14));
        fields.insert(GRPC_STATUS, HeaderValue::from_static("fourteen"));
        assert_eq!(status_in(&fields), Some(2));
    }

    #[test]
    fn every_rejection_is_a_trailers_only_grpc_response_with_its_reason_in_the_extensions() {
        use http_body::Body as _;
        let rejections = [
            (Rejection::MissingKey, 3),
            (Rejection::BodyTooLarge { limit: 1 }, 8),
            (Rejection::BodyUnreadable, 1),
            (
                Rejection::InFlight {
                    retry_after: std::time::Duration::from_secs(2),
                },
                10,
            ),
            (
                Rejection::Mismatch {
                    status: http::StatusCode::CONFLICT,
                },
                10,
            ),
            (
                Rejection::PolicyMismatch {
                    status: http::StatusCode::CONFLICT,
                },
                10,
            ),
            (Rejection::StoreUnavailable, 14),
            (Rejection::Overloaded, 14),
            (Rejection::UnreadableRecord, 13),
            (Rejection::HandlerPanicked, 13),
            (Rejection::MissingScope, 13),
            (
                Rejection::ResponseNotStored {
                    status: http::StatusCode::CONFLICT,
                    why: crate::NotStored::TooLarge,
                },
                9,
            ),
            (
                Rejection::HandlerTimedOut {
                    after: std::time::Duration::from_secs(60),
                },
                4,
            ),
            (Rejection::NoEndpoint, 12),
        ];
        for (rejection, code) in rejections {
            let response = rejection
                .clone()
                .into_grpc_response::<http_body_util::Empty<Bytes>>();
            assert_eq!(response.status(), 200, "{rejection:?}");
            assert_eq!(status_in(response.headers()), Some(code), "{rejection:?}");
            assert_eq!(response.headers()[CONTENT_TYPE], "application/grpc");
            assert!(!response.headers()[GRPC_MESSAGE].is_empty());
            assert!(response.body().is_end_stream(), "trailers-only: no body");
            assert_eq!(response.extensions().get::<Rejection>(), Some(&rejection));
        }
        let in_flight = Rejection::InFlight {
            retry_after: std::time::Duration::from_secs(2),
        }
        .into_grpc_response::<http_body_util::Empty<Bytes>>();
        assert_eq!(in_flight.headers()[GRPC_RETRY_PUSHBACK_MS], "2000");
    }
}
