//! A loopback TCP proxy in front of a real broker, standing for the network
//! between a bridge and its broker, which stays up (its sessions too). A
//! test can stall the link (nothing forwarded either way, the connection
//! held open), delay what the broker sends, and cut it (every connection
//! closed; while cut, a new one is closed at once, as an unreachable broker
//! would refuse it).
#![allow(dead_code)]

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::{TcpListener, TcpStream};
use tokio::task::JoinHandle;

#[derive(Default)]
struct Controls {
    stalled: AtomicBool,
    down: AtomicBool,
    /// Added before each chunk the broker sends is passed on.
    reply_delay_ms: AtomicU64,
}

pub struct LinkProxy {
    pub port: u16,
    controls: Arc<Controls>,
    links: Arc<Mutex<Vec<JoinHandle<()>>>>,
    accept: JoinHandle<()>,
}

/// Copies one direction until either side closes.
async fn pump(
    mut from: OwnedReadHalf,
    mut to: OwnedWriteHalf,
    controls: Arc<Controls>,
    delayed: bool,
) {
    let mut buffer = vec![0u8; 16 * 1024];
    loop {
        while controls.stalled.load(Ordering::Acquire) {
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
        let n = match from.read(&mut buffer).await {
            Ok(0) | Err(_) => return,
            Ok(n) => n,
        };
        let delay = controls.reply_delay_ms.load(Ordering::Acquire);
        if delayed && delay > 0 {
            tokio::time::sleep(Duration::from_millis(delay)).await;
        }
        if to.write_all(&buffer[..n]).await.is_err() {
            return;
        }
    }
}

/// Both directions of one connection; dropping it (a cut) closes both.
async fn link(client: TcpStream, target: u16, controls: Arc<Controls>) {
    let Ok(broker) = TcpStream::connect(("127.0.0.1", target)).await else {
        return;
    };
    let (client_read, client_write) = client.into_split();
    let (broker_read, broker_write) = broker.into_split();
    let up = pump(client_read, broker_write, Arc::clone(&controls), false);
    let down = pump(broker_read, client_write, controls, true);
    tokio::select! {
        () = up => {}
        () = down => {}
    }
}

impl LinkProxy {
    /// A proxy on a free loopback port to `127.0.0.1:target`.
    pub async fn start(target: u16) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let port = listener.local_addr().expect("local addr").port();
        let controls = Arc::new(Controls::default());
        let links: Arc<Mutex<Vec<JoinHandle<()>>>> = Arc::default();
        let accept = tokio::spawn({
            let (controls, links) = (Arc::clone(&controls), Arc::clone(&links));
            async move {
                while let Ok((client, _)) = listener.accept().await {
                    if controls.down.load(Ordering::Acquire) {
                        continue; // dropped: closed at once
                    }
                    let link = tokio::spawn(link(client, target, Arc::clone(&controls)));
                    links.lock().unwrap().push(link);
                }
            }
        });
        Self {
            port,
            controls,
            links,
            accept,
        }
    }

    pub fn url(&self) -> String {
        format!("mqtt://127.0.0.1:{}", self.port)
    }

    /// Stops forwarding, both ways, with the connections held open.
    pub fn stall(&self) {
        self.controls.stalled.store(true, Ordering::Release);
    }

    /// Delays each chunk the broker sends by `ms`.
    pub fn delay_replies(&self, ms: u64) {
        self.controls.reply_delay_ms.store(ms, Ordering::Release);
    }

    /// Closes every connection now (what either side had in flight through
    /// the proxy is lost), refuses new ones until [`Self::restore`], and
    /// ends a stall.
    pub fn cut(&self) {
        self.controls.down.store(true, Ordering::Release);
        for link in self.links.lock().unwrap().drain(..) {
            link.abort();
        }
        self.controls.stalled.store(false, Ordering::Release);
    }

    /// Accepts connections again.
    pub fn restore(&self) {
        self.controls.down.store(false, Ordering::Release);
    }
}

impl Drop for LinkProxy {
    fn drop(&mut self) {
        self.accept.abort();
        for link in self.links.lock().unwrap().drain(..) {
            link.abort();
        }
    }
}
