//! Every URL form `RedisStore::connect` (and so the quickstart's `REDIS_URL`) accepts, each on a
//! real topology started here from `redis-server`:
//!
//! | URL | topology | credentials |
//! |-----|----------|-------------|
//! | `redis://alice:…@127.0.0.1:…` | standalone | an ACL user (the `default` user is off) |
//! | `rediss://alice:…@localhost:…` | standalone, TLS only | an ACL user |
//! | `redis-cluster://…?node=…` | 3 masters + 3 replicas | none |
//! | `redis-sentinel://:…@…?node=…&sentinelServiceName=…&sentinelPassword=…` | 1 master, 1 replica, 3 sentinels | the nodes' and the sentinels' passwords |
//! | `rediss-cluster://alice:…@…?node=…` | 3 + 3, TLS only (clients, replication, cluster bus) | an ACL user |
//! | `rediss-sentinel://:…@…?…` | 1 + 1 + 3, TLS only (the sentinels too) | both passwords |
//!
//! The quickstart binary runs on every form. On the two TLS topologies the layer also runs part
//! of the behaviour suite in this process (claim, run and a byte-exact replay, 409 while running,
//! a mismatch, an operator's purge), and a TLS Sentinel store follows a `SENTINEL FAILOVER`
//! through its `+switch-master` subscriptions, which are TLS connections to the sentinels too.
//! (The plain Cluster and Sentinel run the whole suites in `store_suite.rs` and `layer_suite.rs`.)
//!
//! Each topology is started once for this binary and shared; tests keep to keys of their own.

mod common;

use std::future::Future;
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use common::app::{payment, payment_with, router, send};
use common::cluster::{Access, Cluster};
use common::demo::{call, start};
use common::sentinel::SentinelTopology;
use common::tls::Pki;
use common::RedisServer;
use http::StatusCode;
use tower_idempotency::{IdempotencyLayer, RecordState, RedisStore, Rejection};

/// The certificates every TLS server here serves, made on first use. From then on
/// `SSL_CERT_FILE` names their CA, so that the stores of this process and the quickstarts it
/// starts (which inherit the environment) trust them.
///
/// Setting an environment variable races with threads that read the environment outside `std`
/// (libc's resolver does). So every test calls this before anything else, before it has a
/// thread or a runtime (see [`run`]): the variable is set once, while every other test waits
/// here, and never changes after.
fn pki() -> &'static Pki {
    static PKI: OnceLock<Pki> = OnceLock::new();
    PKI.get_or_init(|| {
        let dir =
            std::env::temp_dir().join(format!("tower-idempotency-url-forms-pki-{}", std::process::id()));
        let pki = Pki::generate(&dir);
        std::env::set_var("SSL_CERT_FILE", &pki.ca);
        common::reap_at_exit(&[], &[&pki.dir]);
        pki
    })
}

/// Runs a test's async part on a runtime of its own, made after [`pki`].
fn run<F: Future>(test: F) -> F::Output {
    pki();
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("a tokio runtime")
        .block_on(test)
}

/// A server kept for the whole binary (a static is never dropped: reaped when the binary exits).
fn shared_server(args: Vec<String>) -> RedisServer {
    let server = RedisServer::start_with(&args);
    let pid: Vec<u32> = server.pid().into_iter().collect();
    common::reap_at_exit(&pid, &[server.dir()]);
    server
}

/// `redis://alice:…@127.0.0.1:<port>`: a standalone server only the ACL user gets into.
fn acl_url() -> String {
    static SERVER: OnceLock<RedisServer> = OnceLock::new();
    pki();
    let server = SERVER.get_or_init(|| shared_server(common::acl_user_args()));
    let (user, password) = (common::ACL_USER, common::ACL_PASSWORD);
    format!("redis://{user}:{password}@127.0.0.1:{}", server.port())
}

/// `rediss://alice:…@localhost:<port>`: the same, listening for TLS only.
fn tls_acl_url() -> String {
    static SERVER: OnceLock<RedisServer> = OnceLock::new();
    let pki = pki();
    let server = SERVER.get_or_init(|| {
        let mut args = pki.server_args();
        args.extend(common::acl_user_args());
        shared_server(args)
    });
    let (user, password) = (common::ACL_USER, common::ACL_PASSWORD);
    format!("rediss://{user}:{password}@localhost:{}", server.port())
}

