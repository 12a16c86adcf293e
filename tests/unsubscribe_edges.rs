//! Ending a subscription, for every kind and delivery mode, as the
//! thirty-fourth session's review found it: `unsubscribe`,
//! `unsubscribe_and_wait` (and dropping its future), dropping handles,
//! captures dropped without a bus lock, counts under churn, interest
//! queries, ending after `close`. Two failed before their fixes:
//! `async_ordered_fn_body_panic_is_caught_and_counted` and
//! `async_ordered_closure_is_dropped_when_unsubscribe_and_wait_returns_mid_drain`.
//! Two are ignored: a known defect of the global grace period that
//! `unsubscribe_and_wait` waits for (two handlers each blocking on their
//! own), documented on it and in the design notes (§10, thirty-fourth
//! session), left for a design that knows which subscription each runner
//! is calling. A third, a busy ordered runner holding up every wait, was
//! fixed in the thirty-fifth session (its runner renews its presence
//! between catch-up rounds). Every step that could hang runs
//! under a time limit and fails instead.

use std::future::Future;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::block_on;

mod common;

use blazesub::{
    Batch, Bus, DeliveryMode, Message, Overflow, Receiver, StreamOptions, StreamOverflow,
    Subscription,
};

const LIMIT: Duration = Duration::from_secs(15);

const MODES: [DeliveryMode; 3] = [
    DeliveryMode::Inline,
    DeliveryMode::WorkerPool,
    DeliveryMode::TaskPerSubscriber,
];

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap()
}

fn bus_with(
    mode: DeliveryMode,
    rt: &tokio::runtime::Runtime,
    f: impl FnOnce(blazesub::BusBuilder<u32>) -> blazesub::BusBuilder<u32>,
) -> Bus<u32> {
    f(Bus::<u32>::builder()
        .delivery(mode)
        .workers(2)
        .runtime(rt.handle().clone()))
    .build()
    .unwrap()
}

fn bus_on(mode: DeliveryMode, rt: &tokio::runtime::Runtime) -> Bus<u32> {
    bus_with(mode, rt, |b| b)
}

/// Runs `f` on a thread; panics if it does not finish within `limit`.
fn within<R: Send + 'static>(
    limit: Duration,
    what: &str,
    f: impl FnOnce() -> R + Send + 'static,
) -> R {
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(f());
    });
    match rx.recv_timeout(limit) {
        Ok(r) => r,
        Err(_) => panic!("{what}: did not finish within {limit:?} (deadlock?)"),
    }
}

fn wait_until(limit: Duration, mut check: impl FnMut() -> bool) -> bool {
    let deadline = Instant::now() + limit;
    while Instant::now() < deadline {
        if check() {
            return true;
        }
        std::thread::sleep(Duration::from_millis(2));
    }
    check()
}

fn quiet(bus: &Bus<u32>) {
    assert!(
        wait_until(LIMIT, || bus.inflight_messages() == 0),
        "deliveries still in flight: {:?}",
        bus.stats()
    );
}

fn spin(micros: u64) {
    let end = Instant::now() + Duration::from_micros(micros);
    while Instant::now() < end {
        std::hint::spin_loop();
    }
}

// ---------------------------------------------------------------------------
// Kinds of subscriptions.
// ---------------------------------------------------------------------------

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    Sync,
    Async,
    OrderedSync,
    OrderedAsync,
    SharedSync,
    SharedAsync,
    /// A sync handler that started with a retained snapshot.
    PrimedSync,
    /// A sync ordered handler that started with a retained snapshot.
    PrimedOrdered,
    PrimedAsync,
}

const KINDS: [Kind; 9] = [
    Kind::Sync,
    Kind::Async,
    Kind::OrderedSync,
    Kind::OrderedAsync,
    Kind::SharedSync,
    Kind::SharedAsync,
    Kind::PrimedSync,
    Kind::PrimedOrdered,
    Kind::PrimedAsync,
];

/// What a probe handler records.
#[derive(Default)]
struct Probe {
    /// Calls between entering the `Fn` body and the end of the call (for an
    /// async handler: the end of its future).
    inside: AtomicU64,
    started: AtomicU64,
    finished: AtomicU64,
}

/// Subscribes a probe handler of `kind` on `filter` (a plain filter; shared
/// kinds get `$share/g/` in front). `work`: microseconds each call spins.
fn subscribe_kind(
    bus: &Bus<u32>,
    kind: Kind,
    filter: &str,
    probe: &Arc<Probe>,
    work: u64,
) -> Subscription {
    let shared = format!("$share/g/{filter}");
    let sync_handler = {
        let probe = Arc::clone(probe);
        move |_m: &Message<u32>| {
            probe.inside.fetch_add(1, Ordering::SeqCst);
            probe.started.fetch_add(1, Ordering::SeqCst);
            spin(work);
            probe.finished.fetch_add(1, Ordering::SeqCst);
            probe.inside.fetch_sub(1, Ordering::SeqCst);
        }
    };
    let async_handler = {
        let probe = Arc::clone(probe);
        move |_m: Arc<Message<u32>>| {
            probe.inside.fetch_add(1, Ordering::SeqCst);
            probe.started.fetch_add(1, Ordering::SeqCst);
            let probe = Arc::clone(&probe);
            async move {
                tokio::task::yield_now().await;
                spin(work);
                tokio::task::yield_now().await;
                probe.finished.fetch_add(1, Ordering::SeqCst);
                probe.inside.fetch_sub(1, Ordering::SeqCst);
            }
        }
    };
    subscribe_as(bus, kind, filter, &shared, sync_handler, async_handler)
}

// ---------------------------------------------------------------------------
// 1. After unsubscribe_and_wait returns, no call of the handler is running
//    and none starts.
// ---------------------------------------------------------------------------

/// A named change to a bus's builder.
type Setting = (
    &'static str,
    fn(blazesub::BusBuilder<u32>) -> blazesub::BusBuilder<u32>,
);

fn configs() -> Vec<Setting> {
    vec![
        ("default", |b| b),
        ("threshold 1, chunked", |b| {
            b.max_concurrent_subscriptions(1)
        }),
        ("threshold 1, single", |b| {
            b.max_concurrent_subscriptions(1).batch(Batch::Single)
        }),
        ("caller runs, queue 2", |b| {
            b.overflow(Overflow::CallerRuns)
                .queue_capacity(2)
                .max_inflight_tasks(2)
        }),
    ]
}

#[test]
fn unsubscribe_and_wait_leaves_no_call_running_any_kind_any_mode() {
    let mut failures = Vec::new();
    for mode in MODES {
        for (name, config) in configs() {
            for kind in KINDS {
                let rt = runtime();
                let bus = bus_with(mode, &rt, config);
                // Company on the same filter, so jobs batch and chunk.
                let mut company = Vec::new();
                for _ in 0..3 {
                    company.push(bus.subscribe("t/x/#", |_: &Message<u32>| spin(5)).unwrap());
                }
                let probe = Arc::new(Probe::default());
                let sub = subscribe_kind(&bus, kind, "t/x/#", &probe, 30);
                let stop = Arc::new(AtomicBool::new(false));
                let publishers: Vec<_> = (0..2)
                    .map(|p| {
                        let (bus, stop) = (bus.clone(), Arc::clone(&stop));
                        std::thread::spawn(move || {
                            let mut n = 0u32;
                            while !stop.load(Ordering::Relaxed) {
                                let _ = bus.publish(&format!("t/x/{p}"), n);
                                n += 1;
                                if n % 64 == 0 {
                                    std::thread::yield_now();
                                }
                            }
                        })
                    })
                    .collect();
                assert!(wait_until(LIMIT, || probe.started.load(Ordering::SeqCst) > 20));
                let what = format!("{mode:?}/{name}/{kind:?}");
                within(LIMIT, &what, move || block_on(sub.unsubscribe_and_wait()));
                let inside = probe.inside.load(Ordering::SeqCst);
                let started = probe.started.load(Ordering::SeqCst);
                std::thread::sleep(Duration::from_millis(30));
                let started_later = probe.started.load(Ordering::SeqCst);
                stop.store(true, Ordering::Relaxed);
                for p in publishers {
                    p.join().unwrap();
                }
                if inside != 0 || started_later != started {
                    failures.push(format!(
                        "{what}: inside after return = {inside}, calls started after return = {}",
                        started_later - started
                    ));
                }
                drop(company);
                quiet(&bus);
            }
        }
    }
    assert!(failures.is_empty(), "{failures:#?}");
}

