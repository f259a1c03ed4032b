//! Real PostgreSQL servers for the tests: a cluster made once per test binary with `initdb`
//! (as the `postgres` user when the tests run as root: PostgreSQL refuses to run as root),
//! copied for each server, started on a free loopback port, and killed (`kill -9`), restarted
//! (crash recovery, on the same port and data), paused (`SIGSTOP`) and resumed as a test asks.
//! Never touches a PostgreSQL on 5432.
#![allow(dead_code)]

use std::net::{SocketAddr, TcpListener};
use std::os::unix::fs::MetadataExt;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

/// The directory of `initdb`, `postgres` and `pg_isready`: `PG_BIN_DIR`, else the newest
/// `/usr/lib/postgresql/*/bin` (Debian's layout).
fn bin_dir() -> PathBuf {
    if let Ok(dir) = std::env::var("PG_BIN_DIR") {
        return PathBuf::from(dir);
    }
    let mut found: Vec<(u32, PathBuf)> = std::fs::read_dir("/usr/lib/postgresql")
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|entry| {
            let version = entry.file_name().to_str()?.parse().ok()?;
            let bin = entry.path().join("bin");
            bin.join("initdb").exists().then_some((version, bin))
        })
        .collect();
    found.sort();
    match found.pop() {
        Some((_, bin)) => bin,
        None => panic!(
            "no PostgreSQL server binaries (initdb) under /usr/lib/postgresql/*/bin: install them \
             (apt-get install postgresql) or run scripts/test.sh, which does; or set PG_BIN_DIR"
        ),
    }
}

/// The user and group the server runs as: `postgres` when this process is root (PostgreSQL
/// refuses to run as root), else this process's own.
fn server_user() -> Option<(u32, u32)> {
    let root = std::fs::metadata("/proc/self")
        .map(|m| m.uid() == 0)
        .unwrap_or(false);
    if !root {
        return None;
    }
    let passwd = std::fs::read_to_string("/etc/passwd").expect("read /etc/passwd");
    let entry = passwd
        .lines()
        .find(|line| line.starts_with("postgres:"))
        .unwrap_or_else(|| {
            panic!("the tests run as root and there is no `postgres` user to run PostgreSQL as (apt-get install postgresql creates it)")
        });
    let fields: Vec<&str> = entry.split(':').collect();
    let id = |i: usize| {
        fields
            .get(i)
            .and_then(|f| f.parse().ok())
            .expect("a uid and gid in /etc/passwd")
    };
    Some((id(2), id(3)))
}

fn command(program: &str) -> Command {
    let mut command = Command::new(bin_dir().join(program));
    if let Some((uid, gid)) = server_user() {
        command.uid(uid).gid(gid);
    }
    command
}

/// A directory the server's user owns, mode 0700 as PostgreSQL requires of its data.
fn owned_dir(path: &Path) {
    use std::os::unix::fs::PermissionsExt;
    std::fs::create_dir_all(path).expect("create a directory for PostgreSQL");
    if let Some((uid, gid)) = server_user() {
        std::os::unix::fs::chown(path, Some(uid), Some(gid))
            .expect("hand the directory to the postgres user");
    }
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o700)).expect("chmod 0700");
}

static SERIAL: AtomicUsize = AtomicUsize::new(0);

fn scratch(name: &str) -> PathBuf {
    std::env::temp_dir().join(format!(
        "tower-idempotency-pg-{name}-{}-{}",
        std::process::id(),
        SERIAL.fetch_add(1, Ordering::Relaxed)
    ))
}

/// One `initdb` per test binary: each server starts from a copy of it, which takes
/// milliseconds where `initdb` takes seconds.
fn template() -> &'static Path {
    static TEMPLATE: OnceLock<PathBuf> = OnceLock::new();
    TEMPLATE.get_or_init(|| {
        let dir = scratch("template");
        owned_dir(&dir);
        let output = command("initdb")
            .arg("-D")
            .arg(&dir)
            .args([
                "-U",
                "postgres",
                "-A",
                "trust",
                "-E",
                "UTF8",
                "--locale=C",
                "--no-sync",
            ])
            .output()
            .unwrap_or_else(|error| panic!("cannot run initdb from {}: {error}", bin_dir().display()));
        assert!(
            output.status.success(),
            "initdb failed: {}",
            String::from_utf8_lossy(&output.stderr)
        );
        super::reap_at_exit(&[], &[&dir]);
        dir
    })
}

