//! A loopback TCP proxy in front of a real broker whose connections a test
//! can cut: the network failing between a bridge and its broker, which
//! stays up (its sessions too). While cut, the proxy closes every
//! connection it accepts at once, as an unreachable broker would refuse.
#![allow(dead_code)]

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use tokio::net::{TcpListener, TcpStream};
use tokio::task::JoinHandle;

pub struct CutProxy {
    pub port: u16,
    down: Arc<AtomicBool>,
    links: Arc<Mutex<Vec<JoinHandle<()>>>>,
    accept: JoinHandle<()>,
}

impl CutProxy {
    /// A proxy on a free loopback port to `127.0.0.1:target`.
    pub async fn start(target: u16) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let port = listener.local_addr().expect("local addr").port();
        let down = Arc::new(AtomicBool::new(false));
        let links: Arc<Mutex<Vec<JoinHandle<()>>>> = Arc::default();
        let accept = tokio::spawn({
            let (down, links) = (Arc::clone(&down), Arc::clone(&links));
            async move {
                while let Ok((mut client, _)) = listener.accept().await {
                    if down.load(Ordering::Acquire) {
                        continue; // dropped: closed at once
                    }
                    let link = tokio::spawn(async move {
                        if let Ok(mut broker) = TcpStream::connect(("127.0.0.1", target)).await {
                            let _ = tokio::io::copy_bidirectional(&mut client, &mut broker).await;
                        }
                    });
                    links.lock().unwrap().push(link);
                }
            }
        });
        Self {
            port,
            down,
            links,
            accept,
        }
    }

    pub fn url(&self) -> String {
        format!("mqtt://127.0.0.1:{}", self.port)
    }

    /// Closes every connection now (what either side had in flight through
    /// the proxy is lost) and refuses new ones until [`Self::restore`].
    pub fn cut(&self) {
        self.down.store(true, Ordering::Release);
        for link in self.links.lock().unwrap().drain(..) {
            link.abort();
        }
    }

    /// Accepts connections again.
    pub fn restore(&self) {
        self.down.store(false, Ordering::Release);
    }
}

impl Drop for CutProxy {
    fn drop(&mut self) {
        self.accept.abort();
        for link in self.links.lock().unwrap().drain(..) {
            link.abort();
        }
    }
}
