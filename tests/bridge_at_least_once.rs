//! The MQTT bridge's `at_least_once` (QoS 1 in a session the broker keeps)
//! against a real `mosquitto`, with the network between a bridge and the
//! broker cut by a proxy while the broker stays up: what a lost connection
//! had in flight is sent again, and what was published for a bridge while
//! its connection was down reaches it after. (The default, at most once,
//! loses both: its tests are in `bridge_mqtt.rs` and `bridge_edges.rs`.)
//!
//! Needs `mosquitto` (Debian: `apt-get install -y mosquitto`); without it
//! these tests fail, never skip. Each test has a time limit.
#![cfg(feature = "mqtt")]

#[path = "common/bridge_support.rs"]
mod bridge_support;
#[path = "common/cut_proxy.rs"]
mod cut_proxy;
#[path = "common/mosquitto.rs"]
mod mosquitto;

use std::collections::BTreeSet;
use std::time::Duration;

use blazesub::bridge::Bridge;
use blazesub::Bus;
use bridge_support::{inline_bus, limit, start_node, subscribed, until, Seen};
use bytes::Bytes;
use cut_proxy::CutProxy;
use mosquitto::Mosquitto;

const SESSION: Duration = Duration::from_secs(60);

async fn node(
    bus: &Bus<Bytes>,
    url: &str,
    name: &str,
    exports: &[&str],
    imports: &[&str],
) -> Bridge {
    let builder = Bridge::builder(bus)
        .mqtt(url)
        .at_least_once(SESSION)
        .reconnect_backoff(Duration::from_millis(20), Duration::from_millis(100));
    start_node(builder, name, exports, imports).await
}

