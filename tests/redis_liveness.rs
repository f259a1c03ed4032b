//! Connections that die without a word: a proxy freezes the flows open now (holds the sockets,
//! passes no byte, sends no FIN or RST) while new connections pass, as a cloud load balancer's
//! idle timeout, a NAT flush or a partition does. The store must notice and replace every
//! connection it uses, and what depends on a silent feed must degrade safely meanwhile.

mod common;

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::Router;
use common::app::{payment, payment_with, router, send, spawn_send};
use common::proxy::{Fault, FaultProxy};
use common::sentinel::SentinelTopology;
use common::{client, RedisServer};
use fred::prelude::*;
use fred::types::config::Options;
use http::StatusCode;
use tower_idempotency::{IdempotencyKey, IdempotencyLayer, RecordKey, RedisStore};

/// The goal: keyed requests are answered normally again this soon after a freeze.
const GOAL: Duration = Duration::from_secs(10);

/// One request of the steady stream: when it was sent and how it was answered.
struct Sent {
    at: Instant,
    answered: Option<(Instant, StatusCode)>,
}

/// Fresh keys, one every 20 ms, each from a task of its own (a frozen connection makes requests
/// wait for their timeout; the stream goes on meanwhile).
struct Stream {
    sent: Arc<Mutex<Vec<Sent>>>,
    task: tokio::task::JoinHandle<()>,
}

