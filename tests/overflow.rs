//! Overflow policies through the public API: when the worker pool's queue or
//! the task cap is full, `Drop` counts what it drops, `Error` also fails the
//! publish, and `CallerRuns` runs the delivery on the publisher, so every
//! message is either delivered exactly once or counted as dropped.

mod common;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use blazesub::{Batch, Bus, DeliveryMode, Error, Message, Overflow, Subscription};
use common::{wait_until, Gate, Hits, MODES};

const K: u32 = 50;
const POLICIES: [Overflow; 3] = [Overflow::Drop, Overflow::Error, Overflow::CallerRuns];

/// A subscription on `o/x` whose handler blocks at `gate` on message 0 only,
/// and records every message and whether it ran on `publisher`.
struct Probe {
    gate: Arc<Gate>,
    entered: Arc<AtomicU64>,
    hits: Arc<Hits>,
    on_publisher: Arc<AtomicU64>,
    _sub: Subscription,
}

fn probe(bus: &Bus<u32>) -> Probe {
    let gate = Arc::new(Gate::new());
    let entered = Arc::new(AtomicU64::new(0));
    let hits = Arc::new(Hits::new(K as usize));
    let on_publisher = Arc::new(AtomicU64::new(0));
    let publisher = std::thread::current().id();
    let (g, e, h, p) = (
        Arc::clone(&gate),
        Arc::clone(&entered),
        Arc::clone(&hits),
        Arc::clone(&on_publisher),
    );
    let sub = bus
        .subscribe("o/x", move |m: &Message<u32>| {
            e.fetch_add(1, Ordering::SeqCst);
            if *m.data() == 0 {
                g.wait();
            }
            if std::thread::current().id() == publisher {
                p.fetch_add(1, Ordering::SeqCst);
            }
            h.hit(*m.data());
        })
        .unwrap();
    Probe {
        gate,
        entered,
        hits,
        on_publisher,
        _sub: sub,
    }
}

/// Publishes message `id` to a bus with no room left and checks what the
/// policy did. `full_since` is the first id that met a full bus.
fn publish_into_full(bus: &Bus<u32>, probe: &Probe, policy: Overflow, id: u32, full_since: u32) {
    let what = format!("{policy:?}, message {id}");
    let overflowed = u64::from(id - full_since + 1);
    let result = bus.publish("o/x", id);
    match policy {
        Overflow::Drop => {
            assert_eq!(result.unwrap(), 1, "{what}");
            assert_eq!(bus.stats().dropped, overflowed, "{what}: drop not counted");
        }
        Overflow::Error => {
            match result {
                Err(Error::Overloaded {
                    topic,
                    dropped,
                    matched,
                }) => {
                    assert_eq!((topic.as_str(), dropped, matched), ("o/x", 1, 1), "{what}");
                }
                other => panic!("{what}: expected Error::Overloaded, got {other:?}"),
            }
            assert_eq!(bus.stats().dropped, overflowed, "{what}: drop not counted");
        }
        Overflow::Wait => unreachable!("a publisher that waits here waits for ever"),
        Overflow::CallerRuns => {
            assert_eq!(result.unwrap(), 1, "{what}");
            assert_eq!(
                probe.hits.get(id),
                1,
                "{what}: the publisher did not run the delivery before returning"
            );
            assert_eq!(bus.stats().caller_runs, overflowed, "{what}");
            assert_eq!(bus.stats().dropped, 0, "{what}");
        }
    }
}

/// After the gate opens and the bus closes: every message was delivered
/// exactly once or counted as dropped, as the policy says.
async fn check_outcome(
    bus: &Bus<u32>,
    probe: &Probe,
    policy: Overflow,
    delivered_before_full: u32,
) {
    probe.gate.open();
    bus.close().await.unwrap();
    let stats = bus.stats();
    let what = format!("{policy:?}");
    assert_eq!(bus.inflight_messages(), 0, "{what}");
    assert_eq!(
        stats.delivered + stats.dropped,
        u64::from(K),
        "{what}: every message is delivered or counted dropped"
    );
    match policy {
        Overflow::CallerRuns => {
            probe.hits.assert_exactly_once(&what);
            assert_eq!(stats.dropped, 0, "{what}");
            assert_eq!(
                probe.on_publisher.load(Ordering::SeqCst),
                u64::from(K - delivered_before_full),
                "{what}: the overflowing deliveries ran on the publisher's thread"
            );
        }
        _ => {
            let expected = |id: u32| u32::from(id < delivered_before_full);
            if let Some((id, got)) = probe.hits.first_mismatch(expected) {
                panic!(
                    "{what}: message {id} delivered {got} times, expected {}",
                    expected(id)
                );
            }
            assert_eq!(stats.delivered, u64::from(delivered_before_full), "{what}");
        }
    }
}

/// One worker, a queue of one job: message 0 blocks the worker, message 1
/// fills the queue, and every later publish meets a full queue.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn worker_pool_full_queue_follows_the_policy() {
    for policy in POLICIES {
        let bus = Bus::<u32>::builder()
            .delivery(DeliveryMode::WorkerPool)
            .workers(1)
            .queue_capacity(1)
            .overflow(policy)
            .build()
            .unwrap();
        let probe = probe(&bus);
        assert_eq!(bus.publish("o/x", 0).unwrap(), 1);
        assert!(
            wait_until(Duration::from_secs(10), || probe
                .entered
                .load(Ordering::SeqCst)
                == 1),
            "the worker never started message 0"
        );
        assert_eq!(bus.publish("o/x", 1).unwrap(), 1, "{policy:?}: queued");
        for id in 2..K {
            publish_into_full(&bus, &probe, policy, id, 2);
        }
        check_outcome(&bus, &probe, policy, 2).await;
    }
}

