//! [`PolicyLayer`]: one layer on a whole router, with settings per method and path.

use std::fmt;
use std::sync::Arc;
use std::task::{Context, Poll};

use bytes::Bytes;
use http::{Method, Request, Response};
use http_body::Body;
use tower_layer::Layer;
use tower_service::Service;

use crate::http::body::{BoxError, RequestBody, ResponseBody};
use crate::http::future::ResponseFuture;
use crate::http::service::call_with;
use crate::{IdempotencyLayer, ShutdownHandle};

/// One layer for a whole router, each endpoint (method and path pattern) with its own settings:
/// the code form of a policy file (see [`Policy`](crate::Policy), feature `policy`).
///
/// A request whose method and path match an endpoint is handled with that endpoint's settings;
/// any other passes through untouched (add `"/*"` for a default). The path is the one this
/// layer sees: put it on the outermost router (`Router::layer` on the top-level router, or
/// around it), not inside a `nest`, which strips the nest's prefix.
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
}

#[derive(Clone)]
struct Endpoint {
    methods: Vec<Method>,
    pattern: PathPattern,
    layer: IdempotencyLayer,
}

impl fmt::Debug for PolicyLayer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut list = f.debug_list();
        for endpoint in self.endpoints.iter() {
            list.entry(&format_args!(
                "{:?} {}",
                endpoint.methods, endpoint.pattern.source
            ));
        }
        list.finish()
    }
}

impl PolicyLayer {
    /// A policy with no endpoints yet, whose endpoints start from `base`'s settings.
    pub fn new(base: IdempotencyLayer) -> Self {
        Self {
            base,
            endpoints: Arc::from(Vec::new()),
        }
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
        let methods: Vec<Method> = methods.into_iter().collect();
        let layer = configure(self.base.clone()).with_methods(methods.clone());
        self.push(Endpoint {
            methods,
            pattern,
            layer,
        })
    }

    #[cfg_attr(not(feature = "policy"), allow(dead_code))]
    pub(crate) fn push_layer(
        self,
        methods: Vec<Method>,
        pattern: PathPattern,
        layer: IdempotencyLayer,
    ) -> Result<Self, PolicyError> {
        let layer = layer.with_methods(methods.clone());
        self.push(Endpoint {
            methods,
            pattern,
            layer,
        })
    }

    fn push(self, endpoint: Endpoint) -> Result<Self, PolicyError> {
        let mut endpoints = self.endpoints.to_vec();
        if let Some(earlier) = endpoints.iter().find(|earlier| {
            earlier.pattern.same_as(&endpoint.pattern)
                && earlier.methods.iter().any(|m| endpoint.methods.contains(m))
        }) {
            return Err(PolicyError::Duplicate {
                endpoint: format!("{:?} {}", endpoint.methods, endpoint.pattern.source),
                earlier: format!("{:?} {}", earlier.methods, earlier.pattern.source),
            });
        }
        endpoints.push(endpoint);
        // Most specific first, so that the first match is the most specific one. The sort is
        // stable, but no two endpoints that can match one request rank alike (see `same_as`).
        endpoints.sort_by(|a, b| b.pattern.rank.cmp(&a.pattern.rank));
        Ok(Self {
            base: self.base,
            endpoints: Arc::from(endpoints),
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
        self.endpoints
            .iter()
            .find(|e| e.methods.contains(method) && e.pattern.matches(path))
            .map(|e| &e.layer)
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
    ResBody: Body<Data = Bytes> + Send + 'static,
    ResBody::Error: Into<BoxError>,
{
    type Response = Response<ResponseBody<ResBody>>;
    type Error = S::Error;
    type Future = ResponseFuture<S::Future, ResBody, S::Error>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: Request<ReqBody>) -> Self::Future {
        match self.policy.select(request.method(), request.uri().path()) {
            Some(layer) => call_with(&mut self.inner, layer, request),
            None => ResponseFuture::passthrough(self.inner.call(request.map(RequestBody::streaming))),
        }
    }
}

/// A path pattern, compiled once: literal segments, parameters and a trailing wildcard.
#[derive(Clone, Debug)]
pub(crate) struct PathPattern {
    source: Box<str>,
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
            } else if let Some(name) = part.strip_prefix('{').and_then(|p| p.strip_suffix('}')) {
                check_param_name(name).map_err(bad)?;
                segments.push(Segment::Param);
            } else if let Some(name) = part.strip_prefix(':') {
                check_param_name(name).map_err(bad)?;
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
        let Some(mut rest) = path.strip_prefix('/') else {
            return false;
        };
        for (i, segment) in self.segments.iter().enumerate() {
            let (head, tail) = match rest.split_once('/') {
                Some((head, tail)) => (head, Some(tail)),
                None => (rest, None),
            };
            let fits = match segment {
                Segment::Literal(literal) => head == &**literal,
                Segment::Param => !head.is_empty(),
            };
            if !fits {
                return false;
            }
            match tail {
                Some(tail) => rest = tail,
                // The path ends here: it matches if the pattern does too.
                None => return i + 1 == self.segments.len() && !self.rest,
            }
        }
        // The path goes on past a `/` (or is just `/` for a pattern of no segments).
        self.rest
    }

    /// Whether the two patterns match the same paths.
    fn same_as(&self, other: &Self) -> bool {
        self.segments == other.segments && self.rest == other.rest
    }
}

fn check_param_name(name: &str) -> Result<(), &'static str> {
    if !name.is_empty() && name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_') {
        Ok(())
    } else {
        Err("a parameter is `{name}` or `:name`, the name of letters, digits and `_`")
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

    #[test]
    fn patterns_match_literals_parameters_and_a_trailing_wildcard() {
        let payments = pattern("/payments");
        assert!(payments.matches("/payments"));
        assert!(!payments.matches("/payments/"));
        assert!(!payments.matches("/payments/1"));
        assert!(!payments.matches("/payment"));
        assert!(!payments.matches(""));

        let comments = pattern("/posts/{id}/comments");
        assert!(comments.matches("/posts/7/comments"));
        assert!(!comments.matches("/posts//comments"));
        assert!(!comments.matches("/posts/7/comments/1"));
        assert!(pattern("/posts/:id/comments").same_as(&comments));

        let files = pattern("/files/*");
        assert!(files.matches("/files/"));
        assert!(files.matches("/files/a/b"));
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

    #[test]
    fn an_endpoint_repeated_is_refused() {
        let base = IdempotencyLayer::new(crate::MemoryStore::new());
        let policy = PolicyLayer::new(base)
            .endpoint([Method::POST], "/posts/{id}", |l| l)
            .unwrap();
        let error = policy
            .clone()
            .endpoint([Method::PATCH, Method::POST], "/posts/:post", |l| l)
            .unwrap_err();
        assert!(matches!(error, PolicyError::Duplicate { .. }), "{error}");
        // Another method on the same pattern is another endpoint.
        assert!(policy.endpoint([Method::PATCH], "/posts/:post", |l| l).is_ok());
    }
}
