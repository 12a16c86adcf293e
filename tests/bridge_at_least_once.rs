//! The MQTT bridge's `at_least_once` (QoS 1 in a session the broker keeps)
//! against a real `mosquitto`, with the network between a bridge and the
//! broker cut by a proxy while the broker stays up: what a lost connection
//! had in flight is sent again, and what was published for a bridge while
//! its connection was down reaches it after. (The default, at most once,
//! loses both: its tests are in `bridge_mqtt.rs` and `bridge_edges.rs`.)
//! The proxy also stalls the link and delays the broker's replies: the
//! faults the thirty-fourth session's review found (resent exports lost to
//! packet id collisions on a link with latency, a close held by a stalled
//! link, a resent export the restarted broker can no longer take).
//!
//! Needs `mosquitto` (Debian: `apt-get install -y mosquitto`); without it
//! these tests fail, never skip. Each test has a time limit.
#![cfg(feature = "mqtt")]

#[path = "common/bridge_support.rs"]
mod bridge_support;
#[path = "common/link_proxy.rs"]
mod link_proxy;
#[path = "common/mosquitto.rs"]
mod mosquitto;

use std::collections::BTreeSet;
use std::time::{Duration, Instant};

use blazesub::bridge::Bridge;
use blazesub::Bus;
use bridge_support::{inline_bus, limit, start_node, subscribed, until, Seen};
use bytes::Bytes;
use link_proxy::LinkProxy;
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

/// Which of `{prefix}/0` to `{prefix}/{n - 1}` `seen` has not received.
fn missing(seen: &Seen, prefix: &str, n: usize) -> Vec<usize> {
    let got: BTreeSet<String> = seen.topics().into_iter().collect();
    (0..n)
        .filter(|i| !got.contains(&format!("{prefix}/{i}")))
        .collect()
}

