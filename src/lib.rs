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
//! layer; configure each route with its own layer (see `examples/per_route.rs`).
//! A gRPC server (tonic's `Server::builder().layer(..)`) takes it too: the key comes as
//! `idempotency-key` metadata, a call is stored only if its `grpc-status` allows
//! ([`default_grpc_cacheable`]), and rejections are gRPC errors ([`Rejection::grpc_code`]); see
//! `examples/grpc.rs`.
//!
//! The protocol itself has no HTTP in it: [`Coordinator`] claims a key, and the [`Claim`] is
//! completed with the result or released. Queue consumers use it directly (see
//! `examples/consumer.rs`).
//!
//! The behaviour table, every setting with its default, and the guarantees and their limits are
//! in the README.
#![forbid(unsafe_code)]
#![deny(missing_docs)]
#![deny(unreachable_pub)]
#![cfg_attr(docsrs, feature(doc_auto_cfg))]

// The HTTP-free core: keys, fingerprints, the claim protocol and the stores.
mod coordinator;
mod fingerprint;
mod key;
#[cfg(feature = "redis")]
mod replay_cache;
mod store;
// The tower adapter over it.
mod http;

pub use self::http::body::{BoxError, RequestBody, ResponseBody};
pub use self::http::config::{default_cacheable, default_unstored_headers};
pub use self::http::future::ResponseFuture;
pub use self::http::grpc::default_grpc_cacheable;
pub use self::http::layer::{IdempotencyLayer, Inspection};
pub use self::http::replay::{NotStored, IDEMPOTENT_REPLAYED};
pub use self::http::response::Rejection;
pub use self::http::service::Idempotency;
pub use self::http::transactional::TransactionalClaim;
pub use coordinator::{Begin, Claim, ClaimTicket, Coordinator, Error, ShutdownHandle, ShutdownTimedOut};
pub use fingerprint::Fingerprint;
pub use key::{IdempotencyKey, KeyError, RecordKey, MAX_KEY_LEN};
pub use store::memory::MemoryStore;
#[cfg(feature = "postgres")]
pub use store::postgres::PostgresStore;
#[cfg(feature = "redis")]
pub use store::redis::RedisStore;
#[cfg(feature = "redis")]
pub use store::replica_acks::ReplicaAcks;
pub use store::{
    ClaimOutcome, OwnerToken, RecordInfo, RecordState, Store, StoreError, StoreFuture, RECORD_VERSION,
};