// ---------------------------------------------------------------------------
// 2. The handler's captures are dropped with no bus lock held: a capture
//    whose Drop acts on the same bus finishes.
// ---------------------------------------------------------------------------

/// Acts on its bus when dropped, then raises `done`.
struct ActsOnDrop {
    bus: Mutex<Option<Bus<u32>>>,
    done: Arc<AtomicBool>,
}

impl Drop for ActsOnDrop {
    fn drop(&mut self) {
        if let Some(bus) = self.bus.lock().unwrap().take() {
            if let Ok(s) = bus.subscribe("z/drop", |_: &Message<u32>| {}) {
                drop(s);
            }
            let _ = bus.publish("z/drop", 1);
            let _ = bus.publish("t/x/1", 1);
            let _ = bus.subscribers("t/x/1");
            let _ = bus.has_subscribers("t/x/1");
            let _ = bus.subscriptions_count();
            let _ = bus.stats();
            let _ = bus.retained("#");
            if let Ok(rx) = bus.subscribe_stream("z/drop") {
                drop(rx);
            }
        }
        self.done.store(true, Ordering::SeqCst);
    }
}

fn subscribe_owning(
    bus: &Bus<u32>,
    kind: Kind,
    filter: &str,
    owned: ActsOnDrop,
    probe: &Arc<Probe>,
) -> Subscription {
    let shared = format!("$share/g/{filter}");
    let owned = Arc::new(owned);
    let sync_handler = {
        let (owned, probe) = (Arc::clone(&owned), Arc::clone(probe));
        move |_m: &Message<u32>| {
            let _keep = &owned;
            probe.started.fetch_add(1, Ordering::SeqCst);
            spin(20);
        }
    };
    let async_handler = {
        let (owned, probe) = (Arc::clone(&owned), Arc::clone(probe));
        move |_m: Arc<Message<u32>>| {
            let _keep = &owned;
            probe.started.fetch_add(1, Ordering::SeqCst);
            async move {
                tokio::task::yield_now().await;
            }
        }
    };
    drop(owned);
    subscribe_as(bus, kind, filter, &shared, sync_handler, async_handler)
}

#[derive(Clone, Copy, Debug)]
enum Ending {
    Unsubscribe,
    UnsubscribeAndWait,
    /// Dropped while deliveries to it are queued behind a slow handler.
    DropWhileQueued,
    CloseThenUnsubscribe,
    UnsubscribeThenClose,
}

#[test]
fn captures_dropped_without_a_bus_lock_every_kind_and_ending() {
    let mut failures = Vec::new();
    for mode in MODES {
        for ending in [
            Ending::Unsubscribe,
            Ending::UnsubscribeAndWait,
            Ending::DropWhileQueued,
            Ending::CloseThenUnsubscribe,
            Ending::UnsubscribeThenClose,
        ] {
            for kind in KINDS {
                let what = format!("{mode:?}/{ending:?}/{kind:?}");
                let rt = runtime();
                let bus = bus_with(mode, &rt, |b| {
                    b.workers(1)
                        .queue_capacity(64)
                        .overflow(Overflow::Drop)
                        .close_timeout(Duration::from_secs(5))
                });
                let done = Arc::new(AtomicBool::new(false));
                let probe = Arc::new(Probe::default());
                let owned = ActsOnDrop {
                    bus: Mutex::new(Some(bus.clone())),
                    done: Arc::clone(&done),
                };
                let sub = subscribe_owning(&bus, kind, "t/x/#", owned, &probe);
                // A slow companion holds the (only) worker.
                let gate = Arc::new(AtomicBool::new(false));
                let slow = {
                    let gate = Arc::clone(&gate);
                    bus.subscribe("t/x/#", move |m: &Message<u32>| {
                        if m.is_retained() {
                            return;
                        }
                        let end = Instant::now() + Duration::from_millis(300);
                        while !gate.load(Ordering::SeqCst) && Instant::now() < end {
                            std::thread::sleep(Duration::from_millis(1));
                        }
                    })
                    .unwrap()
                };
                if !matches!(mode, DeliveryMode::Inline) {
                    for n in 0..6 {
                        let _ = bus.publish("t/x/1", n);
                    }
                }
                let bus2 = bus.clone();
                let gate2 = Arc::clone(&gate);
                let ended = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                    within(LIMIT, &what, move || match ending {
                        Ending::Unsubscribe => {
                            gate2.store(true, Ordering::SeqCst);
                            sub.unsubscribe()
                        }
                        Ending::UnsubscribeAndWait => {
                            gate2.store(true, Ordering::SeqCst);
                            block_on(sub.unsubscribe_and_wait())
                        }
                        Ending::DropWhileQueued => {
                            drop(sub);
                            gate2.store(true, Ordering::SeqCst);
                        }
                        Ending::CloseThenUnsubscribe => {
                            gate2.store(true, Ordering::SeqCst);
                            let _ = block_on(bus2.close());
                            sub.unsubscribe();
                        }
                        Ending::UnsubscribeThenClose => {
                            sub.unsubscribe();
                            gate2.store(true, Ordering::SeqCst);
                            let _ = block_on(bus2.close());
                        }
                    })
                }));
                if ended.is_err() {
                    failures.push(format!("{what}: ending the subscription hung"));
                    gate.store(true, Ordering::SeqCst);
                    continue;
                }
                drop(slow);
                if !wait_until(Duration::from_secs(5), || done.load(Ordering::SeqCst)) {
                    failures.push(format!("{what}: captures not dropped (or their Drop hung)"));
                }
                gate.store(true, Ordering::SeqCst);
                rt.shutdown_background(); // does not wait for a stuck thread
            }
        }
    }
    assert!(failures.is_empty(), "{failures:#?}");
}

// ---------------------------------------------------------------------------
// 3. Stats add up while subscriptions of every kind come and go.
// ---------------------------------------------------------------------------

fn options(capacity: usize, overflow: StreamOverflow) -> StreamOptions {
    StreamOptions::new(capacity).overflow(overflow)
}

fn counting_sync(count: &Arc<AtomicU64>) -> impl Fn(&Message<u32>) + Send + Sync + 'static {
    let count = Arc::clone(count);
    move |_| {
        count.fetch_add(1, Ordering::Relaxed);
    }
}

fn counting_async(
    count: &Arc<AtomicU64>,
) -> impl Fn(Arc<Message<u32>>) -> std::pin::Pin<Box<dyn Future<Output = ()> + Send>>
       + Send
       + Sync
       + 'static {
    let count = Arc::clone(count);
    move |_| {
        let count = Arc::clone(&count);
        Box::pin(async move {
            tokio::task::yield_now().await;
            count.fetch_add(1, Ordering::Relaxed);
        })
    }
}

