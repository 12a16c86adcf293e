//! Delivery contracts per subscription (DESIGN.md §9), through the public
//! API in every delivery mode: stream overflow policies, lossless streams
//! with backpressure (all or nothing, cancel-safe, fair, released by a
//! dropped reader), disconnect, and interest queries. Every wait is under a
//! time limit, so a bug fails instead of hanging.

mod common;

use std::collections::HashMap;
use std::future::Future;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use blazesub::{Bus, DeliveryMode, Error, Receiver, RecvError, StreamOptions, StreamOverflow};
use common::MODES;

const LIMIT: Duration = Duration::from_secs(20);

fn bus(mode: DeliveryMode) -> Bus<u32> {
    Bus::<u32>::builder()
        .delivery(mode)
        .workers(2)
        .build()
        .unwrap()
}

fn options(capacity: usize, overflow: StreamOverflow) -> StreamOptions {
    StreamOptions::new(capacity).overflow(overflow)
}

async fn next(rx: &mut Receiver<u32>) -> Result<u32, RecvError> {
    tokio::time::timeout(LIMIT, rx.recv_lagged())
        .await
        .expect("recv_lagged hangs")
        .map(|m| *m.data())
}

async fn quiet(bus: &Bus<u32>) {
    tokio::time::timeout(LIMIT, async {
        while bus.inflight_messages() > 0 {
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
    })
    .await
    .expect("deliveries stuck in flight");
}

// ---------------------------------------------------------------------------
// 1. Overflow policies, each counted and visible in the stream.
// ---------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn drop_newest_keeps_the_queued_messages_and_reports_the_loss() {
    for mode in MODES {
        let bus = bus(mode);
        let mut rx = bus
            .subscribe_stream_with("t", options(3, StreamOverflow::DropNewest))
            .unwrap();
        for value in 0..5 {
            assert_eq!(bus.publish("t", value).unwrap(), 1);
        }
        assert_eq!(rx.lost(), 2, "{mode:?}");
        assert_eq!(next(&mut rx).await, Err(RecvError::Lagged(2)), "{mode:?}");
        for expected in 0..3 {
            assert_eq!(next(&mut rx).await, Ok(expected), "{mode:?}");
        }
        let stats = bus.stats();
        assert_eq!((stats.delivered, stats.dropped), (3, 2), "{mode:?}");
        bus.close().await.unwrap();
        assert_eq!(next(&mut rx).await, Err(RecvError::Closed), "{mode:?}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn disconnect_hands_over_what_it_held_then_says_why() {
    for mode in MODES {
        let bus = bus(mode);
        let mut cut = bus
            .subscribe_stream_with("t", options(2, StreamOverflow::Disconnect))
            .unwrap();
        let mut plain = bus
            .subscribe_stream_with("t", options(2, StreamOverflow::Disconnect))
            .unwrap();
        for value in 0..3 {
            bus.publish("t", value).unwrap();
        }
        // After the cut, publishes skip it.
        assert_eq!(bus.publish("t", 9).unwrap(), 0, "{mode:?}");
        assert_eq!(next(&mut cut).await, Err(RecvError::Lagged(1)), "{mode:?}");
        assert_eq!(next(&mut cut).await, Ok(0));
        assert_eq!(next(&mut cut).await, Ok(1));
        assert_eq!(
            next(&mut cut).await,
            Err(RecvError::Disconnected),
            "{mode:?}"
        );
        assert_eq!(
            next(&mut cut).await,
            Err(RecvError::Disconnected),
            "{mode:?}"
        );
        // The simple loop ends after what it held.
        let mut seen = Vec::new();
        while let Some(m) = tokio::time::timeout(LIMIT, plain.recv()).await.unwrap() {
            seen.push(*m.data());
        }
        assert_eq!(seen, [0, 1], "{mode:?}");
        let stats = bus.stats();
        assert_eq!(stats.disconnects, 2, "{mode:?}: {stats:?}");
        assert_eq!(stats.dropped, 2, "{mode:?}: {stats:?}");
    }
}

// ---------------------------------------------------------------------------
// 2. Lossless streams.
// ---------------------------------------------------------------------------

/// A full lossless mailbox makes `publish` fail and reach no one at all:
/// not the handler, not the other streams; nothing is counted as published
/// or dropped. Once there is room, it goes through.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_lossless_mailbox_refuses_the_whole_publish() {
    for mode in MODES {
        let bus = bus(mode);
        let handled = Arc::new(AtomicU64::new(0));
        let counter = Arc::clone(&handled);
        let _h = bus
            .subscribe("t", move |_| {
                counter.fetch_add(1, Ordering::SeqCst);
            })
            .unwrap();
        let mut other = bus.subscribe_stream("t").unwrap();
        let mut lossless = bus
            .subscribe_stream_with("t", options(2, StreamOverflow::Backpressure))
            .unwrap();
        assert_eq!(bus.publish("t", 1).unwrap(), 3);
        assert_eq!(bus.publish("t", 2).unwrap(), 3);
        let full = bus.publish("t", 3);
        assert!(
            matches!(&full, Err(Error::Full { topic, capacity: 2 }) if topic == "t"),
            "{mode:?}: {full:?}"
        );
        let refused = bus.try_publish("t", 3).unwrap_err();
        assert_eq!(refused.value, Some(3), "the value comes back");
        quiet(&bus).await;
        assert_eq!(handled.load(Ordering::SeqCst), 2, "{mode:?}");
        assert_eq!(other.len(), 2, "{mode:?}");
        let stats = bus.stats();
        assert_eq!((stats.published, stats.dropped), (2, 0), "{mode:?}");
        assert_eq!(next(&mut lossless).await, Ok(1));
        assert_eq!(bus.publish("t", 3).unwrap(), 3, "{mode:?}: room again");
        quiet(&bus).await;
        assert_eq!(handled.load(Ordering::SeqCst), 3);
        assert_eq!(next(&mut other).await, Ok(1));
        assert_eq!(lossless.lost(), 0);
    }
}

/// A publish refused because one lossless mailbox is full gives back the
/// room it took in the others first: they stay usable.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_publish_gives_back_the_room_it_took() {
    for mode in MODES {
        let bus = bus(mode);
        // Walked first: `y/#` has room, `y/b` (below) is filled.
        let mut wide = bus
            .subscribe_stream_with("y/#", options(1, StreamOverflow::Backpressure))
            .unwrap();
        let mut narrow = bus
            .subscribe_stream_with("y/b", options(1, StreamOverflow::Backpressure))
            .unwrap();
        bus.publish("y/b", 1).unwrap();
        assert_eq!(next(&mut wide).await, Ok(1));
        for _ in 0..3 {
            assert!(
                matches!(bus.publish("y/b", 2), Err(Error::Full { capacity: 1, .. })),
                "{mode:?}"
            );
        }
        // Still one slot in `y/#`: a publish only it receives fits.
        assert_eq!(bus.publish("y/a", 3).unwrap(), 1, "{mode:?}");
        assert_eq!(next(&mut wide).await, Ok(3));
        assert_eq!(next(&mut narrow).await, Ok(1));
        assert!(wide.is_empty() && narrow.is_empty(), "{mode:?}");
    }
}

