//! A TCP fault proxy between a client and a server (Redis, PostgreSQL): pass traffic through,
//! add latency, delay every byte (a slow network: bytes keep flowing, each late), drop every
//! connection, or black-hole (accept and forward nothing) all of them, only those open now, or
//! only the subscriptions open now. It counts what the client sends, and keeps its bytes when asked to.
#![allow(dead_code)]

use std::collections::VecDeque;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicU8, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{watch, Notify};

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub enum Fault {
    None = 0,
    /// Forward nothing in either direction; connections stay open.
    BlackHole = 1,
    /// Close every connection, and every new one at once.
    Drop = 2,
    /// Forward the next request to Redis, then drop the connection instead of delivering the
    /// answer (once; the proxy then passes traffic again).
    DropNextReply = 3,
}

pub struct FaultProxy {
    addr: SocketAddr,
    upstream: Arc<Mutex<SocketAddr>>,
    fault: Arc<AtomicU8>,
    latency_ms: Arc<AtomicU64>,
    delay_ms: Arc<AtomicU64>,
    epoch: watch::Sender<u64>,
    counts: Arc<Counts>,
    task: tokio::task::JoinHandle<()>,
}

/// Connections accepted, and reads from the clients forwarded to the server.
#[derive(Default)]
struct Counts {
    connections: AtomicU64,
    /// Connections numbered below this are black-holed for good.
    black_holed_below: AtomicU64,
    client_reads: AtomicU64,
    /// Reads from a client that came after an answer was delivered to it (or first on its
    /// connection): the round trips the clients waited for.
    turns: AtomicU64,
    /// Replies dropped by `Fault::DropNextReply`.
    dropped_replies: AtomicU64,
    /// What the clients sent since [`FaultProxy::keep_sent`], while it keeps it.
    sent: Mutex<Option<Vec<u8>>>,
    /// What the clients were delivered since [`FaultProxy::keep_received`], while it keeps it.
    received: Mutex<Option<Vec<u8>>>,
    /// The armed cut of [`FaultProxy::cut_after_sending`] or [`FaultProxy::cut_after_answering`].
    cut: Mutex<Option<Cut>>,
    /// Connections cut by it so far.
    cuts: AtomicU64,
    /// The connections whose client sent `SUBSCRIBE` or `PSUBSCRIBE`.
    subscriptions: Mutex<Vec<u64>>,
    /// Those black-holed by [`FaultProxy::black_hole_open_subscriptions`].
    held_subscriptions: Mutex<Vec<u64>>,
}

/// A cut armed on the connections whose client sends `pattern`.
#[derive(Clone)]
struct Cut {
    pattern: Vec<u8>,
    /// When to cut: this long after forwarding the read, or (`None`) at the next answer on that
    /// connection: once it is delivered, or instead of delivering it (`drop_answer`).
    after: Option<Duration>,
    drop_answer: bool,
    /// How many more connections to cut.
    times: u64,
    /// How many reads holding the pattern go through untouched before the first cut.
    spare: u64,
}

impl Counts {
    /// Whether `read` arms a cut (it holds the pattern, and cuts are left): the cut if so.
    fn cut_for(&self, read: &[u8]) -> Option<Cut> {
        let mut armed = self.cut.lock().unwrap();
        let cut = armed.as_mut()?;
        if cut.times == 0 || !read.windows(cut.pattern.len()).any(|w| w == cut.pattern) {
            return None;
        }
        if cut.spare > 0 {
            cut.spare -= 1;
            return None;
        }
        cut.times -= 1;
        self.cuts.fetch_add(1, Ordering::SeqCst);
        Some(cut.clone())
    }
}

