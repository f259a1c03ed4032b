//! A Redis Cluster of 3 masters and 3 replicas on loopback, made of [`RedisServer`]s: started
//! with `redis-cli --cluster create … --cluster-replicas 1`, ready once every node reports
//! `cluster_state:ok`, sees a replica for every master, and every replica is in sync with its
//! master.
//!
//! Suite tests share one cluster per test binary ([`Cluster::shared`]): six processes started
//! once instead of once per test. Each test keeps to its own key prefix.
//!
//! [`Cluster::start_with`] starts one that speaks TLS only (clients, replication and the cluster
//! bus) and/or lets clients in only as the ACL user ([`super::acl_user_args`]).

use std::net::SocketAddr;
use std::process::{Command, Stdio};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use super::tls::Pki;
use super::RedisServer;

const MASTERS: usize = 3;
const READY_TIMEOUT: Duration = Duration::from_secs(30);

fn redis_cli_binary() -> String {
    std::env::var("REDIS_CLI_BIN").unwrap_or_else(|_| "redis-cli".into())
}

/// Runs `redis-cli -p <port> <args>` and returns its output (RESP2 answers as `redis-cli`
/// prints them without a terminal: one value a line). For a cluster of [`Cluster::start`].
pub fn cli(port: u16, args: &[&str]) -> String {
    cli_with(port, &[], args)
}

/// [`cli`] with `access` (TLS, credentials) before the command.
fn cli_with(port: u16, access: &[String], args: &[&str]) -> String {
    let cli = redis_cli_binary();
    let output = Command::new(&cli)
        .args(["-h", "127.0.0.1", "-p", &port.to_string()])
        .args(access)
        .args(args)
        .stdin(Stdio::null())
        .output()
        .unwrap_or_else(|e| {
            panic!("cannot run `{cli}` ({e}); it comes with redis-server (apt-get install redis-tools)")
        });
    String::from_utf8_lossy(&output.stdout).into_owned()
}

/// The nodes serving one slot range: its master and the master's replicas.
#[derive(Debug, Clone)]
pub struct Shard {
    pub master: SocketAddr,
    pub replicas: Vec<SocketAddr>,
    /// The master's slot ranges, first and last slot included.
    pub slots: Vec<(u16, u16)>,
}

impl Shard {
    pub fn serves(&self, slot: u16) -> bool {
        self.slots
            .iter()
            .any(|&(first, last)| (first..=last).contains(&slot))
    }
}

/// One line of `CLUSTER NODES`.
#[derive(Debug)]
struct NodeLine {
    id: String,
    addr: SocketAddr,
    is_master: bool,
    failed: bool,
    master_id: String,
    slots: Vec<(u16, u16)>,
}

fn parse_cluster_nodes(text: &str) -> Vec<NodeLine> {
    text.lines()
        .filter_map(|line| {
            let fields: Vec<&str> = line.split_whitespace().collect();
            if fields.len() < 8 {
                return None;
            }
            // `127.0.0.1:7000@17000` (the bus port after the `@`, a hostname after a `,`).
            let addr = fields[1].split(['@', ',']).next()?.parse().ok()?;
            let flags = fields[2];
            let slots = fields[8..]
                .iter()
                .filter(|range| !range.starts_with('['))
                .filter_map(|range| match range.split_once('-') {
                    Some((first, last)) => Some((first.parse().ok()?, last.parse().ok()?)),
                    None => range.parse().ok().map(|slot| (slot, slot)),
                })
                .collect();
            Some(NodeLine {
                id: fields[0].to_owned(),
                addr,
                is_master: flags.contains("master"),
                failed: flags.contains("fail") && !flags.contains("fail?"),
                master_id: fields[3].to_owned(),
                slots,
            })
        })
        .collect()
}

/// How clients reach a cluster's nodes.
#[derive(Clone, Copy, Default)]
pub struct Access<'a> {
    /// TLS only, with these certificates: clients, replication and the cluster bus.
    pub tls: Option<&'a Pki>,
    /// Clients get in only as [`super::ACL_USER`] (the `default` user is off).
    pub acl_user: bool,
}

