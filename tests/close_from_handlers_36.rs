//! A sync handler blocking on `close` in `WorkerPool` and `Inline` modes
//! (batches, grains and chunks, a publisher running work itself, nested
//! publishes, ordered handlers): `close` finishes once everything else has
//! drained, without waiting for the publish(es) the handler holds up, and
//! never until `close_timeout` because of work that cannot run before the
//! handler returns. `Stats` stay exact afterwards. Every wait is under a
//! time limit, so a bug fails instead of hanging.

mod common;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::Receiver;
use std::sync::Arc;
use std::time::{Duration, Instant};

use blazesub::{Bus, BusBuilder, DeliveryMode, Error, Message, Overflow, Subscription};

/// Where a closer sends what its `close` returned, and how long it took.
type Closed = Receiver<(Result<(), Error>, Duration)>;

const LIMIT: Duration = Duration::from_secs(10);
/// `close` must return well before the bus's `close_timeout` (2 s).
const PROMPT: Duration = Duration::from_secs(1);

fn builder(mode: DeliveryMode, workers: usize) -> BusBuilder<u32> {
    Bus::<u32>::builder()
        .delivery(mode)
        .workers(workers)
        .close_timeout(Duration::from_secs(2))
}

/// Subscribes (plain or ordered) a handler of `topic` that blocks on
/// `close` when it gets `on`, and sends the result and how long it took.
fn closer(bus: &Bus<u32>, topic: &str, on: u32, ordered: bool) -> (Subscription, Closed) {
    let (tx, closed) = std::sync::mpsc::channel();
    let inner = bus.clone();
    let close = move |m: &Message<u32>| {
        if *m.data() == on {
            let started = Instant::now();
            let result = common::block_on(inner.close());
            let _ = tx.send((result, started.elapsed()));
        }
    };
    let sub = if ordered {
        bus.subscribe_ordered(topic, close).unwrap()
    } else {
        bus.subscribe(topic, close).unwrap()
    };
    (sub, closed)
}

/// Checks `close` returned `Ok` promptly, then that the bus drains and its
/// stats account for every delivery `reached` counted.
fn check(what: &str, closed: &Closed) {
    let (result, took) = closed
        .recv_timeout(LIMIT)
        .unwrap_or_else(|_| panic!("{what}: close never returned"));
    assert!(result.is_ok(), "{what}: {result:?} after {took:?}");
    assert!(took < PROMPT, "{what}: close took {took:?}");
}

fn check_drained(what: &str, bus: &Bus<u32>, reached: impl FnOnce() -> u64) {
    assert!(
        common::wait_until(LIMIT, || bus.inflight_messages() == 0),
        "{what}: {:?}",
        bus.stats()
    );
    let stats = bus.stats();
    assert_eq!(
        stats.delivered + stats.dropped + stats.handler_panics,
        reached(),
        "{what}: {stats:?}"
    );
}

/// (a) A pool worker runs a batch of publishes queued behind one another
/// to the same subscriptions; the closer's handler, subscribed first,
/// blocks on `close` in the batch's first job.
#[test]
fn close_from_a_sync_handler_in_a_pool_batch() {
    for workers in [1, 2] {
        for ordered in [false, true] {
            let what = format!("workers: {workers}, ordered: {ordered}");
            let bus = builder(DeliveryMode::WorkerPool, workers).build().unwrap();
            let (_closer, closed) = closer(&bus, "t", 1, ordered);
            // Holds the worker on the first publish while the rest queue
            // (published once it has started, so they make one batch).
            let (started, has_started) = std::sync::mpsc::sync_channel(1);
            let _slow = bus
                .subscribe("t", move |m| {
                    if *m.data() == 0 {
                        let _ = started.try_send(());
                        std::thread::sleep(Duration::from_millis(50));
                    }
                })
                .unwrap();
            let (_others, _count) = common::counters(&bus, "t", 3);
            let publisher = {
                let bus = bus.clone();
                std::thread::spawn(move || {
                    let first = bus.publish("t", 0).unwrap();
                    has_started.recv_timeout(LIMIT).unwrap();
                    first
                        + (1..10)
                            .filter_map(|i| bus.publish("t", i).ok())
                            .sum::<usize>()
                })
            };
            check(&what, &closed);
            let reached = publisher.join().unwrap() as u64;
            check_drained(&what, &bus, || reached);
        }
    }
}