#[test]
fn stats_add_up_under_churn_of_every_kind() {
    const M: u32 = 2_000;
    let mut failures = Vec::new();
    for mode in MODES {
        for (name, config) in configs() {
            let what = format!("{mode:?}/{name}");
            let rt = runtime();
            // Ordered kinds lose (counted) what falls a log behind: room for all.
            let bus = bus_with(mode, &rt, |b| config(b).stream_capacity(1 << 13));
            let kept_sync = Arc::new(AtomicU64::new(0));
            let kept_async = Arc::new(AtomicU64::new(0));
            let kept_ordered = Arc::new(AtomicU64::new(0));
            let kept_ordered_async = Arc::new(AtomicU64::new(0));
            let kept_shared = Arc::new(AtomicU64::new(0));
            let subs = vec![
                bus.subscribe("s/+", counting_sync(&kept_sync)).unwrap(),
                bus.subscribe_async("s/+", counting_async(&kept_async))
                    .unwrap(),
                bus.subscribe_ordered("s/+", counting_sync(&kept_ordered))
                    .unwrap(),
                bus.subscribe_ordered_async("s/+", counting_async(&kept_ordered_async))
                    .unwrap(),
                bus.subscribe("$share/g1/s/+", counting_sync(&kept_shared))
                    .unwrap(),
                bus.subscribe_async("$share/g1/s/+", counting_async(&kept_shared))
                    .unwrap(),
            ];
            let mut lossless = bus
                .subscribe_stream_with("s/+", options(1 << 16, StreamOverflow::Backpressure))
                .unwrap();
            let mut oldest = bus
                .subscribe_stream_with("s/+", options(1 << 14, StreamOverflow::DropOldest))
                .unwrap();
            let stop = Arc::new(AtomicBool::new(false));
            let churn = {
                let (bus, stop) = (bus.clone(), Arc::clone(&stop));
                std::thread::spawn(move || {
                    let sink = Arc::new(AtomicU64::new(0));
                    let mut rounds = 0u64;
                    while !stop.load(Ordering::Relaxed) {
                        rounds += 1;
                        let subs = vec![
                            bus.subscribe("s/+", counting_sync(&sink)).unwrap(),
                            bus.subscribe_async("s/#", counting_async(&sink)).unwrap(),
                            bus.subscribe_ordered("s/+", counting_sync(&sink)).unwrap(),
                            bus.subscribe_ordered_async("s/a", counting_async(&sink))
                                .unwrap(),
                            bus.subscribe("$share/g1/s/+", counting_sync(&sink))
                                .unwrap(),
                            bus.subscribe_async("$share/g2/s/+", counting_async(&sink))
                                .unwrap(),
                            bus.subscribe("$share/g2/s/+", counting_sync(&sink))
                                .unwrap(),
                        ];
                        let mut streams = one_stream_per_policy(&bus);
                        streams.push(bus.subscribe_stream("$share/g1/s/+").unwrap());
                        streams.push(bus.subscribe_stream("$share/g2/s/+").unwrap());
                        std::thread::sleep(Duration::from_micros(300));
                        for rx in streams.iter_mut().step_by(2) {
                            while rx.try_recv().is_ok() {}
                        }
                        // End them in varied orders and ways.
                        if rounds % 2 == 0 {
                            drop(streams);
                            for s in subs {
                                s.unsubscribe();
                            }
                        } else {
                            for s in subs.into_iter().rev() {
                                block_on(s.unsubscribe_and_wait());
                            }
                            drop(streams);
                        }
                    }
                    rounds
                })
            };
            let publishers = publish_on_two_topics(&bus, M);
            // Readers keep the kept streams moving.
            let mut read_lossless = 0u64;
            let mut read_oldest = 0u64;
            while !publishers.iter().all(|p| p.is_finished()) {
                while lossless.try_recv().is_ok() {
                    read_lossless += 1;
                }
                while oldest.try_recv().is_ok() {
                    read_oldest += 1;
                }
                std::thread::sleep(Duration::from_micros(200));
            }
            let matched: u64 = publishers.into_iter().map(|p| p.join().unwrap()).sum();
            stop.store(true, Ordering::Relaxed);
            let rounds = churn.join().unwrap();
            quiet(&bus);
            while lossless.try_recv().is_ok() {
                read_lossless += 1;
            }
            while oldest.try_recv().is_ok() {
                read_oldest += 1;
            }
            let lost_oldest = oldest.lost();
            drop(subs);
            drop(lossless);
            drop(oldest);
            quiet(&bus);
            let s = bus.stats();
            let accounted = s.delivered + s.dropped + s.handler_panics;
            let each = 2 * u64::from(M);
            let kept = [
                ("sync", kept_sync.load(Ordering::SeqCst)),
                ("async", kept_async.load(Ordering::SeqCst)),
                ("ordered", kept_ordered.load(Ordering::SeqCst)),
                ("ordered async", kept_ordered_async.load(Ordering::SeqCst)),
                ("lossless stream", read_lossless),
                ("drop-oldest stream read + lost", read_oldest + lost_oldest),
            ];
            for (k, got) in kept {
                if got != each {
                    failures.push(format!(
                        "{what}: kept {k} subscription got {got}, expected {each}"
                    ));
                }
            }
            if accounted > matched {
                failures.push(format!(
                    "{what}: delivered+dropped+panics = {accounted} > sum of publish results {matched} ({s:?}, churn rounds {rounds})"
                ));
            }
            if s.inflight != 0 || s.subscriptions != 0 {
                failures.push(format!("{what}: left over: {s:?}"));
            }
            rt.shutdown_background();
        }
    }
    assert!(failures.is_empty(), "{failures:#?}");
}

/// With only stream subscriptions coming and going (handlers kept), nothing
/// may be skipped: every publish result must be accounted exactly.
#[test]
fn stats_add_up_exactly_under_stream_churn() {
    const M: u32 = 2_000;
    let mut failures = Vec::new();
    for mode in MODES {
        for (name, config) in configs() {
            let what = format!("{mode:?}/{name}");
            let rt = runtime();
            let bus = bus_with(mode, &rt, config);
            let count = Arc::new(AtomicU64::new(0));
            let subs = vec![
                bus.subscribe("s/+", counting_sync(&count)).unwrap(),
                bus.subscribe_async("s/+", counting_async(&count)).unwrap(),
                bus.subscribe_ordered("s/+", counting_sync(&count)).unwrap(),
                bus.subscribe_ordered_async("s/+", counting_async(&count))
                    .unwrap(),
                bus.subscribe("$share/g1/s/+", counting_sync(&count))
                    .unwrap(),
                bus.subscribe_async("$share/g1/s/+", counting_async(&count))
                    .unwrap(),
            ];
            let mut kept_member = bus
                .subscribe_stream_with_capacity("$share/g1/s/+", 1 << 14)
                .unwrap();
            let stop = Arc::new(AtomicBool::new(false));
            let churn = {
                let (bus, stop) = (bus.clone(), Arc::clone(&stop));
                std::thread::spawn(move || {
                    let mut rounds = 0u64;
                    while !stop.load(Ordering::Relaxed) {
                        rounds += 1;
                        let mut streams = one_stream_per_policy(&bus);
                        streams.push(bus.subscribe_stream("$share/g1/s/+").unwrap());
                        streams.push(
                            bus.subscribe_stream_with_capacity("$share/g1/s/+", 2)
                                .unwrap(),
                        );
                        streams.push(bus.subscribe_stream("$share/g2/s/+").unwrap());
                        std::thread::sleep(Duration::from_micros(300));
                        for rx in streams.iter_mut().step_by(2) {
                            while rx.try_recv().is_ok() {}
                        }
                        if rounds % 2 == 0 {
                            streams.reverse();
                        }
                        drop(streams);
                    }
                    rounds
                })
            };
            let publishers = publish_on_two_topics(&bus, M);
            while !publishers.iter().all(|p| p.is_finished()) {
                while kept_member.try_recv().is_ok() {}
                std::thread::sleep(Duration::from_micros(200));
            }
            let matched: u64 = publishers.into_iter().map(|p| p.join().unwrap()).sum();
            stop.store(true, Ordering::Relaxed);
            let rounds = churn.join().unwrap();
            quiet(&bus);
            while kept_member.try_recv().is_ok() {}
            drop(kept_member);
            drop(subs);
            quiet(&bus);
            let s = bus.stats();
            let accounted = s.delivered + s.dropped + s.handler_panics;
            if accounted != matched {
                failures.push(format!(
                    "{what}: delivered+dropped+panics = {accounted}, sum of publish results = {matched} ({s:?}, churn rounds {rounds})"
                ));
            }
            rt.shutdown_background();
        }
    }
    assert!(failures.is_empty(), "{failures:#?}");
}

// ---------------------------------------------------------------------------
// 4. After unsubscribe_and_wait returns (no publish running), the handler's
//    closure has been dropped.
// ---------------------------------------------------------------------------

fn subscribe_holding(bus: &Bus<u32>, kind: Kind, filter: &str, token: &Arc<()>) -> Subscription {
    let shared = format!("$share/g/{filter}");
    let sync_handler = {
        let token = Arc::clone(token);
        move |_m: &Message<u32>| {
            let _keep = &token;
        }
    };
    let async_handler = {
        let token = Arc::clone(token);
        move |_m: Arc<Message<u32>>| {
            let _keep = &token;
            async move {
                tokio::task::yield_now().await;
            }
        }
    };
    subscribe_as(bus, kind, filter, &shared, sync_handler, async_handler)
}