/// `redis-cluster://…`: the binary's plain cluster, without credentials.
fn cluster_url() -> String {
    pki();
    Cluster::shared().url()
}

/// `redis-sentinel://…`: the binary's plain Sentinel topology, with both passwords.
fn sentinel_url() -> String {
    pki();
    common::sentinel::shared().url()
}

/// `rediss-cluster://alice:…@…`: 3 + 3 nodes speaking TLS only, the ACL user's credentials.
fn tls_cluster_url() -> String {
    static CLUSTER: OnceLock<Cluster> = OnceLock::new();
    let pki = pki();
    let cluster = CLUSTER.get_or_init(|| {
        let access = Access {
            tls: Some(pki),
            acl_user: true,
        };
        let cluster = Cluster::start_with(5000, access);
        cluster.reap_at_exit();
        cluster
    });
    cluster.url()
}

/// `rediss-sentinel://…`: master, replica and sentinels speaking TLS only, both passwords.
fn tls_sentinel_url() -> String {
    static TOPOLOGY: OnceLock<SentinelTopology> = OnceLock::new();
    let pki = pki();
    let topology = TOPOLOGY.get_or_init(|| {
        let topology = SentinelTopology::start_tls(pki);
        topology.reap_at_exit();
        topology
    });
    topology.url()
}

// The quickstart on every form.