/// A cap of one task: message 0's task blocks, and every later publish meets
/// the cap (a lane then holds one publish, queued or running: see
/// `src/dispatch/tasks.rs`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn task_cap_follows_the_policy() {
    for policy in POLICIES {
        let bus = Bus::<u32>::builder()
            .delivery(DeliveryMode::TaskPerSubscriber)
            .max_inflight_tasks(1)
            .overflow(policy)
            .build()
            .unwrap();
        let probe = probe(&bus);
        assert_eq!(bus.publish("o/x", 0).unwrap(), 1);
        for id in 1..K {
            publish_into_full(&bus, &probe, policy, id, 1);
        }
        check_outcome(&bus, &probe, policy, 1).await;
    }
}

/// A publish reaching 40 subscriptions when there is no room: whatever the
/// batch policy and threshold, all 40 deliveries are dropped and counted,
/// and `Error` reports exactly that.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_whole_fanout_that_finds_no_room_is_counted() {
    const MANY: usize = 40;
    for mode in [DeliveryMode::WorkerPool, DeliveryMode::TaskPerSubscriber] {
        for policy in [Overflow::Drop, Overflow::Error] {
            for (batch, threshold) in [
                (Batch::Single, 1),
                (Batch::Single, 10_000),
                (Batch::Chunked, 1),
                (Batch::Chunked, 10_000),
            ] {
                let what = format!("{mode:?} {policy:?} {batch:?} threshold {threshold}");
                let bus = Bus::<u32>::builder()
                    .delivery(mode)
                    .workers(1)
                    .queue_capacity(1)
                    .max_inflight_tasks(1)
                    .batch(batch)
                    .max_concurrent_subscriptions(threshold)
                    .overflow(policy)
                    .build()
                    .unwrap();
                let probe = probe(&bus);
                let many = Arc::new(AtomicU64::new(0));
                let _subs: Vec<Subscription> = (0..MANY)
                    .map(|_| {
                        let many = Arc::clone(&many);
                        bus.subscribe("o/many", move |_: &Message<u32>| {
                            many.fetch_add(1, Ordering::SeqCst);
                        })
                        .unwrap()
                    })
                    .collect();
                // Fill the bus: the worker (or the one task) blocks on
                // message 0; in pool mode message 1 takes the queue's slot
                // (a lane of one publish is full with message 0).
                bus.publish("o/x", 0).unwrap();
                let mut accepted = 1;
                if mode == DeliveryMode::WorkerPool {
                    assert!(wait_until(Duration::from_secs(10), || probe
                        .entered
                        .load(Ordering::SeqCst)
                        == 1));
                    bus.publish("o/x", 1).unwrap();
                    accepted = 2;
                }
                let before = bus.stats().dropped;
                let result = bus.publish("o/many", 7);
                match policy {
                    Overflow::Drop => assert_eq!(result.unwrap(), MANY, "{what}"),
                    _ => match result {
                        Err(Error::Overloaded {
                            dropped, matched, ..
                        }) => assert_eq!((dropped, matched), (MANY, MANY), "{what}"),
                        other => panic!("{what}: expected Error::Overloaded, got {other:?}"),
                    },
                }
                assert_eq!(bus.stats().dropped - before, MANY as u64, "{what}");
                probe.gate.open();
                bus.close().await.unwrap();
                assert_eq!(
                    many.load(Ordering::SeqCst),
                    0,
                    "{what}: dropped yet delivered"
                );
                let stats = bus.stats();
                assert_eq!(stats.delivered, accepted, "{what}");
                assert_eq!(stats.dropped, MANY as u64, "{what}");
            }
        }
    }
}

/// Async handlers that stay pending, against a task cap of 2 under `Drop`:
/// at most 2 can continue as tasks, the rest are cancelled and counted; a
/// delivery is either completed (and counted delivered) or counted dropped.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn async_deliveries_beyond_the_task_cap_are_counted() {
    const CAP: usize = 2;
    const N: u32 = 20;
    for mode in MODES {
        let bus = Bus::<u32>::builder()
            .delivery(mode)
            .workers(2)
            .max_inflight_tasks(CAP)
            .overflow(Overflow::Drop)
            .build()
            .unwrap();
        let release = Arc::new(tokio::sync::Semaphore::new(0));
        let hits = Arc::new(Hits::new(N as usize));
        let (r, h) = (Arc::clone(&release), Arc::clone(&hits));
        let _sub = bus
            .subscribe_async("a/x", move |m: Arc<Message<u32>>| {
                let (r, h) = (Arc::clone(&r), Arc::clone(&h));
                async move {
                    r.acquire().await.unwrap().forget();
                    h.hit(*m.data());
                }
            })
            .unwrap();
        for id in 0..N {
            bus.publish("a/x", id).unwrap();
        }
        // What may stay in flight while the handlers wait: a task each, and
        // in `TaskPerSubscriber` the publishes their lanes hold (lanes of
        // `CAP / workers` publishes, one per worker).
        let room = if mode == DeliveryMode::TaskPerSubscriber {
            2 * CAP as u64
        } else {
            CAP as u64
        };
        // Every delivery has been accepted; wait until each one either
        // continues as a task, waits in a lane, or was dropped, then let
        // them finish.
        assert!(wait_until(Duration::from_secs(10), || {
            bus.inflight_messages() <= room
        }));
        release.add_permits(N as usize);
        bus.close().await.unwrap();
        let stats = bus.stats();
        assert_eq!(
            stats.delivered + stats.dropped,
            u64::from(N),
            "{mode:?}: delivered {} + dropped {}",
            stats.delivered,
            stats.dropped
        );
        assert!(
            stats.dropped >= u64::from(N) - room,
            "{mode:?}: only {room} deliveries may wait, yet only {} were dropped",
            stats.dropped
        );
        assert_eq!(hits.total(), stats.delivered, "{mode:?}");
        assert!(
            (0..N).all(|id| hits.get(id) <= 1),
            "{mode:?}: delivered twice"
        );
    }
}

