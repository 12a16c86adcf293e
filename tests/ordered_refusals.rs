//! Sync ordered handlers under `Overflow::Drop` and `Overflow::Error`: a
//! delivery that could not be queued drops its own message only. Earlier
//! publishes whose work was queued (their `publish` returned `Ok` without
//! dropping) still reach the handler, in order, and every delivery is
//! delivered or counted once.

mod common;

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use blazesub::{Bus, DeliveryMode, Error, Overflow, Subscription};
use common::{runtime, wait_until, Gate};

const LIMIT: Duration = Duration::from_secs(20);

/// What a recording handler saw, in call order.
type Seen = Arc<Mutex<Vec<u32>>>;

/// A plain handler on `topic` that says when it started and then waits at
/// `gate`: it holds the only worker, or a lane's task.
fn blocker(bus: &Bus<u32>, topic: &str, gate: &Arc<Gate>) -> (Subscription, Arc<AtomicU64>) {
    let started = Arc::new(AtomicU64::new(0));
    let sub = {
        let (gate, started) = (Arc::clone(gate), Arc::clone(&started));
        bus.subscribe(topic, move |_| {
            started.fetch_add(1, Ordering::SeqCst);
            gate.wait();
        })
        .unwrap()
    };
    (sub, started)
}

/// An ordered and a plain handler on `t`, each recording what it got.
fn ordered_and_plain(bus: &Bus<u32>) -> (Seen, Seen, [Subscription; 2]) {
    let ordered: Seen = Arc::default();
    let plain: Seen = Arc::default();
    let subs = [
        {
            let seen = Arc::clone(&ordered);
            bus.subscribe_ordered("t", move |m| seen.lock().unwrap().push(*m.data()))
                .unwrap()
        },
        {
            let seen = Arc::clone(&plain);
            bus.subscribe("t", move |m| seen.lock().unwrap().push(*m.data()))
                .unwrap()
        },
    ];
    (ordered, plain, subs)
}

/// One pool worker with a queue of one job, held by a blocked handler:
/// publish 0 is queued, publish 1 is refused. Before, the refusal ran the
/// ordered subscription's log from its cursor in discard mode and dropped
/// the queued 0 with it.
fn a_refusal_leaves_the_queued_message(policy: Overflow) {
    let rt = runtime(2);
    let bus = Bus::<u32>::builder()
        .delivery(DeliveryMode::WorkerPool)
        .workers(1)
        .queue_capacity(1)
        .overflow(policy)
        .runtime(rt.handle().clone())
        .build()
        .unwrap();
    let gate = Arc::new(Gate::new());
    let (_block, started) = blocker(&bus, "block", &gate);
    let (ordered, plain, _subs) = ordered_and_plain(&bus);
    bus.publish("block", 0).unwrap();
    assert!(wait_until(LIMIT, || started.load(Ordering::SeqCst) == 1));
    bus.publish("t", 0).unwrap();
    let dropped_before = bus.stats().dropped;
    let refused = bus.publish("t", 1);
    match policy {
        Overflow::Error => assert!(
            matches!(refused, Err(Error::Overloaded { .. })),
            "{refused:?}"
        ),
        _ => assert!(refused.is_ok(), "{refused:?}"),
    }
    assert_eq!(
        bus.stats().dropped - dropped_before,
        2,
        "publish 1's two deliveries are dropped, no more"
    );
    gate.open();
    assert!(wait_until(LIMIT, || bus.inflight_messages() == 0));
    // The next publish runs past the refused position.
    bus.publish("t", 2).unwrap();
    assert!(wait_until(LIMIT, || bus.inflight_messages() == 0));
    assert_eq!(*plain.lock().unwrap(), [0, 2]);
    assert_eq!(*ordered.lock().unwrap(), [0, 2], "{:?}", bus.stats());
    assert_eq!(bus.stats().dropped - dropped_before, 2, "{:?}", bus.stats());
}

#[test]
fn under_drop_a_refusal_leaves_an_earlier_queued_ordered_message() {
    a_refusal_leaves_the_queued_message(Overflow::Drop);
}

#[test]
fn under_error_a_refusal_leaves_an_earlier_queued_ordered_message() {
    a_refusal_leaves_the_queued_message(Overflow::Error);
}