#[test]
fn closure_is_dropped_when_unsubscribe_and_wait_returns_on_a_quiet_bus() {
    let mut failures = Vec::new();
    for mode in MODES {
        for kind in KINDS {
            for others in [0usize, 3, 100] {
                let what = format!("{mode:?}/{kind:?} beside {others}");
                let rt = runtime();
                let bus = bus_on(mode, &rt);
                let _others: Vec<_> = (0..others)
                    .map(|_| {
                        let t = Arc::new(());
                        bus.subscribe("t/x/#", move |_: &Message<u32>| {
                            let _k = &t;
                        })
                        .unwrap()
                    })
                    .collect();
                let token = Arc::new(());
                let sub = subscribe_holding(&bus, kind, "t/x/#", &token);
                for n in 0..10 {
                    bus.publish("t/x/1", n).unwrap();
                }
                quiet(&bus);
                std::thread::sleep(Duration::from_millis(20));
                within(LIMIT, &what, move || block_on(sub.unsubscribe_and_wait()));
                let count = Arc::strong_count(&token);
                if count != 1 {
                    failures.push(format!(
                        "{what}: {} references left right after return",
                        count - 1
                    ));
                }
                rt.shutdown_background();
            }
        }
    }
    assert!(failures.is_empty(), "{failures:#?}");
}

/// An async ordered handler unsubscribed while its drain is busy: once
/// `unsubscribe_and_wait` returns, its closure must be gone (no publish
/// is running; the drain task is not a publish).
#[test]
fn async_ordered_closure_is_dropped_when_unsubscribe_and_wait_returns_mid_drain() {
    let mut kept = 0;
    const TRIES: usize = 5;
    for _ in 0..TRIES {
        let rt = runtime();
        let bus = bus_with(DeliveryMode::WorkerPool, &rt, |b| {
            b.stream_capacity(1 << 17)
        });
        let token = Arc::new(());
        let release = Arc::new(tokio::sync::Notify::new());
        let entered = Arc::new(AtomicU64::new(0));
        let sub = {
            let (token, release, entered) = (
                Arc::clone(&token),
                Arc::clone(&release),
                Arc::clone(&entered),
            );
            bus.subscribe_ordered_async("o", move |_m| {
                let _keep = &token;
                let (release, entered) = (Arc::clone(&release), Arc::clone(&entered));
                async move {
                    entered.fetch_add(1, Ordering::SeqCst);
                    release.notified().await;
                }
            })
            .unwrap()
        };
        for n in 0..50_000 {
            bus.publish("o", n).unwrap();
        }
        assert!(wait_until(LIMIT, || entered.load(Ordering::SeqCst) == 1));
        let waiter = std::thread::spawn(move || block_on(sub.unsubscribe_and_wait()));
        std::thread::sleep(Duration::from_millis(20));
        release.notify_waiters();
        let waited = Instant::now();
        while !waiter.is_finished() {
            assert!(waited.elapsed() < LIMIT, "unsubscribe_and_wait hangs");
            std::hint::spin_loop();
        }
        let count = Arc::strong_count(&token);
        if count != 1 {
            eprintln!(
                "closure alive after return: {} extra reference(s), {} deliveries still in flight",
                count - 1,
                bus.inflight_messages()
            );
        }
        waiter.join().unwrap();
        if count != 1 {
            kept += 1;
        }
        quiet(&bus);
        rt.shutdown_background();
    }
    assert_eq!(
        kept, 0,
        "closure still alive right after unsubscribe_and_wait returned in {kept} of {TRIES} tries"
    );
}

// ---------------------------------------------------------------------------
// 5. Interest queries reflect the removal as soon as it returns; requests
//    to a removed responder end at once.
// ---------------------------------------------------------------------------

#[test]
fn interest_follows_unsubscribe_at_once_every_kind() {
    let mut failures = Vec::new();
    for mode in MODES {
        for kind in KINDS {
            for how in ["unsubscribe", "drop", "unsubscribe_and_wait"] {
                let what = format!("{mode:?}/{kind:?}/{how}");
                let rt = runtime();
                let bus = bus_on(mode, &rt);
                let probe = Arc::new(Probe::default());
                let sub = subscribe_kind(&bus, kind, "q/+", &probe, 0);
                // Warm the route cache.
                bus.publish("q/a", 1).unwrap();
                if bus.subscribers("q/a") != 1 || !bus.has_subscribers("q/a") {
                    failures.push(format!(
                        "{what}: not counted while subscribed ({})",
                        bus.subscribers("q/a")
                    ));
                }
                match how {
                    "unsubscribe" => sub.unsubscribe(),
                    "drop" => drop(sub),
                    _ => within(LIMIT, &what, move || block_on(sub.unsubscribe_and_wait())),
                }
                let (n, any, count) = (
                    bus.subscribers("q/a"),
                    bus.has_subscribers("q/a"),
                    bus.subscriptions_count(),
                );
                let matched = bus.publish("q/a", 2).unwrap();
                if n != 0 || any || count != 0 || matched != 0 {
                    failures.push(format!(
                        "{what}: after removal subscribers={n} has_subscribers={any} subscriptions_count={count} publish matched {matched}"
                    ));
                }
                // A request now finds no responder, at once.
                let asked = rt.block_on(async {
                    tokio::time::timeout(
                        Duration::from_secs(2),
                        bus.request("q/a", 3, Duration::from_secs(1)),
                    )
                    .await
                });
                if !matches!(asked, Ok(Err(blazesub::Error::NoResponders { .. }))) {
                    failures.push(format!("{what}: request after removal: {asked:?}"));
                }
                quiet(&bus);
                rt.shutdown_background();
            }
        }
        // Streams of every policy, plain and shared.
        for (name, opts) in [
            ("drop oldest", options(8, StreamOverflow::DropOldest)),
            ("drop newest", options(8, StreamOverflow::DropNewest)),
            ("backpressure", options(8, StreamOverflow::Backpressure)),
            ("disconnect", options(8, StreamOverflow::Disconnect)),
        ] {
            for shared in [false, true] {
                if shared && name != "drop oldest" {
                    continue;
                }
                let what = format!("{mode:?}/stream {name} shared={shared}");
                let rt = runtime();
                let bus = bus_on(mode, &rt);
                let filter = if shared { "$share/g/q/+" } else { "q/+" };
                let rx = bus.subscribe_stream_with(filter, opts).unwrap();
                bus.publish("q/a", 1).unwrap();
                drop(rx);
                let (n, any, count) = (
                    bus.subscribers("q/a"),
                    bus.has_subscribers("q/a"),
                    bus.subscriptions_count(),
                );
                let matched = bus.publish("q/a", 2);
                if n != 0 || any || count != 0 || !matches!(matched, Ok(0)) {
                    failures.push(format!(
                        "{what}: after drop subscribers={n} has_subscribers={any} subscriptions_count={count} publish {matched:?}"
                    ));
                }
                quiet(&bus);
                let s = bus.stats();
                if s.delivered + s.dropped != 1 {
                    failures.push(format!("{what}: the unread message is not counted: {s:?}"));
                }
                rt.shutdown_background();
            }
        }
    }
    assert!(failures.is_empty(), "{failures:#?}");
}

/// A responder removed while a request waits: the request times out (it
/// does not hang), and the bus is left clean.
#[test]
fn a_responder_removed_mid_request_lets_the_request_end() {
    for mode in MODES {
        let rt = runtime();
        let bus = bus_on(mode, &rt);
        let gate = Arc::new(AtomicBool::new(false));
        let responder = {
            let (gate, replier) = (Arc::clone(&gate), bus.clone());
            bus.subscribe("rpc/x", move |m: &Message<u32>| {
                while !gate.load(Ordering::SeqCst) {
                    std::thread::sleep(Duration::from_millis(1));
                }
                let _ = replier.reply(m, 1);
            })
            .unwrap()
        };
        let asker = {
            let bus = bus.clone();
            rt.spawn(async move { bus.request("rpc/x", 0, Duration::from_millis(300)).await })
        };
        std::thread::sleep(Duration::from_millis(50));
        if mode != DeliveryMode::Inline {
            responder.unsubscribe();
            gate.store(true, Ordering::SeqCst);
        } else {
            gate.store(true, Ordering::SeqCst);
            responder.unsubscribe();
        }
        let answered =
            rt.block_on(async { tokio::time::timeout(Duration::from_secs(5), asker).await });
        let answered = answered.expect("request hangs").unwrap();
        // The call that had started may still reply; either way it ended.
        assert!(
            answered.is_ok() || matches!(answered, Err(blazesub::Error::Timeout { .. })),
            "{mode:?}: {answered:?}"
        );
        quiet(&bus);
        assert_eq!(bus.subscriptions_count(), 0, "{mode:?}");
        rt.shutdown_background();
    }
}

// ---------------------------------------------------------------------------
// 6. Ending a subscription after close, or after the bus is dropped.
// ---------------------------------------------------------------------------

