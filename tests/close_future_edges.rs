//! The future `close` returns (it closes the bus when called) handed to
//! another thread or task, made outside a handler and awaited inside one,
//! or awaited after an await point: it excludes from its wait only what
//! the stack that first polls it holds. Two tests failed on a version
//! that looked at the stack where `close` was called (it returned with a
//! handler of the publish still running, or timed out waiting for the
//! handler awaiting it). Also: `request_many` keeps the first replies,
//! late ones counted, and the eager release of a closure on a small set
//! neither drops a running closure nor grows in cost.

mod common;

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use blazesub::{Bus, DeliveryMode, Error, Message};
use common::{runtime, within};

type CloseFuture = Pin<Box<dyn Future<Output = Result<(), Error>> + Send>>;

/// Runs `f` on a thread; fails the test if it does not finish in `secs`.
fn wait_until(secs: u64, mut cond: impl FnMut() -> bool) -> bool {
    let deadline = Instant::now() + Duration::from_secs(secs);
    while !cond() {
        if Instant::now() > deadline {
            return false;
        }
        std::thread::sleep(Duration::from_millis(1));
    }
    true
}

/// A sync handler calls `close()` and hands the future to another thread,
/// which awaits it; another handler of the same publish is still running.
/// `close` must wait for it ("waits until every accepted delivery has
/// finished"): the handler that called it has returned.
fn sync_handler_hands_off_close(mode: DeliveryMode) {
    within(Duration::from_secs(20), "the test", move || {
        let rt = runtime(2);
        let bus = Bus::<u32>::builder()
            .delivery(mode)
            .workers(1)
            .runtime(rt.handle().clone())
            .close_timeout(Duration::from_secs(5))
            .build()
            .unwrap();
        let (tx, rx) = std::sync::mpsc::channel::<CloseFuture>();
        let tx = Mutex::new(tx);
        let closer = bus.clone();
        let order = Arc::new(Mutex::new(Vec::new()));
        let o = Arc::clone(&order);
        let _a = bus
            .subscribe("x", move |_m: &Message<u32>| {
                o.lock().unwrap().push("a");
                let f = closer.close();
                tx.lock().unwrap().send(Box::pin(f)).unwrap();
            })
            .unwrap();
        let done = Arc::new(AtomicBool::new(false));
        let (d, o) = (Arc::clone(&done), Arc::clone(&order));
        let _b = bus
            .subscribe("x", move |_m: &Message<u32>| {
                o.lock().unwrap().push("b");
                std::thread::sleep(Duration::from_millis(500));
                d.store(true, Ordering::SeqCst);
            })
            .unwrap();
        let publisher = {
            let bus = bus.clone();
            std::thread::spawn(move || bus.publish("x", 1))
        };
        let f = rx.recv_timeout(Duration::from_secs(5)).unwrap();
        let t = Instant::now();
        let r = rt.block_on(f);
        let took = t.elapsed();
        let finished = done.load(Ordering::SeqCst);
        let inflight = bus.inflight_messages();
        publisher.join().unwrap().unwrap();
        let order = order.lock().unwrap().clone();
        assert!(r.is_ok(), "{mode:?}: {r:?}");
        assert!(
            finished,
            "{mode:?}: close returned {r:?} after {took:?} while the other handler of the publish still ran (inflight {inflight}, order {order:?})"
        );
    });
}

#[test]
fn close_from_a_sync_handler_awaited_on_another_thread_waits_for_the_rest_inline() {
    sync_handler_hands_off_close(DeliveryMode::Inline);
}

#[test]
fn close_from_a_sync_handler_awaited_on_another_thread_waits_for_the_rest_pool() {
    sync_handler_hands_off_close(DeliveryMode::WorkerPool);
}

#[test]
fn close_from_a_sync_handler_awaited_on_another_thread_waits_for_the_rest_tasks() {
    sync_handler_hands_off_close(DeliveryMode::TaskPerSubscriber);
}