pub struct Cluster {
    nodes: Vec<RedisServer>,
    /// `redis-cluster` or `rediss-cluster`.
    scheme: &'static str,
    /// `user:password@`, or empty.
    credentials: String,
    /// What `redis-cli` needs to reach a node (TLS, credentials).
    cli_access: Vec<String>,
}

impl Cluster {
    /// Starts 3 masters and 3 replicas. `node_timeout_ms` is `cluster-node-timeout`: how long a
    /// master may be unreachable before its replica takes over.
    pub fn start(node_timeout_ms: u64) -> Self {
        Self::start_with(node_timeout_ms, Access::default())
    }

    /// [`start`](Self::start), the nodes reached as `access` says.
    pub fn start_with(node_timeout_ms: u64, access: Access<'_>) -> Self {
        let started = Instant::now();
        let node_timeout = node_timeout_ms.to_string();
        let mut secured: Vec<String> = Vec::new();
        let mut cli_access: Vec<String> = Vec::new();
        if let Some(pki) = access.tls {
            secured.extend(pki.server_args());
            secured.extend(["--tls-cluster".to_owned(), "yes".to_owned()]);
            cli_access.extend(pki.cli_args());
        }
        if access.acl_user {
            secured.extend(super::acl_user_args());
            cli_access.extend(super::acl_cli_args());
        }
        // A node can die between listening and `--cluster create` (seen once in CI on Redis 8.0:
        // "Could not connect to Redis at …: Connection refused"): start six new ones and try
        // again, up to three times, saying why.
        let mut attempts = 0;
        let nodes = loop {
            attempts += 1;
            let nodes = start_nodes(&node_timeout, &secured);
            match create(&nodes, &cli_access) {
                Ok(()) => break nodes,
                Err(why) if attempts < 3 => eprintln!("cluster create failed, trying again: {why}"),
                Err(why) => panic!("cluster create failed three times; the last: {why}"),
            }
        };
        let cluster = Self {
            nodes,
            scheme: if access.tls.is_some() {
                "rediss-cluster"
            } else {
                "redis-cluster"
            },
            credentials: if access.acl_user {
                format!("{}:{}@", super::ACL_USER, super::ACL_PASSWORD)
            } else {
                String::new()
            },
            cli_access,
        };
        cluster.wait_until_ready();
        eprintln!(
            "{} of {MASTERS} masters + {MASTERS} replicas ready in {:?}",
            cluster.scheme,
            started.elapsed()
        );
        cluster
    }

    /// `redis-cli` against the node on `port`, with this cluster's TLS and credentials.
    pub fn cli(&self, port: u16, args: &[&str]) -> String {
        cli_with(port, &self.cli_access, args)
    }

