//! Request/reply (issue 9, DESIGN.md §7) through the public API, in every
//! delivery mode: no responder, a slow responder, many responders, a
//! load-balanced service on a shared subscription, cancellation; the reply
//! subscription is gone whenever the request ends. Every await runs under
//! `tokio::time::timeout`, so a bug fails instead of hanging.

mod common;

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use blazesub::{Bus, DeliveryMode, Error, Message};
use common::{runtime, wait_until, MODES};

const LIMIT: Duration = Duration::from_secs(20);

fn bus_on(mode: DeliveryMode, rt: &tokio::runtime::Runtime) -> Bus<u64> {
    Bus::<u64>::builder()
        .delivery(mode)
        .workers(2)
        .runtime(rt.handle().clone())
        .build()
        .unwrap()
}

/// A responder answering `data * 2`.
fn doubler(bus: &Bus<u64>, filter: &str) -> blazesub::Subscription {
    let responder = bus.clone();
    bus.subscribe(filter, move |m: &Message<u64>| {
        responder.reply(m, *m.data() * 2).unwrap();
    })
    .unwrap()
}

#[test]
fn a_request_gets_its_reply_and_leaves_nothing_subscribed() {
    for mode in MODES {
        let rt = runtime(2);
        let bus = bus_on(mode, &rt);
        let _service = doubler(&bus, "rpc/double");
        let mut spy = bus.subscribe_stream("#").unwrap();
        let before = bus.subscriptions_count();
        rt.block_on(async {
            for i in 0..50 {
                let reply = tokio::time::timeout(
                    LIMIT,
                    bus.request("rpc/double", i, Duration::from_secs(5)),
                )
                .await
                .unwrap()
                .unwrap();
                assert_eq!(*reply.data(), i * 2, "{mode:?}");
                assert!(reply.topic().starts_with("$reply/"), "{}", reply.topic());
            }
        });
        assert_eq!(bus.subscriptions_count(), before, "{mode:?}");
        // `#` saw the 50 requests, never a reply.
        let seen: Vec<String> = std::iter::from_fn(|| spy.try_recv().ok())
            .map(|m| m.topic().to_owned())
            .collect();
        assert_eq!(seen.len(), 50, "{mode:?}");
        assert!(seen.iter().all(|t| t == "rpc/double"));
        assert_eq!(bus.stats().late_replies, 0);
    }
}

#[test]
fn no_responder_fails_at_once() {
    for mode in MODES {
        let rt = runtime(2);
        let bus = bus_on(mode, &rt);
        let _elsewhere = doubler(&bus, "rpc/other");
        let before = bus.subscriptions_count();
        let started = Instant::now();
        let result = rt.block_on(async {
            tokio::time::timeout(LIMIT, bus.request("rpc/nobody", 1, Duration::from_secs(10))).await
        });
        assert!(
            matches!(result.unwrap(), Err(Error::NoResponders { ref topic }) if topic == "rpc/nobody"),
            "{mode:?}"
        );
        assert!(
            started.elapsed() < Duration::from_secs(5),
            "{mode:?}: it waited"
        );
        assert_eq!(bus.subscriptions_count(), before, "{mode:?}");
    }
}

#[test]
fn a_slow_responder_times_out_and_its_late_reply_is_counted() {
    for mode in MODES {
        let rt = runtime(2);
        let bus = bus_on(mode, &rt);
        let responder = bus.clone();
        let (answered, done) = std::sync::mpsc::channel();
        let _slow = bus
            .subscribe_async("rpc/slow", move |m: Arc<Message<u64>>| {
                let responder = responder.clone();
                let answered = answered.clone();
                async move {
                    tokio::time::sleep(Duration::from_millis(300)).await;
                    answered.send(responder.reply(&m, 1).unwrap()).unwrap();
                }
            })
            .unwrap();
        let before = bus.subscriptions_count();
        let started = Instant::now();
        let result = rt.block_on(async {
            tokio::time::timeout(LIMIT, bus.request("rpc/slow", 1, Duration::from_millis(50))).await
        });
        let waited = started.elapsed();
        match result.unwrap() {
            Err(Error::Timeout { topic, waited }) => {
                assert_eq!(topic, "rpc/slow");
                assert_eq!(waited, Duration::from_millis(50));
            }
            other => panic!("{mode:?}: expected a timeout, got {other:?}"),
        }
        assert!(waited >= Duration::from_millis(50), "{mode:?}: {waited:?}");
        assert!(waited < Duration::from_millis(290), "{mode:?}: {waited:?}");
        assert_eq!(bus.subscriptions_count(), before, "{mode:?}");
        // The reply comes after the request ended: it reaches nobody.
        assert_eq!(done.recv_timeout(LIMIT).unwrap(), 0, "{mode:?}");
        assert_eq!(bus.stats().late_replies, 1, "{mode:?}");
    }
}

