//! A history checker over real faults (issue 36), in the spirit of Jepsen: many clients on many
//! keys in several scopes (tenants sharing key names) against three layer nodes on one Redis,
//! while a fault schedule drawn from a seed delays, freezes, resets and cuts the nodes'
//! connections to Redis, pauses Redis and kills it -9, and kills -9 the node that runs as a
//! child process. Every request and its answer, every effect (in a ledger outside the system
//! under test: append-only files written before the handler answers, so a killed process's
//! effects survive it), every fault and every report of the layer's reconciliation hook is
//! recorded with a time on the monotonic clock the processes share; then the checker
//! (tests/history/checker.rs, a pure function, unit-tested on hand-made histories) verifies the
//! whole history: (a) at most one effect per (scope, key) beyond the documented limits it can
//! see in the history, (b) every 2xx answer, replays among them, is the key's effect's value,
//! (c) no answer names another scope or key, (d) every request answered, or refused clearly,
//! in time.
//!
//! It prints its seed; `HISTORY_SEED=<seed> scripts/test.sh --test history` draws the same
//! fault schedule and the same workload again. The timing of real servers and processes is not
//! deterministic, so the interleaving (and a failure that depends on it) may differ: the
//! schedule, the kinds, targets and lengths of the faults and when they start, is the same.
//! `HISTORY_DURATION=<seconds>` (default 30) sets how long faults are injected and keys keep
//! starting: the long run documented in docs/guarantees.md.
//!
//! `history_on_sentinel` runs it on Sentinel (a master, two replicas, three sentinels; the
//! stores with the durability option): graceful failovers, kills -9 of the master, kills of the
//! child node (`HISTORY_TOPOLOGY=sentinel` runs `history` there alone, for a long run).
//!
//! `history_on_cluster` runs it on Redis Cluster (three masters, a replica each,
//! `cluster-node-timeout` 1 s; the stores with the durability option): graceful failovers of a
//! master (`CLUSTER FAILOVER` on its replica), kills -9 of a master (its replica promoted, the
//! killed node back as the new master's replica), kills of the child node
//! (`HISTORY_TOPOLOGY=cluster` runs `history` there alone).
//!
//! A failing run prints, for the first keys run twice without an excuse, their timelines
//! (requests, answers, effects, reports, faults), every fault with its times, and the child
//! nodes' logs (warnings, and the layer's notices), with the wall-clock time of the traces' zero.
//!
//! The faults must land: a kind none of whose faults left a mark (requests in flight where it
//! hit, a write whose answer was cut, a request that met a killed process) fails the run as a
//! run that tested nothing.
//!
//! Redis runs with `appendonly yes` and `appendfsync always`: a kill -9 then loses nothing it
//! acknowledged, so its restarts exercise reconnection and the layer's reactions to a dead
//! store, not the documented limit of a Redis restarted empty (which loses claims by design and
//! would make every double run excusable).

mod common;
mod history {
    pub mod checker;
}

use std::collections::BTreeMap;
use std::hash::{Hash, Hasher};
use std::io::Write;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::body::Body;
use axum::routing::post;
use axum::Router;
use common::cluster::Cluster;
use common::proxy::{Fault as ProxyFault, FaultProxy};
use common::sentinel::SentinelTopology;
use common::storm::InFlight;
use common::RedisServer;
use history::checker::{
    self, Attempt, Effect, Fault, FaultKind, History, Limits, Nanos, Outcome, Report, Violation,
};
use http::{HeaderMap, Request, StatusCode};
use http_body_util::BodyExt;
use rand::rngs::StdRng;
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};
use tower::ServiceExt;
use tower_idempotency::{IdempotencyLayer, ReconciliationKind, RedisStore, ReplicaAcks, Scope};

const TENANTS: [&str; 3] = ["t0", "t1", "t2"];
/// Key names started each generation, the same names in every tenant.
const KEYS_PER_GENERATION: usize = 4;
const CLIENTS_PER_KEY: usize = 3;
const CALLS_PER_CLIENT: usize = 2;
/// A generation of keys starts this often while faults are injected.
const GENERATION_EVERY: Duration = Duration::from_millis(1000);
/// The standalone nodes' store timeout (the command timeout too).
const TIMEOUT: Duration = Duration::from_millis(250);
/// A call (retried until a 2xx) still unanswered after this gives up; the checker reports it.
const CALL_DEADLINE: Duration = Duration::from_secs(60);
/// At most this share of the keys may run twice within the documented limits: faults that
/// excuse everything would let the run test nothing.
const LIMITS: Limits = Limits {
    max_excused_share: 0.1,
};
/// The node names: `a` and `b` in this process, `c` a child process killed and restarted.
const NODES: [&str; 3] = ["a", "b", "c"];

/// The Redis deployment the nodes of a run share, and the faults drawn for it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Topology {
    /// One redis-server (AOF, `appendfsync always`), each node behind a fault proxy of its own.
    Standalone,
    /// A master, two replicas and three sentinels (`down-after-milliseconds` 1 s); the stores
    /// wait for both replicas' acknowledgement of each claim and completion (the durability
    /// option, `RedisStore::with_replica_acks`). With one of the two required, a failover may
    /// promote the replica that did not acknowledge (the documented limit, shown in
    /// tests/redis_replica_acks.rs): a 9-minute run on a loaded machine ran 35 keys twice, each
    /// in the seconds after a failover, as that limit does.
    Sentinel,
    /// Redis Cluster: three masters with a replica each (`cluster-node-timeout` 1 s); the
    /// stores use the durability option as with Sentinel: without it, a master killed -9 takes
    /// the claims it had not yet sent its replica with it (asynchronous replication, the
    /// documented limit), and nothing reports that.
    Cluster,
}

/// `cluster-node-timeout` of the Cluster topology: a killed master's replica takes over about
/// this long after it died.
const CLUSTER_NODE_TIMEOUT_MS: u64 = 1000;