/// An async handler spawns `close()` as a task of its own and goes on
/// working: the spawned close is not the handler's own caller, so it must
/// wait for the handler's delivery.
#[test]
fn close_spawned_by_an_async_handler_waits_for_that_handler() {
    within(Duration::from_secs(20), "the test", || {
        let rt = runtime(2);
        for mode in [
            DeliveryMode::TaskPerSubscriber,
            DeliveryMode::WorkerPool,
            DeliveryMode::Inline,
        ] {
            let bus = Bus::<u32>::builder()
                .delivery(mode)
                .workers(2)
                .runtime(rt.handle().clone())
                .close_timeout(Duration::from_secs(5))
                .build()
                .unwrap();
            let (tx, rx) = std::sync::mpsc::channel();
            let tx = Arc::new(Mutex::new(tx));
            let done = Arc::new(AtomicBool::new(false));
            let closer = bus.clone();
            let d = Arc::clone(&done);
            let _a = bus
                .subscribe_async("x", move |_m: Arc<Message<u32>>| {
                    let closer = closer.clone();
                    let tx = Arc::clone(&tx);
                    let d = Arc::clone(&d);
                    async move {
                        let h = tokio::spawn(closer.close());
                        tx.lock().unwrap().send(h).unwrap();
                        tokio::time::sleep(Duration::from_millis(500)).await;
                        d.store(true, Ordering::SeqCst);
                    }
                })
                .unwrap();
            bus.publish("x", 1).unwrap();
            let h = rx.recv_timeout(Duration::from_secs(5)).unwrap();
            let t = Instant::now();
            let r = rt.block_on(h).unwrap();
            let took = t.elapsed();
            let finished = done.load(Ordering::SeqCst);
            let inflight = bus.inflight_messages();
            assert!(r.is_ok(), "{mode:?}: {r:?}");
            assert!(
                finished,
                "{mode:?}: the spawned close returned {r:?} after {took:?} with the handler still running (inflight {inflight})"
            );
        }
    });
}

/// A close future made outside any handler, awaited inside an async
/// handler (which was running before the close): before 542afc1 it was
/// captured at its first poll, inside the handler, and returned.
#[test]
fn close_made_outside_awaited_inside_an_async_handler() {
    within(Duration::from_secs(20), "the test", || {
        let rt = runtime(2);
        let bus = Bus::<u32>::builder()
            .delivery(DeliveryMode::TaskPerSubscriber)
            .runtime(rt.handle().clone())
            .close_timeout(Duration::from_secs(2))
            .build()
            .unwrap();
        let (ftx, frx) = tokio::sync::oneshot::channel::<CloseFuture>();
        let frx = Mutex::new(Some(frx));
        let (rtx, rrx) = std::sync::mpsc::channel();
        let rtx = Mutex::new(rtx);
        let started = Arc::new(AtomicBool::new(false));
        let s = Arc::clone(&started);
        let rtx = Arc::new(rtx);
        let _a = bus
            .subscribe_async("x", move |_m: Arc<Message<u32>>| {
                let frx = frx.lock().unwrap().take().unwrap();
                let s = Arc::clone(&s);
                let rtx = Arc::clone(&rtx);
                async move {
                    s.store(true, Ordering::SeqCst);
                    let f = frx.await.unwrap();
                    let t = Instant::now();
                    let r = f.await;
                    rtx.lock().unwrap().send((r, t.elapsed())).unwrap();
                }
            })
            .unwrap();
        bus.publish("x", 1).unwrap();
        assert!(wait_until(5, || started.load(Ordering::SeqCst)));
        let _ = ftx.send(Box::pin(bus.close()));
        let (r, took) = rrx.recv_timeout(Duration::from_secs(10)).unwrap();
        assert!(
            r.is_ok(),
            "close awaited in a handler: {r:?} after {took:?}"
        );
    });
}

/// An async handler makes the close future, awaits something else (maybe
/// resumed on another worker), then awaits it: it returns, and only once
/// the rest of its publish (a slow sync handler) has finished.
#[test]
fn close_made_in_an_async_handler_awaited_after_an_await_point() {
    within(Duration::from_secs(20), "the test", || {
        let rt = runtime(2);
        for mode in [DeliveryMode::TaskPerSubscriber, DeliveryMode::WorkerPool] {
            let bus = Bus::<u32>::builder()
                .delivery(mode)
                .workers(2)
                .runtime(rt.handle().clone())
                .close_timeout(Duration::from_secs(3))
                .build()
                .unwrap();
            let (rtx, rrx) = std::sync::mpsc::channel();
            let rtx = Arc::new(Mutex::new(rtx));
            let closer = bus.clone();
            let done = Arc::new(AtomicBool::new(false));
            let d = Arc::clone(&done);
            let _a = bus
                .subscribe_async("x", move |_m: Arc<Message<u32>>| {
                    let closer = closer.clone();
                    let rtx = Arc::clone(&rtx);
                    let d = Arc::clone(&d);
                    async move {
                        let f = closer.close();
                        for _ in 0..5 {
                            tokio::task::yield_now().await;
                            tokio::time::sleep(Duration::from_millis(5)).await;
                        }
                        let r = f.await;
                        let other_done = d.load(Ordering::SeqCst);
                        rtx.lock().unwrap().send((r, other_done)).unwrap();
                    }
                })
                .unwrap();
            let _b = bus
                .subscribe("x", move |_m: &Message<u32>| {
                    std::thread::sleep(Duration::from_millis(300));
                    done.store(true, Ordering::SeqCst);
                })
                .unwrap();
            bus.publish("x", 1).unwrap();
            let (r, other_done) = rrx.recv_timeout(Duration::from_secs(10)).unwrap();
            assert!(r.is_ok(), "{mode:?}: {r:?}");
            assert!(other_done, "{mode:?}: returned before the slow handler");
        }
    });
}

