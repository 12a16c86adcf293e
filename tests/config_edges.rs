//! Configuration and bad input at the public API's edges, as the
//! thirty-fourth session's review found them. Failed before their fixes:
//! `workers` and `queue_capacity` without an upper bound (`usize::MAX`
//! panicked in `Bus::new`, 2^40 aborted the process allocating), the
//! bridge's `export_buffer` likewise, `import_buffer(usize::MAX)` silently
//! ending imports, a zero reconnect backoff (824 connections in a second),
//! and durations that `Config` wrote but could not read back
//! (`Duration::MAX`, over 2^53 seconds).
//!
//! Cases that could abort the process run in a child process (this test
//! binary, re-run with `REVIEW_CONFIG_CHILD` set to the case's name and
//! filtered to `child_case`), so the parent survives and reports how the
//! child ended.

mod common;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use blazesub::{Bus, Config, DeliveryMode, Error, Message, Metadata, Overflow, StreamOptions};

const CHILD_ENV: &str = "REVIEW_CONFIG_CHILD";

fn with(change: impl FnOnce(&mut Config)) -> Config {
    let mut config = Config::default();
    change(&mut config);
    config
}

#[track_caller]
fn assert_child_ok(case: &str) {
    let (how, text) = common::run_child(CHILD_ENV, case, Duration::from_secs(30));
    let tail: String = text
        .lines()
        .filter(|l| {
            l.contains("panicked")
                || l.contains("memory")
                || l.contains("RESULT")
                || l.contains("capacity")
        })
        .collect::<Vec<_>>()
        .join("\n");
    assert_eq!(
        how, "exit 0",
        "child case {case} did not end cleanly:\n{tail}"
    );
}

/// A bus built from `config` in the child: it must either refuse with an
/// error naming the field, or build and work.
fn child_build(config: Config) {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let _guard = runtime.enter();
    match Bus::<u32>::new(config) {
        Ok(bus) => {
            let hits = Arc::new(AtomicUsize::new(0));
            let h = Arc::clone(&hits);
            let _s = bus
                .subscribe("a", move |_: &Message<u32>| {
                    h.fetch_add(1, Ordering::SeqCst);
                })
                .unwrap();
            bus.publish("a", 1).unwrap();
            runtime.block_on(bus.close()).unwrap();
            println!("RESULT built, hits {}", hits.load(Ordering::SeqCst));
        }
        Err(e) => println!("RESULT refused: {e}"),
    }
}

#[cfg(feature = "mqtt")]
fn child_bridge(
    change: impl FnOnce(
        blazesub::bridge::BridgeBuilder<bytes::Bytes>,
    ) -> blazesub::bridge::BridgeBuilder<bytes::Bytes>,
) {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap();
    runtime.block_on(async {
        let bus = Bus::<bytes::Bytes>::builder()
            .delivery(DeliveryMode::Inline)
            .build()
            .unwrap();
        let builder = blazesub::bridge::Bridge::builder(&bus)
            .mqtt("mqtt://127.0.0.1:1")
            .export("a/#");
        match change(builder).start().await {
            Ok(bridge) => {
                bus.publish("a/b", bytes::Bytes::from_static(b"x")).unwrap();
                bridge.close().await.unwrap();
                println!("RESULT started");
            }
            Err(e) => println!("RESULT refused: {e}"),
        }
    });
}