impl Stream {
    fn start(app: &Router, name: &'static str) -> Self {
        let sent = Arc::new(Mutex::new(Vec::new()));
        let task = tokio::spawn({
            let (app, sent) = (app.clone(), sent.clone());
            async move {
                for n in 0u64.. {
                    let index = {
                        let mut sent = sent.lock().unwrap();
                        sent.push(Sent {
                            at: Instant::now(),
                            answered: None,
                        });
                        sent.len() - 1
                    };
                    let answer = spawn_send(&app, payment(&format!("{name}-{n}"), "{}"));
                    let sent = sent.clone();
                    tokio::spawn(async move {
                        if let Ok(answer) = answer.await {
                            sent.lock().unwrap()[index].answered = Some((Instant::now(), answer.status));
                        }
                    });
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
            }
        });
        Self { sent, task }
    }

    /// Waits until every request sent in the last second was answered 201, and returns how long
    /// after `since` the last answer other than 201 came: when requests were answered normally
    /// again.
    async fn recovered_after(&self, since: Instant, limit: Duration) -> Duration {
        loop {
            let recovered = {
                let sent = self.sent.lock().unwrap();
                let last_failure = (sent.iter())
                    .filter_map(|s| s.answered)
                    .filter(|(at, status)| *at >= since && *status != StatusCode::CREATED)
                    .map(|(at, _)| at)
                    .max();
                let now = Instant::now();
                let recent_all_created = sent
                    .iter()
                    .filter(|s| now - s.at < Duration::from_secs(2) && now - s.at > Duration::from_secs(1))
                    .all(|s| {
                        s.answered
                            .is_some_and(|(_, status)| status == StatusCode::CREATED)
                    });
                match last_failure {
                    Some(failure) if recent_all_created && now - failure > Duration::from_secs(2) => {
                        Some(failure - since)
                    }
                    _ => None,
                }
            };
            if let Some(recovered) = recovered {
                return recovered;
            }
            assert!(
                since.elapsed() < limit,
                "keyed requests were not answered normally within {limit:?} of the freeze"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    async fn until_answered_normally(&self) {
        common::until_async("the stream is answered 201", || async {
            let sent = self.sent.lock().unwrap();
            sent.iter()
                .rev()
                .filter_map(|s| s.answered)
                .take(10)
                .filter(|(_, status)| *status == StatusCode::CREATED)
                .count()
                == 10
        })
        .await;
    }
}

impl Drop for Stream {
    fn drop(&mut self) {
        self.task.abort();
    }
}

// The goal: every connection open is frozen, twice in a row, under a steady stream of requests,
// and keyed requests are answered normally again within 10 s each time.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keyed_requests_recover_within_10_s_of_a_freeze_twice_in_a_row() {
    let server = RedisServer::start();
    let proxy = FaultProxy::start(server.addr()).await;
    let store = RedisStore::connect(&proxy.url())
        .await
        .unwrap()
        .with_replay_cache(1 << 20)
        .await
        .unwrap();
    let (app, runs) = router(IdempotencyLayer::new(store).with_max_wait(Duration::from_secs(5)));
    // A waiter opens the notices subscriber too, so every kind of connection is frozen.
    let first = spawn_send(&app, payment_with("waited", &[("x-delay-ms", "300")]));
    common::until("the first request runs", || runs.get() == 1).await;
    let waiter = send(&app, payment_with("waited", &[("prefer", "wait=5")])).await;
    assert!(waiter.is_replay(), "{:?}", waiter.status);
    first.await.unwrap();

    let stream = Stream::start(&app, "steady");
    stream.until_answered_normally().await;
    let mut figures = Vec::new();
    for freeze in 1..=2 {
        let connections = proxy.connections();
        proxy.black_hole_open_connections();
        let frozen = Instant::now();
        let recovered = stream
            .recovered_after(frozen, GOAL + Duration::from_secs(5))
            .await;
        println!(
            "freeze {freeze}: {connections} connections frozen; answered normally again after {recovered:?}"
        );
        assert!(recovered <= GOAL, "freeze {freeze}: {recovered:?}");
        assert!(proxy.connections() > connections, "new connections were opened");
        figures.push(recovered);
    }
    println!("FREEZE RECOVERY: {figures:?}");
}

// A client the user built and handed to `RedisStore::new` is kept alive by the same heartbeat,
// when it is built as `RedisStore::new` says: with one attempt per command, so that replacing its
// connection sends none of the user's commands again. (One without a reconnect policy is also
// reconnected by the store when a command fails; one with a policy, as here, is replaced by the
// heartbeat alone.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_users_own_client_is_replaced_too() {
    let server = RedisServer::start();
    let proxy = FaultProxy::start(server.addr()).await;
    let user_client = Builder::from_config(Config::from_url(&proxy.url()).unwrap())
        .with_connection_config(|connection| {
            RedisStore::configure_liveness(connection);
            connection.max_command_attempts = 1;
        })
        .with_performance_config(|p| p.default_command_timeout = Duration::from_secs(2))
        .set_policy(ReconnectPolicy::new_exponential(0, 1, 2_000, 2))
        .build()
        .unwrap();
    user_client.init().await.unwrap();
    let (app, _runs) = router(IdempotencyLayer::new(RedisStore::new(user_client)));
    let stream = Stream::start(&app, "user");
    stream.until_answered_normally().await;
    proxy.black_hole_open_connections();
    let frozen = Instant::now();
    let recovered = stream
        .recovered_after(frozen, GOAL + Duration::from_secs(5))
        .await;
    println!("a user's own client: answered normally again after {recovered:?}");
    assert!(recovered <= GOAL);
}

// Replacing a connection makes fred send its unanswered commands again. A client the user handed
// to the store with fred's default of 3 attempts per command (and a reconnect policy) carries the
// user's own commands, which must never run twice because the store took the connection for dead:
// its silence is reported, and the store leaves the connection to the kernel and fred.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_users_own_client_that_re_sends_commands_is_never_replaced_by_the_store() {
    let server = RedisServer::start();
    let proxy = FaultProxy::start(server.addr()).await;
    let user_client = Builder::from_config(Config::from_url(&proxy.url()).unwrap())
        .with_connection_config(RedisStore::configure_liveness)
        .set_policy(ReconnectPolicy::new_exponential(0, 1, 2_000, 2))
        .build()
        .unwrap();
    user_client.init().await.unwrap();
    assert_eq!(
        user_client.connection_config().max_command_attempts,
        3,
        "fred's default"
    );
    let store = RedisStore::new(user_client.clone());
    let (app, _runs) = router(IdempotencyLayer::new(store));
    assert_eq!(
        send(&app, payment("before", "{}")).await.status,
        StatusCode::CREATED
    );
    let opened = proxy.connections();

    // The user's own INCR is on its way when the connection goes silent.
    proxy.keep_sent();
    proxy.black_hole_open_connections();
    let incr = tokio::spawn({
        let client = user_client.with_options(&Options {
            timeout: Some(Duration::from_secs(8)),
            ..Options::default()
        });
        async move { client.incr::<i64, _>("user:counter").await }
    });
    // The heartbeat has found the connection silent by now (interval plus threshold: 4 s).
    tokio::time::sleep(Duration::from_secs(7)).await;
    let sent = proxy.sent();
    let incrs = sent.windows(4).filter(|bytes| *bytes == b"INCR").count();
    assert_eq!(incrs, 1, "the user's INCR was sent {incrs} times");
    assert_eq!(
        proxy.connections(),
        opened,
        "the store replaced the user's connection"
    );
    assert!(incr.await.unwrap().is_err(), "answered over a frozen connection");
    let stats = client(&server.url()).await;
    let counter: Option<i64> = stats.get("user:counter").await.unwrap();
    assert_eq!(counter, None, "the frozen INCR ran");
}

// Slow is not dead: every byte between the store and Redis is late, each way, by an amount that
// leaves the round trip below the command timeout, for several seconds. Requests are slow and
// answered; no connection is replaced, nothing is answered 503, and the replay cache keeps its
// copies (it serves none while its feed's pulse is older than its bound, and serves them again
// after).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_latency_spike_below_the_command_timeout_replaces_no_connection() {
    const COMMAND_TIMEOUT: Duration = Duration::from_secs(5);
    /// Each way: a round trip of 3 s, 2 s below the command timeout.
    const DELAY: Duration = Duration::from_millis(1500);
    let server = RedisServer::start();
    let stats = client(&server.url()).await;
    let proxy = FaultProxy::start(server.addr()).await;
    let store = RedisStore::connect(&proxy.url())
        .await
        .unwrap()
        .with_command_timeout(COMMAND_TIMEOUT)
        .with_replay_cache(1 << 20)
        .await
        .unwrap();
    let layer = IdempotencyLayer::new(store).with_store_timeout(COMMAND_TIMEOUT + Duration::from_secs(1));
    let (app, runs) = router(layer);
    assert_eq!(
        send(&app, payment("cached", "{}")).await.status,
        StatusCode::CREATED
    );
    assert!(
        send(&app, payment("cached", "{}")).await.is_replay(),
        "from Redis"
    );
    let from_cache = || async {
        let claims = common::command_calls(&stats, "set").await;
        let answer = send(&app, payment("cached", "{}")).await;
        answer.is_replay() && common::command_calls(&stats, "set").await == claims
    };
    assert!(from_cache().await, "the copy is served");
    let opened = proxy.connections();