/// Two close futures: one from a sync handler that blocks on it, one from
/// outside; both return.
#[test]
fn two_close_futures_one_inside_one_outside() {
    within(Duration::from_secs(20), "the test", || {
        let rt = runtime(2);
        let bus = Bus::<u32>::builder()
            .delivery(DeliveryMode::WorkerPool)
            .workers(2)
            .runtime(rt.handle().clone())
            .close_timeout(Duration::from_secs(3))
            .build()
            .unwrap();
        let closer = bus.clone();
        let (rtx, rrx) = std::sync::mpsc::channel();
        let rtx = Mutex::new(rtx);
        let entered = Arc::new(AtomicBool::new(false));
        let e = Arc::clone(&entered);
        let _a = bus
            .subscribe("x", move |_m: &Message<u32>| {
                e.store(true, Ordering::SeqCst);
                std::thread::sleep(Duration::from_millis(100));
                let f = closer.close();
                let r = futures_block_on(f);
                rtx.lock().unwrap().send(r).unwrap();
            })
            .unwrap();
        bus.publish("x", 1).unwrap();
        assert!(wait_until(5, || entered.load(Ordering::SeqCst)));
        let outside = bus.close();
        let r_out = rt.block_on(outside);
        let r_in = rrx.recv_timeout(Duration::from_secs(5)).unwrap();
        assert!(r_in.is_ok() && r_out.is_ok(), "{r_in:?} {r_out:?}");
    });
}

fn futures_block_on<F: Future>(f: F) -> F::Output {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(f)
}

// ---- request/reply ----

#[test]
fn request_many_keeps_the_first_max_and_counts_the_rest() {
    within(Duration::from_secs(20), "the test", || {
        let rt = runtime(2);
        let bus = Bus::<u32>::builder()
            .delivery(DeliveryMode::Inline)
            .runtime(rt.handle().clone())
            .build()
            .unwrap();
        let subs: Vec<_> = (1..=5u32)
            .map(|n| {
                let responder = bus.clone();
                bus.subscribe("svc", move |m: &Message<u32>| {
                    responder.reply(m, n).unwrap();
                })
                .unwrap()
            })
            .collect();
        let got = rt
            .block_on(bus.request_many("svc", 0, Duration::from_secs(2), 2))
            .unwrap();
        let got: Vec<u32> = got.iter().map(|m| *m.data()).collect();
        let s = bus.stats();
        assert_eq!(got, vec![1, 2], "{s:?}");
        assert_eq!(s.dropped + s.late_replies, 3, "{s:?}");
        drop(subs);
    });
}

#[test]
fn late_replies_after_request_many_returned_are_counted_late() {
    within(Duration::from_secs(20), "the test", || {
        let rt = runtime(2);
        let bus = Bus::<u32>::builder()
            .delivery(DeliveryMode::WorkerPool)
            .workers(4)
            .runtime(rt.handle().clone())
            .build()
            .unwrap();
        let slow_done = Arc::new(AtomicUsize::new(0));
        let subs: Vec<_> = (1..=4u32)
            .map(|n| {
                let responder = bus.clone();
                let slow_done = Arc::clone(&slow_done);
                bus.subscribe("svc", move |m: &Message<u32>| {
                    if n > 1 {
                        std::thread::sleep(Duration::from_millis(200));
                    }
                    let r = responder.reply(m, n).unwrap();
                    if n > 1 {
                        assert_eq!(r, 0);
                        slow_done.fetch_add(1, Ordering::SeqCst);
                    }
                })
                .unwrap()
            })
            .collect();
        let got = rt
            .block_on(bus.request_many("svc", 0, Duration::from_secs(2), 1))
            .unwrap();
        assert_eq!(got.len(), 1);
        assert_eq!(*got[0].data(), 1);
        assert!(wait_until(5, || slow_done.load(Ordering::SeqCst) == 3));
        let s = bus.stats();
        assert_eq!((s.late_replies, s.dropped), (3, 0), "{s:?}");
        drop(subs);
    });
}

