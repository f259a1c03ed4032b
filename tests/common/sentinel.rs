//! A Sentinel topology on loopback: one master, one replica (`--replicaof`) and three sentinels,
//! every data node and every sentinel behind a password, all on free ports.
//! [`SentinelTopology::start_tls`] starts one in which every process speaks TLS only (clients,
//! replication, and the sentinels' links to the nodes and to each other).
//!
//! Admin commands go through `redis-cli` (blocking), so the harness needs no runtime and can be
//! started from a process-wide `OnceLock` shared by every test of a binary.

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use super::tls::Pki;
use super::{free_port, has_bound_its_ports, server_dir, RedisServer};

pub const SERVICE: &str = "mymaster";
/// The password of the master and the replica (`requirepass`, `masterauth`).
pub const DATA_PASSWORD: &str = "data-secret";
/// The password of the sentinels (`requirepass`, `sentinel sentinel-pass`).
pub const SENTINEL_PASSWORD: &str = "sentinel-secret";

/// How quickly the sentinels of a topology act: `down-after-milliseconds` and
/// `failover-timeout`.
#[derive(Clone, Copy, Debug)]
pub struct Timing {
    pub down_after: Duration,
    pub failover_timeout: Duration,
}

impl Default for Timing {
    /// A node is down after 1 s without answers; a failover times out after 5 s.
    fn default() -> Self {
        Self {
            down_after: Duration::from_secs(1),
            failover_timeout: Duration::from_secs(5),
        }
    }
}

/// A `redis-server --sentinel` with a config file of its own, killed when dropped.
pub struct SentinelProcess {
    port: u16,
    child: Option<Child>,
    dir: PathBuf,
}

impl SentinelProcess {
    fn start(master_port: u16, tls: Option<&Pki>, timing: Timing) -> Self {
        for _ in 0..5 {
            let port = free_port();
            if let Some(sentinel) = Self::start_on(port, master_port, tls, timing) {
                return sentinel;
            }
        }
        panic!("could not start a sentinel on a free port after 5 tries");
    }

    fn start_on(port: u16, master_port: u16, tls: Option<&Pki>, timing: Timing) -> Option<Self> {
        assert_ne!(port, 26379, "tests never use the default Sentinel port");
        let dir = server_dir("sentinel", port);
        std::fs::create_dir_all(&dir).expect("create a directory for a sentinel");
        // Sentinels rewrite their config file as they learn the topology: it must be writable.
        let config = dir.join("sentinel.conf");
        let pidfile = dir.join("sentinel.pid");
        // With `tls-replication yes` a sentinel also reaches the nodes and the other sentinels
        // over TLS, and announces its TLS port.
        let listen = match tls {
            Some(pki) => format!("port 0\ntls-port {port}\n{}", pki.config_lines()),
            None => format!("port {port}\n"),
        };
        std::fs::write(
            &config,
            format!(
                "{listen}bind 127.0.0.1\ndaemonize no\ndir {dir}\npidfile {pidfile}\n{log}\n\
                 requirepass {SENTINEL_PASSWORD}\n\
                 sentinel resolve-hostnames no\n\
                 sentinel sentinel-pass {SENTINEL_PASSWORD}\n\
                 sentinel monitor {SERVICE} 127.0.0.1 {master_port} 2\n\
                 sentinel auth-pass {SERVICE} {DATA_PASSWORD}\n\
                 sentinel down-after-milliseconds {SERVICE} {down_after}\n\
                 sentinel failover-timeout {SERVICE} {failover_timeout}\n",
                dir = dir.display(),
                pidfile = pidfile.display(),
                log = (super::server_log_args("sentinel", port).chunks(2))
                    .map(|pair| format!("{} {}", pair[0].trim_start_matches("--"), pair[1]))
                    .collect::<Vec<_>>()
                    .join("\n"),
                down_after = timing.down_after.as_millis(),
                failover_timeout = timing.failover_timeout.as_millis(),
            ),
        )
        .expect("write a sentinel config");
        let mut sentinel = Self {
            port,
            child: None,
            dir,
        };
        sentinel.spawn().then_some(sentinel)
    }

