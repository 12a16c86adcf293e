//! The NATS bridge's import accounting at its edges: every message the
//! server hands a node's client is delivered locally or counted in
//! `BridgeStats::dropped`, exactly, under a burst that overflows and at a
//! close with a backlog; and bus topics starting with `$` stay out of the
//! NATS subjects reserved for the server (`$SYS`, `$JS`...).
//!
//! The accounting tests run their node on a current-thread runtime (the
//! test's own), where the client's connection task reads a burst far
//! faster than anything else on the runtime runs; the raw NATS publisher
//! runs on a thread of its own.
//!
//! Needs `nats-server` on PATH or in `BLAZESUB_NATS_SERVER`, as the other
//! bridge tests; without it these tests fail, never skip. Each test has a
//! time limit and fails rather than hangs.
#![cfg(feature = "nats")]

#[path = "common/bridge_support.rs"]
mod bridge_support;
#[path = "common/nats_server.rs"]
mod nats_server;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use blazesub::bridge::mapping::{filter_to_subjects, subject_to_topic, topic_to_subject};
use blazesub::bridge::{Bridge, BridgeStats};
use bridge_support::{inline_bus, limit, start_node, until, Seen};
use bytes::Bytes;
use nats_server::NatsServer;

/// Publishes `n` small messages to `subject.{i % 8}` from a raw client on a
/// thread and runtime of its own (so the node's runtime does not pace it),
/// and returns once the server has them.
async fn publish_burst(url: String, subject: &'static str, n: usize) {
    tokio::task::spawn_blocking(move || {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        runtime.block_on(async {
            let client = async_nats::connect(url).await.unwrap();
            let subjects: Vec<String> = (0..8).map(|i| format!("{subject}.{i}")).collect();
            for i in 0..n {
                client
                    .publish(subjects[i % 8].clone(), Bytes::from_static(b"x"))
                    .await
                    .unwrap();
            }
            client.flush().await.unwrap();
        });
    })
    .await
    .unwrap();
}

/// Waits (off the runtime: it asks the server over HTTP) until the server
/// has sent `n` messages to the connection named `name`.
async fn server_sent(server: &NatsServer, name: &'static str, n: u64) {
    let monitor = NatsServer::monitor_only(server);
    tokio::task::spawn_blocking(move || {
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            let sent = monitor.connection(name).map_or(0, |c| c.1);
            if sent >= n {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "the server sent {name} {sent} of {n}"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    })
    .await
    .unwrap();
}

/// Waits until the server counts `subscriptions` for `name`.
async fn server_subscriptions(server: &NatsServer, name: &'static str, subscriptions: u64) {
    let monitor = NatsServer::monitor_only(server);
    tokio::task::spawn_blocking(move || {
        let deadline = Instant::now() + Duration::from_secs(20);
        while monitor.connection(name).map_or(0, |c| c.0) != subscriptions {
            assert!(Instant::now() < deadline, "{name} never subscribed");
            std::thread::sleep(Duration::from_millis(20));
        }
    })
    .await
    .unwrap();
}

/// `what()` once it has stayed the same for `quiet` (or after `max`).
async fn settle(what: impl Fn() -> u64, quiet: Duration, max: Duration) -> u64 {
    let deadline = Instant::now() + max;
    let mut last = what();
    let mut since = Instant::now();
    while Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(20)).await;
        let now = what();
        if now != last {
            (last, since) = (now, Instant::now());
        } else if since.elapsed() >= quiet {
            break;
        }
    }
    last
}

fn accounted(s: &BridgeStats) -> u64 {
    s.received + s.dropped
}