/// Four publishers use `publish_async` into 16 lossless streams read at
/// different speeds: every message arrives exactly once, in per-publisher
/// order, and nothing is lost.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lossless_streams_under_four_racing_publishers_lose_nothing() {
    const PUBLISHERS: u32 = 4;
    const PER_PUBLISHER: u32 = 300;
    const STREAMS: usize = 16;
    for mode in MODES {
        let bus = bus(mode);
        let readers: Vec<_> = (0..STREAMS)
            .map(|index| {
                let mut rx = bus
                    .subscribe_stream_with("race/+", options(4, StreamOverflow::Backpressure))
                    .unwrap();
                tokio::spawn(async move {
                    let mut last: HashMap<String, u32> = HashMap::new();
                    let mut count = 0u32;
                    while count < PUBLISHERS * PER_PUBLISHER {
                        let m = tokio::time::timeout(LIMIT, rx.recv())
                            .await
                            .expect("a lossless reader starved")
                            .expect("stream ended early");
                        let seq = *m.data();
                        if let Some(previous) = last.insert(m.topic().to_owned(), seq) {
                            assert_eq!(seq, previous + 1, "order or a gap on {}", m.topic());
                        } else {
                            assert_eq!(seq, 0, "first message of {}", m.topic());
                        }
                        count += 1;
                        if index % 4 == 0 && count % 16 == 0 {
                            tokio::time::sleep(Duration::from_millis(1)).await;
                        }
                    }
                    (count, rx.lost())
                })
            })
            .collect();
        let publishers: Vec<_> = (0..PUBLISHERS)
            .map(|p| {
                let bus = bus.clone();
                tokio::spawn(async move {
                    let topic = format!("race/{p}");
                    for seq in 0..PER_PUBLISHER {
                        let reached = bus.publish_async(&topic, seq).await.unwrap();
                        assert_eq!(reached, STREAMS);
                    }
                })
            })
            .collect();
        for publisher in publishers {
            tokio::time::timeout(LIMIT, publisher)
                .await
                .unwrap()
                .unwrap();
        }
        for reader in readers {
            let (count, lost) = tokio::time::timeout(LIMIT, reader).await.unwrap().unwrap();
            assert_eq!((count, lost), (PUBLISHERS * PER_PUBLISHER, 0), "{mode:?}");
        }
        assert_eq!(bus.stats().dropped, 0, "{mode:?}");
    }
}