/// Waits up to `secs` for `done`; whether it became true.
async fn wait_for(secs: u64, mut done: impl FnMut() -> bool) -> bool {
    let deadline = Instant::now() + Duration::from_secs(secs);
    while !done() {
        if Instant::now() >= deadline {
            return false;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    true
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn exports_in_flight_when_the_connection_breaks_are_sent_again() {
    const N: usize = 3_000;
    let broker = Mosquitto::start();
    let proxy = LinkProxy::start(broker.port).await;
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
            || missing(&seen, "qos", N).is_empty(),
            || {
                let gone = missing(&seen, "qos", N);
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
    let proxy = LinkProxy::start(broker.port).await;
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
            || missing(&seen, "qos", N).is_empty(),
            || {
                format!(
                    "{} of {N} never arrived; receiver {:?}",
                    missing(&seen, "qos", N).len(),
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
    let proxy = LinkProxy::start(broker.port).await;
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
            || missing(&seen, "qos", N).is_empty(),
            || {
                format!(
                    "{} of {N} never arrived; sender {:?}",
                    missing(&seen, "qos", N).len(),
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

// Faults found by the thirty-fourth session's review of `at_least_once`.

/// A burst far larger than the broker's Receive Maximum is handed to the
/// client at once, and the connection is cut while most of it is still
/// queued: everything is put back after the reconnect (bypassing rumqttc's
/// flow control, with new packet ids that collide with the resent ones).
/// Every export must arrive, and be counted sent once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_large_burst_queued_at_a_cut_all_arrives() {
    const N: usize = 2_000;
    let broker = Mosquitto::start();
    let proxy = LinkProxy::start(broker.port).await;
    limit(60, async {
        let (a, b) = (inline_bus::<Bytes>(), inline_bus::<Bytes>());
        let receiver = node(&b, &broker.url(), "s34-r1", &[], &["burst/#"]).await;
        let seen = Seen::default();
        let _s = b.subscribe("burst/+", seen.handler()).unwrap();
        subscribed(&receiver, 1).await;
        let sender = node(&a, &proxy.url(), "s34-s1", &["burst/#"], &[]).await;
        for i in 0..N {
            a.publish(&format!("burst/{i}"), Bytes::from(vec![7; 512])).unwrap();
        }
        tokio::time::sleep(Duration::from_millis(2)).await;
        proxy.cut();
        tokio::time::sleep(Duration::from_millis(200)).await;
        proxy.restore();
        let all = wait_for(15, || missing(&seen, "burst", N).is_empty()).await;
        let gone = missing(&seen, "burst", N);
        let before_close = sender.stats();
        let t = Instant::now();
        sender.close().await.unwrap();
        let close_took = t.elapsed();
        let stats = sender.stats();
        receiver.close().await.unwrap();
        assert!(
            all,
            "{} of {N} never arrived (first {:?}); sender before close {before_close:?}, after {stats:?}, close took {close_took:?}",
            gone.len(),
            &gone[..gone.len().min(10)]
        );
        assert_eq!((stats.sent, stats.dropped), (N as u64, 0), "{stats:?}");
        assert_eq!(stats.reconnects, 1, "{stats:?}");
    })
    .await;
}

/// The connection stalls (the broker's acknowledgements stop coming, as on
/// a congested link), the exporter fills rumqttc's request channel behind
/// the Receive Maximum's worth in flight, then the connection breaks: all
/// of it is resent after the reconnect. Every export must arrive.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn exports_queued_behind_a_stalled_connection_all_arrive_after_the_cut() {
    stalled_then_cut("", "s34-2", 0).await;
}

/// The same with a broker whose Receive Maximum is 10 (mosquitto's
/// `max_inflight_messages`): the resent publishes exceed it and reuse
/// packet ids still in flight.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stalled_then_cut_with_a_receive_maximum_of_10() {
    stalled_then_cut("max_inflight_messages 10\n", "s34-3", 0).await;
}

/// The same with the broker's replies 20 ms late (a link with some
/// latency): the resent publishes go out without rumqttc's flow control,
/// their packet ids reused while the first holder is unacknowledged.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stalled_then_cut_on_a_link_with_latency() {
    stalled_then_cut("", "s34-4", 20).await;
}

async fn stalled_then_cut(config: &str, name: &str, latency_ms: u64) {
    const N: usize = 1_000;
    let broker = Mosquitto::start_with(config);
    let proxy = LinkProxy::start(broker.port).await;
    limit(60, async {
        let (a, b) = (inline_bus::<Bytes>(), inline_bus::<Bytes>());
        let receiver = node(&b, &broker.url(), &format!("{name}-r"), &[], &["stall/#"]).await;
        let seen = Seen::default();
        let _s = b.subscribe("stall/+", seen.handler()).unwrap();
        subscribed(&receiver, 1).await;
        let sender = node(&a, &proxy.url(), &format!("{name}-s"), &["stall/#"], &[]).await;
        proxy.delay_replies(latency_ms);
        proxy.stall();
        for i in 0..N {
            a.publish(&format!("stall/{i}"), Bytes::from(vec![7; 64])).unwrap();
        }
        tokio::time::sleep(Duration::from_millis(300)).await;
        let at_cut = sender.stats();
        proxy.cut();
        tokio::time::sleep(Duration::from_millis(200)).await;
        proxy.restore();
        let all = wait_for(10, || missing(&seen, "stall", N).is_empty()).await;
        let gone = missing(&seen, "stall", N);
        let before_close = sender.stats();
        let t = Instant::now();
        sender.close().await.unwrap();
        let close_took = t.elapsed();
        let stats = sender.stats();
        receiver.close().await.unwrap();
        assert!(
            all,
            "{} of {N} never arrived (first {:?}); sender at the cut {at_cut:?}, before close {before_close:?}, after {stats:?}, close took {close_took:?}",
            gone.len(),
            &gone[..gone.len().min(10)]
        );
        assert_eq!((stats.sent, stats.dropped), (N as u64, 0), "{stats:?}");
        assert_eq!(stats.reconnects, 1, "{stats:?}");
    })
    .await;
}

/// The broker stops acknowledging (the link stalls, TCP stays open) while
/// exports keep coming: rumqttc holds a Receive Maximum's worth in flight
/// and its request channel fills. `close` must end within its bound and
/// every export must be counted once, sent or dropped.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn close_on_a_stalled_link_counts_every_export() {
    close_on_a_stalled_link(true, "s34-s5").await;
}

/// Control: the same at most once (QoS 0, the default) holds.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn close_on_a_stalled_link_counts_every_export_qos0_control() {
    close_on_a_stalled_link(false, "s34-s5b").await;
}

async fn close_on_a_stalled_link(at_least_once: bool, name: &str) {
    const N: u64 = 3_000;
    let broker = Mosquitto::start();
    let proxy = LinkProxy::start(broker.port).await;
    limit(60, async {
        let a = inline_bus::<Bytes>();
        let sender = if at_least_once {
            node(&a, &proxy.url(), name, &["st/#"], &[]).await
        } else {
            let builder = Bridge::builder(&a)
                .mqtt(proxy.url())
                .reconnect_backoff(Duration::from_millis(20), Duration::from_millis(100));
            start_node(builder, name, &["st/#"], &[]).await
        };
        proxy.stall();
        for i in 0..N {
            a.publish(&format!("st/{i}"), Bytes::from(vec![7; 64])).unwrap();
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
        let before = sender.stats();
        let t = Instant::now();
        sender.close().await.unwrap();
        let took = t.elapsed();
        let stats = sender.stats();
        assert!(took < Duration::from_secs(8), "close took {took:?}");
        assert_eq!(
            stats.sent + stats.dropped,
            N,
            "every export counted once: before close {before:?}, after {stats:?}, close took {took:?}"
        );
    })
    .await;
}

/// The broker restarts (its sessions gone) while exports are in flight:
/// the sender reconnects into a new session and sends again what it held.
/// Each export ends counted once, and all of them sent (the broker is up).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn broker_restart_with_exports_in_flight() {
    const N: u64 = 2_000;
    let mut broker = Mosquitto::start();
    limit(60, async {
        let a = inline_bus::<Bytes>();
        let sender = node(&a, &broker.url(), "s34-s6", &["rs/#"], &[]).await;
        for i in 0..N {
            a.publish(&format!("rs/{i}"), Bytes::from(vec![7; 256]))
                .unwrap();
        }
        broker.restart();
        let settled = wait_for(15, || {
            let s = sender.stats();
            s.sent + s.dropped == N
        })
        .await;
        let before = sender.stats();
        sender.close().await.unwrap();
        let stats = sender.stats();
        assert!(settled, "not settled: {before:?}; after close {stats:?}");
        assert_eq!((stats.sent, stats.dropped), (N, 0), "{stats:?}");
        assert_eq!(stats.reconnects, 1, "{stats:?}");
    })
    .await;
}

/// A broker that refuses some publishes in its PUBACK (an ACL): those are
/// dropped, the rest sent, no reconnect.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn refused_in_the_puback_counts_dropped() {
    let acl = std::env::temp_dir().join(format!("s34-acl-{}", std::process::id()));
    std::fs::write(&acl, "topic readwrite ok/#\n").unwrap();
    let broker = Mosquitto::start_with(&format!("acl_file {}\n", acl.display()));
    limit(60, async {
        let a = inline_bus::<Bytes>();
        let sender = node(&a, &broker.url(), "s34-s7", &["#"], &[]).await;
        for i in 0..100 {
            a.publish(&format!("ok/{i}"), Bytes::from_static(b"x"))
                .unwrap();
            a.publish(&format!("no/{i}"), Bytes::from_static(b"x"))
                .unwrap();
        }
        let settled = wait_for(10, || {
            let s = sender.stats();
            s.sent + s.dropped == 200
        })
        .await;
        let before = sender.stats();
        sender.close().await.unwrap();
        let stats = sender.stats();
        assert!(settled, "not settled: {before:?}; after close {stats:?}");
        assert_eq!(
            (stats.sent, stats.dropped, stats.reconnects),
            (100, 100, 0),
            "{stats:?}"
        );
    })
    .await;
    let _ = std::fs::remove_file(acl);
}

/// As above, with the exports held in flight by a stalled link when the
/// broker restarts (a new session: nothing of the old one kept).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn broker_restart_with_exports_held_in_flight() {
    const N: u64 = 2_000;
    let mut broker = Mosquitto::start();
    let proxy = LinkProxy::start(broker.port).await;
    limit(60, async {
        let a = inline_bus::<Bytes>();
        let sender = node(&a, &proxy.url(), "s34-s8", &["rs/#"], &[]).await;
        proxy.stall();
        for i in 0..N {
            a.publish(&format!("rs/{i}"), Bytes::from(vec![7; 256]))
                .unwrap();
        }
        tokio::time::sleep(Duration::from_millis(300)).await;
        broker.restart();
        proxy.cut();
        proxy.restore();
        let settled = wait_for(15, || {
            let s = sender.stats();
            s.sent + s.dropped == N
        })
        .await;
        let before = sender.stats();
        sender.close().await.unwrap();
        let stats = sender.stats();
        assert!(settled, "not settled: {before:?}; after close {stats:?}");
        assert_eq!((stats.sent, stats.dropped), (N, 0), "{stats:?}");
        assert_eq!(stats.reconnects, 1, "{stats:?}");
    })
    .await;
}

/// A publish held in flight that the broker, restarted with a smaller
/// Maximum Packet Size, can no longer take: rumqttc fails the connection
/// writing it, the bridge puts it back, and the next connection fails the
/// same way. It must be dropped (counted) and the rest sent, not retried
/// forever.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_held_publish_over_the_restarted_brokers_maximum_packet_size() {
    let mut broker = Mosquitto::start();
    let proxy = LinkProxy::start(broker.port).await;
    limit(60, async {
        let a = inline_bus::<Bytes>();
        let sender = node(&a, &proxy.url(), "s34-s9", &["mp/#"], &[]).await;
        proxy.stall();
        a.publish("mp/big", Bytes::from(vec![7; 50_000])).unwrap();
        for i in 0..10 {
            a.publish(&format!("mp/{i}"), Bytes::from_static(b"x"))
                .unwrap();
        }
        tokio::time::sleep(Duration::from_millis(300)).await;
        let config = std::env::temp_dir().join(format!(
            "blazesub-mosquitto-{}-{}.conf",
            std::process::id(),
            broker.port
        ));
        std::fs::write(
            &config,
            format!(
                "listener {} 127.0.0.1\nallow_anonymous true\nmax_packet_size 10000\n",
                broker.port
            ),
        )
        .unwrap();
        broker.restart();
        proxy.cut();
        proxy.restore();
        let settled = wait_for(8, || {
            let s = sender.stats();
            s.sent + s.dropped == 11
        })
        .await;
        let before = sender.stats();
        sender.close().await.unwrap();
        let stats = sender.stats();
        assert!(
            settled,
            "not settled in 8 s: {before:?}; after close {stats:?}"
        );
        assert_eq!((stats.sent, stats.dropped), (10, 1), "{stats:?}");
        assert!(stats.reconnects <= 2, "{stats:?}");
    })
    .await;
}