/// The same in `TaskPerSubscriber`: the lane's task is blocked in a
/// handler with publish 0 queued behind it, both task slots are taken, and
/// publish 1 finds the lane full.
#[test]
fn a_refusal_in_a_full_lane_leaves_an_earlier_queued_ordered_message() {
    let rt = runtime(2);
    let bus = Bus::<u32>::builder()
        .delivery(DeliveryMode::TaskPerSubscriber)
        .workers(1)
        .max_inflight_tasks(2)
        .overflow(Overflow::Drop)
        .runtime(rt.handle().clone())
        .build()
        .unwrap();
    // An async delivery pending until released holds the second slot.
    let hold = Arc::new(tokio::sync::Semaphore::new(0));
    let holding = Arc::new(AtomicU64::new(0));
    let _hold = {
        let (hold, holding) = (Arc::clone(&hold), Arc::clone(&holding));
        bus.subscribe_async("hold", move |_| {
            let (hold, holding) = (Arc::clone(&hold), Arc::clone(&holding));
            async move {
                holding.fetch_add(1, Ordering::SeqCst);
                let _ = hold.acquire().await.unwrap();
            }
        })
        .unwrap()
    };
    let gate = Arc::new(Gate::new());
    let (_block, started) = blocker(&bus, "block", &gate);
    let (ordered, plain, _subs) = ordered_and_plain(&bus);
    bus.publish("hold", 0).unwrap();
    assert!(wait_until(LIMIT, || holding.load(Ordering::SeqCst) == 1));
    bus.publish("block", 0).unwrap();
    assert!(wait_until(LIMIT, || started.load(Ordering::SeqCst) == 1));
    bus.publish("t", 0).unwrap(); // queued: the lane holds two publishes
    let dropped_before = bus.stats().dropped;
    bus.publish("t", 1).unwrap(); // the lane is full: dropped, counted
    gate.open();
    hold.add_permits(10);
    assert!(wait_until(LIMIT, || bus.inflight_messages() == 0));
    assert_eq!(*plain.lock().unwrap(), [0]);
    assert_eq!(*ordered.lock().unwrap(), [0], "{:?}", bus.stats());
    assert_eq!(bus.stats().dropped - dropped_before, 2, "{:?}", bus.stats());
}