/// (b) One publish to many subscriptions, below the threshold (grains)
/// and above it (chunks): the closer, subscribed first, blocks on `close`
/// with the rest of the publish unclaimed.
#[test]
fn close_from_a_sync_handler_in_a_pool_grain_or_chunk() {
    for workers in [1, 2] {
        for threshold in [1000, 2] {
            for ordered in [false, true] {
                let what =
                    format!("workers: {workers}, threshold: {threshold}, ordered: {ordered}");
                let bus = builder(DeliveryMode::WorkerPool, workers)
                    .max_concurrent_subscriptions(threshold)
                    .build()
                    .unwrap();
                let (_closer, closed) = closer(&bus, "t", 0, ordered);
                let (_others, _count) = common::counters(&bus, "t", 16);
                let reached = bus.publish("t", 0).unwrap() as u64;
                check(&what, &closed);
                check_drained(&what, &bus, || reached);
            }
        }
    }
}

/// (c) A full queue under `Overflow::CallerRuns` / `Overflow::Wait`: the
/// publisher, a plain thread, runs work itself (CallerRuns), or waits; a
/// handler it runs blocks on `close`.
#[test]
fn close_from_a_sync_handler_run_by_its_publisher_on_a_full_queue() {
    for overflow in [Overflow::CallerRuns, Overflow::Wait] {
        for workers in [1, 2, 3] {
            for (ordered, round) in [false, true]
                .into_iter()
                .flat_map(|o| (0..4).map(move |r| (o, r)))
            {
                let what =
                    format!("{overflow:?}, workers: {workers}, ordered: {ordered}, round {round}");
                let bus = builder(DeliveryMode::WorkerPool, workers)
                    .overflow(overflow)
                    .queue_capacity(1)
                    .build()
                    .unwrap();
                let (_closer, closed) = closer(&bus, "t", 3, ordered);
                let _slow = bus
                    .subscribe("t", |m| {
                        if *m.data() == 0 {
                            std::thread::sleep(Duration::from_millis(50));
                        }
                    })
                    .unwrap();
                let (_others, _count) = common::counters(&bus, "t", 3);
                let publisher = {
                    let bus = bus.clone();
                    std::thread::spawn(move || {
                        (0..10)
                            .filter_map(|i| bus.publish("t", i).ok())
                            .sum::<usize>()
                    })
                };
                check(&what, &closed);
                let reached = publisher.join().unwrap() as u64;
                check_drained(&what, &bus, || reached);
            }
        }
    }
}

/// (c') A pool handler publishing to a full queue runs the publish itself
/// (it must not wait on a worker); a handler of that publish blocks on
/// `close`.
#[test]
fn close_from_a_sync_handler_of_a_publish_a_pool_handler_runs_itself() {
    for overflow in [Overflow::CallerRuns, Overflow::Wait] {
        for workers in [1, 2, 3] {
            for (ordered, round) in [false, true]
                .into_iter()
                .flat_map(|o| (0..4).map(move |r| (o, r)))
            {
                let what =
                    format!("{overflow:?}, workers: {workers}, ordered: {ordered}, round {round}");
                let bus = builder(DeliveryMode::WorkerPool, workers)
                    .overflow(overflow)
                    .queue_capacity(1)
                    .build()
                    .unwrap();
                let reached = Arc::new(AtomicU64::new(0));
                let (_closer, closed) = closer(&bus, "inner", 3, ordered);
                let (_others, _count) = common::counters(&bus, "inner", 3);
                let _outer = {
                    let bus = bus.clone();
                    let reached = Arc::clone(&reached);
                    bus.clone()
                        .subscribe("outer", move |_| {
                            for i in 0..6 {
                                if let Ok(n) = bus.publish("inner", i) {
                                    reached.fetch_add(n as u64, Ordering::SeqCst);
                                }
                            }
                        })
                        .unwrap()
                };
                let (_after, _) = common::counters(&bus, "outer", 2);
                let outer = bus.publish("outer", 0).unwrap() as u64;
                check(&what, &closed);
                check_drained(&what, &bus, || outer + reached.load(Ordering::SeqCst));
            }
        }
    }
}

