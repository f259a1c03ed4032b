//! `floor-memory`: the least an in-process idempotency layer can do per request, as a tower
//! service in front of the same handler. It is a yardstick for the benchmark, not a layer anyone
//! should use: it has no lease (a key whose handler panics stays in flight), no bound on the
//! body, no scope, no telemetry, no retries, and it keeps the whole response in memory.
//!
//! Per keyed POST it reads the body, takes one SHA-256 of method, path and body, and looks the
//! key up under one mutex: a completed key with the same fingerprint is replayed from a stored
//! status, header map and body (`idempotent-replayed: true`), one with another fingerprint gets
//! 422 (in flight or not), one in flight 409; a new key is marked in flight, the handler runs, and its buffered
//! response is stored. Records are kept in arrival order and the oldest goes once there are
//! [`CAPACITY`] of them, about as many as the crate's memory store holds in its default 64 MiB
//! with the benchmark's records.

use std::collections::{HashMap, VecDeque};
use std::convert::Infallible;
use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};

use axum::body::{Body, Bytes};
use axum::extract::Request;
use axum::http::request::Parts;
use axum::http::{HeaderMap, HeaderValue, Method, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Router;
use http_body_util::BodyExt;
use sha2::{Digest, Sha256};
use tower::{Layer, Service};

/// Records kept before the oldest goes: 64 MiB ÷ about 560 bytes per record in the crate's
/// memory store (its 384-byte overhead and a payload of about 175 bytes).
const CAPACITY: usize = 120_000;

enum Record {
    InFlight([u8; 32]),
    Done([u8; 32], Arc<Stored>),
}

struct Stored {
    status: StatusCode,
    headers: HeaderMap,
    body: Bytes,
}

#[derive(Default)]
struct Records {
    by_key: HashMap<Box<str>, Record>,
    order: VecDeque<Box<str>>,
}

#[derive(Clone, Default)]
struct FloorLayer {
    records: Arc<Mutex<Records>>,
}

impl<S> Layer<S> for FloorLayer {
    type Service = Floor<S>;

    fn layer(&self, inner: S) -> Floor<S> {
        Floor {
            inner,
            records: self.records.clone(),
        }
    }
}

#[derive(Clone)]
struct Floor<S> {
    inner: S,
    records: Arc<Mutex<Records>>,
}

pub(crate) type BoxFuture<T> = Pin<Box<dyn Future<Output = T> + Send>>;

/// The idempotency key of a keyed `POST`, the only requests either floor looks at.
pub(crate) fn post_key(request: &Request) -> Option<&str> {
    let key = request.headers().get("idempotency-key")?.to_str().ok()?;
    (request.method() == Method::POST).then_some(key)
}

/// The request's parts, its buffered body and one SHA-256 of method, path and body; 400 if the
/// body cannot be read.
pub(crate) async fn read_and_fingerprint(request: Request) -> Result<(Parts, Bytes, [u8; 32]), Response> {
    let (parts, body) = request.into_parts();
    let Ok(body) = body.collect().await.map(|collected| collected.to_bytes()) else {
        return Err(StatusCode::BAD_REQUEST.into_response());
    };
    let mut hasher = Sha256::new();
    hasher.update(parts.method.as_str());
    hasher.update([0]);
    hasher.update(parts.uri.path());
    hasher.update([0]);
    hasher.update(&body);
    Ok((parts, body, hasher.finalize().into()))
}

impl<S> Service<Request> for Floor<S>
where
    S: Service<Request, Response = Response, Error = Infallible> + Clone + Send + 'static,
    S::Future: Send + 'static,
{
    type Response = Response;
    type Error = Infallible;
    type Future = BoxFuture<Result<Response, Infallible>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: Request) -> Self::Future {
        let Some(key) = post_key(&request).map(Box::<str>::from) else {
            let future = self.inner.call(request);
            return Box::pin(future);
        };
        let clone = self.inner.clone();
        let mut inner = std::mem::replace(&mut self.inner, clone);
        let records = self.records.clone();
        Box::pin(async move {
            let (parts, body, fingerprint) = match read_and_fingerprint(request).await {
                Ok(read) => read,
                Err(answer) => return Ok(answer),
            };
            {
                let mut records = records.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
                match records.by_key.get(&key) {
                    Some(Record::Done(seen, stored)) if *seen == fingerprint => {
                        let mut response = Response::new(Body::from(stored.body.clone()));
                        *response.status_mut() = stored.status;
                        *response.headers_mut() = stored.headers.clone();
                        drop(records);
                        response
                            .headers_mut()
                            .insert("idempotent-replayed", HeaderValue::from_static("true"));
                        return Ok(response);
                    }
                    Some(Record::Done(..)) => return Ok(StatusCode::UNPROCESSABLE_ENTITY.into_response()),
                    Some(Record::InFlight(seen)) if *seen != fingerprint => {
                        return Ok(StatusCode::UNPROCESSABLE_ENTITY.into_response())
                    }
                    Some(Record::InFlight(_)) => return Ok(StatusCode::CONFLICT.into_response()),
                    None => {
                        if records.order.len() >= CAPACITY {
                            if let Some(oldest) = records.order.pop_front() {
                                records.by_key.remove(&oldest);
                            }
                        }
                        records.order.push_back(key.clone());
                        records.by_key.insert(key.clone(), Record::InFlight(fingerprint));
                    }
                }
            }
            let Ok(response) = inner.call(Request::from_parts(parts, Body::from(body))).await;
            let (parts, body) = response.into_parts();
            let Ok(body) = body.collect().await.map(|collected| collected.to_bytes()) else {
                records
                    .lock()
                    .unwrap_or_else(|poisoned| poisoned.into_inner())
                    .by_key
                    .remove(&key);
                return Ok(StatusCode::INTERNAL_SERVER_ERROR.into_response());
            };
            let stored = Arc::new(Stored {
                status: parts.status,
                headers: parts.headers.clone(),
                body: body.clone(),
            });
            let mut records = records.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
            if let Some(record) = records.by_key.get_mut(&key) {
                *record = Record::Done(fingerprint, stored);
            }
            drop(records);
            Ok(Response::from_parts(parts, Body::from(body)))
        })
    }
}

/// The benchmark's handler behind the floor.
pub fn router(handler: Router) -> Router {
    handler.layer(FloorLayer::default())
}