/// The child side: does nothing unless `REVIEW_CONFIG_CHILD` is set.
#[test]
fn child_case() {
    let Ok(case) = std::env::var(CHILD_ENV) else {
        return;
    };
    match case.as_str() {
        "queue_capacity_max" => child_build(with(|c| {
            c.workers = 1;
            c.queue_capacity = usize::MAX;
        })),
        "queue_capacity_max_2_workers" => child_build(with(|c| {
            c.workers = 2;
            c.queue_capacity = usize::MAX;
        })),
        "queue_capacity_2_40" => child_build(with(|c| {
            c.workers = 1;
            c.queue_capacity = 1 << 40;
        })),
        "workers_max_pool" => child_build(with(|c| c.workers = usize::MAX)),
        "workers_2_40_pool" => child_build(with(|c| c.workers = 1 << 40)),
        "workers_max_tasks" => child_build(with(|c| {
            c.delivery = DeliveryMode::TaskPerSubscriber;
            c.workers = usize::MAX;
        })),
        "workers_2_40_tasks" => child_build(with(|c| {
            c.delivery = DeliveryMode::TaskPerSubscriber;
            c.workers = 1 << 40;
        })),
        "inflight_max_tasks" => child_build(with(|c| {
            c.delivery = DeliveryMode::TaskPerSubscriber;
            c.max_inflight_tasks = usize::MAX;
        })),
        "workers_1m_tasks_rss" => {
            let rss = || {
                std::fs::read_to_string("/proc/self/status")
                    .unwrap()
                    .lines()
                    .find(|l| l.starts_with("VmRSS"))
                    .unwrap()
                    .to_owned()
            };
            println!("RESULT before {}", rss());
            let t = Instant::now();
            child_build(with(|c| {
                c.delivery = DeliveryMode::TaskPerSubscriber;
                c.workers = 1_000_000;
            }));
            println!("RESULT after {} in {:?}", rss(), t.elapsed());
        }
        "max_retained_max" => child_build(with(|c| c.max_retained = usize::MAX)),
        #[cfg(feature = "mqtt")]
        "export_buffer_max" => child_bridge(|b| b.export_buffer(usize::MAX)),
        #[cfg(feature = "mqtt")]
        "export_buffer_2_40" => child_bridge(|b| b.export_buffer(1 << 40)),
        #[cfg(feature = "mqtt")]
        "outgoing_buffer_max" => child_bridge(|b| b.outgoing_buffer(usize::MAX)),
        other => panic!("unknown child case {other}"),
    }
}

// ---------------------------------------------------------------------------
// Sizes that validation accepts
// ---------------------------------------------------------------------------

/// `queue_capacity` has no upper bound in `validate`; the pool allocates
/// each worker's queue eagerly (crossbeam's array channel).
#[test]
fn queue_capacity_usize_max_is_refused_or_works() {
    assert_child_ok("queue_capacity_max");
}

#[test]
fn queue_capacity_usize_max_two_workers_is_refused_or_works() {
    assert_child_ok("queue_capacity_max_2_workers");
}

#[test]
fn queue_capacity_2_pow_40_does_not_abort() {
    assert_child_ok("queue_capacity_2_40");
}

#[test]
fn queue_capacity_has_an_upper_bound_in_validate() {
    let err = with(|c| c.queue_capacity = 1 << 40).validate();
    assert!(
        matches!(
            err,
            Err(Error::InvalidConfig {
                field: "queue_capacity",
                ..
            })
        ),
        "validate accepted queue_capacity 2^40: {err:?}"
    );
}

#[test]
fn workers_usize_max_pool_is_refused_or_works() {
    assert_child_ok("workers_max_pool");
}

#[test]
fn workers_2_pow_40_pool_does_not_abort() {
    assert_child_ok("workers_2_40_pool");
}

#[test]
fn workers_usize_max_tasks_is_refused_or_works() {
    assert_child_ok("workers_max_tasks");
}

#[test]
fn workers_2_pow_40_tasks_does_not_abort() {
    assert_child_ok("workers_2_40_tasks");
}

#[test]
fn workers_has_an_upper_bound_in_validate() {
    let err = with(|c| c.workers = 1_000_000).validate();
    assert!(
        matches!(
            err,
            Err(Error::InvalidConfig {
                field: "workers",
                ..
            })
        ),
        "validate accepted 1,000,000 worker threads: {err:?}"
    );
}

#[test]
fn workers_1m_tasks_probe() {
    let (how, text) = common::run_child(CHILD_ENV, "workers_1m_tasks_rss", Duration::from_secs(60));
    println!(
        "{how}\n{}",
        text.lines()
            .filter(|l| l.contains("RESULT"))
            .collect::<Vec<_>>()
            .join("\n")
    );
}

#[test]
fn max_inflight_tasks_usize_max_works() {
    assert_child_ok("inflight_max_tasks");
}

#[test]
fn max_retained_usize_max_works() {
    assert_child_ok("max_retained_max");
}

// ---------------------------------------------------------------------------
// Durations in configuration files
// ---------------------------------------------------------------------------

#[track_caller]
fn round_trip(config: &Config) -> Result<Config, String> {
    let json = serde_json::to_string(config).map_err(|e| e.to_string())?;
    serde_json::from_str::<Config>(&json).map_err(|e| format!("{json}: {e}"))
}

