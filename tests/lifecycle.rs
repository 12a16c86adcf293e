//! Subscription and bus lifecycles through the public API: no queued
//! delivery runs after unsubscribe or drop, a dropped receiver leaves the
//! bus, `detach` keeps a subscription alive, and `close` drains everything it
//! accepted (or says it timed out), then refuses new work.

mod common;

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::task::Poll;
use std::time::Duration;

use blazesub::{Batch, Bus, DeliveryMode, Error, Message, Metadata, Receiver, Subscription};
use common::{block_on, wait_until, Gate, Hits, MODES};

/// Things the design promises about the handle types.
#[test]
fn handles_are_send_sync_and_recv_is_send() {
    fn send_sync_static<T: Send + Sync + 'static>() {}
    fn send<T: Send>(_: &T) {}
    send_sync_static::<Bus<u32>>();
    send_sync_static::<Subscription>();
    send_sync_static::<Receiver<u32>>();
    let bus = Bus::<u32>::builder()
        .delivery(DeliveryMode::Inline)
        .build()
        .unwrap();
    let mut rx = bus.subscribe_stream("x").unwrap();
    send(&rx.recv());
}

// ---------------------------------------------------------------------------
// 3. No delivery after unsubscribe.
// ---------------------------------------------------------------------------

/// A slow handler (counts, then sleeps 1 ms) on one worker, with 200
/// messages queued behind it. Once `unsubscribe` (or dropping the handle)
/// returns, none of its queued deliveries may start: its count is frozen.
/// A fast witness subscription on the same topic still gets every message.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn queued_deliveries_do_not_run_after_unsubscribe() {
    const N: u32 = 200;
    for by_drop in [false, true] {
        for (batch, threshold) in [
            (Batch::Chunked, 10),
            (Batch::Single, 10),
            (Batch::Chunked, 1),
            (Batch::Single, 1),
        ] {
            let what = format!("drop: {by_drop}, {batch:?} threshold {threshold}");
            // One worker: the slow handler's deliveries run one at a time, so
            // right after its count moves it is sleeping, not about to start.
            let bus = Bus::<u32>::builder()
                .delivery(DeliveryMode::WorkerPool)
                .workers(1)
                .batch(batch)
                .max_concurrent_subscriptions(threshold)
                .build()
                .unwrap();
            let calls = Arc::new(AtomicU64::new(0));
            let counted = Arc::clone(&calls);
            let slow = bus
                .subscribe("q/x", move |_: &Message<u32>| {
                    counted.fetch_add(1, Ordering::SeqCst);
                    std::thread::sleep(Duration::from_millis(1));
                })
                .unwrap();
            let witness = Arc::new(Hits::new(N as usize));
            let mine = Arc::clone(&witness);
            let _witness = bus
                .subscribe("q/+", move |m: &Message<u32>| mine.hit(*m.data()))
                .unwrap();
            for id in 0..N {
                assert_eq!(bus.publish("q/x", id).unwrap(), 2);
            }
            assert!(
                wait_until(Duration::from_secs(10), || calls.load(Ordering::SeqCst)
                    >= 3),
                "{what}: the slow handler never ran"
            );
            if by_drop {
                drop(slow);
            } else {
                slow.unsubscribe();
            }
            let at_unsubscribe = calls.load(Ordering::SeqCst);
            assert!(
                at_unsubscribe < u64::from(N),
                "{what}: nothing was still queued, the test proves nothing"
            );
            assert_eq!(bus.subscriptions_count(), 1, "{what}");
            bus.close().await.unwrap();
            assert_eq!(
                calls.load(Ordering::SeqCst),
                at_unsubscribe,
                "{what}: deliveries queued for an unsubscribed handler still ran"
            );
            witness.assert_exactly_once(&format!("{what}: witness"));
            let stats = bus.stats();
            assert_eq!(
                stats.delivered,
                u64::from(N) + at_unsubscribe,
                "{what}: delivered = witness + slow calls"
            );
            assert_eq!(stats.dropped, 0, "{what}");
            assert_eq!(bus.inflight_messages(), 0, "{what}");
        }
    }
}

