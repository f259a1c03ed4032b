//! The layer mounts wherever a tower layer does: axum's `Router::layer`, `route_layer` and
//! `MethodRouter::layer`, `tower::ServiceBuilder`, and a plain hyper service over TCP.

mod common;

use std::convert::Infallible;
use std::time::Duration;

use axum::body::Body;
use axum::routing::post;
use axum::Router;
use bytes::Bytes;
use common::app::{payment, send};
use http::{Request, Response, StatusCode};
use http_body_util::{BodyExt, Full};
use tower::{Service, ServiceBuilder, ServiceExt};
use tower_idempotency::{IdempotencyLayer, MemoryStore, RequestBody};

fn counter() -> (std::sync::Arc<std::sync::atomic::AtomicUsize>, impl Fn() -> usize) {
    let count = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let c = count.clone();
    (count, move || c.load(std::sync::atomic::Ordering::SeqCst))
}

#[tokio::test]
async fn axum_router_route_layer_and_method_router() {
    let (count, runs) = counter();
    let handler = move || {
        let count = count.clone();
        async move {
            (
                StatusCode::CREATED,
                format!(
                    "run {}",
                    count.fetch_add(1, std::sync::atomic::Ordering::SeqCst) + 1
                ),
            )
        }
    };
    let required = IdempotencyLayer::new(MemoryStore::new());
    let optional = required
        .clone()
        .with_key_required(false)
        .with_retention(Duration::from_secs(60));
    let app = Router::new()
        .route("/payments", post(handler.clone()).layer(required.clone()))
        .route("/comments", post(handler.clone()))
        .route_layer(optional)
        .merge(Router::new().route("/orders", post(handler)).layer(required));

    // /payments sits under two layers (its own and the route_layer): the outer one handles it,
    // the inner one must not find the outer claim "in flight".
    for path in ["/payments", "/comments", "/orders"] {
        let key = format!("key-for-{path}");
        let request = || {
            Request::post(path)
                .header("idempotency-key", &key)
                .body(Body::from("{}"))
                .unwrap()
        };
        send(&app, request()).await;
        assert!(send(&app, request()).await.is_replay(), "{path}");
    }
    assert_eq!(runs(), 3);
    // /payments requires a key (its own layer), /comments does not.
    let keyless = |path: &str| Request::post(path).body(Body::from("{}")).unwrap();
    assert_eq!(
        send(&app, keyless("/payments")).await.status,
        StatusCode::BAD_REQUEST
    );
    assert_eq!(send(&app, keyless("/comments")).await.status, StatusCode::CREATED);
}

async fn echo(request: Request<RequestBody<Full<Bytes>>>) -> Result<Response<Full<Bytes>>, Infallible> {
    let body = request
        .into_body()
        .collect()
        .await
        .expect("a buffered body")
        .to_bytes();
    Ok(Response::new(Full::new(body)))
}

#[tokio::test]
async fn service_builder_and_service_fn() {
    let mut service = ServiceBuilder::new()
        .layer(IdempotencyLayer::new(MemoryStore::new()))
        .service_fn(echo);
    let request = || {
        Request::post("/")
            .header("idempotency-key", "sb")
            .body(Full::from("hello"))
            .unwrap()
    };
    let first = service.ready().await.unwrap().call(request()).await.unwrap();
    let retry = service.ready().await.unwrap().call(request()).await.unwrap();
    assert!(first.headers().get("idempotent-replayed").is_none());
    assert_eq!(retry.headers()["idempotent-replayed"], "true");
    assert_eq!(retry.into_body().collect().await.unwrap().to_bytes(), "hello");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_plain_hyper_server() {
    use hyper::body::Incoming;
    use hyper_util::rt::TokioIo;

    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let (count, runs) = counter();
    let handler = tower::service_fn(move |request: Request<RequestBody<Incoming>>| {
        let count = count.clone();
        async move {
            let body = request.into_body().collect().await?.to_bytes();
            count.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            Ok::<_, hyper::Error>(Response::new(Full::new(body)))
        }
    });
    let service = ServiceBuilder::new()
        .layer(IdempotencyLayer::new(MemoryStore::new()))
        .service(handler);
    let server = tokio::spawn(async move {
        loop {
            let (stream, _) = listener.accept().await.unwrap();
            let service = hyper_util::service::TowerToHyperService::new(service.clone());
            tokio::spawn(
                hyper::server::conn::http1::Builder::new().serve_connection(TokioIo::new(stream), service),
            );
        }
    });

    for _ in 0..2 {
        let stream = tokio::net::TcpStream::connect(addr).await.unwrap();
        let (mut sender, connection) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
            .await
            .unwrap();
        tokio::spawn(connection);
        let request = Request::post("/")
            .header("idempotency-key", "hyper")
            .body(Full::new(Bytes::from("over tcp")))
            .unwrap();
        let response = sender.send_request(request).await.unwrap();
        assert_eq!(response.status(), StatusCode::OK);
        assert_eq!(
            response.into_body().collect().await.unwrap().to_bytes(),
            "over tcp"
        );
    }
    assert_eq!(runs(), 1);
    server.abort();
}

#[tokio::test]
async fn the_test_app_itself_counts_runs() {
    // Guards the harness the other suites rely on: without the layer every request runs.
    let (count, runs) = counter();
    let app = Router::new().route(
        "/payments",
        post(move || {
            let count = count.clone();
            async move {
                count.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                StatusCode::CREATED
            }
        }),
    );
    send(&app, payment("x", "{}")).await;
    send(&app, payment("x", "{}")).await;
    assert_eq!(runs(), 2);
}