    /// Runs the sentinel on its config file (as it rewrote it, if it ran before); whether it
    /// listens within 5 s.
    fn spawn(&mut self) -> bool {
        let config = self.dir.join("sentinel.conf");
        let pidfile = self.dir.join("sentinel.pid");
        let _ = std::fs::remove_file(&pidfile);
        let child = Command::new(super::redis_server_binary())
            .arg(&config)
            .arg("--sentinel")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap_or_else(|error| {
                panic!(
                    "cannot run `{} <conf> --sentinel` ({error}). Install redis-server (apt-get install \
                     redis-server) or run scripts/test.sh, which does.",
                    super::redis_server_binary().display()
                )
            });
        self.child = Some(child);
        let deadline = Instant::now() + Duration::from_secs(5);
        while Instant::now() < deadline {
            if let Some(child) = &mut self.child {
                if let Ok(Some(_status)) = child.try_wait() {
                    self.child = None;
                    return false; // port taken, most likely
                }
                if has_bound_its_ports(&pidfile, child)
                    && std::net::TcpStream::connect(("127.0.0.1", self.port)).is_ok()
                {
                    return true;
                }
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        false
    }

    pub fn port(&self) -> u16 {
        self.port
    }

    /// `kill -9`: the sentinel's connections are reset; its directory stays for [`restart`].
    ///
    /// [`restart`]: Self::restart
    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Starts a killed sentinel again on its port, with the config it had rewritten.
    pub fn restart(&mut self) {
        assert!(self.child.is_none(), "restart a sentinel that was killed");
        assert!(
            self.spawn(),
            "the sentinel on port {} did not start again",
            self.port
        );
    }

    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }
}

impl Drop for SentinelProcess {
    fn drop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// The arguments of every data node: the password, and no wait before a sync.
fn data_node_args(tls: Option<&Pki>) -> Vec<String> {
    // Redis waits 5 s by default before a diskless full sync (also after a failover, from the
    // promoted replica), for more replicas to join.
    let mut args: Vec<String> = [
        "--requirepass",
        DATA_PASSWORD,
        "--masterauth",
        DATA_PASSWORD,
        "--repl-diskless-sync-delay",
        "0",
    ]
    .map(str::to_owned)
    .to_vec();
    if let Some(pki) = tls {
        args.extend(pki.server_args());
    }
    args
}

/// One master, one replica, three sentinels that agree on both (quorum 2; by default a node is
/// down after 1 s without answers, a failover times out after 5 s: see [`Timing`]).
pub struct SentinelTopology {
    /// The master and the replica as started; after a failover their roles are swapped.
    pub nodes: Vec<RedisServer>,
    pub sentinels: Vec<SentinelProcess>,
    /// The certificates every process serves, if it speaks TLS.
    tls: Option<Pki>,
}

impl SentinelTopology {
    /// Starts the five processes and waits until the replica is in sync and every sentinel sees
    /// the master, the replica and the two other sentinels.
    pub fn start() -> Self {
        Self::start_with_replicas(1)
    }

    /// [`start`](Self::start) with `replicas` replicas.
    pub fn start_with_replicas(replicas: usize) -> Self {
        Self::start_with(replicas, None, Timing::default())
    }

    /// [`start`](Self::start) with sentinels that act with `timing`.
    pub fn start_timed(replicas: usize, timing: Timing) -> Self {
        Self::start_with(replicas, None, timing)
    }

    /// [`start`](Self::start), every process listening for TLS only, with `pki`'s certificates.
    pub fn start_tls(pki: &Pki) -> Self {
        Self::start_with(1, Some(pki), Timing::default())
    }