/// A `publish_async` cancelled while it waits (here by a timeout) has
/// delivered nothing and holds no room: it had reserved room in mailbox A
/// and was waiting for B.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cancelled_publish_async_delivers_nothing_and_holds_no_room() {
    for mode in MODES {
        let bus = bus(mode);
        let mut a = bus
            .subscribe_stream_with("x/#", options(1, StreamOverflow::Backpressure))
            .unwrap();
        let mut b = bus
            .subscribe_stream_with("x/b", options(1, StreamOverflow::Backpressure))
            .unwrap();
        // Fill B only: publish to x/b reaches both, so empty A afterwards.
        bus.publish("x/b", 1).unwrap();
        assert_eq!(next(&mut a).await, Ok(1));
        // A has room, B is full: publish_async reserves A and waits for B.
        let waited =
            tokio::time::timeout(Duration::from_millis(50), bus.publish_async("x/b", 2)).await;
        assert!(waited.is_err(), "{mode:?}: it should still be waiting");
        assert!(a.is_empty(), "{mode:?}: nothing delivered");
        // A's room was given back: a publish that reaches only A fits.
        assert_eq!(bus.publish("x/a", 3).unwrap(), 1, "{mode:?}");
        assert_eq!(next(&mut a).await, Ok(3));
        assert_eq!(next(&mut b).await, Ok(1));
        assert!(b.is_empty(), "{mode:?}");
    }
}

/// Dropping a full lossless receiver releases the publishers waiting on it
/// at once; they deliver to everyone else.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dropping_a_full_lossless_receiver_releases_waiting_publishers() {
    for mode in MODES {
        let bus = bus(mode);
        let full = bus
            .subscribe_stream_with("t", options(1, StreamOverflow::Backpressure))
            .unwrap();
        let mut witness = bus.subscribe_stream("t").unwrap();
        bus.publish("t", 1).unwrap();
        let waiting = {
            let bus = bus.clone();
            tokio::spawn(async move { bus.publish_async("t", 2).await })
        };
        tokio::time::sleep(Duration::from_millis(30)).await;
        assert!(!waiting.is_finished(), "{mode:?}: it should wait for room");
        drop(full);
        let reached = tokio::time::timeout(LIMIT, waiting).await.unwrap().unwrap();
        assert_eq!(reached.unwrap(), 1, "{mode:?}: only the witness is left");
        assert_eq!(next(&mut witness).await, Ok(1));
        assert_eq!(next(&mut witness).await, Ok(2));
        // With no lossless stream left, publish never refuses.
        for value in 0..10 {
            bus.publish("t", value).unwrap();
        }
    }
}

/// A fast publisher cannot starve one that waits: with one slot and two
/// publishers taking turns at a slow reader, both make progress.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn waiting_publishers_are_served_in_turn() {
    let bus = bus(DeliveryMode::WorkerPool);
    let mut rx = bus
        .subscribe_stream_with("fair/+", options(1, StreamOverflow::Backpressure))
        .unwrap();
    let publisher = |name: &'static str| {
        let bus = bus.clone();
        tokio::spawn(async move {
            for seq in 0..50 {
                bus.publish_async(&format!("fair/{name}"), seq)
                    .await
                    .unwrap();
            }
        })
    };
    let (fast, slow) = (publisher("fast"), publisher("slow"));
    let mut order = Vec::new();
    for _ in 0..100 {
        let m = tokio::time::timeout(LIMIT, rx.recv())
            .await
            .unwrap()
            .unwrap();
        order.push(m.topic() == "fair/fast");
        tokio::time::sleep(Duration::from_micros(200)).await;
    }
    fast.await.unwrap();
    slow.await.unwrap();
    // In the first half of what arrived, both publishers are well represented.
    let fast_in_first_half = order[..50].iter().filter(|&&fast| fast).count();
    assert!(
        (10..=40).contains(&fast_in_first_half),
        "one publisher starved the other: {fast_in_first_half} of the first 50 were from one"
    );
}

// ---------------------------------------------------------------------------
// 5. Interest queries.
// ---------------------------------------------------------------------------

#[test]
fn interest_queries_follow_subscriptions() {
    for mode in [DeliveryMode::Inline, DeliveryMode::WorkerPool] {
        let bus = bus(mode);
        assert!(!bus.has_subscribers("s/a/temp"));
        assert_eq!(bus.subscribers("s/a/temp"), 0);
        let a = bus.subscribe("s/+/temp", |_| {}).unwrap();
        let b = bus.subscribe_stream("s/#").unwrap();
        let _c = bus.subscribe("other", |_| {}).unwrap();
        assert!(bus.has_subscribers("s/a/temp"));
        assert_eq!(bus.subscribers("s/a/temp"), 2);
        assert_eq!(bus.subscribers("s/a/humidity"), 1);
        assert_eq!(bus.publish("s/a/temp", 1).unwrap(), 2);
        drop(a);
        assert_eq!(bus.subscribers("s/a/temp"), 1, "{mode:?}");
        drop(b);
        assert!(!bus.has_subscribers("s/a/temp"), "{mode:?}");
        // Not a topic name: nobody could receive it.
        assert!(!bus.has_subscribers("s/+/temp"));
        assert_eq!(bus.subscribers(""), 0);
    }
}

