//! Rejections: every answer the layer gives instead of the handler's, as RFC 9457 problem+json
//! (to a gRPC client, in gRPC's own form: see `grpc.rs`).

use std::io::Write as _;
use std::time::Duration;

use bytes::Bytes;
use http::header::{HeaderName, HeaderValue, CONTENT_TYPE, RETRY_AFTER};
use http::{Response, StatusCode};

use crate::http::grpc::{
    base64, code, percent_encode, proto, GRPC_MESSAGE, GRPC_RETRY_PUSHBACK_MS, GRPC_STATUS,
    GRPC_STATUS_DETAILS,
};
use crate::http::response_body::ResponseBody;
use crate::key::KeyError;
use crate::reconciliation::NotStored;
use crate::telemetry::RejectionKind;

const TYPE_BASE: &str =
    "https://docs.rs/tower-idempotency/latest/tower_idempotency/enum.Rejection.html#variant.";

/// The default key header.
const KEY_HEADER: HeaderName = HeaderName::from_static("idempotency-key");

/// Why the layer answered instead of the handler.
///
/// Each rejection is sent as an RFC 9457 `application/problem+json` document whose `type` is
/// stable per variant (`…/enum.Rejection.html#variant.<Name>`), and the value itself is put in the
/// response's extensions, so outer layers (metrics, logging) can match on it. A gRPC call (a
/// request whose `Content-Type` is `application/grpc…`) gets it as gRPC clients read errors
/// instead: see [`grpc_code`](Rejection::grpc_code) and
/// [`into_grpc_response`](Rejection::into_grpc_response).
///
/// ```
/// use http::StatusCode;
/// use tower_idempotency::Rejection;
///
/// assert_eq!(Rejection::MissingKey.status(), StatusCode::BAD_REQUEST);
/// assert!(Rejection::MissingKey.problem_type().ends_with("#variant.MissingKey"));
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum Rejection {
    /// 400: the route requires an `Idempotency-Key` and none was sent.
    MissingKey,
    /// 400: the `Idempotency-Key` is not a valid key.
    InvalidKey(KeyError),
    /// 413: the request body is larger than the layer buffers.
    BodyTooLarge {
        /// The configured limit in bytes.
        limit: usize,
    },
    /// 400: the request body could not be read (the client went away mid-upload, say).
    BodyUnreadable,
    /// 409 with `Retry-After`: a request with this key is still running. Retry with the same key.
    InFlight {
        /// Whole seconds until the running request's lease ends (at least 1).
        retry_after: Duration,
    },
    /// 409 by default (422 per the IETF draft, configurable): the key was used with a different
    /// request. Do not retry; send a new key for a new request.
    Mismatch {
        /// The status sent.
        status: StatusCode,
    },
    /// The status of [`Mismatch`](Rejection::Mismatch): the key's record was stored under
    /// another fingerprint policy than the endpoint's now (its policy changed since, during a
    /// roll-out say, or the key was used on an endpoint with another policy), so this request
    /// cannot be compared with the stored one. Nothing was replayed or run; the operation ran
    /// once under that key. Do not send it again under a new key without knowing that it must
    /// run again: look its outcome up by other means.
    PolicyMismatch {
        /// The status sent.
        status: StatusCode,
    },
    /// 503 with `Retry-After`: the store did not answer; nothing was run.
    StoreUnavailable,
    /// 500: the store holds something at this key that cannot be read; nothing was run.
    /// An operator can inspect and purge the key.
    UnreadableRecord,
    /// 503 with `Retry-After`: the layer is shutting down or at its bound on running requests;
    /// nothing was claimed.
    Overloaded,
    /// 500: the handler panicked. The key was released, so a retry runs it again.
    HandlerPanicked,
    /// 500: a scope function is configured but gave no scope for this request (is the layer
    /// placed before authentication?). Nothing was run.
    MissingScope,
    /// 409 by default (configurable): a request with this key already ran, but its response
    /// could not be stored (too large, its body failed, or the handler timed out). The key is
    /// kept for its retention period so the operation never runs twice; do not retry it.
    ResponseNotStored {
        /// The status sent.
        status: StatusCode,
        /// Why the response was not stored.
        why: NotStored,
    },
    /// 504: the handler gave no response within the layer's handler timeout and was cancelled.
    /// Whether it had done its work is unknown, so its key is kept as not replayable (a retry
    /// gets [`ResponseNotStored`](Rejection::ResponseNotStored)) unless the layer releases such
    /// keys.
    HandlerTimedOut {
        /// The timeout.
        after: Duration,
    },
    /// 501: the request carries an idempotency key, but its method and path match no endpoint
    /// of a [`PolicyLayer`](crate::PolicyLayer) that refuses such requests
    /// ([`with_refuse_unmatched`](crate::PolicyLayer::with_refuse_unmatched)), so it would run
    /// unprotected. Nothing was run. The server's policy does not cover this route (or the path
    /// is spelled otherwise than its pattern); a retry gets the same answer.
    NoEndpoint,
}