    let stream = Stream::start(&app, "spike");
    stream.until_answered_normally().await;
    proxy.set_delay(DELAY);
    let spike = Instant::now();
    tokio::time::sleep(Duration::from_secs(8)).await;
    proxy.set_delay(Duration::ZERO);
    let sent_during = {
        let sent = stream.sent.lock().unwrap();
        sent.iter().filter(|s| s.at >= spike).count()
    };
    let stream_sent = stream.sent.clone();
    drop(stream);
    common::until_async("every request of the stream is answered", || async {
        let sent = stream_sent.lock().unwrap();
        sent.iter().all(|s| s.answered.is_some())
    })
    .await;
    println!("spike: {sent_during} requests sent during it");
    assert_eq!(
        proxy.connections(),
        opened,
        "a connection was replaced during the spike"
    );
    let refused: Vec<StatusCode> = (stream_sent.lock().unwrap().iter())
        .filter_map(|s| s.answered)
        .map(|(_, status)| status)
        .filter(|status| *status != StatusCode::CREATED)
        .collect();
    assert!(
        refused.is_empty(),
        "answered other than 201 during the spike: {refused:?}"
    );
    // The feed's pulse is recent again within its bound (interval plus 1 s) after the spike.
    tokio::time::sleep(Duration::from_millis(2500)).await;
    assert!(from_cache().await, "the replay cache lost its copy");
    assert_eq!(runs.get(), 1 + stream_sent.lock().unwrap().len());
}

