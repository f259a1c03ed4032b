//! A real Redis Cluster of three masters on loopback: records spread over the slots, each script
//! runs on the node that owns its key, round trips stay at 2 and 1, and a script cache flushed on
//! every node is refilled.

mod common;

use std::process::Command;
use std::time::{Duration, Instant};

use common::app::{payment, router, send};
use common::{admin, client, round_trips, RedisServer};
use http::StatusCode;
use tower_idempotency::{IdempotencyLayer, RedisStore};

struct Cluster {
    nodes: Vec<RedisServer>,
}

impl Cluster {
    fn start() -> Self {
        let nodes: Vec<RedisServer> = (0..3)
            .map(|_| {
                RedisServer::start_with(&[
                    "--cluster-enabled",
                    "yes",
                    "--cluster-config-file",
                    "nodes.conf",
                    "--cluster-node-timeout",
                    "2000",
                ])
            })
            .collect();
        let cli = std::env::var("REDIS_CLI_BIN").unwrap_or_else(|_| "redis-cli".into());
        let addresses: Vec<String> = nodes.iter().map(|n| n.addr().to_string()).collect();
        let output = Command::new(&cli)
            .args(["--cluster", "create"])
            .args(&addresses)
            .arg("--cluster-yes")
            .output()
            .unwrap_or_else(|e| panic!("cannot run `{cli}` ({e}); it comes with redis-server (redis-tools)"));
        assert!(
            output.status.success(),
            "cluster create failed: {}",
            String::from_utf8_lossy(&output.stdout)
        );
        let cluster = Self { nodes };
        cluster.wait_until_ok(&cli);
        cluster
    }

    fn wait_until_ok(&self, cli: &str) {
        let deadline = Instant::now() + Duration::from_secs(20);
        for node in &self.nodes {
            loop {
                let info = Command::new(cli)
                    .args(["-p", &node.port().to_string(), "cluster", "info"])
                    .output()
                    .expect("cluster info");
                if String::from_utf8_lossy(&info.stdout).contains("cluster_state:ok") {
                    break;
                }
                assert!(Instant::now() < deadline, "the cluster did not become ready");
                std::thread::sleep(Duration::from_millis(100));
            }
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_redis_cluster_keeps_every_promise_across_slots() {
    let cluster = Cluster::start();
    let url = format!("redis-cluster://{}", cluster.nodes[0].addr());
    let store = RedisStore::connect(&url).await.expect("connect to the cluster");
    store.load_scripts().await.unwrap();
    let (app, runs) = router(IdempotencyLayer::new(store));
    let mut admins = Vec::new();
    for node in &cluster.nodes {
        let admin_client = client(&node.url()).await;
        admin(&admin_client, &["CONFIG", "RESETSTAT"]).await;
        admins.push(admin_client);
    }

    const KEYS: usize = 30;
    for i in 0..KEYS {
        let answer = send(&app, payment(&format!("cluster-{i}"), "{}")).await;
        assert_eq!(answer.status, StatusCode::CREATED);
    }
    let mut fresh_calls = 0;
    let mut nodes_used = 0;
    for admin_client in &admins {
        let calls = round_trips(admin_client).await;
        fresh_calls += calls;
        nodes_used += usize::from(calls > 0);
        admin(admin_client, &["CONFIG", "RESETSTAT"]).await;
    }
    assert_eq!(
        fresh_calls,
        2 * KEYS as u64,
        "claim + complete per fresh request, on the owning node"
    );
    assert!(nodes_used >= 2, "records spread over the cluster's nodes");

    for i in 0..KEYS {
        assert!(send(&app, payment(&format!("cluster-{i}"), "{}"))
            .await
            .is_replay());
    }
    let mut replay_calls = 0;
    for admin_client in &admins {
        replay_calls += round_trips(admin_client).await;
    }
    assert_eq!(replay_calls, KEYS as u64, "one round trip per replay");

    // A failover or restart leaves nodes without scripts: every node is refilled on demand.
    for admin_client in &admins {
        admin(admin_client, &["SCRIPT", "FLUSH"]).await;
    }
    for i in 0..KEYS {
        assert!(send(&app, payment(&format!("cluster-{i}"), "{}"))
            .await
            .is_replay());
        let answer = send(&app, payment(&format!("cluster-new-{i}"), "{}")).await;
        assert_eq!(answer.status, StatusCode::CREATED);
    }
    assert_eq!(runs.get(), 2 * KEYS);
}