impl Rejection {
    /// The `kind` label this rejection is counted under.
    pub(crate) fn kind(&self) -> RejectionKind {
        match self {
            Rejection::MissingKey => RejectionKind::MissingKey,
            Rejection::InvalidKey(_) => RejectionKind::InvalidKey,
            Rejection::BodyTooLarge { .. } => RejectionKind::BodyTooLarge,
            Rejection::BodyUnreadable => RejectionKind::BodyUnreadable,
            Rejection::InFlight { .. } => RejectionKind::InFlight,
            Rejection::Mismatch { .. } => RejectionKind::Mismatch,
            Rejection::PolicyMismatch { .. } => RejectionKind::PolicyMismatch,
            Rejection::StoreUnavailable => RejectionKind::StoreUnavailable,
            Rejection::UnreadableRecord => RejectionKind::UnreadableRecord,
            Rejection::Overloaded => RejectionKind::Overloaded,
            Rejection::HandlerPanicked => RejectionKind::HandlerPanicked,
            Rejection::MissingScope => RejectionKind::MissingScope,
            Rejection::ResponseNotStored { .. } => RejectionKind::ResponseNotStored,
            Rejection::HandlerTimedOut { .. } => RejectionKind::HandlerTimedOut,
            Rejection::NoEndpoint => RejectionKind::NoEndpoint,
        }
    }

    /// The status this rejection is sent with.
    pub fn status(&self) -> StatusCode {
        self.statuses().0
    }

    /// The HTTP status and the `grpc-status` of this rejection, side by side (the table of
    /// [`grpc_code`](Rejection::grpc_code)).
    fn statuses(&self) -> (StatusCode, i32) {
        use StatusCode as S;
        match self {
            Rejection::MissingKey | Rejection::InvalidKey(_) => (S::BAD_REQUEST, code::INVALID_ARGUMENT),
            Rejection::BodyTooLarge { .. } => (S::PAYLOAD_TOO_LARGE, code::RESOURCE_EXHAUSTED),
            // The request stream did not arrive whole: nearly always a client that went away,
            // which gRPC servers report as CANCELLED.
            Rejection::BodyUnreadable => (S::BAD_REQUEST, code::CANCELLED),
            Rejection::InFlight { .. } => (S::CONFLICT, code::ABORTED),
            Rejection::Mismatch { status } | Rejection::PolicyMismatch { status } => (*status, code::ABORTED),
            Rejection::StoreUnavailable | Rejection::Overloaded => {
                (S::SERVICE_UNAVAILABLE, code::UNAVAILABLE)
            }
            Rejection::UnreadableRecord | Rejection::HandlerPanicked | Rejection::MissingScope => {
                (S::INTERNAL_SERVER_ERROR, code::INTERNAL)
            }
            // The call ran and will not run again under this key until an operator purges it.
            Rejection::ResponseNotStored { status, .. } => (*status, code::FAILED_PRECONDITION),
            Rejection::HandlerTimedOut { .. } => (S::GATEWAY_TIMEOUT, code::DEADLINE_EXCEEDED),
            // The method is not offered with idempotency here, as HTTP's 501 says.
            Rejection::NoEndpoint => (S::NOT_IMPLEMENTED, code::UNIMPLEMENTED),
        }
    }