/// In `Inline` mode the publisher itself drops an async delivery that finds
/// the task cap full, so under `Overflow::Error` it can and must say so. (Or, per `DeliveryMode::Inline`'s docs, "the
/// overflow policy does not apply" and nothing is dropped; either way a
/// publish may not return `Ok` while it dropped a delivery under `Error`.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn inline_publish_under_error_reports_what_it_dropped() {
    const M: u32 = 5;
    let bus = Bus::<u32>::builder()
        .delivery(DeliveryMode::Inline)
        .max_inflight_tasks(1)
        .overflow(Overflow::Error)
        .build()
        .unwrap();
    let release = Arc::new(tokio::sync::Semaphore::new(0));
    let _sub = gated_async_subscription(&bus, &release);
    let mut refused = 0;
    for id in 0..M {
        let before = bus.stats().dropped;
        let result = bus.publish("a/x", id);
        let dropped_now = (bus.stats().dropped - before) as usize;
        if dropped_now > 0 {
            refused += 1;
            match result {
                Err(Error::Overloaded { dropped, .. }) => assert_eq!(dropped, dropped_now),
                other => panic!(
                    "publish {id} dropped {dropped_now} deliveries under Overflow::Error but \
                     returned {other:?}"
                ),
            }
        } else {
            assert_eq!(result.ok(), Some(1), "publish {id} dropped nothing");
        }
    }
    // The first takes the one task slot and waits; every later one finds
    // the cap full: the case this test is about happened.
    assert_eq!(refused, M - 1, "publishes that found the task cap full");
    release.add_permits(M as usize);
    bus.close().await.unwrap();
    let stats = bus.stats();
    assert_eq!(stats.delivered + stats.dropped, u64::from(M));
}

/// A `TaskPerSubscriber` runner that polls an async delivery which is still
/// pending can finish it itself without a new task (as it does under
/// `CallerRuns`). Under `Drop` it cancels it instead whenever the cap is
/// reached, counting the runner itself: with `max_inflight_tasks(1)` no
/// async handler that awaits can ever complete, even when each message is
/// published alone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_task_runner_finishes_its_own_async_delivery_at_the_cap() {
    const M: u32 = 10;
    let bus = Bus::<u32>::builder()
        .delivery(DeliveryMode::TaskPerSubscriber)
        .max_inflight_tasks(1)
        .overflow(Overflow::Drop)
        .build()
        .unwrap();
    let hits = Arc::new(Hits::new(M as usize));
    let _sub = yielding_async_subscription(&bus, &hits);
    for id in 0..M {
        // One at a time: the runner task is the only task alive.
        bus.publish("a/x", id).unwrap();
        assert!(wait_until(Duration::from_secs(10), || bus
            .inflight_messages()
            == 0));
    }
    bus.close().await.unwrap();
    let stats = bus.stats();
    assert_eq!(
        (stats.delivered, stats.dropped),
        (u64::from(M), 0),
        "each message was published alone, needing one task within a cap of one"
    );
    hits.assert_exactly_once("async handler");
}

/// A burst published by a task, under `Overflow::Wait` (the default), to an
/// async handler that awaits a timer of the same runtime, with one pool
/// worker, one queue slot and one task slot. At the task cap the worker
/// drives the handler's future to its end itself, and that future's timer
/// needs the runtime thread the publisher is blocking. Waiting for the
/// worker's room used to deadlock both; the publisher now runs the unit
/// itself once the worker has started nothing for a millisecond.
///
/// `lossless`: whether every delivery must be made. A publisher on a
/// current-thread runtime cannot block for a pending delivery when it runs
/// the unit itself, so there its deliveries past the task cap go on as
/// tasks only up to the cap again; the rest are dropped and counted.
fn a_burst_under_wait_returns(runtime: tokio::runtime::Runtime, lossless: bool) {
    let (done, finished) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let handle = runtime.handle().clone();
        runtime
            .block_on(handle.spawn(async move {
                let bus = Bus::<u32>::builder()
                    .delivery(DeliveryMode::WorkerPool)
                    .workers(1)
                    .queue_capacity(1)
                    .max_inflight_tasks(1)
                    .overflow(Overflow::Wait)
                    .build()
                    .unwrap();
                let _sub = bus
                    .subscribe_async("a/x", |_: Arc<Message<u32>>| async move {
                        tokio::time::sleep(Duration::from_millis(1)).await;
                    })
                    .unwrap();
                // A task that does not yield between publishes.
                for id in 0..20 {
                    bus.publish("a/x", id).unwrap();
                }
                bus.close().await.unwrap();
                let stats = bus.stats();
                let _ = done.send((stats.delivered, stats.dropped));
            }))
            .unwrap();
    });
    let outcome = finished.recv_timeout(Duration::from_secs(30));
    if lossless {
        assert_eq!(
            outcome,
            Ok((20, 0)),
            "20 publishes under Overflow::Wait did not all return and deliver in 30 s"
        );
    } else {
        let (delivered, dropped) =
            outcome.expect("20 publishes under Overflow::Wait did not all return in 30 s");
        assert!(
            delivered >= 2 && delivered + dropped == 20,
            "every delivery made or counted, at least the cap's worth made: delivered {delivered}, dropped {dropped}"
        );
    }
}