/// Many publishes into a queue that is full most of the time, from two
/// publishers, with an ordered log that keeps them all: the ordered handler gets every publish the plain handler
/// beside it got (their deliveries are queued or refused together, and a
/// refused ordered delivery that finds its runner at work still runs), in
/// each publisher's order; every delivery is delivered or counted dropped,
/// exactly once; and under `Error` a publish fails exactly when it dropped.
fn a_full_queue_loses_only_refused_ordered_messages(mode: DeliveryMode, policy: Overflow) {
    const PER_PUBLISHER: u32 = 20_000;
    let rt = runtime(2);
    let bus = Bus::<u32>::builder()
        .delivery(mode)
        .workers(1)
        .queue_capacity(4)
        .max_inflight_tasks(2)
        // The ordered log keeps every publish: what it pushes out is lost by
        // its own bound (the handler fell that far behind), not by a refusal.
        .stream_capacity(1 << 16)
        .overflow(policy)
        .runtime(rt.handle().clone())
        .build()
        .unwrap();
    let (ordered, plain, _subs) = ordered_and_plain(&bus);
    // A handler that is slow now and then keeps the queue full.
    let _slow = bus
        .subscribe("t", |m| {
            if m.data() % 64 == 0 {
                std::thread::sleep(Duration::from_micros(200));
            }
        })
        .unwrap();
    let failed = Arc::new(AtomicU64::new(0));
    let publishers: Vec<_> = (0..2u32)
        .map(|p| {
            let (bus, failed) = (bus.clone(), Arc::clone(&failed));
            std::thread::spawn(move || {
                for i in 0..PER_PUBLISHER {
                    match bus.publish("t", p * PER_PUBLISHER + i) {
                        Ok(_) => {}
                        Err(Error::Overloaded { .. }) => {
                            failed.fetch_add(1, Ordering::Relaxed);
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
    assert!(
        wait_until(LIMIT, || bus.inflight_messages() == 0),
        "{:?}",
        bus.stats()
    );
    let ordered = ordered.lock().unwrap().clone();
    let plain = plain.lock().unwrap().clone();
    let stats = bus.stats();
    let label = format!("{mode:?} {policy:?}: {stats:?}");
    for p in 0..2 {
        let own: Vec<_> = ordered
            .iter()
            .filter(|&&v| v / PER_PUBLISHER == p)
            .collect();
        assert!(
            own.windows(2).all(|w| w[0] < w[1]),
            "{label}: publisher {p}'s order broken"
        );
    }
    let got: std::collections::HashSet<_> = ordered.iter().copied().collect();
    let missing: Vec<_> = plain.iter().filter(|v| !got.contains(v)).collect();
    assert!(
        missing.is_empty(),
        "{label}: {} publishes reached the plain handler and not the ordered one, \
         first {:?}",
        missing.len(),
        &missing[..missing.len().min(8)]
    );
    let total = u64::from(2 * PER_PUBLISHER);
    // Three subscriptions; the slow one's deliveries are queued and
    // refused with the plain one's.
    let refused_jobs = total - plain.len() as u64;
    let ordered_lost = total - ordered.len() as u64;
    assert_eq!(
        stats.dropped,
        2 * refused_jobs + ordered_lost,
        "{label}: every refused delivery counted once"
    );
    assert_eq!(stats.delivered, 3 * total - stats.dropped, "{label}");
    if policy == Overflow::Error {
        assert!(
            failed.load(Ordering::Relaxed) <= refused_jobs
                && failed.load(Ordering::Relaxed) > 0
                && refused_jobs > 0,
            "{label}: {} publishes failed, {refused_jobs} refused",
            failed.load(Ordering::Relaxed)
        );
    }
    assert!(refused_jobs > 0, "{label}: the queue never overflowed");
}

#[test]
fn a_full_pool_queue_loses_only_refused_ordered_messages() {
    a_full_queue_loses_only_refused_ordered_messages(DeliveryMode::WorkerPool, Overflow::Drop);
    a_full_queue_loses_only_refused_ordered_messages(DeliveryMode::WorkerPool, Overflow::Error);
}

#[test]
fn a_full_lane_loses_only_refused_ordered_messages() {
    a_full_queue_loses_only_refused_ordered_messages(
        DeliveryMode::TaskPerSubscriber,
        Overflow::Drop,
    );
    a_full_queue_loses_only_refused_ordered_messages(
        DeliveryMode::TaskPerSubscriber,
        Overflow::Error,
    );
}

/// A pool bus with one worker held by a blocked handler and `queue`
/// publishes to `t` queued behind it, so every later publish to `t` is
/// refused under `policy`; then four publisher threads named `pub-N`
/// publish 20,000 each to `t`, handing each result to `check`.
fn refusing_publishers(
    policy: Overflow,
    queue: u32,
    stream_capacity: usize,
    subscribe: impl FnOnce(&Bus<u32>) -> Subscription,
    check: impl Fn(Result<usize, Error>) + Send + Sync + 'static,
) -> Bus<u32> {
    let rt = runtime(2);
    let bus = Bus::<u32>::builder()
        .delivery(DeliveryMode::WorkerPool)
        .workers(1)
        .queue_capacity(queue as usize)
        .stream_capacity(stream_capacity)
        .overflow(policy)
        .runtime(rt.handle().clone())
        .build()
        .unwrap();
    let gate = Arc::new(Gate::new());
    let (_block, started) = blocker(&bus, "block", &gate);
    let _sub = subscribe(&bus);
    bus.publish("block", 0).unwrap();
    assert!(wait_until(LIMIT, || started.load(Ordering::SeqCst) == 1));
    for value in 0..queue {
        bus.publish("t", value).unwrap();
    }
    let check = Arc::new(check);
    let publishers: Vec<_> = (0..4u32)
        .map(|p| {
            let (bus, check) = (bus.clone(), Arc::clone(&check));
            std::thread::Builder::new()
                .name(format!("pub-{p}"))
                .spawn(move || {
                    for i in 0..20_000 {
                        check(bus.publish("t", 1_000 + p * 20_000 + i));
                    }
                })
                .unwrap()
        })
        .collect();
    for publisher in publishers {
        publisher.join().unwrap();
    }
    gate.open();
    assert!(wait_until(LIMIT, || bus.inflight_messages() == 0));
    bus
}

/// A refused delivery never calls the handler on the publisher's thread
/// (that would be `CallerRuns`, outside what `unsubscribe_and_wait` and a
/// handler's `close()` know of). Found by the session's review: the first
/// version of the fix ran the log when another refusal counted in while it
/// noted its position, 1,000 to 10,000 calls on publisher threads.
#[test]
fn a_refusing_publisher_never_runs_the_ordered_handler() {
    let ran_here = Arc::new(AtomicU64::new(0));
    let counter = Arc::clone(&ran_here);
    refusing_publishers(
        Overflow::Drop,
        1,
        1024,
        move |bus| {
            bus.subscribe_ordered("t", move |_| {
                let name = std::thread::current().name().map(str::to_owned);
                if name.is_some_and(|n| n.starts_with("pub-")) {
                    counter.fetch_add(1, Ordering::SeqCst);
                }
            })
            .unwrap()
        },
        |result| assert!(result.is_ok(), "{result:?}"),
    );
    assert_eq!(ran_here.load(Ordering::SeqCst), 0);
}

/// `Error::Overloaded` reports the publish's own refused deliveries, never
/// more than it matched. The first version of the fix let a refusing
/// publisher that ran the log count the positions the log had pushed out
/// (other publishes', queued and returned `Ok`) as its own.
#[test]
fn overloaded_reports_only_the_publishs_own_refused_deliveries() {
    let over = Arc::new(AtomicBool::new(false));
    let seen = Arc::clone(&over);
    let bus = refusing_publishers(
        Overflow::Error,
        8,
        2,
        |bus| bus.subscribe_ordered("t", |_| {}).unwrap(),
        move |result| match result {
            Ok(_) => {}
            Err(Error::Overloaded {
                dropped, matched, ..
            }) => {
                if dropped > matched {
                    seen.store(true, Ordering::SeqCst);
                }
            }
            Err(e) => panic!("{e:?}"),
        },
    );
    assert!(!over.load(Ordering::SeqCst), "{:?}", bus.stats());
}

/// One worker, a queue of two; four publishers flood `t` (a handler of
/// about 200 µs a call) while `x` is published to every 200 µs: `x` must
/// run during the flood, as it does beside a plain handler on `t`. Found by
/// the session's second review: refusals that counted in behind the
/// ordered subscription's runner kept it running (it went round again for
/// each), so the only worker never let go, and nothing else ran for the
/// whole flood (the code before the session did the same).
fn a_flood_of_refusals_leaves_the_worker_to_other_topics(policy: Overflow, ordered: bool) {
    let rt = runtime(2);
    let bus = Bus::<u32>::builder()
        .delivery(DeliveryMode::WorkerPool)
        .workers(1)
        .queue_capacity(2)
        .stream_capacity(64)
        .overflow(policy)
        .runtime(rt.handle().clone())
        .build()
        .unwrap();
    let calls = Arc::new(AtomicU64::new(0));
    let handler = {
        let calls = Arc::clone(&calls);
        move |_: &blazesub::Message<u32>| {
            calls.fetch_add(1, Ordering::Relaxed);
            let start = std::time::Instant::now();
            while start.elapsed() < Duration::from_micros(200) {
                std::hint::spin_loop();
            }
        }
    };
    let _t = if ordered {
        bus.subscribe_ordered("t", handler)
    } else {
        bus.subscribe("t", handler)
    }
    .unwrap();
    let x_ran = Arc::new(AtomicBool::new(false));
    let _x = {
        let x_ran = Arc::clone(&x_ran);
        bus.subscribe("x", move |_| x_ran.store(true, Ordering::SeqCst))
            .unwrap()
    };
    let stop = Arc::new(AtomicBool::new(false));
    let publishers: Vec<_> = (0..4u32)
        .map(|p| {
            let (bus, stop) = (bus.clone(), Arc::clone(&stop));
            std::thread::spawn(move || {
                let mut i = 0;
                while !stop.load(Ordering::Relaxed) {
                    let _ = bus.publish("t", p * 10_000_000 + i);
                    i += 1;
                    std::thread::sleep(Duration::from_micros(20));
                }
            })
        })
        .collect();
    std::thread::sleep(Duration::from_millis(200));
    let flood_end = std::time::Instant::now() + Duration::from_secs(3);
    while std::time::Instant::now() < flood_end && !x_ran.load(Ordering::SeqCst) {
        match bus.publish("x", 0) {
            Ok(_) | Err(Error::Overloaded { .. }) => {}
            Err(e) => panic!("{e:?}"),
        }
        std::thread::sleep(Duration::from_micros(200));
    }
    let ran = x_ran.load(Ordering::SeqCst);
    let during = calls.load(Ordering::Relaxed);
    stop.store(true, Ordering::SeqCst);
    for publisher in publishers {
        publisher.join().unwrap();
    }
    assert!(wait_until(LIMIT, || bus.inflight_messages() == 0));
    assert!(
        ran,
        "{policy:?}, ordered {ordered}: nothing published to `x` ran during 3 s of flood \
         (`t`'s handler made {during} calls): {:?}",
        bus.stats()
    );
}

#[test]
fn a_flood_of_refusals_into_an_ordered_handler_leaves_the_worker_to_other_topics() {
    a_flood_of_refusals_leaves_the_worker_to_other_topics(Overflow::Drop, true);
    a_flood_of_refusals_leaves_the_worker_to_other_topics(Overflow::Error, true);
    // The control: a plain handler on `t`.
    a_flood_of_refusals_leaves_the_worker_to_other_topics(Overflow::Drop, false);
}

/// Four publishers into a full queue or lane, with an ordered log of two
/// (so refused positions are pushed out before a runner reaches them, and
/// while it works through a read), with and without a second ordered
/// node (`#`): every delivery is delivered or dropped exactly once,
/// `delivered` equals the calls made, calls never overlap, and each
/// publisher's order holds. The session's third version counted up to
/// 8,000 deliveries twice here: a note forgot a refused position as
/// pushed out while a runner was working through the read that held it.
#[test]
fn refusals_pushed_out_of_a_small_log_are_counted_once() {
    const PER: u32 = 5_000;
    for mode in [DeliveryMode::WorkerPool, DeliveryMode::TaskPerSubscriber] {
        for policy in [Overflow::Drop, Overflow::Error] {
            for batch in [blazesub::Batch::Chunked, blazesub::Batch::Single] {
                for second_node in [false, true] {
                    let rt = runtime(2);
                    let bus = Bus::<u32>::builder()
                        .delivery(mode)
                        .workers(1)
                        .queue_capacity(2)
                        .max_inflight_tasks(2)
                        .batch(batch)
                        .stream_capacity(2)
                        .overflow(policy)
                        .runtime(rt.handle().clone())
                        .build()
                        .unwrap();
                    let seen: Seen = Arc::default();
                    let calls = Arc::new(AtomicU64::new(0));
                    let busy = Arc::new(AtomicBool::new(false));
                    let _t = {
                        let (seen, calls, busy) =
                            (Arc::clone(&seen), Arc::clone(&calls), Arc::clone(&busy));
                        bus.subscribe_ordered("t", move |m| {
                            assert!(!busy.swap(true, Ordering::SeqCst), "calls overlapped");
                            calls.fetch_add(1, Ordering::SeqCst);
                            seen.lock().unwrap().push(*m.data());
                            if m.data() % 97 == 0 {
                                std::thread::sleep(Duration::from_micros(100));
                            }
                            busy.store(false, Ordering::SeqCst);
                        })
                        .unwrap()
                    };
                    let _all = second_node.then(|| {
                        let calls = Arc::clone(&calls);
                        bus.subscribe_ordered("#", move |_| {
                            calls.fetch_add(1, Ordering::SeqCst);
                        })
                        .unwrap()
                    });
                    let publishers: Vec<_> = (0..4u32)
                        .map(|p| {
                            let bus = bus.clone();
                            std::thread::spawn(move || {
                                for i in 0..PER {
                                    match bus.publish("t", p * PER + i) {
                                        Ok(_) | Err(Error::Overloaded { .. }) => {}
                                        Err(e) => panic!("{e:?}"),
                                    }
                                }
                            })
                        })
                        .collect();
                    for publisher in publishers {
                        publisher.join().unwrap();
                    }
                    let label = format!("{mode:?} {policy:?} {batch:?} second node {second_node}");
                    assert!(
                        wait_until(LIMIT, || bus.inflight_messages() == 0),
                        "{label}: {:?}",
                        bus.stats()
                    );
                    let stats = bus.stats();
                    let subscriptions = if second_node { 2 } else { 1 };
                    assert_eq!(
                        stats.delivered + stats.dropped,
                        u64::from(4 * PER) * subscriptions,
                        "{label}: each delivery counted once: {stats:?}"
                    );
                    assert_eq!(stats.delivered, calls.load(Ordering::SeqCst), "{label}");
                    let seen = seen.lock().unwrap();
                    for p in 0..4 {
                        let own: Vec<_> = seen.iter().filter(|&&v| v / PER == p).collect();
                        assert!(own.windows(2).all(|w| w[0] < w[1]), "{label}: order");
                    }
                }
            }
        }
    }
}