/// A shared group reaches a publish as one subscription, and the interest
/// queries count it so, whatever its members: a producer that asks first
/// must not skip work meant for a pool of shared workers. (The queries read
/// only the subscription trie, which shared members are not in.)
#[test]
fn interest_queries_count_shared_groups_as_publish_does() {
    for mode in [DeliveryMode::Inline, DeliveryMode::WorkerPool] {
        let bus = bus(mode);
        let a = bus.subscribe("$share/w/jobs/#", |_| {}).unwrap();
        let b = bus.subscribe_stream("$share/w/jobs/#").unwrap();
        assert!(bus.has_subscribers("jobs/a"), "{mode:?}");
        assert_eq!(bus.subscribers("jobs/a"), 1, "{mode:?}: one group");
        let _other = bus.subscribe_stream("$share/v/+/a").unwrap();
        let _plain = bus.subscribe("jobs/+", |_| {}).unwrap();
        assert_eq!(bus.subscribers("jobs/a"), 3, "{mode:?}");
        assert_eq!(bus.publish("jobs/a", 1).unwrap(), 3, "{mode:?}");
        assert_eq!(bus.subscribers("jobs/b"), 2, "{mode:?}");
        assert_eq!(bus.subscribers("other"), 0, "{mode:?}");
        drop((a, b));
        assert_eq!(bus.subscribers("jobs/b"), 1, "{mode:?}: the group is gone");
    }
}

// ---------------------------------------------------------------------------
// 4. Ordered handlers.
// ---------------------------------------------------------------------------

/// Two publisher threads, 2,000 messages each, into one ordered handler
/// that would notice an overlapping call (a flag it holds while running):
/// no overlap, and each publisher's messages in order with no gap. Every
/// mode; `close` waits for the last call.
#[test]
fn ordered_handler_calls_never_overlap_and_keep_publish_order() {
    use std::sync::atomic::AtomicBool;
    use std::sync::Mutex;
    const PER_PUBLISHER: u32 = 2_000;
    for mode in MODES {
        let rt = common::runtime(2);
        let bus = Bus::<u32>::builder()
            .delivery(mode)
            .workers(2)
            .stream_capacity(10_000)
            .runtime(rt.handle().clone())
            .build()
            .unwrap();
        let inside = Arc::new(AtomicBool::new(false));
        let overlaps = Arc::new(AtomicU64::new(0));
        let last: Arc<Mutex<HashMap<String, u32>>> = Arc::default();
        let calls = Arc::new(AtomicU64::new(0));
        let _ordered = {
            let (inside, overlaps, last, calls) = (
                Arc::clone(&inside),
                Arc::clone(&overlaps),
                Arc::clone(&last),
                Arc::clone(&calls),
            );
            bus.subscribe_ordered("o/+", move |m| {
                if inside.swap(true, Ordering::SeqCst) {
                    overlaps.fetch_add(1, Ordering::SeqCst);
                }
                let previous = last.lock().unwrap().insert(m.topic().to_owned(), *m.data());
                assert_eq!(
                    previous.map_or(0, |p| p + 1),
                    *m.data(),
                    "order on {}",
                    m.topic()
                );
                calls.fetch_add(1, Ordering::SeqCst);
                std::hint::spin_loop();
                inside.store(false, Ordering::SeqCst);
            })
            .unwrap()
        };
        let publishers: Vec<_> = (0..2)
            .map(|p| {
                let bus = bus.clone();
                std::thread::spawn(move || {
                    for seq in 0..PER_PUBLISHER {
                        bus.publish(&format!("o/{p}"), seq).unwrap();
                    }
                })
            })
            .collect();
        for publisher in publishers {
            publisher.join().unwrap();
        }
        rt.block_on(async { tokio::time::timeout(LIMIT, bus.close()).await })
            .expect("close hangs")
            .unwrap();
        assert_eq!(
            overlaps.load(Ordering::SeqCst),
            0,
            "{mode:?}: calls overlapped"
        );
        assert_eq!(
            calls.load(Ordering::SeqCst),
            2 * u64::from(PER_PUBLISHER),
            "{mode:?}"
        );
        let stats = bus.stats();
        assert_eq!(
            stats.delivered,
            2 * u64::from(PER_PUBLISHER),
            "{mode:?}: {stats:?}"
        );
        assert_eq!(stats.inflight, 0);
    }
}