/// A dropped `Receiver` unsubscribes: it is no longer matched or counted,
/// later publishes are not counted as lost for it, and the messages it left
/// unread are counted as dropped (nothing vanishes without a count).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dropped_receiver_unsubscribes() {
    for mode in MODES {
        let bus = Bus::<u32>::builder()
            .delivery(mode)
            .workers(2)
            .build()
            .unwrap();
        let rx = bus.subscribe_stream("r/#").unwrap();
        let mut other = bus.subscribe_stream("r/+").unwrap();
        assert_eq!(bus.subscriptions_count(), 2);
        for id in 0..5 {
            assert_eq!(bus.publish("r/x", id).unwrap(), 2, "{mode:?}");
        }
        drop(rx);
        assert_eq!(bus.subscriptions_count(), 1, "{mode:?}");
        for id in 5..2_000 {
            assert_eq!(
                bus.publish("r/x", id).unwrap(),
                1,
                "{mode:?}: a dropped receiver is still matched"
            );
        }
        let stats = bus.stats();
        let unread_when_dropped = 5;
        assert_eq!(
            stats.dropped,
            2_000 - other.capacity() as u64 + unread_when_dropped,
            "{mode:?}: the live, unread receiver's losses plus what the dropped one left unread"
        );
        assert_eq!(other.lost(), stats.dropped - unread_when_dropped);
        bus.close().await.unwrap();
        let mut last = None;
        while let Some(m) = other.recv().await {
            last = Some(*m.data());
        }
        assert_eq!(last, Some(1_999));
    }
}

/// `detach` keeps a subscription for the life of the bus although its handle
/// is gone; a dropped handle unsubscribes at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn detach_keeps_the_subscription_drop_removes_it() {
    for mode in MODES {
        let bus = Bus::<u32>::builder()
            .delivery(mode)
            .workers(2)
            .build()
            .unwrap();
        let detached = Arc::new(AtomicU64::new(0));
        let dropped = Arc::new(AtomicU64::new(0));
        let (d, x) = (Arc::clone(&detached), Arc::clone(&dropped));
        bus.subscribe("k/#", move |_: &Message<u32>| {
            d.fetch_add(1, Ordering::Relaxed);
        })
        .unwrap()
        .detach();
        let sub = bus
            .subscribe("k/#", move |_: &Message<u32>| {
                x.fetch_add(1, Ordering::Relaxed);
            })
            .unwrap();
        assert_eq!(sub.filter(), "k/#");
        drop(sub);
        assert_eq!(bus.subscriptions_count(), 1, "{mode:?}");
        for id in 0..100 {
            assert_eq!(bus.publish("k/1", id).unwrap(), 1, "{mode:?}");
        }
        bus.publish_with("k/2", 100, Metadata::new().with("a", "b"))
            .unwrap();
        bus.close().await.unwrap();
        assert_eq!(detached.load(Ordering::Relaxed), 101, "{mode:?}");
        assert_eq!(dropped.load(Ordering::Relaxed), 0, "{mode:?}");
    }
}

// ---------------------------------------------------------------------------
// 7. Close.
// ---------------------------------------------------------------------------

/// Checks that a closed bus refuses every kind of new work with
/// `Error::Closed`.
fn assert_refuses_new_work(bus: &Bus<u32>, what: &str) {
    assert!(bus.is_closed(), "{what}");
    assert!(
        matches!(bus.publish("c/x", 0), Err(Error::Closed)),
        "{what}: publish after close"
    );
    assert!(
        matches!(
            bus.publish_with("c/x", 0, Metadata::new()),
            Err(Error::Closed)
        ),
        "{what}: publish_with after close"
    );
    assert!(
        matches!(
            bus.subscribe("c/#", |_: &Message<u32>| {}),
            Err(Error::Closed)
        ),
        "{what}: subscribe after close"
    );
    assert!(
        matches!(bus.subscribe_stream("c/#"), Err(Error::Closed)),
        "{what}: subscribe_stream after close"
    );
    assert!(
        matches!(
            bus.subscribe_async("c/#", |_: Arc<Message<u32>>| async {}),
            Err(Error::Closed)
        ),
        "{what}: subscribe_async after close"
    );
}

