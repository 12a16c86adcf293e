//! The edges a service meets (DESIGN.md §6), through the public API, in
//! every delivery mode: drops that must not deadlock, unsubscribing that
//! releases what a handler owns, shutdown and cancellation that lose nothing
//! uncounted, and the ergonomics of subscribing. Each test would hang or fail
//! on the code before the fix it covers; every step that could hang runs
//! under a time limit and fails instead.

mod common;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use blazesub::{Bus, DeliveryMode, Message, Subscription};
use common::{runtime, wait_until, within, MODES};

const LIMIT: Duration = Duration::from_secs(20);

fn bus_on(mode: DeliveryMode, rt: &tokio::runtime::Runtime) -> Bus<u32> {
    Bus::<u32>::builder()
        .delivery(mode)
        .workers(2)
        .runtime(rt.handle().clone())
        .build()
        .unwrap()
}

fn quiet(bus: &Bus<u32>) {
    assert!(
        wait_until(LIMIT, || bus.inflight_messages() == 0),
        "deliveries still in flight: {:?}",
        bus.stats()
    );
}

// ---------------------------------------------------------------------------
// 1. Drops never deadlock.
// ---------------------------------------------------------------------------

/// Handler A on `x` owns a `Subscription` C on `y`; handler B is also on
/// `x`. Dropping A and then B releases A's entry, whose closure drops C,
/// whose drop unsubscribes from the same trie: this must not run while the
/// trie's writer lock is held. With and without a warm route cache.
#[test]
fn dropping_a_handler_that_owns_a_subscription_does_not_deadlock() {
    for mode in MODES {
        for warm in [false, true] {
            let what = format!("{mode:?}, warm cache: {warm}");
            let rt = runtime(2);
            let bus = bus_on(mode, &rt);
            let probe = bus.clone();
            within(LIMIT, &what, move || {
                let c = bus.subscribe("y", |_: &Message<u32>| {}).unwrap();
                let a = bus
                    .subscribe("x", move |_: &Message<u32>| {
                        let _owned = &c;
                    })
                    .unwrap();
                let b = bus.subscribe("x", |_: &Message<u32>| {}).unwrap();
                if warm {
                    bus.publish("x", 1).unwrap();
                    bus.publish("y", 1).unwrap();
                    quiet(&bus);
                }
                drop(a);
                drop(b);
            });
            assert!(
                wait_until(LIMIT, || probe.subscriptions_count() == 0),
                "{what}: {} subscriptions left",
                probe.subscriptions_count()
            );
        }
    }
}

/// The same through compaction: a hundred handlers on one filter, the first
/// owning a subscription elsewhere; removing them one by one compacts the set
/// several times, and the compaction that releases the first one's entry
/// must not hold the lock while its closure is dropped.
#[test]
fn compaction_that_releases_an_owning_handler_does_not_deadlock() {
    for mode in MODES {
        let rt = runtime(2);
        let bus = bus_on(mode, &rt);
        let probe = bus.clone();
        within(LIMIT, &format!("{mode:?}"), move || {
            let owned = bus.subscribe("elsewhere", |_: &Message<u32>| {}).unwrap();
            let mut subs: Vec<Subscription> = Vec::new();
            subs.push(
                bus.subscribe("x", move |_: &Message<u32>| {
                    let _owned = &owned;
                })
                .unwrap(),
            );
            for _ in 0..99 {
                subs.push(bus.subscribe("x", |_: &Message<u32>| {}).unwrap());
            }
            bus.publish("x", 1).unwrap();
            quiet(&bus);
            for sub in subs {
                drop(sub);
            }
        });
        assert!(
            wait_until(LIMIT, || probe.subscriptions_count() == 0),
            "{mode:?}: {} subscriptions left",
            probe.subscriptions_count()
        );
    }
}