impl Topology {
    fn name(self) -> &'static str {
        match self {
            Topology::Standalone => "standalone",
            Topology::Sentinel => "sentinel",
            Topology::Cluster => "cluster",
        }
    }

    fn named(name: &str) -> Self {
        match name {
            "standalone" => Topology::Standalone,
            "sentinel" => Topology::Sentinel,
            "cluster" => Topology::Cluster,
            _ => panic!("no topology {name:?}"),
        }
    }

    /// Standalone: 1 s, so that a freeze of 1.5 s outlasts it now and then (the documented
    /// limit). Sentinel: above 1.5 x the longest failover (a kill -9 is seen after 1 s, and
    /// promoted a few seconds later on a loaded machine), as docs/guarantees.md asks. Cluster:
    /// the same (a killed master is seen failed after the 1 s node timeout, its replica elected
    /// after that).
    fn lease(self) -> Duration {
        match self {
            Topology::Standalone => Duration::from_millis(1000),
            Topology::Sentinel | Topology::Cluster => Duration::from_secs(10),
        }
    }

    /// An attempt not answered within this is a hang. A property with a wide margin, not a
    /// benchmark: standalone, with a 1 s lease and a 250 ms store timeout, a request is answered
    /// (or refused) within a few seconds even across a 1.5 s freeze or a Redis restart; with
    /// Sentinel, a claim waits at the fence until the new master is confirmed (a few seconds);
    /// with Cluster, a call on a failed master's slots until its replica is promoted (seconds).
    /// Only a request stuck for good waits this out.
    fn hang_bound(self) -> Duration {
        match self {
            Topology::Standalone => Duration::from_secs(10),
            Topology::Sentinel | Topology::Cluster => Duration::from_secs(30),
        }
    }

    /// The fault kinds its schedules draw from, each once per round.
    fn kinds(self) -> &'static [FaultKind] {
        match self {
            Topology::Standalone => &[
                FaultKind::Delay,
                FaultKind::Freeze,
                FaultKind::Reset,
                FaultKind::CutAfterWrite,
                FaultKind::RedisPaused,
                FaultKind::RedisKilled,
                FaultKind::NodeKilled,
            ],
            Topology::Sentinel => &[
                FaultKind::SentinelFailover,
                FaultKind::MasterKilled,
                FaultKind::NodeKilled,
            ],
            Topology::Cluster => &[
                FaultKind::ClusterFailover,
                FaultKind::MasterKilled,
                FaultKind::NodeKilled,
            ],
        }
    }

    /// A node's store on `url` (a fault proxy's, the sentinels', or the cluster's).
    async fn store(self, url: &str) -> RedisStore {
        match self {
            Topology::Standalone => RedisStore::new(patient_client(url).await).with_command_timeout(TIMEOUT),
            Topology::Sentinel | Topology::Cluster => {
                let store = RedisStore::connect(url)
                    .await
                    .unwrap_or_else(|e| panic!("connect to {url}: {e}"));
                // Every replica: any of them may be promoted (one per shard on the Cluster).
                let replicas = if self == Topology::Sentinel { 2 } else { 1 };
                let acks = ReplicaAcks::new(replicas).timeout(Duration::from_millis(250));
                store
                    .with_replica_acks(acks)
                    .await
                    .expect("the durability option")
            }
        }
    }
}

/// A node's client, connected however long that takes, up to 30 s: the child node restarts at
/// any moment of the run, on a machine CI loads with other test binaries and the fuzzers, and
/// once missed the shared helper's 1 s connection timeout there; it panicked, and the run ended
/// with it ("the child node c2 exited"). A first connection that fails is a slow start here,
/// not a finding: the faults the run injects are on the nodes' connections once they serve.
async fn patient_client(url: &str) -> fred::clients::Client {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    loop {
        match common::connected(url, 3).await {
            Ok(client) => return client,
            Err(error) if tokio::time::Instant::now() < deadline => {
                eprintln!("a node's first connection to {url} failed ({error}); trying again");
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
            Err(error) => panic!("a node could not connect to {url} in 30 s: {error}"),
        }
    }
}

/// Now on `CLOCK_MONOTONIC`, which every process of the machine shares (`Instant` is the same
/// clock but cannot be sent to another process).
fn now() -> Nanos {
    let mut time = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime writes the timespec it is given, which lives for the call.
    let status = unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut time) };
    assert_eq!(status, 0, "clock_gettime(CLOCK_MONOTONIC)");
    time.tv_sec as u64 * 1_000_000_000 + time.tv_nsec as u64
}

/// Appends one line with a single `write` to a file opened for appending: the kernel keeps it
/// whatever happens to the process after, and lines of concurrent writers never interleave.
fn append_line(path: &Path, line: &str) {
    let mut file = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(path)
        .unwrap_or_else(|e| panic!("open {}: {e}", path.display()));
    file.write_all(format!("{line}\n").as_bytes())
        .expect("append to the ledger");
}