// While its purge feed is silent, a replay cache serves nothing: a purge made meanwhile on
// another instance is never answered from the stale copy.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replay_cache_serves_nothing_while_its_feed_is_silent() {
    let server = RedisServer::start();
    let proxy = FaultProxy::start(server.addr()).await;
    let cached = RedisStore::connect(&proxy.url())
        .await
        .unwrap()
        .with_replay_cache(1 << 20)
        .await
        .unwrap();
    let (node_a, runs_a) = router(IdempotencyLayer::new(cached));
    let layer_b = IdempotencyLayer::new(RedisStore::new(client(&server.url()).await));
    let (node_b, _) = router(layer_b.clone());

    assert_eq!(
        send(&node_b, payment("purged", "{}")).await.status,
        StatusCode::CREATED
    );
    assert!(
        send(&node_a, payment("purged", "{}")).await.is_replay(),
        "answered from Redis"
    );
    assert!(
        send(&node_a, payment("purged", "{}")).await.is_replay(),
        "from the copy"
    );

    proxy.black_hole_open_connections();
    // The feed cannot carry this purge to node A. Node A has not noticed yet: for up to the
    // pulse bound (2 s) after the feed's last answered ping, it may still serve its copy; never
    // after.
    assert!(layer_b.purge(None, "purged").await.unwrap());
    let purged = Instant::now();
    let mut stale = Duration::ZERO;
    let mut timed_out = false;
    loop {
        let sent = purged.elapsed();
        let answer = send(&node_a, payment("purged", "{}")).await;
        if answer.is_replay() {
            stale = sent;
            assert!(
                sent < Duration::from_millis(2500),
                "node A replayed a purged record from its cache {sent:?} after the purge"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
            continue;
        }
        if answer.status == StatusCode::CREATED {
            break;
        }
        // A claim's timeout and the connection's replacement both fall about 4 s after the black
        // hole: a claim fred sends again on the new connection can land just after its caller
        // was answered 503. It holds the key (in flight, 409) until the release queued behind
        // it lands; nothing else writes this key, so a 409 is allowed only after a 503.
        let held = answer.status == StatusCode::CONFLICT && timed_out;
        assert!(
            answer.status == StatusCode::SERVICE_UNAVAILABLE || held,
            "node A answered {} {sent:?} after the purge (after a 503: {timed_out})",
            answer.status
        );
        timed_out |= answer.status == StatusCode::SERVICE_UNAVAILABLE;
        assert!(purged.elapsed() < GOAL, "node A did not recover");
        if held {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
    println!("node A's copy was last served {stale:?} after the unheard purge");
    assert_eq!(runs_a.get(), 1, "the purged key ran again on node A");
    // The feed is back: copies are made and purges reach them again.
    common::until_async("node A caches again", || async {
        send(&node_a, payment("purged", "{}")).await.is_replay()
    })
    .await;
    assert!(layer_b.purge(None, "purged").await.unwrap());
    common::until_async("the purge reaches node A", || async {
        !send(&node_a, payment("purged", "{}")).await.is_replay()
    })
    .await;
}

// A waiter whose notices connection goes silent is not left to its deadline: it reads its record
// and gets the replay once the first request is done.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_waiter_whose_notices_go_silent_still_gets_the_replay() {
    let server = RedisServer::start();
    let proxy = FaultProxy::start(server.addr()).await;
    let waiting = IdempotencyLayer::new(RedisStore::connect(&proxy.url()).await.unwrap())
        .with_max_wait(Duration::from_secs(30));
    let (node_a, _) = router(waiting);
    let (node_b, runs_b) = router(IdempotencyLayer::new(RedisStore::new(
        client(&server.url()).await,
    )));

    let first = spawn_send(&node_b, payment_with("slow", &[("x-delay-ms", "1500")]));
    common::until("the first request runs", || runs_b.get() == 1).await;
    let started = Instant::now();
    let waiter = spawn_send(&node_a, payment_with("slow", &[("prefer", "wait=30")]));
    // The waiter has subscribed before the freeze.
    tokio::time::sleep(Duration::from_millis(300)).await;
    proxy.black_hole_open_connections();
    let first = first.await.unwrap();
    let waited = waiter.await.unwrap();
    println!("the waiter was answered {:?} after it began", started.elapsed());
    assert!(waited.is_replay(), "{:?}", waited.status);
    assert_eq!(waited.body, first.body);
    assert!(started.elapsed() < GOAL, "not left to its 30 s deadline");
}

/// `topology`'s URL with each sentinel behind a proxy of its own.
async fn through_sentinel_proxies(topology: &SentinelTopology) -> (String, Vec<FaultProxy>) {
    let mut url = topology.url();
    let mut proxies = Vec::new();
    for port in topology.sentinel_ports() {
        let proxy = FaultProxy::start(([127, 0, 0, 1], port).into()).await;
        url = url.replace(
            &format!("127.0.0.1:{port}"),
            &format!("127.0.0.1:{}", proxy.addr().port()),
        );
        proxies.push(proxy);
    }
    (url, proxies)
}

// The Sentinel watch: frozen subscriptions are replaced; while no sentinel can be heard, claims
// are refused (a failover would go unseen) and nothing runs; once one is heard, claims go on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_sentinel_watch_is_replaced_and_claims_wait_while_no_sentinel_is_heard() {
    let topology = common::sentinel::shared();
    let (url, proxies) = through_sentinel_proxies(topology).await;
    let store = RedisStore::connect(&url)
        .await
        .unwrap()
        .with_prefix(common::sentinel::unique_prefix());
    let (app, runs) = router(IdempotencyLayer::new(store));
    assert_eq!(
        send(&app, payment("before", "{}")).await.status,
        StatusCode::CREATED
    );

    // Every sentinel has the watch's subscriptions (two channels, one pattern) before the freeze.
    let subscribed = || {
        topology.sentinel_ports().into_iter().all(|port| {
            let clients = topology.sentinel_cli(port, &["CLIENT", "LIST"]);
            clients.lines().any(|client| client.contains("sub=2 psub=1"))
        })
    };
    common::until("the watch has subscribed on every sentinel", subscribed).await;
    // Frozen subscriptions: replaced by new ones (which pass), the watch back within the goal.
    let opened: Vec<u64> = proxies.iter().map(FaultProxy::connections).collect();
    proxies.iter().for_each(FaultProxy::black_hole_open_connections);
    common::until_async("every sentinel subscription is replaced", || async {
        proxies
            .iter()
            .zip(&opened)
            .all(|(proxy, opened)| proxy.connections() > *opened)
    })
    .await;

    // No sentinel at all can be heard: claims are refused, 503, until one is.
    proxies.iter().for_each(|proxy| proxy.set(Fault::BlackHole));
    let blind = Instant::now();
    common::until_async("claims are refused", || async {
        send(
            &app,
            payment(&format!("blind-{}", blind.elapsed().as_millis()), "{}"),
        )
        .await
        .status
            == StatusCode::SERVICE_UNAVAILABLE
    })
    .await;
    println!("blind after {:?}", blind.elapsed());
    let runs_before = runs.get();
    let refused = send(&app, payment("refused", "{}")).await;
    assert_eq!(refused.status, StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(runs.get(), runs_before, "nothing ran while the watch was blind");
    proxies.iter().for_each(|proxy| proxy.set(Fault::None));
    let heard = Instant::now();
    common::until_async("claims are taken again", || async {
        send(&app, payment("refused", "{}")).await.status == StatusCode::CREATED
    })
    .await;
    println!(
        "claims taken again {:?} after the sentinels were reachable",
        heard.elapsed()
    );
}

// The heartbeat's pace is the store's setting: a ping a second by default, none when turned off
// (for connections that are counted command by command, say), and it applies to the heartbeats
// already running.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_heartbeat_pings_at_its_pace_and_can_be_turned_off() {
    let server = RedisServer::start();
    let stats = client(&server.url()).await;
    let store = RedisStore::connect(&server.url()).await.unwrap();
    let pings = || common::command_calls(&stats, "ping");
    let before = pings().await;
    tokio::time::sleep(Duration::from_millis(2500)).await;
    let beating = pings().await - before;
    assert!(beating >= 1, "{beating} pings in 2.5 s");
    let _quiet = store.with_heartbeat(None);
    tokio::time::sleep(Duration::from_millis(1100)).await; // a ping already on its way lands
    let before = pings().await;
    tokio::time::sleep(Duration::from_millis(2500)).await;
    assert_eq!(pings().await - before, 0, "no pings once turned off");
}