/// (d) `Inline`: a handler publishes (nested), and a handler of the inner
/// publish blocks on `close`.
#[test]
fn close_from_a_sync_handler_of_a_nested_inline_publish() {
    for ordered in [false, true] {
        for outer_ordered in [false, true] {
            let what = format!("ordered: {ordered}, outer ordered: {outer_ordered}");
            let bus = builder(DeliveryMode::Inline, 1).build().unwrap();
            let reached = Arc::new(AtomicU64::new(0));
            let (_closer, closed) = closer(&bus, "inner", 0, ordered);
            let (_others, _count) = common::counters(&bus, "inner", 3);
            let publish_inner = {
                let bus = bus.clone();
                let reached = Arc::clone(&reached);
                move |_: &Message<u32>| {
                    if let Ok(n) = bus.publish("inner", 0) {
                        reached.fetch_add(n as u64, Ordering::SeqCst);
                    }
                }
            };
            let _outer = if outer_ordered {
                bus.subscribe_ordered("outer", publish_inner).unwrap()
            } else {
                bus.subscribe("outer", publish_inner).unwrap()
            };
            let (_after, _) = common::counters(&bus, "outer", 2);
            let publisher = {
                let bus = bus.clone();
                std::thread::spawn(move || bus.publish("outer", 0).unwrap() as u64)
            };
            check(&what, &closed);
            let outer = publisher.join().unwrap();
            check_drained(&what, &bus, || outer + reached.load(Ordering::SeqCst));
        }
    }
}

/// (d') `Inline` with several publishers at once: the closer blocks in
/// one publish while others run on other threads.
#[test]
fn close_from_a_sync_handler_of_an_inline_publish_among_others() {
    for ordered in [false, true] {
        let what = format!("ordered: {ordered}");
        let bus = builder(DeliveryMode::Inline, 1).build().unwrap();
        let (_closer, closed) = closer(&bus, "t", 5, ordered);
        let (_others, _count) = common::counters(&bus, "t", 3);
        let publishers: Vec<_> = (0..3)
            .map(|p| {
                let bus = bus.clone();
                std::thread::spawn(move || {
                    (0..10)
                        .filter_map(|i| bus.publish("t", p * 10 + i).ok())
                        .sum::<usize>()
                })
            })
            .collect();
        check(&what, &closed);
        let reached: usize = publishers.into_iter().map(|p| p.join().unwrap()).sum();
        check_drained(&what, &bus, || reached as u64);
    }
}

/// (a') One worker: a publish gathered into a batch with the one whose
/// handler blocks on `close` cannot run before that handler returns.
#[test]
fn close_from_a_sync_handler_with_a_publish_batched_behind_on_its_only_worker() {
    for ordered in [false, true] {
        let what = format!("ordered: {ordered}");
        let bus = builder(DeliveryMode::WorkerPool, 1).build().unwrap();
        let (_closer, closed) = closer(&bus, "t", 0, ordered);
        let (_others, _count) = common::counters(&bus, "t", 3);
        let reached = bus.publish("t", 0).unwrap() + bus.publish("t", 1).unwrap_or(0);
        check(&what, &closed);
        check_drained(&what, &bus, || reached as u64);
    }
}

/// (a2) One worker: a publish to another topic queued behind the one
/// whose handler blocks on `close` (not batched with it) cannot run before
/// that handler returns, and no other worker can take it: the close's
/// stand-in thread runs it (before, `close` waited for it until
/// `close_timeout`).
#[test]
fn close_from_a_sync_handler_with_another_topic_queued_behind_on_its_only_worker() {
    for ordered in [false, true] {
        let what = format!("ordered: {ordered}");
        let bus = builder(DeliveryMode::WorkerPool, 1).build().unwrap();
        let (_closer, closed) = closer(&bus, "t", 0, ordered);
        let (_others, _count) = common::counters(&bus, "u", 3);
        let reached = bus.publish("t", 0).unwrap() + bus.publish("u", 1).unwrap_or(0);
        check(&what, &closed);
        check_drained(&what, &bus, || reached as u64);
    }
}

/// (a4) One worker: a handler publishes to another topic (queued behind
/// it on the only worker, which has room), then blocks on `close`.
#[test]
fn close_from_a_sync_handler_after_its_own_publish_queued_behind_it_on_its_only_worker() {
    for ordered in [false, true] {
        let what = format!("ordered: {ordered}");
        let bus = builder(DeliveryMode::WorkerPool, 1).build().unwrap();
        let (tx, closed) = std::sync::mpsc::channel();
        let reached = Arc::new(AtomicU64::new(0));
        let publish_then_close = {
            let (bus, reached) = (bus.clone(), Arc::clone(&reached));
            move |_: &Message<u32>| {
                for i in 0..3 {
                    if let Ok(n) = bus.publish("u", i) {
                        reached.fetch_add(n as u64, Ordering::SeqCst);
                    }
                }
                let started = Instant::now();
                let result = common::block_on(bus.close());
                let _ = tx.send((result, started.elapsed()));
            }
        };
        let _closer = if ordered {
            bus.subscribe_ordered("t", publish_then_close).unwrap()
        } else {
            bus.subscribe("t", publish_then_close).unwrap()
        };
        let (_others, count) = common::counters(&bus, "u", 3);
        let outer = bus.publish("t", 0).unwrap() as u64;
        check(&what, &closed);
        check_drained(&what, &bus, || outer + reached.load(Ordering::SeqCst));
        assert_eq!(count.load(Ordering::SeqCst), 9, "{what}");
    }
}