#[test]
fn ending_after_close_or_bus_drop_is_quiet_every_kind() {
    let mut failures = Vec::new();
    for mode in MODES {
        for kind in KINDS {
            for after in ["close", "drop bus", "close and drop bus"] {
                for how in ["unsubscribe", "unsubscribe_and_wait", "detach"] {
                    let what = format!("{mode:?}/{kind:?}/{after}/{how}");
                    let rt = runtime();
                    let bus = bus_on(mode, &rt);
                    let probe = Arc::new(Probe::default());
                    let sub = subscribe_kind(&bus, kind, "c/+", &probe, 0);
                    let mut rx = bus
                        .subscribe_stream_with("c/+", options(8, StreamOverflow::Backpressure))
                        .unwrap();
                    bus.publish("c/a", 1).unwrap();
                    if after.starts_with("close") {
                        let b = bus.clone();
                        let closed = within(LIMIT, &what, move || block_on(b.close()));
                        if closed.is_err() {
                            failures.push(format!("{what}: close: {closed:?}"));
                        }
                    }
                    let watcher = if after.contains("drop bus") {
                        drop(bus);
                        None
                    } else {
                        Some(bus)
                    };
                    let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                        within(LIMIT, &what, move || match how {
                            "unsubscribe" => sub.unsubscribe(),
                            "unsubscribe_and_wait" => block_on(sub.unsubscribe_and_wait()),
                            _ => sub.detach(),
                        })
                    }));
                    if result.is_err() {
                        failures.push(format!("{what}: ending panicked or hung"));
                    }
                    let _ = rx.try_recv();
                    drop(rx);
                    if let Some(bus) = watcher {
                        let s = bus.stats();
                        if how != "detach" && s.subscriptions != 0 {
                            failures.push(format!("{what}: {s:?}"));
                        }
                    }
                    rt.shutdown_background();
                }
            }
        }
    }
    assert!(failures.is_empty(), "{failures:#?}");
}

// ---------------------------------------------------------------------------
// 7. Churn leaves nothing growing.
// ---------------------------------------------------------------------------

fn rss_kib() -> u64 {
    let statm = std::fs::read_to_string("/proc/self/statm").unwrap_or_default();
    let pages: u64 = statm
        .split_whitespace()
        .nth(1)
        .and_then(|p| p.parse().ok())
        .unwrap_or(0);
    pages * 4
}

#[derive(Clone, Copy, Debug)]
enum ChurnKind {
    Handler(Kind),
    Stream(StreamOverflow),
    SharedStream,
}

fn churn_once(bus: &Bus<u32>, kind: ChurnKind, filter: &str, i: u64) {
    let token = Arc::new(());
    match kind {
        ChurnKind::Handler(Kind::PrimedSync | Kind::PrimedOrdered | Kind::PrimedAsync) => {
            // The retained message is published once by the caller.
            let sub = match kind {
                ChurnKind::Handler(Kind::PrimedSync) => bus.subscribe(filter, move |_| {
                    let _k = &token;
                }),
                ChurnKind::Handler(Kind::PrimedOrdered) => {
                    bus.subscribe_ordered(filter, move |_| {
                        let _k = &token;
                    })
                }
                _ => bus.subscribe_async(filter, move |_| {
                    let _k = Arc::clone(&token);
                    async {}
                }),
            }
            .unwrap();
            end(sub, i);
        }
        ChurnKind::Handler(kind) => end(subscribe_holding(bus, kind, filter, &token), i),
        ChurnKind::Stream(policy) => drop(
            bus.subscribe_stream_with(filter, options(16, policy))
                .unwrap(),
        ),
        ChurnKind::SharedStream => drop(
            bus.subscribe_stream_with_capacity(&format!("$share/g/{filter}"), 16)
                .unwrap(),
        ),
    }
}

fn end(sub: Subscription, i: u64) {
    match i % 3 {
        0 => sub.unsubscribe(),
        1 => drop(sub),
        _ => block_on(sub.unsubscribe_and_wait()),
    }
}

#[test]
fn churn_of_every_kind_leaves_nothing_growing() {
    // 100,000 per kind with REVIEW_CHURN_N=100000 (about a minute in a
    // debug build on 2 cores); fewer by default.
    let n: u64 = std::env::var("REVIEW_CHURN_N")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(20_000);
    let kinds: Vec<ChurnKind> = KINDS
        .iter()
        .map(|k| ChurnKind::Handler(*k))
        .chain([
            ChurnKind::Stream(StreamOverflow::DropOldest),
            ChurnKind::Stream(StreamOverflow::DropNewest),
            ChurnKind::Stream(StreamOverflow::Backpressure),
            ChurnKind::Stream(StreamOverflow::Disconnect),
            ChurnKind::SharedStream,
        ])
        .collect();
    let mut failures = Vec::new();
    let rt = runtime();
    for kind in kinds {
        for same_filter in [true, false] {
            let what = format!("{kind:?}, same filter: {same_filter}");
            let bus = bus_on(DeliveryMode::WorkerPool, &rt);
            bus.publish_retained("m/0/retained", 1).unwrap();
            // An anchor on the filter keeps its node alive, so dead entries
            // would pile up in its set if they were never compacted away.
            let anchor = bus.subscribe("m/+/#", |_| {}).unwrap();
            let anchor_shared = bus.subscribe("$share/g/m/0/#", |_| {}).unwrap();
            let started = Instant::now();
            let mut rss_mid = 0;
            let mut fp_mid = None;
            for i in 0..n {
                let filter = if same_filter {
                    "m/0/#".to_string()
                } else {
                    format!("m/{}/#", i % 50_000)
                };
                churn_once(&bus, kind, &filter, i);
                if i % 1_000 == 0 {
                    let _ = bus.publish("m/0/x", i as u32);
                }
                if i == n / 5 {
                    quiet(&bus);
                    rss_mid = rss_kib();
                    fp_mid = Some(bus.footprint());
                }
                if started.elapsed() > Duration::from_secs(60) {
                    failures.push(format!("{what}: too slow, stopped at {i}"));
                    break;
                }
            }
            quiet(&bus);
            let rss_end = rss_kib();
            let fp = bus.footprint();
            let s = bus.stats();
            eprintln!(
                "{what}: {:?} rss {rss_mid} -> {rss_end} KiB, footprint {fp_mid:?} -> {fp:?}",
                started.elapsed()
            );
            if s.subscriptions != 2 {
                failures.push(format!(
                    "{what}: {} subscriptions left, expected 2",
                    s.subscriptions
                ));
            }
            if rss_end > rss_mid + 16 * 1024 {
                failures.push(format!("{what}: RSS grew {rss_mid} -> {rss_end} KiB"));
            }
            if let Some(mid) = fp_mid {
                if fp.trie_nodes > mid.trie_nodes + 2 || fp.live_tasks > 2 {
                    failures.push(format!("{what}: footprint grew {mid:?} -> {fp:?}"));
                }
            }
            drop((anchor, anchor_shared));
        }
    }
    rt.shutdown_background();
    assert!(failures.is_empty(), "{failures:#?}");
}

// ---------------------------------------------------------------------------
// 8. unsubscribe_and_wait from inside handlers.
// ---------------------------------------------------------------------------

type Slot = Arc<Mutex<Option<Subscription>>>;

/// Two one-shot sync handlers (each unsubscribes itself and waits, as the
/// docs allow a handler to) that happen to run at the same time on two
/// threads.
#[test]
#[ignore = "known defect: a grace period waits for every runner (design notes §10, thirty-fourth session)"]
fn two_handlers_each_waiting_on_their_own_unsubscribe_at_once() {
    let mut failures = Vec::new();
    for mode in [DeliveryMode::Inline, DeliveryMode::WorkerPool] {
        let rt = runtime();
        let bus = bus_on(mode, &rt);
        let both_inside = Arc::new(std::sync::Barrier::new(2));
        let done = Arc::new(AtomicU64::new(0));
        let passed = Arc::new(AtomicU64::new(0));
        let mut slots = Vec::new();
        for topic in ["one/a", "two/b"] {
            let slot: Slot = Arc::default();
            let sub = {
                let (slot, barrier, done) = (
                    Arc::clone(&slot),
                    Arc::clone(&both_inside),
                    Arc::clone(&done),
                );
                let passed = Arc::clone(&passed);
                bus.subscribe(topic, move |_| {
                    if let Some(own) = slot.lock().unwrap().take() {
                        barrier.wait(); // both calls are running now
                        passed.fetch_add(1, Ordering::SeqCst);
                        block_on(own.unsubscribe_and_wait());
                        done.fetch_add(1, Ordering::SeqCst);
                    }
                })
                .unwrap()
            };
            *slot.lock().unwrap() = Some(sub);
            slots.push(slot);
        }
        // Two publishers, so the two calls run on two threads in every mode.
        for topic in ["one/a", "two/b"] {
            let bus = bus.clone();
            std::thread::spawn(move || {
                let _ = bus.publish(topic, 1);
            });
        }
        if !wait_until(Duration::from_secs(5), || done.load(Ordering::SeqCst) == 2) {
            failures.push(format!(
                "{mode:?}: deadlock: both handlers were running and called unsubscribe_and_wait ({} of 2), {} of 2 returned after 5 s",
                passed.load(Ordering::SeqCst),
                done.load(Ordering::SeqCst)
            ));
        }
        std::mem::forget(rt);
        std::mem::forget(bus);
    }
    assert!(failures.is_empty(), "{failures:#?}");
}