/// A burst far bigger than the client's subscription channel (64 Ki
/// messages) to a node on a current-thread runtime: the client's
/// connection task reads the burst in a few large polls, so before the fix
/// its channel overflowed and async-nats dropped the rest, reporting each
/// drop as an event through a channel of 128 it fills with `try_send`;
/// most drops went uncounted. Now every message the server sent is
/// received or counted dropped (as a slow consumer), exactly.
#[tokio::test]
async fn a_burst_that_overflows_is_received_or_counted_exactly() {
    const N: u64 = 200_000;
    let server = NatsServer::start();
    limit(60, async {
        let bus = inline_bus::<Bytes>();
        let bridge = start_node(
            Bridge::builder(&bus)
                .nats(server.url())
                .import_buffer(1_024),
            "sink",
            &[],
            &["burst/#"],
        )
        .await;
        let handled = Arc::new(AtomicU64::new(0));
        let h = Arc::clone(&handled);
        let _sub = bus
            .subscribe("burst/#", move |_| {
                h.fetch_add(1, Ordering::Relaxed);
            })
            .unwrap();
        server_subscriptions(&server, "sink", 2).await; // `burst.>`, `burst`
        let started = Instant::now();
        publish_burst(server.url(), "burst", N as usize).await;
        server_sent(&server, "sink", N).await;
        let total = settle(
            || accounted(&bridge.stats()),
            Duration::from_millis(500),
            Duration::from_secs(20),
        )
        .await;
        let s = bridge.stats();
        eprintln!("{s:?} after {:?}", started.elapsed());
        assert_eq!(s.reconnects, 0, "the connection held: {s:?}");
        assert_eq!(
            server.varz_field("slow_consumers"),
            Some(0),
            "the server dropped nothing"
        );
        assert_eq!(handled.load(Ordering::Relaxed), s.received);
        assert_eq!(s.dropped, s.slow_consumers, "{s:?}");
        assert_eq!(
            total,
            N,
            "every message received or counted dropped: {} of {N} unaccounted ({s:?})",
            N.saturating_sub(total)
        );
        bridge.close().await.unwrap();
    })
    .await;
}

/// A backlog still in the client's subscription channel when the bridge
/// closes: the node's only subscriber is an Inline handler that takes
/// about 0.1 ms, so on this current-thread runtime the bridge moves
/// little of a 40,000-message burst (which fits the client's channel)
/// before `close`. Before the fix, what the client's channel held was
/// dropped with its reader task, uncounted; now `close` counts it.
#[tokio::test]
async fn close_counts_what_the_clients_channel_still_holds() {
    const N: u64 = 40_000;
    let server = NatsServer::start();
    limit(60, async {
        let bus = inline_bus::<Bytes>();
        let bridge = start_node(
            Bridge::builder(&bus).nats(server.url()),
            "held",
            &[],
            &["held/#"],
        )
        .await;
        let handled = Arc::new(AtomicU64::new(0));
        let h = Arc::clone(&handled);
        let _sub = bus
            .subscribe("held/#", move |_| {
                std::thread::sleep(Duration::from_micros(100));
                h.fetch_add(1, Ordering::Relaxed);
            })
            .unwrap();
        server_subscriptions(&server, "held", 2).await;
        publish_burst(server.url(), "held", N as usize).await;
        server_sent(&server, "held", N).await;
        // A moment for the client to read the socket: what is still in it
        // when the bridge unsubscribes is the at-most-once gap, uncounted.
        tokio::time::sleep(Duration::from_millis(300)).await;
        let before = bridge.stats();
        bridge.close().await.unwrap();
        let at_close = handled.load(Ordering::Relaxed);
        tokio::time::sleep(Duration::from_millis(300)).await;
        let s = bridge.stats();
        eprintln!("before close {before:?}; after {s:?}");
        assert_eq!(s.reconnects, 0, "{s:?}");
        assert!(
            handled.load(Ordering::Relaxed) <= at_close + 1,
            "deliveries after close returned"
        );
        assert_eq!(handled.load(Ordering::Relaxed), s.received);
        assert!(
            s.received < N / 2,
            "the test needs a backlog at close: {s:?}"
        );
        assert_eq!(
            accounted(&s),
            N,
            "every message received or counted dropped: {} of {N} unaccounted ({s:?})",
            N.saturating_sub(accounted(&s))
        );
    })
    .await;
}

/// A local filter subscribed and unsubscribed 40 times while 60,000
/// messages flow counts no drop that did not happen (the thirty-third
/// session's reverted fix counted 35-1,411: it took messages the client
/// dropped for a subscription it had just forgotten as slow-consumer
/// drops), and a filter that stays subscribed gets every message.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn filter_churn_counts_no_drop_that_did_not_happen() {
    const N: u64 = 60_000;
    let server = NatsServer::start();
    limit(60, async {
        let bus = inline_bus::<Bytes>();
        let bridge = start_node(
            Bridge::builder(&bus).nats(server.url()),
            "churn",
            &[],
            &["churn/#"],
        )
        .await;
        let kept = Arc::new(AtomicU64::new(0));
        let k = Arc::clone(&kept);
        let _kept = bus
            .subscribe("churn/#", move |_| {
                k.fetch_add(1, Ordering::Relaxed);
            })
            .unwrap();
        server_subscriptions(&server, "churn", 2).await;
        let publisher = tokio::spawn(publish_burst(server.url(), "churn", N as usize));
        for _ in 0..40 {
            let churn = bus.subscribe("churn/+", |_| {}).unwrap();
            tokio::time::sleep(Duration::from_millis(5)).await;
            drop(churn);
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        publisher.await.unwrap();
        until(
            || kept.load(Ordering::Relaxed) >= N,
            || {
                format!(
                    "{} of {N}: {:?}",
                    kept.load(Ordering::Relaxed),
                    bridge.stats()
                )
            },
        )
        .await;
        tokio::time::sleep(Duration::from_millis(200)).await;
        let s = bridge.stats();
        assert_eq!(kept.load(Ordering::Relaxed), N, "{s:?}");
        assert_eq!((s.dropped, s.slow_consumers), (0, 0), "{s:?}");
        bridge.close().await.unwrap();
    })
    .await;
}

