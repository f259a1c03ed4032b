//! The benchmark's peer servers (see Cargo.toml): `bench_peers ADDR MODE`, with `REDIS_URL`.
//!
//! - `peer-idempotent`: `idempotent` 2.0's `IdempotencyLayer` over its `ValkeyStore` (a Lua claim
//!   with fencing tokens), every setting at its default;
//! - `peer-axum-idempotent`: `axum-idempotent` 0.6 keyed by the `Idempotency-Key` header (no
//!   claim: a read before the handler, a write after), over `ruts` sessions in Redis, responses
//!   kept 24 h. It caches only for a request that carries a session, so the server makes one
//!   session at start and puts its cookie on every request that has none (a header insert, the
//!   only work this harness adds).
//!
//! - `floor-memory`: no library, the least an in-process layer can do per request (see
//!   `floor.rs`), a yardstick for what the memory store's cells could reach at best.
//! - `floor-redis`: no library, the least a layer over Redis can do per request with `fred` (one
//!   `SET … NX GET` per request and a `SET` per fresh key, see `floor_redis.rs`), a yardstick for
//!   the Redis cells.
//!
//! All mark replays `idempotent-replayed: true`, as the bench expects. It prints what
//! bench_server prints (`bench_server: listening on …`, `bench_server: warnings=0` at exit) and
//! stops with status 0 on SIGTERM.

use std::sync::Arc;

use axum::body::Body;
use axum::extract::Request;
use axum::http::{header, HeaderValue, StatusCode};
use axum::middleware::{self, Next};
use axum::routing::get;
use axum::Router;
use fred::prelude::{Builder, ClientLike, Config};
use tower::ServiceExt;

#[path = "../../../benches/common.rs"]
mod common;
mod floor;
mod floor_redis;

type BoxError = Box<dyn std::error::Error + Send + Sync>;
type SessionStore = ruts::store::redis::RedisStore<fred::clients::Client>;

async fn idempotent_router(url: &str) -> Result<Router, BoxError> {
    let store = idempotent::valkey::ValkeyStore::with_url(url).try_build().await?;
    Ok(common::payments().layer(idempotent::middleware::IdempotencyLayer::new(store)))
}

/// Starts the one session every request will carry.
async fn start_session(session: ruts::Session<SessionStore>) -> StatusCode {
    let ttl = ruts::store::Ttl::new(24 * 3600).expect("a valid TTL");
    match session.set("bench", &1u8, ttl, None).await {
        Ok(()) => StatusCode::NO_CONTENT,
        Err(_) => StatusCode::INTERNAL_SERVER_ERROR,
    }
}

async fn axum_idempotent_router(url: &str) -> Result<Router, BoxError> {
    let client = Builder::from_config(Config::from_url(url)?).build()?;
    client.init().await?;
    let store = Arc::new(SessionStore::new(Arc::new(client)).await?);
    let options = axum_idempotent::IdempotentOptions::default()
        .use_idempotency_key_header(Some("Idempotency-Key"), true)
        .replay_header_name("idempotent-replayed")
        .expire_after(24 * 3600);
    let sessions = |router: Router| {
        router
            .layer(
                ruts::SessionLayer::new(store.clone()).with_cookie_options(
                    ruts::CookieOptions::build()
                        .name("session")
                        .path("/")
                        .max_age(24 * 3600),
                ),
            )
            .layer(tower_cookies::CookieManagerLayer::new())
    };
    let session_maker = sessions(Router::new().route("/session", get(start_session)));
    let answer = session_maker
        .oneshot(Request::get("/session").body(Body::empty())?)
        .await?;
    let set_cookie = answer
        .headers()
        .get(header::SET_COOKIE)
        .ok_or_else(|| {
            // ruts's Redis store sets field TTLs with HEXPIRE, which Redis has since 7.4.
            format!(
                "could not start a session (answered {}); ruts needs Redis 7.4 or newer: set \
                 BENCH_REDIS_SERVER (bench/peers/README.md)",
                answer.status()
            )
        })?
        .to_str()?;
    let cookie = HeaderValue::from_str(set_cookie.split(';').next().unwrap_or_default())?;
    let app =
        sessions(common::payments().layer(axum_idempotent::IdempotentLayer::<SessionStore>::new(options)));
    Ok(
        app.layer(middleware::from_fn(move |mut request: Request, next: Next| {
            let cookie = cookie.clone();
            async move {
                request.headers_mut().entry(header::COOKIE).or_insert(cookie);
                next.run(request).await
            }
        })),
    )
}

#[tokio::main]
async fn main() -> Result<(), BoxError> {
    let mut args = std::env::args().skip(1);
    let addr = args.next().unwrap_or_else(|| "127.0.0.1:3000".into());
    let mode = args.next().unwrap_or_default();
    let url = std::env::var("REDIS_URL").unwrap_or_else(|_| "redis://127.0.0.1:6379".into());
    let router = match mode.as_str() {
        "peer-idempotent" => idempotent_router(&url).await?,
        "peer-axum-idempotent" => axum_idempotent_router(&url).await?,
        "floor-memory" => floor::router(common::payments()),
        "floor-redis" => floor_redis::router(common::payments(), &url).await?,
        other => {
            eprintln!(
                "bench_server: unknown mode `{other}` (peer-idempotent, peer-axum-idempotent, floor-memory, floor-redis)"
            );
            std::process::exit(2);
        }
    };
    common::serve(&addr, &mode, router).await?;
    eprintln!("bench_server: warnings=0");
    Ok(())
}