/// A handler owning a clone of its own bus (a cycle through the trie) is
/// released on unsubscribe, and dropping the last outside handle then drops
/// the bus.
#[test]
fn a_handler_owning_its_bus_makes_no_cycle() {
    for mode in MODES {
        let rt = runtime(2);
        let bus = bus_on(mode, &rt);
        let token = Arc::new(());
        let witness = Arc::clone(&token);
        let inner = bus.clone();
        let sub = bus
            .subscribe("loop", move |_: &Message<u32>| {
                let _keep = (&inner, &witness);
            })
            .unwrap();
        bus.publish("loop", 1).unwrap();
        quiet(&bus);
        within(LIMIT, &format!("{mode:?}"), move || drop(sub));
        assert!(
            wait_until(LIMIT, || Arc::strong_count(&token) == 1),
            "{mode:?}: the handler (and the bus clone it owns) was never dropped"
        );
    }
}

// ---------------------------------------------------------------------------
// 2. Unsubscribing releases what the handler owns.
// ---------------------------------------------------------------------------

/// A handler that captured a tokio `mpsc::Sender`: once its subscription is
/// dropped (and its deliveries have finished), the receiver sees `None`,
/// whether the handler was alone on its filter behind a warm route-cache
/// slot, or one of several live subscribers on it.
#[test]
fn dropping_a_subscription_drops_its_closure() {
    for mode in MODES {
        for others in [0usize, 5, 40] {
            let what = format!("{mode:?} beside {others} others");
            let rt = runtime(2);
            let bus = bus_on(mode, &rt);
            let _others: Vec<Subscription> = (0..others)
                .map(|_| bus.subscribe("t/+", |_: &Message<u32>| {}).unwrap())
                .collect();
            let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel::<u32>();
            let sub = bus
                .subscribe("t/+", move |m: &Message<u32>| {
                    let _ = tx.send(*m.data());
                })
                .unwrap();
            // Warm the route cache with a route that reaches the handler.
            bus.publish("t/a", 7).unwrap();
            quiet(&bus);
            drop(sub);
            let closed = rt.block_on(async {
                tokio::time::timeout(LIMIT, async {
                    assert_eq!(rx.recv().await, Some(7), "{what}");
                    rx.recv().await
                })
                .await
            });
            assert_eq!(closed, Ok(None), "{what}: the sender was never dropped");
            // The others still work.
            if others > 0 {
                assert_eq!(bus.publish("t/a", 8).unwrap(), others, "{what}");
            }
        }
    }
}

/// On a filter with more than 64 subscriptions a plain unsubscribe keeps
/// the closure until half of them have left (the set is compacted then:
/// a compaction per removal would make churn quadratic), as the docs say;
/// `unsubscribe_and_wait` releases it at once, whatever their number.
#[test]
fn a_large_filters_closure_is_released_as_documented() {
    let rt = runtime(1);
    let bus = Bus::<u32>::builder()
        .delivery(DeliveryMode::Inline)
        .build()
        .unwrap();
    let mut others: Vec<Subscription> = (0..100)
        .map(|_| {
            let own = Arc::new(());
            bus.subscribe("t", move |_: &Message<u32>| {
                let _keep = &own;
            })
            .unwrap()
        })
        .collect();
    let subscribe_holding = |token: &Arc<()>| {
        let held = Arc::clone(token);
        bus.subscribe("t", move |_: &Message<u32>| {
            let _keep = &held;
        })
        .unwrap()
    };
    // `unsubscribe_and_wait`: at once.
    let waited = Arc::new(());
    let sub = subscribe_holding(&waited);
    rt.block_on(sub.unsubscribe_and_wait());
    assert_eq!(
        Arc::strong_count(&waited),
        1,
        "kept after unsubscribe_and_wait"
    );
    // A plain unsubscribe: by the time half the set has left.
    let plain = Arc::new(());
    subscribe_holding(&plain).unsubscribe();
    bus.publish("t", 0).unwrap();
    let mut left = 1;
    while Arc::strong_count(&plain) > 1 {
        assert!(left <= 60, "kept after {left} of 101 left");
        others.pop().unwrap().unsubscribe();
        left += 1;
    }
}