#[test]
fn many_responders() {
    for mode in MODES {
        let rt = runtime(2);
        let bus = bus_on(mode, &rt);
        let services: Vec<_> = ["a", "b", "c"]
            .iter()
            .map(|name| doubler(&bus, &format!("health/{name}")))
            .collect();
        let _everything = doubler(&bus, "health/#");
        let before = bus.subscriptions_count();
        rt.block_on(async {
            // To a filter: every subscription it overlaps answers.
            let all = tokio::time::timeout(
                LIMIT,
                bus.request_many("health/+", 1, Duration::from_millis(300), 10),
            )
            .await
            .unwrap()
            .unwrap();
            assert_eq!(all.len(), 4, "{mode:?}");
            // Returns as soon as `max` came.
            let started = Instant::now();
            let two = tokio::time::timeout(
                LIMIT,
                bus.request_many("health/a", 1, Duration::from_secs(10), 2),
            )
            .await
            .unwrap()
            .unwrap();
            assert_eq!(two.len(), 2, "{mode:?}");
            assert!(started.elapsed() < Duration::from_secs(5));
            // `request` takes the first; the others are counted.
            let one =
                tokio::time::timeout(LIMIT, bus.request("health/b", 21, Duration::from_secs(10)))
                    .await
                    .unwrap()
                    .unwrap();
            assert_eq!(*one.data(), 42);
        });
        assert!(wait_until(LIMIT, || bus.inflight_messages() == 0));
        let stats = bus.stats();
        assert_eq!(
            stats.dropped + stats.late_replies,
            1,
            "{mode:?}: the second reply to `request`: {stats:?}"
        );
        assert_eq!(bus.subscriptions_count(), before, "{mode:?}");
        assert!(matches!(
            rt.block_on(bus.request_many("health/a", 1, Duration::from_secs(1), 0)),
            Err(Error::InvalidArgument { name: "max", .. })
        ));
        drop(services);
    }
}

/// `max` is an upper bound, not a size: `usize::MAX` ("as many as come")
/// panicked with "capacity overflow", and `1 << 40` aborted the process,
/// when the reply mailbox was allocated at `max` replies.
#[test]
fn request_many_without_a_practical_limit_takes_all_that_come() {
    for mode in MODES {
        let rt = runtime(2);
        let bus = bus_on(mode, &rt);
        let _services: Vec<_> = ["a", "b", "c"]
            .iter()
            .map(|name| doubler(&bus, &format!("health/{name}")))
            .collect();
        for max in [usize::MAX, 1 << 40, 1 << 20] {
            let all = rt
                .block_on(async {
                    tokio::time::timeout(
                        LIMIT,
                        bus.request_many("health/+", 1, Duration::from_millis(100), max),
                    )
                    .await
                })
                .unwrap()
                .unwrap();
            assert_eq!(all.len(), 3, "{mode:?}, max {max}");
        }
        assert_eq!(bus.stats().dropped, 0, "{mode:?}");
    }
}

/// The bound on replies queued at once (4,096, documented on
/// `request_many`): `Inline` responders all answer inside the publish,
/// before the request takes any, so those beyond it are refused (the first
/// replies are kept), counted in `Stats::dropped` as for any full mailbox.
#[test]
fn request_many_queues_at_most_4096_replies_at_once() {
    let bus = Bus::<u64>::builder()
        .delivery(DeliveryMode::Inline)
        .build()
        .unwrap();
    let _services: Vec<_> = (0..4_100).map(|_| doubler(&bus, "svc")).collect();
    let all = common::block_on(bus.request_many("svc", 1, Duration::from_millis(50), usize::MAX))
        .unwrap();
    assert_eq!(all.len(), 4_096);
    assert_eq!(bus.stats().dropped, 4);
}