/// A layer node: `POST /payments`, scoped by `x-tenant`, whose handler appends its effect to
/// `effects-<process>.log` before answering, and whose reconciliation hook appends to
/// `reports-<process>.log`.
fn node_app(topology: Topology, store: RedisStore, dir: &Path, process: &str) -> Router {
    let reports = dir.join(format!("reports-{process}.log"));
    let effects = dir.join(format!("effects-{process}.log"));
    let node_name = process.to_owned();
    let process: Arc<str> = process.into();
    let mut layer = IdempotencyLayer::new(store).with_lease(topology.lease());
    if topology == Topology::Standalone {
        layer = layer.with_store_timeout(TIMEOUT);
    }
    let layer = layer
        .with_scope(Scope::header("x-tenant"))
        .with_reconciliation(move |event| {
            let kind = match event.kind {
                ReconciliationKind::ClaimLost => "ClaimLost",
                ReconciliationKind::CompletionFailed { .. } => "CompletionFailed",
                ReconciliationKind::LostBeforeReplicated => "LostBeforeReplicated",
                ReconciliationKind::ReplicationAbandoned { .. } => "ReplicationAbandoned",
                ReconciliationKind::NotStorable { .. } => "NotStorable",
                _ => "Other",
            };
            let scope = event.key.scope().unwrap_or("-");
            let line = format!("{}\t{scope}\t{}\t{kind}", now(), event.key.key().as_str());
            append_line(&reports, &line);
        });
    let counter = Arc::new(AtomicU64::new(0));
    let handler = move |headers: HeaderMap| {
        let (effects, process, counter) = (effects.clone(), process.clone(), counter.clone());
        async move {
            let header = |name: &str| headers[name].to_str().expect("ASCII test headers").to_owned();
            let (scope, key) = (header("x-tenant"), header("idempotency-key"));
            let id = format!("{process}-{}", counter.fetch_add(1, Ordering::SeqCst) + 1);
            append_line(&effects, &format!("{}\t{scope}\t{key}\t{id}", now()));
            let delay: u64 = header("x-delay-ms").parse().expect("a delay in ms");
            tokio::time::sleep(Duration::from_millis(delay)).await;
            (StatusCode::CREATED, checker::effect_value(&scope, &key, &id))
        }
    };
    // Every line the layer logs for this node carries its name (`node{name=a}`), background
    // tasks' too (they are spawned in the request's span): nodes a and b share a process.
    let span = tracing::info_span!("node", name = %node_name);
    let in_span = tower::util::MapFutureLayer::new(move |request| {
        tracing::Instrument::instrument(request, span.clone())
    });
    Router::new()
        .route("/payments", post(handler))
        .layer(layer)
        .layer(in_span)
}

/// The in-process nodes' log (`warnings-local.txt` in the run's directory): the file of the run
/// under way, for the test binary's one subscriber (its runs take turns).
static LOCAL_LOG: Mutex<Option<std::fs::File>> = Mutex::new(None);

struct LocalLog;