// Each connection is pinged on a beat of its own: while one connection's replacement takes
// seconds (its proxy passes nothing, to new connections either), the other connection of the
// pool goes on being pinged once a second. With one beat for all, every connection waited for the
// slowest ping and replacement (2 s plus up to 5 s) before its next ping.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slow_replacement_holds_back_no_other_connections_pings() {
    let server = RedisServer::start();
    let stats = client(&server.url()).await;
    let stuck = FaultProxy::start(server.addr()).await;
    let healthy = FaultProxy::start(server.addr()).await;
    let mut clients = Vec::new();
    for proxy in [&stuck, &healthy] {
        let client = Builder::from_config(Config::from_url(&proxy.url()).unwrap())
            .with_connection_config(|connection| {
                RedisStore::configure_liveness(connection);
                connection.max_command_attempts = 1; // so the store replaces it
            })
            .set_policy(ReconnectPolicy::new_exponential(0, 1, 2_000, 2))
            .build()
            .unwrap();
        client.init().await.unwrap();
        clients.push(client);
    }
    let _store = RedisStore::from_pool(Pool::from_clients(clients).unwrap());
    tokio::time::sleep(Duration::from_millis(1500)).await;

    stuck.set(Fault::BlackHole);
    let before = common::command_calls(&stats, "ping").await;
    tokio::time::sleep(Duration::from_secs(8)).await;
    // The stuck proxy passes nothing: every ping Redis counted is the healthy connection's.
    let pings = common::command_calls(&stats, "ping").await - before;
    println!("the healthy connection was pinged {pings} times in 8 s");
    assert!(
        pings >= 6,
        "the healthy connection was pinged {pings} times in 8 s while the other one was replaced"
    );
    assert!(stuck.connections() > 1, "the stuck connection was replaced");
}