    fn start_with(replicas: usize, tls: Option<&Pki>, timing: Timing) -> Self {
        let started = Instant::now();
        let auth = data_node_args(tls);
        let master = RedisServer::start_with(&auth);
        let master_port = master.port().to_string();
        let mut replica_args: Vec<&str> = auth.iter().map(String::as_str).collect();
        replica_args.extend(["--replicaof", "127.0.0.1", &master_port]);
        let mut nodes = vec![master];
        nodes.extend((0..replicas).map(|_| RedisServer::start_with(&replica_args)));
        let sentinels = (0..3)
            .map(|_| SentinelProcess::start(nodes[0].port(), tls, timing))
            .collect();
        let topology = Self {
            nodes,
            sentinels,
            tls: tls.cloned(),
        };
        topology.wait_until_settled(Duration::from_secs(20));
        eprintln!(
            "{} topology (master {}, replicas {:?}, sentinels {:?}) ready in {:?}",
            topology.scheme(),
            topology.nodes[0].port(),
            topology.nodes[1..]
                .iter()
                .map(RedisServer::port)
                .collect::<Vec<_>>(),
            topology
                .sentinels
                .iter()
                .map(SentinelProcess::port)
                .collect::<Vec<_>>(),
            started.elapsed()
        );
        topology
    }

    /// Waits until the current master has an online replica and every sentinel sees it, one
    /// replica and two other sentinels. Panics after `timeout`.
    pub fn wait_until_settled(&self, timeout: Duration) {
        let deadline = Instant::now() + timeout;
        loop {
            let settled = self.settled();
            match settled {
                Ok(()) => return,
                Err(why) if Instant::now() > deadline => {
                    panic!("the sentinel topology did not settle: {why}")
                }
                Err(_) => std::thread::sleep(Duration::from_millis(50)),
            }
        }
    }

    fn settled(&self) -> Result<(), String> {
        let master = self.master_port();
        let replication = self.data_cli(master, &["INFO", "replication"]);
        let live_replicas = self.nodes.iter().filter(|node| node.pid().is_some()).count() - 1;
        let online = replication.matches("state=online").count();
        if !replication.contains("role:master") || online < live_replicas.max(1) {
            return Err(format!(
                "master {master} has {online} of {live_replicas} replicas online: {replication}"
            ));
        }
        for sentinel in &self.sentinels {
            let port = sentinel.port();
            let seen = self.sentinel_cli(port, &["SENTINEL", "get-master-addr-by-name", SERVICE]);
            if seen.lines().nth(1) != Some(master.to_string().as_str()) {
                return Err(format!(
                    "sentinel {port} sees the master at {seen:?}, not {master}"
                ));
            }
            let replicas = self.sentinel_cli(port, &["SENTINEL", "replicas", SERVICE]);
            if !replicas.lines().any(|line| line == "slave") || replicas.contains("s_down") {
                return Err(format!("sentinel {port} sees no healthy replica: {replicas}"));
            }
            let others = self.sentinel_cli(port, &["SENTINEL", "sentinels", SERVICE]);
            if others.lines().filter(|line| *line == "sentinel").count() < 2 {
                return Err(format!(
                    "sentinel {port} sees fewer than 2 other sentinels: {others}"
                ));
            }
        }
        Ok(())
    }

    /// `redis-sentinel`, or `rediss-sentinel` for a topology that speaks TLS.
    fn scheme(&self) -> &'static str {
        if self.tls.is_some() {
            "rediss-sentinel"
        } else {
            "redis-sentinel"
        }
    }

    /// The URL of this topology for `RedisStore::connect`: the data nodes' password as the
    /// URL's credentials, the sentinels' in `sentinelPassword`.
    pub fn url(&self) -> String {
        let mut sentinels = self.sentinels.iter().map(SentinelProcess::port);
        let first = sentinels.next().expect("three sentinels");
        let nodes: String = sentinels.map(|port| format!("node=127.0.0.1:{port}&")).collect();
        format!(
            "{scheme}://:{DATA_PASSWORD}@127.0.0.1:{first}?{nodes}sentinelServiceName={SERVICE}&\
             sentinelPassword={SENTINEL_PASSWORD}",
            scheme = self.scheme()
        )
    }

    /// The URL of this topology naming only its `index`th sentinel, as a client reaching the
    /// sentinels through one address (a Kubernetes Service in front of them) has it.
    pub fn url_of(&self, index: usize) -> String {
        format!(
            "{scheme}://:{DATA_PASSWORD}@127.0.0.1:{port}?sentinelServiceName={SERVICE}&\
             sentinelPassword={SENTINEL_PASSWORD}",
            scheme = self.scheme(),
            port = self.sentinels[index].port()
        )
    }