/// A topic that several filters match, only some of them with ordered
/// subscriptions (the message has a position in some nodes' logs and none
/// in others): each ordered handler gets every message once, in order, and
/// the plain ones get every message. Every mode.
#[test]
fn ordered_handlers_among_several_matching_filters_get_every_message_in_order() {
    use std::sync::Mutex;
    const MESSAGES: u32 = 500;
    for mode in MODES {
        let rt = common::runtime(2);
        let bus = Bus::<u32>::builder()
            .delivery(mode)
            .workers(2)
            .stream_capacity(1_000)
            .runtime(rt.handle().clone())
            .build()
            .unwrap();
        let plain_calls = Arc::new(AtomicU64::new(0));
        let mut subs = Vec::new();
        for filter in ["#", "+/b", "a/#", "+/+"] {
            let calls = Arc::clone(&plain_calls);
            subs.push(
                bus.subscribe(filter, move |_| {
                    calls.fetch_add(1, Ordering::SeqCst);
                })
                .unwrap(),
            );
        }
        let seen: Vec<Arc<Mutex<Vec<u32>>>> = (0..2).map(|_| Arc::default()).collect();
        for (filter, seen) in ["a/+", "a/b"].into_iter().zip(&seen) {
            let seen = Arc::clone(seen);
            subs.push(
                bus.subscribe_ordered(filter, move |m| seen.lock().unwrap().push(*m.data()))
                    .unwrap(),
            );
        }
        for value in 0..MESSAGES {
            bus.publish("a/b", value).unwrap();
        }
        rt.block_on(async { tokio::time::timeout(LIMIT, bus.close()).await })
            .expect("close hangs")
            .unwrap();
        let expected: Vec<u32> = (0..MESSAGES).collect();
        for (filter, seen) in ["a/+", "a/b"].into_iter().zip(&seen) {
            assert_eq!(*seen.lock().unwrap(), expected, "{mode:?}: {filter}");
        }
        assert_eq!(
            plain_calls.load(Ordering::SeqCst),
            4 * u64::from(MESSAGES),
            "{mode:?}"
        );
    }
}

/// A slow ordered handler holds up only itself: another ordered
/// subscription and a plain one on the same topic get every message while
/// it is blocked; its own bounded queue drops (and counts) what does not
/// fit.
#[test]
fn a_slow_ordered_handler_holds_up_only_itself() {
    for mode in [DeliveryMode::WorkerPool, DeliveryMode::TaskPerSubscriber] {
        let rt = common::runtime(2);
        let bus = Bus::<u32>::builder()
            .delivery(mode)
            .workers(2)
            .stream_capacity(4)
            .runtime(rt.handle().clone())
            .build()
            .unwrap();
        let gate = Arc::new(common::Gate::new());
        let slow_calls = Arc::new(AtomicU64::new(0));
        let fast_calls = Arc::new(AtomicU64::new(0));
        let _slow = {
            let (gate, calls) = (Arc::clone(&gate), Arc::clone(&slow_calls));
            bus.subscribe_ordered("t", move |_| {
                gate.wait();
                calls.fetch_add(1, Ordering::SeqCst);
            })
            .unwrap()
        };
        let _fast = {
            let calls = Arc::clone(&fast_calls);
            bus.subscribe_ordered("t", move |_| {
                calls.fetch_add(1, Ordering::SeqCst);
            })
            .unwrap()
        };
        for value in 0..4 {
            bus.publish("t", value).unwrap();
        }
        assert!(
            common::wait_until(LIMIT, || fast_calls.load(Ordering::SeqCst) == 4),
            "{mode:?}: the fast ordered handler was held up"
        );
        // The slow one is in its call for 0, with 1..=3 taken into the
        // same batch or waiting in the log; 8 more (4 at a time, which the
        // fast one's log keeps), and the log keeps only the newest 4 of
        // everything it has not started: 0, what its batch had taken, and
        // those 4 run.
        for round in [4, 8] {
            for value in round..round + 4 {
                bus.publish("t", value).unwrap();
            }
            let fast = round as u64 + 4;
            assert!(
                common::wait_until(LIMIT, || fast_calls.load(Ordering::SeqCst) == fast),
                "{mode:?}: the fast ordered handler was held up: {} of {fast}, {:?}",
                fast_calls.load(Ordering::SeqCst),
                bus.stats()
            );
        }
        gate.open();
        assert!(
            common::wait_until(LIMIT, || bus.inflight_messages() == 0),
            "{mode:?}"
        );
        let stats = bus.stats();
        let slow = slow_calls.load(Ordering::SeqCst);
        assert!(
            (5..=8).contains(&slow),
            "{mode:?}: the bounded queue kept {slow} of 12"
        );
        assert_eq!(
            slow + stats.dropped,
            12,
            "{mode:?}: every message ran or was counted: {stats:?}"
        );
        assert_eq!(stats.delivered, 12 + slow, "{mode:?}");
    }
}

/// The async variant awaits each call before the next.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn async_ordered_handlers_await_each_call_in_order() {
    use std::sync::Mutex;
    for mode in MODES {
        let bus = bus(mode);
        let seen: Arc<Mutex<Vec<u32>>> = Arc::default();
        let _sub = {
            let seen = Arc::clone(&seen);
            bus.subscribe_ordered_async("a", move |m| {
                let seen = Arc::clone(&seen);
                async move {
                    tokio::task::yield_now().await;
                    seen.lock().unwrap().push(*m.data());
                }
            })
            .unwrap()
        };
        for value in 0..200 {
            bus.publish("a", value).unwrap();
        }
        tokio::time::timeout(LIMIT, bus.close())
            .await
            .unwrap()
            .unwrap();
        assert_eq!(
            *seen.lock().unwrap(),
            (0..200).collect::<Vec<_>>(),
            "{mode:?}"
        );
    }
}

