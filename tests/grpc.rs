//! gRPC through the layer: a real tonic server with the layer around it, over a TCP listener
//! and HTTP/2, called by a real tonic client; on the memory store and on a real Redis.

mod common;

use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::{BufMut, Bytes, BytesMut};
use common::Backend;
use http::uri::PathAndQuery;
use http_body_util::BodyExt;
use prost::Message as _;
use tonic::metadata::MetadataValue;
use tonic::transport::{Channel, Endpoint};
use tonic::{Code, Status};
use tonic_prost::ProstCodec;
use tower::ServiceExt;
use tower_idempotency::IdempotencyLayer;

#[derive(Clone, PartialEq, prost::Message)]
struct PaymentRequest {
    #[prost(int64, tag = "1")]
    amount: i64,
    /// The gRPC code the handler fails with (0: it succeeds)...
    #[prost(int32, tag = "2")]
    fail_with: i32,
    /// ...on its first `fail_times` runs (0: every time).
    #[prost(uint32, tag = "3")]
    fail_times: u32,
    #[prost(uint64, tag = "4")]
    delay_ms: u64,
    #[prost(string, tag = "5")]
    note: String,
}

#[derive(Clone, PartialEq, prost::Message)]
struct PaymentReply {
    #[prost(string, tag = "1")]
    id: String,
    #[prost(int64, tag = "2")]
    amount: i64,
}

/// gRPC's rich error model (`google/rpc/status.proto`, `error_details.proto`), as much as the
/// rejections carry in `grpc-status-details-bin`.
#[derive(Clone, PartialEq, prost::Message)]
struct RpcStatus {
    #[prost(int32, tag = "1")]
    code: i32,
    #[prost(string, tag = "2")]
    message: String,
    #[prost(message, repeated, tag = "3")]
    details: Vec<Any>,
}

#[derive(Clone, PartialEq, prost::Message)]
struct Any {
    #[prost(string, tag = "1")]
    type_url: String,
    #[prost(bytes = "vec", tag = "2")]
    value: Vec<u8>,
}

#[derive(Clone, PartialEq, prost::Message)]
struct ErrorInfo {
    #[prost(string, tag = "1")]
    reason: String,
    #[prost(string, tag = "2")]
    domain: String,
    #[prost(map = "string, string", tag = "3")]
    metadata: std::collections::HashMap<String, String>,
}

#[derive(Clone, PartialEq, prost::Message)]
struct RetryInfo {
    #[prost(message, optional, tag = "1")]
    retry_delay: Option<ProtoDuration>,
}

#[derive(Clone, PartialEq, prost::Message)]
struct ProtoDuration {
    #[prost(int64, tag = "1")]
    seconds: i64,
    #[prost(int32, tag = "2")]
    nanos: i32,
}

/// A rejection's kind (`ErrorInfo.reason`) and retry delay in seconds (`RetryInfo`), read from
/// its rich error details as a client would.
fn kind(status: &Status) -> (String, Option<i64>) {
    let rpc = RpcStatus::decode(status.details()).expect("grpc-status-details-bin holds a google.rpc.Status");
    assert_eq!(rpc.code, status.code() as i32);
    assert_eq!(rpc.message, status.message());
    let (mut reason, mut delay) = (None, None);
    for any in rpc.details {
        match any.type_url.as_str() {
            "type.googleapis.com/google.rpc.ErrorInfo" => {
                let info = ErrorInfo::decode(&any.value[..]).expect("an ErrorInfo");
                assert_eq!(info.domain, "tower-idempotency");
                assert!(info.metadata["type"].starts_with("https://docs.rs/tower-idempotency/"));
                reason = Some(info.reason);
            }
            "type.googleapis.com/google.rpc.RetryInfo" => {
                let info = RetryInfo::decode(&any.value[..]).expect("a RetryInfo");
                delay = info.retry_delay.map(|d| d.seconds);
            }
            other => panic!("unexpected detail {other}"),
        }
    }
    (reason.expect("an ErrorInfo in the details"), delay)
}

const CREATE: &str = "/test.Payments/Create";
/// A read: answers at once and runs nothing (not counted in `runs`).
const GET: &str = "/test.Payments/Get";
/// Server streaming: one reply, then the request's failure (if any) in the trailers.
const STREAM: &str = "/test.Payments/Stream";