impl std::io::Write for LocalLog {
    fn write(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
        if let Some(file) = LOCAL_LOG.lock().unwrap_or_else(|p| p.into_inner()).as_mut() {
            std::io::Write::write_all(file, bytes)?;
        }
        Ok(bytes.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// Logs the in-process nodes' warnings and the layer's notices to `dir`'s `warnings-local.txt`,
/// as each child node logs to its own file.
fn log_local_nodes(dir: &Path) {
    let file = std::fs::File::create(dir.join("warnings-local.txt")).expect("the local nodes' log");
    *LOCAL_LOG.lock().unwrap_or_else(|p| p.into_inner()) = Some(file);
    let _ = tracing_subscriber::fmt()
        .with_env_filter("warn,tower_idempotency=info")
        .with_ansi(false)
        .with_writer(|| LocalLog)
        .try_init();
}

/// The child process's side: serves node `c` over HTTP until killed, or until the test that
/// started it closes its stdin (it died: no orphan is left behind).
fn serve_child_node(process: &str) {
    let dir = PathBuf::from(std::env::var("HISTORY_DIR").expect("HISTORY_DIR"));
    let redis = std::env::var("HISTORY_REDIS_URL").expect("HISTORY_REDIS_URL");
    let topology = Topology::named(&std::env::var("HISTORY_TOPOLOGY").expect("HISTORY_TOPOLOGY"));
    // The layer's warnings and notices, kept beside the ledger: what a failing run's trace is
    // read with.
    let log = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(dir.join(format!("warnings-{process}.txt")))
        .expect("the node's log");
    tracing_subscriber::fmt()
        // The layer's own notices too: whether the store heard a failover begin.
        .with_env_filter("warn,tower_idempotency=info")
        .with_ansi(false)
        .with_writer(Mutex::new(log))
        .init();
    std::thread::spawn(|| {
        let _ = std::io::Read::read_to_end(&mut std::io::stdin(), &mut Vec::new());
        std::process::exit(0);
    });
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    runtime.block_on(async {
        let app = node_app(topology, topology.store(&redis).await, &dir, process);
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        // Written whole, then renamed: the test never reads half an address.
        let ready = dir.join(format!("addr-{process}"));
        std::fs::write(ready.with_extension("tmp"), addr.to_string()).unwrap();
        std::fs::rename(ready.with_extension("tmp"), &ready).unwrap();
        axum::serve(listener, app).await.unwrap();
    });
}

/// The child node's current process.
struct ChildNode {
    child: Child,
    process: String,
}

impl ChildNode {
    /// Starts incarnation `n` of node `c`: this test binary again, running only this test, which
    /// serves the node when `HISTORY_NODE` names it.
    async fn start(n: usize, topology: Topology, dir: &Path, redis_url: &str) -> (Self, SocketAddr) {
        let process = format!("c{n}");
        let child = Command::new(std::env::current_exe().expect("the test binary"))
            .args(["--exact", "history", "--nocapture", "--test-threads", "1"])
            .env("HISTORY_NODE", &process)
            .env("HISTORY_DIR", dir)
            .env("HISTORY_REDIS_URL", redis_url)
            .env("HISTORY_TOPOLOGY", topology.name())
            .stdin(Stdio::piped())
            .stdout(Stdio::null())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("start the child node");
        let ready = dir.join(format!("addr-{process}"));
        let mut node = Self { child, process };
        for _ in 0..1000 {
            if let Ok(addr) = std::fs::read_to_string(&ready) {
                return (node, addr.parse().expect("an address"));
            }
            if let Ok(Some(status)) = node.child.try_wait() {
                panic!("the child node {} exited: {status}", node.process);
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        node.kill();
        panic!("the child node did not start serving within 10 s");
    }

    /// kill -9.
    fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for ChildNode {
    fn drop(&mut self) {
        self.kill();
    }
}

/// Where a client sends a request: a node in this process, or the child's current address.
#[derive(Clone)]
enum Target {
    Local(Router),
    Remote(Arc<Mutex<SocketAddr>>),
}

/// What an attempt got, before the checker sees it.
async fn send(target: &Target, request: Request<Body>) -> Outcome {
    let response = match target {
        Target::Local(router) => router.clone().oneshot(request).await.expect("infallible"),
        Target::Remote(addr) => {
            let addr = *addr.lock().unwrap();
            match send_over_tcp(addr, request).await {
                Ok(response) => response,
                Err(error) => return Outcome::Transport(error),
            }
        }
    };
    let status = response.status().as_u16();
    let (replayed, problem) = {
        let header = |name: &str| response.headers().get(name).and_then(|v| v.to_str().ok());
        let replayed = header("idempotent-replayed") == Some("true");
        let problem = header("content-type").is_some_and(|t| t.starts_with("application/problem+json"));
        (replayed, problem)
    };
    match response.into_body().collect().await {
        Ok(body) => Outcome::Answer {
            status,
            replayed,
            problem,
            body: body.to_bytes(),
        },
        Err(error) => Outcome::Transport(format!("body: {error}")),
    }
}

async fn send_over_tcp(addr: SocketAddr, request: Request<Body>) -> Result<http::Response<Body>, String> {
    let stream = tokio::net::TcpStream::connect(addr)
        .await
        .map_err(|e| format!("connect: {e}"))?;
    let (mut sender, connection) =
        hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(stream))
            .await
            .map_err(|e| format!("handshake: {e}"))?;
    tokio::spawn(connection);
    let response = sender
        .send_request(request)
        .await
        .map_err(|e| format!("request: {e}"))?;
    Ok(response.map(Body::new))
}

/// What the run records as it goes, and what the fault injector aims by.
#[derive(Default)]
struct Recorder {
    attempts: Mutex<Vec<Attempt>>,
    calls: AtomicU64,
    /// Requests in flight on each node now: where a fault would land.
    in_flight: [AtomicUsize; 3],
}

/// One client: `CALLS_PER_CLIENT` calls on its key, each retried (on a node drawn each time)
/// until a 2xx, every attempt recorded.
async fn run_client(
    topology: Topology,
    targets: [Target; 3],
    scope: &'static str,
    key: String,
    client: u64,
    seed: u64,
    recorder: Arc<Recorder>,
) {
    let mut rng = StdRng::seed_from_u64(seed);
    let delay_ms: u64 = rng.random_range(10..150);
    // The same body in every tenant: only the scope keeps one tenant's answer from another.
    let body = format!("{{\"key\":\"{key}\"}}");
    let fingerprint = {
        let mut hasher = std::hash::DefaultHasher::new();
        body.hash(&mut hasher);
        hasher.finish()
    };
    for _ in 0..CALLS_PER_CLIENT {
        let call = recorder.calls.fetch_add(1, Ordering::SeqCst);
        let started = now();
        loop {
            let n = rng.random_range(0..NODES.len());
            let request = Request::post("/payments")
                .header("idempotency-key", &key)
                .header("x-tenant", scope)
                .header("content-type", "application/json")
                .header("x-delay-ms", delay_ms.to_string())
                .body(Body::from(body.clone()))
                .unwrap();
            // Now and then the client hangs up after a while (its future is dropped).
            let patience = if rng.random_bool(0.1) {
                Some(Duration::from_millis(rng.random_range(5..120)))
            } else {
                None
            };
            let in_flight = InFlight::new(&recorder.in_flight[n]);
            let sent = now();
            let outcome = match tokio::time::timeout(
                patience.unwrap_or(topology.hang_bound()),
                send(&targets[n], request),
            )
            .await
            {
                Ok(outcome) => outcome,
                Err(_) if patience.is_some() => Outcome::HungUp,
                Err(_) => Outcome::Hung,
            };
            drop(in_flight);
            let done = matches!(&outcome, Outcome::Answer { status, .. } if (200..300).contains(status));
            recorder.attempts.lock().unwrap().push(Attempt {
                call,
                client,
                node: NODES[n].to_owned(),
                scope: scope.to_owned(),
                key: key.clone(),
                fingerprint,
                sent,
                finished: now(),
                outcome,
            });
            if done || now() - started > CALL_DEADLINE.as_nanos() as u64 {
                break;
            }
            tokio::time::sleep(Duration::from_millis(rng.random_range(10..80))).await;
        }
    }
}

/// One fault of the schedule: when it starts (from the run's start), what, where, how long.
#[derive(Clone, Debug)]
struct Planned {
    at: Duration,
    kind: FaultKind,
    /// The node, for faults on a node's connections or process.
    node: usize,
    hold: Duration,
    /// For a cut after a write: the write it cuts, a claim (`SET … NX`) or a script call (a
    /// completion, a renewal or a release: `EVALSHA`).
    cut: &'static [u8],
}

/// The fault schedule for `duration`, drawn from `seed` alone: each kind once per round, in a
/// shuffled order, so the first round (a few seconds) has every kind.
fn schedule(seed: u64, duration: Duration, topology: Topology) -> Vec<Planned> {
    let mut rng = StdRng::seed_from_u64(seed ^ 0xfa017);
    let mut plan = Vec::new();
    let mut at = Duration::from_millis(300);
    let mut deck = Vec::new();
    while at + Duration::from_secs(1) < duration {
        if deck.is_empty() {
            deck = topology.kinds().to_vec();
            deck.shuffle(&mut rng);
        }
        let kind = deck.pop().expect("a full deck");
        let node = match kind {
            FaultKind::NodeKilled => 2,
            _ => rng.random_range(0..NODES.len()),
        };
        let hold = match kind {
            FaultKind::Delay => Duration::from_millis(rng.random_range(200..900)),
            // Now and then longer than the lease: the documented limit.
            FaultKind::Freeze if rng.random_bool(0.2) => topology.lease() + Duration::from_millis(500),
            FaultKind::Freeze => Duration::from_millis(rng.random_range(100..900)),
            FaultKind::Reset => Duration::from_millis(rng.random_range(20..300)),
            // How long the cut stays armed, waiting for a write to cut.
            FaultKind::CutAfterWrite => Duration::from_millis(1000),
            FaultKind::RedisPaused => Duration::from_millis(rng.random_range(100..800)),
            // How long Redis, or the node, stays down.
            FaultKind::RedisKilled | FaultKind::NodeKilled => {
                Duration::from_millis(rng.random_range(50..400))
            }
            // A failover lasts as long as it lasts: the injector waits until it is over and
            // the topology settled again.
            FaultKind::SentinelFailover | FaultKind::ClusterFailover | FaultKind::MasterKilled => {
                Duration::ZERO
            }
        };
        let cut: &'static [u8] = if rng.random_bool(0.5) {
            b"$2\r\nNX\r\n"
        } else {
            b"EVALSHA"
        };
        plan.push(Planned {
            at,
            kind,
            node,
            hold,
            cut,
        });
        at += hold + Duration::from_millis(rng.random_range(200..900));
    }
    plan
}

/// What the injector leaves for the checker and for the landing check.
#[derive(Default)]
struct Injected {
    faults: Vec<Fault>,
    /// Per kind, how many of its faults left a mark.
    landed: BTreeMap<FaultKind, usize>,
    /// Faults of the schedule not injected: due after the workload ended.
    skipped: usize,
}

/// Everything the injector acts on.
struct Rig {
    topology: Topology,
    /// Standalone: the server, and a proxy in front of it for each node.
    server: Option<RedisServer>,
    proxies: Vec<Arc<FaultProxy>>,
    sentinel: Option<SentinelTopology>,
    cluster: Option<Cluster>,
    /// What the child node connects to: its proxy's URL, the sentinels', or the cluster's.
    child_url: String,
    child: ChildNode,
    child_addr: Arc<Mutex<SocketAddr>>,
    incarnations: usize,
    dir: PathBuf,
}

async fn inject(
    mut rig: Rig,
    plan: Vec<Planned>,
    start: tokio::time::Instant,
    end: Duration,
    recorder: Arc<Recorder>,
) -> (Rig, Injected) {
    let mut injected = Injected::default();
    for planned in plan {
        // A schedule overrun by slow failovers stops with the workload.
        if start.elapsed() > end {
            injected.skipped += 1;
            continue;
        }
        tokio::time::sleep_until(start + planned.at).await;
        let busy = |n: usize| recorder.in_flight[n].load(Ordering::SeqCst) > 0;
        // Aimed at traffic: it waits (half a second at most) for a request in flight where it
        // hits, so that it lands on requests rather than on idle connections. The schedule
        // stays the seed's; only its start moves with the traffic.
        let hits = |n: usize| match planned.kind {
            FaultKind::RedisPaused
            | FaultKind::RedisKilled
            | FaultKind::SentinelFailover
            | FaultKind::ClusterFailover
            | FaultKind::MasterKilled => busy(0) || busy(1) || busy(2),
            _ => busy(n),
        };
        let aimed = tokio::time::Instant::now();
        while !hits(planned.node) && aimed.elapsed() < Duration::from_millis(500) {
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
        let anywhere = busy(0) || busy(1) || busy(2);
        // Faults on a node's path to Redis exist where the nodes have proxies (standalone).
        let proxy = || rig.proxies[planned.node].clone();
        let began = now();
        let mut target = NODES[planned.node].to_owned();
        let landed = match planned.kind {
            FaultKind::Delay => {
                proxy().set_delay(planned.hold / 4);
                tokio::time::sleep(planned.hold).await;
                proxy().set_delay(Duration::ZERO);
                busy(planned.node)
            }
            FaultKind::Freeze => {
                proxy().set(ProxyFault::BlackHole);
                tokio::time::sleep(planned.hold).await;
                proxy().set(ProxyFault::None);
                busy(planned.node)
            }
            FaultKind::Reset => {
                proxy().set(ProxyFault::Drop);
                tokio::time::sleep(planned.hold).await;
                proxy().set(ProxyFault::None);
                busy(planned.node)
            }
            FaultKind::CutAfterWrite => {
                // A claim or a script call reaches Redis; its answer never comes back, its
                // connection closes.
                let proxy = proxy();
                let cuts = proxy.cuts();
                proxy.cut_instead_of_answering(planned.cut, 1);
                let armed = tokio::time::Instant::now();
                while proxy.cuts() == cuts && armed.elapsed() < planned.hold {
                    tokio::time::sleep(Duration::from_millis(5)).await;
                }
                proxy.cut_instead_of_answering(planned.cut, 0);
                proxy.cuts() > cuts
            }
            FaultKind::RedisPaused => {
                target = "redis".into();
                let server = rig.server.as_ref().expect("a standalone server");
                let pid = server.pid().expect("redis runs") as libc::pid_t;
                // SAFETY: signals to the redis-server this test started and owns.
                unsafe { libc::kill(pid, libc::SIGSTOP) };
                tokio::time::sleep(planned.hold).await;
                unsafe { libc::kill(pid, libc::SIGCONT) };
                anywhere
            }
            FaultKind::RedisKilled => {
                target = "redis".into();
                let server = rig.server.as_mut().expect("a standalone server");
                server.kill();
                tokio::time::sleep(planned.hold).await;
                // Blocking (it polls the new server's port), briefly; from its append-only file.
                tokio::task::block_in_place(|| server.restart());
                anywhere
            }
            FaultKind::SentinelFailover => {
                target = "redis".into();
                let sentinel = rig.sentinel.as_ref().expect("a Sentinel topology");
                println!("{}", subscribed(sentinel));
                // Blocking (redis-cli), for as long as the failover takes. The sentinels may
                // refuse it (one under way) or give it up (the replica they picked was being
                // converted by another sentinel): then it did not land, and the run goes on.
                tokio::task::block_in_place(|| {
                    let old = sentinel.master_port();
                    let failed_over = (sentinel.try_failover())
                        .and_then(|()| {
                            (sentinel.try_wait_for_new_master(old, Duration::from_secs(30)))
                                .ok_or_else(|| format!("{old} still the master after 30 s"))
                        })
                        .map_err(|why| println!("sentinel failover did not happen: {why}"));
                    sentinel.wait_until_settled(Duration::from_secs(60));
                    failed_over.is_ok() && anywhere
                })
            }
            FaultKind::MasterKilled if rig.topology == Topology::Sentinel => {
                target = "redis".into();
                let sentinel = rig.sentinel.as_mut().expect("a Sentinel topology");
                println!("{}", subscribed(sentinel));
                tokio::task::block_in_place(|| {
                    let old = sentinel.master_port();
                    sentinel.node_mut(old).kill();
                    let new = sentinel.wait_for_new_master(old, Duration::from_secs(30));
                    // Back as a replica of the new master, as a machine replaced after a crash.
                    sentinel.restart_as_replica(old, new);
                    sentinel.wait_until_settled(Duration::from_secs(30));
                });
                anywhere
            }
            FaultKind::ClusterFailover | FaultKind::MasterKilled => {
                target = "redis".into();
                let cluster = rig.cluster.as_mut().expect("a Cluster topology");
                // Blocking (redis-cli), for as long as the failover takes.
                let slot = SHARD_SLOTS[planned.node];
                tokio::task::block_in_place(|| fail_over_cluster(cluster, planned.kind, slot));
                anywhere
            }
            FaultKind::NodeKilled => {
                target = rig.child.process.clone();
                let landed = busy(2);
                rig.child.kill();
                tokio::time::sleep(planned.hold).await;
                rig.incarnations += 1;
                let (child, addr) =
                    ChildNode::start(rig.incarnations, rig.topology, &rig.dir, &rig.child_url).await;
                rig.child = child;
                *rig.child_addr.lock().unwrap() = addr;
                landed
            }
        };
        injected.faults.push(Fault {
            kind: planned.kind,
            target,
            start: began,
            end: now(),
        });
        *injected.landed.entry(planned.kind).or_default() += usize::from(landed);
    }
    (rig, injected)
}

/// A slot in each of the cluster's shards (`--cluster create` splits the 16384 slots in three):
/// the shard a Cluster failover hits is drawn by the fault's node index.
const SHARD_SLOTS: [u16; 3] = [0, 5461, 10923];

/// Fails over the master serving `slot`: `CLUSTER FAILOVER` on its replica (graceful), or a
/// kill -9 of the master, which comes back as the new master's replica once its replica is
/// promoted (a node that rejoins with an older epoch follows the one that took its slots; with
/// the durability option, the shard takes claims again once its master has a replica). Returns
/// once every node agrees on the new layout and every replica is in sync.
fn fail_over_cluster(cluster: &mut Cluster, kind: FaultKind, slot: u16) {
    let shard = cluster.shard_of(slot);
    let replica = shard.replicas[0];
    let master = shard.master;
    if kind == FaultKind::ClusterFailover {
        println!("cluster failover: {master} to its replica {replica}");
        // Redis drops a manual failover that does not finish within 5 s (its master's offset
        // not reached, or no majority of votes in time) and says nothing: CI's load once left
        // one undone for 30 s. An operator asks again, and so does this.
        let promoted = (1..=3).any(|ask| {
            if ask > 1 {
                println!("cluster failover: {replica} not promoted after 10 s; asking again ({ask})");
            }
            let answer = cluster.cli(replica.port(), &["CLUSTER", "FAILOVER"]);
            // A master's refusal: promoted after all, just after the last look.
            let promoted_meanwhile = ask > 1 && cluster.is_master(replica);
            assert!(
                answer.contains("OK") || promoted_meanwhile,
                "CLUSTER FAILOVER answered {answer:?}"
            );
            promoted_within(cluster, replica, Duration::from_secs(10))
        });
        assert!(
            promoted,
            "the replica {replica} was never promoted, asked 3 times"
        );
    } else {
        println!("cluster master {master} killed, its replica {replica}");
        cluster.node_mut(master).kill();
        assert!(
            promoted_within(cluster, replica, Duration::from_secs(30)),
            "the replica {replica} was never promoted"
        );
        cluster.node_mut(master).restart();
    }
    cluster.wait_until_ready();
}

/// Whether `replica` answers as a master within `limit`: the failover done (on this node; the
/// caller then waits for every node to agree).
fn promoted_within(cluster: &Cluster, replica: SocketAddr, limit: Duration) -> bool {
    let waited = std::time::Instant::now();
    while !cluster.is_master(replica) {
        if waited.elapsed() > limit {
            return false;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    true
}

/// How many connections are subscribed to the failover events on each sentinel (`CLIENT LIST`:
/// `sub=` channels, `psub=` patterns), at a failover's start: a store that does not listen
/// cannot be fenced.
fn subscribed(sentinel: &SentinelTopology) -> String {
    let counts: Vec<String> = (sentinel.sentinel_ports().into_iter())
        .map(|port| {
            let list = sentinel.sentinel_cli(port, &["CLIENT", "LIST"]);
            let listening = list.lines().filter(|line| line.contains(" sub=2 ")).count();
            format!("{port}: {listening}")
        })
        .collect();
    format!(
        "connections subscribed to the failover events, per sentinel: {}",
        counts.join(", ")
    )
}

/// The ledger and the reports every process appended, read back.
fn read_ledger(dir: &Path) -> (Vec<Effect>, Vec<Report>) {
    let (mut effects, mut reports) = (Vec::new(), Vec::new());
    for entry in std::fs::read_dir(dir).expect("the run's directory") {
        let path = entry.expect("an entry").path();
        let name = path
            .file_name()
            .and_then(|n| n.to_str())
            .unwrap_or_default()
            .to_owned();
        let Some((kind, process)) = name.strip_suffix(".log").and_then(|n| n.split_once('-')) else {
            continue;
        };
        let text = std::fs::read_to_string(&path).expect("a ledger file");
        for line in text.lines() {
            let fields: Vec<&str> = line.split('\t').collect();
            let [at, scope, key, last] = fields[..] else {
                panic!("a torn ledger line in {name}: {line:?}");
            };
            let (at, node) = (at.parse().expect("a time"), process.to_owned());
            let (scope, key) = (scope.to_owned(), key.to_owned());
            match kind {
                "effects" => effects.push(Effect {
                    at,
                    node,
                    scope,
                    key,
                    id: last.to_owned(),
                }),
                "reports" => reports.push(Report {
                    at,
                    node,
                    scope,
                    key,
                    kind: last.to_owned(),
                }),
                _ => panic!("an unknown ledger file {name}"),
            }
        }
    }
    (effects, reports)
}

/// The run on standalone Redis: faults on the nodes' connections, on Redis, and on the child
/// node (or, with `HISTORY_TOPOLOGY=sentinel`, the Sentinel run below).
#[test]
fn history() {
    // The child node is this test binary again, running this test with `HISTORY_NODE` set.
    if let Ok(process) = std::env::var("HISTORY_NODE") {
        return serve_child_node(&process);
    }
    let topology =
        std::env::var("HISTORY_TOPOLOGY").map_or(Topology::Standalone, |name| Topology::named(&name));
    run_seeded(topology);
}

/// The run on Sentinel: graceful failovers and kills -9 of the master, with the durability
/// option, and kills of the child node. It found keys run twice by a store started in the second
/// before a failover (seed 7 in every run, 3 to 5 keys), whose Sentinel watch followed no
/// announcement before its second liveness tick; since it follows them from its start, and
/// takes no claim before it listens, seeds 4, 6 and 7 ran clean.
#[test]
fn history_on_sentinel() {
    if std::env::var("HISTORY_NODE").is_ok() || std::env::var("HISTORY_TOPOLOGY").is_ok() {
        // A child node, or a run of `history` on a topology named by hand.
        return;
    }
    run_seeded(Topology::Sentinel);
}

/// The run on Redis Cluster: graceful failovers and kills -9 of a master, with the durability
/// option, and kills of the child node.
#[test]
fn history_on_cluster() {
    if std::env::var("HISTORY_NODE").is_ok() || std::env::var("HISTORY_TOPOLOGY").is_ok() {
        // A child node, or a run of `history` on a topology named by hand.
        return;
    }
    run_seeded(Topology::Cluster);
}

/// One run at a time: each starts its own servers and injects faults whose timing matters.
static ONE_AT_A_TIME: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn run_seeded(topology: Topology) {
    let _alone = ONE_AT_A_TIME
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    let seed: u64 = std::env::var("HISTORY_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| rand::rng().random());
    let duration = Duration::from_secs(
        std::env::var("HISTORY_DURATION")
            .ok()
            .map(|s| s.parse().expect("HISTORY_DURATION in seconds"))
            .unwrap_or(30),
    );
    let name = topology.name();
    println!("history ({name}) seed: {seed} (replay with HISTORY_SEED={seed}), faults for {duration:?}");
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    runtime.block_on(run(topology, seed, duration));
}

async fn run(topology: Topology, seed: u64, duration: Duration) {
    let began = std::time::Instant::now();
    let (mut server, mut sentinel, mut cluster, mut proxies) = (None, None, None, Vec::new());
    // Each node's URL, and the run's directory (removed with the servers).
    let (urls, dir) = match topology {
        Topology::Standalone => {
            let started = RedisServer::start_with(&["--appendonly", "yes", "--appendfsync", "always"]);
            for _ in NODES {
                proxies.push(Arc::new(FaultProxy::start(started.addr()).await));
            }
            let dir = started.dir().join("history");
            server = Some(started);
            (proxies.iter().map(|p| p.url()).collect::<Vec<_>>(), dir)
        }
        Topology::Sentinel => {
            let started = tokio::task::block_in_place(|| SentinelTopology::start_with_replicas(2));
            let url = started.url();
            let dir = started.nodes[0].dir().join("history");
            sentinel = Some(started);
            (vec![url; NODES.len()], dir)
        }
        Topology::Cluster => {
            let started = tokio::task::block_in_place(|| Cluster::start(CLUSTER_NODE_TIMEOUT_MS));
            let url = started.url();
            let dir = started.dir().join("history");
            cluster = Some(started);
            (vec![url; NODES.len()], dir)
        }
    };
    std::fs::create_dir_all(&dir).expect("the run's directory");
    log_local_nodes(&dir);
    let mut targets = Vec::new();
    for (n, node) in NODES[..2].iter().enumerate() {
        let store = topology.store(&urls[n]).await;
        targets.push(Target::Local(node_app(topology, store, &dir, node)));
    }
    let (child, addr) = ChildNode::start(1, topology, &dir, &urls[2]).await;
    let child_addr = Arc::new(Mutex::new(addr));
    targets.push(Target::Remote(child_addr.clone()));
    let targets: [Target; 3] = [targets[0].clone(), targets[1].clone(), targets[2].clone()];

    let plan = schedule(seed, duration, topology);
    let plan_figures: BTreeMap<&str, usize> = plan.iter().fold(BTreeMap::new(), |mut m, p| {
        *m.entry(p.kind.name()).or_default() += 1;
        m
    });
    println!("fault schedule: {} faults {plan_figures:?}", plan.len());
    let recorder = Arc::new(Recorder::default());
    let rig = Rig {
        topology,
        server: server.take(),
        proxies: proxies.clone(),
        sentinel: sentinel.take(),
        cluster: cluster.take(),
        child_url: urls[2].clone(),
        child,
        child_addr,
        incarnations: 1,
        dir: dir.clone(),
    };
    let start = tokio::time::Instant::now();
    let injector = tokio::spawn(inject(rig, plan, start, duration, recorder.clone()));

    let mut clients = Vec::new();
    let generations = (duration.as_millis() / GENERATION_EVERY.as_millis()).max(1) as u64;
    let mut client_id = 0;
    for generation in 0..generations {
        tokio::time::sleep_until(start + GENERATION_EVERY * generation as u32).await;
        for k in 0..KEYS_PER_GENERATION {
            for scope in TENANTS {
                for _ in 0..CLIENTS_PER_KEY {
                    client_id += 1;
                    let key = format!("g{generation}-k{k}");
                    let client_seed = seed.wrapping_mul(31).wrapping_add(client_id);
                    let (targets, recorder) = (targets.clone(), recorder.clone());
                    // The keys of a generation start spread over it, so requests are in flight
                    // all along; a key's clients start together, within a few milliseconds.
                    let key_start = GENERATION_EVERY * k as u32 / KEYS_PER_GENERATION as u32;
                    clients.push(tokio::spawn(async move {
                        let jitter = Duration::from_millis(client_seed % 30);
                        tokio::time::sleep(key_start + jitter).await;
                        run_client(topology, targets, scope, key, client_id, client_seed, recorder).await
                    }));
                }
            }
        }
    }
    for client in clients {
        client.await.expect("a client panicked");
    }
    let (rig, injected) = injector.await.expect("the fault injector panicked");
    for proxy in &proxies {
        proxy.set(ProxyFault::None);
        proxy.set_delay(Duration::ZERO);
    }
    // The last incarnation's effects are in the ledger already: stop it.
    let Rig {
        server,
        sentinel,
        cluster,
        mut child,
        ..
    } = rig;
    child.kill();

    let (effects, reports) = read_ledger(&dir);
    let history = History {
        attempts: std::mem::take(&mut *recorder.attempts.lock().unwrap()),
        effects,
        faults: injected.faults,
        reports,
    };
    let verdict = checker::check(&history, LIMITS);
    let name = topology.name();
    let mut report_kinds: BTreeMap<&str, usize> = BTreeMap::new();
    for report in &history.reports {
        *report_kinds.entry(report.kind.as_str()).or_default() += 1;
    }
    let statuses = history.attempts.iter().fold(BTreeMap::new(), |mut m, a| {
        if let Outcome::Answer { status, .. } = a.outcome {
            *m.entry(status).or_insert(0usize) += 1;
        }
        m
    });
    println!(
        "history ({name}): {} calls, {} requests ({} replayed, statuses {statuses:?}, {} without an HTTP answer, {} hang-ups), \
         {} keys in {} scopes, {} effects, in {:.1?}",
        verdict.calls,
        history.attempts.len(),
        verdict.replays,
        verdict.transport_errors,
        verdict.hang_ups,
        verdict.keys,
        TENANTS.len(),
        history.effects.len(),
        began.elapsed()
    );
    let faults: Vec<String> = topology
        .kinds()
        .iter()
        .map(|&kind| {
            let count = history.faults.iter().filter(|f| f.kind == kind).count();
            format!(
                "{} x{count} ({} landed)",
                kind.name(),
                injected.landed.get(&kind).copied().unwrap_or(0)
            )
        })
        .collect();
    println!(
        "faults: {} (not injected, due after the workload: {})",
        faults.join(", "),
        injected.skipped
    );
    println!("layer reports: {report_kinds:?}");
    let excuses: Vec<String> = (verdict.excuses.iter())
        .map(|(e, n)| format!("{}: {n}", e.name()))
        .collect();
    println!(
        "extra effects excused: {}",
        if excuses.is_empty() {
            "none".into()
        } else {
            excuses.join(", ")
        }
    );
    println!("violations: {}", verdict.violations.len());

    let mut failures: Vec<String> = verdict.violations.iter().map(ToString::to_string).collect();
    // The first keys run twice without an excuse, as timelines: the reduced failure.
    let origin = history.attempts.iter().map(|a| a.sent).min().unwrap_or_default();
    let doubled = verdict.violations.iter().filter_map(|v| match v {
        Violation::UnexcusedEffect { scope, key, .. } => Some((scope, key)),
        _ => None,
    });
    for (scope, key) in doubled.take(3) {
        println!("{scope}/{key}:\n{}", checker::trace(&history, scope, key, origin));
    }
    if !verdict.violations.is_empty() {
        let ms = |t: Nanos| t.saturating_sub(origin) as f64 / 1e6;
        // The logs' wall clock at the trace's zero, to read the nodes' logs beside the trace.
        let since_epoch = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .expect("a clock after 1970");
        let zero = since_epoch.as_secs_f64() - (now() - origin) as f64 / 1e9;
        println!("the traces' 0 ms is {zero:.3} s after the Unix epoch (`date -ud @{zero:.3}`)");
        for fault in &history.faults {
            let (kind, target) = (fault.kind.name(), &fault.target);
            println!(
                "fault {kind} on {target}: {:.1} to {:.1} ms",
                ms(fault.start),
                ms(fault.end)
            );
        }
        for report in &history.reports {
            let (kind, node) = (&report.kind, &report.node);
            println!(
                "report {kind} from {node} on {}/{} at {:.1} ms",
                report.scope,
                report.key,
                ms(report.at)
            );
        }
        for entry in std::fs::read_dir(&dir).expect("the run's directory").flatten() {
            let name = entry.file_name().to_string_lossy().into_owned();
            if name.starts_with("warnings-") {
                let text = std::fs::read_to_string(entry.path()).unwrap_or_default();
                println!("{name}:\n{text}");
            }
        }
    }
    for &kind in topology.kinds() {
        if injected.landed.get(&kind).copied().unwrap_or(0) == 0 {
            failures.push(format!("the fault \"{}\" never left its mark", kind.name()));
        }
    }
    if topology == Topology::Standalone && !statuses.contains_key(&503) {
        failures.push("no request was answered 503: the faults reached no client".into());
    }
    if verdict.transport_errors == 0 {
        failures.push("no request met a killed node".into());
    }
    drop((server, sentinel, cluster));
    let shown = failures.len().min(40);
    assert!(
        failures.is_empty(),
        "seed {seed}: {} failures (first {shown}):\n{}",
        failures.len(),
        failures[..shown].join("\n")
    );
}