/// Once its last ordered subscription is gone, a filter's ordered log lets
/// go of the messages it kept, though the filter still has subscribers.
#[test]
fn the_ordered_log_releases_its_messages_when_its_last_reader_leaves() {
    for mode in MODES {
        let rt = common::runtime(2);
        let bus = Bus::<Arc<()>>::builder()
            .delivery(mode)
            .workers(2)
            .runtime(rt.handle().clone())
            .build()
            .unwrap();
        let probe = Arc::new(());
        let _plain = bus.subscribe("t", |_| {}).unwrap();
        let ordered = bus.subscribe_ordered("t", |_| {}).unwrap();
        for _ in 0..10 {
            bus.publish("t", Arc::clone(&probe)).unwrap();
        }
        assert!(common::wait_until(LIMIT, || bus.inflight_messages() == 0));
        drop(ordered);
        // Other references (in-flight jobs) go as their runners finish.
        assert!(
            common::wait_until(LIMIT, || Arc::strong_count(&probe) == 1),
            "{mode:?}: {} references left",
            Arc::strong_count(&probe) - 1
        );
    }
}

/// `unsubscribe_and_wait` on an async ordered subscription waits for the
/// call in progress, as it does for every other handler.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unsubscribe_and_wait_waits_for_a_running_async_ordered_call() {
    for mode in MODES {
        let bus = bus(mode);
        let started = Arc::new(tokio::sync::Notify::new());
        let release = Arc::new(tokio::sync::Notify::new());
        let finished = Arc::new(AtomicU64::new(0));
        let sub = {
            let (started, release, finished) = (
                Arc::clone(&started),
                Arc::clone(&release),
                Arc::clone(&finished),
            );
            bus.subscribe_ordered_async("slow", move |_| {
                let (started, release, finished) = (
                    Arc::clone(&started),
                    Arc::clone(&release),
                    Arc::clone(&finished),
                );
                async move {
                    started.notify_one();
                    release.notified().await;
                    finished.fetch_add(1, Ordering::SeqCst);
                }
            })
            .unwrap()
        };
        bus.publish("slow", 1).unwrap();
        tokio::time::timeout(LIMIT, started.notified())
            .await
            .expect("the call started");
        let mut waiting = Box::pin(sub.unsubscribe_and_wait());
        let early = tokio::time::timeout(Duration::from_millis(100), waiting.as_mut()).await;
        assert!(early.is_err(), "{mode:?}: returned while the call ran");
        release.notify_one();
        tokio::time::timeout(LIMIT, waiting)
            .await
            .expect("unsubscribe_and_wait hangs");
        assert_eq!(finished.load(Ordering::SeqCst), 1, "{mode:?}");
        tokio::time::timeout(LIMIT, bus.close())
            .await
            .unwrap()
            .unwrap();
    }
}

/// An async ordered handler that unsubscribes itself and awaits the wait
/// does not wait for its own call.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_async_ordered_handler_waiting_for_its_own_unsubscribe_finishes() {
    use std::sync::Mutex;
    for mode in MODES {
        let bus = bus(mode);
        let slot: Arc<Mutex<Option<blazesub::Subscription>>> = Arc::default();
        let done = Arc::new(tokio::sync::Notify::new());
        let sub = {
            let (slot, done) = (Arc::clone(&slot), Arc::clone(&done));
            bus.subscribe_ordered_async("self", move |_| {
                let (slot, done) = (Arc::clone(&slot), Arc::clone(&done));
                async move {
                    let own = slot.lock().unwrap().take();
                    if let Some(own) = own {
                        own.unsubscribe_and_wait().await;
                        done.notify_one();
                    }
                }
            })
            .unwrap()
        };
        *slot.lock().unwrap() = Some(sub);
        bus.publish("self", 1).unwrap();
        tokio::time::timeout(LIMIT, done.notified())
            .await
            .unwrap_or_else(|_| panic!("{mode:?}: the handler waited for itself"));
        tokio::time::timeout(LIMIT, bus.close())
            .await
            .unwrap()
            .unwrap();
    }
}

// ---------------------------------------------------------------------------
// 6. Handlers that act on the bus.
// ---------------------------------------------------------------------------