/// Slow handlers (sleep 1 ms) with deliveries queued: `close` returns Ok only
/// once every accepted delivery ran; then nothing new is accepted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn close_drains_slow_handlers_then_refuses_work() {
    const SLOW_SUBS: u64 = 4;
    const N: u32 = 30;
    for mode in MODES {
        let bus = Bus::<u32>::builder()
            .delivery(mode)
            .workers(2)
            .build()
            .unwrap();
        let done = Arc::new(AtomicU64::new(0));
        let _subs: Vec<Subscription> = (0..SLOW_SUBS)
            .map(|_| {
                let done = Arc::clone(&done);
                bus.subscribe("c/#", move |_: &Message<u32>| {
                    std::thread::sleep(Duration::from_millis(1));
                    done.fetch_add(1, Ordering::SeqCst);
                })
                .unwrap()
            })
            .collect();
        for id in 0..N {
            bus.publish("c/x", id).unwrap();
        }
        bus.close().await.unwrap();
        assert_eq!(
            done.load(Ordering::SeqCst),
            SLOW_SUBS * u64::from(N),
            "{mode:?}: close returned before every accepted delivery ran"
        );
        assert_eq!(bus.inflight_messages(), 0, "{mode:?}");
        assert_eq!(bus.stats().delivered, SLOW_SUBS * u64::from(N), "{mode:?}");
        assert_refuses_new_work(&bus, &format!("{mode:?}"));
        // Closing again is fine.
        bus.close().await.unwrap();
    }
}

/// Polls `future` once, with the current task's waker.
async fn poll_once<F: Future + Unpin>(future: &mut F) -> Poll<F::Output> {
    std::future::poll_fn(|cx| Poll::Ready(Pin::new(&mut *future).poll(cx))).await
}

/// The same, deterministically: every delivery blocks at a gate, so while it
/// is shut `close` must stay pending with all of them in flight, and the bus
/// already refuses new work. Runs the `TaskPerSubscriber` bus on a runtime of
/// its own (`BusBuilder::runtime`), since its handlers block their threads.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn close_is_pending_until_blocked_deliveries_finish() {
    const SUBS: u64 = 3;
    const N: u32 = 20;
    let own_runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .thread_name("bus-own-runtime")
        .enable_all()
        .build()
        .unwrap();
    for mode in [DeliveryMode::WorkerPool, DeliveryMode::TaskPerSubscriber] {
        let bus = Bus::<u32>::builder()
            .delivery(mode)
            .workers(2)
            .runtime(own_runtime.handle().clone())
            .build()
            .unwrap();
        let gate = Arc::new(Gate::new());
        let done = Arc::new(AtomicU64::new(0));
        let elsewhere = Arc::new(AtomicU64::new(0));
        let _subs: Vec<Subscription> = (0..SUBS)
            .map(|_| {
                let (gate, done) = (Arc::clone(&gate), Arc::clone(&done));
                let elsewhere = Arc::clone(&elsewhere);
                bus.subscribe("g/x", move |_: &Message<u32>| {
                    // Tasks go to the runtime given to the builder, never to
                    // the publisher's.
                    if mode == DeliveryMode::TaskPerSubscriber
                        && std::thread::current().name() != Some("bus-own-runtime")
                    {
                        elsewhere.fetch_add(1, Ordering::SeqCst);
                    }
                    gate.wait();
                    done.fetch_add(1, Ordering::SeqCst);
                })
                .unwrap()
            })
            .collect();
        for id in 0..N {
            bus.publish("g/x", id).unwrap();
        }
        let accepted = SUBS * u64::from(N);
        assert_eq!(bus.inflight_messages(), accepted, "{mode:?}");

        let mut close = Box::pin(bus.close());
        assert!(
            poll_once(&mut close).await.is_pending(),
            "{mode:?}: close finished with every delivery still blocked"
        );
        assert_refuses_new_work(&bus, &format!("{mode:?} while closing"));
        tokio::time::sleep(Duration::from_millis(30)).await;
        assert!(
            poll_once(&mut close).await.is_pending(),
            "{mode:?}: close finished with every delivery still blocked"
        );
        assert_eq!(done.load(Ordering::SeqCst), 0);
        assert_eq!(bus.inflight_messages(), accepted, "{mode:?}");

        gate.open();
        tokio::time::timeout(Duration::from_secs(10), close)
            .await
            .expect("close did not finish after the gate opened")
            .unwrap();
        assert_eq!(done.load(Ordering::SeqCst), accepted, "{mode:?}");
        assert_eq!(bus.inflight_messages(), 0, "{mode:?}");
        assert_eq!(
            elsewhere.load(Ordering::SeqCst),
            0,
            "{mode:?}: a task ran outside the runtime given to the builder"
        );
    }
    own_runtime.shutdown_background();
}