    /// One cluster for the whole test binary, started on first use (node timeout 5 s: a loaded
    /// CI machine must not trigger failovers by accident).
    ///
    /// Statics are never dropped, so a watchdog process kills the servers when this process
    /// exits, however it exits.
    pub fn shared() -> &'static Cluster {
        static SHARED: OnceLock<Cluster> = OnceLock::new();
        SHARED.get_or_init(|| {
            let cluster = Cluster::start(5000);
            cluster.reap_at_exit();
            cluster
        })
    }

    /// Stops the servers and removes their directories once this process has exited (for a
    /// cluster kept in a static, which is never dropped).
    pub fn reap_at_exit(&self) {
        let pids: Vec<u32> = self.nodes.iter().filter_map(RedisServer::pid).collect();
        let dirs: Vec<&std::path::Path> = self.nodes.iter().map(RedisServer::dir).collect();
        super::reap_at_exit(&pids, &dirs);
    }

    /// Waits until every live node says `cluster_state:ok`, agrees on who serves every slot and
    /// which replica follows each master, and every replica has finished its sync with its master.
    pub fn wait_until_ready(&self) {
        let deadline = Instant::now() + READY_TIMEOUT;
        while !self.is_ready() {
            assert!(
                Instant::now() < deadline,
                "the cluster did not become ready in {READY_TIMEOUT:?}:\n{}",
                self.cli(self.live_ports()[0], &["CLUSTER", "NODES"])
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    fn is_ready(&self) -> bool {
        self.live_ports().into_iter().all(|port| {
            if !self.cli(port, &["CLUSTER", "INFO"]).contains("cluster_state:ok") {
                return false;
            }
            let nodes = parse_cluster_nodes(&self.cli(port, &["CLUSTER", "NODES"]));
            let live_masters: Vec<&NodeLine> = nodes
                .iter()
                .filter(|n| n.is_master && !n.failed && !n.slots.is_empty())
                .collect();
            if live_masters.len() != MASTERS {
                return false;
            }
            // Each node learns who replicates whom by gossip, after `--cluster create` has
            // returned: until then a node's view may show a master with no replica (a test that
            // asked it for one found none).
            let has_replica = |master: &NodeLine| {
                nodes
                    .iter()
                    .any(|n| !n.is_master && !n.failed && n.master_id == master.id)
            };
            if !live_masters.iter().all(|master| has_replica(master)) {
                return false;
            }
            let replication = self.cli(port, &["INFO", "replication"]);
            if replication.contains("role:slave") {
                replication.contains("master_link_status:up")
                    && replication.contains("master_sync_in_progress:0")
            } else {
                true
            }
        })
    }

    fn live_ports(&self) -> Vec<u16> {
        self.nodes
            .iter()
            .filter(|node| node.pid().is_some())
            .map(|node| node.port())
            .collect()
    }

    /// The first node's directory: a place for a test's own files, removed with the cluster.
    pub fn dir(&self) -> &std::path::Path {
        self.nodes[0].dir()
    }

    /// Every node's address, killed ones included.
    pub fn addrs(&self) -> Vec<SocketAddr> {
        self.nodes.iter().map(RedisServer::addr).collect()
    }

    /// `redis-cluster://<node>?node=<node>&…`, every live node listed (any one is enough for a
    /// client to learn the topology; the others are there if it is down). `rediss-cluster://`
    /// for TLS, and `user:password@` before the first node for the ACL user.
    pub fn url(&self) -> String {
        let live: Vec<String> = self
            .nodes
            .iter()
            .filter(|node| node.pid().is_some())
            .map(|node| node.addr().to_string())
            .collect();
        let others: Vec<String> = live[1..].iter().map(|addr| format!("node={addr}")).collect();
        format!(
            "{}://{}{}?{}",
            self.scheme,
            self.credentials,
            live[0],
            others.join("&")
        )
    }

    /// The slot of each of `keys`, as the cluster computes it (`CLUSTER KEYSLOT`, all in one
    /// `redis-cli` run).
    pub fn slots_of(&self, keys: &[String]) -> Vec<u16> {
        let port = self.live_ports()[0];
        let commands: String = keys
            .iter()
            .map(|key| format!("CLUSTER KEYSLOT \"{key}\"\n"))
            .collect();
        let mut child = Command::new(redis_cli_binary())
            .args(["-h", "127.0.0.1", "-p", &port.to_string()])
            .args(&self.cli_access)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .expect("run redis-cli");
        std::io::Write::write_all(&mut child.stdin.take().expect("stdin"), commands.as_bytes())
            .expect("write to redis-cli");
        let output = child.wait_with_output().expect("redis-cli output");
        let slots: Vec<u16> = String::from_utf8_lossy(&output.stdout)
            .lines()
            .map(|line| line.trim().parse().expect("CLUSTER KEYSLOT answers a number"))
            .collect();
        assert_eq!(slots.len(), keys.len(), "one slot per key");
        slots
    }

    /// The master serving `slot` and its replicas, as a live node sees them now.
    pub fn shard_of(&self, slot: u16) -> Shard {
        let nodes = parse_cluster_nodes(&self.cli(self.live_ports()[0], &["CLUSTER", "NODES"]));
        let master = nodes
            .iter()
            .find(|n| n.is_master && n.slots.iter().any(|&(a, b)| (a..=b).contains(&slot)))
            .unwrap_or_else(|| panic!("no master serves slot {slot}"));
        let replicas = nodes
            .iter()
            .filter(|n| !n.is_master && n.master_id == master.id)
            .map(|n| n.addr)
            .collect();
        Shard {
            master: master.addr,
            replicas,
            slots: master.slots.clone(),
        }
    }

    /// The server listening at `addr`.
    pub fn node_mut(&mut self, addr: SocketAddr) -> &mut RedisServer {
        self.nodes
            .iter_mut()
            .find(|node| node.addr() == addr)
            .unwrap_or_else(|| panic!("no node at {addr}"))
    }

    /// The masters serving slots now.
    pub fn masters(&self) -> Vec<SocketAddr> {
        let nodes = parse_cluster_nodes(&self.cli(self.live_ports()[0], &["CLUSTER", "NODES"]));
        nodes
            .iter()
            .filter(|n| n.is_master && !n.failed && !n.slots.is_empty())
            .map(|n| n.addr)
            .collect()
    }

    /// Whether the node at `addr` answers `INFO replication` with `role:master`.
    pub fn is_master(&self, addr: SocketAddr) -> bool {
        self.cli(addr.port(), &["INFO", "replication"])
            .contains("role:master")
    }
}

impl super::Backend {
    /// A Redis store on the binary's shared cluster, connected with `RedisStore::connect` and a
    /// `redis-cluster://` URL, its keys under a prefix of `test`'s own.
    pub async fn cluster(test: &str) -> Self {
        let cluster = Cluster::shared();
        let store = super::connect(&cluster.url())
            .await
            .expect("connect to the shared cluster with a redis-cluster:// URL")
            .with_prefix(format!("suite:{test}"));
        Self {
            name: "cluster",
            store: std::sync::Arc::new(store),
            memory: None,
            redis: None,
        }
    }
}

/// Generates, for each named `async fn test(backend: Backend)`, a test `cluster::<test>` on the
/// binary's shared Redis Cluster (3 masters, 3 replicas).
#[macro_export]
macro_rules! on_cluster {
    ($($test:ident),* $(,)?) => {
        mod cluster {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $test() {
                    super::$test($crate::common::Backend::cluster(stringify!($test)).await).await
                }
            )*
        }
    };
}

/// Six cluster-enabled nodes, listening.
fn start_nodes(node_timeout: &str, secured: &[String]) -> Vec<RedisServer> {
    (0..2 * MASTERS)
        .map(|_| {
            let mut args = vec![
                "--cluster-enabled",
                "yes",
                "--cluster-config-file",
                "nodes.conf",
                "--cluster-node-timeout",
                node_timeout,
                // A replica whose master is unreachable still takes over, however long its
                // link has been down (a test kills masters on purpose).
                "--cluster-replica-validity-factor",
                "0",
                // Replicas sync at once, not after the default 5 s wait for more replicas.
                "--repl-diskless-sync-delay",
                "0",
            ];
            args.extend(secured.iter().map(String::as_str));
            RedisServer::start_with(&args)
        })
        .collect()
}

/// `redis-cli --cluster create` over `nodes`, a replica for each master.
fn create(nodes: &[RedisServer], cli_access: &[String]) -> Result<(), String> {
    let cli = redis_cli_binary();
    let addresses: Vec<String> = nodes.iter().map(|n| n.addr().to_string()).collect();
    let output = Command::new(&cli)
        .args(cli_access)
        .args(["--cluster", "create"])
        .args(&addresses)
        .args(["--cluster-replicas", "1", "--cluster-yes"])
        .stdin(Stdio::null())
        .output()
        .unwrap_or_else(|e| {
            panic!("cannot run `{cli}` ({e}); it comes with redis-server (apt-get install redis-tools)")
        });
    if output.status.success() {
        Ok(())
    } else {
        Err(format!(
            "{}{}",
            String::from_utf8_lossy(&output.stdout),
            String::from_utf8_lossy(&output.stderr)
        ))
    }
}
