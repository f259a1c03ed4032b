//! Tower middleware that makes non-idempotent HTTP endpoints (create a payment, place an order)
//! safe to retry.
//!
//! A client sends an `Idempotency-Key` header. The first request with a key runs the handler and
//! its response is stored; a retry with the same key and the same request gets the stored
//! response back, byte for byte, with `Idempotent-Replayed: true`, and the handler does not run
//! again. Keys live in a [`Store`]: [`RedisStore`] shared by every instance of a service,
//! `PostgresStore` (crate feature `postgres`) in the service's own PostgreSQL database, where a
//! handler can store its response in the transaction of its business writes, or [`MemoryStore`]
//! inside one process.
//!
//! ```
//! use std::convert::Infallible;
//! use bytes::Bytes;
//! use http::{Request, Response, StatusCode};
//! use http_body_util::Full;
//! use tower::{Service, ServiceBuilder, ServiceExt};
//! use tower_idempotency::{IdempotencyLayer, MemoryStore, RequestBody};
//!
//! async fn create_payment(_: Request<RequestBody<Full<Bytes>>>) -> Result<Response<Full<Bytes>>, Infallible> {
//!     let mut response = Response::new(Full::from("{\"id\":\"pay_1\"}"));
//!     *response.status_mut() = StatusCode::CREATED;
//!     Ok(response)
//! }
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() {
//! let mut service = ServiceBuilder::new()
//!     .layer(IdempotencyLayer::new(MemoryStore::new()))
//!     .service_fn(create_payment);
//!
//! let request = || {
//!     Request::post("/payments").header("idempotency-key", "order-42").body(Full::from("{}")).unwrap()
//! };
//! let first = service.ready().await.unwrap().call(request()).await.unwrap();
//! let retry = service.ready().await.unwrap().call(request()).await.unwrap();
//! assert_eq!(first.status(), StatusCode::CREATED);
//! assert_eq!(retry.status(), StatusCode::CREATED);
//! assert_eq!(retry.headers()["idempotent-replayed"], "true");
//! # }
//! ```
//!
//! With axum, `Router::layer`, `Router::route_layer` and `MethodRouter::layer` all take the
//! layer; configure each route with its own layer (see `examples/per_route.rs`), or put one
//! [`PolicyLayer`] on the whole router with settings per method and path, in code or from a
//! policy file (`Policy`, crate features `policy`, `policy-yaml`, `policy-toml`; see
//! `examples/policy.rs`). [`Scope`] builds the usual per-tenant scopes, and
//! [`FingerprintPolicy`] chooses what makes a retry the same request.
//!
//! A replay is answered by the layer, before the handler runs, so before any authentication
//! done in the handler (an axum extractor): without a scope, whoever sends another caller's key
//! and body gets that caller's stored response. Put the layer inside the authentication layer
//! and scope keys by what it found ([`Scope::extension`]); an unscoped layer that sees
//! `Authorization` or `Cookie` warns once, and
//! [`without_scope`](IdempotencyLayer::without_scope) declares a single-tenant layer.
//! A gRPC server (tonic's `Server::builder().layer(..)`) takes it too: the key comes as
//! `idempotency-key` metadata, a call is stored only if its `grpc-status` allows
//! ([`default_grpc_cacheable`]), and rejections are gRPC errors ([`Rejection::grpc_code`]);
//! gRPC's own services (health check, reflection) pass untouched; see `examples/grpc.rs`.
//!
//! The protocol itself has no HTTP in it: [`Coordinator`] claims a key, and the [`Claim`] is
//! completed with the result or released. Queue consumers use it directly (see
//! `examples/consumer.rs`).
//!
//! The behaviour table, every setting with its default, and the guarantees in short are in the
//! [README](guide::readme); each topic has a [guide] of its own (stores, topologies and failover,
//! PostgreSQL, the guarantees in full, performance, operators, metrics, gRPC, the policy file).
//!
//! # Crate features
//!
//! | feature | default | what it adds |
//! |---|---|---|
//! | `redis` | yes | [`RedisStore`], over the `fred` client: standalone, Sentinel and Cluster |
//! | `tls` | yes | `rediss://` URLs for the Redis store (rustls; the platform's trust store, or `SSL_CERT_FILE`) |
//! | `metrics` | yes | counters, a histogram and a gauge through the `metrics` facade ([guide](guide::metrics_and_tracing)) |
//! | `streams` | no | `StreamConsumer`, a Redis Streams consumer group that runs each message's effect once ([guide](guide::queue_consumers)), and `StreamPublisher`; turns on `redis` |
//! | `postgres` | no | `PostgresStore`, over `sqlx`, with completions in the handler's own transaction |
//! | `postgres-tls` | no | `sslmode=require` / `verify-full` in the PostgreSQL URL (rustls) |
//! | `policy` | no | `Policy`: settings per method and path from a JSON file (the [`PolicyLayer`] itself needs no feature) |
//! | `policy-yaml` | no | YAML policy files (`serde-saphyr`; needs Rust 1.89) |
//! | `policy-toml` | no | TOML policy files (`toml`) |
//! | `testing` | no | [`testing::conformance`]: the store suite as one call, for the tests of a store of your own |
//! | `cli` | no | the `idempotency-admin` binary (`cargo install tower-idempotency --features cli`): inspect, purge and list records from a shell; turns on both stores and their TLS |
//!
//! With no feature at all the crate builds with the [`MemoryStore`] alone. The minimum supported
//! Rust version is 1.85 (`rust-version` in `Cargo.toml`, checked in CI against what every locked
//! dependency needs); `policy-yaml` alone needs 1.89.
#![forbid(unsafe_code)]
#![deny(missing_docs)]
#![deny(unreachable_pub)]
#![cfg_attr(docsrs, feature(doc_cfg))]

// The HTTP-free core: keys, fingerprints, the claim protocol and the stores.
mod canonical_json;
mod coordinator;
mod fingerprint;
mod key;
mod reconciliation;
#[cfg(feature = "redis")]
mod replay_cache;
mod store;
mod sync;
// Metrics and the request span, for core and adapter alike.
mod telemetry;
// The tower adapter over it.
mod http;
// Redis Streams consumers over the core.
#[cfg(feature = "streams")]
mod streams;
// README and the guides of docs/, as pages of the documentation (no code).
pub mod guide;
#[cfg(feature = "testing")]
#[cfg_attr(docsrs, doc(cfg(feature = "testing")))]
pub mod testing;

/// Not an API: the fuzz targets' entry points (`fuzz/`), each the check of one parser or codec
/// on one input, which panics where a property fails. Only with the crate feature `fuzzing`,
/// for `fuzz/` and `tests/fuzz_corpora.rs`; hidden, and changed or removed in any release.
#[cfg(feature = "fuzzing")]
#[doc(hidden)]
pub mod __fuzz {
    /// An `Idempotency-Key` header value.
    pub fn key(data: &[u8]) {
        crate::key::check(data);
    }

    /// A stored response (the payload of a completed record, in every store).
    pub fn stored_response(data: &[u8]) {
        crate::http::stored::check(data);
    }

    /// A Redis record, and the stored response of a completed one.
    #[cfg(feature = "redis")]
    pub fn redis_record(data: &[u8]) {
        if let Some(payload) = crate::store::redis::check_record(data) {
            crate::http::stored::check(&payload);
        }
    }

    /// `Prefer: wait` fields with the layer's wait settings, and `Retry-After`.
    pub fn prefer(data: &[u8]) {
        crate::http::prefer::check(data);
        crate::http::retry_after::check(data);
    }

    /// The fingerprint's authority, media type and request target.
    pub fn fingerprint(data: &[u8]) {
        crate::http::fingerprint::check(data);
    }

    /// A JSON body's canonical form (RFC 8785) and the members JSON Pointers choose.
    pub fn json_fingerprint(data: &[u8]) {
        crate::canonical_json::check(data);
    }

    /// A policy file, a path pattern, a duration or a size.
    #[cfg(feature = "policy")]
    pub fn policy(data: &[u8]) {
        crate::http::policy::check(data);
    }
}

/// The `bytes` this crate is built with (1): [`Coordinator::once`] takes and gives back a
/// message's result as `tower_idempotency::bytes::Bytes`, so a consumer needs no `bytes` of its
/// own.
pub use bytes;

/// The `sqlx` this crate is built with (0.8), for the pool and transactions a
/// [`PostgresStore`] takes: `tower_idempotency::sqlx::PgPool`. Use it, or depend on the same
/// minor version, as two releases of `sqlx` in one build are two types that do not mix.
#[cfg(feature = "postgres")]
#[cfg_attr(docsrs, doc(cfg(feature = "postgres")))]
pub use sqlx;

/// The `fred` this crate is built with (10), for a client or pool of your own
/// ([`RedisStore::new`], [`RedisStore::from_pool`]): use it, or depend on the same major
/// version, as two releases of `fred` in one build are two types that do not mix. It is built
/// with what a Redis Streams consumer needs besides the store's own commands: the stream
/// commands (`XREADGROUP`, `XAUTOCLAIM`, `XACK`, `XADD`, `XGROUP`; fred's `i-streams`) and
/// `MULTI` (`transactions`), so a consumer's Cargo.toml needs no `fred` of its own.
#[cfg(feature = "redis")]
#[cfg_attr(docsrs, doc(cfg(feature = "redis")))]
pub use fred;

pub use self::http::body::{BoxError, RequestBody};
pub use self::http::config::{default_cacheable, default_unstored_headers};
pub use self::http::endpoints::{PolicyError, PolicyLayer, PolicyService};
pub use self::http::fingerprint::FingerprintPolicy;
pub use self::http::future::ResponseFuture;
pub use self::http::grpc::default_grpc_cacheable;
pub use self::http::layer::{IdempotencyLayer, Inspection};
#[cfg(feature = "policy")]
pub use self::http::policy::Policy;
pub use self::http::replay::IDEMPOTENT_REPLAYED;
pub use self::http::response::Rejection;
pub use self::http::response_body::ResponseBody;
pub use self::http::scope::Scope;
pub use self::http::service::Idempotency;
pub use self::http::transactional::TransactionalClaim;
pub use self::telemetry::RequestOutcome;
pub use canonical_json::{InvalidJsonPointer, JsonPointer};
pub use coordinator::{
    default_consumer_name, Begin, Claim, Coordinator, Disposition, Error, Once, OnceCall, ShutdownHandle,
    ShutdownTimedOut,
};
pub use fingerprint::{Fingerprint, PolicyTag};
pub use key::{IdempotencyKey, KeyError, RecordKey, MAX_KEY_LEN};
pub use reconciliation::{NotStored, ReconciliationEvent, ReconciliationKind};
pub use store::memory::MemoryStore;
#[cfg(feature = "postgres")]
pub use store::postgres::{ClaimCommitError, ClaimTransaction, PostgresStore};
#[cfg(feature = "redis")]
pub use store::redis::{RedisStore, ReplicaAcks};
pub use store::{
    ClaimOutcome, ClaimTicket, InFlightRecord, KeyWatch, OwnerToken, RecordInfo, RecordState, Store,
    StoreError, StoreFuture, RECORD_VERSION,
};
#[cfg(feature = "streams")]
#[cfg_attr(docsrs, doc(cfg(feature = "streams")))]
pub use streams::{
    shutdown_signal, Failure, FieldError, StreamConsumer, StreamEvent, StreamMessage, StreamOutcome,
    StreamPublisher,
};
