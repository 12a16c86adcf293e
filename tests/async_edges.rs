//! Async handlers and the runtime they run on, in every delivery mode, as
//! the thirty-fifth session's review found them. Each test here failed on
//! the code before its fix; the doc comment of each says what it shows:
//! a future whose `Drop` panics when the task cap cancels it (a publish
//! panicked, a pool's only worker died, the delivery never counted), the
//! same in a retained snapshot (`subscribe_async` panicked), and a request
//! made by an async delivery that its own runner waits for at the cap (the
//! responder's job queued behind that runner: never answered).

mod common;

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use blazesub::{Bus, DeliveryMode, Message, Overflow, Stats};
use common::{runtime, wait_until, within, MODES};

const LIMIT: Duration = Duration::from_secs(10);

type Fut = Pin<Box<dyn Future<Output = ()> + Send>>;

/// A handler's future whose `Drop` panics (once, and never while the thread
/// is already unwinding): user code the bus runs when it lets go of the
/// future, after it completed or when it cancels it.
struct Bomb {
    inner: Fut,
}

impl Future for Bomb {
    type Output = ();
    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
        self.inner.as_mut().poll(cx)
    }
}

impl Drop for Bomb {
    fn drop(&mut self) {
        if !std::thread::panicking() {
            panic!("review bomb: the Drop of an async handler's future panicked");
        }
    }
}

fn bomb(inner: impl Future<Output = ()> + Send + 'static) -> Fut {
    Box::pin(Bomb {
        inner: Box::pin(inner),
    })
}

fn ended(stats: &Stats) -> u64 {
    stats.delivered + stats.dropped + stats.handler_panics
}

/// Silences this file's intentional panics.
fn quiet() -> common::QuietPanics {
    common::QuietPanics::install(|info| {
        info.payload()
            .downcast_ref::<&str>()
            .is_some_and(|s| s.starts_with("review bomb"))
            || info
                .payload()
                .downcast_ref::<String>()
                .is_some_and(|s| s.starts_with("review bomb"))
    })
}

/// Message 0 awaits `gate` (holding the only task slot, or the lane's task
/// in `TaskPerSubscriber`); every other message gets `other`'s future.
fn gated_or(
    gate: &Arc<tokio::sync::Semaphore>,
    other: fn() -> Fut,
) -> impl Fn(Arc<Message<u32>>) -> Fut + Send + Sync + 'static {
    let gate = Arc::clone(gate);
    move |m: Arc<Message<u32>>| -> Fut {
        if *m.data() == 0 {
            let gate = Arc::clone(&gate);
            Box::pin(async move {
                let _ = gate.acquire().await;
            })
        } else {
            other()
        }
    }
}

