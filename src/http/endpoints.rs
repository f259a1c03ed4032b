//! [`PolicyLayer`]: one layer on a whole router, with settings per method and path.

use std::fmt;
use std::sync::Arc;
use std::task::{Context, Poll};

use bytes::Bytes;
use http::{HeaderName, Method, Request, Response};
use http_body::Body;
use tower_layer::Layer;
use tower_service::Service;

use crate::coordinator::ShutdownHandle;
use crate::http::body::{BoxError, RequestBody};
use crate::http::future::ResponseFuture;
use crate::http::grpc;
use crate::http::layer::IdempotencyLayer;
use crate::http::response::Rejection;
use crate::http::response_body::ResponseBody;
use crate::http::service::{self, call_with, Guarded};
use crate::http::unmatched::UnmatchedPaths;
use crate::telemetry::{self, RequestOutcome};

/// One layer for a whole router, each endpoint (method and path pattern) with its own settings:
/// the code form of a policy file (see `Policy`, feature `policy`).
///
/// A request whose method and path match an endpoint is handled with that endpoint's settings;
/// any other passes through untouched (add `"/*"` for a default). The path is the one this
/// layer sees: put it on the outermost router (`Router::layer` on the top-level router, or
/// around it), not inside a `nest`, which strips the nest's prefix.
///
/// **A keyed request that matches no endpoint is never silent.** One that carries a key (the
/// key header of the base layer or of any endpoint) with an unsafe method (not `GET`, `HEAD`,
/// `OPTIONS` or `TRACE`) and matches no endpoint is counted
/// (`idempotency_unmatched_requests_total`) and logged, once per path (up to 1 024 paths; past
/// that, counted only); it passes through unprotected, or is refused with
/// [`with_refuse_unmatched`](Self::with_refuse_unmatched). A request that matches no endpoint
/// only because of a trailing slash matches with
/// [`with_ignore_trailing_slash`](Self::with_ignore_trailing_slash).
///
/// Patterns are literal segments, `{name}` or `:name` for any one non-empty segment, and a
/// last segment `*` (or `{*name}`) for the rest of the path, empty or not: `/files/*` matches
/// `/files/` and `/files/a/b`, not `/files`. They are compared with the path as sent, before
/// percent-decoding; a trailing slash counts. **The most specific pattern wins**, whatever the
/// order of the endpoints: comparing segment by segment from the left, a literal beats a
/// parameter, which beats the wildcard. Two endpoints with the same pattern (parameter names
/// aside) and a method in common are refused when added, so no request can match two
/// endpoints equally.
///
/// Each endpoint's layer is a clone of the base layer adjusted by a function: clones share the
/// store, the bound on running requests (unless an endpoint sets its own `with_max_in_flight`)
/// and the shutdown, so [`shutdown_handle`](Self::shutdown_handle) covers them all, whatever
/// their settings.
///
/// ```
/// use std::time::Duration;
/// use http::{Method, StatusCode};
/// use tower_idempotency::{IdempotencyLayer, MemoryStore, PolicyLayer};
///
/// let policy = PolicyLayer::new(IdempotencyLayer::new(MemoryStore::new()))
///     .endpoint([Method::POST], "/payments", |layer| {
///         layer.with_retention(Duration::from_secs(7 * 24 * 3600))
///     })?
///     .endpoint([Method::POST], "/posts/{id}/comments", |layer| {
///         layer.with_key_required(false).with_mismatch_status(StatusCode::UNPROCESSABLE_ENTITY)
///     })?;
/// let app = axum::Router::<()>::new() /* .route(..) */ .layer(policy);
/// # let _ = app;
/// # Ok::<(), tower_idempotency::PolicyError>(())
/// ```
#[derive(Clone)]
pub struct PolicyLayer {
    base: IdempotencyLayer,
    endpoints: Arc<[Endpoint]>,
    /// The key headers of the base and of every endpoint: a request with one of them that
    /// matches no endpoint expected protection.
    key_headers: Arc<[HeaderName]>,
    refuse_unmatched: bool,
    ignore_trailing_slash: bool,
    /// Shared by clones, so that each path is logged once per policy.
    unmatched_paths: Arc<UnmatchedPaths>,
}