/// The same with async handlers, which the docs say may `.await` their own
/// unsubscribe, on a pool whose task cap is taken (the workers then finish
/// pending futures in place, still inside their runs).
#[test]
#[ignore = "known defect: a grace period waits for every runner (design notes §10, thirty-fourth session)"]
fn two_async_handlers_awaiting_their_own_unsubscribe_at_the_task_cap() {
    // Control: below the cap the same handlers finish.
    assert_eq!(
        two_async_self_unsubscribers(false, 2),
        (2, 2),
        "below the task cap"
    );
    // Control: one alone at the cap finishes.
    assert_eq!(
        two_async_self_unsubscribers(true, 1),
        (1, 1),
        "one alone at the task cap"
    );
    let (passed, returned) = two_async_self_unsubscribers(true, 2);
    assert_eq!(
        (passed, returned),
        (2, 2),
        "deadlock at the task cap: {passed} of 2 async handlers were running, {returned} of 2 returned after 5 s"
    );
}

fn two_async_self_unsubscribers(at_cap: bool, handlers: usize) -> (u64, u64) {
    let rt = runtime();
    let bus = bus_with(DeliveryMode::WorkerPool, &rt, |b| {
        b.max_inflight_tasks(if at_cap { 1 } else { 64 })
    });
    // Something long takes the one task slot.
    let hold = Arc::new(tokio::sync::Notify::new());
    let _holder = {
        let hold = Arc::clone(&hold);
        bus.subscribe_async("hold", move |_| {
            let hold = Arc::clone(&hold);
            async move { hold.notified().await }
        })
        .unwrap()
    };
    if at_cap {
        bus.publish("hold", 0).unwrap();
    }
    std::thread::sleep(Duration::from_millis(50));
    let both_inside = Arc::new(std::sync::Barrier::new(handlers));
    let done = Arc::new(AtomicU64::new(0));
    let passed = Arc::new(AtomicU64::new(0));
    let mut slots = Vec::new();
    for topic in ["one/a", "two/b"].into_iter().take(handlers) {
        let slot: Slot = Arc::default();
        let sub = {
            let (slot, barrier, done) = (
                Arc::clone(&slot),
                Arc::clone(&both_inside),
                Arc::clone(&done),
            );
            let passed = Arc::clone(&passed);
            bus.subscribe_async(topic, move |_| {
                let own = slot.lock().unwrap().take();
                if own.is_some() {
                    barrier.wait(); // both calls are running now
                    passed.fetch_add(1, Ordering::SeqCst);
                }
                let done = Arc::clone(&done);
                async move {
                    if let Some(own) = own {
                        own.unsubscribe_and_wait().await;
                        done.fetch_add(1, Ordering::SeqCst);
                    }
                }
            })
            .unwrap()
        };
        *slot.lock().unwrap() = Some(sub);
        slots.push(slot);
    }
    for topic in ["one/a", "two/b"].into_iter().take(handlers) {
        let bus = bus.clone();
        std::thread::spawn(move || {
            let _ = bus.publish(topic, 1);
        });
    }
    wait_until(Duration::from_secs(5), || {
        done.load(Ordering::SeqCst) == handlers as u64
    });
    let returned = done.load(Ordering::SeqCst);
    hold.notify_waiters();
    std::mem::forget(rt);
    std::mem::forget(bus);
    (passed.load(Ordering::SeqCst), returned)
}

// ---------------------------------------------------------------------------
// 9. After a plain unsubscribe returns, deliveries queued before it never
//    start.
// ---------------------------------------------------------------------------

#[test]
fn queued_deliveries_never_start_after_unsubscribe_any_kind() {
    let mut failures = Vec::new();
    for mode in MODES {
        for kind in KINDS {
            for how in ["unsubscribe", "drop"] {
                let what = format!("{mode:?}/{kind:?}/{how}");
                let rt = runtime();
                let bus = bus_with(mode, &rt, |b| b.workers(1).max_inflight_tasks(4));
                let gate = Arc::new(AtomicBool::new(false));
                // A blocker holds the worker (lane) so later publishes queue.
                let _blocker = {
                    let gate = Arc::clone(&gate);
                    bus.subscribe("t/x/#", move |m: &Message<u32>| {
                        if m.is_retained() || *m.data() != 0 {
                            return;
                        }
                        let end = Instant::now() + Duration::from_secs(3);
                        while !gate.load(Ordering::SeqCst) && Instant::now() < end {
                            std::thread::sleep(Duration::from_millis(1));
                        }
                    })
                    .unwrap()
                };
                let probe = Arc::new(Probe::default());
                let sub = subscribe_kind(&bus, kind, "t/x/#", &probe, 0);
                let before = probe.started.load(Ordering::SeqCst); // retained snapshot calls
                if mode == DeliveryMode::Inline {
                    // The blocker runs on the publisher: publish from a thread.
                    let b = bus.clone();
                    std::thread::spawn(move || {
                        let _ = b.publish("t/x/1", 0);
                    });
                } else {
                    bus.publish("t/x/1", 0).unwrap();
                }
                std::thread::sleep(Duration::from_millis(30));
                if mode != DeliveryMode::Inline {
                    for n in 1..50 {
                        let _ = bus.publish("t/x/1", n);
                    }
                }
                let started_at_unsubscribe = probe.started.load(Ordering::SeqCst);
                let inside_at_unsubscribe = probe.inside.load(Ordering::SeqCst);
                match how {
                    "unsubscribe" => sub.unsubscribe(),
                    _ => drop(sub),
                }
                let started_right_after = probe.started.load(Ordering::SeqCst);
                gate.store(true, Ordering::SeqCst);
                quiet(&bus);
                std::thread::sleep(Duration::from_millis(20));
                let started_end = probe.started.load(Ordering::SeqCst);
                // Only calls in progress when unsubscribe was called may
                // have been counted after it (none here: the probe's calls
                // are instantaneous, the blocker holds the worker).
                if started_end != started_right_after {
                    failures.push(format!(
                        "{what}: {} calls started after unsubscribe returned (started before: {} incl. {} snapshot, inside then: {})",
                        started_end - started_right_after,
                        started_at_unsubscribe,
                        before,
                        inside_at_unsubscribe
                    ));
                }
                rt.shutdown_background();
            }
        }
    }
    assert!(failures.is_empty(), "{failures:#?}");
}

// ---------------------------------------------------------------------------
// 10. unsubscribe_and_wait's future: the unsubscribe happens at the call,
//     and dropping the future (unpolled, or mid-wait) only stops waiting.
// ---------------------------------------------------------------------------