/// Finding 1. At the task cap under `Overflow::Drop`, an async delivery
/// still pending after its first poll is cancelled (its future dropped) and
/// must be counted as dropped. When that future's `Drop` panics, the panic
/// escapes `pending::settle` and is caught by the runner's `resuming` loop
/// as if the *handler* had panicked — but the delivery had already been
/// counted as "handed over" (not finished) and the settle never counted it
/// finished. It stays in flight for ever: `inflight_messages()` never
/// returns to 0 and `close()` can only time out.
#[test]
fn a_future_whose_drop_panics_cancelled_at_the_cap_is_counted() {
    let _quiet = quiet();
    let rt = runtime(2);
    let mut failures = Vec::new();
    for mode in [DeliveryMode::Inline, DeliveryMode::WorkerPool] {
        let what = format!("{mode:?}");
        let bus = Bus::<u32>::builder()
            .delivery(mode)
            .workers(1)
            .max_inflight_tasks(1)
            .overflow(Overflow::Drop)
            .close_timeout(Duration::from_secs(2))
            .runtime(rt.handle().clone())
            .build()
            .unwrap();
        let gate = Arc::new(tokio::sync::Semaphore::new(0));
        let sub = bus
            .subscribe_async("t", gated_or(&gate, || bomb(std::future::pending::<()>())))
            .unwrap();
        let publisher = bus.clone();
        let published = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            within(LIMIT, &what, move || {
                let a = publisher.publish("t", 0).unwrap() as u64;
                // Let message 0 take the only task slot first.
                assert!(
                    wait_until(Duration::from_secs(3), || publisher.footprint().live_tasks
                        == 1),
                    "message 0 never held the task slot: {:?}",
                    publisher.footprint()
                );
                let b = publisher.publish("t", 1);
                (a, b.map_err(|e| e.to_string()))
            })
        }));
        // Message 1 meets the cap (a pool worker takes it after `publish`
        // returns) before message 0 lets go of the slot.
        let _ = wait_until(Duration::from_secs(3), || {
            let stats = bus.stats();
            stats.dropped + stats.handler_panics > 0
        });
        gate.add_permits(100);
        let drained = wait_until(Duration::from_secs(3), || bus.inflight_messages() == 0);
        // The bus still delivers afterwards (a worker that died would not).
        let later = Arc::new(AtomicU64::new(0));
        let probe = {
            let later = Arc::clone(&later);
            bus.subscribe("u", move |_m: &Message<u32>| {
                later.fetch_add(1, Ordering::SeqCst);
            })
            .unwrap()
        };
        let _ = bus.publish("u", 0);
        if !wait_until(Duration::from_secs(3), || later.load(Ordering::SeqCst) == 1) {
            failures.push(format!(
                "{what}: a later publish to a sync handler was never delivered (the runner died)"
            ));
        }
        drop(probe);
        let stats = bus.stats();
        let closed = rt.block_on(bus.close());
        match published {
            Err(panic) => failures.push(format!(
                "{what}: publish(\"t\", 1) panicked: {:?}; inflight {} (close: {closed:?}): {stats:?}",
                panic_text(&panic),
                bus.inflight_messages()
            )),
            Ok((a, b)) => {
                // Under `Drop`, a publish reports `Ok(matched)`; and the
                // probe's one delivery.
                let accepted = a + b.as_ref().map_or(0, |n| *n as u64) + 1;
                if !drained || ended(&stats) != accepted || stats.dropped != 1 {
                    failures.push(format!(
                        "{what}: publish 1: {b:?}; accepted {accepted}, ended {}, inflight {} (close: {closed:?}): {stats:?}",
                        ended(&stats),
                        bus.inflight_messages()
                    ));
                }
            }
        }
        drop(sub);
    }
    assert!(failures.is_empty(), "{failures:#?}");
}

fn panic_text(panic: &Box<dyn std::any::Any + Send>) -> String {
    panic
        .downcast_ref::<String>()
        .cloned()
        .or_else(|| panic.downcast_ref::<&str>().map(|s| s.to_string()))
        .unwrap_or_default()
}

/// Finding 2. A retained snapshot delivered to a new async handler
/// subscription at the task cap under `Overflow::Drop`: the future, pending
/// after its first poll, is cancelled in `dispatch::direct::deliver_now`
/// (`pending::settle`), outside any `catch_unwind`. A future whose `Drop`
/// panics makes `subscribe_async` itself panic (the public API must not),
/// and the delivery admitted under the subscriber's token is never counted.
#[test]
fn subscribe_async_does_not_panic_when_a_snapshot_future_panics_on_drop() {
    let _quiet = quiet();
    let rt = runtime(2);
    let mut failures = Vec::new();
    for mode in MODES {
        let what = format!("{mode:?}");
        let bus = Bus::<u32>::builder()
            .delivery(mode)
            .workers(1)
            .max_inflight_tasks(1)
            .overflow(Overflow::Drop)
            .close_timeout(Duration::from_secs(2))
            .runtime(rt.handle().clone())
            .build()
            .unwrap();
        let gate = Arc::new(tokio::sync::Semaphore::new(0));
        let holder = bus
            .subscribe_async("hold", gated_or(&gate, || Box::pin(async {})))
            .unwrap();
        bus.publish_retained("cfg", 7).unwrap();
        let b = bus.clone();
        let subscribed = within(LIMIT, &what, move || {
            b.publish("hold", 0).unwrap();
            assert!(wait_until(LIMIT, || b.footprint().live_tasks == 1));
            let b2 = b.clone();
            let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(move || {
                b2.subscribe_async("cfg", |_m: Arc<Message<u32>>| {
                    bomb(std::future::pending::<()>())
                })
            }));
            match result {
                Ok(Ok(sub)) => {
                    sub.detach();
                    Ok(())
                }
                Ok(Err(e)) => Err(format!("error {e}")),
                Err(_) => Err("subscribe_async panicked".to_string()),
            }
        });
        gate.add_permits(100);
        let drained = wait_until(Duration::from_secs(3), || bus.inflight_messages() == 0);
        let stats = bus.stats();
        if subscribed.is_err() || !drained {
            failures.push(format!(
                "{what}: subscribe: {subscribed:?}; inflight {}: {stats:?}",
                bus.inflight_messages()
            ));
        }
        drop(holder);
    }
    assert!(failures.is_empty(), "{failures:#?}");
}