#[test]
fn wait_on_a_current_thread_runtime_with_async_handlers_at_the_task_cap_returns() {
    a_burst_under_wait_returns(
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap(),
        false,
    );
}

#[test]
fn wait_on_a_one_worker_runtime_with_async_handlers_at_the_task_cap_returns() {
    a_burst_under_wait_returns(
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .unwrap(),
        true,
    );
}

/// An async handler on `a/x` that yields once (so it is still pending
/// after its first poll), then records the message in `hits`.
fn yielding_async_subscription(bus: &Bus<u32>, hits: &Arc<Hits>) -> Subscription {
    let hits = Arc::clone(hits);
    bus.subscribe_async("a/x", move |m: Arc<Message<u32>>| {
        let hits = Arc::clone(&hits);
        async move {
            tokio::task::yield_now().await;
            hits.hit(*m.data());
        }
    })
    .unwrap()
}

/// An async handler on `rpc` that yields once (so it is still pending after
/// its first poll), then answers the request with its value plus one.
fn yielding_responder(bus: &Bus<u32>) -> Subscription {
    let responder = bus.clone();
    bus.subscribe_async("rpc", move |m: Arc<Message<u32>>| {
        let bus = responder.clone();
        async move {
            tokio::task::yield_now().await;
            let _ = bus.reply(&m, *m.data() + 1);
        }
    })
    .unwrap()
}

/// An async handler on `a/x` that awaits a permit of `gate` per message.
fn gated_async_subscription(bus: &Bus<u32>, gate: &Arc<tokio::sync::Semaphore>) -> Subscription {
    let gate = Arc::clone(gate);
    bus.subscribe_async("a/x", move |_: Arc<Message<u32>>| {
        let gate = Arc::clone(&gate);
        async move { gate.acquire().await.unwrap().forget() }
    })
    .unwrap()
}

/// `max_inflight_tasks` bounds the tasks an async handler's pending
/// deliveries keep alive when the publisher is a task on a multi-thread
/// runtime (it used to spawn one task per delivery past the cap, with
/// no bound). Past the cap the publisher finishes the delivery itself,
/// under `Wait` and `CallerRuns` alike, blocking in `block_in_place` while
/// the runtime's other tasks move on. A thread releases the handlers
/// slowly, one message at a time.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_task_cap_bounds_a_runtime_publishers_pending_deliveries() {
    const CAP: usize = 4;
    const N: u32 = 400;
    for overflow in [Overflow::Wait, Overflow::CallerRuns] {
        let bus = Bus::<u32>::builder()
            .delivery(DeliveryMode::Inline)
            .max_inflight_tasks(CAP)
            .overflow(overflow)
            .build()
            .unwrap();
        let gate = Arc::new(tokio::sync::Semaphore::new(0));
        let _sub = gated_async_subscription(&bus, &gate);
        let releaser = {
            let gate = Arc::clone(&gate);
            std::thread::spawn(move || {
                for _ in 0..N {
                    std::thread::sleep(Duration::from_micros(200));
                    gate.add_permits(1);
                }
            })
        };
        let metrics = tokio::runtime::Handle::current().metrics();
        let before = metrics.num_alive_tasks();
        let mut most_alive = 0;
        for id in 0..N {
            bus.publish("a/x", id).unwrap();
            most_alive = most_alive.max(metrics.num_alive_tasks().saturating_sub(before));
        }
        let still_blocked = bus.inflight_messages();
        releaser.join().unwrap();
        bus.close().await.unwrap();
        let stats = bus.stats();
        // Tokio still counts a task that has given its slot back until its
        // last poll returns: one per runtime worker at most.
        assert!(
            most_alive <= CAP + 2,
            "{overflow:?}: {most_alive} tasks alive with max_inflight_tasks = {CAP}"
        );
        assert!(
            still_blocked <= CAP as u64 + 1,
            "{overflow:?}: {still_blocked} deliveries pending after the loop: the tasks \
             and the one the publisher ran are all there can be"
        );
        assert_eq!(
            (stats.delivered, stats.dropped),
            (u64::from(N), 0),
            "{overflow:?}: every message delivered, none dropped"
        );
    }
}