#[test]
fn unsubscribe_and_wait_future_dropped_unpolled_or_mid_wait_every_kind() {
    let mut failures = Vec::new();
    for mode in MODES {
        for kind in KINDS {
            for polled in [false, true] {
                let what = format!("{mode:?}/{kind:?}/polled once: {polled}");
                let rt = runtime();
                let bus = bus_on(mode, &rt);
                // A slow handler elsewhere keeps a runner present, so a wait
                // cannot end at its first poll.
                let gate = Arc::new(AtomicBool::new(false));
                let _slow = {
                    let gate = Arc::clone(&gate);
                    bus.subscribe("slow", move |_: &Message<u32>| {
                        let end = Instant::now() + Duration::from_secs(3);
                        while !gate.load(Ordering::SeqCst) && Instant::now() < end {
                            std::thread::sleep(Duration::from_millis(1));
                        }
                    })
                    .unwrap()
                };
                {
                    let b = bus.clone();
                    std::thread::spawn(move || {
                        let _ = b.publish("slow", 0);
                    });
                }
                std::thread::sleep(Duration::from_millis(20));
                let token = Arc::new(());
                let sub = subscribe_holding(&bus, kind, "t/x/#", &token);
                let before = bus.subscriptions_count();
                let mut wait = Box::pin(sub.unsubscribe_and_wait());
                if polled {
                    let waker = std::task::Waker::noop();
                    let mut cx = std::task::Context::from_waker(waker);
                    let first = wait.as_mut().poll(&mut cx);
                    if first.is_ready() {
                        failures.push(format!("{what}: ready although a runner is inside"));
                    }
                }
                drop(wait);
                let (count, n, matched) = (
                    bus.subscriptions_count(),
                    bus.subscribers("t/x/1"),
                    bus.publish("t/x/1", 9).unwrap(),
                );
                if count != before - 1 || n != 0 || matched != 0 {
                    failures.push(format!(
                        "{what}: after the dropped future: subscriptions {before} -> {count}, subscribers {n}, publish matched {matched}"
                    ));
                }
                gate.store(true, Ordering::SeqCst);
                quiet(&bus);
                if !wait_until(Duration::from_secs(2), || Arc::strong_count(&token) == 1) {
                    failures.push(format!("{what}: closure never released"));
                }
                // Another wait still works.
                let other = bus.subscribe("o", |_: &Message<u32>| {}).unwrap();
                let ok = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                    within(Duration::from_secs(5), &what, move || {
                        block_on(other.unsubscribe_and_wait())
                    })
                }));
                if ok.is_err() {
                    failures.push(format!("{what}: a later unsubscribe_and_wait hangs"));
                }
                rt.shutdown_background();
            }
        }
    }
    assert!(failures.is_empty(), "{failures:#?}");
}

// ---------------------------------------------------------------------------
// 11. (Side probe) An async ordered handler whose `Fn` body panics.
// ---------------------------------------------------------------------------

#[test]
fn async_ordered_fn_body_panic_is_caught_and_counted() {
    let rt = runtime();
    let bus = bus_on(DeliveryMode::WorkerPool, &rt);
    let release = Arc::new(tokio::sync::Notify::new());
    let ran = Arc::new(AtomicU64::new(0));
    let _sub = {
        let (release, ran) = (Arc::clone(&release), Arc::clone(&ran));
        bus.subscribe_ordered_async("p", move |m: Arc<Message<u32>>| {
            if *m.data() == 1 {
                panic!("the handler's body panics on 1");
            }
            let (release, ran) = (Arc::clone(&release), Arc::clone(&ran));
            async move {
                if *m.data() == 0 {
                    release.notified().await; // 1..10 queue behind this call
                }
                ran.fetch_add(1, Ordering::SeqCst);
            }
        })
        .unwrap()
    };
    for n in 0..10 {
        bus.publish("p", n).unwrap();
    }
    std::thread::sleep(Duration::from_millis(50));
    release.notify_waiters();
    quiet(&bus);
    let s = bus.stats();
    assert_eq!(
        (ran.load(Ordering::SeqCst), s.handler_panics, s.dropped),
        (9, 1, 0),
        "calls that completed, panics counted, dropped: {s:?}"
    );
}

// ---------------------------------------------------------------------------
// 12. Detached subscriptions are released with the bus.
// ---------------------------------------------------------------------------

#[test]
fn detached_closures_are_released_when_the_bus_goes() {
    let mut failures = Vec::new();
    for mode in MODES {
        for kind in KINDS {
            for closed in [false, true] {
                let what = format!("{mode:?}/{kind:?}/closed first: {closed}");
                let rt = runtime();
                let bus = bus_on(mode, &rt);
                let token = Arc::new(());
                subscribe_holding(&bus, kind, "t/x/#", &token).detach();
                for n in 0..5 {
                    bus.publish("t/x/1", n).unwrap();
                }
                quiet(&bus);
                if closed {
                    let b = bus.clone();
                    let _ = within(LIMIT, &what, move || block_on(b.close()));
                }
                drop(bus);
                if !wait_until(Duration::from_secs(2), || Arc::strong_count(&token) == 1) {
                    failures.push(format!(
                        "{what}: closure still alive after the bus was dropped"
                    ));
                }
                rt.shutdown_background();
            }
        }
    }
    assert!(failures.is_empty(), "{failures:#?}");
}

// ---------------------------------------------------------------------------
// 13. unsubscribe_and_wait of an idle subscription while an ordered handler
//     is kept busy by a steady publisher.
// ---------------------------------------------------------------------------

#[test]
fn unsubscribe_and_wait_is_not_held_up_by_a_busy_ordered_runner() {
    let mut failures = Vec::new();
    for mode in [
        DeliveryMode::Inline,
        DeliveryMode::WorkerPool,
        DeliveryMode::TaskPerSubscriber,
    ] {
        let rt = runtime();
        let bus = bus_on(mode, &rt);
        let calls = Arc::new(AtomicU64::new(0));
        let _ordered = {
            let calls = Arc::clone(&calls);
            bus.subscribe_ordered("ord", move |_| {
                spin(300); // each call takes 0.3 ms
                calls.fetch_add(1, Ordering::Relaxed);
            })
            .unwrap()
        };
        let stop = Arc::new(AtomicBool::new(false));
        // Two steady publishers, one message every 0.1 ms each: more than the
        // handler can take, as a busy topic would be (the log drops what
        // falls behind, counted).
        let publishers = feed_ordered(&bus, &stop, &Arc::default(), 0);
        std::thread::sleep(Duration::from_millis(100));
        // An unrelated subscription that was never called.
        let idle = bus.subscribe("idle", |_: &Message<u32>| {}).unwrap();
        let started = Instant::now();
        let waiter = std::thread::spawn(move || block_on(idle.unsubscribe_and_wait()));
        finished_within(&waiter, started, Duration::from_secs(3));
        let waited = started.elapsed();
        let returned_while_publishing = waiter.is_finished();
        stop.store(true, Ordering::Relaxed);
        for p in publishers {
            p.join().unwrap();
        }
        let after_stop = Instant::now();
        waiter.join().unwrap();
        if !returned_while_publishing {
            failures.push(format!(
                "{mode:?}: unsubscribe_and_wait of an idle subscription did not return in {waited:?} while the ordered handler was busy; it returned {:?} after the publishers stopped ({} ordered calls ran)",
                after_stop.elapsed(),
                calls.load(Ordering::Relaxed)
            ));
        }
        quiet(&bus);
        rt.shutdown_background();
    }
    assert!(failures.is_empty(), "{failures:#?}");
}

/// The busy ordered subscription itself: `unsubscribe_and_wait` returns while
/// the publishers go on, and no call of the handler starts or is running
/// after it has. (It returned before the renewal too: the removed
/// subscription's runner skips what is left and leaves. It guards the
/// renewal's safety: a runner renews only between calls, each checking the
/// flag after it.)
#[test]
fn unsubscribe_and_wait_of_a_busy_ordered_handler_returns_and_no_call_follows() {
    let mut failures = Vec::new();
    for mode in [
        DeliveryMode::Inline,
        DeliveryMode::WorkerPool,
        DeliveryMode::TaskPerSubscriber,
    ] {
        let rt = runtime();
        let bus = bus_on(mode, &rt);
        let waited = Arc::new(AtomicBool::new(false));
        let (calls, late) = (Arc::new(AtomicU64::new(0)), Arc::new(AtomicU64::new(0)));
        let ordered = {
            let (waited, calls, late) =
                (Arc::clone(&waited), Arc::clone(&calls), Arc::clone(&late));
            bus.subscribe_ordered("ord", move |_| {
                if waited.load(Ordering::SeqCst) {
                    late.fetch_add(1, Ordering::SeqCst);
                }
                spin(300);
                calls.fetch_add(1, Ordering::Relaxed);
                // Still running when the wait returned?
                if waited.load(Ordering::SeqCst) {
                    late.fetch_add(1, Ordering::SeqCst);
                }
            })
            .unwrap()
        };
        let stop = Arc::new(AtomicBool::new(false));
        let publishers = feed_ordered(&bus, &stop, &Arc::default(), 0);
        std::thread::sleep(Duration::from_millis(100));
        let started = Instant::now();
        let waiter = {
            let waited = Arc::clone(&waited);
            std::thread::spawn(move || {
                block_on(ordered.unsubscribe_and_wait());
                waited.store(true, Ordering::SeqCst);
            })
        };
        finished_within(&waiter, started, Duration::from_secs(3));
        let returned_while_publishing = waiter.is_finished();
        // Publishing goes on a while after the wait returned: nothing runs.
        std::thread::sleep(Duration::from_millis(50));
        stop.store(true, Ordering::Relaxed);
        for p in publishers {
            p.join().unwrap();
        }
        waiter.join().unwrap();
        if !returned_while_publishing {
            failures.push(format!(
                "{mode:?}: unsubscribe_and_wait of the busy ordered handler did not return in 3 s while publishers went on ({} calls ran)",
                calls.load(Ordering::Relaxed)
            ));
        }
        if late.load(Ordering::SeqCst) > 0 {
            failures.push(format!(
                "{mode:?}: {} call(s) started or were running after unsubscribe_and_wait returned",
                late.load(Ordering::SeqCst)
            ));
        }
        quiet(&bus);
        rt.shutdown_background();
    }
    assert!(failures.is_empty(), "{failures:#?}");
}