    /// The variant's name: its metric label, and the end of its problem type.
    pub(crate) fn name(&self) -> &'static str {
        RejectionKind::LABELS[self.kind() as usize]
    }

    /// The problem document's `type` URI.
    pub fn problem_type(&self) -> String {
        format!("{TYPE_BASE}{}", self.name())
    }

    /// The problem document's `title`: fixed per kind.
    pub fn title(&self) -> &'static str {
        match self {
            Rejection::MissingKey => "Idempotency key required",
            Rejection::InvalidKey(_) => "Invalid idempotency key",
            Rejection::BodyTooLarge { .. } => "Request body too large",
            Rejection::BodyUnreadable => "Request body unreadable",
            Rejection::InFlight { .. } => "Request with this Idempotency-Key is in progress",
            Rejection::Mismatch { .. } => "Idempotency-Key reused with a different request",
            Rejection::PolicyMismatch { .. } => "Idempotency-Key stored under another fingerprint policy",
            Rejection::StoreUnavailable => "Idempotency store unavailable",
            Rejection::UnreadableRecord => "Stored record unreadable",
            Rejection::Overloaded => "Too many requests in progress",
            Rejection::HandlerPanicked => "Internal server error",
            Rejection::MissingScope => "Idempotency scope unavailable",
            Rejection::ResponseNotStored { .. } => "Response to this Idempotency-Key was not stored",
            Rejection::HandlerTimedOut { .. } => "Request timed out",
            Rejection::NoEndpoint => "No idempotent endpoint for this request",
        }
    }

    /// The problem document's `detail`: what happened and what the client should do. Key
    /// problems name the `Idempotency-Key` header; the layer names the header it is configured
    /// to read.
    pub fn detail(&self) -> String {
        self.detail_for(&KEY_HEADER)
    }

    /// The detail, naming the layer's configured key header.
    pub(crate) fn detail_for(&self, key_header: &HeaderName) -> String {
        let key_header = match key_header.as_str() {
            // As the IETF draft spells it (header names arrive lower-cased).
            "idempotency-key" => "Idempotency-Key",
            configured => configured,
        };
        match self {
            Rejection::MissingKey => format!("This endpoint requires an {key_header} header."),
            Rejection::InvalidKey(error) => {
                format!("{key_header}: {error}. Send 1 to 255 visible ASCII characters.")
            }
            Rejection::BodyTooLarge { limit } => format!("The request body exceeds {limit} bytes."),
            Rejection::BodyUnreadable => "The request body could not be read in full.".into(),
            Rejection::InFlight { retry_after } => format!(
                "A request with this Idempotency-Key is still being processed. Retry with the same key in {} s.",
                retry_after.as_secs()
            ),
            Rejection::Mismatch { .. } => "This Idempotency-Key was used with a different request \
                (method, host, path, query, Content-Type or body). Use a new key for a new request."
                .into(),
            Rejection::PolicyMismatch { .. } => "A request with this Idempotency-Key was processed under \
                another fingerprint policy (the server changed which parts of a request count), so this \
                request cannot be compared with it, and its response is not replayed. It will not be \
                processed again with this key: look up its outcome, and use a new key only for a \
                request that must run again."
                .into(),
            Rejection::StoreUnavailable => {
                "The idempotency store did not answer; the request was not processed. Retry with the same key.".into()
            }
            Rejection::UnreadableRecord => {
                "The stored record for this Idempotency-Key cannot be read; the request was not processed.".into()
            }
            Rejection::Overloaded => {
                "The server is at capacity or shutting down; the request was not processed. Retry with the same key."
                    .into()
            }
            Rejection::HandlerPanicked => {
                "The request failed and was not stored; it may be retried with the same key.".into()
            }
            Rejection::MissingScope => "The request has no idempotency scope; it was not processed.".into(),
            Rejection::ResponseNotStored { why, .. } => format!(
                "A request with this Idempotency-Key was already processed, but its response was not \
                 stored ({why}). It will not be processed again with this key: look up its outcome, \
                 and use a new key only for a request that must run again."
            ),
            Rejection::HandlerTimedOut { after } => format!(
                "The request was not answered within {} s and was cancelled; whether it took effect \
                 is unknown.",
                after.as_secs()
            ),
            Rejection::NoEndpoint => format!(
                "This server honours an {key_header} on none of its endpoints for this method and \
                 path, so the request was refused rather than run unprotected; it was not processed."
            ),
        }
    }

    /// The problem document's `key_state`: what the server holds for the key, so a client can
    /// decide without reading `detail` (the table for API-client authors is in the guide
    /// [for API clients](crate::guide::api_clients)).
    ///
    /// | `key_state` | rejections |
    /// |---|---|
    /// | `in_flight` | `InFlight` |
    /// | `mismatch` | `Mismatch` |
    /// | `policy_mismatch` | `PolicyMismatch` |
    /// | `not_replayable` | `ResponseNotStored`, `HandlerTimedOut` (its key kept) |
    /// | `released` | `HandlerPanicked`, `HandlerTimedOut` on a layer that releases such keys |
    /// | `store_unavailable` | `StoreUnavailable` |
    /// | `unreadable` | `UnreadableRecord` |
    /// | `not_claimed` | `BodyTooLarge`, `BodyUnreadable`, `Overloaded`, `MissingScope`, `NoEndpoint` |
    /// | `absent` / `invalid` | `MissingKey` / `InvalidKey` |
    ///
    /// ```
    /// use std::time::Duration;
    /// use tower_idempotency::Rejection;
    /// let running = Rejection::InFlight { retry_after: Duration::from_secs(3) };
    /// assert_eq!((running.key_state(), running.retryable()), ("in_flight", true));
    /// ```
    pub fn key_state(&self) -> &'static str {
        self.key_state_given(false).0
    }

    /// The problem document's `retryable`: whether sending the same request with the same key
    /// again, later, can succeed (after `retry_after` seconds where the document has it). `false`
    /// means the request as sent will not: change it, or its key, or ask a person.
    pub fn retryable(&self) -> bool {
        self.key_state_given(false).1
    }

    /// The key's state and whether a retry can succeed, `key_released` telling whether the
    /// layer released the key of a handler that timed out (`with_release_not_stored`), which
    /// only the layer knows.
    fn key_state_given(&self, key_released: bool) -> (&'static str, bool) {
        match self {
            Rejection::MissingKey => ("absent", false),
            Rejection::InvalidKey(_) => ("invalid", false),
            Rejection::InFlight { .. } => ("in_flight", true),
            Rejection::Mismatch { .. } => ("mismatch", false),
            Rejection::PolicyMismatch { .. } => ("policy_mismatch", false),
            Rejection::StoreUnavailable => ("store_unavailable", true),
            Rejection::UnreadableRecord => ("unreadable", false),
            Rejection::HandlerPanicked => ("released", true),
            Rejection::HandlerTimedOut { .. } if key_released => ("released", true),
            Rejection::ResponseNotStored { .. } | Rejection::HandlerTimedOut { .. } => {
                ("not_replayable", false)
            }
            Rejection::BodyUnreadable | Rejection::Overloaded => ("not_claimed", true),
            Rejection::BodyTooLarge { .. } | Rejection::MissingScope | Rejection::NoEndpoint => {
                ("not_claimed", false)
            }
        }
    }

    pub(crate) fn retry_after_seconds(&self) -> Option<u64> {
        match self {
            Rejection::InFlight { retry_after } => Some(retry_after.as_secs().max(1)),
            Rejection::StoreUnavailable | Rejection::Overloaded => Some(1),
            _ => None,
        }
    }

    /// The whole response: status, `Content-Type: application/problem+json`, `Retry-After` where
    /// a retry makes sense, the JSON body, and `self` in the extensions.
    pub fn into_response<B>(self) -> Response<ResponseBody<B>> {
        crate::telemetry::rejection(self.kind(), None);
        self.into_problem_response(&KEY_HEADER, false)
    }

    /// The problem+json response; `key_released`: see [`key_state_given`](Self::key_state_given).
    fn into_problem_response<B>(
        self,
        key_header: &HeaderName,
        key_released: bool,
    ) -> Response<ResponseBody<B>> {
        let status = self.status();
        let detail = self.detail_for(key_header);
        // Members in RFC 9457's order, written into one buffer: a retry storm on a key in flight
        // is answered with these, and every allocation made here on one worker thread and freed
        // on the other after the write can take the lock of a malloc arena both threads use.
        let (name, title) = (self.name(), self.title());
        let mut body = Vec::with_capacity(128 + TYPE_BASE.len() + name.len() + title.len() + detail.len());
        body.extend_from_slice(b"{\"type\":\"");
        // Both parts are fixed ASCII with nothing to escape (a test checks every kind).
        body.extend_from_slice(TYPE_BASE.as_bytes());
        body.extend_from_slice(name.as_bytes());
        body.extend_from_slice(b"\",\"title\":");
        push_json_string(&mut body, title);
        body.extend_from_slice(b",\"status\":");
        body.extend_from_slice(status.as_str().as_bytes());
        body.extend_from_slice(b",\"detail\":");
        push_json_string(&mut body, &detail);
        // Extension members (RFC 9457 section 3.2), after the standard ones so that a client
        // that compared the document's start keeps working: fixed ASCII, nothing to escape.
        let (key_state, retryable) = self.key_state_given(key_released);
        body.extend_from_slice(b",\"key_state\":\"");
        body.extend_from_slice(key_state.as_bytes());
        body.extend_from_slice(b"\",\"retryable\":");
        body.extend_from_slice(if retryable { b"true" } else { b"false" });
        let retry_after = self.retry_after_seconds();
        if let Some(seconds) = retry_after {
            body.extend_from_slice(b",\"retry_after\":");
            // Into the buffer itself: writing to a `Vec` cannot fail.
            let _ = write!(body, "{seconds}");
        }
        body.push(b'}');
        let mut response = Response::new(ResponseBody::full(Bytes::from(body)));
        *response.status_mut() = status;
        let headers = response.headers_mut();
        headers.insert(CONTENT_TYPE, HeaderValue::from_static("application/problem+json"));
        if let Some(seconds) = retry_after {
            headers.insert(RETRY_AFTER, HeaderValue::from(seconds));
        }
        response.extensions_mut().insert(self);
        response
    }

    /// The rejection in the client's protocol: gRPC for a gRPC call (see
    /// [`into_grpc_response`](Rejection::into_grpc_response)), problem+json otherwise; counted
    /// under the layer's metrics name, if it has one.
    pub(crate) fn respond<B>(
        self,
        key_header: &HeaderName,
        grpc: bool,
        named: Option<&crate::telemetry::Named>,
    ) -> Response<ResponseBody<B>> {
        self.respond_released(key_header, grpc, named, false)
    }

    /// [`respond`](Self::respond), for a rejection whose key the layer released
    /// (`key_released`) where it is kept by default (a handler that timed out).
    pub(crate) fn respond_released<B>(
        self,
        key_header: &HeaderName,
        grpc: bool,
        named: Option<&crate::telemetry::Named>,
        key_released: bool,
    ) -> Response<ResponseBody<B>> {
        crate::telemetry::rejection(self.kind(), named);
        if grpc {
            self.into_grpc_response_naming(key_header)
        } else {
            self.into_problem_response(key_header, key_released)
        }
    }

    /// The `grpc-status` this rejection is sent with to a gRPC client (a request whose
    /// `Content-Type` is `application/grpc…`): the code of `google.rpc.Code`, which
    /// `tonic::Code::from_i32` reads.
    ///
    /// | rejection | `grpc-status` |
    /// |---|---|
    /// | `MissingKey`, `InvalidKey` | 3 `INVALID_ARGUMENT` |
    /// | `BodyTooLarge` | 8 `RESOURCE_EXHAUSTED` |
    /// | `BodyUnreadable` | 1 `CANCELLED` |
    /// | `InFlight`, `Mismatch`, `PolicyMismatch` | 10 `ABORTED` |
    /// | `StoreUnavailable`, `Overloaded` | 14 `UNAVAILABLE` |
    /// | `UnreadableRecord`, `HandlerPanicked`, `MissingScope` | 13 `INTERNAL` |
    /// | `ResponseNotStored` | 9 `FAILED_PRECONDITION` |
    /// | `HandlerTimedOut` | 4 `DEADLINE_EXCEEDED` |
    /// | `NoEndpoint` | 12 `UNIMPLEMENTED` |
    ///
    /// ```
    /// use tower_idempotency::Rejection;
    ///
    /// assert_eq!(Rejection::MissingKey.grpc_code(), 3); // INVALID_ARGUMENT
    /// assert_eq!(Rejection::StoreUnavailable.grpc_code(), 14); // UNAVAILABLE
    /// ```
    pub fn grpc_code(&self) -> i32 {
        self.statuses().1
    }

    /// The rejection as a gRPC client reads it: a trailers-only response (HTTP 200,
    /// `content-type: application/grpc`, no body) whose `grpc-status` is
    /// [`grpc_code`](Rejection::grpc_code) and whose `grpc-message` is the
    /// [`detail`](Rejection::detail), percent-encoded as the gRPC spec asks; where a retry makes
    /// sense, `grpc-retry-pushback-ms` (read by gRPC clients with a retry policy) and
    /// `retry-after`. `self` is in the extensions.
    ///
    /// The kind is machine-readable in `grpc-status-details-bin`, gRPC's rich error model (what
    /// `tonic_types::StatusExt::get_error_details` reads): a `google.rpc.Status` with a
    /// `google.rpc.ErrorInfo` whose `domain` is `tower-idempotency`, whose `reason` is the
    /// variant's name in upper snake case (`IN_FLIGHT`, `MISMATCH`, `MISSING_KEY`...) and whose
    /// `metadata["type"]` is the problem type URI; and, where a retry makes sense, a
    /// `google.rpc.RetryInfo` with the delay.
    ///
    /// ```
    /// use tower_idempotency::Rejection;
    ///
    /// let response = Rejection::MissingKey.into_grpc_response::<http_body_util::Empty<bytes::Bytes>>();
    /// assert_eq!(response.status(), 200);
    /// assert_eq!(response.headers()["content-type"], "application/grpc");
    /// assert_eq!(response.headers()["grpc-status"], "3");
    /// assert!(response.extensions().get::<Rejection>().is_some());
    /// ```
    pub fn into_grpc_response<B>(self) -> Response<ResponseBody<B>> {
        self.into_grpc_response_naming(&KEY_HEADER)
    }

    pub(crate) fn into_grpc_response_naming<B>(self, key_header: &HeaderName) -> Response<ResponseBody<B>> {
        let mut response = Response::new(ResponseBody::full(Bytes::new()));
        let headers = response.headers_mut();
        headers.insert(CONTENT_TYPE, HeaderValue::from_static("application/grpc"));
        headers.insert(GRPC_STATUS, HeaderValue::from(self.grpc_code()));
        let message_text = self.detail_for(key_header);
        let message = percent_encode(message_text.as_bytes());
        // Percent-encoding leaves only visible ASCII and spaces, which a header value always takes.
        if let Ok(message) = HeaderValue::from_maybe_shared(message) {
            headers.insert(GRPC_MESSAGE, message);
        }
        let retry_after = self.retry_after_seconds();
        if let Some(seconds) = retry_after {
            headers.insert(
                GRPC_RETRY_PUSHBACK_MS,
                HeaderValue::from(seconds.saturating_mul(1000)),
            );
            headers.insert(http::header::RETRY_AFTER, HeaderValue::from(seconds));
        }
        let details = base64(&self.status_details(&message_text, retry_after));
        // Base64 is visible ASCII.
        if let Ok(details) = HeaderValue::from_maybe_shared(details) {
            headers.insert(GRPC_STATUS_DETAILS, details);
        }
        response.extensions_mut().insert(self);
        response
    }

    /// The `google.rpc.Status` of this rejection, protobuf-encoded (see
    /// [`into_grpc_response`](Rejection::into_grpc_response)).
    fn status_details(&self, message: &str, retry_after: Option<u64>) -> Bytes {
        let mut reason = String::new();
        for (i, c) in self.name().char_indices() {
            if c.is_ascii_uppercase() && i > 0 {
                reason.push('_');
            }
            reason.push(c.to_ascii_uppercase());
        }
        let mut type_entry = Vec::new();
        proto::string(&mut type_entry, 1, "type");
        proto::string(&mut type_entry, 2, &self.problem_type());
        let mut error_info = Vec::new();
        proto::string(&mut error_info, 1, &reason);
        proto::string(&mut error_info, 2, "tower-idempotency");
        proto::bytes(&mut error_info, 3, &type_entry);
        let mut status = Vec::new();
        // Every code is small and positive: its int32 varint is its u64 varint.
        proto::varint_field(&mut status, 1, self.grpc_code().unsigned_abs().into());
        proto::string(&mut status, 2, message);
        proto::bytes(&mut status, 3, &proto::any("google.rpc.ErrorInfo", &error_info));
        if let Some(seconds) = retry_after {
            let mut delay = Vec::new();
            proto::varint_field(&mut delay, 1, seconds);
            let mut retry_info = Vec::new();
            proto::bytes(&mut retry_info, 1, &delay);
            proto::bytes(&mut status, 3, &proto::any("google.rpc.RetryInfo", &retry_info));
        }
        Bytes::from(status)
    }
}