impl FaultProxy {
    pub async fn start(upstream: SocketAddr) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind the proxy");
        let addr = listener.local_addr().expect("proxy address");
        let fault = Arc::new(AtomicU8::new(Fault::None as u8));
        let latency_ms = Arc::new(AtomicU64::new(0));
        let delay_ms = Arc::new(AtomicU64::new(0));
        let (epoch, _) = watch::channel(0);
        let upstream = Arc::new(Mutex::new(upstream));
        let counts = Arc::new(Counts::default());
        let task = {
            let (fault, latency_ms, epoch) = (fault.clone(), latency_ms.clone(), epoch.clone());
            let (upstream, counts, delay_ms) = (upstream.clone(), counts.clone(), delay_ms.clone());
            tokio::spawn(async move {
                while let Ok((client, _)) = listener.accept().await {
                    let (fault, latency_ms, epoch) = (fault.clone(), latency_ms.clone(), epoch.subscribe());
                    let delay_ms = delay_ms.clone();
                    let upstream = *upstream.lock().unwrap();
                    let number = counts.connections.fetch_add(1, Ordering::SeqCst);
                    let faults = Faults {
                        fault,
                        latency_ms,
                        delay_ms,
                        counts: counts.clone(),
                        number,
                    };
                    tokio::spawn(serve(client, upstream, faults, epoch));
                }
            })
        };
        Self {
            addr,
            upstream,
            fault,
            latency_ms,
            delay_ms,
            epoch,
            counts,
            task,
        }
    }

    /// Black-holes the connections open now, until [`release_black_holed`]; new ones pass (as
    /// set by [`set`]).
    pub fn black_hole_open_connections(&self) {
        let open = self.counts.connections.load(Ordering::SeqCst);
        self.counts.black_holed_below.store(open, Ordering::SeqCst);
    }

    /// Black-holes the subscriptions open now (connections whose client sent `SUBSCRIBE` or
    /// `PSUBSCRIBE`), until [`release_black_holed`]; the other connections pass (a sentinel's
    /// links to the others, where it announces this proxy's address).
    pub fn black_hole_open_subscriptions(&self) {
        let open = self.counts.subscriptions.lock().unwrap().clone();
        *self.counts.held_subscriptions.lock().unwrap() = open;
    }

    /// Lets the connections [`black_hole_open_connections`] or
    /// [`black_hole_open_subscriptions`] held pass again: what they held is delivered then, late.
    pub fn release_black_holed(&self) {
        self.counts.black_holed_below.store(0, Ordering::SeqCst);
        self.counts.held_subscriptions.lock().unwrap().clear();
    }

    /// Keeps what the clients are delivered from now on ([`received`](Self::received)).
    pub fn keep_received(&self) {
        *self.counts.received.lock().unwrap() = Some(Vec::new());
    }

    /// What the clients were delivered since [`keep_received`](Self::keep_received).
    pub fn received(&self) -> Vec<u8> {
        self.counts.received.lock().unwrap().clone().unwrap_or_default()
    }

    /// Connections accepted so far.
    pub fn connections(&self) -> u64 {
        self.counts.connections.load(Ordering::SeqCst)
    }

    /// Reads from the clients forwarded so far: one per message a client sends and then
    /// waits on, as a client does when it waits for each answer.
    pub fn client_reads(&self) -> u64 {
        self.counts.client_reads.load(Ordering::SeqCst)
    }

    /// Round trips so far, over all connections: reads from a client that came after the proxy
    /// delivered an answer on that connection. Commands a client sends behind one another
    /// without waiting count once, provided the answers are late enough (set a latency) not to
    /// reach it before it has sent them all.
    pub fn turns(&self) -> u64 {
        self.counts.turns.load(Ordering::SeqCst)
    }

    /// Keeps every byte the clients send from now on (all connections, in the order read),
    /// dropping what was kept before.
    pub fn keep_sent(&self) {
        *self.counts.sent.lock().unwrap() = Some(Vec::new());
    }

    /// The bytes kept since [`keep_sent`](Self::keep_sent).
    pub fn sent(&self) -> Vec<u8> {
        self.counts.sent.lock().unwrap().clone().unwrap_or_default()
    }

    /// Replies dropped so far by [`Fault::DropNextReply`] (each one's request reached the server).
    pub fn dropped_replies(&self) -> u64 {
        self.counts.dropped_replies.load(Ordering::SeqCst)
    }

    pub fn url(&self) -> String {
        format!("redis://{}", self.addr)
    }

    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Sets the fault. `Drop` also cuts the connections open now.
    pub fn set(&self, fault: Fault) {
        self.fault.store(fault as u8, Ordering::SeqCst);
        if fault == Fault::Drop {
            self.epoch.send_modify(|e| *e += 1);
        }
    }

    /// Sends new connections to `upstream` from now on, and cuts the open ones (a failover to
    /// another server behind one address).
    pub fn set_upstream(&self, upstream: SocketAddr) {
        *self.upstream.lock().unwrap() = upstream;
        self.epoch.send_modify(|e| *e += 1);
    }

    /// Closes a connection `after` this long once it forwarded a read from the client holding
    /// `pattern` (say `$4\r\nWAIT\r\n`, a `WAIT` in RESP), at most `times` connections; the
    /// answer to that read, if later, is never delivered.
    pub fn cut_after_sending(&self, pattern: &[u8], after: Duration, times: u64) {
        *self.counts.cut.lock().unwrap() = Some(Cut {
            pattern: pattern.to_vec(),
            after: Some(after),
            drop_answer: false,
            times,
            spare: 0,
        });
    }

    /// Closes a connection right after delivering the next answer behind a read from the client
    /// holding `pattern`, at most `times` connections: the client has that answer, and whatever
    /// it sends next needs a new connection.
    pub fn cut_after_answering(&self, pattern: &[u8], times: u64) {
        *self.counts.cut.lock().unwrap() = Some(Cut {
            pattern: pattern.to_vec(),
            after: None,
            drop_answer: false,
            times,
            spare: 0,
        });
    }

    /// Closes a connection instead of delivering the next answer behind a read from the client
    /// holding `pattern` (the command reached the server; its answer is lost), at most `times`
    /// connections.
    pub fn cut_instead_of_answering(&self, pattern: &[u8], times: u64) {
        *self.counts.cut.lock().unwrap() = Some(Cut {
            pattern: pattern.to_vec(),
            after: None,
            drop_answer: true,
            times,
            spare: 0,
        });
    }

    /// As [`cut_instead_of_answering`](Self::cut_instead_of_answering), once `spare` reads
    /// holding `pattern` have gone through untouched (another client's, say, that sends it
    /// first).
    pub fn cut_instead_of_answering_after(&self, pattern: &[u8], spare: u64, times: u64) {
        self.cut_instead_of_answering(pattern, times);
        if let Some(cut) = self.counts.cut.lock().unwrap().as_mut() {
            cut.spare = spare;
        }
    }

    /// Connections cut by [`cut_after_sending`](Self::cut_after_sending) or
    /// [`cut_after_answering`](Self::cut_after_answering) so far.
    pub fn cuts(&self) -> u64 {
        self.counts.cuts.load(Ordering::SeqCst)
    }

    /// Holds each read for `latency` before forwarding it, and reads no more meanwhile: later
    /// bytes wait behind it (a slow link whose reads pile up).
    pub fn set_latency(&self, latency: Duration) {
        self.latency_ms
            .store(latency.as_millis() as u64, Ordering::SeqCst);
    }

    /// Delivers every byte read from now on `delay` after it was read, in both directions and
    /// in order, while reading on meanwhile (a slow network, not a slow reader: each byte is
    /// `delay` late, none later for those before it). `Duration::ZERO` ends it.
    pub fn set_delay(&self, delay: Duration) {
        self.delay_ms.store(delay.as_millis() as u64, Ordering::SeqCst);
    }
}