    /// The sentinels' ports.
    pub fn sentinel_ports(&self) -> Vec<u16> {
        self.sentinels.iter().map(SentinelProcess::port).collect()
    }

    /// The port of the master, as the first sentinel that answers names it.
    pub fn master_port(&self) -> u16 {
        for sentinel in &self.sentinels {
            if sentinel.child.is_none() {
                continue;
            }
            let answer =
                self.sentinel_cli(sentinel.port(), &["SENTINEL", "get-master-addr-by-name", SERVICE]);
            if let Some(port) = answer.lines().nth(1).and_then(|port| port.parse().ok()) {
                return port;
            }
        }
        panic!("no sentinel names a master");
    }

    /// The data node (master or replica) listening on `port`.
    pub fn node_mut(&mut self, port: u16) -> &mut RedisServer {
        (self.nodes.iter_mut())
            .find(|node| node.port() == port)
            .unwrap_or_else(|| panic!("no data node on port {port}"))
    }

    /// Starts the data node on `port` again (killed), empty, as a replica of the master on
    /// `master`: a machine replaced after a crash.
    pub fn restart_as_replica(&mut self, port: u16, master: u16) {
        let mut args = data_node_args(self.tls.as_ref());
        args.extend(["--replicaof".into(), "127.0.0.1".into(), master.to_string()]);
        let binary = std::env::var_os("REDIS_SERVER_BIN").unwrap_or_else(|| "redis-server".into());
        self.node_mut(port).restart_as_with(binary, &args);
    }

    /// `SENTINEL FAILOVER`: a graceful failover, the replica promoted without agreement.
    pub fn failover(&self) {
        if let Err(answer) = self.try_failover() {
            panic!("SENTINEL FAILOVER refused: {answer}");
        }
    }

    /// [`failover`](Self::failover), answering the sentinel's refusal (`INPROG`: a failover
    /// already under way) instead of panicking.
    pub fn try_failover(&self) -> Result<(), String> {
        let answer = self.sentinel_cli(self.sentinels[0].port(), &["SENTINEL", "FAILOVER", SERVICE]);
        match answer.trim() {
            "OK" => Ok(()),
            refused => Err(refused.to_owned()),
        }
    }

    /// Waits until the sentinels name a master other than `old` and the new master has an
    /// online replica again. Returns the new master's port.
    pub fn wait_for_new_master(&self, old: u16, timeout: Duration) -> u16 {
        self.try_wait_for_new_master(old, timeout)
            .unwrap_or_else(|| panic!("the sentinels still name {old} as master after {timeout:?}"))
    }