/// A publisher on a current-thread runtime cannot block for a pending
/// delivery (its own thread runs them), so past the cap, under the default
/// `Wait`, its deliveries continue as tasks up to the cap again (the
/// documented exception), and the rest are dropped and counted: the tasks
/// stay bounded (they were not, before the thirty-fifth session: a task
/// per delivery), and nothing is lost uncounted.
#[test]
fn a_current_thread_publisher_stays_within_twice_the_task_cap_and_counts_the_rest() {
    const CAP: usize = 2;
    const N: u32 = 300;
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    runtime.block_on(async {
        let bus = Bus::<u32>::builder()
            .delivery(DeliveryMode::Inline)
            .max_inflight_tasks(CAP)
            .build()
            .unwrap();
        let hits = Arc::new(Hits::new(N as usize));
        let _sub = yielding_async_subscription(&bus, &hits);
        let mut most_alive = 0;
        for id in 0..N {
            bus.publish("a/x", id).unwrap();
            most_alive = most_alive.max(bus.footprint().live_tasks);
        }
        tokio::time::timeout(Duration::from_secs(30), bus.close())
            .await
            .expect("close timed out")
            .unwrap();
        let stats = bus.stats();
        assert!(most_alive <= 2 * CAP, "{most_alive} tasks alive, cap {CAP}");
        assert_eq!(
            (stats.delivered, stats.dropped),
            (2 * CAP as u64, u64::from(N) - 2 * CAP as u64),
            "the cap's worth twice delivered, the rest counted dropped"
        );
        assert_eq!(hits.total(), 2 * CAP as u64);
    });
}

/// An async handler that holds the only task slot and awaits a request
/// whose responder is itself an async handler still pending after its
/// first poll: the responder must not wait for the slot its own requester
/// holds, or neither would ever move. Its publisher (the requester's task)
/// finishes it itself, in every mode. (A first version of a waiting room
/// for task slots deadlocked here until the request's timeout.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_from_a_task_holding_the_last_slot_is_answered() {
    for mode in MODES {
        let bus = Bus::<u32>::builder()
            .delivery(mode)
            .max_inflight_tasks(1)
            .build()
            .unwrap();
        let _responder = yielding_responder(&bus);
        let (answered, answer) = tokio::sync::oneshot::channel();
        let answered = std::sync::Mutex::new(Some(answered));
        let requester = bus.clone();
        let _requester = bus
            .subscribe_async("go", move |_: Arc<Message<u32>>| {
                let bus = requester.clone();
                let answered = answered.lock().unwrap().take();
                async move {
                    // Pending at its first poll: continued as a task.
                    tokio::task::yield_now().await;
                    let reply = bus.request("rpc", 41, Duration::from_secs(5)).await;
                    if let Some(answered) = answered {
                        let _ = answered.send(reply.map(|m| *m.data()));
                    }
                }
            })
            .unwrap();
        bus.publish("go", 0).unwrap();
        let reply = tokio::time::timeout(Duration::from_secs(10), answer)
            .await
            .expect("the requester never finished")
            .unwrap();
        assert_eq!(
            reply.ok(),
            Some(42),
            "{mode:?}: the request was not answered"
        );
        bus.close().await.unwrap();
    }
}

/// A handler of one bus whose first poll publishes to a second bus at its
/// task cap, from a current-thread runtime's thread. The first poll enters
/// the first bus's multi-thread runtime context, so the thread looked like
/// one of that runtime's and the second bus tried `block_in_place` there,
/// which panics on a current-thread runtime (the panic was counted twice
/// and the accepted delivery stayed in flight for good). The delivery now
/// continues as a task past the cap, or, past twice the cap (here: message
/// 1 took the one slot past it), is dropped and counted; no panic.
#[test]
fn a_publish_from_a_first_poll_on_a_current_thread_runtime_does_not_block_in_place() {
    let rt = common::runtime(2);
    let build = || {
        Bus::<u32>::builder()
            .delivery(DeliveryMode::Inline)
            .max_inflight_tasks(1)
            .runtime(rt.handle().clone())
            .build()
            .unwrap()
    };
    let (first, second) = (build(), build());
    let gate = Arc::new(tokio::sync::Semaphore::new(0));
    let _held = gated_async_subscription(&second, &gate);
    let _relay = {
        let second = second.clone();
        first
            .subscribe_async("b", move |_: Arc<Message<u32>>| {
                let second = second.clone();
                async move {
                    // In the first poll, inside the first bus's context.
                    let result = second.publish("a/x", 2);
                    assert_eq!(result.ok(), Some(1), "the relayed publish failed");
                }
            })
            .unwrap()
    };
    let publisher = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let (second_too, first_too) = (second.clone(), first.clone());
    common::within(Duration::from_secs(10), "the publishes", move || {
        publisher.block_on(async move {
            second_too.publish("a/x", 0).unwrap(); // a task: the only slot
            second_too.publish("a/x", 1).unwrap(); // past the cap: cannot block
            first_too.publish("b", 0).unwrap(); // relays "a/x" 2
        });
    });
    gate.add_permits(3);
    assert!(
        wait_until(Duration::from_secs(10), || second.inflight_messages() == 0),
        "{:?}",
        second.stats()
    );
    let (first, second) = (first.stats(), second.stats());
    assert_eq!(
        (first.handler_panics, second.handler_panics),
        (0, 0),
        "{first:?} {second:?}"
    );
    assert_eq!((second.delivered, second.dropped), (2, 1), "{second:?}");
}