/// Finding 3. `TaskPerSubscriber` with one lane (`workers(1)`) and one task
/// slot. An async handler still pending after its first poll is awaited by
/// the lane's task itself (`pending::settle` hands it `Back`, and the task
/// awaits it in `finish_here`). Its future then makes a request; the
/// request is queued in the same lane (it has room), behind the task that
/// awaits the requester. The lanes' watcher sees the lane stuck but has no
/// task slot for a helper, so nobody ever runs the responder: the request
/// can only time out. (`overflow.rs`'s
/// `a_request_from_a_task_holding_the_last_slot_is_answered` passes only
/// because the responder's topic lands in another lane.) DESIGN §9:
/// `request` from inside a handler never deadlocks.
#[test]
fn a_request_from_an_async_handler_awaited_by_its_lane_is_answered() {
    let rt = runtime(2);
    let bus = Bus::<u32>::builder()
        .delivery(DeliveryMode::TaskPerSubscriber)
        .workers(1)
        .max_inflight_tasks(1)
        .close_timeout(Duration::from_secs(2))
        .runtime(rt.handle().clone())
        .build()
        .unwrap();
    let responder_bus = bus.clone();
    let _responder = bus
        .subscribe("rpc", move |m: &Message<u32>| {
            let _ = responder_bus.reply(m, *m.data() + 1);
        })
        .unwrap();
    let (answered, answer) = std::sync::mpsc::channel();
    let answered = std::sync::Mutex::new(answered);
    let requester = bus.clone();
    let _requester = bus
        .subscribe_async("go", move |_: Arc<Message<u32>>| {
            let bus = requester.clone();
            let answered = answered.lock().unwrap().clone();
            async move {
                // Pending at its first poll: at the cap, its lane's task
                // awaits it.
                tokio::task::yield_now().await;
                let reply = bus.request("rpc", 41, Duration::from_secs(3)).await;
                let _ = answered.send(reply.map(|m| *m.data()).map_err(|e| e.to_string()));
            }
        })
        .unwrap();
    bus.publish("go", 0).unwrap();
    let reply = answer
        .recv_timeout(LIMIT)
        .expect("the requester never finished");
    assert_eq!(
        reply,
        Ok(42),
        "the request was not answered: {:?}",
        bus.stats()
    );
}

/// Finding 3, `WorkerPool`: one worker, and another async delivery holds
/// the only task slot, so the requester's pending future is finished in
/// place on the worker (`Handle::block_on`). Its request is queued to that
/// same worker (a worker's publish never waits, and the queue has room),
/// behind the future that awaits it: the request can only time out.
#[test]
fn a_request_from_an_async_handler_finished_in_place_on_the_worker_is_answered() {
    let rt = runtime(2);
    let bus = Bus::<u32>::builder()
        .delivery(DeliveryMode::WorkerPool)
        .workers(1)
        .max_inflight_tasks(1)
        .close_timeout(Duration::from_secs(2))
        .runtime(rt.handle().clone())
        .build()
        .unwrap();
    let responder_bus = bus.clone();
    let _responder = bus
        .subscribe("rpc", move |m: &Message<u32>| {
            let _ = responder_bus.reply(m, *m.data() + 1);
        })
        .unwrap();
    let gate = Arc::new(tokio::sync::Semaphore::new(0));
    let _holder = bus
        .subscribe_async("hold", gated_or(&gate, || Box::pin(async {})))
        .unwrap();
    let (answered, answer) = std::sync::mpsc::channel();
    let answered = std::sync::Mutex::new(answered);
    let requester = bus.clone();
    let _requester = bus
        .subscribe_async("go", move |_: Arc<Message<u32>>| {
            let bus = requester.clone();
            let answered = answered.lock().unwrap().clone();
            async move {
                tokio::task::yield_now().await;
                let reply = bus.request("rpc", 41, Duration::from_secs(3)).await;
                let _ = answered.send(reply.map(|m| *m.data()).map_err(|e| e.to_string()));
            }
        })
        .unwrap();
    bus.publish("hold", 0).unwrap();
    assert!(wait_until(LIMIT, || bus.footprint().live_tasks == 1));
    bus.publish("go", 0).unwrap();
    let reply = answer
        .recv_timeout(LIMIT)
        .expect("the requester never finished");
    gate.add_permits(100);
    assert_eq!(
        reply,
        Ok(42),
        "the request was not answered: {:?}",
        bus.stats()
    );
}