/// Appends `text` as a JSON string, quoted and escaped by serde_json.
fn push_json_string(buffer: &mut Vec<u8>, text: &str) {
    // Serializing a `str` into a `Vec` has no way to fail (no I/O error, no map key to reject).
    let written = serde_json::to_writer(&mut *buffer, text);
    debug_assert!(written.is_ok(), "a str written to a Vec");
}

#[cfg(test)]
mod tests {
    use super::*;

    fn every_kind() -> Vec<Rejection> {
        vec![
            Rejection::MissingKey,
            Rejection::InvalidKey(KeyError::TooLong { len: 300 }),
            Rejection::BodyTooLarge { limit: 1024 },
            Rejection::BodyUnreadable,
            Rejection::InFlight {
                retry_after: Duration::from_secs(7),
            },
            Rejection::Mismatch {
                status: StatusCode::UNPROCESSABLE_ENTITY,
            },
            Rejection::PolicyMismatch {
                status: StatusCode::CONFLICT,
            },
            Rejection::StoreUnavailable,
            Rejection::UnreadableRecord,
            Rejection::Overloaded,
            Rejection::HandlerPanicked,
            Rejection::MissingScope,
            Rejection::ResponseNotStored {
                status: StatusCode::CONFLICT,
                why: NotStored::TooLarge,
            },
            Rejection::HandlerTimedOut {
                after: Duration::from_secs(60),
            },
            Rejection::NoEndpoint,
        ]
    }