/// An async handler continued as a task holds the only task slot and calls
/// `close()`; a second delivery of the same subscription, published before
/// the close at the cap, is finished by its publisher and does not wait for
/// that slot. (With the first version of a waiting room for task slots it
/// did: `close` waited for it, it waited for the caller's slot, and `close`
/// could only time out. Found by the review of the session's diff.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn close_from_a_handler_holding_the_last_slot_returns() {
    let bus = Bus::<u32>::builder()
        .delivery(DeliveryMode::Inline)
        .max_inflight_tasks(1)
        .close_timeout(Duration::from_secs(3))
        .build()
        .unwrap();
    let gate = Arc::new(tokio::sync::Semaphore::new(0));
    let (closed_tx, closed_rx) = tokio::sync::oneshot::channel();
    let closed_tx = std::sync::Mutex::new(Some(closed_tx));
    let closer = bus.clone();
    let g = Arc::clone(&gate);
    let _sub = bus
        .subscribe_async("a/x", move |m: Arc<Message<u32>>| {
            let bus = closer.clone();
            let gate = Arc::clone(&g);
            let tx = if *m.data() == 0 {
                closed_tx.lock().unwrap().take()
            } else {
                None
            };
            async move {
                if let Some(tx) = tx {
                    // Pending at its first poll: continued as a task, in
                    // the only slot.
                    gate.acquire().await.unwrap().forget();
                    let _ = tx.send(bus.close().await);
                } else {
                    tokio::task::yield_now().await;
                }
            }
        })
        .unwrap();
    bus.publish("a/x", 0).unwrap(); // a task: the only slot
    bus.publish("a/x", 1).unwrap(); // pending at the cap: finished here
    gate.add_permits(1);
    let closed = tokio::time::timeout(Duration::from_secs(20), closed_rx)
        .await
        .expect("the closing handler never finished")
        .unwrap();
    assert!(
        closed.is_ok(),
        "close() from the handler: {closed:?} (the other delivery waits for the caller's slot)"
    );
}

/// An async handler holding the only task slot hands a request to a task of
/// its own (`tokio::spawn`) and awaits it: the responder's delivery
/// (pending after its first poll) must not wait for the slot its requester
/// holds. (With the first version of a waiting room for task slots it
/// did, and the request timed out; found by the review of the session's
/// diff.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_from_a_task_spawned_by_a_handler_holding_the_last_slot_is_answered() {
    let mut failed = Vec::new();
    for mode in common::MODES {
        let bus = Bus::<u32>::builder()
            .delivery(mode)
            .max_inflight_tasks(1)
            .build()
            .unwrap();
        let _responder = yielding_responder(&bus);
        let (answered, answer) = tokio::sync::oneshot::channel();
        let answered = std::sync::Mutex::new(Some(answered));
        let requester = bus.clone();
        let _requester = bus
            .subscribe_async("go", move |_: Arc<Message<u32>>| {
                let bus = requester.clone();
                let answered = answered.lock().unwrap().take();
                async move {
                    tokio::task::yield_now().await;
                    let reply = tokio::spawn(async move {
                        bus.request("rpc", 41, Duration::from_secs(3)).await
                    })
                    .await
                    .unwrap();
                    if let Some(answered) = answered {
                        let _ = answered.send(reply.map(|m| *m.data()));
                    }
                }
            })
            .unwrap();
        bus.publish("go", 0).unwrap();
        let reply = tokio::time::timeout(Duration::from_secs(20), answer)
            .await
            .expect("the requester never finished")
            .unwrap();
        if reply.as_ref().ok().copied() != Some(42) {
            failed.push(format!("{mode:?}: {reply:?}"));
        }
        let _ = tokio::time::timeout(Duration::from_secs(20), bus.close()).await;
    }
    assert!(failed.is_empty(), "requests not answered: {failed:?}");
}

/// `close()` awaited in an async handler whose task runner, at the task
/// cap, awaits it together with another pending delivery of the same
/// publish: that other delivery is counted as soon as it finishes, so
/// `close` (which waits for everything but its own delivery) returns.
/// Found by the thirty-first session's random API test: the runner counted
/// both only once both were done, and `close` waited out `close_timeout`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn close_from_an_async_handler_awaited_with_another_at_the_cap_returns() {
    let bus = Bus::<u32>::builder()
        .delivery(DeliveryMode::TaskPerSubscriber)
        .max_inflight_tasks(1)
        .close_timeout(Duration::from_secs(3))
        .build()
        .unwrap();
    let _other = bus
        .subscribe_async("#", |_m: Arc<Message<u32>>| async {
            tokio::time::sleep(Duration::from_micros(300)).await
        })
        .unwrap();
    let result: Arc<std::sync::Mutex<Option<Result<(), Error>>>> = Arc::default();
    let _closer = {
        let (bus, result) = (bus.clone(), Arc::clone(&result));
        bus.clone()
            .subscribe_async("z/close", move |_m: Arc<Message<u32>>| {
                let (bus, result) = (bus.clone(), Arc::clone(&result));
                async move {
                    let closed = bus.close().await;
                    *result.lock().unwrap() = Some(closed);
                }
            })
            .unwrap()
    };
    bus.publish("z/close", 1).unwrap();
    let closed = taken_within(&result, Duration::from_secs(10)).await;
    assert!(
        matches!(closed, Some(Ok(()))),
        "close() from the handler: {closed:?}"
    );
    assert!(wait_until(Duration::from_secs(10), || bus
        .inflight_messages()
        == 0));
}

