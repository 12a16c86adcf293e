//! The bridge against real `nats-server`s (feature `nats`): cross-node
//! delivery, subscription sharing as the server counts it, overlapping
//! filters, three nodes with no loops, a server killed and restarted, a
//! cluster member dying, and payloads that do not decode.
//!
//! Needs `nats-server` on PATH or in `BLAZESUB_NATS_SERVER` (Debian:
//! `apt-get install -y nats-server`); without it these tests fail, never
//! skip. Each test has a time limit and fails rather than hangs.
#![cfg(feature = "nats")]

#[path = "common/bridge_support.rs"]
mod bridge_support;
#[path = "common/nats_server.rs"]
mod nats_server;

use std::future::Future;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use blazesub::bridge::{Bridge, BridgeStats};
use blazesub::{Bus, Metadata};
use bridge_support::{inline_bus, limit, start_node, until, Seen};
use bytes::Bytes;
use nats_server::NatsServer;

/// Polls `check` (on a blocking thread: it may do HTTP) until true, or panics after 20 s.
async fn eventually(what: &str, check: impl Fn() -> bool + Send + Sync + 'static) {
    let check = Arc::new(check);
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let c = Arc::clone(&check);
        if tokio::task::spawn_blocking(move || c()).await.unwrap() {
            return;
        }
        assert!(Instant::now() < deadline, "timed out waiting for: {what}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

async fn node(
    bus: &Bus<Bytes>,
    url: &str,
    name: &str,
    exports: &[&str],
    imports: &[&str],
) -> Bridge {
    start_node(Bridge::builder(bus).nats(url), name, exports, imports).await
}

fn subscriptions_of(server: &NatsServer, name: &str) -> u64 {
    server.connection(name).map_or(0, |c| c.0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cross_node_delivery_with_metadata_and_reserved_characters() {
    let server = NatsServer::start();
    limit(60, async {
        let (a, b) = (inline_bus::<Bytes>(), inline_bus::<Bytes>());
        let bridge_a = node(&a, &server.url(), "a", &["orders/#"], &[]).await;
        let bridge_b = node(&b, &server.url(), "b", &[], &["orders/#"]).await;
        let seen = Seen::default();
        let _sub = b.subscribe("orders/+/+", seen.handler()).unwrap();
        let monitor = server_ref(&server);
        eventually("b subscribed upstream", move || {
            subscriptions_of(&monitor, "b") == 1
        })
        .await;
        // The server may see the SUB before the bridge's subscribe call
        // returns and the bridge counts it.
        until(
            || bridge_b.stats().upstream_subscriptions == 1,
            || format!("{:?}", bridge_b.stats()),
        )
        .await;
        // The bridge's tap is not a subscription of the bus.
        assert_eq!(a.subscriptions_count(), 0);

        let topics = ["orders/eu/42", "orders//", "orders/a.b c/*>%"];
        for topic in topics {
            let md = Metadata::new().with("trace-id", "7f:3a %x").with("é", "ü");
            a.publish_with(topic, Bytes::from(topic.as_bytes().to_vec()), md)
                .unwrap();
        }
        let s = seen.clone();
        eventually("b received all", move || s.len() == 3).await;
        let got = seen.0.lock().unwrap().clone();
        for (i, (topic, payload, md)) in got.iter().enumerate() {
            assert_eq!(topic, topics[i], "in publish order");
            assert_eq!(&payload[..], topics[i].as_bytes(), "payload untouched");
            let md = md.as_ref().expect("metadata travels");
            assert_eq!(md.get("trace-id"), Some("7f:3a %x"));
            assert_eq!(md.get("é"), Some("ü"));
        }
        let stats: BridgeStats = bridge_a.stats();
        assert_eq!((stats.sent, stats.dropped), (3, 0));
        assert_eq!(bridge_b.stats().received, 3);
        bridge_a.close().await.unwrap();
        bridge_b.close().await.unwrap();
    })
    .await;
}

/// A second handle on the same server process, for monitoring from a
/// blocking closure (it never kills it).
fn server_ref(server: &NatsServer) -> NatsServer {
    NatsServer::monitor_only(server)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_upstream_subscription_and_one_message_per_node() {
    let server = NatsServer::start();
    limit(60, async {
        let publisher = inline_bus::<Bytes>();
        let _p = node(&publisher, &server.url(), "pub", &["event/#"], &[]).await;
        let delivered = Arc::new(AtomicU64::new(0));
        let mut nodes = Vec::new();
        for n in 0..3 {
            let bus = inline_bus::<Bytes>();
            let name = format!("consumer-{n}");
            let bridge = node(&bus, &server.url(), &name, &[], &["event/#"]).await;
            let subs: Vec<_> = (0..1_000)
                .map(|_| {
                    let d = Arc::clone(&delivered);
                    bus.subscribe("event/fired", move |_| {
                        d.fetch_add(1, Ordering::Relaxed);
                    })
                    .unwrap()
                })
                .collect();
            let monitor = server_ref(&server);
            let watched = name.clone();
            eventually("one upstream subscription", move || {
                subscriptions_of(&monitor, &watched) == 1
            })
            .await;
            nodes.push((bus, bridge, subs, name));
        }
        let before = server.varz_field("out_msgs").unwrap();
        publisher
            .publish("event/fired", Bytes::from_static(b"!"))
            .unwrap();
        let d = Arc::clone(&delivered);
        eventually("3,000 deliveries", move || {
            d.load(Ordering::Relaxed) == 3_000
        })
        .await;
        tokio::time::sleep(Duration::from_millis(200)).await;
        assert_eq!(
            delivered.load(Ordering::Relaxed),
            3_000,
            "exactly once each"
        );
        assert_eq!(
            server.varz_field("out_msgs").unwrap() - before,
            3,
            "the server sent one message per node"
        );
        for (_, bridge, _, name) in &nodes {
            assert_eq!(
                server.connection(name).unwrap(),
                (1, 1),
                "{name}: one subscription, one message"
            );
            assert_eq!(bridge.stats().upstream_subscriptions, 1);
            assert_eq!(bridge.stats().received, 1);
        }
        // The last local subscriber leaving removes the upstream subscription.
        let (_, _, subs, name) = nodes.pop().unwrap();
        drop(subs);
        let monitor = server_ref(&server);
        eventually("upstream subscription removed", move || {
            subscriptions_of(&monitor, &name) == 0
        })
        .await;
    })
    .await;
}

/// `Bridge::close` is cancel-safe: a close future dropped after its first
/// poll still closes the connection.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cancelled_close_still_closes_the_connection() {
    let server = NatsServer::start();
    limit(60, async {
        let bus = inline_bus::<Bytes>();
        // The closing work runs on the runtime's other worker, which may
        // finish it before the first poll looks (CI saw it once): then
        // nothing was cancelled, and a new bridge tries again.
        let mut tries = 0;
        let bridge = loop {
            tries += 1;
            let bridge = node(&bus, &server.url(), "closing", &["a/#"], &["b/#"]).await;
            let monitor = server_ref(&server);
            eventually("connected", move || monitor.connection("closing").is_some()).await;
            // Polled once, then dropped.
            let mut close = Box::pin(bridge.close());
            let waker = std::task::Waker::noop();
            let pending = close
                .as_mut()
                .poll(&mut std::task::Context::from_waker(waker))
                .is_pending();
            drop(close);
            if pending {
                break bridge;
            }
            assert!(
                tries < 10,
                "close finished in one poll {tries} times: nothing was cancelled"
            );
            let monitor = server_ref(&server);
            eventually("the connection closed", move || {
                monitor.connection("closing").is_none()
            })
            .await;
        };
        let monitor = server_ref(&server);
        eventually("the connection closed", move || {
            monitor.connection("closing").is_none()
        })
        .await;
        // Closing again does nothing, and the bridge is still there.
        bridge.close().await.unwrap();
        assert!(!bridge.stats().connected);
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn overlapping_filters_deliver_once_each() {
    let server = NatsServer::start();
    limit(60, async {
        let (a, b) = (inline_bus::<Bytes>(), inline_bus::<Bytes>());
        let _ba = node(&a, &server.url(), "a", &["a/#"], &[]).await;
        let bb = node(&b, &server.url(), "b", &[], &["a/#"]).await;
        let (hash, plus) = (Seen::default(), Seen::default());
        let _h = b.subscribe("a/#", hash.handler()).unwrap();
        let _p = b.subscribe("a/+", plus.handler()).unwrap();
        // `a/#` is two NATS subscriptions (`a.>` and `a`), `a/+` one.
        let monitor = server_ref(&server);
        eventually("three NATS subscriptions", move || {
            subscriptions_of(&monitor, "b") == 3
        })
        .await;
        a.publish("a/x", Bytes::from_static(b"1")).unwrap();
        a.publish("a", Bytes::from_static(b"2")).unwrap();
        a.publish("a/x/y", Bytes::from_static(b"3")).unwrap();
        let (h, p) = (hash.clone(), plus.clone());
        eventually("deliveries", move || h.len() == 3 && p.len() == 1).await;
        tokio::time::sleep(Duration::from_millis(300)).await;
        // (`a` and `a/x/...` arrive on different NATS subscriptions: order
        // holds per topic, not across them.)
        let mut topics = hash.topics();
        topics.sort();
        assert_eq!(topics, ["a", "a/x", "a/x/y"]);
        assert_eq!(plus.topics(), ["a/x"]);
        // The server sent `a/x` twice (one per matching subscription).
        assert_eq!(server.connection("b").unwrap().1, 4);
        assert_eq!(bb.stats().received, 4);
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_nodes_export_and_import_one_namespace_without_loops() {
    let server = NatsServer::start();
    limit(60, async {
        let mut nodes = Vec::new();
        for n in 0..3 {
            let bus = inline_bus::<Bytes>();
            let name = format!("peer-{n}");
            let bridge = node(&bus, &server.url(), &name, &["chat/#"], &["chat/#"]).await;
            let seen = Seen::default();
            let sub = bus.subscribe("chat/#", seen.handler()).unwrap();
            let monitor = server_ref(&server);
            let watched = name.clone();
            eventually("subscribed", move || {
                subscriptions_of(&monitor, &watched) == 2
            })
            .await;
            nodes.push((bus, bridge, seen, sub));
        }
        let in_before = server.varz_field("in_msgs").unwrap();
        for (n, (bus, ..)) in nodes.iter().enumerate() {
            bus.publish(&format!("chat/from-{n}"), Bytes::from_static(b"hi"))
                .unwrap();
        }
        for (_, _, seen, _) in &nodes {
            let s = seen.clone();
            eventually("three messages each", move || s.len() == 3).await;
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
        for (_, bridge, seen, _) in &nodes {
            let mut topics = seen.topics();
            topics.sort();
            assert_eq!(
                topics,
                ["chat/from-0", "chat/from-1", "chat/from-2"],
                "no echo, no loop"
            );
            let stats = bridge.stats();
            assert_eq!((stats.sent, stats.received), (1, 2));
        }
        assert_eq!(
            server.varz_field("in_msgs").unwrap() - in_before,
            3,
            "each message entered the engine once: nothing was sent back out"
        );
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn server_restart_restores_subscriptions_and_counts_losses() {
    let mut server = NatsServer::start();
    limit(90, async {
        let (a, b) = (inline_bus::<Bytes>(), inline_bus::<Bytes>());
        let url = server.url();
        let ba = Bridge::builder(&a)
            .nats(url.as_str())
            .name("a")
            .export("jobs/#")
            .outgoing_buffer(2)
            .reconnect_backoff(Duration::from_millis(20), Duration::from_millis(200))
            .start()
            .await
            .unwrap();
        let bb = Bridge::builder(&b)
            .nats(url.as_str())
            .name("b")
            .import("jobs/#")
            .reconnect_backoff(Duration::from_millis(20), Duration::from_millis(200))
            .start()
            .await
            .unwrap();
        let seen = Seen::default();
        let _s = b.subscribe("jobs/+", seen.handler()).unwrap();
        let monitor = server_ref(&server);
        eventually("subscribed", move || subscriptions_of(&monitor, "b") == 1).await;
        a.publish("jobs/1", Bytes::from_static(b"1")).unwrap();
        let s = seen.clone();
        eventually("first delivery", move || s.len() == 1).await;

        server.kill();
        let stats = || (ba.stats().connected, bb.stats().connected);
        until(
            || stats() == (false, false),
            || "the bridges did not notice".to_string(),
        )
        .await;
        // Five while down, with room for two: three dropped, counted.
        for n in 0..5 {
            a.publish(&format!("jobs/down-{n}"), Bytes::from_static(b"x"))
                .unwrap();
        }
        until(
            || ba.stats().dropped >= 3,
            || format!("losses not counted: {:?}", ba.stats()),
        )
        .await;
        assert_eq!(ba.stats().dropped, 3);

        server.restart();
        // The client's state turns connected before its event reaches the
        // bridge's counter: wait for both.
        until(
            || stats() == (true, true) && ba.stats().reconnects >= 1 && bb.stats().reconnects >= 1,
            || {
                format!(
                    "the bridges did not reconnect: {:?} {:?}",
                    ba.stats(),
                    bb.stats()
                )
            },
        )
        .await;
        let monitor = server_ref(&server);
        eventually("subscription restored", move || {
            subscriptions_of(&monitor, "b") == 1
        })
        .await;
        a.publish("jobs/after", Bytes::from_static(b"2")).unwrap();
        let s = seen.clone();
        eventually("delivery after the restart", move || {
            s.topics().iter().any(|t| t == "jobs/after")
        })
        .await;
        // The two buffered messages were sent after the reconnect (b may
        // have resubscribed after they passed: at most once).
        assert_eq!(ba.stats().sent, 4);
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cluster_member_dying_moves_the_node_and_its_subscriptions() {
    let [s1, mut s2, s3] = NatsServer::cluster3();
    limit(90, async {
        let (a, b) = (inline_bus::<Bytes>(), inline_bus::<Bytes>());
        let ba = node(&a, &s1.url(), "a", &["alerts/#"], &[]).await;
        // Only s2's URL: the client learns the other members from it.
        let bb = Bridge::builder(&b)
            .nats(s2.url())
            .name("b")
            .import("alerts/#")
            .reconnect_backoff(Duration::from_millis(20), Duration::from_millis(200))
            .start()
            .await
            .unwrap();
        let seen = Seen::default();
        let _s = b.subscribe("alerts/+", seen.handler()).unwrap();
        // Interest crosses the routes asynchronously: publish until one lands.
        let publish_until = |topic: &'static str| {
            let a = a.clone();
            let seen = seen.clone();
            async move {
                let deadline = Instant::now() + Duration::from_secs(20);
                while !seen.topics().iter().any(|t| t == topic) {
                    assert!(Instant::now() < deadline, "{topic} never arrived");
                    a.publish(topic, Bytes::from_static(b"!")).unwrap();
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
            }
        };
        publish_until("alerts/before").await;
        assert!(s2.connection("b").is_some(), "b starts on s2");

        s2.kill();
        until(
            || bb.stats().reconnects >= 1 && bb.stats().connected,
            || format!("b did not fail over: {:?}", bb.stats()),
        )
        .await;
        publish_until("alerts/after").await;
        assert!(s3.connection("b").is_some() || s1.connection("b").is_some());
        assert_eq!(bb.stats().upstream_subscriptions, 1);
        assert!(ba.stats().sent >= 2);
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_payloads_and_foreign_subjects_are_counted_not_fatal() {
    let server = NatsServer::start();
    limit(60, async {
        let bus = inline_bus::<Vec<u32>>();
        let bridge = Bridge::builder(&bus)
            .nats(server.url())
            .name("typed")
            .import("data/#")
            .start()
            .await
            .unwrap();
        let got = Arc::new(Mutex::new(Vec::new()));
        let g = Arc::clone(&got);
        let _s = bus
            .subscribe("data/#", move |m| g.lock().unwrap().push(m.data().clone()))
            .unwrap();
        let monitor = server_ref(&server);
        eventually("subscribed", move || {
            subscriptions_of(&monitor, "typed") == 2
        })
        .await;
        // A plain NATS client, as another service would be.
        let raw = async_nats::connect(server.url()).await.unwrap();
        raw.publish("data.x", "not json".into()).await.unwrap();
        raw.publish("data.%ZZ", "[1]".into()).await.unwrap();
        raw.publish("data.y", "[1,2,3]".into()).await.unwrap();
        raw.flush().await.unwrap();
        let g = Arc::clone(&got);
        eventually("the good one", move || g.lock().unwrap().len() == 1).await;
        assert_eq!(*got.lock().unwrap(), [vec![1, 2, 3]]);
        until(
            || bridge.stats().decode_errors >= 2,
            || format!("{:?}", bridge.stats()),
        )
        .await;
        assert_eq!(bridge.stats().decode_errors, 2);
        assert_eq!(bridge.stats().received, 1);
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_subscribe_storm_coalesces_into_one_upstream_subscription() {
    let server = NatsServer::start();
    limit(60, async {
        let bus = inline_bus::<Bytes>();
        let bridge = node(&bus, &server.url(), "storm", &[], &["s/#"]).await;
        let keep = bus.subscribe("s/x", |_| {}).unwrap();
        let workers: Vec<_> = (0..2)
            .map(|_| {
                let bus = bus.clone();
                std::thread::spawn(move || {
                    for n in 0..5_000 {
                        let sub = bus
                            .subscribe(if n % 2 == 0 { "s/y" } else { "s/x" }, |_| {})
                            .unwrap();
                        drop(sub);
                    }
                })
            })
            .collect();
        for w in workers {
            w.join().unwrap();
        }
        let monitor = server_ref(&server);
        eventually("one subscription left", move || {
            subscriptions_of(&monitor, "storm") == 1
        })
        .await;
        tokio::time::sleep(Duration::from_millis(200)).await;
        assert_eq!(bridge.stats().upstream_subscriptions, 1);
        assert_eq!(subscriptions_of(&server, "storm"), 1);
        drop(keep);
        let monitor = server_ref(&server);
        eventually("none left", move || {
            subscriptions_of(&monitor, "storm") == 0
        })
        .await;
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_connection_is_retried_and_exports_wait_for_it() {
    let [port, monitor] = nats_server::free_ports();
    limit(60, async {
        let bus = inline_bus::<Bytes>();
        // Nothing listens yet: start succeeds, the bridge keeps trying.
        let bridge = Bridge::builder(&bus)
            .nats(format!("nats://127.0.0.1:{port}"))
            .name("early")
            .export("early/#")
            .reconnect_backoff(Duration::from_millis(20), Duration::from_millis(100))
            .start()
            .await
            .unwrap();
        for n in 0..3 {
            bus.publish(&format!("early/{n}"), Bytes::from_static(b"x"))
                .unwrap();
        }
        tokio::time::sleep(Duration::from_millis(300)).await;
        let stats = bridge.stats();
        assert!(!stats.connected);
        assert_eq!((stats.sent, stats.dropped), (0, 0), "held, not lost");

        let server =
            tokio::task::spawn_blocking(move || NatsServer::start_on(port, monitor, 0, &[]))
                .await
                .unwrap();
        until(
            || bridge.stats().sent >= 3,
            || format!("not sent after connecting: {:?}", bridge.stats()),
        )
        .await;
        assert_eq!(bridge.stats().dropped, 0);
        let in_msgs = server.varz_field("in_msgs").unwrap();
        assert_eq!(in_msgs, 3, "the server got the three held messages");
        bridge.close().await.unwrap();
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slow_local_consumer_is_counted_as_a_slow_consumer() {
    let server = NatsServer::start();
    limit(60, async {
        let (a, b) = (inline_bus::<Bytes>(), inline_bus::<Bytes>());
        let _ba = node(&a, &server.url(), "fast", &["slow/#"], &[]).await;
        let bb = Bridge::builder(&b)
            .nats(server.url())
            .name("slow")
            .import("slow/#")
            .import_buffer(4)
            .start()
            .await
            .unwrap();
        let handled = Arc::new(AtomicU64::new(0));
        let h = Arc::clone(&handled);
        // An Inline handler that blocks: the bridge's delivery waits for it,
        // and the client's 4-message buffer overflows.
        let _s = b
            .subscribe("slow/+", move |_| {
                std::thread::sleep(Duration::from_millis(20));
                h.fetch_add(1, Ordering::Relaxed);
            })
            .unwrap();
        let monitor = server_ref(&server);
        eventually("subscribed", move || {
            subscriptions_of(&monitor, "slow") == 1
        })
        .await;
        for n in 0..200 {
            a.publish(&format!("slow/{n}"), Bytes::from_static(b"x"))
                .unwrap();
        }
        until(
            || bb.stats().received + bb.stats().slow_consumers >= 200,
            || format!("{:?}", bb.stats()),
        )
        .await;
        let stats = bb.stats();
        assert!(stats.slow_consumers > 0, "{stats:?}");
        assert_eq!(stats.dropped, stats.slow_consumers);
        assert_eq!(
            stats.received + stats.slow_consumers,
            200,
            "every message delivered or counted"
        );
        assert_eq!(handled.load(Ordering::Relaxed), stats.received);
    })
    .await;
}

#[tokio::test]
async fn misuse_gets_its_exact_error() {
    use blazesub::Error;
    let bus = inline_bus::<Bytes>();
    let no_engine = Bridge::builder(&bus).export("a/#").start().await;
    assert!(matches!(
        no_engine,
        Err(Error::InvalidArgument {
            name: "nats/mqtt",
            ..
        })
    ));
    let no_filter = Bridge::builder(&bus)
        .nats("nats://127.0.0.1:1")
        .start()
        .await;
    assert!(matches!(
        no_filter,
        Err(Error::InvalidArgument {
            name: "export/import",
            ..
        })
    ));
    let bad_filter = Bridge::builder(&bus)
        .nats("nats://127.0.0.1:1")
        .import("a/#/b")
        .start()
        .await;
    assert!(matches!(bad_filter, Err(Error::Topic(_))));
    let shared = Bridge::builder(&bus)
        .nats("nats://127.0.0.1:1")
        .import("$share/g/a")
        .start()
        .await;
    assert!(matches!(
        shared,
        Err(Error::InvalidArgument { name: "filter", .. })
    ));
    let bad_url = Bridge::builder(&bus)
        .nats("nats://127.0.0.1:notaport")
        .import("a/#")
        .start()
        .await;
    match bad_url {
        Err(Error::Bridge {
            engine: "NATS",
            url,
            ..
        }) => assert!(url.contains("notaport")),
        other => panic!("{other:?}"),
    }
    bus.close().await.unwrap();
    let closed = Bridge::builder(&bus)
        .nats("nats://127.0.0.1:1")
        .import("a/#")
        .start()
        .await;
    assert!(matches!(closed, Err(Error::Closed)));
}

/// nats-server holds payload and headers together to its `max_payload` (1
/// MiB by default) and closes the connection over it. A payload just under
/// the limit that the origin header pushes over, and a small payload with
/// large metadata, are refused before they are sent and counted as
/// dropped; the connection stays up and the next message arrives.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn headers_count_against_the_servers_max_payload() {
    let server = NatsServer::start();
    limit(60, async {
        let (a, b) = (inline_bus::<Bytes>(), inline_bus::<Bytes>());
        let ba = node(&a, &server.url(), "a", &["big/#"], &[]).await;
        let bb = node(&b, &server.url(), "b", &[], &["big/#"]).await;
        let seen = Seen::default();
        let _s = b.subscribe("big/+", seen.handler()).unwrap();
        let monitor = server_ref(&server);
        eventually("b subscribed upstream", move || {
            subscriptions_of(&monitor, "b") == 1
        })
        .await;
        let max = 1 << 20; // nats-server's default max_payload
        a.publish("big/edge", Bytes::from(vec![1u8; max - 8]))
            .unwrap();
        let metadata = Metadata::new().with("k", "v".repeat(max));
        a.publish_with("big/metadata", Bytes::from_static(b"x"), metadata)
            .unwrap();
        a.publish("big/after", Bytes::from_static(b"small"))
            .unwrap();
        until(
            || seen.len() == 1,
            || format!("{:?} {:?}", ba.stats(), bb.stats()),
        )
        .await;
        assert_eq!(seen.topics(), ["big/after"]);
        let sa = ba.stats();
        assert_eq!(
            (sa.sent, sa.dropped),
            (1, 2),
            "both refused, counted: {sa:?}"
        );
        assert_eq!(
            (sa.reconnects, bb.stats().reconnects),
            (0, 0),
            "no connection lost"
        );
    })
    .await;
}

/// Messages the bus put in an export tap that the export task had not read
/// yet when `close` ran are sent (the connection is up), and what the tap
/// dropped before that is counted: every accepted export ends up in `sent`
/// or `dropped`. (On this single-threaded runtime the export task does not
/// run between the publishes and `close`.)
#[tokio::test]
async fn close_sends_or_counts_what_the_export_taps_still_hold() {
    let server = NatsServer::start();
    limit(60, async {
        let a = inline_bus::<Bytes>();
        let ba = node(&a, &server.url(), "a", &["c/#"], &[]).await;
        for n in 0..500 {
            a.publish(&format!("c/{n}"), Bytes::from_static(b"x"))
                .unwrap();
        }
        ba.close().await.unwrap();
        let s = ba.stats();
        assert_eq!((s.sent, s.dropped), (500, 0), "{s:?}");

        // A tap of 100 kept the newest 100 and lost 400.
        let small = start_node(
            Bridge::builder(&a).nats(server.url()).export_buffer(100),
            "small",
            &["c/#"],
            &[],
        )
        .await;
        for n in 0..500 {
            a.publish(&format!("c/{n}"), Bytes::from_static(b"x"))
                .unwrap();
        }
        small.close().await.unwrap();
        let s = small.stats();
        assert_eq!((s.sent, s.dropped), (100, 400), "{s:?}");
    })
    .await;
}

/// Overlapping export filters (`a/#` and `#`) put a message in both taps,
/// but only the first sends it: a tap's overflow counts only the messages
/// it would have sent, so each loss is counted once and no sent message as
/// lost. (Single-threaded runtime: the export task reads nothing until the
/// publishes are done, so each tap keeps only its newest message.)
#[tokio::test]
async fn overlapping_exports_count_each_loss_once() {
    let server = NatsServer::start();
    limit(60, async {
        let a = inline_bus::<Bytes>();
        let ba = start_node(
            Bridge::builder(&a).nats(server.url()).export_buffer(1),
            "a",
            &["a/#", "#"],
            &[],
        )
        .await;
        for _ in 0..200 {
            a.publish("a/x", Bytes::from_static(b"x")).unwrap();
        }
        // Only `#` sends these; its tap also lost every `a/x` above.
        for _ in 0..200 {
            a.publish("b/y", Bytes::from_static(b"y")).unwrap();
        }
        until(
            || ba.stats().sent + ba.stats().dropped >= 400,
            || format!("{:?}", ba.stats()),
        )
        .await;
        tokio::time::sleep(Duration::from_millis(300)).await;
        let s = ba.stats();
        assert_eq!((s.sent, s.dropped), (2, 398), "{s:?}");
    })
    .await;
}

/// Once `close` has returned, imports stop reaching local subscribers (at
/// most the delivery in progress finishes), and what was still queued for
/// local delivery is counted as dropped.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn close_stops_import_deliveries_and_counts_what_was_queued() {
    let server = NatsServer::start();
    limit(60, async {
        let (a, b) = (inline_bus::<Bytes>(), inline_bus::<Bytes>());
        let _ba = node(&a, &server.url(), "a", &["q/#"], &[]).await;
        let bb = node(&b, &server.url(), "b", &[], &["q/#"]).await;
        let handled = Arc::new(AtomicU64::new(0));
        let h = Arc::clone(&handled);
        // An Inline handler that blocks: deliveries queue up behind it.
        let _s = b
            .subscribe("q/+", move |_| {
                std::thread::sleep(Duration::from_millis(20));
                h.fetch_add(1, Ordering::Relaxed);
            })
            .unwrap();
        let monitor = server_ref(&server);
        eventually("b subscribed upstream", move || {
            subscriptions_of(&monitor, "b") == 1
        })
        .await;
        let sent_before = server.varz_field("out_msgs").unwrap();
        for n in 0..100 {
            a.publish(&format!("q/{n}"), Bytes::from_static(b"x"))
                .unwrap();
        }
        // All 100 on their way to b (what is still in the socket when it
        // unsubscribes is the at-most-once gap, uncounted by design), and a
        // moment for its client to read them.
        let monitor = server_ref(&server);
        eventually("the server sent b all 100", move || {
            monitor.varz_field("out_msgs").unwrap() - sent_before >= 100
        })
        .await;
        tokio::time::sleep(Duration::from_millis(100)).await;
        until(
            || handled.load(Ordering::Relaxed) >= 5,
            || format!("{:?}", bb.stats()),
        )
        .await;
        bb.close().await.unwrap();
        let at_close = handled.load(Ordering::Relaxed);
        tokio::time::sleep(Duration::from_millis(500)).await;
        let after = handled.load(Ordering::Relaxed);
        assert!(
            after <= at_close + 1,
            "{} deliveries after close returned",
            after - at_close
        );
        let s = bb.stats();
        assert_eq!(s.received, after, "{s:?}");
        assert_eq!(s.received + s.dropped, 100, "delivered or counted: {s:?}");
    })
    .await;
}