/// `Inline`: a handler `X` publishes to a busy ordered topic from inside its
/// call, and its publish becomes that topic's runner, catching up while two
/// publishers go on. The runner is nested in `X`'s call, so it must not
/// renew its presence: `unsubscribe_and_wait` of `X` returns only once `X`'s
/// call has, not while the runner in it catches up.
#[test]
fn a_runner_nested_in_a_handler_keeps_that_handler_waited_for() {
    let rt = runtime();
    let bus = bus_on(DeliveryMode::Inline, &rt);
    let ordered_ran = Arc::new(AtomicU64::new(0));
    // Publishes to `ord` by the feeding threads.
    let fed = Arc::new(AtomicU64::new(0));
    let _ordered = {
        let (ran, fed) = (Arc::clone(&ordered_ran), Arc::clone(&fed));
        bus.subscribe_ordered("ord", move |message| {
            ran.fetch_add(1, Ordering::SeqCst);
            if *message.data() == 0 {
                // `X`'s message: held until the feeders are at work, so
                // the runner has something to catch up on.
                wait_until(LIMIT, || fed.load(Ordering::SeqCst) >= 4);
            }
            spin(300);
        })
        .unwrap()
    };
    let in_x = Arc::new(AtomicBool::new(false));
    let x = {
        let (bus, in_x) = (bus.clone(), Arc::clone(&in_x));
        bus.clone()
            .subscribe("x", move |_| {
                in_x.store(true, Ordering::SeqCst);
                // The ordered topic is idle: this publish is its runner.
                let _ = bus.publish("ord", 0);
                in_x.store(false, Ordering::SeqCst);
            })
            .unwrap()
    };
    let x_publisher = {
        let bus = bus.clone();
        std::thread::spawn(move || bus.publish("x", 0))
    };
    assert!(
        wait_until(LIMIT, || ordered_ran.load(Ordering::SeqCst) > 0),
        "the ordered handler never ran"
    );
    // Feed the runner inside `X`'s call faster than it runs.
    let stop = Arc::new(AtomicBool::new(false));
    let publishers = feed_ordered(&bus, &stop, &fed, 1);
    std::thread::sleep(Duration::from_millis(20));
    let was_in_x = in_x.load(Ordering::SeqCst);
    let waiter = std::thread::spawn(move || {
        block_on(x.unsubscribe_and_wait());
    });
    let started = Instant::now();
    finished_within(&waiter, started, Duration::from_millis(500));
    let returned_early = waiter.is_finished() && in_x.load(Ordering::SeqCst);
    stop.store(true, Ordering::Relaxed);
    for p in publishers {
        p.join().unwrap();
    }
    waiter.join().unwrap();
    x_publisher.join().unwrap().unwrap();
    assert!(was_in_x, "X's call had returned before the wait began");
    assert!(
        !returned_early,
        "unsubscribe_and_wait of X returned while X's call was still running (its publish's runner renewed the presence X's call depends on)"
    );
    quiet(&bus);
    rt.shutdown_background();
}

/// Waits until `thread` has finished or `limit` has passed since `started`.
fn finished_within<R>(thread: &std::thread::JoinHandle<R>, started: Instant, limit: Duration) {
    while !thread.is_finished() && started.elapsed() < limit {
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// Two threads publishing to `ord` until `stop`, one message every 0.1 ms
/// each (faster than a handler of 0.3 ms a call can take them), numbered
/// from `first`, each publish counted in `fed`.
fn feed_ordered(
    bus: &Bus<u32>,
    stop: &Arc<AtomicBool>,
    fed: &Arc<AtomicU64>,
    first: u32,
) -> Vec<std::thread::JoinHandle<()>> {
    (0..2)
        .map(|_| {
            let (bus, stop, fed) = (bus.clone(), Arc::clone(stop), Arc::clone(fed));
            std::thread::spawn(move || {
                let mut n = first;
                while !stop.load(Ordering::Relaxed) {
                    let _ = bus.publish("ord", n);
                    fed.fetch_add(1, Ordering::SeqCst);
                    n += 1;
                    spin(100);
                }
            })
        })
        .collect()
}

/// Two publisher threads, on `s/a` and `s/b`, each publishing `0..n` (again
/// after `Full`, until accepted); each returns the sum of what its
/// publishes matched.
fn publish_on_two_topics(bus: &Bus<u32>, n: u32) -> Vec<std::thread::JoinHandle<u64>> {
    ["s/a", "s/b"]
        .into_iter()
        .map(|topic| {
            let bus = bus.clone();
            std::thread::spawn(move || {
                let mut matched = 0u64;
                let mut i = 0;
                while i < n {
                    match bus.publish(topic, i) {
                        Ok(m) => {
                            matched += m as u64;
                            i += 1;
                        }
                        Err(blazesub::Error::Full { .. }) => std::thread::yield_now(),
                        Err(e) => panic!("{e}"),
                    }
                }
                matched
            })
        })
        .collect()
}

/// A stream on `s/...` per overflow policy (small mailboxes, to overflow).
fn one_stream_per_policy(bus: &Bus<u32>) -> Vec<Receiver<u32>> {
    [
        ("s/+", 4, StreamOverflow::DropOldest),
        ("s/+", 4, StreamOverflow::DropNewest),
        ("s/#", 4, StreamOverflow::Disconnect),
        ("s/+", 64, StreamOverflow::Backpressure),
    ]
    .into_iter()
    .map(|(filter, capacity, policy)| {
        bus.subscribe_stream_with(filter, options(capacity, policy))
            .unwrap()
    })
    .collect()
}

/// Subscribes `kind` on `filter` (`shared`: the same filter in a group)
/// with the handler of its shape.
fn subscribe_as<S, A, Fut>(
    bus: &Bus<u32>,
    kind: Kind,
    filter: &str,
    shared: &str,
    sync_handler: S,
    async_handler: A,
) -> Subscription
where
    S: Fn(&Message<u32>) + Send + Sync + 'static,
    A: Fn(Arc<Message<u32>>) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = ()> + Send + 'static,
{
    match kind {
        Kind::Sync => bus.subscribe(filter, sync_handler).unwrap(),
        Kind::Async => bus.subscribe_async(filter, async_handler).unwrap(),
        Kind::OrderedSync => bus.subscribe_ordered(filter, sync_handler).unwrap(),
        Kind::OrderedAsync => bus.subscribe_ordered_async(filter, async_handler).unwrap(),
        Kind::SharedSync => bus.subscribe(shared, sync_handler).unwrap(),
        Kind::SharedAsync => bus.subscribe_async(shared, async_handler).unwrap(),
        Kind::PrimedSync | Kind::PrimedOrdered | Kind::PrimedAsync => {
            // A retained message on a sibling topic the filter matches.
            let base = filter.trim_end_matches("/#").trim_end_matches("/+");
            bus.publish_retained(&format!("{base}/retained"), 7)
                .unwrap();
            match kind {
                Kind::PrimedSync => bus.subscribe(filter, sync_handler).unwrap(),
                Kind::PrimedOrdered => bus.subscribe_ordered(filter, sync_handler).unwrap(),
                _ => bus.subscribe_async(filter, async_handler).unwrap(),
            }
        }
    }
}