#[test]
fn close_timeout_duration_max_round_trips() {
    let config = with(|c| c.close_timeout = Duration::MAX);
    config.validate().unwrap();
    let back = round_trip(&config).expect("a valid Config must read back what it wrote");
    assert_eq!(back.close_timeout, Duration::MAX);
}

#[test]
fn close_timeout_u64_max_seconds_round_trips() {
    // What `huge_close_timeout_does_not_overflow` reads from a number.
    let config = with(|c| c.close_timeout = Duration::from_secs(u64::MAX));
    let back = round_trip(&config).expect("a valid Config must read back what it wrote");
    assert_eq!(back.close_timeout, Duration::from_secs(u64::MAX));
}

#[test]
fn retained_expiry_duration_max_round_trips() {
    // Documented: `Duration::MAX` never expires.
    let config = with(|c| c.retained_expiry = Some(Duration::MAX));
    config.validate().unwrap();
    let back = round_trip(&config).expect("a valid Config must read back what it wrote");
    assert_eq!(back.retained_expiry, Some(Duration::MAX));
}

#[test]
fn large_durations_round_trip_exactly() {
    let mut bad = Vec::new();
    for d in [
        Duration::from_millis(9_007_199_254_740_993),
        Duration::from_secs(9_007_199_254_740_993),
        Duration::from_micros(123_456_789_012_345_679),
        Duration::from_millis(86_400_123),
        Duration::from_micros(3_600_000_001),
    ] {
        let config = with(|c| c.close_timeout = d);
        match round_trip(&config) {
            Ok(back) if back.close_timeout == d => {}
            Ok(back) => bad.push(format!("{d:?} came back as {:?}", back.close_timeout)),
            Err(e) => bad.push(format!("{d:?}: {e}")),
        }
    }
    assert!(
        bad.is_empty(),
        "durations that do not round-trip:\n{}",
        bad.join("\n")
    );
}