/// (a3) Any number of workers: a publish to another topic that the
/// closer's worker took off its queue while gathering a batch (it did not
/// fit, so it waits to run next on that worker) cannot run before that
/// handler returns. Another topic's home is the same worker when
/// `workers - 1` other routes were made between.
#[test]
fn close_from_a_sync_handler_with_another_topic_taken_behind_it() {
    for workers in [1, 2, 3] {
        for ordered in [false, true] {
            let what = format!("workers: {workers}, ordered: {ordered}");
            let bus = builder(DeliveryMode::WorkerPool, workers).build().unwrap();
            let (_closer, closed) = closer(&bus, "t", 0, ordered);
            let (_others, _count) = common::counters(&bus, "u", 3);
            // Routes get homes in turn: "t" first, then fillers, then "u".
            assert!(bus.has_subscribers("t"));
            for filler in 1..workers {
                assert!(!bus.has_subscribers(&format!("filler/{filler}")));
            }
            assert!(bus.has_subscribers("u"));
            // Queued together, before the worker wakes (most times; at
            // other times the closer may have closed the bus first).
            let reached = bus.publish("t", 0).unwrap() + bus.publish("u", 1).unwrap_or(0);
            check(&what, &closed);
            check_drained(&what, &bus, || reached as u64);
        }
    }
}

/// (a5) While a `close` from a handler waits, the work it runs in place of
/// a stalled worker may block too: `close` still gives up at its
/// `close_timeout`, and everything runs once let go.
///
/// The closing handler is published first and waits until the rest is
/// queued before it closes, so that one worker is in it while the other
/// blocks in the first of the held-up publishes, whichever worker takes
/// which: a worker slow to wake looks stalled, and an idle one takes its
/// work over. Published last, the closing publish could be left queued
/// behind two workers blocked in the held-up publishes (tests run side by
/// side, and a worker was once slow to wake for a millisecond).
#[test]
fn close_from_a_sync_handler_still_times_out_when_the_held_up_work_blocks() {
    let bus = builder(DeliveryMode::WorkerPool, 2)
        .close_timeout(Duration::from_millis(300))
        .build()
        .unwrap();
    let released = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let (go, may_close) = std::sync::mpsc::sync_channel::<()>(1);
    let (closed_tx, closed) = std::sync::mpsc::channel();
    let _closer = {
        let inner = bus.clone();
        let may_close = std::sync::Mutex::new(may_close);
        bus.subscribe("t", move |_| {
            let _ = may_close.lock().unwrap().recv_timeout(LIMIT);
            let started = Instant::now();
            let result = common::block_on(inner.close());
            let _ = closed_tx.send((result, started.elapsed()));
        })
        .unwrap()
    };
    let (started, has_started) = std::sync::mpsc::sync_channel(3);
    let _blocker = {
        let released = Arc::clone(&released);
        bus.subscribe("s", move |_| {
            let _ = started.try_send(());
            let limit = Instant::now() + LIMIT;
            while !released.load(Ordering::SeqCst) && Instant::now() < limit {
                std::thread::sleep(Duration::from_millis(1));
            }
        })
        .unwrap()
    };
    // Routes get homes in turn: "t" on worker 0, "s" on worker 1.
    assert!(bus.has_subscribers("t"));
    assert!(bus.has_subscribers("s"));
    // A worker in the closing handler, which waits; the other blocks in the
    // first "s"; the others wait in worker 1's queue.
    let mut reached = bus.publish("t", 0).unwrap();
    reached += bus.publish("s", 0).unwrap();
    has_started.recv_timeout(LIMIT).unwrap();
    reached += (1..3).map(|i| bus.publish("s", i).unwrap()).sum::<usize>();
    go.send(()).unwrap();
    let (result, took) = closed.recv_timeout(LIMIT).expect("close never returned");
    released.store(true, Ordering::SeqCst);
    assert!(
        matches!(result, Err(Error::CloseTimeout { .. })),
        "{result:?} after {took:?}"
    );
    assert!(took < PROMPT, "close took {took:?}");
    check_drained("after the release", &bus, || reached as u64);
}
