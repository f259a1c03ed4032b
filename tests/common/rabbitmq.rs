//! A real RabbitMQ node for the tests: a private `rabbitmq-server` run as the current user, with
//! its own node name, its own `epmd` on a free port (`ERL_EPMD_PORT`), its AMQP and distribution
//! ports free loopback ports, its database and logs in a directory of its own, and no plugins.
//! Never touches 5672, 4369 or a node the system runs.
//!
//! Starting a node takes seconds (the Erlang VM boots RabbitMQ's applications: 5-10 s on 2
//! loaded cores), so a test binary shares one ([`shared`]) and gives each test queues of its
//! own ([`unique_queue`]).
#![allow(dead_code)]

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

/// The server script: `RABBITMQ_SERVER_BIN`, else Debian's. Not `/usr/sbin/rabbitmq-server`,
/// which runs the node as the `rabbitmq` user from `/var/lib/rabbitmq`.
fn server_binary() -> PathBuf {
    let path = std::env::var_os("RABBITMQ_SERVER_BIN")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("/usr/lib/rabbitmq/bin/rabbitmq-server"));
    if !path.exists() {
        panic!(
            "no rabbitmq-server at {}: install it (apt-get install rabbitmq-server) or run \
             scripts/test.sh, which does; or set RABBITMQ_SERVER_BIN",
            path.display()
        );
    }
    path
}

fn free_port() -> u16 {
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind an ephemeral loopback port");
    listener.local_addr().expect("local address").port()
}

static SERIAL: AtomicUsize = AtomicUsize::new(0);

/// Runs as the process group's leader, so one `kill -9 -PGID` ends epmd, the node and every
/// process the node started. Starts epmd first (the node is told not to start one of its own,
/// which would outlive it), then the node; when this test process closes the script's stdin
/// (it dropped the server, or exited however it did, `kill -9` included) it kills the group.
/// Should the node stop by itself (its port was taken), `exited` says so and the group goes too.
const SUPERVISOR: &str = r#"
exec 3<&0
epmd -port "$ERL_EPMD_PORT" -address 127.0.0.1 >"$DIR/epmd.log" 2>&1 &
n=0
until epmd -port "$ERL_EPMD_PORT" -names >/dev/null 2>&1; do
  n=$((n + 1))
  if [ "$n" -gt 500 ]; then echo "epmd did not start" >"$DIR/exited"; kill -9 0; fi
  sleep 0.01
done
( "$RABBITMQ_SERVER" >"$DIR/server.log" 2>&1; echo "rabbitmq-server exited: $?" >"$DIR/exited"; kill -9 0 ) &
read _ <&3
kill -9 0
"#;

/// A RabbitMQ node this test owns: started on free loopback ports, killed (with its epmd) when
/// dropped or when this test process exits.
pub struct RabbitServer {
    amqp_port: u16,
    epmd_port: u16,
    node: String,
    dir: PathBuf,
    child: Option<Child>,
    /// Held open: the supervisor kills the node when it closes.
    lifeline: Option<ChildStdin>,
    /// How long the node took from its start to accepting AMQP.
    started_in: Duration,
}

impl RabbitServer {
    /// Starts a node. Panics with a clear message if RabbitMQ is not installed: a missing server
    /// is a failure, never a skip.
    pub fn start() -> Self {
        let binary = server_binary();
        let mut last = String::new();
        for _ in 0..3 {
            match Self::start_once(&binary) {
                Ok(server) => return server,
                Err(why) => last = why,
            }
        }
        panic!("could not start rabbitmq-server after 3 tries: {last}");
    }