#[test]
fn duration_text_forms_parse() {
    for (text, expected) in [
        ("1ns", Duration::from_nanos(1)),
        ("0ns", Duration::ZERO),
        ("18446744073709551615ns", Duration::from_nanos(u64::MAX)),
        ("1us", Duration::from_micros(1)),
        ("1µs", Duration::from_micros(1)),
        (" 5s ", Duration::from_secs(5)),
    ] {
        let c: Config = serde_json::from_str(&format!(r#"{{"close_timeout": "{text}"}}"#))
            .unwrap_or_else(|e| panic!("{text}: {e}"));
        assert_eq!(c.close_timeout, expected, "{text}");
    }
    for text in [
        "NaNs", "infs", "1..5s", ".s", "1e3ms", "-0s", "+1s", "1s2", "1 2s",
    ] {
        let r = serde_json::from_str::<Config>(&format!(r#"{{"close_timeout": "{text}"}}"#));
        assert!(r.is_err(), "{text} parsed: {r:?}");
    }
}

#[test]
fn retained_expiry_from_json() {
    let c: Config = serde_json::from_str(r#"{"retained_expiry": "1ns"}"#).unwrap();
    assert_eq!(c.retained_expiry, Some(Duration::from_nanos(1)));
    let c: Config = serde_json::from_str(r#"{"retained_expiry": null}"#).unwrap();
    assert_eq!(c.retained_expiry, None);
    let c: Config = serde_json::from_str(r#"{"retained_expiry": "0s"}"#).unwrap();
    assert!(matches!(
        c.validate(),
        Err(Error::InvalidConfig {
            field: "retained_expiry",
            ..
        })
    ));
    let c: Config = serde_json::from_str(r#"{"retained_expiry": 0.0000000001}"#).unwrap();
    // 0.1 ns rounds to zero: refused by validate, not a silent zero.
    assert!(c.validate().is_err() || c.retained_expiry.unwrap() > Duration::ZERO);
}

// ---------------------------------------------------------------------------
// Durations that work
// ---------------------------------------------------------------------------

async fn limit<F: std::future::Future>(f: F) -> F::Output {
    tokio::time::timeout(Duration::from_secs(10), f)
        .await
        .expect("timed out")
}

#[tokio::test]
async fn close_timeout_extremes_work() {
    for timeout in [Duration::ZERO, Duration::from_nanos(1), Duration::MAX] {
        let bus = Bus::<u32>::builder()
            .workers(1)
            .close_timeout(timeout)
            .build()
            .unwrap();
        let hits = Arc::new(AtomicUsize::new(0));
        let h = Arc::clone(&hits);
        let _s = bus
            .subscribe("a", move |_: &Message<u32>| {
                std::thread::sleep(Duration::from_millis(20));
                h.fetch_add(1, Ordering::SeqCst);
            })
            .unwrap();
        bus.publish("a", 1).unwrap();
        let r = limit(bus.close()).await;
        if timeout == Duration::MAX {
            r.unwrap();
            assert_eq!(hits.load(Ordering::SeqCst), 1);
        } else {
            assert!(
                r.is_ok() || matches!(r, Err(Error::CloseTimeout { .. })),
                "{timeout:?}: {r:?}"
            );
        }
    }
}

#[tokio::test]
async fn retained_expiry_extremes_work() {
    for expiry in [Duration::from_nanos(1), Duration::MAX] {
        let bus = Bus::<u32>::builder()
            .delivery(DeliveryMode::Inline)
            .retained_expiry(expiry)
            .build()
            .unwrap();
        bus.publish_retained("a", 1).unwrap();
        std::thread::sleep(Duration::from_millis(2));
        let mut rx = bus.subscribe_stream("a").unwrap();
        let got = rx.try_recv();
        if expiry == Duration::MAX {
            assert!(got.is_ok(), "Duration::MAX expired");
        } else {
            assert!(got.is_err(), "1ns did not expire");
        }
        bus.close().await.unwrap();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn request_timeout_extremes_work() {
    let bus = Bus::<u32>::builder().workers(1).build().unwrap();
    let responder = bus.clone();
    let _s = bus
        .subscribe("rpc", move |m: &Message<u32>| {
            responder.reply(m, *m.data() + 1).unwrap();
        })
        .unwrap();
    for timeout in [Duration::from_secs(2), Duration::MAX] {
        let r = limit(bus.request("rpc", 1, timeout)).await.unwrap();
        assert_eq!(*r.data(), 2);
    }
    // 0 and 1 ns: an answer or a timeout, never a hang or a panic.
    for timeout in [Duration::ZERO, Duration::from_nanos(1)] {
        let r = limit(bus.request("rpc", 1, timeout)).await;
        assert!(
            r.is_ok() || matches!(r, Err(Error::Timeout { .. })),
            "{r:?}"
        );
        let r = limit(bus.request_many("rpc", 1, timeout, usize::MAX)).await;
        assert!(
            r.is_ok() || matches!(r, Err(Error::Timeout { .. })),
            "{r:?}"
        );
    }
    // Nobody listens on `none`; a silent responder with Duration::MAX ends at close.
    let _silent = bus.subscribe("quiet", |_: &Message<u32>| {}).unwrap();
    let b2 = bus.clone();
    let waiting = tokio::spawn(async move { b2.request("quiet", 1, Duration::MAX).await });
    tokio::time::sleep(Duration::from_millis(50)).await;
    limit(bus.close()).await.unwrap();
    let r = limit(waiting).await.unwrap();
    assert!(matches!(r, Err(Error::Closed)), "{r:?}");
}

// ---------------------------------------------------------------------------
// Values that interact
// ---------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn interacting_values_build_and_deliver() {
    use blazesub::Batch;
    let mut cases = Vec::new();
    for delivery in [
        DeliveryMode::WorkerPool,
        DeliveryMode::TaskPerSubscriber,
        DeliveryMode::Inline,
    ] {
        for batch in [Batch::Single, Batch::Chunked] {
            for (workers, threshold, queue, inflight) in [
                (1, 0, 1, 1),
                (4, usize::MAX, 1, 1),
                (3, 1, 2, 2),
                (64, 10, 1, 1),
                (2, usize::MAX, 1_000_000, usize::MAX),
            ] {
                for overflow in [Overflow::Wait, Overflow::CallerRuns, Overflow::Drop] {
                    cases.push(with(|c| {
                        c.delivery = delivery;
                        c.batch = batch;
                        c.workers = workers;
                        c.max_concurrent_subscriptions = threshold;
                        c.queue_capacity = queue;
                        c.max_inflight_tasks = inflight;
                        c.overflow = overflow;
                        c.stream_capacity = 1;
                        c.route_cache_capacity = 1;
                        c.max_retained = 1;
                    }));
                }
            }
        }
    }
    for config in cases {
        config.validate().unwrap();
        let bus = Bus::<u32>::new(config.clone()).unwrap();
        let hits = Arc::new(AtomicUsize::new(0));
        let mut subs = Vec::new();
        for _ in 0..40 {
            let h = Arc::clone(&hits);
            subs.push(
                bus.subscribe("x/+", move |_: &Message<u32>| {
                    h.fetch_add(1, Ordering::SeqCst);
                })
                .unwrap(),
            );
        }
        let mut delivered = 0;
        for i in 0..20 {
            delivered += limit(async { bus.publish_with("x/y", i, Metadata::new().with("", "")) })
                .await
                .unwrap();
        }
        bus.publish_retained("r/1", 1).unwrap();
        bus.publish_retained("r/2", 2).unwrap();
        assert_eq!(bus.retained_count(), 1, "{config:?}");
        limit(bus.close()).await.unwrap();
        if config.overflow != Overflow::Drop {
            assert_eq!(delivered, 800, "{config:?}");
            assert_eq!(hits.load(Ordering::SeqCst), 800, "{config:?}");
        }
    }
}

#[test]
fn stream_capacity_max_is_accepted_and_works() {
    let bus = Bus::<u32>::builder()
        .delivery(DeliveryMode::Inline)
        .build()
        .unwrap();
    let mut rx = bus
        .subscribe_stream_with("a", StreamOptions::new(StreamOptions::MAX_CAPACITY))
        .unwrap();
    bus.publish("a", 1).unwrap();
    assert_eq!(rx.try_recv().map(|m| *m.data()).ok(), Some(1));
}

// ---------------------------------------------------------------------------
// The bridge builder
// ---------------------------------------------------------------------------

#[cfg(feature = "mqtt")]
#[test]
fn bridge_export_buffer_usize_max_is_refused_or_works() {
    assert_child_ok("export_buffer_max");
}

#[cfg(feature = "mqtt")]
#[test]
fn bridge_export_buffer_2_pow_40_does_not_abort() {
    assert_child_ok("export_buffer_2_40");
}

#[cfg(feature = "mqtt")]
#[test]
fn bridge_outgoing_buffer_usize_max_works() {
    assert_child_ok("outgoing_buffer_max");
}

/// `import_buffer(usize::MAX)` ("unbounded") is accepted by `start`; the
/// import queue is made when a local subscriber appears.
#[cfg(feature = "mqtt")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bridge_import_buffer_usize_max_imports() {
    use blazesub::bridge::Bridge;
    for buffer in [65_536, usize::MAX] {
        let bus = Bus::<bytes::Bytes>::builder()
            .delivery(DeliveryMode::Inline)
            .build()
            .unwrap();
        let bridge = match Bridge::builder(&bus)
            .mqtt("mqtt://127.0.0.1:1")
            .import("a/#")
            .import_buffer(buffer)
            .start()
            .await
        {
            Ok(bridge) => bridge,
            Err(e) => {
                // A clear refusal is fine.
                assert!(
                    matches!(
                        e,
                        Error::InvalidArgument {
                            name: "import_buffer",
                            ..
                        }
                    ),
                    "{e:?}"
                );
                continue;
            }
        };
        let _rx = bus.subscribe_stream("a/b").unwrap();
        let start = Instant::now();
        while bridge.stats().upstream_subscriptions == 0 && start.elapsed() < Duration::from_secs(3)
        {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        let n = bridge.stats().upstream_subscriptions;
        limit(bridge.close()).await.unwrap();
        assert_eq!(
            n, 1,
            "import_buffer {buffer}: the local subscriber got no upstream subscription"
        );
    }
}

/// A zero reconnect backoff is refused (accepted, it reconnected in a tight
/// loop: 824 connections in one second).
#[cfg(feature = "mqtt")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bridge_zero_backoff_does_not_storm() {
    use blazesub::bridge::Bridge;
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    let accepted = Arc::new(AtomicUsize::new(0));
    let a = Arc::clone(&accepted);
    listener.set_nonblocking(true).unwrap();
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let st = Arc::clone(&stop);
    let server = std::thread::spawn(move || {
        while !st.load(Ordering::SeqCst) {
            match listener.accept() {
                Ok((s, _)) => {
                    a.fetch_add(1, Ordering::SeqCst);
                    drop(s); // a broker that hangs up at once
                }
                Err(_) => std::thread::sleep(Duration::from_micros(100)),
            }
        }
    });
    let bus = Bus::<bytes::Bytes>::builder()
        .delivery(DeliveryMode::Inline)
        .build()
        .unwrap();
    let r = Bridge::builder(&bus)
        .mqtt(format!("mqtt://127.0.0.1:{port}"))
        .export("a/#")
        .reconnect_backoff(Duration::ZERO, Duration::ZERO)
        .start()
        .await;
    let attempts = match r {
        Ok(bridge) => {
            tokio::time::sleep(Duration::from_secs(1)).await;
            let n = accepted.load(Ordering::SeqCst);
            limit(bridge.close()).await.unwrap();
            n
        }
        Err(e) => {
            assert!(matches!(e, Error::InvalidArgument { .. }), "{e:?}");
            0
        }
    };
    stop.store(true, Ordering::SeqCst);
    server.join().unwrap();
    assert!(
        attempts <= 100,
        "reconnect_backoff(0, 0) accepted: {attempts} connections in one second"
    );
}

/// `reconnect_backoff(Duration::MAX, Duration::MAX)` and a session expiry at
/// the extremes: `start` neither panics nor refuses, and `close` ends. (A
/// zero or inverted backoff is refused: `bridge_zero_backoff_does_not_storm`
/// and `an_inverted_backoff_is_refused`.)
#[cfg(feature = "mqtt")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bridge_duration_extremes_start_and_close() {
    use blazesub::bridge::Bridge;
    for (min, max, session) in [
        (Duration::MAX, Duration::MAX, Duration::MAX),
        (Duration::from_nanos(1), Duration::MAX, Duration::ZERO),
        (
            Duration::from_secs(5),
            Duration::from_secs(5),
            Duration::from_nanos(1),
        ),
    ] {
        let bus = Bus::<bytes::Bytes>::builder()
            .delivery(DeliveryMode::Inline)
            .build()
            .unwrap();
        let bridge = limit(
            Bridge::builder(&bus)
                .mqtt("mqtt://127.0.0.1:1")
                .export("a/#")
                .import("b/#")
                .reconnect_backoff(min, max)
                .at_least_once(session)
                .name("review-config")
                .start(),
        )
        .await
        .unwrap();
        tokio::time::sleep(Duration::from_millis(100)).await;
        bus.publish("a/x", bytes::Bytes::from_static(b"1")).unwrap();
        limit(bridge.close()).await.unwrap();
        limit(bus.close()).await.unwrap();
    }
}

#[cfg(feature = "mqtt")]
#[tokio::test]
async fn bridge_names_and_filters_are_checked() {
    use blazesub::bridge::Bridge;
    let bus = Bus::<bytes::Bytes>::builder()
        .delivery(DeliveryMode::Inline)
        .build()
        .unwrap();
    for name in ["", " leading", "x".repeat(70_000).as_str(), "nul\0"] {
        let r = limit(
            Bridge::builder(&bus)
                .mqtt("mqtt://127.0.0.1:1")
                .export("a/#")
                .name(name)
                .start(),
        )
        .await;
        match r {
            Ok(b) => limit(b.close()).await.unwrap(),
            Err(e) => assert!(
                matches!(e, Error::InvalidArgument { .. } | Error::Bridge { .. }),
                "{e:?}"
            ),
        }
    }
    for url in [
        "mqtt://",
        "mqtt://:",
        "mqtt://h:99999",
        "mqtt://[::1]",
        "nats://x",
        "",
    ] {
        let r = limit(Bridge::builder(&bus).mqtt(url).export("a").start()).await;
        if let Ok(b) = r {
            limit(b.close()).await.unwrap();
        }
    }
}

#[cfg(feature = "mqtt")]
#[tokio::test]
async fn an_inverted_backoff_is_refused() {
    use blazesub::bridge::Bridge;
    let bus = Bus::<bytes::Bytes>::builder()
        .delivery(DeliveryMode::Inline)
        .build()
        .unwrap();
    let started = Bridge::builder(&bus)
        .mqtt("mqtt://127.0.0.1:1")
        .export("a/#")
        .reconnect_backoff(Duration::from_secs(5), Duration::from_millis(1))
        .start()
        .await;
    assert!(
        matches!(
            started,
            Err(blazesub::Error::InvalidArgument {
                name: "reconnect_backoff",
                ..
            })
        ),
        "{started:?}"
    );
}