/// A handler that takes 2 s against a 100 ms `close_timeout`: `close` gives
/// up with `Error::CloseTimeout`, the bus stays closed, and the delivery
/// still finishes afterwards (then `close` succeeds).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn close_times_out_on_a_stuck_handler() {
    let mut buses = Vec::new();
    for mode in MODES {
        let bus = Bus::<u32>::builder()
            .delivery(mode)
            .workers(2)
            .close_timeout(Duration::from_millis(100))
            .build()
            .unwrap();
        let done = Arc::new(AtomicU64::new(0));
        let finished = Arc::clone(&done);
        // Inline runs sync handlers inside `publish`; an async handler is what
        // can still be running when it is closed.
        let sub = if mode == DeliveryMode::Inline {
            bus.subscribe_async("t/x", move |_: Arc<Message<u32>>| {
                let finished = Arc::clone(&finished);
                async move {
                    tokio::time::sleep(Duration::from_secs(2)).await;
                    finished.fetch_add(1, Ordering::SeqCst);
                }
            })
        } else {
            bus.subscribe("t/x", move |_: &Message<u32>| {
                std::thread::sleep(Duration::from_secs(2));
                finished.fetch_add(1, Ordering::SeqCst);
            })
        }
        .unwrap();
        bus.publish("t/x", 0).unwrap();
        buses.push((mode, bus, done, sub));
    }
    for (mode, bus, done, _) in &buses {
        match bus.close().await {
            Err(Error::CloseTimeout { waited, inflight }) => {
                assert!(waited >= Duration::from_millis(100), "{mode:?}: {waited:?}");
                assert_eq!(inflight, 1, "{mode:?}");
            }
            other => panic!("{mode:?}: expected Error::CloseTimeout, got {other:?}"),
        }
        assert_eq!(done.load(Ordering::SeqCst), 0, "{mode:?}");
        assert_refuses_new_work(bus, &format!("{mode:?} after a timed-out close"));
    }
    for (mode, bus, done, _) in &buses {
        assert!(
            wait_until(Duration::from_secs(10), || bus.inflight_messages() == 0),
            "{mode:?}: the stuck delivery never finished"
        );
        bus.close().await.unwrap();
        assert_eq!(done.load(Ordering::SeqCst), 1, "{mode:?}");
        assert_eq!(bus.stats().delivered, 1, "{mode:?}");
    }
}

