//! Test support: real `redis-server` processes on free loopback ports, a client for them, and a
//! minimal HTTP harness. Never touches a Redis on 6379.
#![allow(dead_code)]

pub mod cluster;
pub mod consumers;
pub mod demo;
#[cfg(feature = "postgres")]
pub mod postgres;
pub mod proxy;
pub mod rabbitmq;
pub mod sentinel;
pub mod storm;
pub mod tls;

use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use fred::prelude::*;
use fred::types::{ClusterHash, CustomCommand};

/// A `redis-server` this test owns: started on a free port, killed when dropped.
pub struct RedisServer {
    port: u16,
    child: Option<Child>,
    dir: PathBuf,
    extra: Vec<String>,
    /// The server's binary: `REDIS_SERVER_BIN`, `redis-server`, or one given ([`RedisServer::start_binary`]).
    binary: PathBuf,
}

fn redis_server_binary() -> PathBuf {
    std::env::var_os("REDIS_SERVER_BIN")
        .map(PathBuf::from)
        .unwrap_or_else(|| "redis-server".into())
}

/// The launcher of a newer server that `scripts/newer-servers.sh` fetches into the build tree
/// (`redis-8.0`, `valkey-8.1`, `redis-8.6`, `valkey-9.1`): `${CARGO_TARGET_DIR:-target}/servers/<name>/redis-server`.
/// `"redis-7.0"` names the system's `redis-server`. Panics if it is missing: a test that needs a
/// server's capability fails without it, never skips.
pub fn newer_server(name: &str) -> PathBuf {
    if name == "redis-7.0" {
        return "redis-server".into();
    }
    let target = std::env::var_os("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("target"));
    let target = if target.is_relative() {
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join(target)
    } else {
        target
    };
    let launcher = target.join("servers").join(name).join("redis-server");
    assert!(
        launcher.exists(),
        "{} is missing: run scripts/newer-servers.sh (it fetches {name} into the build tree)",
        launcher.display()
    );
    launcher
}

fn free_port() -> u16 {
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind an ephemeral loopback port");
    listener.local_addr().expect("local address").port()
}

/// A directory for one server process, never shared: two servers that tried the same port at
/// once (one loses) must not share one, since the loser removes its directory.
fn server_dir(kind: &str, port: u16) -> PathBuf {
    static NEXT: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    std::env::temp_dir().join(format!(
        "tower-idempotency-{kind}-{port}-{}-{n}",
        std::process::id()
    ))
}

/// Whether the server `child` has bound its ports: it writes `pidfile` only once it has (a
/// server that lost its port exits without writing it). A connection alone does not tell: the
/// port can belong to another process for a while, as a free port is found by binding and
/// releasing it, which other tests and other test binaries do at the same time.
fn has_bound_its_ports(pidfile: &std::path::Path, child: &Child) -> bool {
    std::fs::read_to_string(pidfile).is_ok_and(|pid| pid.trim() == child.id().to_string())
}

impl RedisServer {
    /// Starts a server on a free loopback port. Panics with a clear message if `redis-server`
    /// is not installed: a missing server is a failure, never a skip.
    pub fn start() -> Self {
        Self::start_with::<&str>(&[])
    }

    /// Starts a server with extra arguments (later arguments override the defaults).
    pub fn start_with<S: AsRef<str>>(extra: &[S]) -> Self {
        Self::start_binary_with(redis_server_binary(), extra)
    }

    /// Starts the server `binary` (a launcher from [`newer_server`], say) whatever
    /// `REDIS_SERVER_BIN` says.
    pub fn start_binary(binary: impl Into<PathBuf>) -> Self {
        Self::start_binary_with::<&str>(binary, &[])
    }

    /// [`start_binary`](Self::start_binary) with extra arguments.
    pub fn start_binary_with<S: AsRef<str>>(binary: impl Into<PathBuf>, extra: &[S]) -> Self {
        let binary = binary.into();
        for _ in 0..5 {
            let port = free_port();
            if let Some(server) = Self::start_on(&binary, port, extra) {
                return server;
            }
        }
        panic!(
            "could not start {} on a free port after 5 tries",
            binary.display()
        );
    }

    fn start_on<S: AsRef<str>>(binary: &std::path::Path, port: u16, extra: &[S]) -> Option<Self> {
        assert_ne!(port, 6379, "tests never use the default Redis port");
        let dir = server_dir("redis", port);
        std::fs::create_dir_all(&dir).expect("create a directory for redis-server");
        let extra = extra.iter().map(|s| s.as_ref().to_owned()).collect();
        let mut server = Self {
            port,
            child: None,
            dir,
            extra,
            binary: binary.to_owned(),
        };
        server.spawn().then_some(server)
    }

    fn spawn(&mut self) -> bool {
        let pidfile = self.dir.join("redis.pid");
        // A server killed with SIGKILL leaves its pid file behind.
        let _ = std::fs::remove_file(&pidfile);
        let child = Command::new(&self.binary)
            .args(["--port", &self.port.to_string(), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"])
            .args(["--enable-debug-command", "local", "--daemonize", "no"])
            .args(server_log_args("redis", self.port))
            .arg("--dir")
            .arg(&self.dir)
            .arg("--pidfile")
            .arg(&pidfile)
            // `{port}` in an extra argument is this server's port (a TLS-only server listens there).
            .args(self.extra.iter().map(|arg| arg.replace("{port}", &self.port.to_string())))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap_or_else(|error| {
                panic!(
                    "cannot run `{}` ({error}). Install it (apt-get install redis-server) or run scripts/test.sh, \
                     which does.",
                    self.binary.display()
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
                if has_bound_its_ports(&pidfile, child) && TcpStream::connect(self.addr()).is_ok() {
                    return true;
                }
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        self.kill();
        false
    }

    pub fn port(&self) -> u16 {
        self.port
    }

    pub fn addr(&self) -> SocketAddr {
        SocketAddr::from(([127, 0, 0, 1], self.port))
    }

    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }

    /// The server's working directory (removed when it is dropped).
    pub fn dir(&self) -> &std::path::Path {
        &self.dir
    }

    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    /// Kills the server (SIGKILL: a crash, not a shutdown).
    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Starts the server again on the same port, empty (no persistence).
    pub fn restart(&mut self) {
        self.kill();
        let deadline = Instant::now() + Duration::from_secs(10);
        while Instant::now() < deadline {
            if self.spawn() {
                return;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        panic!("could not restart redis-server on port {}", self.port);
    }

    /// Starts the server again on the same port, empty, as `binary`: an upgrade or a downgrade,
    /// or a failover onto a server of another version.
    pub fn restart_as(&mut self, binary: impl Into<PathBuf>) {
        self.binary = binary.into();
        self.restart();
    }

    /// [`restart_as`](Self::restart_as), with `extra` arguments in place of those it had.
    pub fn restart_as_with<S: AsRef<str>>(&mut self, binary: impl Into<PathBuf>, extra: &[S]) {
        self.extra = extra.iter().map(|s| s.as_ref().to_owned()).collect();
        self.restart_as(binary);
    }
}

impl Drop for RedisServer {
    fn drop(&mut self) {
        self.kill();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// An ACL user allowed everything, for servers started with [`acl_user_args`].
pub const ACL_USER: &str = "alice";
pub const ACL_PASSWORD: &str = "alice-secret";

/// `redis-server` arguments that turn the `default` user off, so that only [`ACL_USER`] with
/// [`ACL_PASSWORD`] gets in (a client without them is refused), and make replicas sync as that
/// user.
pub fn acl_user_args() -> Vec<String> {
    let password = format!(">{ACL_PASSWORD}");
    let args = [
        "--user", "default", "off", "--user", ACL_USER, "on", &password, "~*", "&*", "+@all",
    ];
    (args.into_iter())
        .chain(["--masteruser", ACL_USER, "--masterauth", ACL_PASSWORD])
        .map(str::to_owned)
        .collect()
}

/// `redis-cli` arguments for a server started with [`acl_user_args`].
pub fn acl_cli_args() -> Vec<String> {
    ["--user", ACL_USER, "--pass", ACL_PASSWORD, "--no-auth-warning"]
        .map(str::to_owned)
        .to_vec()
}

/// A connected `fred` client for `url`, with a reconnect policy and command timeouts.
pub async fn client(url: &str) -> Client {
    client_with_attempts(url, 3).await
}

/// [`client`], sending each command at most `attempts` times (fred re-sends a command whose
/// connection closed before its answer; 1: never).
pub async fn client_with_attempts(url: &str, attempts: u32) -> Client {
    connected(url, attempts)
        .await
        .expect("connect to the test redis-server")
}

/// [`client_with_attempts`], its first connection's failure returned rather than a panic: for
/// a caller that tries again. A server still loading its data set (`LOADING`, as a restarted
/// server may answer for a moment on a loaded machine) is waited for, up to 10 s.
pub async fn connected(url: &str, attempts: u32) -> Result<Client, fred::error::Error> {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let client = Builder::from_config(Config::from_url(url).expect("valid url"))
            .with_connection_config(|c| {
                c.connection_timeout = Duration::from_secs(1);
                c.internal_command_timeout = Duration::from_secs(1);
                c.max_command_attempts = attempts;
            })
            .with_performance_config(|p| p.default_command_timeout = Duration::from_secs(2))
            .set_policy(ReconnectPolicy::new_constant(0, 20))
            .build()
            .expect("build a fred client");
        match client.init().await {
            Ok(_) => return Ok(client),
            Err(error) if error.details().starts_with("LOADING") && Instant::now() < deadline => {
                let _ = client.quit().await;
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            Err(error) => return Err(error),
        }
    }
}

/// Waits until `done` holds (a request has claimed its key, say), polling; panics after 10 s.
/// Instead of a fixed sleep, which a loaded machine can outlast.
pub async fn until(what: &str, done: impl Fn() -> bool) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while !done() {
        assert!(tokio::time::Instant::now() < deadline, "never: {what}");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// Waits until the async check `done` holds, polling every 20 ms; panics after 15 s.
pub async fn until_async<F, Fut>(what: &str, done: F)
where
    F: Fn() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let deadline = tokio::time::Instant::now() + Duration::from_secs(15);
    while !done().await {
        assert!(tokio::time::Instant::now() < deadline, "never: {what}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Runs one admin command and returns its answer.
pub async fn admin(client: &Client, args: &[&str]) -> Value {
    let command = CustomCommand::new_static(leak(args[0]), ClusterHash::Random, false);
    let rest: Vec<Value> = args[1..].iter().map(|a| Value::from(*a)).collect();
    client
        .custom(command, rest)
        .await
        .unwrap_or_else(|e| panic!("{args:?} failed: {e}"))
}

fn leak(s: &str) -> &'static str {
    Box::leak(s.to_owned().into_boxed_str())
}

/// Calls to `command` counted by `INFO commandstats` (0 if never called).
pub async fn command_calls(client: &Client, command: &str) -> u64 {
    let info = admin(client, &["INFO", "commandstats"]).await;
    let info = info.as_str().expect("INFO answers text").into_owned();
    let prefix = format!("cmdstat_{command}:calls=");
    info.lines()
        .find_map(|line| line.strip_prefix(&prefix))
        .and_then(|rest| rest.split(',').next())
        .and_then(|n| n.parse().ok())
        .unwrap_or(0)
}

/// The round trips the store made: its claims (`SET … NX GET`) and its scripts' calls
/// (EVALSHA, EVAL; the commands a script runs inside are not counted).
///
/// A waiter's reads (`wait.lua`: `SET … NX GET`, and `SETRANGE` when it marks) are not counted
/// right here: no test that counts has a waiter.
///
/// complete.lua writes a completed record with one `SET`, which `INFO commandstats` counts with
/// the client's: those are left out. Every script run reads its record with one `GETRANGE`, and
/// every run but that completion (and one that finds its claim lost, which writes nothing) also
/// calls `SETRANGE` or `DEL`: so the scripts' `SET` calls are their `GETRANGE` calls less their
/// `SETRANGE` and `DEL` calls, which the client never sends (a test's own `DEL` or a lost claim
/// in the window makes the count too high, never too low).
pub async fn round_trips(client: &Client) -> u64 {
    let mut total = 0;
    for command in ["set", "evalsha", "eval"] {
        total += command_calls(client, command).await;
    }
    let read = command_calls(client, "getrange").await;
    let other_branches = command_calls(client, "setrange").await + command_calls(client, "del").await;
    total - read.saturating_sub(other_branches)
}

/// `RedisStore::new(client)`: the store the suites build over a client.
pub fn redis_store(client: Client) -> RedisStore {
    RedisStore::new(client)
}

/// `RedisStore::connect(url)`: the store the suites connect.
pub async fn connect(url: &str) -> Result<RedisStore, tower_idempotency::StoreError> {
    RedisStore::connect(url).await
}

use std::sync::Arc;
use tower_idempotency::{MemoryStore, RedisStore, Store};

/// One of the two stores, ready for a test: the memory store, or a Redis store over a
/// `redis-server` of the test's own.
pub struct Backend {
    pub name: &'static str,
    pub store: Arc<dyn Store>,
    pub memory: Option<MemoryStore>,
    pub redis: Option<(RedisServer, Client)>,
}

impl Backend {
    pub async fn memory() -> Self {
        let memory = MemoryStore::new();
        Self {
            name: "memory",
            store: Arc::new(memory.clone()),
            memory: Some(memory),
            redis: None,
        }
    }

    pub async fn redis() -> Self {
        let server = RedisServer::start();
        let client = client(&server.url()).await;
        let store = redis_store(client.clone());
        Self {
            name: "redis",
            store: Arc::new(store),
            memory: None,
            redis: Some((server, client)),
        }
    }

    /// A Redis store built by `RedisStore::connect` from the `redis-sentinel://` URL (with both
    /// passwords) of the topology shared by this binary's sentinel tests, under a prefix of its own.
    pub async fn sentinel() -> Self {
        let url = tokio::task::spawn_blocking(|| sentinel::shared().url())
            .await
            .expect("start the shared sentinel topology");
        let store = connect(&url)
            .await
            .unwrap_or_else(|error| panic!("connect to {url}: {error}"))
            .with_prefix(sentinel::unique_prefix());
        Self {
            name: "sentinel",
            store: Arc::new(store),
            memory: None,
            redis: None,
        }
    }

    /// A PostgreSQL store on the server shared by this test binary, in a table of its own.
    #[cfg(feature = "postgres")]
    pub async fn postgres() -> Self {
        let url = tokio::task::spawn_blocking(|| postgres::shared().url())
            .await
            .expect("start the shared PostgreSQL server");
        let store = postgres::store(&url).await;
        Self {
            name: "postgres",
            store: Arc::new(store),
            memory: None,
            redis: None,
        }
    }

    pub fn redis_client(&self) -> Option<&Client> {
        self.redis.as_ref().map(|(_, client)| client)
    }
}

/// Kills `pids` and removes `dirs` once this test process has exited: servers shared by a whole
/// test binary live in statics, which are never dropped. An `sh` loop polls this process.
// The reaper is never waited for: it is meant to outlive this process.
#[allow(clippy::zombie_processes)]
pub fn reap_at_exit(pids: &[u32], dirs: &[&std::path::Path]) {
    let pids: Vec<String> = pids.iter().map(u32::to_string).collect();
    let dirs: Vec<String> = dirs.iter().map(|dir| format!("'{}'", dir.display())).collect();
    let script = format!(
        "while kill -0 {parent} 2>/dev/null; do sleep 0.2; done; kill -9 {pids} 2>/dev/null; rm -rf {dirs}",
        parent = std::process::id(),
        pids = pids.join(" "),
        dirs = dirs.join(" "),
    );
    std::process::Command::new("sh")
        .args(["-c", &script])
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .expect("start the reaper of the servers shared by this test binary (`sh`)");
}

/// Generates, for each named `async fn test(backend: Backend)`, one test per store.
#[macro_export]
macro_rules! on_both_stores {
    // `on_both_stores!(and sentinel: a, b)` also runs each test as `sentinel::a` on the
    // Sentinel topology shared by the binary (tests/common/sentinel.rs).
    (and sentinel: $($test:ident),* $(,)?) => {
        $crate::on_both_stores!($($test),*);
        mod sentinel {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $test() {
                    super::$test($crate::common::Backend::sentinel().await).await
                }
            )*
        }
    };
    ($($test:ident),* $(,)?) => {
        mod memory {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $test() {
                    super::$test($crate::common::Backend::memory().await).await
                }
            )*
        }
        mod redis {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $test() {
                    super::$test($crate::common::Backend::redis().await).await
                }
            )*
        }
    };
}

/// Generates each suite test for every store and topology: `memory::`, `redis::` (standalone)
/// `sentinel::` (Redis behind Sentinel, see `common::sentinel`), `cluster::` (Redis Cluster,
/// see `common::cluster`) and `postgres::` (see `common::postgres`).
#[macro_export]
macro_rules! on_every_store {
    ($($test:ident),* $(,)?) => {
        $crate::on_both_stores!(and sentinel: $($test),*);
        $crate::on_cluster!($($test),*);
        $crate::on_postgres!($($test),*);
    };
}

/// Generates, for each named `async fn test(backend: Backend)`, a `postgres::test` on the
/// PostgreSQL server shared by the binary (a table per test), when the crate feature
/// `postgres` is on (`scripts/test.sh` turns on every feature). Built without it, the binary
/// has one failing test, `postgres::not_built`, instead: a store's tranche is never left out
/// without a word.
#[macro_export]
macro_rules! on_postgres {
    ($($test:ident),* $(,)?) => {
        #[cfg(feature = "postgres")]
        mod postgres {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $test() {
                    super::$test($crate::common::Backend::postgres().await).await
                }
            )*
        }
        #[cfg(not(feature = "postgres"))]
        mod postgres {
            #[test]
            fn not_built() {
                panic!(
                    "this suite's PostgreSQL tests were not built (the crate feature `postgres` is off): \
                     run scripts/test.sh, or cargo test --all-features"
                );
            }
        }
    };
}

/// The `message` field of a tracing event, for tests that capture logs.
pub fn event_message(event: &tracing::Event<'_>) -> String {
    struct Message(String);
    impl tracing::field::Visit for Message {
        fn record_debug(&mut self, field: &tracing::field::Field, value: &dyn std::fmt::Debug) {
            if field.name() == "message" {
                self.0 = format!("{value:?}");
            }
        }
    }
    let mut message = Message(String::new());
    event.record(&mut message);
    message.0
}

pub mod app {
    //! A test application: an axum router whose handler counts its runs and answers as the
    //! request's `x-*` headers ask.
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Arc;
    use std::time::Duration;

    use axum::body::Body;
    use axum::response::Response;
    use axum::routing;
    use axum::Router;
    use bytes::Bytes;
    use http::{HeaderMap, HeaderValue, Request, StatusCode};
    use http_body_util::BodyExt;
    use tower::ServiceExt;
    use tower_idempotency::IdempotencyLayer;

    /// How often the handler started, how often it ran to its end, the key of each start, and
    /// when runs were stopped before their end (their future dropped: cancelled, or a panic).
    #[derive(Clone, Default)]
    pub struct Runs {
        started: Arc<AtomicUsize>,
        finished: Arc<AtomicUsize>,
        keys: Arc<std::sync::Mutex<Vec<String>>>,
        stopped: Arc<std::sync::Mutex<Vec<std::time::Instant>>>,
    }

    /// Held by a run of the handler: dropped before it is marked done, it records when the run
    /// was stopped.
    struct Running {
        runs: Runs,
        done: bool,
    }

    impl Drop for Running {
        fn drop(&mut self) {
            if !self.done {
                self.runs.stopped.lock().unwrap().push(std::time::Instant::now());
            }
        }
    }

    impl Runs {
        /// Handler starts.
        pub fn get(&self) -> usize {
            self.started.load(Ordering::SeqCst)
        }

        /// Handler runs that reached their response.
        pub fn finished(&self) -> usize {
            self.finished.load(Ordering::SeqCst)
        }

        /// How often the handler started for `key` (its `Idempotency-Key`).
        pub fn of(&self, key: &str) -> usize {
            self.keys.lock().unwrap().iter().filter(|k| *k == key).count()
        }

        /// When each run stopped before its end (its future dropped mid-run: a cancellation, or
        /// a panic), in order.
        pub fn stopped(&self) -> Vec<std::time::Instant> {
            self.stopped.lock().unwrap().clone()
        }
    }

    async fn handler(runs: Runs, headers: HeaderMap, body: Bytes) -> Response {
        let run = runs.started.fetch_add(1, Ordering::SeqCst) + 1;
        let mut running = Running {
            runs: runs.clone(),
            done: false,
        };
        let header = |name: &str| headers.get(name).and_then(|v| v.to_str().ok()).map(str::to_owned);
        runs.keys
            .lock()
            .unwrap()
            .push(header("idempotency-key").unwrap_or_default());
        if let Some(ms) = header("x-delay-ms").and_then(|v| v.parse().ok()) {
            tokio::time::sleep(Duration::from_millis(ms)).await;
        }
        if header("x-panic").is_some() {
            panic!("handler asked to panic");
        }
        runs.finished.fetch_add(1, Ordering::SeqCst);
        running.done = true;
        let status = header("x-status").and_then(|s| s.parse().ok()).unwrap_or(201);
        let body = match header("x-body-size").and_then(|v| v.parse::<usize>().ok()) {
            Some(size) => Body::from(vec![b'x'; size]),
            None => match header("x-stream") {
                Some(spec) => stream(&spec, header("x-trailer")),
                None => Body::from(format!("run {run}; echo {}", String::from_utf8_lossy(&body))),
            },
        };
        let mut response = Response::new(body);
        if let Some(length) = header("x-stream-length") {
            response
                .headers_mut()
                .insert("content-length", HeaderValue::from_str(&length).unwrap());
        }
        *response.status_mut() = StatusCode::from_u16(status).unwrap();
        let h = response.headers_mut();
        h.insert(
            "content-type",
            HeaderValue::from_static("application/json; charset=utf-8"),
        );
        h.append("x-multi", HeaderValue::from_static("first"));
        h.append("x-multi", HeaderValue::from_static("second"));
        h.insert("x-latin1", HeaderValue::from_bytes(b"caf\xe9").unwrap());
        h.insert("set-cookie", HeaderValue::from_static("session=secret"));
        if let Some(cc) = header("x-cache-control") {
            h.insert("cache-control", HeaderValue::from_str(&cc).unwrap());
        }
        response
    }

    /// A body of unknown length, as `x-stream: <chunks>,<ms between>[,fail]` asks: `chunk 0\n`,
    /// `chunk 1\n`, ..., then an error (`fail`) or the end, with an `x-checksum` trailer holding
    /// `trailer` if given.
    fn stream(spec: &str, trailer: Option<String>) -> Body {
        use http_body::Frame;
        let mut spec = spec.split(',');
        let chunks: u64 = spec.next().and_then(|n| n.parse().ok()).unwrap_or(1);
        let gap = Duration::from_millis(spec.next().and_then(|n| n.parse().ok()).unwrap_or(0));
        let fail = spec.next() == Some("fail");
        let frames = futures_util::stream::unfold(0u64, move |i| {
            let trailer = trailer.clone();
            async move {
                if i > 0 && i <= chunks {
                    tokio::time::sleep(gap).await;
                }
                let frame = match i {
                    i if i < chunks => Ok(Frame::data(Bytes::from(format!("chunk {i}\n")))),
                    i if i == chunks && fail => Err(std::io::Error::other("the upstream broke")),
                    i if i == chunks => {
                        let value = HeaderValue::from_str(&trailer?).unwrap();
                        Ok(Frame::trailers(HeaderMap::from_iter([(
                            http::HeaderName::from_static("x-checksum"),
                            value,
                        )])))
                    }
                    _ => return None,
                };
                Some((frame, i + 1))
            }
        });
        Body::new(http_body_util::StreamBody::new(frames))
    }

    /// `POST /payments` and `PATCH /payments` behind `layer`; `GET` and `PUT /payments` too.
    pub fn router(layer: IdempotencyLayer) -> (Router, Runs) {
        let runs = Runs::default();
        let r = runs.clone();
        let route = routing::post(move |h: HeaderMap, b: Bytes| handler(r.clone(), h, b));
        let r = runs.clone();
        let route = route.patch(move |h: HeaderMap, b: Bytes| handler(r.clone(), h, b));
        let r = runs.clone();
        let route = route.put(move |h: HeaderMap, b: Bytes| handler(r.clone(), h, b));
        let r = runs.clone();
        let route = route.merge(routing::get(move |h: HeaderMap| {
            handler(r.clone(), h, Bytes::new())
        }));
        (Router::new().route("/payments", route).layer(layer), runs)
    }

    pub struct Answer {
        pub status: StatusCode,
        pub headers: HeaderMap,
        pub body: Bytes,
        pub trailers: Option<HeaderMap>,
        pub extensions: http::Extensions,
    }

    impl Answer {
        pub fn problem_type(&self) -> String {
            let json: serde_json::Value = serde_json::from_slice(&self.body).expect("a problem+json body");
            json["type"].as_str().expect("a type").to_owned()
        }

        pub fn is_replay(&self) -> bool {
            self.headers
                .get("idempotent-replayed")
                .is_some_and(|v| v == "true")
        }
    }

    pub async fn send(router: &Router, request: Request<Body>) -> Answer {
        let response = router.clone().oneshot(request).await.expect("infallible");
        let (parts, body) = response.into_parts();
        let collected = body.collect().await.expect("a readable body");
        let trailers = collected.trailers().cloned();
        Answer {
            status: parts.status,
            headers: parts.headers,
            body: collected.to_bytes(),
            trailers,
            extensions: parts.extensions,
        }
    }

    /// Load sent across a store outage, as (key, status) pairs, checked against the handler's
    /// runs: every answer is 201 or 503, some met the outage (503), a 503 ran nothing (fail
    /// closed), a 201 ran exactly once, and nothing else ran.
    pub fn assert_failed_closed(answers: &[(String, StatusCode)], runs: &Runs) {
        let mut unavailable = 0;
        for (key, status) in answers {
            let expected = match *status {
                StatusCode::CREATED => 1,
                StatusCode::SERVICE_UNAVAILABLE => 0,
                other => panic!("{key}: answered {other}, not 201 or 503"),
            };
            unavailable += 1 - expected;
            assert_eq!(
                runs.of(key),
                expected,
                "{key}: answered {status}, ran {} times",
                runs.of(key)
            );
        }
        assert!(unavailable > 0, "no request met the outage: {answers:?}");
        assert_eq!(runs.get(), answers.len() - unavailable, "runs beyond the 201s");
    }

    /// Sends `key` until it is answered 201, then once more, which must replay that answer: the
    /// store took a completion again (a 201 alone is what a client also gets when every
    /// completion fails). Panics after 10 s.
    pub async fn until_stored(router: &Router, key: &str) {
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        let created = loop {
            let answer = send(router, super::app::payment(key, "{}")).await;
            if answer.status == StatusCode::CREATED {
                break answer;
            }
            assert!(
                std::time::Instant::now() < deadline,
                "never answered 201: {} {:?}",
                answer.status,
                answer.body
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        };
        let again = send(router, super::app::payment(key, "{}")).await;
        assert!(
            again.is_replay(),
            "{key}: answered 201 but not stored: {} {:?}",
            again.status,
            again.body
        );
        assert_eq!(
            again.body, created.body,
            "{key}: the replay differs from the answer"
        );
    }

    /// A router whose handler answers 201 `ran once` and, as it returns, has `proxy` drop the reply
    /// to the next request it forwards: the completion's. Counts the handler's runs.
    pub fn dropping_the_completion_reply(
        layer: IdempotencyLayer,
        proxy: &Arc<super::proxy::FaultProxy>,
    ) -> (Router, Arc<AtomicUsize>) {
        let runs = Arc::new(AtomicUsize::new(0));
        let (proxy, counted) = (proxy.clone(), runs.clone());
        let handler = move || {
            let (proxy, runs) = (proxy.clone(), counted.clone());
            async move {
                runs.fetch_add(1, Ordering::SeqCst);
                // The tail of the claim's answer (PostgreSQL's ReadyForQuery) may still be on its
                // way when the handler starts: let it pass first.
                tokio::time::sleep(Duration::from_millis(50)).await;
                proxy.set(super::proxy::Fault::DropNextReply);
                (StatusCode::CREATED, "ran once")
            }
        };
        (
            Router::new()
                .route("/payments", routing::post(handler))
                .layer(layer),
            runs,
        )
    }

    /// Every reconciliation event the layer reports, by kind.
    pub fn reconciled(layer: IdempotencyLayer) -> (IdempotencyLayer, Arc<std::sync::Mutex<Vec<String>>>) {
        let events = Arc::new(std::sync::Mutex::new(Vec::new()));
        let seen = events.clone();
        let layer =
            layer.with_reconciliation(move |event| seen.lock().unwrap().push(format!("{:?}", event.kind)));
        (layer, events)
    }

    /// Sends `request` from a task of its own, for requests that must overlap.
    pub fn spawn_send(router: &Router, request: Request<Body>) -> tokio::task::JoinHandle<Answer> {
        let router = router.clone();
        tokio::spawn(async move { send(&router, request).await })
    }

    /// `POST /payments` with JSON content type and, if given, an `Idempotency-Key`.
    pub fn post(key: Option<&str>) -> http::request::Builder {
        let builder = Request::post("/payments").header("content-type", "application/json");
        match key {
            Some(key) => builder.header("idempotency-key", key),
            None => builder,
        }
    }

    /// `POST /payments` with `key`, body `{}`, and the given `x-*` headers for the test handler.
    pub fn payment_with(key: &str, headers: &[(&str, &str)]) -> Request<Body> {
        let mut request = post(Some(key));
        for (name, value) in headers {
            request = request.header(*name, *value);
        }
        request.body(Body::from("{}")).unwrap()
    }

    pub fn payment(key: &str, body: &str) -> Request<Body> {
        post(Some(key)).body(Body::from(body.to_owned())).unwrap()
    }
}

/// A store wrapper that injects faults: answers that come back late (the call lands at once,
/// its answer after `answer_delay`: a slow network on the way back), releases that fail, and
/// completions that fail; it counts the completions and renewals it was asked for.
pub struct FaultyStore {
    inner: Arc<dyn Store>,
    answer_delay: Duration,
    releases_to_fail: std::sync::atomic::AtomicUsize,
    failed_releases: std::sync::atomic::AtomicUsize,
    completions_to_fail: std::sync::atomic::AtomicUsize,
    completion_failure_after: Duration,
    completions: std::sync::atomic::AtomicUsize,
    renewals: std::sync::atomic::AtomicUsize,
}

impl FaultyStore {
    pub fn new(inner: Arc<dyn Store>) -> Self {
        Self {
            inner,
            answer_delay: Duration::ZERO,
            releases_to_fail: 0.into(),
            failed_releases: 0.into(),
            completions_to_fail: 0.into(),
            completion_failure_after: Duration::ZERO,
            completions: 0.into(),
            renewals: 0.into(),
        }
    }

    /// The first `n` completions fail with `Unavailable` after `after` (a store that takes that
    /// long to fail, a timeout say), without reaching the inner store.
    pub fn with_failing_completions(self, n: usize, after: Duration) -> Self {
        self.completions_to_fail
            .store(n, std::sync::atomic::Ordering::SeqCst);
        Self {
            completion_failure_after: after,
            ..self
        }
    }

    /// Completions asked for, failed or not.
    pub fn completions(&self) -> usize {
        self.completions.load(std::sync::atomic::Ordering::SeqCst)
    }

    /// Renewals asked for.
    pub fn renewals(&self) -> usize {
        self.renewals.load(std::sync::atomic::Ordering::SeqCst)
    }

    /// Claims and completions answer only after `delay`.
    pub fn with_answer_delay(mut self, delay: Duration) -> Self {
        self.answer_delay = delay;
        self
    }

    /// The first `n` releases fail with `Unavailable`.
    pub fn with_failing_releases(self, n: usize) -> Self {
        self.releases_to_fail
            .store(n, std::sync::atomic::Ordering::SeqCst);
        self
    }

    pub fn failed_releases(&self) -> usize {
        self.failed_releases.load(std::sync::atomic::Ordering::SeqCst)
    }

    async fn late<T>(&self, answer: T) -> T {
        tokio::time::sleep(self.answer_delay).await;
        answer
    }
}

impl Store for FaultyStore {
    fn peek<'a>(
        &'a self,
        key: &'a tower_idempotency::RecordKey,
        fingerprint: &'a tower_idempotency::Fingerprint,
    ) -> tower_idempotency::StoreFuture<'a, Option<tower_idempotency::ClaimOutcome>> {
        Box::pin(async move { self.late(self.inner.peek(key, fingerprint).await).await })
    }
    fn claim<'a>(
        &'a self,
        key: &'a tower_idempotency::RecordKey,
        fingerprint: &'a tower_idempotency::Fingerprint,
        owner: &'a tower_idempotency::OwnerToken,
        lease: Duration,
    ) -> tower_idempotency::StoreFuture<'a, tower_idempotency::ClaimOutcome> {
        Box::pin(async move {
            self.late(self.inner.claim(key, fingerprint, owner, lease).await)
                .await
        })
    }
    fn complete<'a>(
        &'a self,
        key: &'a tower_idempotency::RecordKey,
        owner: &'a tower_idempotency::OwnerToken,
        payload: bytes::Bytes,
        retention: Duration,
    ) -> tower_idempotency::StoreFuture<'a, bool> {
        use std::sync::atomic::Ordering;
        self.completions.fetch_add(1, Ordering::SeqCst);
        let fail = self
            .completions_to_fail
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
            .is_ok();
        Box::pin(async move {
            if fail {
                tokio::time::sleep(self.completion_failure_after).await;
                let error = std::io::Error::new(std::io::ErrorKind::TimedOut, "injected completion failure");
                return Err(tower_idempotency::StoreError::Unavailable(Box::new(error)));
            }
            self.late(self.inner.complete(key, owner, payload, retention).await)
                .await
        })
    }
    fn release<'a>(
        &'a self,
        key: &'a tower_idempotency::RecordKey,
        owner: &'a tower_idempotency::OwnerToken,
    ) -> tower_idempotency::StoreFuture<'a, bool> {
        use std::sync::atomic::Ordering;
        let fail = self
            .releases_to_fail
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
            .is_ok();
        if fail {
            self.failed_releases.fetch_add(1, Ordering::SeqCst);
            let error = std::io::Error::new(std::io::ErrorKind::ConnectionReset, "injected");
            return Box::pin(std::future::ready(Err(
                tower_idempotency::StoreError::Unavailable(Box::new(error)),
            )));
        }
        self.inner.release(key, owner)
    }
    fn renew<'a>(
        &'a self,
        key: &'a tower_idempotency::RecordKey,
        owner: &'a tower_idempotency::OwnerToken,
        lease: Duration,
    ) -> tower_idempotency::StoreFuture<'a, bool> {
        self.renewals.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        self.inner.renew(key, owner, lease)
    }
    fn inspect<'a>(
        &'a self,
        key: &'a tower_idempotency::RecordKey,
    ) -> tower_idempotency::StoreFuture<'a, Option<tower_idempotency::RecordInfo>> {
        self.inner.inspect(key)
    }
    fn purge<'a>(
        &'a self,
        key: &'a tower_idempotency::RecordKey,
    ) -> tower_idempotency::StoreFuture<'a, bool> {
        self.inner.purge(key)
    }
}