/// Same for a stream of handlers on one filter, each captured value released
/// once its own subscription is gone, with publishes running all along.
#[test]
fn closures_are_released_while_publishes_run() {
    for mode in MODES {
        let rt = runtime(2);
        let bus = bus_on(mode, &rt);
        let delivered = Arc::new(AtomicU64::new(0));
        let tokens: Vec<Arc<()>> = (0..20).map(|_| Arc::new(())).collect();
        let mut subs: Vec<Subscription> = tokens
            .iter()
            .map(|token| {
                let token = Arc::clone(token);
                let delivered = Arc::clone(&delivered);
                bus.subscribe("busy", move |_: &Message<u32>| {
                    let _keep = &token;
                    delivered.fetch_add(1, Ordering::Relaxed);
                })
                .unwrap()
            })
            .collect();
        for round in 0..20u32 {
            bus.publish("busy", round).unwrap();
            let sub = subs.pop().unwrap();
            drop(sub);
        }
        quiet(&bus);
        for (index, token) in tokens.iter().enumerate() {
            assert!(
                wait_until(LIMIT, || Arc::strong_count(token) == 1),
                "{mode:?}: handler {index}'s closure is still alive after its unsubscribe"
            );
        }
    }
}

// ---------------------------------------------------------------------------
// 3. Nothing accepted vanishes uncounted when the runtime shuts down.
// ---------------------------------------------------------------------------

/// A `TaskPerSubscriber` bus whose runtime was dropped: publishes are still
/// accepted, but their runner tasks are dropped unpolled. Every delivery
/// must be counted as dropped, `inflight_messages()` must return to 0, and
/// `close()` must finish at once instead of waiting out its timeout.
#[test]
fn deliveries_are_counted_when_the_runtime_is_gone() {
    let rt = runtime(2);
    let bus = Bus::<u32>::builder()
        .delivery(DeliveryMode::TaskPerSubscriber)
        .runtime(rt.handle().clone())
        .close_timeout(Duration::from_secs(30))
        .build()
        .unwrap();
    let delivered = Arc::new(AtomicU64::new(0));
    let _subs: Vec<Subscription> = (0..100)
        .map(|_| {
            let delivered = Arc::clone(&delivered);
            bus.subscribe("gone", move |_: &Message<u32>| {
                delivered.fetch_add(1, Ordering::Relaxed);
            })
            .unwrap()
        })
        .collect();
    drop(rt);
    for value in 0..20 {
        assert_eq!(bus.publish("gone", value).unwrap(), 100);
    }
    assert!(
        wait_until(LIMIT, || bus.inflight_messages() == 0),
        "deliveries stuck in flight: {:?}",
        bus.stats()
    );
    let stats = bus.stats();
    assert_eq!(
        stats.delivered + stats.dropped,
        2_000,
        "every accepted delivery ran or was counted: {stats:?}"
    );
    assert_eq!(delivered.load(Ordering::Relaxed), stats.delivered);
    let closer = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let closed =
        closer.block_on(async { tokio::time::timeout(Duration::from_secs(5), bus.close()).await });
    assert!(matches!(closed, Ok(Ok(()))), "close: {closed:?}");
}

/// An async handler whose delivery is still pending when the runtime goes
/// away is counted as dropped, whatever mode it was started in.
#[test]
fn pending_async_deliveries_are_counted_when_the_runtime_is_gone() {
    for mode in MODES {
        let rt = runtime(2);
        let bus = bus_on(mode, &rt);
        let _sub = bus
            .subscribe_async("slow", |_m: Arc<Message<u32>>| async {
                std::future::pending::<()>().await;
            })
            .unwrap();
        for value in 0..10 {
            bus.publish("slow", value).unwrap();
        }
        drop(rt);
        assert!(
            wait_until(LIMIT, || bus.inflight_messages() == 0),
            "{mode:?}: deliveries stuck in flight: {:?}",
            bus.stats()
        );
        assert_eq!(bus.stats().dropped, 10, "{mode:?}: {:?}", bus.stats());
    }
}

// ---------------------------------------------------------------------------
// 5. After `CloseTimeout`, work still arriving from an admitted publish runs.
// ---------------------------------------------------------------------------