#[derive(Clone)]
struct Endpoint {
    methods: Vec<Method>,
    pattern: PathPattern,
    layer: IdempotencyLayer,
}

impl fmt::Debug for PolicyLayer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_list().entries(self.endpoints.iter()).finish()
    }
}

/// An endpoint as `Debug` and errors name it: its methods and its pattern.
impl fmt::Debug for Endpoint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:?} {}", self.methods, self.pattern.source)
    }
}

impl PolicyLayer {
    /// A policy with no endpoints yet, whose endpoints start from `base`'s settings.
    pub fn new(base: IdempotencyLayer) -> Self {
        let key_headers = Arc::from([base.config.key_header.clone()]);
        Self {
            base,
            endpoints: Arc::from(Vec::new()),
            key_headers,
            refuse_unmatched: false,
            ignore_trailing_slash: false,
            unmatched_paths: Arc::default(),
        }
    }

    /// Whether a request that carries a key but matches no endpoint is refused (default:
    /// `false`: it passes through unprotected, counted and logged). With `true` it gets 501
    /// [`Rejection::NoEndpoint`](crate::Rejection::NoEndpoint) (gRPC: `UNIMPLEMENTED`) and
    /// nothing runs: a client that sends a key is either protected or told, so a route the
    /// policy misses (a path spelled otherwise than its pattern, a prefix stripped by a `nest`)
    /// fails in testing rather than running unprotected in production. Requests without a key,
    /// with a safe method (`GET`, `HEAD`, `OPTIONS`, `TRACE`), or to gRPC's own services (see
    /// [`IdempotencyLayer::with_exempt_grpc_services`]) pass as before.
    ///
    /// ```
    /// # use http::Method;
    /// # use tower_idempotency::{IdempotencyLayer, MemoryStore, PolicyLayer};
    /// let policy = PolicyLayer::new(IdempotencyLayer::new(MemoryStore::new()))
    ///     .with_refuse_unmatched(true)
    ///     .endpoint([Method::POST], "/payments", |layer| layer)?;
    /// # let _ = policy;
    /// # Ok::<(), tower_idempotency::PolicyError>(())
    /// ```
    pub fn with_refuse_unmatched(mut self, refuse: bool) -> Self {
        self.refuse_unmatched = refuse;
        self
    }

    /// Whether a trailing slash is insignificant (default: `false`: `/payments/` does not match
    /// `/payments`, as a router tells them apart). With `true`, a request that matches no
    /// pattern as sent is matched again without its trailing slash, or with one added:
    /// `/payments/` gets the endpoint `/payments`, `/payments` the endpoint `/payments/`, and
    /// `/files` the endpoint `/files/*`. A pattern that matches the path as sent still wins,
    /// and a request that matches at once pays nothing more.
    ///
    /// ```
    /// # use http::Method;
    /// # use tower_idempotency::{IdempotencyLayer, MemoryStore, PolicyLayer};
    /// let policy = PolicyLayer::new(IdempotencyLayer::new(MemoryStore::new()))
    ///     .with_ignore_trailing_slash(true)
    ///     .endpoint([Method::POST], "/payments", |layer| layer)?;
    /// # let _ = policy;
    /// # Ok::<(), tower_idempotency::PolicyError>(())
    /// ```
    pub fn with_ignore_trailing_slash(mut self, ignore: bool) -> Self {
        self.ignore_trailing_slash = ignore;
        self
    }

