//! Issue 13, item 6: handlers that act on the bus. One test per action
//! (`publish`, `publish_async`, `subscribe`, unsubscribing, `request`,
//! `close`), each from sync and async handlers in every delivery mode,
//! including a pool of one worker with a one-ticket queue (under
//! `CallerRuns` and under `Wait`, so a handler's own publish meets a full
//! queue) and the task cap under `CallerRuns`. Every step runs under a time
//! limit, so a deadlock fails the test instead of hanging it.
//!
//! A sync handler blocks on a future (`publish_async`, `request`, `close`)
//! only where it may block: not on a tokio worker, where
//! `TaskPerSubscriber` runs its handlers (there it would spawn the call).

mod common;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use blazesub::{Bus, DeliveryMode, Message, Overflow, StreamOptions, StreamOverflow, Subscription};

const LIMIT: Duration = Duration::from_secs(20);
const PUBLISHES: u32 = 50;

/// The settings each test runs under: a name, and the bus.
fn setups(rt: &tokio::runtime::Runtime) -> Vec<(&'static str, Bus<u32>)> {
    let bus = |mode: DeliveryMode, workers: usize, queue: usize, overflow: Overflow| {
        Bus::<u32>::builder()
            .delivery(mode)
            .workers(workers)
            .queue_capacity(queue)
            .max_inflight_tasks(2)
            .overflow(overflow)
            .close_timeout(Duration::from_secs(5))
            .runtime(rt.handle().clone())
            .build()
            .unwrap()
    };
    vec![
        ("Inline", bus(DeliveryMode::Inline, 2, 64, Overflow::Wait)),
        (
            "WorkerPool, 2 workers",
            bus(DeliveryMode::WorkerPool, 2, 64, Overflow::Wait),
        ),
        (
            "WorkerPool, 1 worker, 1-ticket queue, CallerRuns",
            bus(DeliveryMode::WorkerPool, 1, 1, Overflow::CallerRuns),
        ),
        (
            "WorkerPool, 1 worker, 1-ticket queue, Wait",
            bus(DeliveryMode::WorkerPool, 1, 1, Overflow::Wait),
        ),
        (
            "TaskPerSubscriber, cap 2, CallerRuns",
            bus(DeliveryMode::TaskPerSubscriber, 2, 64, Overflow::CallerRuns),
        ),
    ]
}

/// Whether a sync handler of `bus` may block its thread on a future.
fn sync_may_block(bus: &Bus<u32>) -> bool {
    bus.config().delivery != DeliveryMode::TaskPerSubscriber
}

/// A handler counting its calls.
fn counter(bus: &Bus<u32>, filter: &str) -> (Subscription, Arc<AtomicU64>) {
    let (mut subs, count) = common::counters(bus, filter, 1);
    (subs.remove(0), count)
}

/// Publishes `PUBLISHES` messages to `topic` from a thread, under the limit.
fn burst(bus: &Bus<u32>, topic: &'static str, what: &str) {
    let publisher = bus.clone();
    common::within(LIMIT, what, move || {
        for value in 0..PUBLISHES {
            publisher.publish(topic, value).unwrap();
        }
    });
}

fn settle(bus: &Bus<u32>, what: &str) {
    assert!(
        common::wait_until(LIMIT, || bus.inflight_messages() == 0),
        "{what}: {:?}",
        bus.stats()
    );
    assert_eq!(bus.stats().handler_panics, 0, "{what}: a handler panicked");
}

#[test]
fn a_handler_publishes() {
    let rt = common::runtime(2);
    for (name, bus) in setups(&rt) {
        let (_out, out) = counter(&bus, "out");
        let inner = bus.clone();
        let _sync = bus
            .subscribe("in", move |m: &Message<u32>| {
                inner.publish("out", *m.data()).unwrap();
            })
            .unwrap();
        let inner = bus.clone();
        let _async = bus
            .subscribe_async("in", move |m| {
                let bus = inner.clone();
                async move {
                    bus.publish("out", *m.data()).unwrap();
                }
            })
            .unwrap();
        burst(&bus, "in", name);
        settle(&bus, name);
        assert_eq!(
            out.load(Ordering::SeqCst),
            2 * u64::from(PUBLISHES),
            "{name}"
        );
    }
}