/// `close` while the connection is down, with exports held by the client
/// (put back for the next ConnAck) and in the outbox: each counted once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn close_while_cut_counts_every_export_once() {
    const N: u64 = 1_000;
    let broker = Mosquitto::start();
    let proxy = LinkProxy::start(broker.port).await;
    limit(60, async {
        let a = inline_bus::<Bytes>();
        let sender = node(&a, &proxy.url(), "s34-s10", &["cw/#"], &[]).await;
        proxy.stall();
        for i in 0..N / 2 {
            a.publish(&format!("cw/{i}"), Bytes::from(vec![7; 64]))
                .unwrap();
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
        proxy.cut();
        tokio::time::sleep(Duration::from_millis(200)).await;
        for i in N / 2..N {
            a.publish(&format!("cw/{i}"), Bytes::from(vec![7; 64]))
                .unwrap();
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
        let before = sender.stats();
        let t = Instant::now();
        sender.close().await.unwrap();
        let took = t.elapsed();
        let stats = sender.stats();
        assert!(took < Duration::from_secs(3), "close took {took:?}");
        assert_eq!(
            stats.sent + stats.dropped,
            N,
            "before {before:?}, after {stats:?}"
        );
    })
    .await;
}

/// Session expiry 0 (the session ends at each disconnect) and
/// `Duration::MAX`: a cut with exports held in flight, all of them arrive
/// and are counted once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn session_expiry_zero_and_max_resend_after_a_cut() {
    for (k, expiry) in [Duration::ZERO, Duration::MAX].into_iter().enumerate() {
        const N: usize = 300;
        let broker = Mosquitto::start();
        let proxy = LinkProxy::start(broker.port).await;
        limit(40, async {
            let (a, b) = (inline_bus::<Bytes>(), inline_bus::<Bytes>());
            let receiver = node(&b, &broker.url(), &format!("s34-r11-{k}"), &[], &["ex/#"]).await;
            let seen = Seen::default();
            let _s = b.subscribe("ex/+", seen.handler()).unwrap();
            subscribed(&receiver, 1).await;
            let builder = Bridge::builder(&a)
                .mqtt(proxy.url())
                .at_least_once(expiry)
                .reconnect_backoff(Duration::from_millis(20), Duration::from_millis(100));
            let sender = start_node(builder, &format!("s34-s11-{k}"), &["ex/#"], &[]).await;
            proxy.stall();
            for i in 0..N {
                a.publish(&format!("ex/{i}"), Bytes::from_static(b"x"))
                    .unwrap();
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
            proxy.cut();
            tokio::time::sleep(Duration::from_millis(100)).await;
            proxy.restore();
            let all = wait_for(10, || missing(&seen, "ex", N).is_empty()).await;
            sender.close().await.unwrap();
            let stats = sender.stats();
            receiver.close().await.unwrap();
            assert!(
                all,
                "{expiry:?}: {} missing; {stats:?}",
                missing(&seen, "ex", N).len()
            );
            assert_eq!(
                (stats.sent, stats.dropped),
                (N as u64, 0),
                "{expiry:?}: {stats:?}"
            );
        })
        .await;
    }
}