    /// Adds an endpoint: requests with one of `methods` and a path matching `pattern` are
    /// handled by `configure(base.clone())`. Fails on a pattern that is not valid and on an
    /// endpoint with the same pattern and a method in common as an earlier one.
    pub fn endpoint(
        self,
        methods: impl IntoIterator<Item = Method>,
        pattern: &str,
        configure: impl FnOnce(IdempotencyLayer) -> IdempotencyLayer,
    ) -> Result<Self, PolicyError> {
        let pattern = PathPattern::parse(pattern)?;
        let layer = configure(self.base.clone());
        self.push_layer(methods.into_iter().collect(), pattern, layer)
    }

    /// Adds the endpoint of `methods` and `pattern`, handled by `layer`.
    pub(crate) fn push_layer(
        self,
        methods: Vec<Method>,
        pattern: PathPattern,
        layer: IdempotencyLayer,
    ) -> Result<Self, PolicyError> {
        let layer = layer.with_methods(methods.clone());
        let endpoint = Endpoint {
            methods,
            pattern,
            layer,
        };
        let mut endpoints = self.endpoints.to_vec();
        if let Some(earlier) = endpoints.iter().find(|earlier| {
            earlier.pattern.same_as(&endpoint.pattern)
                && earlier.methods.iter().any(|m| endpoint.methods.contains(m))
        }) {
            return Err(PolicyError::Duplicate {
                endpoint: format!("{endpoint:?}"),
                earlier: format!("{earlier:?}"),
            });
        }
        let mut key_headers = self.key_headers.to_vec();
        if !key_headers.contains(&endpoint.layer.config.key_header) {
            key_headers.push(endpoint.layer.config.key_header.clone());
        }
        endpoints.push(endpoint);
        // Most specific first, so that the first match is the most specific one. The sort is
        // stable, but no two endpoints that can match one request rank alike (see `same_as`).
        endpoints.sort_by(|a, b| b.pattern.rank.cmp(&a.pattern.rank));
        Ok(Self {
            endpoints: Arc::from(endpoints),
            key_headers: Arc::from(key_headers),
            ..self
        })
    }

    /// The base layer, as the endpoints' layers were cloned from it.
    pub fn base(&self) -> &IdempotencyLayer {
        &self.base
    }

    /// A handle to stop taking new keys and wait for running handlers, on every endpoint
    /// (see [`ShutdownHandle`]).
    pub fn shutdown_handle(&self) -> ShutdownHandle {
        self.base.shutdown_handle()
    }

    /// The layer for a request with this method and path, if an endpoint matches.
    fn select(&self, method: &Method, path: &str) -> Option<&IdempotencyLayer> {
        let find = |matches: fn(&PathPattern, &str) -> bool| {
            (self.endpoints.iter()).find(|e| e.methods.contains(method) && matches(&e.pattern, path))
        };
        let found = match find(PathPattern::matches) {
            None if self.ignore_trailing_slash => find(PathPattern::matches_but_trailing_slash),
            exact => exact,
        };
        found.map(|e| &e.layer)
    }

    /// What becomes of a request no endpoint matches: if it carries a key, it is counted and
    /// its path logged the first time; with `refuse_unmatched`, this is its refusal.
    fn unmatched<B, R>(&self, request: &Request<B>) -> Option<Response<ResponseBody<R>>> {
        let path = request.uri().path();
        let keyed = !request.method().is_safe()
            && self.key_headers.iter().any(|name| request.headers().contains_key(name))
            // An outer idempotency layer handles it already.
            && request.extensions().get::<Guarded>().is_none()
            && !(self.base.config.exempt_grpc_services && grpc::is_grpc_service(path));
        if !keyed {
            return None;
        }
        telemetry::unmatched();
        self.unmatched_paths
            .notice(request.method(), path, self.refuse_unmatched);
        if !self.refuse_unmatched {
            return None;
        }
        let named = self.base.coordinator.named();
        telemetry::outcome(RequestOutcome::Rejected, named);
        let grpc = grpc::is_grpc_request(request.headers());
        let rejection = Rejection::NoEndpoint.respond(&self.base.config.key_header, grpc, named);
        Some(service::mark(rejection, RequestOutcome::Rejected))
    }
}