/// `publish_async` into a lossless stream of two that a slow task drains:
/// handlers wait for room and nothing is lost.
#[test]
fn a_handler_publishes_async_into_a_full_lossless_stream() {
    let rt = common::runtime(2);
    for (name, bus) in setups(&rt) {
        let mut reader = bus
            .subscribe_stream_with(
                "out",
                StreamOptions::new(2).overflow(StreamOverflow::Backpressure),
            )
            .unwrap();
        let read = rt.spawn(async move {
            let mut got = Vec::new();
            while got.len() < 2 * PUBLISHES as usize {
                match tokio::time::timeout(LIMIT, reader.recv()).await {
                    Ok(Some(message)) => got.push(*message.data()),
                    _ => break,
                }
                tokio::time::sleep(Duration::from_micros(200)).await;
            }
            (got, reader.lost())
        });
        let inner = bus.clone();
        let _async = bus
            .subscribe_async("in", move |m| {
                let bus = inner.clone();
                async move {
                    bus.publish_async("out", *m.data()).await.unwrap();
                }
            })
            .unwrap();
        let (inner, handle) = (bus.clone(), rt.handle().clone());
        let blocks = sync_may_block(&bus);
        let _sync = bus
            .subscribe("in", move |m: &Message<u32>| {
                if blocks {
                    common::block_on(inner.publish_async("out", *m.data())).unwrap();
                } else {
                    // Spawned, as a handler on a tokio worker should.
                    let (bus, value) = (inner.clone(), *m.data());
                    handle.spawn(async move { bus.publish_async("out", value).await.unwrap() });
                }
            })
            .unwrap();
        burst(&bus, "in", name);
        let (mut got, lost) = rt.block_on(read).unwrap();
        settle(&bus, name);
        got.sort_unstable();
        let want: Vec<u32> = (0..PUBLISHES).flat_map(|v| [v, v]).collect();
        assert_eq!((got, lost), (want, 0), "{name}");
    }
}

/// Each call subscribes a handler of its own; all of them get a later
/// publish.
#[test]
fn a_handler_subscribes() {
    let rt = common::runtime(2);
    for (name, bus) in setups(&rt) {
        let made: Arc<Mutex<Vec<Subscription>>> = Arc::default();
        let count = Arc::new(AtomicU64::new(0));
        let (inner, kept, counted) = (bus.clone(), Arc::clone(&made), Arc::clone(&count));
        let _sync = bus
            .subscribe("in", move |_: &Message<u32>| {
                let counted = Arc::clone(&counted);
                let sub = inner
                    .subscribe("later", move |_| {
                        counted.fetch_add(1, Ordering::SeqCst);
                    })
                    .unwrap();
                kept.lock().unwrap().push(sub);
            })
            .unwrap();
        let (inner, kept, counted) = (bus.clone(), Arc::clone(&made), Arc::clone(&count));
        let _async = bus
            .subscribe_async("in", move |_| {
                let (bus, kept, counted) = (inner.clone(), Arc::clone(&kept), Arc::clone(&counted));
                async move {
                    let sub = bus
                        .subscribe_async("later", move |_| {
                            let counted = Arc::clone(&counted);
                            async move {
                                counted.fetch_add(1, Ordering::SeqCst);
                            }
                        })
                        .unwrap();
                    kept.lock().unwrap().push(sub);
                }
            })
            .unwrap();
        burst(&bus, "in", name);
        settle(&bus, name);
        let made_count = made.lock().unwrap().len();
        assert_eq!(made_count, 2 * PUBLISHES as usize, "{name}");
        assert_eq!(bus.publish("later", 0).unwrap(), made_count, "{name}");
        settle(&bus, name);
        assert_eq!(count.load(Ordering::SeqCst), made_count as u64, "{name}");
    }
}

/// A sync handler unsubscribes itself (`unsubscribe`) and an async one
/// awaits its own `unsubscribe_and_wait`, on their first call: neither
/// deadlocks, and neither is called for a publish made after the burst.
#[test]
fn a_handler_unsubscribes_itself() {
    let rt = common::runtime(2);
    for (name, bus) in setups(&rt) {
        let calls = Arc::new(AtomicU64::new(0));
        let own_sync: Arc<Mutex<Option<Subscription>>> = Arc::default();
        let (slot, counted) = (Arc::clone(&own_sync), Arc::clone(&calls));
        let sub = bus
            .subscribe("in", move |_: &Message<u32>| {
                counted.fetch_add(1, Ordering::SeqCst);
                let own = slot.lock().unwrap().take();
                if let Some(own) = own {
                    own.unsubscribe();
                }
            })
            .unwrap();
        *own_sync.lock().unwrap() = Some(sub);
        let own_async: Arc<Mutex<Option<Subscription>>> = Arc::default();
        let (slot, counted) = (Arc::clone(&own_async), Arc::clone(&calls));
        let sub = bus
            .subscribe_async("in", move |_| {
                let (slot, counted) = (Arc::clone(&slot), Arc::clone(&counted));
                async move {
                    counted.fetch_add(1, Ordering::SeqCst);
                    let own = slot.lock().unwrap().take();
                    if let Some(own) = own {
                        own.unsubscribe_and_wait().await;
                    }
                }
            })
            .unwrap();
        *own_async.lock().unwrap() = Some(sub);
        burst(&bus, "in", name);
        settle(&bus, name);
        let after_burst = calls.load(Ordering::SeqCst);
        assert!(after_burst >= 2, "{name}: {after_burst} calls");
        assert_eq!(bus.publish("in", 0).unwrap(), 0, "{name}: still subscribed");
        settle(&bus, name);
        assert_eq!(calls.load(Ordering::SeqCst), after_burst, "{name}");
    }
}