/// `TaskPerSubscriber` under `Error` with no task slot free: a publish
/// whose lane's task cannot start drops what the lane holds, other
/// publishers' queued publishes too (counted), but reports only its own
/// deliveries in `Overloaded`, never more than it matched. Found by the
/// thirty-first session's review: it reported every publish it dropped
/// (11–12 dropped of 6 matched).
#[test]
fn a_lane_that_cannot_start_its_task_reports_only_the_publishs_own_drops() {
    for _ in 0..20 {
        lane_without_a_task_slot_reports_its_own_drops();
    }
}

fn lane_without_a_task_slot_reports_its_own_drops() {
    let rt = common::runtime(2);
    let bus = Bus::<u32>::builder()
        .delivery(DeliveryMode::TaskPerSubscriber)
        .workers(1)
        .queue_capacity(2)
        .max_inflight_tasks(2)
        .overflow(Overflow::Error)
        .runtime(rt.handle().clone())
        .build()
        .unwrap();
    let mut subs: Vec<_> = ["t", "t", "t", "+", "#"]
        .into_iter()
        .map(|filter| {
            bus.subscribe_ordered(filter, |m| {
                if m.data() % 97 == 0 {
                    std::thread::sleep(Duration::from_micros(50));
                }
            })
            .unwrap()
        })
        .collect();
    subs.push(
        bus.subscribe_async("t", |_m: Arc<Message<u32>>| async {
            tokio::task::yield_now().await;
        })
        .unwrap(),
    );
    let over = Arc::new(AtomicU64::new(0));
    let publishers: Vec<_> = (0..4u32)
        .map(|p| {
            let (bus, over) = (bus.clone(), Arc::clone(&over));
            std::thread::spawn(move || {
                for i in 0..1_000 {
                    match bus.publish("t", p * 1_000 + i) {
                        Ok(_) => {}
                        Err(Error::Overloaded {
                            dropped, matched, ..
                        }) => {
                            if dropped > matched {
                                over.fetch_add(1, Ordering::Relaxed);
                            }
                        }
                        Err(e) => panic!("{e:?}"),
                    }
                }
            })
        })
        .collect();
    for publisher in publishers {
        publisher.join().unwrap();
    }
    assert!(wait_until(Duration::from_secs(20), || bus
        .inflight_messages()
        == 0));
    let stats = bus.stats();
    assert_eq!(stats.delivered + stats.dropped, 6 * 4_000, "{stats:?}");
    assert_eq!(
        over.load(Ordering::Relaxed),
        0,
        "publishes reported more drops than they matched: {stats:?}"
    );
}

/// `close()` awaited in an async handler whose future is finished where it
/// runs, because another delivery holds the only task slot (`Inline`: on
/// the publisher's thread; `WorkerPool`: on the worker), returns once
/// everything else has drained. The rest of that publish's deliveries wait
/// behind the handler on the same stack, so they are its caller's, not
/// something to wait for. Every way there: `close` first awaited in the
/// handler's first poll (before its future was found pending) or in a
/// later one, and a publisher that is a runtime task (`block_in_place`) or
/// a plain thread (`block_on`). Found by the thirty-first session's random
/// API test (`CloseTimeout` with 2 in flight); the first-poll case by the
/// thirty-second session's review of its own fix.
#[test]
fn close_from_an_async_handler_finished_in_place_at_the_task_cap_returns() {
    for mode in [DeliveryMode::WorkerPool, DeliveryMode::Inline] {
        for yield_first in [true, false] {
            for from_a_task in [true, false] {
                let (closed, after_ran) = close_in_place_round(mode, yield_first, from_a_task);
                assert!(
                    matches!(closed, Some((Ok(()), 1))) && after_ran,
                    "{mode:?}, yield first: {yield_first}, publisher a task: {from_a_task}: \
                     close() from the handler, and whether it waited for the other \
                     handler: {closed:?}; the handler behind it ran: {after_ran}"
                );
            }
        }
    }
}

/// What `close` returned in a handler, with another handler's count then.
type Closed = Option<(Result<(), Error>, u64)>;