impl<S> Layer<S> for PolicyLayer {
    type Service = PolicyService<S>;

    fn layer(&self, inner: S) -> Self::Service {
        PolicyService {
            inner,
            policy: self.clone(),
        }
    }
}

/// The middleware [`PolicyLayer`] builds.
#[derive(Clone, Debug)]
pub struct PolicyService<S> {
    inner: S,
    policy: PolicyLayer,
}

impl<S> PolicyService<S> {
    /// The wrapped service.
    pub fn get_ref(&self) -> &S {
        &self.inner
    }
}

impl<S, ReqBody, ResBody> Service<Request<ReqBody>> for PolicyService<S>
where
    S: Service<Request<RequestBody<ReqBody>>, Response = Response<ResBody>> + Clone + Send + 'static,
    S::Future: Send + 'static,
    S::Error: Send + 'static,
    ReqBody: Body<Data = Bytes> + Send + 'static,
    ResBody: Body<Data = Bytes, Error: Into<BoxError>> + Send + 'static,
{
    type Response = Response<ResponseBody<ResBody>>;
    type Error = S::Error;
    type Future = ResponseFuture<S::Future, ResBody, S::Error>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: Request<ReqBody>) -> Self::Future {
        if let Some(layer) = self.policy.select(request.method(), request.uri().path()) {
            return call_with(&mut self.inner, layer, request);
        }
        if let Some(refused) = self.policy.unmatched(&request) {
            return ResponseFuture::ready(refused);
        }
        ResponseFuture::passthrough(self.inner.call(request.map(RequestBody::streaming)))
    }
}

/// A path pattern, compiled once: literal segments, parameters and a trailing wildcard.
#[derive(Clone, Debug)]
pub(crate) struct PathPattern {
    pub(crate) source: Box<str>,
    segments: Box<[Segment]>,
    /// A trailing `*`: any rest of the path.
    rest: bool,
    /// For the most-specific-first order: per segment 2 (literal) or 1 (parameter), then 0 for
    /// a wildcard.
    rank: Box<[u8]>,
}

#[derive(Clone, Debug, PartialEq, Eq)]
enum Segment {
    Literal(Box<str>),
    Param,
}