/// Every call makes a request that a responder answers: sync handlers
/// (blocking where they may) and async ones (awaiting) get every reply.
#[test]
fn a_handler_makes_a_request() {
    let rt = common::runtime(2);
    for (name, bus) in setups(&rt) {
        let responder = bus.clone();
        let _responder = bus
            .subscribe("rpc", move |m: &Message<u32>| {
                responder.reply(m, *m.data() + 1).unwrap();
            })
            .unwrap();
        let answered = Arc::new(AtomicU64::new(0));
        let (inner, counted, handle) = (bus.clone(), Arc::clone(&answered), rt.handle().clone());
        let blocks = sync_may_block(&bus);
        let _sync = bus
            .subscribe("in", move |m: &Message<u32>| {
                let value = *m.data();
                if blocks {
                    let reply = common::block_on(inner.request("rpc", value, LIMIT)).unwrap();
                    assert_eq!(*reply.data(), value + 1);
                    counted.fetch_add(1, Ordering::SeqCst);
                } else {
                    let (bus, counted) = (inner.clone(), Arc::clone(&counted));
                    handle.spawn(async move {
                        let reply = bus.request("rpc", value, LIMIT).await.unwrap();
                        assert_eq!(*reply.data(), value + 1);
                        counted.fetch_add(1, Ordering::SeqCst);
                    });
                }
            })
            .unwrap();
        let (inner, counted) = (bus.clone(), Arc::clone(&answered));
        let _async = bus
            .subscribe_async("in", move |m| {
                let (bus, counted) = (inner.clone(), Arc::clone(&counted));
                async move {
                    let value = *m.data();
                    let reply = bus.request("rpc", value, LIMIT).await.unwrap();
                    assert_eq!(*reply.data(), value + 1);
                    counted.fetch_add(1, Ordering::SeqCst);
                }
            })
            .unwrap();
        burst(&bus, "in", name);
        assert!(
            common::wait_until(LIMIT, || answered.load(Ordering::SeqCst)
                == 2 * u64::from(PUBLISHES)),
            "{name}: {} of {} answered; {:?}",
            answered.load(Ordering::SeqCst),
            2 * PUBLISHES,
            bus.stats()
        );
        settle(&bus, name);
    }
}

/// A handler (sync, blocking where it may; async, awaiting) closes the bus
/// in the middle of a burst: `close` returns `Ok` within the limit, and
/// every delivery accepted is accounted for.
#[test]
fn a_handler_closes_the_bus() {
    for sync in [true, false] {
        let rt = common::runtime(2);
        for (name, bus) in setups(&rt) {
            let what = format!("{name}, sync handler: {sync}");
            if sync && !sync_may_block(&bus) {
                continue;
            }
            let (_others, _count) = common::counters(&bus, "in", 3);
            let (tx, closed) = std::sync::mpsc::channel();
            let tx = Arc::new(Mutex::new(tx));
            let inner = bus.clone();
            let _closer = if sync {
                bus.subscribe("in", move |m: &Message<u32>| {
                    if *m.data() == PUBLISHES / 2 {
                        let result = common::block_on(inner.close());
                        let _ = tx.lock().unwrap().send(result);
                    }
                })
                .unwrap()
            } else {
                bus.subscribe_async("in", move |m| {
                    let (bus, tx) = (inner.clone(), Arc::clone(&tx));
                    async move {
                        if *m.data() == PUBLISHES / 2 {
                            let result = bus.close().await;
                            let _ = tx.lock().unwrap().send(result);
                        }
                    }
                })
                .unwrap()
            };
            let publisher = bus.clone();
            let reached = common::within(LIMIT, &what, move || {
                (0..PUBLISHES)
                    .filter_map(|value| publisher.publish("in", value).ok())
                    .sum::<usize>() as u64
            });
            let result = closed
                .recv_timeout(LIMIT)
                .unwrap_or_else(|_| panic!("{what}: close never returned"));
            assert!(result.is_ok(), "{what}: {result:?}");
            settle(&bus, &what);
            let stats = bus.stats();
            assert_eq!(
                stats.delivered + stats.dropped + stats.handler_panics,
                reached,
                "{what}: {stats:?}"
            );
        }
    }
}