/// Replies taken while more arrive: each reply counted once (returned,
/// dropped, or late), whatever the timing.
#[test]
fn request_many_counts_every_reply_once_under_a_stream_of_replies() {
    within(Duration::from_secs(30), "the test", || {
        let rt = runtime(2);
        for round in 0..50 {
            let bus = Bus::<u32>::builder()
                .delivery(DeliveryMode::WorkerPool)
                .workers(3)
                .runtime(rt.handle().clone())
                .build()
                .unwrap();
            let replied = Arc::new(AtomicUsize::new(0));
            let subs: Vec<_> = (1..=12u32)
                .map(|n| {
                    let responder = bus.clone();
                    let replied = Arc::clone(&replied);
                    bus.subscribe("svc", move |m: &Message<u32>| {
                        responder.reply(m, n).unwrap();
                        replied.fetch_add(1, Ordering::SeqCst);
                    })
                    .unwrap()
                })
                .collect();
            let got = rt
                .block_on(bus.request_many("svc", 0, Duration::from_secs(2), 3))
                .unwrap();
            assert!(wait_until(5, || replied.load(Ordering::SeqCst) == 12));
            assert!(wait_until(5, || bus.inflight_messages() == 0));
            let s = bus.stats();
            assert_eq!(got.len(), 3, "round {round}: {s:?}");
            assert_eq!(
                got.len() as u64 + s.dropped + s.late_replies,
                12,
                "round {round}: every reply once: {s:?}"
            );
            drop(subs);
        }
    });
}

// ---- eager compaction by live count ----

struct DropFlag(Arc<AtomicUsize>);
impl Drop for DropFlag {
    fn drop(&mut self) {
        self.0.fetch_add(1, Ordering::SeqCst);
    }
}

/// A handler running when its subscription is removed (eager compaction,
/// 60 live of 100 slots): its closure is not dropped before it returns.
#[test]
fn eager_compaction_does_not_drop_a_running_closure() {
    within(Duration::from_secs(20), "the test", || {
        let bus = Bus::<u32>::builder()
            .delivery(DeliveryMode::WorkerPool)
            .workers(2)
            .build()
            .unwrap();
        let dropped = Arc::new(AtomicUsize::new(0));
        let mut subs: Vec<_> = (0..99)
            .map(|_| {
                let flag = DropFlag(Arc::new(AtomicUsize::new(0)));
                bus.subscribe("f", move |_: &Message<u32>| {
                    let _ = &flag;
                })
                .unwrap()
            })
            .collect();
        let inside = Arc::new(AtomicBool::new(false));
        let release = Arc::new(AtomicBool::new(false));
        let saw_dropped = Arc::new(AtomicBool::new(false));
        let (i, r, sd, dr) = (
            Arc::clone(&inside),
            Arc::clone(&release),
            Arc::clone(&saw_dropped),
            Arc::clone(&dropped),
        );
        let flag = DropFlag(Arc::clone(&dropped));
        let running = bus
            .subscribe("f", move |_: &Message<u32>| {
                let _ = &flag;
                i.store(true, Ordering::SeqCst);
                while !r.load(Ordering::SeqCst) {
                    std::thread::sleep(Duration::from_millis(1));
                }
                if dr.load(Ordering::SeqCst) > 0 {
                    sd.store(true, Ordering::SeqCst);
                }
            })
            .unwrap();
        for sub in subs.drain(..40) {
            sub.unsubscribe();
        }
        bus.publish("f", 1).unwrap();
        assert!(wait_until(5, || inside.load(Ordering::SeqCst)));
        running.unsubscribe();
        std::thread::sleep(Duration::from_millis(20));
        let early = dropped.load(Ordering::SeqCst);
        release.store(true, Ordering::SeqCst);
        assert!(wait_until(5, || bus.inflight_messages() == 0));
        assert_eq!(early, 0, "closure dropped while its call ran");
        assert!(!saw_dropped.load(Ordering::SeqCst));
        assert!(wait_until(5, || dropped.load(Ordering::SeqCst) == 1));
    });
}

