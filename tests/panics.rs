//! Panic isolation through the public API: a handler that panics on every
//! message (sync, async before its first await, async after it) is caught and
//! counted, its neighbours in the same batch still get everything, and the
//! bus — its workers included — keeps working. In a binary of its own
//! because it replaces the process-wide panic hook.

mod common;

use std::panic::{self, PanicHookInfo};
use std::sync::Arc;
use std::time::Duration;

use blazesub::{Batch, Bus, DeliveryMode, Message, Overflow, Subscription};
use common::{wait_until, Hits, QuietPanics, MODES};

/// The payload of the panics these tests cause on purpose.
const INTENTIONAL: &str = "intentional test panic";

/// A non-string payload, for `panic_any`.
struct IntentionalPayload;

fn is_intentional(info: &PanicHookInfo<'_>) -> bool {
    let payload = info.payload();
    payload.is::<IntentionalPayload>()
        || payload.downcast_ref::<&str>() == Some(&INTENTIONAL)
        || payload
            .downcast_ref::<String>()
            .is_some_and(|s| s == INTENTIONAL)
}

const N: u32 = 400;
const COUNTERS: usize = 7;

/// Waits until nothing is in flight, without closing the bus.
fn settle(bus: &Bus<u32>, what: &str) {
    assert!(
        wait_until(Duration::from_secs(20), || bus.inflight_messages() == 0),
        "{what}: deliveries never finished ({} in flight): did a panic kill a runner?",
        bus.inflight_messages()
    );
}

/// Seven counting handlers around one that always panics, all on the same
/// trie node (so the panicking one sits in the middle of every unit), plus a
/// counter on another node. Two rounds of 400 publishes: after the first the
/// bus is still open and must still deliver; after the second it closes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_panicking_handler_harms_nobody() {
    let _quiet = QuietPanics::install(is_intentional);
    for mode in MODES {
        for (batch, threshold) in [
            (Batch::Chunked, 10_000),
            (Batch::Single, 10_000),
            (Batch::Chunked, 1),
            (Batch::Single, 1),
        ] {
            let what = format!("{mode:?} {batch:?} threshold {threshold}");
            let bus = Bus::<u32>::builder()
                .delivery(mode)
                .workers(2)
                .batch(batch)
                .max_concurrent_subscriptions(threshold)
                // In pool mode a dead worker must show: nothing may quietly
                // fall back to the publisher (the queue of 4,096 holds a
                // round's at most 3,200 jobs, so nothing overflows either).
                // The task cap, though, is exceeded on purpose by 3,200
                // tasks: there the publisher takes over, as by default.
                .overflow(if mode == DeliveryMode::WorkerPool {
                    Overflow::Drop
                } else {
                    Overflow::CallerRuns
                })
                .close_timeout(Duration::from_secs(20))
                .build()
                .unwrap();
            let hits: Vec<Arc<Hits>> = (0..COUNTERS)
                .map(|_| Arc::new(Hits::new(2 * N as usize)))
                .collect();
            let counting = |i: usize| {
                let mine = Arc::clone(&hits[i]);
                move |m: &Message<u32>| mine.hit(*m.data())
            };
            let mut subs: Vec<Subscription> = Vec::new();
            for i in 0..3 {
                subs.push(bus.subscribe("p/x", counting(i)).unwrap());
            }
            subs.push(
                bus.subscribe("p/x", |m: &Message<u32>| {
                    if m.data() % 2 == 0 {
                        panic!("{}", INTENTIONAL);
                    }
                    panic::panic_any(IntentionalPayload);
                })
                .unwrap(),
            );
            for i in 3..6 {
                subs.push(bus.subscribe("p/x", counting(i)).unwrap());
            }
            subs.push(bus.subscribe("p/+", counting(6)).unwrap());

            for round in 0..2u32 {
                for id in round * N..(round + 1) * N {
                    assert_eq!(
                        bus.publish("p/x", id).unwrap(),
                        COUNTERS + 1,
                        "{what}: publish failed next to a panicking handler"
                    );
                }
                if round == 0 {
                    settle(&bus, &what);
                } else {
                    bus.close().await.unwrap();
                }
                let published = (round + 1) * N;
                for (i, mine) in hits.iter().enumerate() {
                    if let Some((id, got)) = mine.first_mismatch(|id| u32::from(id < published)) {
                        panic!("{what}, round {round}: counter {i} got message {id} {got} times");
                    }
                }
                let stats = bus.stats();
                assert_eq!(
                    stats.handler_panics,
                    u64::from(published),
                    "{what}, round {round}: panics counted"
                );
                assert_eq!(
                    stats.delivered,
                    COUNTERS as u64 * u64::from(published),
                    "{what}, round {round}"
                );
                assert_eq!(stats.dropped, 0, "{what}, round {round}");
                if mode == DeliveryMode::WorkerPool {
                    assert_eq!(stats.caller_runs, 0, "{what}, round {round}");
                }
            }
            assert_eq!(bus.inflight_messages(), 0, "{what}");
        }
    }
}

/// Async handlers that panic, before and after their first await, are caught
/// and counted too, and `close` still drains.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_panicking_async_handler_is_caught_and_counted() {
    let _quiet = QuietPanics::install(is_intentional);
    const M: u32 = 200;
    for mode in MODES {
        let bus = Bus::<u32>::builder()
            .delivery(mode)
            .workers(2)
            .close_timeout(Duration::from_secs(20))
            .build()
            .unwrap();
        let counted = Arc::new(Hits::new(M as usize));
        let mine = Arc::clone(&counted);
        let _subs = [
            bus.subscribe_async("q/#", |_: Arc<Message<u32>>| async {
                panic!("{}", INTENTIONAL);
            })
            .unwrap(),
            bus.subscribe_async("q/#", |_: Arc<Message<u32>>| async {
                tokio::task::yield_now().await;
                panic::panic_any(IntentionalPayload);
            })
            .unwrap(),
            bus.subscribe_async("q/#", move |m: Arc<Message<u32>>| {
                let mine = Arc::clone(&mine);
                async move {
                    tokio::task::yield_now().await;
                    mine.hit(*m.data());
                }
            })
            .unwrap(),
        ];
        for id in 0..M {
            assert_eq!(bus.publish("q/x", id).unwrap(), 3, "{mode:?}");
        }
        settle(&bus, &format!("{mode:?}"));
        assert_eq!(
            bus.stats().handler_panics,
            2 * u64::from(M),
            "{mode:?}: async panics counted"
        );
        // Still working.
        assert_eq!(bus.publish("q/x", 0).unwrap(), 3);
        bus.close().await.unwrap();
        let stats = bus.stats();
        assert_eq!(stats.handler_panics, 2 * u64::from(M) + 2, "{mode:?}");
        assert_eq!(stats.delivered, u64::from(M) + 1, "{mode:?}");
        assert_eq!(counted.get(0), 2, "{mode:?}");
        assert!((1..M).all(|id| counted.get(id) == 1), "{mode:?}");
    }
}