/// Stalls every worker of the test's runtime (two) for `stall`: the heartbeat, fred's connection
/// tasks and the proxy stop, as in a long pause of the process or CPU starvation.
async fn stall_the_process(stall: Duration) {
    let barrier = Arc::new(std::sync::Barrier::new(2));
    let stalls: Vec<_> = (0..2)
        .map(|_| {
            let barrier = barrier.clone();
            // Both workers at once: each waits for the other before sleeping.
            tokio::spawn(async move {
                barrier.wait();
                std::thread::sleep(stall);
            })
        })
        .collect();
    for stall in stalls {
        stall.await.unwrap();
    }
}

// A stall of this process is not silence of its connections: a ping in flight when the process
// stops is answered while it cannot read, and its deadline passes meanwhile. Its connection is
// pinged again, not replaced. (Here each ping is always in flight: a 600 ms delay each way.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stall_of_the_process_replaces_no_connection() {
    let server = RedisServer::start();
    let proxy = FaultProxy::start(server.addr()).await;
    let store = RedisStore::connect(&proxy.url()).await.unwrap();
    let (app, _runs) = router(IdempotencyLayer::new(store));
    proxy.set_delay(Duration::from_millis(600));
    assert_eq!(
        send(&app, payment("before", "{}")).await.status,
        StatusCode::CREATED
    );
    tokio::time::sleep(Duration::from_secs(2)).await;
    let opened = proxy.connections();
    for _ in 0..2 {
        stall_the_process(Duration::from_secs(5)).await;
        tokio::time::sleep(Duration::from_secs(3)).await;
    }
    assert_eq!(
        proxy.connections(),
        opened,
        "a connection was replaced after a stall"
    );
    assert_eq!(
        send(&app, payment("after", "{}")).await.status,
        StatusCode::CREATED
    );
}

/// Resumes a node stopped with `SIGSTOP` when dropped, so a failed test leaves no node stopped.
struct Stopped(u32);

impl Stopped {
    fn stop(pid: u32) -> Self {
        signal(pid, "STOP");
        Self(pid)
    }
}

impl Drop for Stopped {
    fn drop(&mut self) {
        signal(self.0, "CONT");
    }
}

fn signal(pid: u32, signal: &str) {
    let status = std::process::Command::new("kill")
        .args([&format!("-{signal}"), &pid.to_string()])
        .status()
        .expect("run kill");
    assert!(status.success(), "kill -{signal} {pid}");
}

/// The claims (`SET`) `masters` have served.
fn claims_on(cluster: &common::cluster::Cluster, masters: &[std::net::SocketAddr]) -> u64 {
    let calls = |master: &std::net::SocketAddr| {
        let info = cluster.cli(master.port(), &["INFO", "commandstats"]);
        (info.lines())
            .find_map(|line| line.strip_prefix("cmdstat_set:calls="))
            .and_then(|rest| rest.split(',').next())
            .and_then(|n| n.parse::<u64>().ok())
            .unwrap_or(0)
    };
    masters.iter().map(calls).sum()
}