/// The service, written as tonic's code generator would write it, by hand (no `protoc`).
#[derive(Clone)]
struct Payments {
    runs: Arc<AtomicUsize>,
}

impl tonic::server::NamedService for Payments {
    const NAME: &'static str = "test.Payments";
}

impl Payments {
    /// Runs the handler once: counts the run, waits, fails if asked to, else answers with an id
    /// unique to this run (so a replay is told from a second run).
    async fn run(runs: Arc<AtomicUsize>, request: PaymentRequest) -> Result<PaymentReply, Status> {
        let run = runs.fetch_add(1, Ordering::SeqCst) + 1;
        tokio::time::sleep(Duration::from_millis(request.delay_ms)).await;
        let fails = request.fail_with != 0 && (request.fail_times == 0 || run <= request.fail_times as usize);
        if fails {
            return Err(Status::new(
                Code::from_i32(request.fail_with),
                format!("failed on run {run}"),
            ));
        }
        Ok(PaymentReply {
            id: format!("pay_{run}"),
            amount: request.amount,
        })
    }
}

type BoxFuture<T> = std::pin::Pin<Box<dyn std::future::Future<Output = T> + Send>>;

impl<B> tower::Service<http::Request<B>> for Payments
where
    B: http_body::Body<Data = Bytes> + Send + 'static,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>> + Send + 'static,
{
    type Response = http::Response<tonic::body::Body>;
    type Error = std::convert::Infallible;
    type Future = BoxFuture<Result<Self::Response, Self::Error>>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, request: http::Request<B>) -> Self::Future {
        let runs = self.runs.clone();
        let mut grpc = tonic::server::Grpc::new(ProstCodec::<PaymentReply, PaymentRequest>::default());
        match request.uri().path() {
            CREATE => Box::pin(async move {
                let create = tower::service_fn(move |request: tonic::Request<PaymentRequest>| {
                    let runs = runs.clone();
                    async move {
                        Payments::run(runs, request.into_inner())
                            .await
                            .map(tonic::Response::new)
                    }
                });
                Ok(grpc.unary(create, request).await)
            }),
            STREAM => Box::pin(async move {
                let stream = tower::service_fn(move |request: tonic::Request<PaymentRequest>| {
                    let runs = runs.clone();
                    async move {
                        let mut request = request.into_inner();
                        let fail_with = std::mem::take(&mut request.fail_with);
                        let reply = Payments::run(runs, request).await;
                        let mut items = vec![reply];
                        if fail_with != 0 {
                            items.push(Err(Status::new(
                                Code::from_i32(fail_with),
                                "failed after a reply",
                            )));
                        }
                        Ok::<_, Status>(tonic::Response::new(futures_util::stream::iter(items)))
                    }
                });
                Ok(grpc.server_streaming(stream, request).await)
            }),
            GET => Box::pin(async move {
                let get = tower::service_fn(|request: tonic::Request<PaymentRequest>| async move {
                    let amount = request.into_inner().amount;
                    Ok(tonic::Response::new(PaymentReply {
                        id: "read".into(),
                        amount,
                    }))
                });
                Ok(grpc.unary(get, request).await)
            }),
            _ => Box::pin(async { Ok(Status::unimplemented("no such method").into_http()) }),
        }
    }
}

