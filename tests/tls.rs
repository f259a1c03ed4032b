//! TLS to Redis: a `redis-server` listening only for TLS, with a CA made at test time. The
//! certificate is verified against the platform's trust store, which `SSL_CERT_FILE` replaces.

mod common;

use common::app::{payment, router, send};
use common::tls::Pki;
use common::RedisServer;
use http::StatusCode;
use tower_idempotency::{IdempotencyLayer, RedisStore};

// One test, as it sets SSL_CERT_FILE for the process.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tls_is_verified_and_an_untrusted_certificate_is_refused() {
    let dir = std::env::temp_dir().join(format!("tower-idempotency-tls-{}", std::process::id()));
    let pki = Pki::generate(&dir);
    let mut args = pki.server_args();
    args.extend(["--requirepass".to_owned(), "secret".to_owned()]);
    let server = RedisServer::start_with(&args);
    let url = |host: &str| format!("rediss://:secret@{host}:{}", server.port());

    // Trusted through SSL_CERT_FILE (as the quickstart trusts a private CA): the layer works.
    std::env::set_var("SSL_CERT_FILE", &pki.ca);
    for host in ["localhost", "127.0.0.1"] {
        let store = RedisStore::connect(&url(host))
            .await
            .unwrap_or_else(|error| panic!("TLS to {host} with a trusted CA: {error}"));
        let (app, runs) = router(IdempotencyLayer::new(store));
        assert_eq!(send(&app, payment(host, "{}")).await.status, StatusCode::CREATED);
        assert!(send(&app, payment(host, "{}")).await.is_replay());
        assert_eq!(runs.get(), 1);
    }

    // A plain-text client gets nothing from the TLS port: the store really speaks TLS.
    let plain = format!("redis://:secret@127.0.0.1:{}", server.port());
    let plain_attempt =
        tokio::time::timeout(std::time::Duration::from_secs(5), RedisStore::connect(&plain)).await;
    assert!(
        !matches!(plain_attempt, Ok(Ok(_))),
        "plain text must not reach a TLS-only server"
    );

    // A certificate from a CA the trust store does not hold is refused, clearly.
    std::env::set_var("SSL_CERT_FILE", &pki.other_ca);
    let refused = tokio::time::timeout(
        std::time::Duration::from_secs(10),
        RedisStore::connect(&url("localhost")),
    )
    .await
    .expect("an untrusted certificate fails fast, never hangs");
    let error = refused
        .expect_err("an untrusted certificate is refused")
        .to_string();
    assert!(
        error.to_lowercase().contains("certificate"),
        "the error names the certificate: {error}"
    );
    std::env::remove_var("SSL_CERT_FILE");
    let _ = std::fs::remove_dir_all(&dir);
}
