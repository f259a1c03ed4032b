//! A TCP fault proxy between a client and Redis: pass traffic through, add latency, drop every
//! connection, or black-hole (accept and forward nothing).
#![allow(dead_code)]

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, AtomicU8, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;

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
    epoch: watch::Sender<u64>,
    task: tokio::task::JoinHandle<()>,
}

impl FaultProxy {
    pub async fn start(upstream: SocketAddr) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind the proxy");
        let addr = listener.local_addr().expect("proxy address");
        let fault = Arc::new(AtomicU8::new(Fault::None as u8));
        let latency_ms = Arc::new(AtomicU64::new(0));
        let (epoch, _) = watch::channel(0);
        let upstream = Arc::new(Mutex::new(upstream));
        let task = {
            let (fault, latency_ms, epoch) = (fault.clone(), latency_ms.clone(), epoch.clone());
            let upstream = upstream.clone();
            tokio::spawn(async move {
                while let Ok((client, _)) = listener.accept().await {
                    let (fault, latency_ms, epoch) = (fault.clone(), latency_ms.clone(), epoch.subscribe());
                    let upstream = *upstream.lock().unwrap();
                    tokio::spawn(serve(client, upstream, fault, latency_ms, epoch));
                }
            })
        };
        Self {
            addr,
            upstream,
            fault,
            latency_ms,
            epoch,
            task,
        }
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

    pub fn set_latency(&self, latency: Duration) {
        self.latency_ms
            .store(latency.as_millis() as u64, Ordering::SeqCst);
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

async fn serve(
    client: TcpStream,
    upstream: SocketAddr,
    fault: Arc<AtomicU8>,
    latency_ms: Arc<AtomicU64>,
    mut epoch: watch::Receiver<u64>,
) {
    if current(&fault) == Fault::Drop {
        return;
    }
    let Ok(server) = TcpStream::connect(upstream).await else {
        return;
    };
    let (mut client_read, mut client_write) = client.into_split();
    let (mut server_read, mut server_write) = server.into_split();
    epoch.mark_unchanged();
    let up = {
        let (fault, latency_ms) = (fault.clone(), latency_ms.clone());
        async move {
            let mut buffer = vec![0u8; 64 * 1024];
            loop {
                let n = match client_read.read(&mut buffer).await {
                    Ok(0) | Err(_) => return,
                    Ok(n) => n,
                };
                pause(&fault, &latency_ms).await;
                if server_write.write_all(&buffer[..n]).await.is_err() {
                    return;
                }
            }
        }
    };
    let down = {
        let fault = fault.clone();
        async move {
            let mut buffer = vec![0u8; 64 * 1024];
            loop {
                let n = match server_read.read(&mut buffer).await {
                    Ok(0) | Err(_) => return,
                    Ok(n) => n,
                };
                let once = Fault::DropNextReply as u8;
                if fault
                    .compare_exchange(once, Fault::None as u8, Ordering::SeqCst, Ordering::SeqCst)
                    .is_ok()
                {
                    return;
                }
                pause(&fault, &latency_ms).await;
                if client_write.write_all(&buffer[..n]).await.is_err() {
                    return;
                }
            }
        }
    };
    tokio::select! {
        _ = up => {}
        _ = down => {}
        _ = epoch.changed() => {}
    }
}

/// Waits out the latency, and for as long as the proxy black-holes traffic.
async fn pause(fault: &AtomicU8, latency_ms: &AtomicU64) {
    let latency = latency_ms.load(Ordering::SeqCst);
    if latency > 0 {
        tokio::time::sleep(Duration::from_millis(latency)).await;
    }
    while current(fault) == Fault::BlackHole {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}
