//! Three buses, as three instances of a service would have, joined through
//! a NATS server by the bridge: an order published on one reaches the
//! subscribers of all three, once each, and nothing loops.
//!
//! It uses the server at `$NATS_URL` (default `nats://127.0.0.1:4222`); if
//! none answers there, it starts `nats-server` from PATH on a free port for
//! the run. To get one: `apt-get install nats-server` (Debian/Ubuntu),
//! `brew install nats-server` (macOS), or a release from
//! <https://github.com/nats-io/nats-server/releases>.
//!
//! `cargo run --features nats --example cluster`

use std::net::{TcpListener, TcpStream, ToSocketAddrs};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use blazesub::bridge::Bridge;
use blazesub::{Bus, DeliveryMode};
use serde::{Deserialize, Serialize};

/// A typed message: it travels as JSON (the bridge's default codec).
#[derive(Clone, Debug, Serialize, Deserialize)]
struct Order {
    id: u32,
    amount_cents: u64,
}

/// A server this example started; killed when dropped.
struct OwnServer(Child);

impl Drop for OwnServer {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn answers(url: &str) -> bool {
    let host_port = url.trim_start_matches("nats://");
    host_port
        .to_socket_addrs()
        .ok()
        .and_then(|mut addrs| addrs.next())
        .is_some_and(|addr| TcpStream::connect_timeout(&addr, Duration::from_millis(300)).is_ok())
}

/// The server's URL, starting one if none answers.
fn server() -> Result<(String, Option<OwnServer>), String> {
    let url = std::env::var("NATS_URL").unwrap_or_else(|_| "nats://127.0.0.1:4222".into());
    if answers(&url) {
        return Ok((url, None));
    }
    let port = TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map_err(|e| e.to_string())?
        .port();
    let binary = std::env::var("BLAZESUB_NATS_SERVER").unwrap_or_else(|_| "nats-server".into());
    let child = Command::new(&binary)
        .args(["-a", "127.0.0.1", "-p", &port.to_string()])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .map_err(|e| {
            format!(
                "no NATS server answers at {url}, and `{binary}` could not be started ({e}).\n\
                 Install one (Debian/Ubuntu: `apt-get install nats-server`; macOS: \
                 `brew install nats-server`; or a release from \
                 https://github.com/nats-io/nats-server/releases), or set NATS_URL."
            )
        })?;
    let own = OwnServer(child);
    let url = format!("nats://127.0.0.1:{port}");
    let deadline = Instant::now() + Duration::from_secs(10);
    while !answers(&url) {
        if Instant::now() > deadline {
            return Err("the nats-server started here did not come up".into());
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    println!("started nats-server at {url} for this run");
    Ok((url, Some(own)))
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let (url, _own) = server()?;
    let names = ["eu", "us", "ap"];
    let seen: Arc<Mutex<Vec<String>>> = Arc::default();
    let mut nodes = Vec::new();
    for name in names {
        let bus: Bus<Order> = Bus::builder().delivery(DeliveryMode::Inline).build()?;
        let bridge = Bridge::builder(&bus)
            .nats(url.as_str())
            .name(name)
            .export("orders/#")
            .import("orders/#")
            .start()
            .await?;
        let log = Arc::clone(&seen);
        let sub = bus.subscribe("orders/+", move |m| {
            let line = format!(
                "{name} saw {} (order {}, {} cents)",
                m.topic(),
                m.data().id,
                m.data().amount_cents
            );
            log.lock().unwrap().push(line);
        })?;
        nodes.push((name, bus, bridge, sub));
    }
    // Each bridge subscribes upstream in the background: wait for all three.
    let deadline = Instant::now() + Duration::from_secs(10);
    while nodes
        .iter()
        .any(|(_, _, b, _)| !b.stats().connected || b.stats().upstream_subscriptions < 1)
    {
        if Instant::now() > deadline {
            return Err("the bridges did not connect".into());
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    tokio::time::sleep(Duration::from_millis(100)).await;

    for (i, (name, bus, _, _)) in nodes.iter().enumerate() {
        let order = Order {
            id: i as u32 + 1,
            amount_cents: 1_000 * (i as u64 + 1),
        };
        bus.publish(&format!("orders/{name}"), order)?;
    }
    let deadline = Instant::now() + Duration::from_secs(5);
    while seen.lock().unwrap().len() < 9 && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    tokio::time::sleep(Duration::from_millis(200)).await; // anything extra would be a loop
    let mut lines = seen.lock().unwrap().clone();
    lines.sort();
    for line in &lines {
        println!("{line}");
    }
    println!("{} deliveries (3 orders × 3 nodes, each once)", lines.len());
    for (name, _, bridge, _) in &nodes {
        let s = bridge.stats();
        println!(
            "{name}: sent {}, received {}, upstream subscriptions {}, dropped {}",
            s.sent, s.received, s.upstream_subscriptions, s.dropped
        );
    }
    for (_, _, bridge, _) in &nodes {
        bridge.close().await?;
    }
    Ok(())
}