#[test]
fn a_cancelled_request_leaves_nothing_subscribed() {
    for mode in MODES {
        let rt = runtime(2);
        let bus = bus_on(mode, &rt);
        let responder = bus.clone();
        let _slow = bus
            .subscribe_async("rpc/slow", move |m: Arc<Message<u64>>| {
                let responder = responder.clone();
                async move {
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    let _ = responder.reply(&m, 1);
                }
            })
            .unwrap();
        let before = bus.subscriptions_count();
        rt.block_on(async {
            // The caller gives up first: the request future is dropped.
            let gave_up = tokio::time::timeout(
                Duration::from_millis(20),
                bus.request("rpc/slow", 1, Duration::from_secs(60)),
            )
            .await;
            assert!(gave_up.is_err(), "{mode:?}");
            assert_eq!(bus.subscriptions_count(), before, "{mode:?}");
            // And a future dropped before it was ever polled.
            drop(bus.request("rpc/slow", 2, Duration::from_secs(60)));
            assert_eq!(bus.subscriptions_count(), before, "{mode:?}");
        });
        assert!(wait_until(LIMIT, || bus.stats().late_replies == 1));
        assert!(wait_until(LIMIT, || bus.inflight_messages() == 0));
        assert_eq!(bus.subscriptions_count(), before);
    }
}

/// A request to a shared subscription reaches one member: the members
/// form a load-balanced service.
#[test]
fn a_shared_subscription_is_a_load_balanced_service() {
    for mode in MODES {
        let rt = runtime(2);
        let bus = bus_on(mode, &rt);
        let workers: Vec<_> = (1..=3u64)
            .map(|id| {
                let responder = bus.clone();
                bus.subscribe("$share/pricing/rpc/price/+", move |m: &Message<u64>| {
                    responder.reply(m, id).unwrap();
                })
                .unwrap()
            })
            .collect();
        let answered_by = rt.block_on(async {
            let mut by = BTreeMap::new();
            for i in 0..90 {
                let reply = tokio::time::timeout(
                    LIMIT,
                    bus.request(&format!("rpc/price/{}", i % 5), i, Duration::from_secs(5)),
                )
                .await
                .unwrap()
                .unwrap();
                *by.entry(*reply.data()).or_insert(0) += 1;
            }
            by
        });
        assert_eq!(answered_by.values().sum::<u32>(), 90, "{mode:?}");
        assert_eq!(
            answered_by.len(),
            3,
            "{mode:?}: every member served: {answered_by:?}"
        );
        assert_eq!(bus.subscriptions_count(), 3);
        drop(workers);
    }
}

#[test]
fn replying_to_a_message_that_is_not_a_request_is_an_error() {
    let bus = Bus::<u64>::builder()
        .delivery(DeliveryMode::Inline)
        .build()
        .unwrap();
    let target = bus.clone();
    let (tx, rx) = std::sync::mpsc::channel();
    let _sub = bus
        .subscribe("plain", move |m: &Message<u64>| {
            assert!(m.reply_to().is_none());
            tx.send(target.reply(m, 1)).unwrap();
        })
        .unwrap();
    bus.publish("plain", 1).unwrap();
    assert!(matches!(
        rx.recv_timeout(LIMIT).unwrap(),
        Err(Error::NotARequest { topic }) if topic == "plain"
    ));
    let rt = runtime(1);
    assert!(matches!(
        rt.block_on(bus.request("bad/#/topic", 1, Duration::from_secs(1))),
        Err(Error::Topic(_))
    ));
}

#[test]
fn requests_work_without_a_runtime_timer() {
    // A bus built outside any runtime, a request driven by a bare executor
    // (a current-thread runtime without the time driver).
    let bus = Bus::<u64>::builder()
        .delivery(DeliveryMode::WorkerPool)
        .build()
        .unwrap();
    let rt = tokio::runtime::Builder::new_current_thread()
        .build()
        .unwrap();
    let _responder = doubler(&bus, "rpc/d");
    let reply = rt.block_on(bus.request("rpc/d", 4, Duration::from_secs(5)));
    assert_eq!(*reply.unwrap().data(), 8);
    let quiet = bus.subscribe("rpc/quiet", |_: &Message<u64>| {}).unwrap();
    let started = Instant::now();
    let timed_out = rt.block_on(bus.request("rpc/quiet", 4, Duration::from_millis(30)));
    assert!(matches!(timed_out, Err(Error::Timeout { .. })));
    assert!(started.elapsed() >= Duration::from_millis(30));
    drop(quiet);
}