impl Drop for FaultProxy {
    fn drop(&mut self) {
        self.task.abort();
        self.epoch.send_modify(|e| *e += 1);
        self.fault.store(Fault::Drop as u8, Ordering::SeqCst);
    }
}

fn current(fault: &AtomicU8) -> Fault {
    match fault.load(Ordering::SeqCst) {
        1 => Fault::BlackHole,
        2 => Fault::Drop,
        3 => Fault::DropNextReply,
        _ => Fault::None,
    }
}

/// What one connection's forwarding checks.
#[derive(Clone)]
struct Faults {
    fault: Arc<AtomicU8>,
    latency_ms: Arc<AtomicU64>,
    delay_ms: Arc<AtomicU64>,
    counts: Arc<Counts>,
    /// This connection's number.
    number: u64,
}

async fn serve(client: TcpStream, upstream: SocketAddr, faults: Faults, mut epoch: watch::Receiver<u64>) {
    if current(&faults.fault) == Fault::Drop {
        return;
    }
    let Ok(server) = TcpStream::connect(upstream).await else {
        return;
    };
    let (mut client_read, mut client_write) = client.into_split();
    let (mut server_read, mut server_write) = server.into_split();
    epoch.mark_unchanged();
    // An answer was delivered since the client last sent something (or it has sent nothing).
    let answered = Arc::new(AtomicBool::new(true));
    // A cut armed by the client's reads: now, after the next answer, or instead of it.
    let cut = Arc::new(Notify::new());
    let cut_after_answer = Arc::new(AtomicBool::new(false));
    let cut_instead_of_answer = Arc::new(AtomicBool::new(false));
    let up = {
        let (faults, answered) = (faults.clone(), answered.clone());
        let (cut, cut_after_answer) = (cut.clone(), cut_after_answer.clone());
        let cut_instead_of_answer = cut_instead_of_answer.clone();
        async move {
            let mut buffer = vec![0u8; 64 * 1024];
            let mut queue: Queue = VecDeque::new();
            loop {
                // What is due is written before the next read: with no delay, each read is
                // written before the next one is made, as before the delay existed.
                if let Some(bytes) = pop_due(&mut queue) {
                    pause(&faults).await;
                    if server_write.write_all(&bytes).await.is_err() {
                        return;
                    }
                    continue;
                }
                let due = queue.front().map(|(due, _)| *due);
                tokio::select! {
                    _ = tokio::time::sleep_until(due.unwrap_or_else(tokio::time::Instant::now)), if due.is_some() => {}
                    read = client_read.read(&mut buffer), if queue.len() < 4096 => {
                        let n = match read {
                            Ok(0) | Err(_) => return,
                            Ok(n) => n,
                        };
                        faults.counts.client_reads.fetch_add(1, Ordering::SeqCst);
                        if buffer[..n].windows(9).any(|w| w.eq_ignore_ascii_case(b"SUBSCRIBE")) {
                            faults.counts.subscriptions.lock().unwrap().push(faults.number);
                        }
                        if let Some(sent) = faults.counts.sent.lock().unwrap().as_mut() {
                            sent.extend_from_slice(&buffer[..n]);
                        }
                        if answered.swap(false, Ordering::SeqCst) {
                            faults.counts.turns.fetch_add(1, Ordering::SeqCst);
                        }
                        match faults.counts.cut_for(&buffer[..n]) {
                            Some(Cut { after: Some(after), .. }) => {
                                let (cut, due) = (cut.clone(), due_after(&faults) + after);
                                tokio::spawn(async move {
                                    tokio::time::sleep_until(due).await;
                                    cut.notify_one();
                                });
                            }
                            Some(Cut { drop_answer: true, .. }) => cut_instead_of_answer.store(true, Ordering::SeqCst),
                            Some(_) => cut_after_answer.store(true, Ordering::SeqCst),
                            None => {}
                        }
                        queue.push_back((due_after(&faults), buffer[..n].to_vec()));
                    }
                }
            }
        }
    };
    let down = {
        let faults = faults.clone();
        async move {
            let mut buffer = vec![0u8; 64 * 1024];
            let mut queue: Queue = VecDeque::new();
            loop {
                if let Some(bytes) = pop_due(&mut queue) {
                    pause(&faults).await;
                    // Before the write: a client that answers at once could otherwise send its
                    // next command before this task marks the answer delivered, and that round
                    // trip would not be counted (CI once counted a completion as 0 round trips).
                    answered.store(true, Ordering::SeqCst);
                    if client_write.write_all(&bytes).await.is_err() {
                        return;
                    }
                    if let Some(received) = faults.counts.received.lock().unwrap().as_mut() {
                        received.extend_from_slice(&bytes);
                    }
                    if cut_after_answer.swap(false, Ordering::SeqCst) {
                        return;
                    }
                    continue;
                }
                let due = queue.front().map(|(due, _)| *due);
                tokio::select! {
                    _ = tokio::time::sleep_until(due.unwrap_or_else(tokio::time::Instant::now)), if due.is_some() => {}
                    read = server_read.read(&mut buffer), if queue.len() < 4096 => {
                        let n = match read {
                            Ok(0) | Err(_) => return,
                            Ok(n) => n,
                        };
                        if cut_instead_of_answer.load(Ordering::SeqCst) {
                            return;
                        }
                        let once = Fault::DropNextReply as u8;
                        if faults
                            .fault
                            .compare_exchange(once, Fault::None as u8, Ordering::SeqCst, Ordering::SeqCst)
                            .is_ok()
                        {
                            faults.counts.dropped_replies.fetch_add(1, Ordering::SeqCst);
                            return;
                        }
                        queue.push_back((due_after(&faults), buffer[..n].to_vec()));
                    }
                }
            }
        }
    };
    tokio::select! {
        _ = up => {}
        _ = down => {}
        _ = epoch.changed() => {}
        _ = cut.notified() => {}
    }
}

/// Bytes read from one side, each with when it is due on the other.
type Queue = VecDeque<(tokio::time::Instant, Vec<u8>)>;

/// The first bytes of `queue`, if they are due.
fn pop_due(queue: &mut Queue) -> Option<Vec<u8>> {
    let (due, _) = queue.front()?;
    if *due > tokio::time::Instant::now() {
        return None;
    }
    queue.pop_front().map(|(_, bytes)| bytes)
}

/// When bytes read now are due on the other side: after the delay set.
fn due_after(faults: &Faults) -> tokio::time::Instant {
    tokio::time::Instant::now() + Duration::from_millis(faults.delay_ms.load(Ordering::SeqCst))
}

/// Waits out the latency, and for as long as the proxy black-holes this connection's traffic.
async fn pause(faults: &Faults) {
    let latency = faults.latency_ms.load(Ordering::SeqCst);
    if latency > 0 {
        tokio::time::sleep(Duration::from_millis(latency)).await;
    }
    while current(&faults.fault) == Fault::BlackHole
        || faults.number < faults.counts.black_holed_below.load(Ordering::SeqCst)
        || (faults.counts.held_subscriptions.lock().unwrap()).contains(&faults.number)
    {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}
