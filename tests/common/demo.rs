//! The quickstart example run as a black box: the built binary started on a free port, with
//! `REDIS_URL`, `DATABASE_URL` or neither, and an HTTP client for it.

use std::io::{BufRead, BufReader, Read};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};

use bytes::Bytes;
use http::{HeaderMap, Request, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper::client::conn::http1::SendRequest;
use hyper_util::rt::TokioIo;

/// A running quickstart, killed when dropped.
pub struct Demo {
    pub child: Child,
    pub addr: SocketAddr,
    /// Its first line: which store it uses.
    pub store_line: String,
}

impl Drop for Demo {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The quickstart built by cargo beside this test binary.
pub fn quickstart_binary() -> PathBuf {
    super::example_binary("quickstart")
}

/// Starts the quickstart on a free port, on Redis at `redis_url` or in memory, and waits until
/// it listens. Panics with the quickstart's own error output if it exits instead (a URL it
/// cannot connect to, say).
pub fn start(redis_url: Option<&str>) -> Demo {
    start_with(redis_url, None, &[])
}

/// [`start`] with a `DATABASE_URL` and more environment variables.
pub fn start_with(redis_url: Option<&str>, database_url: Option<&str>, env: &[(&str, &str)]) -> Demo {
    let mut command = Command::new(quickstart_binary());
    command.envs(env.iter().copied());
    command
        .env("ADDR", "127.0.0.1:0")
        .env("RUST_LOG", "warn")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    for (name, value) in [("REDIS_URL", redis_url), ("DATABASE_URL", database_url)] {
        match value {
            Some(url) => command.env(name, url),
            None => command.env_remove(name),
        };
    }
    let mut child = command.spawn().expect("start the quickstart example");
    let mut stderr = child.stderr.take().expect("stderr");
    let mut lines = BufReader::new(child.stdout.take().expect("stdout")).lines();
    let (Some(Ok(store_line)), Some(Ok(listening))) = (lines.next(), lines.next()) else {
        let status = child.wait().expect("wait for the quickstart");
        let mut errors = String::new();
        let _ = stderr.read_to_string(&mut errors);
        panic!("the quickstart ({redis_url:?}, {database_url:?}) did not start: {status}\n{errors}");
    };
    // Its warnings go to this test's output (shown if the test fails), and never fill the pipe.
    std::thread::spawn(move || {
        for line in BufReader::new(stderr).lines().map_while(Result::ok) {
            eprintln!("quickstart: {line}");
        }
    });
    let addr = listening
        .trim_start_matches("listening on http://")
        .parse()
        .expect("an address");
    Demo {
        child,
        addr,
        store_line,
    }
}

pub struct Reply {
    pub status: StatusCode,
    pub headers: HeaderMap,
    /// The body as it came.
    pub body: Bytes,
    /// The body as JSON (`Null` if it is not).
    pub json: serde_json::Value,
}

/// A keep-alive connection to the demo.
pub async fn connect(addr: SocketAddr) -> SendRequest<Full<Bytes>> {
    let stream = tokio::net::TcpStream::connect(addr)
        .await
        .expect("connect to the demo");
    let (sender, connection) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
        .await
        .unwrap();
    tokio::spawn(connection);
    sender
}

/// `POST path` with a JSON `body` and, if given, an `Idempotency-Key`.
pub async fn send(sender: &mut SendRequest<Full<Bytes>>, path: &str, key: Option<&str>, body: &str) -> Reply {
    send_with(sender, path, key, body, &[]).await
}

/// [`send`] with more request headers.
pub async fn send_with(
    sender: &mut SendRequest<Full<Bytes>>,
    path: &str,
    key: Option<&str>,
    body: &str,
    headers: &[(&str, &str)],
) -> Reply {
    let mut request = Request::post(path).header("content-type", "application/json");
    if let Some(key) = key {
        request = request.header("idempotency-key", key);
    }
    for (name, value) in headers {
        request = request.header(*name, *value);
    }
    sender.ready().await.expect("the connection is open");
    let response = sender
        .send_request(request.body(Full::new(Bytes::from(body.to_owned()))).unwrap())
        .await
        .unwrap();
    let (parts, body) = response.into_parts();
    let body = body.collect().await.unwrap().to_bytes();
    let json = serde_json::from_slice(&body).unwrap_or(serde_json::Value::Null);
    Reply {
        status: parts.status,
        headers: parts.headers,
        body,
        json,
    }
}

/// `GET path` on a connection of its own.
pub async fn fetch(addr: SocketAddr, path: &str) -> Reply {
    let mut sender = connect(addr).await;
    sender.ready().await.expect("the connection is open");
    let response = sender
        .send_request(Request::get(path).body(Full::new(Bytes::new())).unwrap())
        .await
        .unwrap();
    let (parts, body) = response.into_parts();
    let body = body.collect().await.unwrap().to_bytes();
    Reply {
        status: parts.status,
        headers: parts.headers,
        body,
        json: serde_json::Value::Null,
    }
}

/// [`send`] on a connection of its own.
pub async fn call(addr: SocketAddr, path: &str, key: Option<&str>, body: &str) -> Reply {
    send(&mut connect(addr).await, path, key, body).await
}