/// The example `name`, built by cargo beside this test binary (tests run from
/// target/<profile>/deps; cargo builds examples into target/<profile>/examples).
pub fn example_binary(name: &str) -> PathBuf {
    let exe = std::env::current_exe().expect("test executable path");
    let path = exe
        .parent()
        .and_then(|deps| deps.parent())
        .expect("target dir")
        .join("examples")
        .join(name);
    assert!(
        path.exists(),
        "{} is missing: run the whole suite (cargo test builds examples) or `cargo build --examples --all-features`",
        path.display()
    );
    path
}

/// `--loglevel warning`; with `TEST_SERVER_LOGS=<dir>`, `--loglevel notice` and a log file
/// `<dir>/<kind>-<port>.log` that outlives the test (appended to across restarts), to read
/// what the servers did in a failing fault run (which replica a sentinel promoted, when a
/// replica synchronised).
pub fn server_log_args(kind: &str, port: u16) -> Vec<String> {
    match std::env::var_os("TEST_SERVER_LOGS") {
        Some(dir) => {
            let dir = PathBuf::from(dir);
            let _ = std::fs::create_dir_all(&dir);
            let file = dir.join(format!("{kind}-{port}.log"));
            vec![
                "--loglevel".into(),
                "notice".into(),
                "--logfile".into(),
                file.display().to_string(),
            ]
        }
        None => vec!["--loglevel".into(), "warning".into()],
    }
}