/// NATS reserves subjects starting with `$` for the server and its
/// services (`$SYS` events, the `$JS` JetStream API, `$KV`...). Bus topics
/// starting with `$` are valid, and the mapping promises one subject per
/// topic name: they are escaped (`%24`), never sent onto a reserved
/// subject, and carried between nodes; a reserved subject another client
/// publishes is no topic of this mapping.
#[test]
fn dollar_topics_map_outside_the_reserved_subjects() {
    for topic in ["$SYS/x", "$JS/API/INFO", "$", "$/a", "a/$b"] {
        let subject = topic_to_subject(topic);
        assert!(!subject.starts_with('$'), "{topic} -> {subject}");
        assert_eq!(subject_to_topic(&subject).as_deref(), Some(topic));
    }
    // Only a leading `$` is reserved.
    assert_eq!(topic_to_subject("a/$b"), "a.$b");
    for filter in ["$SYS/#", "$JS/+/INFO", "$share"] {
        for subject in filter_to_subjects(filter) {
            assert!(!subject.starts_with('$'), "{filter} -> {subject}");
        }
    }
    assert_eq!(subject_to_topic("$SYS.x"), None);
    assert_eq!(subject_to_topic("$JS.API.INFO"), None);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dollar_topics_cross_the_bridge_but_not_into_reserved_subjects() {
    let server = NatsServer::start();
    limit(60, async {
        let (a, b) = (inline_bus::<Bytes>(), inline_bus::<Bytes>());
        let filters = ["$SYS/#", "$JS/#"];
        let ba = start_node(Bridge::builder(&a).nats(server.url()), "a", &filters, &[]).await;
        let bb = start_node(Bridge::builder(&b).nats(server.url()), "b", &[], &filters).await;
        // A raw client watching the reserved subjects.
        let raw = async_nats::connect(server.url()).await.unwrap();
        let mut watch_sys = raw.subscribe("$SYS.>").await.unwrap();
        let mut watch_js = raw.subscribe("$JS.>").await.unwrap();
        raw.flush().await.unwrap();
        let seen = Seen::default();
        let _s1 = b.subscribe("$SYS/#", seen.handler()).unwrap();
        let _s2 = b.subscribe("$JS/#", seen.handler()).unwrap();
        until(
            || bb.stats().upstream_subscriptions == 2,
            || format!("{:?}", bb.stats()),
        )
        .await;
        server_subscriptions(&server, "b", 4).await;

        a.publish("$SYS/x", Bytes::from_static(b"1")).unwrap();
        a.publish("$JS/API/INFO", Bytes::from_static(b"2")).unwrap();
        // Another client's message on a reserved subject is no topic.
        raw.publish("$SYS.y", Bytes::from_static(b"3"))
            .await
            .unwrap();
        raw.flush().await.unwrap();
        until(
            || seen.len() >= 2,
            || format!("{:?} {:?}", ba.stats(), bb.stats()),
        )
        .await;
        tokio::time::sleep(Duration::from_millis(300)).await;
        assert_eq!(seen.sorted_topics(), ["$JS/API/INFO", "$SYS/x"]);
        assert_eq!(ba.stats().sent, 2);
        // `$SYS.y` is the raw client's own (it does not set no_echo).
        assert_eq!(waiting(&mut watch_sys), ["$SYS.y"], "on reserved subjects");
        assert!(waiting(&mut watch_js).is_empty(), "on reserved subjects");
        ba.close().await.unwrap();
        bb.close().await.unwrap();
    })
    .await;
}

/// The subjects of the messages `subscriber` holds now.
fn waiting(subscriber: &mut async_nats::Subscriber) -> Vec<String> {
    let waker = std::task::Waker::noop();
    let mut cx = std::task::Context::from_waker(waker);
    let mut subjects = Vec::new();
    while let std::task::Poll::Ready(Some(message)) =
        futures_core::Stream::poll_next(std::pin::Pin::new(&mut *subscriber), &mut cx)
    {
        subjects.push(message.subject.to_string());
    }
    subjects
}