/// Two workers, a queue of two tickets (one each), `Batch::Single` (a
/// ticket per subscription). Worker A is blocked on `w` with a second `w`
/// ticket queued behind it, worker B on `b` likewise, so both queues are
/// full; a publish to two subscriptions of `c` runs its first runner itself
/// (`CallerRuns`) and blocks in it. `close()` times out meanwhile. Then A
/// drains its `w` ticket and takes B's `b` ticket (B is stalled): both
/// workers block in `b`, both queues are empty. The publish, let go, queues
/// its second runner. That runner must still run once B is let go (workers
/// may not stop while accepted work remains), and `close()` then succeeds.
#[test]
fn work_queued_after_a_close_timeout_still_runs() {
    use blazesub::{Batch, Overflow};
    let rt = runtime(2);
    let bus = Bus::<u32>::builder()
        .delivery(DeliveryMode::WorkerPool)
        .workers(2)
        .queue_capacity(2)
        .batch(Batch::Single)
        .max_concurrent_subscriptions(10)
        .overflow(Overflow::CallerRuns)
        .close_timeout(Duration::from_millis(100))
        .runtime(rt.handle().clone())
        .build()
        .unwrap();
    let blocking = |topic: &str| {
        let gate = Arc::new(common::Gate::new());
        let entered = Arc::new(common::Countdown::new());
        let sub = {
            let (gate, entered) = (Arc::clone(&gate), Arc::clone(&entered));
            bus.subscribe(topic, move |_: &Message<u32>| {
                entered.arrive();
                gate.wait();
            })
            .unwrap()
        };
        (gate, entered, sub)
    };
    let (w_gate, w_entered, _w) = blocking("w");
    let (b_gate, b_entered, _b) = blocking("b");
    let (c_gate, c_entered, _c1) = blocking("c");
    let second = Arc::new(AtomicU64::new(0));
    let _c2 = {
        let second = Arc::clone(&second);
        bus.subscribe("c", move |_: &Message<u32>| {
            second.fetch_add(1, Ordering::Relaxed);
        })
        .unwrap()
    };
    // Both workers running at once, then waiting: a worker that has not
    // started yet could have its first ticket taken over by the other.
    let both_in = Arc::new(std::sync::Barrier::new(2));
    let warm: Vec<_> = (0..2)
        .map(|_| {
            let both_in = Arc::clone(&both_in);
            bus.subscribe("warm", move |_: &Message<u32>| {
                both_in.wait();
            })
            .unwrap()
        })
        .collect();
    bus.publish("warm", 0).unwrap();
    assert!(wait_until(LIMIT, || bus.inflight_messages() == 0));
    drop(warm);
    // Routes get their home workers in turn: `w` A's, `b` B's.
    bus.publish("w", 1).unwrap();
    assert!(w_entered.wait_for(1, LIMIT));
    bus.publish("b", 1).unwrap();
    assert!(b_entered.wait_for(1, LIMIT));
    bus.publish("w", 2).unwrap(); // both queues fill
    bus.publish("b", 2).unwrap();
    let publisher = {
        let bus = bus.clone();
        std::thread::spawn(move || bus.publish("c", 4))
    };
    assert!(
        c_entered.wait_for(1, LIMIT),
        "the publisher runs its first runner"
    );
    let timed_out = rt.block_on(bus.close());
    assert!(
        matches!(timed_out, Err(blazesub::Error::CloseTimeout { .. })),
        "{timed_out:?}"
    );
    w_gate.open();
    assert!(w_entered.wait_for(2, LIMIT), "A drains its queue");
    assert!(b_entered.wait_for(2, LIMIT), "A takes over B's queue");
    c_gate.open();
    assert_eq!(publisher.join().unwrap().unwrap(), 2);
    std::thread::sleep(Duration::from_millis(50));
    assert_eq!(
        second.load(Ordering::Relaxed),
        0,
        "the second runner waits in a queue behind a blocked worker"
    );
    assert!(bus.inflight_messages() > 0);
    b_gate.open();
    assert!(
        wait_until(LIMIT, || bus.inflight_messages() == 0),
        "a delivery was queued behind the stop tickets and never ran: {:?}",
        bus.stats()
    );
    assert_eq!(second.load(Ordering::Relaxed), 1);
    assert!(rt.block_on(bus.close()).is_ok());
}

// ---------------------------------------------------------------------------
// 7. Handler closures need no annotations.
// ---------------------------------------------------------------------------