/// Unsubscribing many owning closures from a filter that keeps 64 live
/// ones (others added and removed around them): each removal rebuilds the
/// set; its cost must stay bounded by the live count, not the history.
#[test]
fn eager_compaction_cost_stays_bounded() {
    within(Duration::from_secs(60), "the test", || {
        let bus = Bus::<u32>::builder()
            .delivery(DeliveryMode::Inline)
            .build()
            .unwrap();
        let owning = |bus: &Bus<u32>| {
            let flag = Arc::new(0u8);
            bus.subscribe("g", move |_: &Message<u32>| {
                let _ = &flag;
            })
            .unwrap()
        };
        let _keep: Vec<_> = (0..63).map(|_| owning(&bus)).collect();
        // Many non-owning subscriptions, removed: dead slots.
        let plain: Vec<_> = (0..20_000)
            .map(|_| bus.subscribe("g", |_: &Message<u32>| {}).unwrap())
            .collect();
        for s in plain {
            s.unsubscribe();
        }
        let t = Instant::now();
        for _ in 0..20_000 {
            owning(&bus).unsubscribe();
        }
        let took = t.elapsed();
        eprintln!("20,000 subscribe+unsubscribe at 63 live: {took:?}");
        assert!(took < Duration::from_secs(10), "{took:?}");
    });
}

// ---- controls: the same hand-offs with `close` called where the future is
// first polled (what the parent commit's `async fn close` did) ----

#[test]
fn control_close_called_at_first_poll_from_a_sync_handler_hand_off() {
    within(Duration::from_secs(20), "the test", || {
        let rt = runtime(2);
        let bus = Bus::<u32>::builder()
            .delivery(DeliveryMode::Inline)
            .close_timeout(Duration::from_secs(5))
            .build()
            .unwrap();
        let (tx, rx) = std::sync::mpsc::channel::<CloseFuture>();
        let tx = Mutex::new(tx);
        let closer = bus.clone();
        let _a = bus
            .subscribe("x", move |_m: &Message<u32>| {
                let c = closer.clone();
                tx.lock()
                    .unwrap()
                    .send(Box::pin(async move { c.close().await }))
                    .unwrap();
            })
            .unwrap();
        let done = Arc::new(AtomicBool::new(false));
        let d = Arc::clone(&done);
        let _b = bus
            .subscribe("x", move |_m: &Message<u32>| {
                std::thread::sleep(Duration::from_millis(500));
                d.store(true, Ordering::SeqCst);
            })
            .unwrap();
        let publisher = {
            let bus = bus.clone();
            std::thread::spawn(move || bus.publish("x", 1))
        };
        let f = rx.recv_timeout(Duration::from_secs(5)).unwrap();
        let r = rt.block_on(f);
        assert!(r.is_ok(), "{r:?}");
        assert!(done.load(Ordering::SeqCst));
        publisher.join().unwrap().unwrap();
    });
}

#[test]
fn control_close_called_at_first_poll_inside_an_async_handler() {
    within(Duration::from_secs(20), "the test", || {
        let rt = runtime(2);
        let bus = Bus::<u32>::builder()
            .delivery(DeliveryMode::TaskPerSubscriber)
            .runtime(rt.handle().clone())
            .close_timeout(Duration::from_secs(2))
            .build()
            .unwrap();
        let (ftx, frx) = tokio::sync::oneshot::channel::<CloseFuture>();
        let frx = Mutex::new(Some(frx));
        let (rtx, rrx) = std::sync::mpsc::channel();
        let rtx = Arc::new(Mutex::new(rtx));
        let started = Arc::new(AtomicBool::new(false));
        let s = Arc::clone(&started);
        let _a = bus
            .subscribe_async("x", move |_m: Arc<Message<u32>>| {
                let frx = frx.lock().unwrap().take().unwrap();
                let s = Arc::clone(&s);
                let rtx = Arc::clone(&rtx);
                async move {
                    s.store(true, Ordering::SeqCst);
                    let f = frx.await.unwrap();
                    let r = f.await;
                    rtx.lock().unwrap().send(r).unwrap();
                }
            })
            .unwrap();
        bus.publish("x", 1).unwrap();
        assert!(wait_until(5, || started.load(Ordering::SeqCst)));
        let b = bus.clone();
        let _ = ftx.send(Box::pin(async move { b.close().await }));
        let r = rrx.recv_timeout(Duration::from_secs(10)).unwrap();
        assert!(r.is_ok(), "{r:?}");
    });
}
