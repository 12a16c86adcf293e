//! The thirty-fifth session's review of its own changes. The first four
//! tests failed on the code as reviewed, each fixed since:
//! - a handler subscribing an ordered handler with a retained snapshot:
//!   the snapshot's catch-up renewed the handler's own presence, so a wait
//!   for the handler returned mid-call (the snapshot now runs in a
//!   presence of its own);
//! - a publish from a future a pool worker finishes in place, under
//!   `Batch::Single`, ran one unit of n (now one run per runner);
//! - a relay of sync handlers started there nested on the worker's stack
//!   without bound (the mark is cleared while the job's handlers run);
//! - least loaded kept the load of handed-over messages the pool dropped.
//!
//! The mapping properties (NATS) passed as reviewed. Every step that could
//! hang runs under a time limit.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

mod common;

use blazesub::{Bus, DeliveryMode, Subscription};
use common::{block_on, within};

const LIMIT: Duration = Duration::from_secs(15);

fn rt() -> tokio::runtime::Runtime {
    common::runtime(2)
}

fn bus_on(mode: DeliveryMode, rt: &tokio::runtime::Runtime) -> Bus<u32> {
    Bus::<u32>::builder()
        .delivery(mode)
        .workers(2)
        .runtime(rt.handle().clone())
        .build()
        .unwrap()
}

fn spin(micros: u64) {
    let end = Instant::now() + Duration::from_micros(micros);
    while Instant::now() < end {
        std::hint::spin_loop();
    }
}

fn wait_until(limit: Duration, cond: impl FnMut() -> bool) -> bool {
    common::wait_until(limit, cond)
}

// ---------------------------------------------------------------------------
// 1. The renewal of a presence that a handler's call depends on.
// ---------------------------------------------------------------------------

/// A handler `X` subscribes a sync ordered handler with a retained snapshot
/// from inside its call. `subscribe_ordered` runs the snapshot and then the
/// catch-up of the live messages that arrived meanwhile *without a presence
/// of its own* (`Bus::insert_ordered` -> `OrderedSink::run_snapshot` ->
/// `hand_back` -> `run`), so `renew_if_outermost` finds the thread's only
/// presence, the one of the runner calling `X`, and renews it: an
/// `unsubscribe_and_wait` of `X` in progress returns while `X`'s call is
/// still running.
#[test]
fn unsubscribe_and_wait_outlasts_a_handler_that_subscribes_ordered_with_a_snapshot() {
    let mut failures = Vec::new();
    for mode in common::MODES {
        let rt = rt();
        let bus = bus_on(mode, &rt);
        bus.publish_retained("o", 0).unwrap();
        let in_x = Arc::new(AtomicBool::new(false));
        let go = Arc::new(AtomicBool::new(false));
        let kept: Arc<Mutex<Option<Subscription>>> = Arc::new(Mutex::new(None));
        let fed = Arc::new(AtomicU64::new(0));
        let x = {
            let (weak, in_x, go, kept, fed) = (
                bus.downgrade(),
                Arc::clone(&in_x),
                Arc::clone(&go),
                Arc::clone(&kept),
                Arc::clone(&fed),
            );
            bus.subscribe("x", move |_| {
                in_x.store(true, Ordering::SeqCst);
                // Until the waiter has flipped the epoch and waits for us.
                wait_until(LIMIT, || go.load(Ordering::SeqCst));
                let bus = weak.upgrade().unwrap();
                let fed = Arc::clone(&fed);
                let sub = bus
                    .subscribe_ordered("o", move |m| {
                        if *m.data() == 0 {
                            // The snapshot's call: live messages pile up.
                            let start = fed.load(Ordering::SeqCst);
                            wait_until(LIMIT, || fed.load(Ordering::SeqCst) >= start + 4);
                        }
                        spin(300);
                    })
                    .unwrap();
                *kept.lock().unwrap() = Some(sub);
                // X's call goes on a little after the subscribe.
                std::thread::sleep(Duration::from_millis(300));
                in_x.store(false, Ordering::SeqCst);
            })
            .unwrap()
        };
        let stop = Arc::new(AtomicBool::new(false));
        let feeders: Vec<_> = (0..2)
            .map(|_| {
                let (bus, stop, fed) = (bus.clone(), Arc::clone(&stop), Arc::clone(&fed));
                std::thread::spawn(move || {
                    let mut n = 1;
                    while !stop.load(Ordering::Relaxed) {
                        let _ = bus.publish("o", n);
                        fed.fetch_add(1, Ordering::SeqCst);
                        n += 1;
                        spin(100);
                    }
                })
            })
            .collect();
        let x_publisher = {
            let bus = bus.clone();
            std::thread::spawn(move || bus.publish("x", 0))
        };
        assert!(wait_until(LIMIT, || in_x.load(Ordering::SeqCst)));
        let waited = Arc::new(AtomicBool::new(false));
        let waiter = {
            let waited = Arc::clone(&waited);
            std::thread::spawn(move || {
                block_on(x.unsubscribe_and_wait());
                waited.store(true, Ordering::SeqCst);
            })
        };
        std::thread::sleep(Duration::from_millis(50));
        go.store(true, Ordering::SeqCst);
        // Whether the wait returned while X's call was still running.
        let mut early = false;
        let started = Instant::now();
        while started.elapsed() < Duration::from_secs(3) {
            if waited.load(Ordering::SeqCst) {
                early = in_x.load(Ordering::SeqCst);
                break;
            }
            std::thread::sleep(Duration::from_micros(200));
        }
        stop.store(true, Ordering::Relaxed);
        for f in feeders {
            f.join().unwrap();
        }
        within(LIMIT, "the waiter", move || waiter.join().unwrap());
        within(LIMIT, "x's publish", move || x_publisher.join().unwrap()).unwrap();
        if early {
            failures.push(format!(
                "{mode:?}: unsubscribe_and_wait of X returned while X's call (which subscribed an ordered handler with a snapshot) was still running"
            ));
        }
        drop(kept.lock().unwrap().take());
        rt.shutdown_background();
    }
    assert!(failures.is_empty(), "{failures:#?}");
}