    #[tokio::test]
    async fn every_problem_document_is_json_with_its_members_in_order() {
        use http_body_util::BodyExt;
        let header = HeaderName::from_static("x-request-key");
        for rejection in every_kind() {
            let expected = serde_json::json!({
                "type": rejection.problem_type(),
                "title": rejection.title(),
                "status": rejection.status().as_u16(),
                "detail": rejection.detail_for(&header),
                "key_state": rejection.key_state(),
                "retryable": rejection.retryable(),
            });
            let mut expected = expected;
            if let Some(seconds) = rejection.retry_after_seconds() {
                expected["retry_after"] = seconds.into();
            }
            let response = rejection
                .clone()
                .into_problem_response::<http_body_util::Empty<Bytes>>(&header, false);
            let Ok(collected) = response.into_body().collect().await else {
                panic!("{rejection:?}: the body failed");
            };
            let body = collected.to_bytes();
            let parsed: serde_json::Value = serde_json::from_slice(&body)
                .unwrap_or_else(|error| panic!("{rejection:?}: {error}: {body:?}"));
            assert_eq!(parsed, expected, "{rejection:?}");
            assert!(body.starts_with(b"{\"type\":"), "RFC 9457's order: {body:?}");
            let position_of = |member: &str| body.windows(member.len()).position(|w| w == member.as_bytes());
            let order = [
                "\"type\":",
                "\"title\":",
                "\"status\":",
                "\"detail\":",
                "\"key_state\":",
            ]
            .map(position_of);
            assert!(
                order.windows(2).all(|pair| pair[0] < pair[1]),
                "{rejection:?}: {body:?}"
            );
        }
    }

    /// One table names the rejections (`RejectionKind::LABELS`, indexed by kind): each name must
    /// be its variant's, as `Debug` spells it.
    #[test]
    fn each_rejection_is_named_after_its_variant() {
        for rejection in every_kind() {
            let debug = format!("{rejection:?}");
            assert_eq!(Some(rejection.name()), debug.split([' ', '(']).next());
        }
    }

    #[test]
    fn json_strings_are_escaped() {
        let mut buffer = b"x".to_vec();
        push_json_string(&mut buffer, "a \"quoted\" \\ path\n\u{1}é");
        assert_eq!(buffer, "x\"a \\\"quoted\\\" \\\\ path\\n\\u0001é\"".as_bytes());
    }
}