/// From inside handlers (sync and async, every mode, and a worker pool of
/// one worker with a one-ticket queue so `CallerRuns` runs work on the
/// publisher): publish, publish_async, subscribe and unsubscribe never
/// deadlock.
#[test]
fn handlers_act_on_the_bus_without_deadlock() {
    use blazesub::Overflow;
    let configs: Vec<(DeliveryMode, usize, usize)> = vec![
        (DeliveryMode::Inline, 2, 64),
        (DeliveryMode::WorkerPool, 2, 64),
        (DeliveryMode::WorkerPool, 1, 1),
        (DeliveryMode::TaskPerSubscriber, 2, 64),
    ];
    for (mode, workers, queue) in configs {
        let what = format!("{mode:?}, {workers} workers, queue {queue}");
        let rt = common::runtime(2);
        let bus = Bus::<u32>::builder()
            .delivery(mode)
            .workers(workers)
            .queue_capacity(queue)
            .max_inflight_tasks(4)
            .overflow(Overflow::CallerRuns)
            .runtime(rt.handle().clone())
            .build()
            .unwrap();
        let out = Arc::new(AtomicU64::new(0));
        let counted = Arc::clone(&out);
        let _out = bus
            .subscribe("act/out", move |_| {
                counted.fetch_add(1, Ordering::SeqCst);
            })
            .unwrap();
        let inner = bus.clone();
        let _sync = bus
            .subscribe("act/in", move |m| {
                inner.publish("act/out", *m.data()).unwrap();
                let temporary = inner.subscribe("act/tmp", |_| {}).unwrap();
                drop(temporary);
            })
            .unwrap();
        let inner = bus.clone();
        let _async = bus
            .subscribe_async("act/in", move |m| {
                let bus = inner.clone();
                async move {
                    bus.publish_async("act/out", *m.data()).await.unwrap();
                    let temporary = bus.subscribe_stream("act/tmp").unwrap();
                    drop(temporary);
                }
            })
            .unwrap();
        let publisher = bus.clone();
        common::within(LIMIT, &what, move || {
            for value in 0..200 {
                publisher.publish("act/in", value).unwrap();
            }
        });
        assert!(
            common::wait_until(LIMIT, || out.load(Ordering::SeqCst) == 400),
            "{what}: {} of 400",
            out.load(Ordering::SeqCst)
        );
        // A handler's failed `unwrap` is caught by the bus, not the test.
        assert_eq!(bus.stats().handler_panics, 0, "{what}: a handler panicked");
    }
}

/// `close()` called from inside a handler finishes once everything else
/// has drained, without waiting for its own caller: a sync handler blocking
/// on it (pool worker, `Inline` publisher thread) and an async handler
/// awaiting it (every mode), while a slow handler elsewhere is still busy.
#[test]
fn close_from_a_handler_waits_for_everything_else_only() {
    use std::sync::atomic::AtomicBool;
    for (mode, sync) in [
        (DeliveryMode::WorkerPool, true),
        (DeliveryMode::Inline, true),
        (DeliveryMode::WorkerPool, false),
        (DeliveryMode::TaskPerSubscriber, false),
        (DeliveryMode::Inline, false),
    ] {
        let what = format!("{mode:?}, sync handler: {sync}");
        let rt = common::runtime(2);
        let bus = Bus::<u32>::builder()
            .delivery(mode)
            .workers(2)
            .runtime(rt.handle().clone())
            .build()
            .unwrap();
        let slow_done = Arc::new(AtomicBool::new(false));
        let slow_started = Arc::new(common::Countdown::new());
        let _slow = {
            let (done, started) = (Arc::clone(&slow_done), Arc::clone(&slow_started));
            bus.subscribe("slow", move |_| {
                started.arrive();
                std::thread::sleep(Duration::from_millis(150));
                done.store(true, Ordering::SeqCst);
            })
            .unwrap()
        };
        let closed = Arc::new(common::Countdown::new());
        let saw_slow_done = Arc::new(AtomicBool::new(false));
        let inner = bus.clone();
        let (closed_flag, saw) = (Arc::clone(&closed), Arc::clone(&saw_slow_done));
        let slow_flag = Arc::clone(&slow_done);
        let _closer = if sync {
            bus.subscribe("close", move |_| {
                let result = common::block_on(inner.close());
                assert!(result.is_ok(), "{result:?}");
                saw.store(slow_flag.load(Ordering::SeqCst), Ordering::SeqCst);
                closed_flag.arrive();
            })
            .unwrap()
        } else {
            bus.subscribe_async("close", move |_m| {
                let (bus, closed, saw, slow) = (
                    inner.clone(),
                    Arc::clone(&closed_flag),
                    Arc::clone(&saw),
                    Arc::clone(&slow_flag),
                );
                async move {
                    let result = bus.close().await;
                    assert!(result.is_ok(), "{result:?}");
                    saw.store(slow.load(Ordering::SeqCst), Ordering::SeqCst);
                    closed.arrive();
                }
            })
            .unwrap()
        };
        let slow_publisher = {
            let bus = bus.clone();
            std::thread::spawn(move || bus.publish("slow", 1).unwrap())
        };
        assert!(slow_started.wait_for(1, LIMIT), "{what}");
        let closer = {
            let bus = bus.clone();
            std::thread::spawn(move || bus.publish("close", 1).unwrap())
        };
        assert!(
            closed.wait_for(1, LIMIT),
            "{what}: close from a handler never returned"
        );
        assert!(
            saw_slow_done.load(Ordering::SeqCst),
            "{what}: close returned before the other handler drained"
        );
        slow_publisher.join().unwrap();
        closer.join().unwrap();
        assert!(bus.is_closed());
        assert!(
            common::wait_until(LIMIT, || bus.inflight_messages() == 0),
            "{what}"
        );
    }
}