    fn start_once(binary: &Path) -> Result<Self, String> {
        let (amqp_port, dist_port, epmd_port) = (free_port(), free_port(), free_port());
        for port in [amqp_port, dist_port, epmd_port] {
            assert!(
                port != 5672 && port != 4369 && port != 25672,
                "tests never use RabbitMQ's default ports"
            );
        }
        let serial = SERIAL.fetch_add(1, Ordering::Relaxed);
        let node = format!("tower-idempotency-{}-{serial}@localhost", std::process::id());
        let dir = std::env::temp_dir().join(format!(
            "tower-idempotency-rabbitmq-{}-{serial}",
            std::process::id()
        ));
        std::fs::create_dir_all(&dir).expect("create a directory for rabbitmq-server");
        std::fs::write(dir.join("enabled_plugins"), "").expect("write enabled_plugins");
        std::fs::write(
            dir.join("rabbitmq.conf"),
            // A nearly full disk (CI's) must not block publishers; the log says only what is wrong.
            "disk_free_limit.absolute = 1MB\nlog.console = false\nlog.file.level = warning\n",
        )
        .expect("write rabbitmq.conf");
        let path = |name: &str| dir.join(name).into_os_string();
        let began = Instant::now();
        let mut child = Command::new("sh")
            .args(["-c", SUPERVISOR])
            .env("DIR", &dir)
            .env("RABBITMQ_SERVER", binary)
            .env("ERL_EPMD_PORT", epmd_port.to_string())
            // The Erlang cookie goes to $HOME: this node's own, not the user's.
            .env("HOME", &dir)
            .env("RABBITMQ_NODENAME", &node)
            .env("RABBITMQ_NODE_IP_ADDRESS", "127.0.0.1")
            .env("RABBITMQ_NODE_PORT", amqp_port.to_string())
            .env("RABBITMQ_DIST_PORT", dist_port.to_string())
            .env(
                "RABBITMQ_SERVER_ADDITIONAL_ERL_ARGS",
                "-start_epmd false -kernel inet_dist_use_interface {127,0,0,1}",
            )
            .env("RABBITMQ_CONFIG_FILE", path("rabbitmq.conf"))
            .env("RABBITMQ_ADVANCED_CONFIG_FILE", path("advanced.config"))
            // Absent, so /etc/rabbitmq/rabbitmq-env.conf is not read either.
            .env("RABBITMQ_CONF_ENV_FILE", path("rabbitmq-env.conf"))
            .env("RABBITMQ_ENABLED_PLUGINS_FILE", path("enabled_plugins"))
            .env("RABBITMQ_PLUGINS_EXPAND_DIR", path("plugins-expand"))
            .env("RABBITMQ_MNESIA_BASE", path("mnesia"))
            .env("RABBITMQ_LOG_BASE", path("log"))
            .env("RABBITMQ_PID_FILE", path("rabbitmq.pid"))
            .process_group(0)
            .stdin(Stdio::piped())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("run sh to start rabbitmq-server");
        let lifeline = child.stdin.take();
        let mut server = Self {
            amqp_port,
            epmd_port,
            node,
            dir,
            child: Some(child),
            lifeline,
            started_in: Duration::ZERO,
        };
        let deadline = began + Duration::from_secs(60);
        while Instant::now() < deadline {
            if let Ok(why) = std::fs::read_to_string(server.dir.join("exited")) {
                let log = std::fs::read_to_string(server.dir.join("server.log")).unwrap_or_default();
                let tail: String = log
                    .lines()
                    .rev()
                    .take(15)
                    .collect::<Vec<_>>()
                    .into_iter()
                    .rev()
                    .collect::<Vec<_>>()
                    .join("\n");
                return Err(format!("{} ({}):\n{tail}", why.trim(), server.dir.display()));
            }
            if server.accepts_amqp() {
                server.started_in = began.elapsed();
                return Ok(server);
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        Err(format!(
            "no AMQP on port {amqp_port} after 60 s (logs in {})",
            server.dir.display()
        ))
    }

    /// Whether the node answers an AMQP 0-9-1 protocol header with `connection.start` (a method
    /// frame, type 1): RabbitMQ opens its listener only once it has booted, and a bare
    /// connection could reach another process holding the port for a moment.
    fn accepts_amqp(&self) -> bool {
        let Ok(mut stream) = TcpStream::connect_timeout(&self.addr(), Duration::from_millis(200)) else {
            return false;
        };
        let _ = stream.set_read_timeout(Some(Duration::from_secs(2)));
        let mut first = [0u8; 1];
        stream.write_all(b"AMQP\x00\x00\x09\x01").is_ok()
            && stream.read_exact(&mut first).is_ok()
            && first[0] == 1
    }

    pub fn addr(&self) -> SocketAddr {
        SocketAddr::from(([127, 0, 0, 1], self.amqp_port))
    }

    /// The AMQP URL of the default virtual host, as the default `guest` user (allowed from
    /// loopback).
    pub fn url(&self) -> String {
        format!("amqp://guest:guest@127.0.0.1:{}/%2f", self.amqp_port)
    }

    pub fn node(&self) -> &str {
        &self.node
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// How long the node took from its start to accepting AMQP.
    pub fn started_in(&self) -> Duration {
        self.started_in
    }

    /// Evaluates Erlang expressions on the node, through `erl_call` (Erlang's own small C
    /// client, milliseconds a call where `rabbitmqctl` boots a VM), and answers what they
    /// return, as Erlang prints it. Panics if the node does not answer.
    pub fn eval(&self, expressions: &str) -> String {
        let cookie =
            std::fs::read_to_string(self.dir.join(".erlang.cookie")).expect("read the node's Erlang cookie");
        let mut failed = String::new();
        // A connection is now and then refused under load ("failed to connect to node"): try
        // again a few times before calling the node gone.
        for _ in 0..5 {
            let mut child = Command::new("erl_call")
                .args(["-sname", &self.node, "-c", cookie.trim(), "-e"])
                .env("ERL_EPMD_PORT", self.epmd_port.to_string())
                .stdin(Stdio::piped())
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .spawn()
                .expect("run erl_call (it comes with erlang-base, which rabbitmq-server needs)");
            let mut stdin = child.stdin.take().expect("erl_call's stdin");
            stdin
                .write_all(format!("{expressions}\n").as_bytes())
                .expect("write to erl_call");
            drop(stdin);
            let output = child.wait_with_output().expect("wait for erl_call");
            let answer = String::from_utf8_lossy(&output.stdout).into_owned();
            if output.status.success() && answer.starts_with("{ok,") {
                return answer;
            }
            failed = format!("{answer:?} {}", String::from_utf8_lossy(&output.stderr));
            std::thread::sleep(Duration::from_millis(50));
        }
        panic!("erl_call {expressions:?} answered {failed}");
    }

    /// A quorum queue's messages: ready for a consumer, and delivered but not acknowledged,
    /// read from the queue's state machine itself (over AMQP a queue tells only its ready
    /// messages, in `queue.declare-ok`).
    pub fn queue_counts(&self, queue: &str) -> (u64, u64) {
        let answer = self.eval(&format!(
            "{{ok, Q}} = rabbit_amqqueue:lookup(rabbit_misc:r(<<\"/\">>, queue, <<\"{queue}\">>)),
             Leader = amqqueue:get_pid(Q),
             {{ok, {{_, Ready}}, _}} = ra:local_query(Leader, fun rabbit_fifo:query_messages_ready/1),
             {{ok, {{_, Out}}, _}} = ra:local_query(Leader, fun rabbit_fifo:query_messages_checked_out/1),
             {{Ready, Out}}."
        ));
        // "{ok, {3,1}}"
        let numbers: Vec<u64> = answer
            .split(|c: char| !c.is_ascii_digit())
            .filter(|part| !part.is_empty())
            .map(|part| part.parse().expect("a count"))
            .collect();
        match numbers[..] {
            [ready, unacked] => (ready, unacked),
            _ => panic!("unexpected counts for {queue}: {answer}"),
        }
    }

    /// Kills the node, its epmd and every process they started (SIGKILL).
    pub fn kill(&mut self) {
        self.lifeline = None;
        if let Some(mut child) = self.child.take() {
            let _ = Command::new("kill")
                .args(["-s", "KILL", "--", &format!("-{}", child.id())])
                .stderr(Stdio::null())
                .status();
            let _ = child.wait();
        }
    }
}

impl Drop for RabbitServer {
    fn drop(&mut self) {
        self.kill();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// The node shared by every test of this binary: started once, killed when the test binary
/// exits (its supervisor sees this process's end of the pipe close), its directory removed then.
pub fn shared() -> &'static RabbitServer {
    static SHARED: OnceLock<RabbitServer> = OnceLock::new();
    SHARED.get_or_init(|| {
        let server = RabbitServer::start();
        super::reap_at_exit(&[], &[server.dir()]);
        eprintln!(
            "rabbitmq-server {} accepted AMQP {:?} after its start",
            server.node(),
            server.started_in()
        );
        server
    })
}

/// A queue name no other test of this binary uses.
pub fn unique_queue(prefix: &str) -> String {
    static QUEUES: AtomicUsize = AtomicUsize::new(0);
    format!(
        "{prefix}-{}-{}",
        std::process::id(),
        QUEUES.fetch_add(1, Ordering::Relaxed)
    )
}