/// `close()` awaited by an async handler finishes once everything else has
/// drained, also when the runner that first polled it claimed other
/// deliveries with it (`Inline`: the whole publish; `WorkerPool` above the
/// threshold: a chunk): once that poll has returned, only the handler's own
/// delivery is its caller's, and a slow handler elsewhere is waited for.
#[test]
fn close_from_an_async_handler_in_a_multi_delivery_claim_waits_for_others() {
    const LIMIT: Duration = Duration::from_secs(10);
    for (mode, threshold) in [(DeliveryMode::Inline, 10), (DeliveryMode::WorkerPool, 1)] {
        let what = format!("{mode:?}");
        let rt = common::runtime(2);
        let bus = Bus::<u32>::builder()
            .delivery(mode)
            .workers(2)
            .max_concurrent_subscriptions(threshold)
            .runtime(rt.handle().clone())
            .build()
            .unwrap();
        let slow_done = Arc::new(AtomicU64::new(0));
        let slow_started = Arc::new(common::Countdown::new());
        let _slow = {
            let (done, started) = (Arc::clone(&slow_done), Arc::clone(&slow_started));
            bus.subscribe("slow", move |_: &Message<u32>| {
                started.arrive();
                std::thread::sleep(Duration::from_millis(300));
                done.store(1, Ordering::SeqCst);
            })
            .unwrap()
        };
        let closed = Arc::new(common::Countdown::new());
        let saw_slow_done = Arc::new(AtomicU64::new(0));
        let _closer = {
            let (inner, closed, saw, slow) = (
                bus.clone(),
                Arc::clone(&closed),
                Arc::clone(&saw_slow_done),
                Arc::clone(&slow_done),
            );
            bus.subscribe_async("close", move |_m| {
                let (bus, closed, saw, slow) = (
                    inner.clone(),
                    Arc::clone(&closed),
                    Arc::clone(&saw),
                    Arc::clone(&slow),
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
        // Cheap handlers on the same topic, claimed with the closer.
        let cheap = Arc::new(AtomicU64::new(0));
        let _cheap: Vec<Subscription> = (0..9)
            .map(|_| {
                let cheap = Arc::clone(&cheap);
                bus.subscribe("close", move |_: &Message<u32>| {
                    cheap.fetch_add(1, Ordering::SeqCst);
                })
                .unwrap()
            })
            .collect();
        let slow_publisher = {
            let bus = bus.clone();
            std::thread::spawn(move || bus.publish("slow", 1).unwrap())
        };
        assert!(slow_started.wait_for(1, LIMIT), "{what}");
        let closer = {
            let bus = bus.clone();
            std::thread::spawn(move || bus.publish("close", 1).unwrap())
        };
        assert!(closed.wait_for(1, LIMIT), "{what}: close never returned");
        assert_eq!(
            saw_slow_done.load(Ordering::SeqCst),
            1,
            "{what}: close returned before the slow handler elsewhere finished"
        );
        assert_eq!(cheap.load(Ordering::SeqCst), 9, "{what}");
        slow_publisher.join().unwrap();
        closer.join().unwrap();
    }
}

/// `close()` blocked on by a sync handler waits for an async delivery the
/// same runner ran just before it, whose future is still pending and
/// continues as a task: that delivery left the runner's stack, so the
/// handler's caller no longer holds it. (The runner's claim used to keep
/// counting it as the caller's until the run ended, and `close` returned
/// with it still running.) One pool worker runs both deliveries of the
/// publish, the async one first.
#[test]
fn close_from_a_handler_waits_for_an_async_delivery_its_runner_handed_to_a_task() {
    const LIMIT: Duration = Duration::from_secs(10);
    let rt = common::runtime(2);
    let bus = Bus::<u32>::builder()
        .delivery(DeliveryMode::WorkerPool)
        .workers(1)
        .runtime(rt.handle().clone())
        .build()
        .unwrap();
    let gate = Arc::new(tokio::sync::Semaphore::new(0));
    let async_done = Arc::new(AtomicU64::new(0));
    let _waiting = {
        let (gate, done) = (Arc::clone(&gate), Arc::clone(&async_done));
        bus.subscribe_async("t", move |_| {
            let (gate, done) = (Arc::clone(&gate), Arc::clone(&done));
            async move {
                gate.acquire().await.unwrap().forget();
                done.store(1, Ordering::SeqCst);
            }
        })
        .unwrap()
    };
    let closed = Arc::new(common::Countdown::new());
    let saw_async_done = Arc::new(AtomicU64::new(u64::MAX));
    let _closer = {
        let (inner, handle) = (bus.clone(), rt.handle().clone());
        let (closed, saw, done) = (
            Arc::clone(&closed),
            Arc::clone(&saw_async_done),
            Arc::clone(&async_done),
        );
        bus.subscribe("t", move |_: &Message<u32>| {
            let result = handle.block_on(inner.close());
            assert!(result.is_ok(), "{result:?}");
            saw.store(done.load(Ordering::SeqCst), Ordering::SeqCst);
            closed.arrive();
        })
        .unwrap()
    };
    bus.publish("t", 1).unwrap();
    // Long enough for a `close` that does not wait to have returned.
    let returned_early = closed.wait_for(1, Duration::from_millis(300));
    gate.add_permits(1);
    assert!(closed.wait_for(1, LIMIT), "close never returned");
    assert!(
        !returned_early && saw_async_done.load(Ordering::SeqCst) == 1,
        "close returned while the async delivery was still running"
    );
    // The closer's own delivery is counted once its handler has returned.
    assert!(
        wait_until(LIMIT, || bus.stats().delivered == 2),
        "{:?}",
        bus.stats()
    );
}

/// `close()` awaited inside an async ordered handler's call, with the next
/// message already queued behind that call in the same subscription's
/// mailbox: that message cannot run before the call returns, so `close`
/// does not wait for it (it runs once the call has returned, as a sync
/// ordered handler's next message does). It used to wait for it until
/// `close_timeout` and fail with `CloseTimeout`. The call for message 0
/// waits until message 1 is queued before it closes. Every mode.
#[test]
fn close_from_an_async_ordered_handler_does_not_wait_for_its_own_queue() {
    const LIMIT: Duration = Duration::from_secs(10);
    for mode in common::MODES {
        let rt = common::runtime(2);
        let bus = Bus::<u32>::builder()
            .delivery(mode)
            .workers(2)
            .close_timeout(Duration::from_secs(3))
            .runtime(rt.handle().clone())
            .build()
            .unwrap();
        let (closed, result) = std::sync::mpsc::channel();
        let go = Arc::new(tokio::sync::Semaphore::new(0));
        let calls = Arc::new(AtomicU64::new(0));
        let _closer = {
            let (inner, go, calls) = (bus.clone(), Arc::clone(&go), Arc::clone(&calls));
            let closed = std::sync::Mutex::new(closed);
            bus.subscribe_ordered_async("close", move |m| {
                let (bus, go, calls) = (inner.clone(), Arc::clone(&go), Arc::clone(&calls));
                let closed = closed.lock().unwrap().clone();
                async move {
                    if *m.data() == 0 {
                        go.acquire().await.unwrap().forget();
                        let _ = closed.send(bus.close().await);
                    }
                    calls.fetch_add(1, Ordering::SeqCst);
                }
            })
            .unwrap()
        };
        bus.publish("close", 0).unwrap();
        bus.publish("close", 1).unwrap();
        go.add_permits(1);
        let result = result
            .recv_timeout(LIMIT)
            .unwrap_or_else(|_| panic!("{mode:?}: close from the handler never returned"));
        assert!(result.is_ok(), "{mode:?}: {result:?}");
        assert!(
            common::wait_until(LIMIT, || bus.inflight_messages() == 0),
            "{mode:?}: {:?}",
            bus.stats()
        );
        assert_eq!(calls.load(Ordering::SeqCst), 2, "{mode:?}: both calls ran");
    }
}

/// `close()` of bus B, blocked on by a handler of bus A on a pool worker,
/// returns Ok only once B's running delivery has finished: what the
/// worker's stack holds is A's, not B's, so it is waited for like any.
#[test]
fn close_from_another_buss_handler_waits_for_its_deliveries() {
    let pool = || {
        Bus::<u32>::builder()
            .delivery(DeliveryMode::WorkerPool)
            .workers(2)
            .build()
            .unwrap()
    };
    let (a, b) = (pool(), pool());
    let finished = Arc::new(AtomicU64::new(0));
    let entered = Arc::new(common::Countdown::new());
    let _slow = {
        let (finished, entered) = (Arc::clone(&finished), Arc::clone(&entered));
        b.subscribe("slow", move |_: &Message<u32>| {
            entered.arrive();
            std::thread::sleep(Duration::from_millis(300));
            finished.fetch_add(1, Ordering::SeqCst);
        })
        .unwrap()
    };
    b.publish("slow", 1).unwrap();
    assert!(entered.wait_for(1, Duration::from_secs(10)));
    let seen = Arc::new(std::sync::Mutex::new(None));
    let done = Arc::new(common::Countdown::new());
    let _closer = {
        let (b, finished) = (b.clone(), Arc::clone(&finished));
        let (seen, done) = (Arc::clone(&seen), Arc::clone(&done));
        a.subscribe("go", move |_: &Message<u32>| {
            let result = block_on(b.close());
            *seen.lock().unwrap() = Some((
                result.is_ok(),
                finished.load(Ordering::SeqCst),
                b.inflight_messages(),
            ));
            done.arrive();
        })
        .unwrap()
    };
    a.publish("go", 1).unwrap();
    assert!(
        done.wait_for(1, Duration::from_secs(10)),
        "close from the other bus's handler never returned"
    );
    let (ok, finished, inflight) = seen.lock().unwrap().unwrap();
    assert!(ok, "close failed");
    assert_eq!(
        (finished, inflight),
        (1, 0),
        "bus B's close returned Ok before its delivery finished"
    );
}

/// Without any tokio runtime, `WorkerPool` and `Inline` buses work from plain
/// threads, and `close` and `recv` complete on a non-tokio executor.
#[test]
fn works_outside_any_runtime() {
    const SUBS: u64 = 4;
    const N: u32 = 20;
    for mode in [DeliveryMode::WorkerPool, DeliveryMode::Inline] {
        let bus = Bus::<u32>::builder()
            .delivery(mode)
            .workers(2)
            .build()
            .unwrap();
        let done = Arc::new(AtomicU64::new(0));
        let _subs: Vec<Subscription> = (0..SUBS)
            .map(|_| {
                let done = Arc::clone(&done);
                bus.subscribe("n/#", move |_: &Message<u32>| {
                    std::thread::sleep(Duration::from_millis(1));
                    done.fetch_add(1, Ordering::SeqCst);
                })
                .unwrap()
            })
            .collect();
        let mut rx = bus.subscribe_stream("n/#").unwrap();
        let publishers: Vec<_> = (0..2)
            .map(|p| {
                let bus = bus.clone();
                std::thread::spawn(move || {
                    for id in 0..N {
                        bus.publish(&format!("n/{p}"), id).unwrap();
                    }
                })
            })
            .collect();
        for publisher in publishers {
            publisher.join().unwrap();
        }
        block_on(bus.close()).unwrap();
        assert_eq!(
            done.load(Ordering::SeqCst),
            2 * SUBS * u64::from(N),
            "{mode:?}"
        );
        let mut received = 0;
        while block_on(rx.recv()).is_some() {
            received += 1;
        }
        assert_eq!(received, 2 * N, "{mode:?}");
        assert_eq!(bus.inflight_messages(), 0, "{mode:?}");
    }
}
