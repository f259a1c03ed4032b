//! What the layer did with a request, in its response's extensions for the layers outside.

use http::Response;

use crate::telemetry::Outcome;

/// What the layer did with a keyed request: put in the extensions of every response it hands
/// on for one (the handler's, a replay, a rejection), so that a layer outside it (tower-http's
/// `TraceLayer`, a metrics layer, a log line) can label by it without parsing headers.
///
/// Its [`as_str`](Self::as_str) is the `outcome` label of `idempotency_requests_total` and the
/// `outcome` field of the request span. A rejection also carries its [`Rejection`](crate::Rejection)
/// (why, and what the client is told) in the same extensions. A request the layer let pass
/// untouched (no key where none is required, a method it does not guard) carries none.
///
/// ```
/// # use std::convert::Infallible;
/// # use bytes::Bytes;
/// # use http::{Request, Response};
/// # use http_body_util::Full;
/// use tower::{Service, ServiceBuilder, ServiceExt};
/// use tower_idempotency::{IdempotencyLayer, MemoryStore, RequestBody, RequestOutcome};
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() {
/// let mut service = ServiceBuilder::new()
///     .layer(IdempotencyLayer::new(MemoryStore::new()))
///     .service_fn(|_: Request<RequestBody<Full<Bytes>>>| async {
///         Ok::<_, Infallible>(Response::new(Full::from("done")))
///     });
/// let request = || Request::post("/orders").header("idempotency-key", "k1").body(Full::from("{}")).unwrap();
/// let first = service.ready().await.unwrap().call(request()).await.unwrap();
/// let retry = service.ready().await.unwrap().call(request()).await.unwrap();
/// assert_eq!(first.extensions().get(), Some(&RequestOutcome::Executed));
/// assert_eq!(retry.extensions().get::<RequestOutcome>().map(|o| o.as_str()), Some("replayed"));
/// # }
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum RequestOutcome {
    /// The key was claimed and the handler ran (its response; or the layer's 500 or 504 if it
    /// panicked or timed out, with that [`Rejection`](crate::Rejection)).
    Executed,
    /// The stored response was replayed; the handler did not run.
    Replayed,
    /// Another request holds the key: 409 with `Retry-After` (or a record of a newer release).
    InFlight,
    /// The key was used with a different request.
    Mismatch,
    /// The key's record was stored under another fingerprint policy: the two requests cannot
    /// be compared, and nothing was replayed or run.
    PolicyMismatch,
    /// The key ran before, but its response was not stored: it is not replayable.
    NotStored,
    /// Refused before the store was asked: no key, an invalid key, no scope, a body too large
    /// or unreadable, no endpoint.
    Rejected,
    /// The store failed or timed out: 503, nothing run.
    StoreError,
    /// The store refused the claim on purpose during a failover, or its replicas did not
    /// acknowledge it: 503, nothing run.
    Fenced,
    /// The store failed and the handler ran unprotected (`with_fail_open(true)`).
    FailOpen,
    /// At the bound on running requests, or shutting down: 503, nothing claimed.
    Overloaded,
    /// The record at the key cannot be read: 500, nothing run.
    Unreadable,
}

impl RequestOutcome {
    /// The outcome's name, as metrics and the request span spell it: `executed`, `replayed`,
    /// `in_flight`, `mismatch`, `policy_mismatch`, `not_stored`, `rejected`, `store_error`, `fenced`,
    /// `fail_open`, `overloaded`, `unreadable`.
    pub fn as_str(self) -> &'static str {
        self.counted().as_str()
    }

    /// The outcome as it is counted; one table, so the two spellings cannot drift apart.
    fn counted(self) -> Outcome {
        match self {
            RequestOutcome::Executed => Outcome::Executed,
            RequestOutcome::Replayed => Outcome::Replayed,
            RequestOutcome::InFlight => Outcome::InFlight,
            RequestOutcome::Mismatch => Outcome::Mismatch,
            RequestOutcome::PolicyMismatch => Outcome::PolicyMismatch,
            RequestOutcome::NotStored => Outcome::NotStored,
            RequestOutcome::Rejected => Outcome::Rejected,
            RequestOutcome::StoreError => Outcome::StoreError,
            RequestOutcome::Fenced => Outcome::Fenced,
            RequestOutcome::FailOpen => Outcome::FailOpen,
            RequestOutcome::Overloaded => Outcome::Overloaded,
            RequestOutcome::Unreadable => Outcome::Unreadable,
        }
    }

    /// The outcome a request ended with, if `counted` is one (`Waited` is counted besides).
    fn of(counted: Outcome) -> Option<Self> {
        const ALL: [RequestOutcome; 12] = [
            RequestOutcome::Executed,
            RequestOutcome::Replayed,
            RequestOutcome::InFlight,
            RequestOutcome::Mismatch,
            RequestOutcome::PolicyMismatch,
            RequestOutcome::NotStored,
            RequestOutcome::Rejected,
            RequestOutcome::StoreError,
            RequestOutcome::Fenced,
            RequestOutcome::FailOpen,
            RequestOutcome::Overloaded,
            RequestOutcome::Unreadable,
        ];
        ALL.into_iter().find(|outcome| outcome.counted() == counted)
    }
}

impl std::fmt::Display for RequestOutcome {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Puts `outcome` in `response`'s extensions.
pub(crate) fn mark<B>(mut response: Response<B>, outcome: Outcome) -> Response<B> {
    if let Some(outcome) = RequestOutcome::of(outcome) {
        response.extensions_mut().insert(outcome);
    }
    response
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_outcome_a_request_ends_with_has_a_public_twin_of_the_same_name() {
        for outcome in [
            Outcome::Executed,
            Outcome::Replayed,
            Outcome::InFlight,
            Outcome::Mismatch,
            Outcome::PolicyMismatch,
            Outcome::NotStored,
            Outcome::Rejected,
            Outcome::StoreError,
            Outcome::Fenced,
            Outcome::FailOpen,
            Outcome::Overloaded,
            Outcome::Unreadable,
        ] {
            let public = RequestOutcome::of(outcome).expect("a public twin");
            assert_eq!(public.as_str(), outcome.as_str());
        }
        assert_eq!(RequestOutcome::of(Outcome::Waited), None);
    }
}