// ---------------------------------------------------------------------------
// 5. A publish made by a future a pool worker finishes in place.
// ---------------------------------------------------------------------------

/// A pool bus whose one task slot is taken by a `hog` delivery that stays
/// pending until `release` is notified.
fn capped_pool(
    rt: &tokio::runtime::Runtime,
    batch: blazesub::Batch,
) -> (Bus<u32>, Arc<tokio::sync::Notify>, Subscription) {
    let bus = Bus::<u32>::builder()
        .delivery(DeliveryMode::WorkerPool)
        .workers(2)
        .batch(batch)
        .max_inflight_tasks(1)
        .runtime(rt.handle().clone())
        .build()
        .unwrap();
    let release = Arc::new(tokio::sync::Notify::new());
    let polled = Arc::new(AtomicBool::new(false));
    let hog = {
        let (release, polled) = (Arc::clone(&release), Arc::clone(&polled));
        bus.subscribe_async("hog", move |_| {
            let (release, polled) = (Arc::clone(&release), Arc::clone(&polled));
            async move {
                let notified = release.notified();
                polled.store(true, Ordering::SeqCst);
                notified.await
            }
        })
        .unwrap()
    };
    bus.publish("hog", 0).unwrap();
    // Its delivery holds the only task slot once its first poll returned
    // (then it continues as a task).
    assert!(wait_until(LIMIT, || polled.load(Ordering::SeqCst)));
    std::thread::sleep(Duration::from_millis(200));
    assert_eq!(bus.inflight_messages(), 1);
    (bus, release, hog)
}

/// `Batch::Single` below the threshold plans one runner per subscription,
/// each making a single claim. An async handler's future that a pool
/// worker finishes in place (the task cap is full) publishes to a topic
/// with two sync subscribers: `Pool::dispatch`'s `holds_runner_here` branch
/// runs `caller_runs` once, which makes one claim, and the other
/// subscription's delivery is never run nor counted: it stays in flight
/// for good and `close` times out.
#[test]
fn a_publish_from_a_future_finished_in_place_reaches_every_subscriber_under_batch_single() {
    let rt = rt();
    let (bus, release, _hog) = capped_pool(&rt, blazesub::Batch::Single);
    let calls = Arc::new(AtomicU64::new(0));
    let _subs: Vec<_> = (0..2)
        .map(|_| {
            let calls = Arc::clone(&calls);
            bus.subscribe("fan", move |_| {
                calls.fetch_add(1, Ordering::SeqCst);
            })
            .unwrap()
        })
        .collect();
    let published = Arc::new(AtomicBool::new(false));
    let _a = {
        let (weak, published) = (bus.downgrade(), Arc::clone(&published));
        bus.subscribe_async("a", move |_| {
            let (weak, published) = (weak.clone(), Arc::clone(&published));
            async move {
                // Pending at its first poll: the worker finishes it in place.
                tokio::task::yield_now().await;
                if let Some(bus) = weak.upgrade() {
                    let _ = bus.publish("fan", 1);
                }
                published.store(true, Ordering::SeqCst);
            }
        })
        .unwrap()
    };
    bus.publish("a", 0).unwrap();
    assert!(wait_until(LIMIT, || published.load(Ordering::SeqCst)));
    release.notify_waiters();
    let settled = wait_until(Duration::from_secs(3), || bus.inflight_messages() == 0);
    let (got, inflight, stats) = (
        calls.load(Ordering::SeqCst),
        bus.inflight_messages(),
        bus.stats(),
    );
    rt.shutdown_background();
    assert!(
        got == 2 && settled,
        "expected 2 calls and nothing in flight; got {got} call(s), {inflight} in flight after 3 s: {stats:?}"
    );
}