/// `subscribe` is bound on `Fn(&Message<T>)` itself, so a closure's argument
/// type is inferred (this file would not compile otherwise); a named
/// `Handler` type goes through `subscribe_handler`.
#[test]
fn closures_need_no_type_annotations() {
    struct Doubler(Arc<AtomicU64>);
    impl blazesub::Handler<u32> for Doubler {
        fn handle(&self, message: &Message<u32>) {
            self.0
                .fetch_add(2 * u64::from(*message.data()), Ordering::Relaxed);
        }
    }
    let bus = Bus::<u32>::builder()
        .delivery(DeliveryMode::Inline)
        .build()
        .unwrap();
    let sum = Arc::new(AtomicU64::new(0));
    let seen = Arc::clone(&sum);
    let _a = bus
        .subscribe("n/+", move |m| {
            seen.fetch_add(u64::from(*m.data()), Ordering::Relaxed);
            assert!(m.topic().starts_with("n/"));
        })
        .unwrap();
    let _b = bus
        .subscribe_handler("n/+", Doubler(Arc::clone(&sum)))
        .unwrap();
    assert_eq!(bus.publish("n/1", 5).unwrap(), 2);
    assert_eq!(sum.load(Ordering::Relaxed), 15);
    // The handler's own assertion is caught by the bus: counted, not thrown.
    assert_eq!(bus.stats().handler_panics, 0);
}

// ---------------------------------------------------------------------------
// 8. `unsubscribe_and_wait` returns once no call of the handler is running.
// ---------------------------------------------------------------------------

/// A slow sync handler is inside a call when `unsubscribe_and_wait` is
/// awaited: it returns only after that call has finished, and no call runs
/// after it. (Plain `unsubscribe` returns while the call is still running.)
#[test]
fn unsubscribe_and_wait_waits_for_a_running_sync_handler() {
    for mode in MODES {
        let rt = runtime(2);
        let bus = bus_on(mode, &rt);
        let inside = Arc::new(AtomicU64::new(0));
        let calls = Arc::new(AtomicU64::new(0));
        let entered = Arc::new(common::Countdown::new());
        let sub = {
            let (inside, calls, entered) = (
                Arc::clone(&inside),
                Arc::clone(&calls),
                Arc::clone(&entered),
            );
            bus.subscribe("slow", move |_| {
                inside.fetch_add(1, Ordering::SeqCst);
                entered.arrive();
                std::thread::sleep(Duration::from_millis(150));
                calls.fetch_add(1, Ordering::SeqCst);
                inside.fetch_sub(1, Ordering::SeqCst);
            })
            .unwrap()
        };
        let publisher = {
            let bus = bus.clone();
            // Inline runs the handler on the publisher: publish from a thread.
            std::thread::spawn(move || bus.publish("slow", 1).unwrap())
        };
        assert!(entered.wait_for(1, LIMIT), "{mode:?}");
        rt.block_on(async {
            tokio::time::timeout(LIMIT, sub.unsubscribe_and_wait())
                .await
                .expect("unsubscribe_and_wait hangs");
        });
        assert_eq!(
            inside.load(Ordering::SeqCst),
            0,
            "{mode:?}: a call is still running"
        );
        assert_eq!(calls.load(Ordering::SeqCst), 1, "{mode:?}");
        publisher.join().unwrap();
        bus.publish("slow", 2).unwrap();
        quiet(&bus);
        assert_eq!(
            calls.load(Ordering::SeqCst),
            1,
            "{mode:?}: called after the wait"
        );
    }
}

/// An async handler awaiting a timer counts as running until its future
/// completes.
#[test]
fn unsubscribe_and_wait_waits_for_a_pending_async_handler() {
    for mode in MODES {
        let rt = runtime(2);
        let bus = bus_on(mode, &rt);
        let inside = Arc::new(AtomicU64::new(0));
        let entered = Arc::new(common::Countdown::new());
        let sub = {
            let (inside, entered) = (Arc::clone(&inside), Arc::clone(&entered));
            bus.subscribe_async("slow", move |_m| {
                let (inside, entered) = (Arc::clone(&inside), Arc::clone(&entered));
                async move {
                    inside.fetch_add(1, Ordering::SeqCst);
                    entered.arrive();
                    tokio::time::sleep(Duration::from_millis(150)).await;
                    inside.fetch_sub(1, Ordering::SeqCst);
                }
            })
            .unwrap()
        };
        bus.publish("slow", 1).unwrap();
        assert!(entered.wait_for(1, LIMIT), "{mode:?}");
        rt.block_on(async {
            tokio::time::timeout(LIMIT, sub.unsubscribe_and_wait())
                .await
                .expect("unsubscribe_and_wait hangs");
        });
        assert_eq!(
            inside.load(Ordering::SeqCst),
            0,
            "{mode:?}: the future still runs"
        );
    }
}