/// A request to a topic or filter under `$reply/` is refused: it would
/// reach the requests' own reply streams (its own first: with no responder
/// it returned its own request as the reply; `$reply/+/+` handed 666 to
/// another waiting request as that one's reply). Found by the
/// thirty-second session's review.
#[test]
fn a_request_under_reply_is_refused_and_reaches_no_other_request() {
    for mode in MODES {
        let rt = runtime(2);
        let bus = Bus::<u64>::builder()
            .delivery(mode)
            .runtime(rt.handle().clone())
            .build()
            .unwrap();
        rt.block_on(async {
            for topic in ["$reply/#", "$reply/+/+", "$reply/1/2", "$reply"] {
                let refused = bus.request(topic, 7, Duration::from_millis(300)).await;
                assert!(
                    matches!(refused, Err(Error::InvalidArgument { name: "topic", .. })),
                    "{mode:?} {topic}: {:?}",
                    refused.map(|m| *m.data())
                );
            }
            let _silent = bus.subscribe("rpc/slow", |_: &Message<u64>| {}).unwrap();
            let waiting = tokio::spawn({
                let bus = bus.clone();
                async move { bus.request("rpc/slow", 1, Duration::from_millis(300)).await }
            });
            tokio::time::sleep(Duration::from_millis(50)).await;
            let many = bus
                .request_many("$reply/+/+", 666, Duration::from_millis(50), 10)
                .await;
            assert!(
                matches!(many, Err(Error::InvalidArgument { .. })),
                "{mode:?}"
            );
            let theirs = waiting.await.unwrap();
            assert!(
                matches!(theirs, Err(Error::Timeout { .. })),
                "{mode:?}: nobody replied, yet {:?}",
                theirs.map(|m| *m.data())
            );
        });
    }
}

/// A request waiting when `close()` is called ends with `Error::Closed`
/// then: no reply can come any more (`reply` is refused from that moment),
/// even while another delivery keeps the bus from draining. Found by the
/// thirty-second session's review: it waited out its own timeout and
/// returned `Timeout` (about 1.95 s after `close` for a 2 s request).
#[test]
fn a_request_waiting_when_the_bus_closes_ends_with_closed() {
    for mode in MODES {
        let rt = runtime(2);
        let bus = Bus::<u64>::builder()
            .delivery(mode)
            .workers(2)
            .close_timeout(Duration::from_millis(300))
            .runtime(rt.handle().clone())
            .build()
            .unwrap();
        // Keeps the bus from draining (and `close` from finishing).
        let gate = Arc::new(common::Gate::new());
        let _stuck = {
            let gate = Arc::clone(&gate);
            bus.subscribe("stuck", move |_: &Message<u64>| gate.wait())
                .unwrap()
        };
        let stuck = {
            let bus = bus.clone();
            std::thread::spawn(move || bus.publish("stuck", 0))
        };
        assert!(wait_until(Duration::from_secs(30), || bus
            .inflight_messages()
            == 1));
        // A responder that never answers.
        let _silent = bus.subscribe("rpc/x", |_: &Message<u64>| {}).unwrap();
        let (closed, got) = rt.block_on(async {
            let request = tokio::spawn({
                let bus = bus.clone();
                // Far longer than the test's limit: only the close ends it.
                async move { bus.request("rpc/x", 1, Duration::from_secs(600)).await }
            });
            tokio::time::sleep(Duration::from_millis(20)).await;
            let closed = bus.close().await;
            let got = tokio::time::timeout(Duration::from_secs(30), request)
                .await
                .expect("the request still waited 30 s after close")
                .unwrap();
            (closed, got.map(|m| *m.data()))
        });
        gate.open();
        stuck.join().unwrap().unwrap();
        assert!(
            matches!(closed, Err(Error::CloseTimeout { .. })),
            "{mode:?}: {closed:?}"
        );
        assert!(matches!(got, Err(Error::Closed)), "{mode:?}: {got:?}");
    }
}