fn free_port() -> u16 {
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind an ephemeral loopback port");
    listener.local_addr().expect("local address").port()
}

/// A PostgreSQL server this test owns: started on a free port, killed when dropped.
pub struct PgServer {
    port: u16,
    dir: PathBuf,
    child: Option<Child>,
}

impl PgServer {
    /// Starts a server with an empty cluster on a free loopback port. Panics with a clear
    /// message if PostgreSQL is not installed: a missing server is a failure, never a skip.
    pub fn start() -> Self {
        let dir = scratch("data");
        let copied = Command::new("cp")
            .arg("-a")
            .arg(template())
            .arg(&dir)
            .status()
            .expect("run cp");
        assert!(copied.success(), "copy the template cluster");
        for _ in 0..5 {
            let mut server = Self {
                port: free_port(),
                dir: dir.clone(),
                child: None,
            };
            if server.spawn() {
                return server;
            }
        }
        panic!(
            "could not start PostgreSQL on a free port after 5 tries (log: {})",
            dir.join("server.log").display()
        );
    }

    fn spawn(&mut self) -> bool {
        assert_ne!(self.port, 5432, "tests never use the default PostgreSQL port");
        // A crash leaves its pid file behind; every process of that server is dead by now.
        let _ = std::fs::remove_file(self.dir.join("postmaster.pid"));
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.dir.join("server.log"))
            .expect("open the server log");
        let child = command("postgres")
            .arg("-D")
            .arg(&self.dir)
            .args(["-p", &self.port.to_string()])
            .args(["-c", "listen_addresses=127.0.0.1"])
            .arg("-c")
            .arg(format!("unix_socket_directories={}", self.dir.display()))
            // Test data need no durability against a power cut; a killed process loses nothing
            // the kernel already holds, so kill -9 still tests crash recovery.
            .args(["-c", "fsync=off", "-c", "full_page_writes=off"])
            .args(["-c", "max_connections=300", "-c", "shared_buffers=32MB"])
            .args(["-c", "shared_preload_libraries=pg_stat_statements"])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .unwrap_or_else(|error| panic!("cannot run postgres from {}: {error}", bin_dir().display()));
        self.child = Some(child);
        let deadline = Instant::now() + Duration::from_secs(20);
        while Instant::now() < deadline {
            if let Some(child) = &mut self.child {
                if let Ok(Some(_)) = child.try_wait() {
                    self.child = None;
                    return false; // port taken, most likely
                }
            }
            let ready = Command::new(bin_dir().join("pg_isready"))
                .args([
                    "-q",
                    "-h",
                    "127.0.0.1",
                    "-p",
                    &self.port.to_string(),
                    "-U",
                    "postgres",
                ])
                .status()
                .is_ok_and(|status| status.success());
            if ready {
                return true;
            }
            std::thread::sleep(Duration::from_millis(20));
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

    /// A URL for the `postgres` database as the `postgres` user (trust authentication).
    pub fn url(&self) -> String {
        url_for(self.addr())
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The postmaster's process id.
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    /// The postmaster and every process it started (a backend per connection, the writers).
    pub fn pids(&self) -> Vec<u32> {
        let Some(postmaster) = self.pid() else {
            return Vec::new();
        };
        let mut pids = vec![postmaster];
        for entry in std::fs::read_dir("/proc").into_iter().flatten().flatten() {
            let Some(pid) = entry.file_name().to_str().and_then(|n| n.parse::<u32>().ok()) else {
                continue;
            };
            // "pid (comm) state ppid …": the name may hold spaces and parentheses.
            let stat = std::fs::read_to_string(entry.path().join("stat")).unwrap_or_default();
            let ppid = stat
                .rsplit_once(')')
                .and_then(|(_, rest)| rest.split_whitespace().nth(1))
                .and_then(|ppid| ppid.parse::<u32>().ok());
            if ppid == Some(postmaster) {
                pids.push(pid);
            }
        }
        pids
    }

    /// Sends `signal` to every process of the server, if it has any (a kill of a server killed
    /// already is nothing to do).
    fn signal(&self, signal: &str) -> bool {
        let pids: Vec<String> = self.pids().iter().map(u32::to_string).collect();
        if pids.is_empty() {
            return false;
        }
        let status = Command::new("kill")
            .arg(format!("-{signal}"))
            .args(&pids)
            .stderr(Stdio::null())
            .status()
            .expect("run kill");
        // A backend that exited since the list was read fails `kill` for itself alone: what
        // counts is that the postmaster (first in the list) is still there to have received it.
        status.success()
            || Command::new("kill")
                .args(["-0", &pids[0]])
                .stderr(Stdio::null())
                .status()
                .is_ok_and(|alive| alive.success())
    }

    /// Sends `signal` to a server that must be running: a pause that paused nothing would let
    /// a test pass without its fault.
    fn signal_running(&self, signal: &str) {
        assert!(
            self.signal(signal),
            "SIG{signal} to PostgreSQL on port {}: the server is not running",
            self.port
        );
    }

    /// Stops every process of the server (`SIGSTOP`): connections stay open, nothing answers.
    pub fn pause(&self) {
        self.signal_running("STOP");
    }

    /// Lets a paused server go on (`SIGCONT`).
    pub fn resume(&self) {
        self.signal_running("CONT");
    }

    /// Kills every process of the server (`SIGKILL`): a crash, not a shutdown.
    pub fn kill(&mut self) {
        // Nothing to kill is fine: a server killed already, or one that never bound its port.
        let _ = self.signal("KILL");
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
        // The backends are not our children: wait until none is left holding the data.
        let deadline = Instant::now() + Duration::from_secs(5);
        while Instant::now() < deadline
            && self.dir.join("postmaster.pid").exists()
            && any_process_uses(&self.dir)
        {
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// Starts the server again on the same port and data: PostgreSQL recovers from its WAL, so
    /// what was committed before a kill is still there.
    pub fn restart(&mut self) {
        self.kill();
        let deadline = Instant::now() + Duration::from_secs(20);
        while Instant::now() < deadline {
            if self.spawn() {
                return;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        panic!("could not restart PostgreSQL on port {}", self.port);
    }
}

/// Whether a process still has `dir` as its working directory (PostgreSQL's processes do).
fn any_process_uses(dir: &Path) -> bool {
    std::fs::read_dir("/proc")
        .into_iter()
        .flatten()
        .flatten()
        .any(|entry| std::fs::read_link(entry.path().join("cwd")).is_ok_and(|cwd| cwd == dir))
}

impl Drop for PgServer {
    fn drop(&mut self) {
        self.kill();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

pub fn url_for(addr: SocketAddr) -> String {
    format!("postgres://postgres@{addr}/postgres")
}

/// The server shared by every test of this binary that needs no faults of its own: started
/// once, killed when the test binary exits.
pub fn shared() -> &'static PgServer {
    static SHARED: OnceLock<PgServer> = OnceLock::new();
    SHARED.get_or_init(|| {
        let server = PgServer::start();
        let pids: Vec<u32> = server.pid().into_iter().collect();
        super::reap_at_exit(&pids, &[server.dir()]);
        server
    })
}

/// A table name no other test of this binary uses, so tests on one server never share records.
pub fn unique_table() -> String {
    static TABLES: AtomicUsize = AtomicUsize::new(0);
    format!(
        "idem_{}_{}",
        std::process::id(),
        TABLES.fetch_add(1, Ordering::Relaxed)
    )
}

/// A store on `url` in a table of its own, migrated.
pub async fn store(url: &str) -> tower_idempotency::PostgresStore {
    let store = tower_idempotency::PostgresStore::connect(url)
        .await
        .unwrap_or_else(|error| panic!("connect to {url}: {error}"))
        .with_table(&unique_table());
    store.migrate().await.expect("create the record table");
    store
}

/// A database of its own, named `<prefix>_<pid>_<n>`, on the server shared by this test binary:
/// its URL and a pool on it. For tests whose tables have fixed names (a consumer's `ledger`).
pub async fn fresh_database(prefix: &str) -> (String, sqlx::PgPool) {
    static DATABASES: AtomicUsize = AtomicUsize::new(0);
    let addr = tokio::task::spawn_blocking(|| shared().addr())
        .await
        .expect("start the shared PostgreSQL server");
    let name = format!(
        "{prefix}_{}_{}",
        std::process::id(),
        DATABASES.fetch_add(1, Ordering::Relaxed)
    );
    let admin = sqlx::PgPool::connect(&url_for(addr))
        .await
        .expect("connect to the shared PostgreSQL server");
    sqlx::query(&format!("CREATE DATABASE {name}"))
        .execute(&admin)
        .await
        .expect("create a database");
    admin.close().await;
    let url = format!("postgres://postgres@{addr}/{name}");
    let pool = sqlx::PgPool::connect(&url)
        .await
        .expect("connect to the new database");
    (url, pool)
}