/// One round of the test above: what `close` returned with the slot
/// holder's count when it did, and whether the sync handler behind the
/// closer ran.
fn close_in_place_round(
    mode: DeliveryMode,
    yield_first: bool,
    from_a_task: bool,
) -> (Closed, bool) {
    let rt = common::runtime(2);
    let bus = Bus::<u32>::builder()
        .delivery(mode)
        .max_inflight_tasks(1)
        .close_timeout(Duration::from_secs(3))
        .runtime(rt.handle().clone())
        .build()
        .unwrap();
    // Holds the one task slot for a while (its first poll is pending):
    // `close` must wait for it.
    let slept = Arc::new(AtomicU64::new(0));
    let _slot_holder = {
        let slept = Arc::clone(&slept);
        bus.subscribe_async("#", move |_m: Arc<Message<u32>>| {
            let slept = Arc::clone(&slept);
            async move {
                tokio::time::sleep(Duration::from_millis(200)).await;
                slept.fetch_add(1, Ordering::SeqCst);
            }
        })
        .unwrap()
    };
    let result: Arc<std::sync::Mutex<Closed>> = Arc::default();
    let _closer = {
        let (bus, result, slept) = (bus.clone(), Arc::clone(&result), Arc::clone(&slept));
        bus.clone()
            .subscribe_async("z/close", move |_m: Arc<Message<u32>>| {
                let (bus, result, slept) = (bus.clone(), Arc::clone(&result), Arc::clone(&slept));
                async move {
                    if yield_first {
                        tokio::task::yield_now().await;
                    }
                    // Pending at its first poll either way: finished in place.
                    let closed = bus.close().await;
                    *result.lock().unwrap() = Some((closed, slept.load(Ordering::SeqCst)));
                }
            })
            .unwrap()
    };
    let after = Arc::new(AtomicU64::new(0));
    let _after = {
        let after = Arc::clone(&after);
        bus.subscribe("#", move |_m| {
            after.fetch_add(1, Ordering::SeqCst);
        })
        .unwrap()
    };
    let publisher = if from_a_task {
        let bus = bus.clone();
        let task = rt.spawn(async move { bus.publish("z/close", 1) });
        let handle = rt.handle().clone();
        std::thread::spawn(move || handle.block_on(task).unwrap())
    } else {
        let bus = bus.clone();
        std::thread::spawn(move || bus.publish("z/close", 1))
    };
    let closed = rt.block_on(taken_within(&result, Duration::from_secs(10)));
    let after_ran = wait_until(Duration::from_secs(10), || {
        after.load(Ordering::SeqCst) == 1
    });
    assert!(
        matches!(publisher.join(), Ok(Ok(3))),
        "the publish matched 3"
    );
    assert!(wait_until(Duration::from_secs(10), || bus
        .inflight_messages()
        == 0));
    (closed, after_ran)
}

/// `TaskPerSubscriber` under the default `Wait`: publishers on every thread
/// of the runtime wait for room in a lane whose server, a publisher thread
/// outside the runtime, finishes an async handler's future in place at the
/// task cap; the future awaits a timer, which only the runtime's threads
/// drive. A stalled publisher with nothing queued to serve now runs its own
/// job. Found by the thirty-second session's random API test: the
/// publishers never returned (in the first three rounds of four runs).
#[test]
fn wait_in_task_mode_does_not_deadlock_on_an_async_handlers_timer() {
    for round in 0..20 {
        assert!(
            timer_handler_round(2, 200, Duration::from_secs(10)),
            "round {round}: the publishers were still blocked in publish after 10 s"
        );
    }
}

/// One round: a `TaskPerSubscriber` bus with one lane and two task slots,
/// an async handler that sleeps, a publisher thread outside the runtime and
/// `runtime_publishers` publisher tasks. `false` if the publishers did not
/// all return within `limit` (the stuck threads and runtime are left).
fn timer_handler_round(runtime_publishers: usize, per: u32, limit: Duration) -> bool {
    let rt = common::runtime(runtime_publishers);
    let bus = Bus::<u32>::builder()
        .delivery(DeliveryMode::TaskPerSubscriber)
        .overflow(Overflow::Wait)
        .workers(1)
        .max_inflight_tasks(2)
        .runtime(rt.handle().clone())
        .build()
        .unwrap();
    let calls = Arc::new(AtomicU64::new(0));
    let _sub = {
        let calls = Arc::clone(&calls);
        bus.subscribe_async("t", move |_m: Arc<Message<u32>>| {
            let calls = Arc::clone(&calls);
            async move {
                tokio::time::sleep(Duration::from_micros(300)).await;
                calls.fetch_add(1, Ordering::SeqCst);
            }
        })
        .unwrap()
    };
    let (done_tx, done) = std::sync::mpsc::channel();
    for _ in 0..runtime_publishers {
        let (bus, done_tx) = (bus.clone(), done_tx.clone());
        rt.spawn(async move {
            for n in 0..per {
                bus.publish("t", n).unwrap();
            }
            let _ = done_tx.send(());
        });
    }
    {
        let (bus, done_tx) = (bus.clone(), done_tx.clone());
        std::thread::spawn(move || {
            for n in 0..per {
                bus.publish("t", n).unwrap();
            }
            let _ = done_tx.send(());
        });
    }
    let deadline = std::time::Instant::now() + limit;
    for _ in 0..=runtime_publishers {
        let left = deadline.saturating_duration_since(std::time::Instant::now());
        if done.recv_timeout(left).is_err() {
            std::mem::forget(rt);
            return false;
        }
    }
    rt.block_on(async { tokio::time::timeout(Duration::from_secs(10), bus.close()).await })
        .expect("close hung")
        .expect("close");
    assert_eq!(
        calls.load(Ordering::SeqCst),
        (runtime_publishers as u64 + 1) * u64::from(per)
    );
    true
}

/// What a handler left in `slot`, once it did, or `None` after `within`.
async fn taken_within<R>(slot: &std::sync::Mutex<Option<R>>, within: Duration) -> Option<R> {
    let deadline = std::time::Instant::now() + within;
    while slot.lock().unwrap().is_none() && std::time::Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    slot.lock().unwrap().take()
}