/// In `Inline` mode a handler whose publish reaches itself again is stopped
/// at the depth limit with an error, counted, never a stack overflow.
#[test]
fn inline_recursion_is_bounded_and_counted() {
    self_publishing_handler_stops_at_the_depth_limit(false);
}

/// The same for a sync ordered handler: its publish to itself finds its
/// own runner at work and leaves the message to it, so the calls do not
/// nest, but the runner runs the message as deep as its publish did, and
/// the depth limit stops the chain. (Before, the outer `publish` never
/// returned: the runner ran each new message at its own depth.)
#[test]
fn inline_recursion_is_bounded_for_an_ordered_handler() {
    self_publishing_handler_stops_at_the_depth_limit(true);
}

fn self_publishing_handler_stops_at_the_depth_limit(ordered: bool) {
    let bus = Bus::<u32>::builder()
        .delivery(DeliveryMode::Inline)
        .build()
        .unwrap();
    let deepest = Arc::new(AtomicU64::new(0));
    let refusals = Arc::new(AtomicU64::new(0));
    let inner = bus.clone();
    let (deep, refused) = (Arc::clone(&deepest), Arc::clone(&refusals));
    let handler = move |m: &blazesub::Message<u32>| {
        deep.fetch_max(u64::from(*m.data()), Ordering::SeqCst);
        if let Err(error) = inner.publish("echo", m.data() + 1) {
            assert!(matches!(error, Error::RecursionLimit { .. }), "{error}");
            refused.fetch_add(1, Ordering::SeqCst);
        }
    };
    let sub = if ordered {
        bus.subscribe_ordered("echo", handler)
    } else {
        bus.subscribe("echo", handler)
    }
    .unwrap();
    // A thread with a small stack: an unbounded recursion would overflow
    // it; a chain that never ends fails the time limit.
    let publisher = bus.clone();
    common::within(LIMIT, "a self-publishing handler", move || {
        std::thread::Builder::new()
            .stack_size(8 << 20)
            .spawn(move || publisher.publish("echo", 1).unwrap())
            .unwrap()
            .join()
            .unwrap()
    });
    assert_eq!(refusals.load(Ordering::SeqCst), 1);
    assert_eq!(bus.stats().recursion_refused, 1);
    assert_eq!(deepest.load(Ordering::SeqCst), 64);
    assert_eq!(bus.inflight_messages(), 0);
    drop(sub); // releases the handler's bus clone
}

/// The depth limit holds for every way a handler publishes, not only
/// `publish`: a retained publish and a request that reach their own
/// handler again are refused at the same depth. (They used to recurse
/// without a limit.)
#[test]
fn inline_recursion_is_bounded_for_retained_publishes_and_requests() {
    for via in ["retained", "request"] {
        let bus = Bus::<u32>::builder()
            .delivery(DeliveryMode::Inline)
            .build()
            .unwrap();
        let deepest = Arc::new(AtomicU64::new(0));
        let refusals = Arc::new(AtomicU64::new(0));
        let inner = bus.clone();
        let (deep, refused) = (Arc::clone(&deepest), Arc::clone(&refusals));
        let sub = bus
            .subscribe("echo", move |m| {
                deep.fetch_max(u64::from(*m.data()), Ordering::SeqCst);
                let next = m.data() + 1;
                let result = if via == "retained" {
                    inner.publish_retained("echo", next).map(|_| ())
                } else {
                    // Never awaited past its first poll: the nested publish
                    // happens inside it, as the request is sent.
                    let request = inner.request("echo", next, Duration::from_millis(1));
                    let mut request = std::pin::pin!(request);
                    let waker = std::task::Waker::noop();
                    match request
                        .as_mut()
                        .poll(&mut std::task::Context::from_waker(waker))
                    {
                        std::task::Poll::Ready(Err(error)) => Err(error),
                        _ => Ok(()),
                    }
                };
                if let Err(error) = result {
                    assert!(matches!(error, Error::RecursionLimit { .. }), "{error}");
                    refused.fetch_add(1, Ordering::SeqCst);
                }
            })
            .unwrap();
        let publisher = bus.clone();
        std::thread::Builder::new()
            .stack_size(8 << 20)
            .spawn(move || publisher.publish("echo", 1).unwrap())
            .unwrap()
            .join()
            .unwrap();
        assert_eq!(refusals.load(Ordering::SeqCst), 1, "{via}");
        assert_eq!(bus.stats().recursion_refused, 1, "{via}");
        assert_eq!(deepest.load(Ordering::SeqCst), 64, "{via}");
        drop(sub);
    }
}