fn missing(seen: &Seen, n: usize) -> Vec<usize> {
    let got: BTreeSet<String> = seen.topics().into_iter().collect();
    (0..n)
        .filter(|i| !got.contains(&format!("qos/{i}")))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn exports_in_flight_when_the_connection_breaks_are_sent_again() {
    const N: usize = 3_000;
    let broker = Mosquitto::start();
    let proxy = CutProxy::start(broker.port).await;
    limit(90, async {
        let (a, b) = (inline_bus::<Bytes>(), inline_bus::<Bytes>());
        let receiver = node(&b, &broker.url(), "alo-receiver", &[], &["qos/#"]).await;
        let seen = Seen::default();
        let _s = b.subscribe("qos/+", seen.handler()).unwrap();
        subscribed(&receiver, 1).await;
        let sender = node(&a, &proxy.url(), "alo-sender", &["qos/#"], &[]).await;
        for i in 0..N {
            a.publish(&format!("qos/{i}"), Bytes::from(vec![7; 256]))
                .unwrap();
            // Cut twice, each time right after a burst handed to the
            // client, with publishes written and unacknowledged.
            if i == N / 3 || i == 2 * N / 3 {
                tokio::time::sleep(Duration::from_millis(1)).await;
                proxy.cut();
                tokio::time::sleep(Duration::from_millis(150)).await;
                proxy.restore();
                until(
                    || sender.stats().connected,
                    || "the sender did not come back".into(),
                )
                .await;
            } else if i % 100 == 0 {
                tokio::time::sleep(Duration::from_millis(1)).await;
            }
        }
        until(
            || missing(&seen, N).is_empty(),
            || {
                let gone = missing(&seen, N);
                format!(
                    "{} of {N} never arrived (first {:?}); sender {:?}",
                    gone.len(),
                    &gone[..gone.len().min(10)],
                    sender.stats()
                )
            },
        )
        .await;
        sender.close().await.unwrap();
        let stats = sender.stats();
        // Two cuts, and no further reconnect: what was sent again did not
        // get the connection closed.
        assert_eq!(stats.reconnects, 2, "{stats:?}");
        assert_eq!(stats.dropped, 0, "{stats:?}");
        assert_eq!(
            stats.sent, N as u64,
            "each export acknowledged once: {stats:?}"
        );
        receiver.close().await.unwrap();
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn imports_published_while_the_connection_was_down_arrive_after_it() {
    const N: usize = 500;
    let broker = Mosquitto::start();
    let proxy = CutProxy::start(broker.port).await;
    limit(60, async {
        let (a, b) = (inline_bus::<Bytes>(), inline_bus::<Bytes>());
        let sender = node(&a, &broker.url(), "alo-sender-2", &["qos/#"], &[]).await;
        let receiver = node(&b, &proxy.url(), "alo-receiver-2", &[], &["qos/#"]).await;
        let seen = Seen::default();
        let _s = b.subscribe("qos/+", seen.handler()).unwrap();
        subscribed(&receiver, 1).await;
        proxy.cut();
        until(
            || !receiver.stats().connected,
            || "the receiver did not see the cut".into(),
        )
        .await;
        for i in 0..N {
            a.publish(&format!("qos/{i}"), Bytes::from_static(b"x"))
                .unwrap();
        }
        // The broker has them all (acknowledged) before the receiver is back.
        until(
            || sender.stats().sent == N as u64,
            || format!("{:?}", sender.stats()),
        )
        .await;
        assert_eq!(seen.len(), 0, "nothing can arrive through the cut");
        proxy.restore();
        until(
            || missing(&seen, N).is_empty(),
            || {
                format!(
                    "{} of {N} never arrived; receiver {:?}",
                    missing(&seen, N).len(),
                    receiver.stats()
                )
            },
        )
        .await;
        let stats = receiver.stats();
        assert_eq!(stats.dropped, 0, "{stats:?}");
        sender.close().await.unwrap();
        receiver.close().await.unwrap();
    })
    .await;
}

#[cfg(feature = "nats")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn at_least_once_with_nats_is_refused() {
    let bus = inline_bus::<Bytes>();
    let started = Bridge::builder(&bus)
        .nats("nats://127.0.0.1:1")
        .export("qos/#")
        .at_least_once(SESSION)
        .start()
        .await;
    match started {
        Err(blazesub::Error::InvalidArgument { name, .. }) => assert_eq!(name, "at_least_once"),
        other => panic!("expected InvalidArgument, got {other:?}"),
    }
}

/// A bridge started with the name of one that died (its process gone, its
/// session left on the broker with its subscriptions) starts a session of
/// its own: the old subscriptions, which the new bridge's table does not
/// know, would send copies of their messages under identifiers the new
/// bridge numbers afresh (here two copies of each, for `#`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_new_bridge_with_a_dead_ones_name_starts_its_own_session() {
    let broker = Mosquitto::start();
    let proxy = CutProxy::start(broker.port).await;
    limit(60, async {
        let (a, b) = (inline_bus::<Bytes>(), inline_bus::<Bytes>());
        let sender = node(&a, &broker.url(), "alo-sender-3", &["#"], &[]).await;
        let first = node(&b, &proxy.url(), "alo-same", &[], &["#"]).await;
        let old = b.subscribe("old/#", |_| {}).unwrap();
        subscribed(&first, 1).await;
        // Dies: nothing it does from now reaches the broker.
        proxy.cut();
        drop(first);
        drop(old);
        let second = node(&b, &broker.url(), "alo-same", &[], &["#"]).await;
        let seen = Seen::default();
        let _s = b.subscribe("#", seen.handler()).unwrap();
        subscribed(&second, 1).await;
        for i in 0..20 {
            a.publish(&format!("old/{i}"), Bytes::from_static(b"o"))
                .unwrap();
        }
        until(
            || seen.len() >= 20,
            || format!("{} of 20; {:?}", seen.len(), second.stats()),
        )
        .await;
        tokio::time::sleep(Duration::from_millis(300)).await;
        assert_eq!(seen.len(), 20, "each message once: {:?}", seen.topics());
        sender.close().await.unwrap();
        second.close().await.unwrap();
    })
    .await;
}

/// A broker whose Maximum QoS is 0 closes the connection of a client that
/// publishes with QoS 1: the bridge publishes with the broker's maximum,
/// rather than reconnecting forever with the same publishes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_broker_that_allows_only_qos_0_gets_qos_0() {
    const N: usize = 200;
    let broker = Mosquitto::start_with("max_qos 0\n");
    limit(60, async {
        let (a, b) = (inline_bus::<Bytes>(), inline_bus::<Bytes>());
        let receiver = node(&b, &broker.url(), "alo-receiver-4", &[], &["qos/#"]).await;
        let seen = Seen::default();
        let _s = b.subscribe("qos/+", seen.handler()).unwrap();
        subscribed(&receiver, 1).await;
        let sender = node(&a, &broker.url(), "alo-sender-4", &["qos/#"], &[]).await;
        for i in 0..N {
            a.publish(&format!("qos/{i}"), Bytes::from_static(b"x"))
                .unwrap();
        }
        until(
            || missing(&seen, N).is_empty(),
            || {
                format!(
                    "{} of {N} never arrived; sender {:?}",
                    missing(&seen, N).len(),
                    sender.stats()
                )
            },
        )
        .await;
        sender.close().await.unwrap();
        let stats = sender.stats();
        assert_eq!(stats.reconnects, 0, "{stats:?}");
        assert_eq!((stats.sent, stats.dropped), (N as u64, 0), "{stats:?}");
        receiver.close().await.unwrap();
    })
    .await;
}
