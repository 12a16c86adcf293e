//! What the bridge tests share, whatever the engine: time limits, polling,
//! a recording handler, and starting a node's bridge.

#![allow(dead_code)] // each bridge test file uses a different part

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use blazesub::bridge::{Bridge, BridgeBuilder};
use blazesub::{Bus, DeliveryMode, Message, Metadata};
use bytes::Bytes;

/// Runs a test body with a time limit.
pub async fn limit<F: std::future::Future<Output = ()>>(secs: u64, body: F) {
    tokio::time::timeout(Duration::from_secs(secs), body)
        .await
        .expect("the test ran past its time limit");
}

/// Polls `done` every 10 ms until true; panics with `what()` after 20 s.
pub async fn until(mut done: impl FnMut() -> bool, what: impl Fn() -> String) {
    let deadline = Instant::now() + Duration::from_secs(20);
    while !done() {
        assert!(Instant::now() < deadline, "timed out waiting: {}", what());
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

pub fn inline_bus<T: Send + Sync + 'static>() -> Bus<T> {
    Bus::builder()
        .delivery(DeliveryMode::Inline)
        .build()
        .unwrap()
}

/// Starts `builder` (its engine already set) as node `name` with these
/// exports and imports, and waits until it is connected.
pub async fn start_node<T: Send + Sync + 'static>(
    mut builder: BridgeBuilder<T>,
    name: &str,
    exports: &[&str],
    imports: &[&str],
) -> Bridge {
    builder = builder.name(name);
    for e in exports {
        builder = builder.export(*e);
    }
    for i in imports {
        builder = builder.import(*i);
    }
    let bridge = builder.start().await.unwrap();
    until(
        || bridge.stats().connected,
        || format!("{name} did not connect"),
    )
    .await;
    bridge
}

/// Starts node `name` bridged through the MQTT broker at `url`
/// (reconnecting after 20–200 ms; at least once, with a session of a
/// minute, if asked), and waits until it is connected.
#[cfg(feature = "mqtt")]
pub async fn mqtt_node(
    bus: &Bus<Bytes>,
    url: &str,
    name: &str,
    exports: &[&str],
    imports: &[&str],
    at_least_once: bool,
) -> Bridge {
    let mut builder = Bridge::builder(bus)
        .mqtt(url)
        .reconnect_backoff(Duration::from_millis(20), Duration::from_millis(200));
    if at_least_once {
        builder = builder.at_least_once(Duration::from_secs(60));
    }
    start_node(builder, name, exports, imports).await
}

/// Waits until `bridge` holds `n` upstream subscriptions, then a little
/// longer for the engine's acknowledgements (an MQTT broker has no
/// monitoring endpoint to ask).
pub async fn subscribed(bridge: &Bridge, n: u64) {
    until(
        || bridge.stats().upstream_subscriptions == n,
        || format!("{:?}", bridge.stats()),
    )
    .await;
    tokio::time::sleep(Duration::from_millis(300)).await;
}

/// One delivery: topic, payload, metadata.
pub type Delivery = (String, Bytes, Option<Metadata>);

/// Records deliveries in order.
#[derive(Clone, Default)]
pub struct Seen(pub Arc<Mutex<Vec<Delivery>>>);

impl Seen {
    pub fn handler(&self) -> impl Fn(&Message<Bytes>) + Send + Sync + 'static {
        let seen = self.clone();
        move |m| {
            seen.0.lock().unwrap().push((
                m.topic().to_owned(),
                m.data().clone(),
                m.metadata().cloned(),
            ))
        }
    }

    pub fn len(&self) -> usize {
        self.0.lock().unwrap().len()
    }

    /// The topics received, in the order received.
    pub fn topics(&self) -> Vec<String> {
        self.0.lock().unwrap().iter().map(|s| s.0.clone()).collect()
    }

    /// The topics received, sorted.
    pub fn sorted_topics(&self) -> Vec<String> {
        let mut topics = self.topics();
        topics.sort();
        topics
    }
}