/// How many subscribed clients (`SUBSCRIBE`) the node at `port` has.
fn subscribers(cluster: &common::cluster::Cluster, port: u16) -> usize {
    let clients = cluster.cli(port, &["CLIENT", "LIST"]);
    clients
        .lines()
        .filter(|client| client.contains(" sub=1 "))
        .count()
}

// On Redis Cluster a replay cache's subscription lives on one master (fred sends `SUBSCRIBE` to
// the master of a slot of the client's id) and a keyless `PING` goes to whichever connection
// comes first: every connection a feed depends on must be proven on itself. Only the master that
// carries the subscriptions of three caches is frozen (`SIGSTOP`; the node timeout is long, so no
// failover): purges published from then on cannot reach those caches, so none may serve its copy
// later than its pulse bound (2 s) after the freeze. A repeat answered then is a replay read from
// Redis (its record lives on another master, which counts the claim), never the copy.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_a_cluster_a_cache_whose_subscriptions_master_is_frozen_serves_nothing() {
    let mut cluster = common::cluster::Cluster::start(60_000);
    let url = cluster.url();
    let masters = cluster.masters();
    // Caches until three have their subscriptions on one master: the one to freeze.
    let mut on_master: Vec<Vec<RedisStore>> = masters.iter().map(|_| Vec::new()).collect();
    let frozen = 'found: {
        for _ in 0..30 {
            let before: Vec<usize> = masters.iter().map(|m| subscribers(&cluster, m.port())).collect();
            let store = RedisStore::connect(&url)
                .await
                .unwrap()
                .with_replay_cache(1 << 20)
                .await
                .unwrap();
            let after: Vec<usize> = masters.iter().map(|m| subscribers(&cluster, m.port())).collect();
            let Some(index) = (0..masters.len()).find(|&i| after[i] > before[i]) else {
                panic!("no master gained the cache's subscription");
            };
            on_master[index].push(store);
            if on_master[index].len() == 3 {
                break 'found index;
            }
        }
        panic!("no master carries three caches' subscriptions after 30 caches");
    };
    let frozen_master = masters[frozen];
    let live: Vec<std::net::SocketAddr> = masters.iter().copied().filter(|m| *m != frozen_master).collect();
    let caches = std::mem::take(&mut on_master[frozen]);
    drop(on_master);
    // One key per cache, each on a master that stays live.
    let mut keys = Vec::new();
    for n in 0.. {
        let key = format!("cluster-cached-{n}");
        let record = caches[0].redis_key(&RecordKey::new(None, IdempotencyKey::parse(&key).unwrap()));
        let slot = cluster.slots_of(&[record])[0];
        if cluster.shard_of(slot).master != frozen_master {
            keys.push(key);
        }
        if keys.len() == caches.len() {
            break;
        }
    }
    let mut apps = Vec::new();
    for (cache, key) in caches.into_iter().zip(&keys) {
        let (app, _) = router(IdempotencyLayer::new(cache));
        assert_eq!(send(&app, payment(key, "{}")).await.status, StatusCode::CREATED);
        assert!(send(&app, payment(key, "{}")).await.is_replay(), "from Redis");
        let claims = claims_on(&cluster, &live);
        assert!(send(&app, payment(key, "{}")).await.is_replay(), "from the copy");
        assert_eq!(
            claims_on(&cluster, &live),
            claims,
            "the copy is served with no claim"
        );
        apps.push(app);
    }

    let pid = cluster.node_mut(frozen_master).pid().expect("the master runs");
    let _stopped = Stopped::stop(pid);
    tokio::time::sleep(Duration::from_millis(2500)).await;
    let mut from_copy = Vec::new();
    for (app, key) in apps.iter().zip(&keys) {
        let claims = claims_on(&cluster, &live);
        let answer = send(app, payment(key, "{}")).await;
        // A replay with no claim on the record's (live) master came from the copy.
        from_copy.push(answer.is_replay() && claims_on(&cluster, &live) == claims);
    }
    println!("served from the copy 2.5 s after the freeze: {from_copy:?}");
    assert!(
        from_copy.iter().all(|served| !served),
        "a cache served its copy 2.5 s after the master of its subscription froze: {from_copy:?}"
    );
}