/// A handler that unsubscribes itself and waits does not wait for itself:
/// an async handler awaiting it, and a sync handler blocking on it (on a
/// thread that may block: a pool worker, or an Inline publisher thread).
#[test]
fn a_handler_waiting_on_its_own_unsubscribe_does_not_deadlock() {
    type Slot = Arc<std::sync::Mutex<Option<Subscription>>>;
    for mode in MODES {
        let rt = runtime(2);
        let bus = bus_on(mode, &rt);
        let done = Arc::new(common::Countdown::new());
        // Async, every mode.
        let slot: Slot = Arc::default();
        let sub = {
            let (slot, done) = (Arc::clone(&slot), Arc::clone(&done));
            bus.subscribe_async("self/async", move |_m| {
                let (slot, done) = (Arc::clone(&slot), Arc::clone(&done));
                async move {
                    let own = slot.lock().unwrap().take();
                    if let Some(own) = own {
                        own.unsubscribe_and_wait().await;
                        done.arrive();
                    }
                }
            })
            .unwrap()
        };
        *slot.lock().unwrap() = Some(sub);
        bus.publish("self/async", 1).unwrap();
        assert!(
            done.wait_for(1, LIMIT),
            "{mode:?}: an async handler waits for itself"
        );
        if mode == DeliveryMode::TaskPerSubscriber {
            // Its handlers run on runtime threads, which must not block.
            continue;
        }
        let slot: Slot = Arc::default();
        let sub = {
            let (slot, done) = (Arc::clone(&slot), Arc::clone(&done));
            bus.subscribe("self/sync", move |_| {
                let own = slot.lock().unwrap().take();
                if let Some(own) = own {
                    common::block_on(own.unsubscribe_and_wait());
                    done.arrive();
                }
            })
            .unwrap()
        };
        *slot.lock().unwrap() = Some(sub);
        let publisher = {
            let bus = bus.clone();
            std::thread::spawn(move || bus.publish("self/sync", 1).unwrap())
        };
        assert!(
            done.wait_for(2, LIMIT),
            "{mode:?}: a sync handler waits for itself"
        );
        publisher.join().unwrap();
    }
}

/// With the last `Bus` handle dropped while a pool worker is inside the
/// handler, `unsubscribe_and_wait` still waits for that call: the worker
/// outlives the bus's handles, and so does what the wait watches.
#[test]
fn unsubscribe_and_wait_after_the_bus_is_dropped_waits_for_a_running_call() {
    let bus = Bus::<u32>::builder()
        .delivery(DeliveryMode::WorkerPool)
        .workers(2)
        .build()
        .unwrap();
    let inside = Arc::new(AtomicU64::new(0));
    let entered = Arc::new(common::Countdown::new());
    let sub = {
        let (inside, entered) = (Arc::clone(&inside), Arc::clone(&entered));
        bus.subscribe("slow", move |_| {
            inside.fetch_add(1, Ordering::SeqCst);
            entered.arrive();
            std::thread::sleep(Duration::from_millis(300));
            inside.fetch_sub(1, Ordering::SeqCst);
        })
        .unwrap()
    };
    bus.publish("slow", 1).unwrap();
    assert!(entered.wait_for(1, LIMIT));
    drop(bus);
    within(LIMIT, "unsubscribe_and_wait", move || {
        common::block_on(sub.unsubscribe_and_wait())
    });
    assert_eq!(
        inside.load(Ordering::SeqCst),
        0,
        "returned while the handler was still running"
    );
}