impl PathPattern {
    pub(crate) fn parse(source: &str) -> Result<Self, PolicyError> {
        let bad = |reason: &str| PolicyError::Pattern {
            pattern: source.to_owned(),
            reason: reason.to_owned(),
        };
        let Some(path) = source.strip_prefix('/') else {
            return Err(bad("a path pattern starts with '/'"));
        };
        let mut segments = Vec::new();
        let mut rest = false;
        let mut parts = path.split('/').peekable();
        while let Some(part) = parts.next() {
            let last = parts.peek().is_none();
            if part == "*" || (part.starts_with("{*") && part.ends_with('}')) {
                if !last {
                    return Err(bad("the wildcard `*` must be the last segment"));
                }
                rest = true;
            } else if let Some(name) =
                (part.strip_prefix('{').and_then(|p| p.strip_suffix('}'))).or_else(|| part.strip_prefix(':'))
            {
                if name.is_empty() || !name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_') {
                    return Err(bad(
                        "a parameter is `{name}` or `:name`, the name of letters, digits and `_`",
                    ));
                }
                segments.push(Segment::Param);
            } else if part.contains(['{', '}', '*']) {
                return Err(bad(
                    "`{`, `}` and `*` are only allowed as a whole segment: `{name}`, `*` (last)",
                ));
            } else if part.contains(|c: char| c.is_ascii_whitespace() || c == '?' || c == '#') {
                return Err(bad("a path pattern has no spaces, query (`?`) or fragment (`#`)"));
            } else {
                segments.push(Segment::Literal(part.into()));
            }
        }
        let rank = segments
            .iter()
            .map(|s| match s {
                Segment::Literal(_) => 2,
                Segment::Param => 1,
            })
            .chain(rest.then_some(0))
            .collect();
        Ok(Self {
            source: source.into(),
            segments: segments.into(),
            rest,
            rank,
        })
    }

    /// Whether `path` (the request's, from its leading `/`) matches. No allocation.
    pub(crate) fn matches(&self, path: &str) -> bool {
        (path.strip_prefix('/')).is_some_and(|rest| self.matches_segments(rest.split('/')))
    }

    /// Whether `path` matches without its trailing slash, or with one added. No allocation.
    fn matches_but_trailing_slash(&self, path: &str) -> bool {
        // `/` alone is the root: no slash to take away, nor one to add.
        let Some(rest) = path.strip_prefix('/').filter(|rest| !rest.is_empty()) else {
            return false;
        };
        match rest.strip_suffix('/') {
            Some(trimmed) => self.matches_segments(trimmed.split('/')),
            None => self.matches_segments(rest.split('/').chain(std::iter::once(""))),
        }
    }

    /// Whether the segments of a path (what follows its leading `/`, split at each `/`)
    /// match: one per segment of the pattern, then none more, or, for a trailing wildcard, at
    /// least one more (empty or not: `/files/` has the empty one).
    fn matches_segments<'a>(&self, mut parts: impl Iterator<Item = &'a str>) -> bool {
        let each_fits = self.segments.iter().all(|segment| {
            parts.next().is_some_and(|part| match segment {
                Segment::Literal(literal) => part == &**literal,
                Segment::Param => !part.is_empty(),
            })
        });
        each_fits && parts.next().is_some() == self.rest
    }

    /// Whether the two patterns match the same paths.
    fn same_as(&self, other: &Self) -> bool {
        self.segments == other.segments && self.rest == other.rest
    }
}

/// Why a policy, or the file it was loaded from, was refused.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum PolicyError {
    /// A path pattern that is not valid.
    #[error("invalid path pattern {pattern:?}: {reason}")]
    Pattern {
        /// The pattern as written.
        pattern: String,
        /// What is wrong with it.
        reason: String,
    },
    /// Two endpoints with the same pattern and a method in common.
    #[error("endpoint {endpoint} repeats endpoint {earlier} (the same path pattern and a method in common)")]
    Duplicate {
        /// The later endpoint's methods and pattern.
        endpoint: String,
        /// The earlier one's.
        earlier: String,
    },
    /// The file could not be read.
    #[error("cannot read the policy file {path}: {source}")]
    Io {
        /// The file.
        path: String,
        /// Why.
        source: std::io::Error,
    },
    /// The file is not a valid policy: `origin:line:column: field: message`.
    #[error("{origin}{}: {field}: {message}", location(*line, *column))]
    Parse {
        /// The file name, or the format for a string.
        origin: String,
        /// Where in the document, as `idempotency.endpoints[1].ttl_override`.
        field: String,
        /// The line (from 1), when the format tells it.
        line: Option<usize>,
        /// The column (from 1), when the format tells it.
        column: Option<usize>,
        /// What is wrong.
        message: String,
    },
    /// A file whose format is not known from its extension, or whose format's crate feature is
    /// off.
    #[error("cannot load {path}: {reason}")]
    Format {
        /// The file.
        path: String,
        /// Why.
        reason: String,
    },
}

