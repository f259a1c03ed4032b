//! A real Redis Cluster of three masters and three replicas on loopback: records spread over the
//! slots, each script runs on the master that owns its key, round trips stay at 2 and 1, and a
//! script cache flushed on every node is refilled.

mod common;

use common::app::{payment, router, send};
use common::cluster::Cluster;
use common::{admin, client, round_trips};
use http::StatusCode;
use tower_idempotency::IdempotencyLayer;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_redis_cluster_keeps_every_promise_across_slots() {
    let cluster = Cluster::start(2000);
    let store = common::connect(&cluster.url())
        .await
        .expect("connect to the cluster");
    store.load_scripts().await.unwrap();
    let (app, runs) = router(IdempotencyLayer::new(store));
    // Replicas count the commands they replay from their master: only masters are counted.
    let mut admins = Vec::new();
    for master in cluster.masters() {
        let admin_client = client(&format!("redis://{master}")).await;
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
    for node in cluster.addrs() {
        admin(&client(&format!("redis://{node}")).await, &["SCRIPT", "FLUSH"]).await;
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