thread_local! {
    static DEPTH: std::cell::Cell<u32> = const { std::cell::Cell::new(0) };
}

/// The same in-place future publishes once to `ping`, whose sync handler
/// publishes the next `ping` until 200 (a relay, harmless in `WorkerPool`
/// mode: each publish is queued). Under the held runner's marker every one
/// of those publishes runs its job on the publishing thread, inside the
/// handler that made it: the relay nests 200 deep on one stack, with no
/// depth limit (`MAX_INLINE_DEPTH` applies to `Inline` mode only); a longer
/// relay overflows the worker's stack.
#[test]
fn a_relay_started_by_a_future_finished_in_place_does_not_nest_without_bound() {
    let rt = rt();
    let (bus, release, _hog) = capped_pool(&rt, blazesub::Batch::Chunked);
    let deepest = Arc::new(AtomicU64::new(0));
    let last = Arc::new(AtomicU64::new(0));
    let _relay = {
        let (weak, deepest, last) = (bus.downgrade(), Arc::clone(&deepest), Arc::clone(&last));
        bus.subscribe("ping", move |m| {
            let depth = DEPTH.with(|d| {
                d.set(d.get() + 1);
                d.get()
            });
            deepest.fetch_max(u64::from(depth), Ordering::SeqCst);
            last.store(u64::from(*m.data()), Ordering::SeqCst);
            if *m.data() < 200 {
                if let Some(bus) = weak.upgrade() {
                    let _ = bus.publish("ping", m.data() + 1);
                }
            }
            DEPTH.with(|d| d.set(d.get() - 1));
        })
        .unwrap()
    };
    let _a = {
        let weak = bus.downgrade();
        bus.subscribe_async("a", move |_| {
            let weak = weak.clone();
            async move {
                tokio::task::yield_now().await;
                if let Some(bus) = weak.upgrade() {
                    let _ = bus.publish("ping", 0);
                }
            }
        })
        .unwrap()
    };
    bus.publish("a", 0).unwrap();
    assert!(wait_until(LIMIT, || last.load(Ordering::SeqCst) == 200));
    release.notify_waiters();
    assert!(wait_until(LIMIT, || bus.inflight_messages() == 0));
    let deepest = deepest.load(Ordering::SeqCst);
    rt.shutdown_background();
    assert!(
        deepest <= 64,
        "the relay nested {deepest} handler calls deep on one stack (a pool bus queues each publish; Inline stops at 64)"
    );
}

// ---------------------------------------------------------------------------
// 3. A leaving stream member's queue handed to handler members.
// ---------------------------------------------------------------------------

