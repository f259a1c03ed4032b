//! TLS to Redis: a `redis-server` listening only for TLS, with a CA made at test time. The
//! certificate is verified against the platform's trust store, which `SSL_CERT_FILE` replaces.

mod common;

use std::path::{Path, PathBuf};

use common::app::{payment, router, send};
use common::RedisServer;
use http::StatusCode;
use rcgen::{BasicConstraints, CertificateParams, IsCa, Issuer, KeyPair};
use tower_idempotency::{IdempotencyLayer, RedisStore};

/// A CA, a server certificate it signed (for `localhost` and 127.0.0.1), and a second CA that
/// signed nothing here.
struct Pki {
    ca: PathBuf,
    other_ca: PathBuf,
    server_cert: PathBuf,
    server_key: PathBuf,
}

fn ca(name: &str) -> (CertificateParams, KeyPair) {
    let mut params = CertificateParams::new(Vec::new()).unwrap();
    params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    params.distinguished_name.push(rcgen::DnType::CommonName, name);
    (params, KeyPair::generate().unwrap())
}

fn write_pki(dir: &Path) -> Pki {
    std::fs::create_dir_all(dir).unwrap();
    let (ca_params, ca_key) = ca("tower-idempotency test CA");
    let ca_cert = ca_params.self_signed(&ca_key).unwrap();
    let (other_params, other_key) = ca("an unrelated CA");
    let other_cert = other_params.self_signed(&other_key).unwrap();
    let issuer = Issuer::new(ca_params, ca_key);
    let server_key = KeyPair::generate().unwrap();
    let server_params = CertificateParams::new(vec!["localhost".into(), "127.0.0.1".into()]).unwrap();
    let server_cert = server_params.signed_by(&server_key, &issuer).unwrap();
    let write = |name: &str, pem: String| {
        let path = dir.join(name);
        std::fs::write(&path, pem).unwrap();
        path
    };
    Pki {
        ca: write("ca.pem", ca_cert.pem()),
        other_ca: write("other-ca.pem", other_cert.pem()),
        server_cert: write("server.pem", server_cert.pem()),
        server_key: write("server.key", server_key.serialize_pem()),
    }
}

// One test, as it sets SSL_CERT_FILE for the process.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tls_is_verified_and_an_untrusted_certificate_is_refused() {
    let dir = std::env::temp_dir().join(format!("tower-idempotency-tls-{}", std::process::id()));
    let pki = write_pki(&dir);
    let path = |p: &PathBuf| p.to_str().unwrap().to_owned();
    let server = RedisServer::start_with(&[
        "--port",
        "0",
        "--tls-port",
        "{port}",
        "--tls-cert-file",
        &path(&pki.server_cert),
        "--tls-key-file",
        &path(&pki.server_key),
        "--tls-ca-cert-file",
        &path(&pki.ca),
        "--tls-auth-clients",
        "no",
        "--requirepass",
        "secret",
    ]);
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
