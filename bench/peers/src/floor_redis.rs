//! `floor-redis`: the least a Redis-backed idempotency layer can do per request with `fred`, as a
//! tower service in front of the same handler. Like `floor.rs`, a yardstick for the benchmark,
//! not a layer anyone should use: no lease (a key whose handler panics or whose process dies
//! stays in flight for the whole retention), no bound on the body, no scope, no telemetry, no
//! retries, no bound on a Redis call.
//!
//! Per keyed POST it reads the body and takes one SHA-256 of method, path and body. Then one
//! plain command, no script: `SET key <in flight, fingerprint> NX PX <24 h> GET` claims a new key
//! and returns what an old key holds, in one round trip (Redis 7.0 allows NX with GET). A
//! completed key with the same fingerprint is replayed from its stored status, headers and body
//! (`idempotent-replayed: true`), one with another fingerprint gets 422, one in flight 409. A
//! claimed key runs the handler, and its buffered response is stored with a second `SET`: two
//! commands and two round trips per fresh key, one per replay, each a single command sent
//! through one `fred` client with its defaults (which pipelines concurrent commands).
//!
//! A record is `d` or `p`, the 32-byte fingerprint, and for `d` the status (2 bytes, big
//! endian), the header count (2 bytes) and each header as name length (2), name, value length
//! (2), value, then the body.

use std::convert::Infallible;
use std::task::{Context, Poll};

use axum::body::{Body, Bytes};
use axum::extract::Request;
use axum::http::{HeaderMap, HeaderName, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Router;
use fred::clients::Client;
use fred::prelude::KeysInterface;
use fred::types::{Expiration, SetOptions};
use http_body_util::BodyExt;
use tower::{Layer, Service};

use crate::floor::{post_key, read_and_fingerprint, BoxFuture};

const RETENTION_MS: i64 = 24 * 3600 * 1000;
const IN_FLIGHT: u8 = b'p';
const DONE: u8 = b'd';

#[derive(Clone)]
struct FloorLayer {
    client: Client,
}

impl<S> Layer<S> for FloorLayer {
    type Service = FloorRedis<S>;

    fn layer(&self, inner: S) -> FloorRedis<S> {
        FloorRedis {
            inner,
            client: self.client.clone(),
        }
    }
}

#[derive(Clone)]
struct FloorRedis<S> {
    inner: S,
    client: Client,
}

fn encode(fingerprint: &[u8; 32], status: StatusCode, headers: &HeaderMap, body: &[u8]) -> Bytes {
    let mut record = Vec::with_capacity(37 + headers.len() * 48 + body.len());
    record.push(DONE);
    record.extend_from_slice(fingerprint);
    record.extend_from_slice(&status.as_u16().to_be_bytes());
    record.extend_from_slice(&(headers.len() as u16).to_be_bytes());
    for (name, value) in headers {
        record.extend_from_slice(&(name.as_str().len() as u16).to_be_bytes());
        record.extend_from_slice(name.as_str().as_bytes());
        record.extend_from_slice(&(value.len() as u16).to_be_bytes());
        record.extend_from_slice(value.as_bytes());
    }
    record.extend_from_slice(body);
    Bytes::from(record)
}

/// The response a completed record replays, or `None` if the record is corrupt.
fn decode(record: &Bytes) -> Option<Response> {
    fn take<'a>(rest: &mut &'a [u8], n: usize) -> Option<&'a [u8]> {
        let (head, tail) = rest.split_at_checked(n)?;
        *rest = tail;
        Some(head)
    }
    fn length(rest: &mut &[u8]) -> Option<usize> {
        take(rest, 2).map(|b| u16::from_be_bytes([b[0], b[1]]) as usize)
    }
    let mut rest = record.get(33..)?;
    let status = StatusCode::from_u16(length(&mut rest)? as u16).ok()?;
    let count = length(&mut rest)?;
    let mut headers = HeaderMap::with_capacity(count + 1);
    for _ in 0..count {
        let n = length(&mut rest)?;
        let name = HeaderName::from_bytes(take(&mut rest, n)?).ok()?;
        let n = length(&mut rest)?;
        let value = HeaderValue::from_bytes(take(&mut rest, n)?).ok()?;
        headers.append(name, value);
    }
    let body = record.slice(record.len() - rest.len()..);
    headers.insert("idempotent-replayed", HeaderValue::from_static("true"));
    let mut response = Response::new(Body::from(body));
    *response.status_mut() = status;
    *response.headers_mut() = headers;
    Some(response)
}

impl<S> Service<Request> for FloorRedis<S>
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
        let Some(key) = post_key(&request).map(|key| format!("floor:{key}")) else {
            let future = self.inner.call(request);
            return Box::pin(future);
        };
        let clone = self.inner.clone();
        let mut inner = std::mem::replace(&mut self.inner, clone);
        let client = self.client.clone();
        Box::pin(async move {
            let (parts, body, fingerprint) = match read_and_fingerprint(request).await {
                Ok(read) => read,
                Err(answer) => return Ok(answer),
            };
            let mut pending = [IN_FLIGHT; 33];
            pending[1..].copy_from_slice(&fingerprint);
            let claim = client
                .set::<Option<Bytes>, _, _>(
                    key.as_str(),
                    Bytes::copy_from_slice(&pending),
                    Some(Expiration::PX(RETENTION_MS)),
                    Some(SetOptions::NX),
                    true,
                )
                .await;
            match claim {
                Err(_) => return Ok(StatusCode::SERVICE_UNAVAILABLE.into_response()),
                Ok(Some(record)) => {
                    let answer = if record.get(1..33) != Some(&fingerprint[..]) {
                        StatusCode::UNPROCESSABLE_ENTITY.into_response()
                    } else if record.first() == Some(&DONE) {
                        decode(&record).unwrap_or_else(|| StatusCode::INTERNAL_SERVER_ERROR.into_response())
                    } else {
                        StatusCode::CONFLICT.into_response()
                    };
                    return Ok(answer);
                }
                Ok(None) => {}
            }
            let Ok(response) = inner.call(Request::from_parts(parts, Body::from(body))).await;
            let (parts, body) = response.into_parts();
            let Ok(body) = body.collect().await.map(|collected| collected.to_bytes()) else {
                let _ = client.del::<(), _>(key.as_str()).await;
                return Ok(StatusCode::INTERNAL_SERVER_ERROR.into_response());
            };
            let record = encode(&fingerprint, parts.status, &parts.headers, &body);
            let stored = client
                .set::<(), _, _>(
                    key.as_str(),
                    record,
                    Some(Expiration::PX(RETENTION_MS)),
                    None,
                    false,
                )
                .await;
            if stored.is_err() {
                return Ok(StatusCode::SERVICE_UNAVAILABLE.into_response());
            }
            Ok(Response::from_parts(parts, Body::from(body)))
        })
    }
}

/// The benchmark's handler behind the floor, over one `fred` client with its defaults.
pub async fn router(handler: Router, url: &str) -> Result<Router, crate::BoxError> {
    let client = fred::prelude::Builder::from_config(fred::prelude::Config::from_url(url)?).build()?;
    fred::prelude::ClientLike::init(&client).await?;
    Ok(handler.layer(FloorLayer { client }))
}