/// `SharePolicy::LeastLoaded`, `Overflow::Drop`, a pool whose one worker is
/// busy and whose queue is full. A group's stream member holding three
/// messages is dropped: each is picked for one of two idle handler members
/// (`state.picked()`, their loads become 2 and 1), and `Bus::dispatch_to`'s
/// job is refused for lack of room and counted dropped, but
/// `SharedGroups::pass_on` takes the pick back only when `dispatch_to`
/// returns `false` (a closing bus), not when the dispatcher dropped the job.
/// The loads never come down: from then on every message goes to the
/// member with the lower leaked load, however idle the other is.
#[test]
fn least_loaded_forgets_picks_whose_handover_the_pool_dropped() {
    let rt = rt();
    let bus = Bus::<u32>::builder()
        .delivery(DeliveryMode::WorkerPool)
        .workers(1)
        .queue_capacity(1)
        .overflow(blazesub::Overflow::Drop)
        .share_policy(blazesub::SharePolicy::LeastLoaded)
        .runtime(rt.handle().clone())
        .build()
        .unwrap();
    let stream = bus.subscribe_stream("$share/g/t").unwrap();
    for n in 0..3 {
        bus.publish("t", n).unwrap();
    }
    assert_eq!(stream.len(), 3);
    let counts: Vec<Arc<AtomicU64>> = (0..2).map(|_| Arc::new(AtomicU64::new(0))).collect();
    let _members: Vec<_> = counts
        .iter()
        .map(|count| {
            let count = Arc::clone(count);
            bus.subscribe("$share/g/t", move |_| {
                count.fetch_add(1, Ordering::SeqCst);
            })
            .unwrap()
        })
        .collect();
    // The worker busy, its queue full.
    let gate = Arc::new(common::Gate::new());
    let entered = Arc::new(AtomicBool::new(false));
    let _block = {
        let (gate, entered) = (Arc::clone(&gate), Arc::clone(&entered));
        bus.subscribe("block", move |_| {
            entered.store(true, Ordering::SeqCst);
            gate.wait();
        })
        .unwrap()
    };
    bus.publish("block", 0).unwrap();
    assert!(wait_until(LIMIT, || entered.load(Ordering::SeqCst)));
    bus.publish("block", 1).unwrap();
    let before = bus.stats();
    drop(stream);
    let after_drop = bus.stats();
    gate.open();
    assert!(wait_until(LIMIT, || bus.inflight_messages() == 0));
    // Idle members from now on: one message at a time.
    let base: Vec<u64> = counts.iter().map(|c| c.load(Ordering::SeqCst)).collect();
    for n in 0..20 {
        bus.publish("t", n).unwrap();
        assert!(wait_until(LIMIT, || bus.inflight_messages() == 0));
    }
    let got: Vec<u64> = counts
        .iter()
        .zip(&base)
        .map(|(c, b)| c.load(Ordering::SeqCst) - b)
        .collect();
    let stats = bus.stats();
    rt.shutdown_background();
    assert!(
        got.iter().all(|&g| g >= 5),
        "20 messages to two idle least-loaded members split {got:?} (dropped by the handover: {}); stats {stats:?}",
        after_drop.dropped - before.dropped
    );
}

// ---------------------------------------------------------------------------
// 4. The NATS subject mapping is one-to-one, `$` included (a probe that
//    holds).
// ---------------------------------------------------------------------------

#[cfg(feature = "nats")]
mod mapping_properties {
    use blazesub::bridge::mapping::{subject_to_topic, topic_to_subject};
    use blazesub::topic::validate_topic;
    use proptest::prelude::*;

    fn level() -> impl Strategy<Value = String> {
        proptest::collection::vec(
            prop_oneof![
                Just('$'),
                Just('%'),
                Just('.'),
                Just('*'),
                Just('>'),
                Just(' '),
                Just('\t'),
                Just('\u{7f}'),
                Just('a'),
                Just('2'),
                Just('4'),
                Just('é'),
                Just('\u{2028}'),
                any::<char>(),
            ],
            0..5,
        )
        .prop_map(|chars| chars.into_iter().collect())
    }

    fn topic() -> impl Strategy<Value = String> {
        proptest::collection::vec(level(), 1..4).prop_map(|levels| levels.join("/"))
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(20_000))]

        #[test]
        fn every_valid_topic_round_trips_and_distinct_topics_differ(a in topic(), b in topic()) {
            for t in [&a, &b] {
                if validate_topic(t).is_ok() {
                    let s = topic_to_subject(t);
                    let back = subject_to_topic(&s);
                    prop_assert_eq!(back.as_deref(), Some(t.as_str()), "subject {}", s);
                    prop_assert!(!s.starts_with('$'), "{} -> {}", t, s);
                }
            }
            if a != b && validate_topic(&a).is_ok() && validate_topic(&b).is_ok() {
                prop_assert_ne!(topic_to_subject(&a), topic_to_subject(&b));
            }
        }

        #[test]
        fn a_subject_maps_back_only_from_its_one_topic(s in "[$%.*>a-c2-4A-F/ é]{0,12}") {
            if let Some(t) = subject_to_topic(&s) {
                // (`%` maps back to the empty topic, which is no valid
                // topic: an import of that subject is refused at publish.)
                prop_assert_eq!(topic_to_subject(&t), s);
            }
        }
    }
}