    /// [`wait_for_new_master`](Self::wait_for_new_master), `None` after `timeout` (a failover
    /// the sentinels gave up: `-failover-abort-*`).
    pub fn try_wait_for_new_master(&self, old: u16, timeout: Duration) -> Option<u16> {
        let deadline = Instant::now() + timeout;
        while Instant::now() < deadline {
            let master = self.master_port();
            if master != old {
                return Some(master);
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        None
    }

    /// With `TEST_SERVER_LOGS=<dir>`, `MONITOR` on every data node to `<dir>/monitor-<port>.log`
    /// (each command with the server's clock, in microseconds, and the connection it came on)
    /// until the returned guard is dropped: where each write of a failing storm landed, and when,
    /// beside the servers' logs (when a replica took `REPLICAOF NO ONE`). Without it, nothing.
    pub fn monitor_if_asked(&self) -> Monitors {
        let Some(dir) = std::env::var_os("TEST_SERVER_LOGS") else {
            return Monitors(Vec::new());
        };
        let dir = PathBuf::from(dir);
        let _ = std::fs::create_dir_all(&dir);
        let monitors = (self.nodes.iter().map(RedisServer::port)).map(|port| {
            let log = std::fs::File::create(dir.join(format!("monitor-{port}.log"))).expect("a MONITOR log");
            cli_command(port, DATA_PASSWORD, self.tls.as_ref())
                .arg("MONITOR")
                .stdin(Stdio::null())
                .stdout(log)
                .spawn()
                .expect("redis-cli MONITOR")
        });
        Monitors(monitors.collect())
    }

    /// `redis-cli` against a data node of this topology, with its password (and TLS).
    pub fn data_cli(&self, port: u16, args: &[&str]) -> String {
        cli(port, DATA_PASSWORD, self.tls.as_ref(), args)
    }

    /// `redis-cli` against a sentinel of this topology, with its password (and TLS).
    pub fn sentinel_cli(&self, port: u16, args: &[&str]) -> String {
        cli(port, SENTINEL_PASSWORD, self.tls.as_ref(), args)
    }

    /// Kills the processes and removes their directories once this process exits (for a
    /// topology kept in a static, which is never dropped; see [`shared`]).
    pub fn reap_at_exit(&self) {
        let pids: Vec<u32> = (self.nodes.iter().filter_map(RedisServer::pid))
            .chain(self.sentinels.iter().filter_map(SentinelProcess::pid))
            .collect();
        let dirs: Vec<&std::path::Path> = (self.sentinels.iter().map(|s| s.dir.as_path()))
            .chain(self.nodes.iter().map(|node| node.dir.as_path()))
            .collect();
        super::reap_at_exit(&pids, &dirs);
    }
}

/// The `redis-cli MONITOR`s of [`SentinelTopology::monitor_if_asked`], stopped when dropped.
pub struct Monitors(Vec<Child>);

impl Drop for Monitors {
    fn drop(&mut self) {
        for monitor in &mut self.0 {
            let _ = monitor.kill();
            let _ = monitor.wait();
        }
    }
}

/// `redis-cli` against a data node of a plain-text topology, with its password. Returns the raw
/// output.
pub fn data_cli(port: u16, args: &[&str]) -> String {
    cli(port, DATA_PASSWORD, None, args)
}

/// `redis-cli` against a sentinel of a plain-text topology, with its password. Returns the raw
/// output.
pub fn sentinel_cli(port: u16, args: &[&str]) -> String {
    cli(port, SENTINEL_PASSWORD, None, args)
}

/// `redis-cli` against `port` with `password` (and TLS), its command's arguments yet to add.
fn cli_command(port: u16, password: &str, tls: Option<&Pki>) -> Command {
    let mut command = Command::new("redis-cli");
    command.args(tls.map(Pki::cli_args).unwrap_or_default()).args([
        "-h",
        "127.0.0.1",
        "-p",
        &port.to_string(),
        "--no-auth-warning",
        "-a",
        password,
    ]);
    command
}

fn cli(port: u16, password: &str, tls: Option<&Pki>, args: &[&str]) -> String {
    let output = cli_command(port, password, tls)
        .args(args)
        .stdin(Stdio::null())
        .output()
        .unwrap_or_else(|error| {
            panic!(
                "cannot run `redis-cli` ({error}); it comes with redis-server (apt-get install redis-server)"
            )
        });
    String::from_utf8_lossy(&output.stdout).into_owned()
}

/// The topology shared by every sentinel test of this binary, started on first use.
///
/// A static is never dropped, so its processes would outlive the test binary: a reaper (a
/// `sh` loop, see [`SentinelTopology::reap_at_exit`]) kills them once this process is gone,
/// however it ends (success, panic, abort, SIGKILL). `PR_SET_PDEATHSIG` would need `unsafe`
/// and fires when the spawning *thread* ends, which in a test harness is the first test's thread.
pub fn shared() -> &'static SentinelTopology {
    static SHARED: OnceLock<SentinelTopology> = OnceLock::new();
    SHARED.get_or_init(|| {
        let topology = SentinelTopology::start();
        topology.reap_at_exit();
        topology
    })
}

/// A key prefix no other test of this binary uses, so tests can share one topology.
pub fn unique_prefix() -> String {
    static NEXT: AtomicUsize = AtomicUsize::new(0);
    format!("sentinel-test-{}", NEXT.fetch_add(1, Ordering::Relaxed))
}