struct Server {
    addr: SocketAddr,
    runs: Arc<AtomicUsize>,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for Server {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl Server {
    /// A tonic server with `layer` around its service, on a free loopback port.
    async fn start(layer: IdempotencyLayer) -> Self {
        Self::serve(|incoming, payments| {
            tonic::transport::Server::builder()
                .layer(layer)
                .add_service(payments)
                .serve_with_incoming(incoming)
        })
        .await
    }

    /// A server that `build` makes, given the listener and the `Payments` service.
    async fn serve<F>(build: impl FnOnce(tonic::transport::server::TcpIncoming, Payments) -> F) -> Self
    where
        F: std::future::Future<Output = Result<(), tonic::transport::Error>> + Send + 'static,
    {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind a loopback port");
        let addr = listener.local_addr().expect("local address");
        let runs = Arc::new(AtomicUsize::new(0));
        let payments = Payments { runs: runs.clone() };
        let serve = build(tonic::transport::server::TcpIncoming::from(listener), payments);
        let task = tokio::spawn(async move { serve.await.expect("the gRPC server runs") });
        Self { addr, runs, task }
    }

    fn runs(&self) -> usize {
        self.runs.load(Ordering::SeqCst)
    }

    async fn channel(&self) -> Channel {
        Endpoint::from_shared(format!("http://{}", self.addr))
            .expect("a valid endpoint")
            .connect()
            .await
            .expect("connect to the gRPC server")
    }
}

fn request(key: Option<&str>, message: PaymentRequest) -> tonic::Request<PaymentRequest> {
    let mut request = tonic::Request::new(message);
    if let Some(key) = key {
        let key = MetadataValue::try_from(key).expect("a valid metadata value");
        request.metadata_mut().insert("idempotency-key", key);
    }
    request
}

fn payment(amount: i64) -> PaymentRequest {
    PaymentRequest {
        amount,
        ..PaymentRequest::default()
    }
}

/// A unary `Create` call through a real tonic client.
async fn create(
    channel: &Channel,
    key: Option<&str>,
    message: PaymentRequest,
) -> Result<tonic::Response<PaymentReply>, Status> {
    unary(channel, CREATE, key, message).await
}

async fn unary(
    channel: &Channel,
    method: &'static str,
    key: Option<&str>,
    message: PaymentRequest,
) -> Result<tonic::Response<PaymentReply>, Status> {
    let mut client = tonic::client::Grpc::new(channel.clone());
    client.ready().await.expect("the channel is ready");
    let codec = ProstCodec::<PaymentRequest, PaymentReply>::default();
    client
        .unary(request(key, message), PathAndQuery::from_static(method), codec)
        .await
}

/// A server-streaming `Stream` call: the replies, then how the stream ended, and the response
/// metadata.
async fn stream(
    channel: &Channel,
    key: &str,
    message: PaymentRequest,
) -> (
    Vec<PaymentReply>,
    Result<(), Status>,
    tonic::metadata::MetadataMap,
) {
    let mut client = tonic::client::Grpc::new(channel.clone());
    client.ready().await.expect("the channel is ready");
    let codec = ProstCodec::<PaymentRequest, PaymentReply>::default();
    let response = client
        .server_streaming(
            request(Some(key), message),
            PathAndQuery::from_static(STREAM),
            codec,
        )
        .await
        .expect("the stream starts");
    let metadata = response.metadata().clone();
    let mut stream = response.into_inner();
    let mut replies = Vec::new();
    loop {
        match stream.message().await {
            Ok(Some(reply)) => replies.push(reply),
            Ok(None) => return (replies, Ok(()), metadata),
            Err(status) => return (replies, Err(status), metadata),
        }
    }
}

fn is_replay(metadata: &tonic::metadata::MetadataMap) -> bool {
    metadata.get("idempotent-replayed").is_some_and(|v| v == "true")
}

/// The raw HTTP/2 exchange of a unary call, over the tonic channel: status, headers, body bytes
/// and trailers, as they crossed the wire.
struct Raw {
    status: http::StatusCode,
    headers: http::HeaderMap,
    body: Bytes,
    trailers: Option<http::HeaderMap>,
}

async fn raw_create(channel: &Channel, key: &str, message: &PaymentRequest) -> Raw {
    let encoded = message.encode_to_vec();
    let mut framed = BytesMut::with_capacity(5 + encoded.len());
    framed.put_u8(0); // not compressed
    framed.put_u32(encoded.len() as u32);
    framed.put_slice(&encoded);
    let request = http::Request::post(format!("http://127.0.0.1{CREATE}"))
        .header("content-type", "application/grpc")
        .header("te", "trailers")
        .header("idempotency-key", key)
        .body(tonic::body::Body::new(http_body_util::Full::new(framed.freeze())))
        .expect("a valid request");
    let response = channel.clone().oneshot(request).await.expect("an HTTP/2 answer");
    let (parts, body) = response.into_parts();
    let collected = body.collect().await.expect("the whole body");
    let trailers = collected.trailers().cloned();
    Raw {
        status: parts.status,
        headers: parts.headers,
        body: collected.to_bytes(),
        trailers,
    }
}

async fn a_unary_call_runs_once_and_its_retry_gets_the_same_message_and_trailers(b: Backend) {
    let server = Server::start(IdempotencyLayer::new(b.store.clone())).await;
    let channel = server.channel().await;

    let first = create(&channel, Some("pay-1"), payment(42))
        .await
        .expect("the call succeeds");
    assert!(!is_replay(first.metadata()));
    let retry = create(&channel, Some("pay-1"), payment(42))
        .await
        .expect("the retry succeeds");
    assert!(
        is_replay(retry.metadata()),
        "idempotent-replayed in the retry's metadata"
    );
    assert_eq!(retry.get_ref(), first.get_ref());
    assert_eq!(first.get_ref().id, "pay_1");
    assert_eq!(server.runs(), 1, "the handler ran once");

    // On the wire: the same headers, the same body, byte for byte, and the same trailers.
    let first = raw_create(&channel, "pay-raw", &payment(7)).await;
    let retry = raw_create(&channel, "pay-raw", &payment(7)).await;
    assert_eq!(server.runs(), 2);
    assert_eq!((first.status.as_u16(), retry.status.as_u16()), (200, 200));
    assert!(!first.body.is_empty());
    assert_eq!(retry.body, first.body, "byte-exact body");
    let trailers = first
        .trailers
        .as_ref()
        .expect("a gRPC response ends with trailers");
    assert_eq!(trailers["grpc-status"], "0");
    assert_eq!(retry.trailers, first.trailers, "the same trailers");
    assert_eq!(retry.headers["idempotent-replayed"], "true");
    let without = |headers: &http::HeaderMap| {
        let mut headers = headers.clone();
        headers.remove("date");
        headers.remove("idempotent-replayed");
        // hyper adds it to a body of known length, as a replayed one is; not a stored header.
        headers.remove("content-length");
        headers
    };
    assert_eq!(without(&retry.headers), without(&first.headers));
    assert_eq!(first.headers["content-type"], "application/grpc");
}

async fn a_grpc_error_is_not_stored_and_the_retry_runs_again(b: Backend) {
    let server = Server::start(IdempotencyLayer::new(b.store.clone())).await;
    let channel = server.channel().await;
    let flaky = PaymentRequest {
        fail_with: Code::Unavailable as i32,
        fail_times: 1,
        ..payment(5)
    };
    // A trailers-only error (tonic's form for a unary error): the status is in the headers.
    let first = create(&channel, Some("flaky"), flaky.clone())
        .await
        .expect_err("the first run fails");
    assert_eq!(first.code(), Code::Unavailable);
    assert_eq!(first.message(), "failed on run 1");
    let retry = create(&channel, Some("flaky"), flaky.clone())
        .await
        .expect("the retry runs again");
    assert!(!is_replay(retry.metadata()));
    assert_eq!(retry.get_ref().id, "pay_2");
    let again = create(&channel, Some("flaky"), flaky)
        .await
        .expect("the success was stored");
    assert!(is_replay(again.metadata()));
    assert_eq!(again.get_ref().id, "pay_2");
    assert_eq!(server.runs(), 2);

    // Every 5xx-like code releases the key; each retry runs.
    for code in [
        Code::Internal,
        Code::Unknown,
        Code::DeadlineExceeded,
        Code::ResourceExhausted,
        Code::Aborted,
    ] {
        let failing = PaymentRequest {
            fail_with: code as i32,
            ..payment(6)
        };
        let key = format!("failing-{}", code as i32);
        let before = server.runs();
        for _ in 0..2 {
            let status = create(&channel, Some(&key), failing.clone())
                .await
                .expect_err("fails");
            assert_eq!(status.code(), code);
            assert!(!is_replay(status.metadata()));
        }
        assert_eq!(server.runs(), before + 2, "{code:?} is not stored");
    }
}

async fn a_4xx_like_grpc_status_is_stored_and_replayed(b: Backend) {
    let server = Server::start(IdempotencyLayer::new(b.store.clone())).await;
    let channel = server.channel().await;
    let missing = PaymentRequest {
        fail_with: Code::NotFound as i32,
        ..payment(8)
    };
    let first = create(&channel, Some("not-found"), missing.clone())
        .await
        .expect_err("fails");
    assert_eq!(first.code(), Code::NotFound);
    let retry = create(&channel, Some("not-found"), missing)
        .await
        .expect_err("replayed");
    assert_eq!(retry.code(), Code::NotFound);
    assert_eq!(
        retry.message(),
        "failed on run 1",
        "the stored answer, not a second run"
    );
    assert!(is_replay(retry.metadata()));
    assert_eq!(server.runs(), 1);
}

async fn an_error_in_the_trailers_after_a_reply_is_not_stored(b: Backend) {
    let server = Server::start(IdempotencyLayer::new(b.store.clone())).await;
    let channel = server.channel().await;
    let failing = PaymentRequest {
        fail_with: Code::Unavailable as i32,
        ..payment(9)
    };
    // A reply, then UNAVAILABLE in the trailers: the status is known only at the end.
    let (replies, end, _) = stream(&channel, "stream-fails", failing.clone()).await;
    assert_eq!(replies.len(), 1);
    assert_eq!(end.expect_err("ends in an error").code(), Code::Unavailable);
    let (replies, end, metadata) = stream(&channel, "stream-fails", failing).await;
    assert!(!is_replay(&metadata));
    assert_eq!(replies[0].id, "pay_2", "the retry ran again");
    assert_eq!(end.expect_err("ends in an error").code(), Code::Unavailable);
    assert_eq!(server.runs(), 2);

    // A stream that ends in OK is stored, trailers included, and replayed.
    let (first, end, _) = stream(&channel, "stream-ok", payment(10)).await;
    assert!(end.is_ok());
    let (retry, end, metadata) = stream(&channel, "stream-ok", payment(10)).await;
    assert!(end.is_ok(), "the replayed stream ends with grpc-status 0");
    assert!(is_replay(&metadata));
    assert_eq!(retry, first);
    assert_eq!(server.runs(), 3);
}

async fn a_different_request_under_the_same_key_gets_aborted(b: Backend) {
    let server = Server::start(IdempotencyLayer::new(b.store.clone())).await;
    let channel = server.channel().await;
    create(&channel, Some("reused"), payment(1))
        .await
        .expect("the first call succeeds");
    let status = create(&channel, Some("reused"), payment(2))
        .await
        .expect_err("a different request");
    assert_eq!(status.code(), Code::Aborted);
    assert!(
        status.message().contains("different request"),
        "{}",
        status.message()
    );
    assert_eq!(
        kind(&status),
        ("MISMATCH".into(), None),
        "told apart from IN_FLIGHT"
    );
    assert!(
        status.metadata().get("grpc-retry-pushback-ms").is_none(),
        "no pushback: the key must not be retried"
    );
    assert_eq!(server.runs(), 1);
}

async fn a_call_still_running_gets_aborted_with_a_pushback(b: Backend) {
    let server = Server::start(IdempotencyLayer::new(b.store.clone())).await;
    let channel = server.channel().await;
    let slow = PaymentRequest {
        delay_ms: 1_500,
        ..payment(3)
    };
    let running = tokio::spawn({
        let (channel, slow) = (channel.clone(), slow.clone());
        async move { create(&channel, Some("slow"), slow).await }
    });
    while server.runs() == 0 {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let status = create(&channel, Some("slow"), slow)
        .await
        .expect_err("still running");
    assert_eq!(status.code(), Code::Aborted);
    assert!(
        status.message().contains("still being processed"),
        "{}",
        status.message()
    );
    assert_eq!(status.metadata().get("grpc-retry-pushback-ms").unwrap(), "1000");
    assert_eq!(kind(&status), ("IN_FLIGHT".into(), Some(1)));
    running.await.unwrap().expect("the first call succeeds");
    assert_eq!(server.runs(), 1);
}

async fn a_missing_or_invalid_key_gets_invalid_argument(b: Backend) {
    let server = Server::start(IdempotencyLayer::new(b.store.clone())).await;
    let channel = server.channel().await;
    let status = create(&channel, None, payment(1)).await.expect_err("no key");
    assert_eq!(status.code(), Code::InvalidArgument);
    assert!(
        status.message().contains("Idempotency-Key"),
        "{}",
        status.message()
    );
    assert_eq!(kind(&status).0, "MISSING_KEY");
    let status = create(&channel, Some("two words"), payment(1))
        .await
        .expect_err("invalid key");
    assert_eq!(status.code(), Code::InvalidArgument);
    assert_eq!(kind(&status).0, "INVALID_KEY");
    assert_eq!(server.runs(), 0);
}

async fn a_request_over_the_body_limit_gets_resource_exhausted(b: Backend) {
    let server = Server::start(IdempotencyLayer::new(b.store.clone()).with_body_limit(64)).await;
    let channel = server.channel().await;
    let large = PaymentRequest {
        note: "x".repeat(100),
        ..payment(1)
    };
    let status = create(&channel, Some("large"), large)
        .await
        .expect_err("too large");
    assert_eq!(status.code(), Code::ResourceExhausted);
    assert_eq!(kind(&status).0, "BODY_TOO_LARGE");
    assert_eq!(server.runs(), 0);
}

async fn a_handler_past_its_timeout_gets_deadline_exceeded_and_its_retry_failed_precondition(b: Backend) {
    let layer = IdempotencyLayer::new(b.store.clone()).with_handler_timeout(Duration::from_millis(200));
    let server = Server::start(layer).await;
    let channel = server.channel().await;
    let hung = PaymentRequest {
        delay_ms: 5_000,
        ..payment(4)
    };
    let status = create(&channel, Some("hung"), hung.clone())
        .await
        .expect_err("timed out");
    assert_eq!(status.code(), Code::DeadlineExceeded);
    assert_eq!(kind(&status).0, "HANDLER_TIMED_OUT");
    // The key is kept as not replayable: the retry is told so, and nothing runs again.
    let status = create(&channel, Some("hung"), hung)
        .await
        .expect_err("not stored");
    assert_eq!(status.code(), Code::FailedPrecondition);
    assert_eq!(kind(&status), ("RESPONSE_NOT_STORED".into(), None));
    assert_eq!(server.runs(), 1);
}

async fn the_store_down_gets_unavailable(mut b: Backend) {
    let timeout = Duration::from_millis(200);
    let layer = match &mut b.redis {
        // A real outage: the Redis server is killed.
        Some((server, _)) => {
            server.kill();
            IdempotencyLayer::new(b.store.clone()).with_store_timeout(timeout)
        }
        // The memory store cannot go down; one that answers too late is unavailable all the same.
        None => {
            let slow = common::FaultyStore::new(b.store.clone()).with_answer_delay(Duration::from_secs(5));
            IdempotencyLayer::new(Arc::new(slow)).with_store_timeout(timeout)
        }
    };
    let server = Server::start(layer).await;
    let channel = server.channel().await;
    let status = create(&channel, Some("down"), payment(1))
        .await
        .expect_err("store down");
    assert_eq!(status.code(), Code::Unavailable);
    assert!(status.message().contains("store"), "{}", status.message());
    assert_eq!(kind(&status), ("STORE_UNAVAILABLE".into(), Some(1)));
    assert_eq!(status.metadata().get("grpc-retry-pushback-ms").unwrap(), "1000");
    assert_eq!(server.runs(), 0, "fail-closed: nothing ran");
}

on_both_stores!(
    a_unary_call_runs_once_and_its_retry_gets_the_same_message_and_trailers,
    a_grpc_error_is_not_stored_and_the_retry_runs_again,
    a_4xx_like_grpc_status_is_stored_and_replayed,
    an_error_in_the_trailers_after_a_reply_is_not_stored,
    a_different_request_under_the_same_key_gets_aborted,
    a_call_still_running_gets_aborted_with_a_pushback,
    a_missing_or_invalid_key_gets_invalid_argument,
    a_request_over_the_body_limit_gets_resource_exhausted,
    a_handler_past_its_timeout_gets_deadline_exceeded_and_its_retry_failed_precondition,
    the_store_down_gets_unavailable,
);

/// The standard health service (`tonic-health`) and server reflection (`tonic-reflection`,
/// v1 and v1alpha), served beside `Payments`, each asked as its usual client asks.
mod standard {
    use super::*;
    use tonic_health::pb::health_client::HealthClient;
    use tonic_health::pb::{health_check_response::ServingStatus, HealthCheckRequest};

    /// A server with `$layer` around the health service, both reflection services and
    /// `Payments`. (A macro: tonic's bounds on a layer are long to write out.)
    macro_rules! server {
        ($layer:expr) => {{
            let layer = $layer;
            let (health, reflection, reflection_alpha) = standard::services().await;
            Server::serve(move |incoming, payments| {
                tonic::transport::Server::builder()
                    .layer(layer)
                    .add_service(health)
                    .add_service(reflection)
                    .add_service(reflection_alpha)
                    .add_service(payments)
                    .serve_with_incoming(incoming)
            })
            .await
        }};
    }
    pub(super) use server;

    pub(super) async fn services() -> (
        tonic_health::pb::health_server::HealthServer<impl tonic_health::pb::health_server::Health>,
        tonic_reflection::pb::v1::server_reflection_server::ServerReflectionServer<
            impl tonic_reflection::pb::v1::server_reflection_server::ServerReflection,
        >,
        tonic_reflection::pb::v1alpha::server_reflection_server::ServerReflectionServer<
            impl tonic_reflection::pb::v1alpha::server_reflection_server::ServerReflection,
        >,
    ) {
        let (reporter, health) = tonic_health::server::health_reporter();
        reporter.set_serving::<Payments>().await;
        let reflection = tonic_reflection::server::Builder::configure()
            .register_encoded_file_descriptor_set(tonic_health::pb::FILE_DESCRIPTOR_SET)
            .build_v1()
            .expect("the reflection service");
        let reflection_alpha = tonic_reflection::server::Builder::configure()
            .register_encoded_file_descriptor_set(tonic_health::pb::FILE_DESCRIPTOR_SET)
            .build_v1alpha()
            .expect("the v1alpha reflection service");
        (health, reflection, reflection_alpha)
    }

    /// `grpc.health.v1.Health/Check`, as a Kubernetes gRPC probe calls it: no metadata.
    pub(super) async fn check(channel: &Channel, service: &str) -> Result<ServingStatus, Status> {
        let request = HealthCheckRequest {
            service: service.into(),
        };
        let answer = HealthClient::new(channel.clone()).check(request).await?;
        Ok(answer.get_ref().status())
    }

    /// The first answer of `Health/Watch`, a server stream.
    pub(super) async fn watch(channel: &Channel, service: &str) -> Result<ServingStatus, Status> {
        let request = HealthCheckRequest {
            service: service.into(),
        };
        let mut stream = HealthClient::new(channel.clone())
            .watch(request)
            .await?
            .into_inner();
        let first = stream.message().await?.expect("a first status");
        Ok(first.status())
    }

    /// The services `ServerReflectionInfo` lists, v1 and v1alpha, asked as `grpcurl list` asks:
    /// over a bidirectional stream the client keeps open while it waits for the answer.
    pub(super) async fn list_services(channel: &Channel) -> Result<(Vec<String>, Vec<String>), Status> {
        use futures_util::StreamExt;
        use tonic_reflection::pb::{v1, v1alpha};

        let request = v1::ServerReflectionRequest {
            host: String::new(),
            message_request: Some(v1::server_reflection_request::MessageRequest::ListServices(
                String::new(),
            )),
        };
        let open = futures_util::stream::iter([request]).chain(futures_util::stream::pending());
        let mut client = v1::server_reflection_client::ServerReflectionClient::new(channel.clone());
        let mut answers = client.server_reflection_info(open).await?.into_inner();
        let v1_names = match answers.message().await?.and_then(|a| a.message_response) {
            Some(v1::server_reflection_response::MessageResponse::ListServicesResponse(list)) => {
                list.service.into_iter().map(|s| s.name).collect()
            }
            other => panic!("not a list of services: {other:?}"),
        };

        let request = v1alpha::ServerReflectionRequest {
            host: String::new(),
            message_request: Some(v1alpha::server_reflection_request::MessageRequest::ListServices(
                String::new(),
            )),
        };
        let open = futures_util::stream::iter([request]).chain(futures_util::stream::pending());
        let mut client = v1alpha::server_reflection_client::ServerReflectionClient::new(channel.clone());
        let mut answers = client.server_reflection_info(open).await?.into_inner();
        let alpha_names = match answers.message().await?.and_then(|a| a.message_response) {
            Some(v1alpha::server_reflection_response::MessageResponse::ListServicesResponse(list)) => {
                list.service.into_iter().map(|s| s.name).collect()
            }
            other => panic!("not a list of services: {other:?}"),
        };
        Ok((v1_names, alpha_names))
    }
}

/// `what`, or a failure after 10 s: a call the layer held open fails rather than stalls.
async fn within<F: std::future::Future>(what: F) -> F::Output {
    tokio::time::timeout(Duration::from_secs(10), what)
        .await
        .expect("an answer, not a call held open")
}

/// The documented setup, `Server::builder().layer(IdempotencyLayer::new(..))`, with the
/// standard health and reflection services beside the application's: probes and `grpcurl`
/// pass without a key, while the application's methods still need one.
#[tokio::test]
async fn the_documented_setup_lets_the_health_check_and_reflection_pass() {
    use tonic_health::pb::health_check_response::ServingStatus;

    let server = standard::server!(IdempotencyLayer::new(tower_idempotency::MemoryStore::new()));
    let channel = server.channel().await;
    let overall = within(standard::check(&channel, "")).await;
    assert_eq!(
        overall.expect("the server's overall health, as a Kubernetes probe asks it"),
        ServingStatus::Serving
    );
    let one = within(standard::check(&channel, "test.Payments")).await;
    assert_eq!(one.expect("one service's health"), ServingStatus::Serving);
    let watched = within(standard::watch(&channel, "test.Payments")).await;
    assert_eq!(watched.expect("a watch"), ServingStatus::Serving);
    let (v1, v1alpha) = within(standard::list_services(&channel))
        .await
        .expect("reflection answers");
    for names in [&v1, &v1alpha] {
        assert!(names.iter().any(|n| n == "grpc.health.v1.Health"), "{names:?}");
    }
    // The application's own methods are covered as before.
    let status = create(&channel, None, payment(1)).await.expect_err("no key");
    assert_eq!(kind(&status).0, "MISSING_KEY");
    create(&channel, Some("h-1"), payment(1)).await.expect("keyed");
    let retry = create(&channel, Some("h-1"), payment(1)).await.expect("replayed");
    assert!(is_replay(retry.metadata()));
    assert_eq!(server.runs(), 1);

    // Turned off, gRPC's own services are covered like any other method: probes are refused.
    let covered =
        IdempotencyLayer::new(tower_idempotency::MemoryStore::new()).with_exempt_grpc_services(false);
    let server = standard::server!(covered);
    let channel = server.channel().await;
    let status = within(standard::check(&channel, "")).await.expect_err("no key");
    assert_eq!(status.code(), Code::InvalidArgument);
    assert_eq!(kind(&status).0, "MISSING_KEY");
}

/// Per-method settings: a `PolicyLayer` whose endpoints are gRPC methods keys the writes and lets
/// the reads (and gRPC's own services) pass; with `refuse_unmatched`, a key sent to a method it
/// does not cover is refused with UNIMPLEMENTED rather than ignored.
#[tokio::test]
async fn a_policy_per_method_keys_the_writes_and_lets_the_reads_pass() {
    use tonic_health::pb::health_check_response::ServingStatus;

    let policy =
        tower_idempotency::PolicyLayer::new(IdempotencyLayer::new(tower_idempotency::MemoryStore::new()))
            .with_refuse_unmatched(true)
            .endpoint([http::Method::POST], CREATE, |layer| layer)
            .expect("a gRPC method is a path pattern");
    let server = standard::server!(policy);
    let channel = server.channel().await;

    let read = unary(&channel, GET, None, payment(5))
        .await
        .expect("a read needs no key");
    assert_eq!(read.get_ref().id, "read");
    let health = within(standard::check(&channel, "")).await;
    assert_eq!(health.expect("a probe needs no key"), ServingStatus::Serving);
    let status = create(&channel, None, payment(1))
        .await
        .expect_err("a write needs its key");
    assert_eq!(status.code(), Code::InvalidArgument);
    create(&channel, Some("w-1"), payment(1)).await.expect("keyed");
    let retry = create(&channel, Some("w-1"), payment(1)).await.expect("replayed");
    assert!(is_replay(retry.metadata()));
    assert_eq!(server.runs(), 1);

    let status = unary(&channel, GET, Some("r-1"), payment(5))
        .await
        .expect_err("a key where none is honoured");
    assert_eq!(status.code(), Code::Unimplemented);
    assert_eq!(kind(&status), ("NO_ENDPOINT".into(), None));
}