/// Two quickstarts on `url`, as two instances of one service: a payment made on the first is
/// replayed byte for byte by the second, and a different payment under the same key is refused
/// by either as a mismatch.
async fn the_quickstart_keeps_its_promises_on(url: &str) {
    let scheme = url.split("://").next().unwrap_or_default().to_owned();
    let key = format!("url-form-{scheme}");
    let first = start(Some(url));
    let second = start(Some(url));
    assert!(
        first.store_line.starts_with("store: Redis"),
        "{}",
        first.store_line
    );

    let fresh = call(first.addr, "/payments", Some(&key), r#"{"amount": 42}"#).await;
    assert_eq!(fresh.status, StatusCode::CREATED, "{scheme}: {:?}", fresh.body);
    assert!(fresh.headers.get("idempotent-replayed").is_none());
    assert!(fresh.json["id"].is_string(), "{scheme}: a payment id");

    let replay = call(second.addr, "/payments", Some(&key), r#"{"amount": 42}"#).await;
    assert_eq!(replay.status, fresh.status, "{scheme}");
    assert_eq!(
        replay.headers.get("idempotent-replayed").map(|v| v.as_bytes()),
        Some(&b"true"[..]),
        "{scheme}: the second instance replays"
    );
    assert_eq!(
        replay.body, fresh.body,
        "{scheme}: byte for byte, the same payment id"
    );
    for header in ["content-type", "content-length", "location"] {
        assert_eq!(
            replay.headers.get(header),
            fresh.headers.get(header),
            "{scheme}: {header}"
        );
    }

    for demo in [&first, &second] {
        let mismatch = call(demo.addr, "/payments", Some(&key), r#"{"amount": 43}"#).await;
        assert_eq!(
            mismatch.status,
            StatusCode::CONFLICT,
            "{scheme}: {:?}",
            mismatch.body
        );
        assert_eq!(mismatch.headers["content-type"], "application/problem+json");
        let kind = mismatch.json["type"].as_str().unwrap_or_default();
        assert!(kind.ends_with("#variant.Mismatch"), "{scheme}: {kind}");
        assert!(mismatch.headers.get("retry-after").is_none(), "{scheme}");
    }
}

#[test]
fn the_quickstart_on_redis_with_an_acl_user() {
    let url = acl_url();
    run(the_quickstart_keeps_its_promises_on(&url));
}

#[test]
fn the_quickstart_on_rediss() {
    let url = tls_acl_url();
    run(the_quickstart_keeps_its_promises_on(&url));
}

#[test]
fn the_quickstart_on_redis_cluster() {
    let url = cluster_url();
    run(the_quickstart_keeps_its_promises_on(&url));
}

#[test]
fn the_quickstart_on_redis_sentinel() {
    let url = sentinel_url();
    run(the_quickstart_keeps_its_promises_on(&url));
}

#[test]
fn the_quickstart_on_rediss_cluster() {
    let url = tls_cluster_url();
    run(the_quickstart_keeps_its_promises_on(&url));
}

#[test]
fn the_quickstart_on_rediss_sentinel() {
    let url = tls_sentinel_url();
    run(the_quickstart_keeps_its_promises_on(&url));
}

/// A URL without the ACL user's credentials is refused: the credentials in the URLs above are
/// the ones that got in.
#[test]
fn without_credentials_the_acl_servers_refuse_the_store() {
    let plain = acl_url();
    let tls = tls_acl_url();
    run(async {
        for url in [plain, tls] {
            let anonymous = url.replace(&format!("{}:{}@", common::ACL_USER, common::ACL_PASSWORD), "");
            let attempt =
                tokio::time::timeout(Duration::from_secs(10), RedisStore::connect(&anonymous)).await;
            let error = match attempt {
                Ok(Err(error)) => error.to_string(),
                other => panic!("{anonymous} must be refused promptly, not {other:?}"),
            };
            assert!(error.contains("NOAUTH"), "{anonymous}: {error}");
        }
    });
}

// Part of the behaviour suite, in this process, on the TLS topologies.

async fn store_on(url: &str, prefix: &str) -> RedisStore {
    RedisStore::connect(url)
        .await
        .unwrap_or_else(|error| panic!("connect to {url}: {error}"))
        .with_prefix(format!("url-forms-{prefix}"))
}

fn assert_rejected(answer: &common::app::Answer, status: StatusCode, kind: &str) {
    assert_eq!(answer.status, status, "body: {:?}", answer.body);
    assert!(
        answer.problem_type().ends_with(&format!("#variant.{kind}")),
        "{}",
        answer.problem_type()
    );
    assert!(answer.extensions.get::<Rejection>().is_some());
}

/// Claim, run, complete, then replays with the same status, headers and bytes, over keys spread
/// across the slots (on a cluster: across masters).
async fn claim_run_and_replay_byte_for_byte(url: String) {
    let store = store_on(&url, "replay").await;
    let (app, runs) = router(IdempotencyLayer::new(store));
    const KEYS: usize = 12;
    for k in 0..KEYS {
        let key = format!("replay-{k}");
        let first = send(&app, payment(&key, "{\"amount\":10}")).await;
        assert_eq!(first.status, StatusCode::CREATED);
        assert!(!first.is_replay());
        let retry = send(&app, payment(&key, "{\"amount\":10}")).await;
        assert!(retry.is_replay(), "{key}");
        assert_eq!(retry.status, first.status);
        assert_eq!(retry.body, first.body);
        let mut expected = first.headers.clone();
        expected.remove("set-cookie");
        let mut replayed = retry.headers.clone();
        replayed.remove("idempotent-replayed");
        assert_eq!(replayed, expected, "every stored header is replayed as it was");
    }
    assert_eq!(runs.get(), KEYS, "each key ran once");
}

/// A retry while the first request runs gets 409 with `Retry-After`; a different request under a
/// finished key gets the mismatch, with none.
async fn in_flight_then_mismatch(url: String) {
    let store = store_on(&url, "busy").await;
    let (app, runs) = router(IdempotencyLayer::new(store));
    let slow = {
        let app = app.clone();
        tokio::spawn(async move { send(&app, payment_with("busy", &[("x-delay-ms", "600")])).await })
    };
    tokio::time::sleep(Duration::from_millis(200)).await;
    let busy = send(&app, payment("busy", "{}")).await;
    assert_rejected(&busy, StatusCode::CONFLICT, "InFlight");
    assert!(busy.headers.contains_key("retry-after"));
    assert_eq!(slow.await.unwrap().status, StatusCode::CREATED);
    assert!(send(&app, payment("busy", "{}")).await.is_replay());

    let mismatch = send(&app, payment("busy", "{\"amount\":2}")).await;
    assert_rejected(&mismatch, StatusCode::CONFLICT, "Mismatch");
    assert!(mismatch.headers.get("retry-after").is_none());
    assert_eq!(runs.get(), 1);
}

/// An operator inspects a finished key and purges it; the next request runs again.
async fn an_operator_purges_a_key(url: String) {
    let store = store_on(&url, "purge").await;
    let layer = IdempotencyLayer::new(store);
    let (app, runs) = router(layer.clone());
    send(&app, payment("purged", "{}")).await;
    let record = layer.inspect(None, "purged").await.unwrap().expect("a record");
    assert_eq!(record.state, RecordState::Completed);
    assert!(layer.purge(None, "purged").await.unwrap());
    assert!(layer.inspect(None, "purged").await.unwrap().is_none());
    assert!(!send(&app, payment("purged", "{}")).await.is_replay());
    assert_eq!(runs.get(), 2);
}

macro_rules! on_tls_topologies {
    ($($test:ident),* $(,)?) => {
        mod tls_cluster {
            $(
                #[test]
                fn $test() {
                    let url = super::tls_cluster_url();
                    super::run(super::$test(url));
                }
            )*
        }
        mod tls_sentinel {
            $(
                #[test]
                fn $test() {
                    let url = super::tls_sentinel_url();
                    super::run(super::$test(url));
                }
            )*
        }
    };
}

on_tls_topologies!(
    claim_run_and_replay_byte_for_byte,
    in_flight_then_mismatch,
    an_operator_purges_a_key
);

/// How long after the sentinels name the new master the store may still write to the old one.
/// The old master goes on acknowledging writes until the sentinels demote it, about 10 s after
/// the switch here (8 s at the least: Sentinel waits that long before it converts it), so a
/// store that does not follow `+switch-master` fails this.
const FOLLOWED_WITHIN: Duration = Duration::from_secs(5);

/// `SENTINEL FAILOVER` on a topology of this test's own (the shared one stays put for the other
/// tests): the store, connected with a `rediss-sentinel://` URL, writes to the new master within
/// [`FOLLOWED_WITHIN`] of the switch, and still replays what it stored before.
#[test]
fn a_tls_sentinel_failover_is_followed_at_once() {
    let topology = SentinelTopology::start_tls(pki());
    run(async {
        const PREFIX: &str = "failover";
        let store = RedisStore::connect(&topology.url())
            .await
            .expect("connect with a rediss-sentinel:// URL")
            .with_prefix(PREFIX);
        let layer = IdempotencyLayer::new(store);
        let (app, runs) = router(layer.clone());
        let records_on = |port: u16| {
            let keys = topology.data_cli(port, &["KEYS", &format!("{PREFIX}:*")]);
            keys.lines().filter(|line| !line.is_empty()).count()
        };

        let before = send(&app, payment("before", "{}")).await;
        assert_eq!(before.status, StatusCode::CREATED);
        let old = topology.master_port();
        let replica = (topology.nodes.iter().map(RedisServer::port))
            .find(|&port| port != old)
            .expect("a replica");
        let deadline = Instant::now() + Duration::from_secs(5);
        while records_on(replica) == 0 {
            assert!(Instant::now() < deadline, "the record never reached the replica");
            std::thread::sleep(Duration::from_millis(10));
        }

        topology.failover();
        let new = topology.wait_for_new_master(old, Duration::from_secs(15));
        let named = Instant::now();
        let baseline = records_on(new);
        let (mut sent, mut created) = (0, 0);
        let followed = loop {
            let answer = send(&app, payment(&format!("after-{sent}"), "{}")).await;
            sent += 1;
            // 503 (nothing ran) while the store reconnects; anything else is a failure.
            match answer.status {
                StatusCode::CREATED => created += 1,
                StatusCode::SERVICE_UNAVAILABLE => {}
                status => panic!("{status}: {:?}", answer.body),
            }
            if records_on(new) > baseline {
                break named.elapsed();
            }
            let old_role = topology.data_cli(old, &["ROLE"]);
            assert!(
                named.elapsed() < FOLLOWED_WITHIN,
                "{sent} requests in {FOLLOWED_WITHIN:?} after the sentinels named {new} and none was written there: \
                 the store did not follow +switch-master over TLS (the old master {old} says {:?})",
                old_role.lines().next()
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        };
        let old_role = topology.data_cli(old, &["ROLE"]);
        println!(
            "rediss-sentinel: SENTINEL FAILOVER {old} -> {new}; the store wrote to the new master {followed:?} after \
             the sentinels named it ({sent} requests; the old master was still a {:?})",
            old_role.lines().next().unwrap_or_default()
        );

        // The record made before the failover had reached the replica: replayed, and purgeable,
        // on the new master (its scripts reloaded there).
        let replay = send(&app, payment("before", "{}")).await;
        assert!(replay.is_replay());
        assert_eq!(replay.body, before.body);
        assert!(layer.purge(None, "before").await.unwrap());
        assert!(!send(&app, payment("before", "{}")).await.is_replay());
        assert_eq!(runs.get(), created + 2);
    });
}