fn location(line: Option<usize>, column: Option<usize>) -> String {
    match (line, column) {
        (Some(line), Some(column)) => format!(":{line}:{column}"),
        (Some(line), None) => format!(":{line}"),
        _ => String::new(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pattern(source: &str) -> PathPattern {
        PathPattern::parse(source).unwrap()
    }

    /// Beyond `patterns_match_exactly_the_paths_they_describe` (policy.rs): a literal cut short
    /// or given a `/`, the spellings of a parameter and of a wildcard, the root.
    #[test]
    fn patterns_match_literals_parameters_and_a_trailing_wildcard() {
        let payments = pattern("/payments");
        assert!(!payments.matches("/payments/"));
        assert!(!payments.matches("/payment"));
        assert!(!payments.matches(""));

        let comments = pattern("/posts/{id}/comments");
        assert!(pattern("/posts/:id/comments").same_as(&comments));

        let files = pattern("/files/*");
        assert!(!files.matches("/files"));
        assert!(pattern("/files/{*rest}").same_as(&files));

        let everything = pattern("/*");
        for path in ["/", "/a", "/a/b/"] {
            assert!(everything.matches(path), "{path}");
        }
        let root = pattern("/");
        assert!(root.matches("/"));
        assert!(!root.matches("/a"));
    }

    #[test]
    fn a_trailing_slash_can_be_taken_away_or_added() {
        let loosely = |p: &str, path: &str| pattern(p).matches_but_trailing_slash(path);
        assert!(loosely("/payments", "/payments/"));
        assert!(loosely("/payments/", "/payments"));
        assert!(loosely("/posts/{id}", "/posts/7/"));
        assert!(loosely("/files/*", "/files"));
        assert!(!loosely("/payments", "/payments//"));
        assert!(!loosely("/payments", "/payment/"));
        assert!(!loosely("/posts/{id}", "/posts/"));
        assert!(!loosely("/", "/"), "the root matches as it is, or not at all");
        assert!(!loosely("/payments", "payments/"));
    }

    #[test]
    fn invalid_patterns_are_named() {
        for (source, reason) in [
            ("payments", "starts with '/'"),
            ("/files/*/x", "must be the last"),
            ("/a/{}", "a parameter is"),
            ("/a/{id", "only allowed as a whole segment"),
            ("/a/b*", "only allowed as a whole segment"),
            ("/a/:", "a parameter is"),
            ("/a?b=1", "no spaces, query"),
        ] {
            let error = PathPattern::parse(source).unwrap_err().to_string();
            assert!(
                error.contains(reason) && error.contains(source),
                "{source}: {error}"
            );
        }
    }

    #[test]
    fn the_most_specific_endpoint_wins_whatever_the_order() {
        let base = IdempotencyLayer::new(crate::MemoryStore::new());
        let patterns = [
            "/*",
            "/api/*",
            "/api/{version}/payments",
            "/api/v1/payments",
            "/api/v1/{resource}",
        ];
        let expect = [
            ("/api/v1/payments", "/api/v1/payments"),
            ("/api/v2/payments", "/api/{version}/payments"),
            ("/api/v1/refunds", "/api/v1/{resource}"),
            ("/api/v1/payments/1", "/api/*"),
            ("/health", "/*"),
        ];
        // Every order of adding gives the same choice.
        for rotation in 0..patterns.len() {
            let mut policy = PolicyLayer::new(base.clone());
            for i in 0..patterns.len() {
                let source = patterns[(i + rotation) % patterns.len()];
                policy = policy.endpoint([Method::POST], source, |l| l).unwrap();
            }
            for (path, winner) in expect {
                let chosen = policy
                    .endpoints
                    .iter()
                    .find(|e| e.pattern.matches(path))
                    .map(|e| &*e.pattern.source);
                assert_eq!(chosen, Some(winner), "{path} (rotation {rotation})");
            }
        }
    }

    /// An endpoint repeated is refused (tests/policy.rs, `an_endpoint_listed_twice_is_refused`);
    /// another method on the same pattern is another endpoint.
    #[test]
    fn another_method_on_a_pattern_is_another_endpoint() {
        let base = IdempotencyLayer::new(crate::MemoryStore::new());
        let policy = PolicyLayer::new(base)
            .endpoint([Method::POST], "/posts/{id}", |l| l)
            .unwrap();
        assert!(policy.endpoint([Method::PATCH], "/posts/:post", |l| l).is_ok());
    }
}