/// An async ordered handler's call is its `Fn` body as well as the future
/// it returns: `unsubscribe_and_wait` waits for a body still running (its
/// drain calls it as a runner, not before announcing itself).
#[test]
fn unsubscribe_and_wait_waits_for_an_async_ordered_handler_call() {
    for mode in MODES {
        let rt = runtime(2);
        let bus = bus_on(mode, &rt);
        let inside = Arc::new(AtomicU64::new(0));
        let entered = Arc::new(common::Countdown::new());
        let sub = {
            let (inside, entered) = (Arc::clone(&inside), Arc::clone(&entered));
            bus.subscribe_ordered_async("slow", move |_m| {
                inside.fetch_add(1, Ordering::SeqCst);
                entered.arrive();
                std::thread::sleep(Duration::from_millis(300));
                inside.fetch_sub(1, Ordering::SeqCst);
                async {}
            })
            .unwrap()
        };
        bus.publish("slow", 1).unwrap();
        assert!(entered.wait_for(1, LIMIT), "{mode:?}");
        within(LIMIT, "unsubscribe_and_wait", move || {
            common::block_on(sub.unsubscribe_and_wait())
        });
        assert_eq!(
            inside.load(Ordering::SeqCst),
            0,
            "{mode:?}: returned while the handler was still running"
        );
        quiet(&bus);
    }
}

/// `unsubscribe_and_wait` on bus B, blocked on by a handler of bus A on a
/// pool worker, waits for B's running call: A's runner on the waiting
/// thread is not one of B's, so it does not stand in for B's call.
#[test]
fn unsubscribe_and_wait_from_another_buss_handler_waits() {
    let pool = || {
        Bus::<u32>::builder()
            .delivery(DeliveryMode::WorkerPool)
            .workers(2)
            .build()
            .unwrap()
    };
    let (a, b) = (pool(), pool());
    let inside = Arc::new(AtomicU64::new(0));
    let entered = Arc::new(common::Countdown::new());
    let sub_b = {
        let (inside, entered) = (Arc::clone(&inside), Arc::clone(&entered));
        b.subscribe("slow", move |_| {
            inside.fetch_add(1, Ordering::SeqCst);
            entered.arrive();
            std::thread::sleep(Duration::from_millis(300));
            inside.fetch_sub(1, Ordering::SeqCst);
        })
        .unwrap()
    };
    b.publish("slow", 1).unwrap();
    assert!(entered.wait_for(1, LIMIT));
    let sub_b = std::sync::Mutex::new(Some(sub_b));
    let seen = Arc::new(std::sync::Mutex::new(None));
    let done = Arc::new(common::Countdown::new());
    let _waiter = {
        let (inside, seen, done) = (Arc::clone(&inside), Arc::clone(&seen), Arc::clone(&done));
        a.subscribe("go", move |_| {
            if let Some(sub) = sub_b.lock().unwrap().take() {
                common::block_on(sub.unsubscribe_and_wait());
                *seen.lock().unwrap() = Some(inside.load(Ordering::SeqCst));
                done.arrive();
            }
        })
        .unwrap()
    };
    a.publish("go", 1).unwrap();
    assert!(done.wait_for(1, LIMIT), "unsubscribe_and_wait hangs");
    assert_eq!(
        *seen.lock().unwrap(),
        Some(0),
        "returned while bus B's handler was still running"
    );
}

// ---------------------------------------------------------------------------
// 10. A refused publish hands the value back.
// ---------------------------------------------------------------------------

/// `try_publish` returns the value with the error when the bus refuses it
/// (closed, bad topic), as a channel's `send` does; `publish` keeps its plain
/// `Error`.
#[test]
fn a_refused_publish_hands_the_value_back() {
    let rt = runtime(1);
    let bus = Bus::<String>::builder()
        .delivery(DeliveryMode::Inline)
        .build()
        .unwrap();
    let _sub = bus.subscribe("a/+", |_| {}).unwrap();
    assert_eq!(bus.try_publish("a/1", "sent".to_string()).unwrap(), 1);
    let bad = bus.try_publish("a/+", "wildcard".to_string()).unwrap_err();
    assert!(matches!(bad.error, blazesub::Error::Topic(_)), "{bad:?}");
    assert_eq!(bad.into_value().as_deref(), Some("wildcard"));
    rt.block_on(bus.close()).unwrap();
    let closed = bus.try_publish("a/1", "late".to_string()).unwrap_err();
    assert!(
        matches!(closed.error, blazesub::Error::Closed),
        "{closed:?}"
    );
    assert_eq!(closed.value.as_deref(), Some("late"));
    assert_eq!(closed.to_string(), blazesub::Error::Closed.to_string());
    assert_eq!(bus.stats().published, 1);
}
