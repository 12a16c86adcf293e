//! Retained messages at their edges, as the thirty-fourth session's review
//! found them: expiry, eviction and clear racing snapshots of every
//! subscription kind, `close` during a snapshot, payloads whose `Drop` uses
//! the store, bad input. Five failed before their fixes: the two
//! `a_huge_retained_expiry_*` (a retained publish panicked),
//! `close_waits_for_a_handlers_snapshot_and_its_backlog` and
//! `close_runs_a_live_message_accepted_during_an_async_snapshot` (`close`
//! did not wait for a handler's snapshot and the live messages held back
//! behind it), `the_retained_count_does_not_include_expired_messages`.
//! Every step that could hang runs under a time limit.

mod common;

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use blazesub::{Bus, DeliveryMode, Error, Message, StreamOptions, StreamOverflow};
use common::{runtime, wait_until, within, MODES};

const LIMIT: Duration = Duration::from_secs(20);

/// Live heap bytes of this test binary (for the memory-bound test).
struct Counting;

static LIVE: std::sync::atomic::AtomicIsize = std::sync::atomic::AtomicIsize::new(0);

unsafe impl std::alloc::GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: std::alloc::Layout) -> *mut u8 {
        LIVE.fetch_add(layout.size() as isize, Ordering::Relaxed);
        unsafe { std::alloc::System.alloc(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: std::alloc::Layout) {
        LIVE.fetch_sub(layout.size() as isize, Ordering::Relaxed);
        unsafe { std::alloc::System.dealloc(ptr, layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: std::alloc::Layout, new: usize) -> *mut u8 {
        LIVE.fetch_add(new as isize - layout.size() as isize, Ordering::Relaxed);
        unsafe { std::alloc::System.realloc(ptr, layout, new) }
    }
}

#[global_allocator]
static ALLOCATOR: Counting = Counting;

fn bus_on(mode: DeliveryMode, rt: &tokio::runtime::Runtime) -> Bus<u64> {
    Bus::<u64>::builder()
        .delivery(mode)
        .workers(2)
        .runtime(rt.handle().clone())
        .build()
        .unwrap()
}

// ---------------------------------------------------------------------------
// Bad input: a huge expiry.
// ---------------------------------------------------------------------------

/// `Config::retained_expiry` accepts any non-zero duration (validate only
/// refuses zero), so `Duration::MAX` ("never, really") builds a bus. A
/// retained publish on it must not panic.
#[test]
fn a_huge_retained_expiry_does_not_panic_a_retained_publish() {
    for expiry in [Duration::MAX, Duration::from_secs(u64::MAX / 2)] {
        let bus = Bus::<u64>::builder()
            .delivery(DeliveryMode::Inline)
            .retained_expiry(expiry)
            .build()
            .expect("validate accepts it");
        let published = within(LIMIT, "publish_retained", {
            let bus = bus.clone();
            move || {
                std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                    bus.publish_retained("a", 1)
                }))
            }
        });
        assert!(
            matches!(published, Ok(Ok(0))),
            "{expiry:?}: publish_retained panicked (or failed): {:?}",
            published
                .as_ref()
                .map(|r| r.as_ref().map_err(|e| e.to_string()))
                .map_err(|_| "panic")
        );
        assert_eq!(bus.retained("a").len(), 1, "{expiry:?}");
    }
}

/// The same through a configuration file: `"retained_expiry":
/// "10000000000000000000s"` parses, validates and builds a bus whose first
/// retained publish must not panic.
#[test]
fn a_huge_retained_expiry_from_a_config_file_does_not_panic_a_retained_publish() {
    let config: blazesub::Config = serde_json::from_str(
        r#"{"delivery": "inline", "retained_expiry": "10000000000000000000s"}"#,
    )
    .expect("parses");
    config.validate().expect("validates");
    let bus = Bus::<u64>::new(config).expect("builds");
    let published = within(LIMIT, "publish_retained", move || {
        std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            bus.publish_retained("a", 1)
        }))
        .map_err(|_| ())
    });
    assert!(matches!(published, Ok(Ok(0))), "publish_retained panicked");
}

// ---------------------------------------------------------------------------
// close() during a handler's retained snapshot.
// ---------------------------------------------------------------------------

/// A plain handler's snapshot is delivered on the subscribing thread before
/// `subscribe` returns; a live publish meanwhile waits in its backlog and is
/// counted as delivered by its runner. `close()` "waits for every accepted
/// delivery to finish": it must not return before the handler has been
/// called with the live message the publish accepted (and before the
/// snapshot's call is over).
fn close_during_a_handler_snapshot(mode: DeliveryMode, kind: &str) -> Result<(), String> {
    let rt = runtime(2);
    let bus = Bus::<u64>::builder()
        .delivery(mode)
        .workers(2)
        .runtime(rt.handle().clone())
        .close_timeout(Duration::from_secs(5))
        .build()
        .unwrap();
    bus.publish_retained("t", 1).unwrap();
    let (entered_tx, entered) = std::sync::mpsc::channel::<()>();
    let entered_tx = Mutex::new(Some(entered_tx));
    let gate = Arc::new(AtomicBool::new(false));
    let calls: Arc<Mutex<Vec<(u64, Instant)>>> = Arc::default();
    let handler = {
        let (gate, calls) = (Arc::clone(&gate), Arc::clone(&calls));
        move |m: &Message<u64>| {
            if m.is_retained() {
                if let Some(tx) = entered_tx.lock().unwrap().take() {
                    let _ = tx.send(());
                }
                let deadline = Instant::now() + LIMIT;
                while !gate.load(Ordering::SeqCst) && Instant::now() < deadline {
                    std::thread::sleep(Duration::from_millis(1));
                }
            }
            calls.lock().unwrap().push((*m.data(), Instant::now()));
        }
    };
    let subscriber = {
        let bus = bus.clone();
        let kind = kind.to_owned();
        std::thread::spawn(move || match kind.as_str() {
            "plain" => bus.subscribe("t", handler).map(|s| s.detach()),
            "ordered" => bus.subscribe_ordered("t", handler).map(|s| s.detach()),
            "ordered_async" => bus
                .subscribe_ordered_async("t", move |m: Arc<Message<u64>>| {
                    handler(&m);
                    async {}
                })
                .map(|s| s.detach()),
            _ => bus
                .subscribe_async("t", move |m: Arc<Message<u64>>| {
                    handler(&m);
                    async {}
                })
                .map(|s| s.detach()),
        })
    };
    entered
        .recv_timeout(LIMIT)
        .map_err(|_| "snapshot call never started".to_string())?;
    // A live publish accepted while the snapshot call runs.
    let matched = bus.publish("t", 2).unwrap();
    assert_eq!(matched, 1);
    let closed_at: Arc<Mutex<Option<Instant>>> = Arc::default();
    let closer = {
        let bus = bus.clone();
        let closed_at = Arc::clone(&closed_at);
        let handle = rt.handle().clone();
        std::thread::spawn(move || {
            let result = handle.block_on(bus.close());
            *closed_at.lock().unwrap() = Some(Instant::now());
            result
        })
    };
    std::thread::sleep(Duration::from_millis(300));
    let closed_while_running = closed_at.lock().unwrap().is_some();
    gate.store(true, Ordering::SeqCst);
    subscriber.join().unwrap().unwrap();
    let close_result = closer.join().unwrap();
    assert!(wait_until(LIMIT, || calls.lock().unwrap().len() == 2));
    let closed_at = closed_at.lock().unwrap().unwrap();
    let calls = calls.lock().unwrap().clone();
    let after_close: Vec<u64> = calls
        .iter()
        .filter(|(_, at)| *at > closed_at)
        .map(|(n, _)| *n)
        .collect();
    if closed_while_running || !after_close.is_empty() {
        return Err(format!(
            "{mode:?} {kind}: close returned {:?} while the snapshot call was running: {closed_while_running}; \
             handler calls finished after close returned: {after_close:?} (calls {:?})",
            close_result,
            calls.iter().map(|c| c.0).collect::<Vec<_>>()
        ));
    }
    Ok(())
}

#[test]
fn close_waits_for_a_handlers_snapshot_and_its_backlog() {
    let mut failures = Vec::new();
    for mode in MODES {
        for kind in ["plain", "async", "ordered", "ordered_async"] {
            if let Err(e) = within(LIMIT * 2, "close during snapshot", move || {
                close_during_a_handler_snapshot(mode, kind)
            }) {
                failures.push(e);
            }
        }
    }
    assert!(failures.is_empty(), "{failures:#?}");
}

// ---------------------------------------------------------------------------
// No user Drop runs under the store's lock.
// ---------------------------------------------------------------------------

/// A payload whose `Drop` reads the bus's retained store (which takes the
/// store's lock): if it runs under that lock, it deadlocks.
struct Reentrant {
    bus: Option<Bus<Reentrant>>,
    dropped: Arc<AtomicUsize>,
}

impl Drop for Reentrant {
    fn drop(&mut self) {
        if let Some(bus) = self.bus.take() {
            let _ = bus.retained("#");
            let _ = bus.clear_retained("never/there");
            // With an expiry these take the store's lock too.
            let _ = bus.stats();
            let _ = bus.retained_count();
            self.dropped.fetch_add(1, Ordering::SeqCst);
        }
    }
}

fn reentrant_bus(
    rt: &tokio::runtime::Runtime,
    max: usize,
    expiry: Option<Duration>,
) -> Bus<Reentrant> {
    let mut builder = Bus::<Reentrant>::builder()
        .delivery(DeliveryMode::WorkerPool)
        .workers(2)
        .runtime(rt.handle().clone())
        .max_retained(max);
    if let Some(expiry) = expiry {
        builder = builder.retained_expiry(expiry);
    }
    builder.build().unwrap()
}

fn armed(bus: &Bus<Reentrant>, dropped: &Arc<AtomicUsize>) -> Reentrant {
    Reentrant {
        bus: Some(bus.clone()),
        dropped: Arc::clone(dropped),
    }
}

fn plain(dropped: &Arc<AtomicUsize>) -> Reentrant {
    Reentrant {
        bus: None,
        dropped: Arc::clone(dropped),
    }
}

/// Replaced, evicted, cleared and expired retained values are dropped after
/// the store's lock is released, whichever operation lets go of them
/// (every subscription kind that takes a snapshot included).
#[test]
fn a_payload_whose_drop_reads_the_store_never_deadlocks() {
    type Op = (&'static str, fn(&Bus<Reentrant>, &Arc<AtomicUsize>));
    let ops: Vec<Op> = vec![
        ("replace", |bus, d| {
            bus.publish_retained("a", plain(d)).unwrap();
        }),
        ("evict", |bus, d| {
            bus.publish_retained("b", plain(d)).unwrap();
        }),
        ("clear", |bus, _| {
            assert!(bus.clear_retained("a"));
        }),
    ];
    for (name, op) in ops {
        let rt = runtime(2);
        let bus = reentrant_bus(&rt, 1, None);
        let dropped = Arc::new(AtomicUsize::new(0));
        bus.publish_retained("a", armed(&bus, &dropped)).unwrap();
        let b = bus.clone();
        let d = Arc::clone(&dropped);
        within(Duration::from_secs(5), name, move || op(&b, &d));
        assert!(
            wait_until(LIMIT, || dropped.load(Ordering::SeqCst) == 1),
            "{name}: the armed value was not dropped"
        );
    }
    // Expiry, removed by each kind of retained operation.
    type Expire = (&'static str, fn(&Bus<Reentrant>, &Arc<AtomicUsize>));
    let expiring: Vec<Expire> = vec![
        ("retained()", |bus, _| {
            assert!(bus.retained("#").is_empty());
        }),
        ("publish_retained", |bus, d| {
            bus.publish_retained("b", plain(d)).unwrap();
        }),
        ("clear_retained", |bus, _| {
            assert!(!bus.clear_retained("a"));
        }),
        ("subscribe", |bus, _| {
            bus.subscribe("#", |_| {}).unwrap().detach();
        }),
        ("subscribe_async", |bus, _| {
            bus.subscribe_async("#", |_| async {}).unwrap().detach();
        }),
        ("subscribe_ordered", |bus, _| {
            bus.subscribe_ordered("#", |_| {}).unwrap().detach();
        }),
        ("subscribe_ordered_async", |bus, _| {
            bus.subscribe_ordered_async("#", |_| async {})
                .unwrap()
                .detach();
        }),
        ("subscribe_stream", |bus, _| {
            std::mem::forget(bus.subscribe_stream("#").unwrap());
        }),
        ("subscribe_stream_with Backpressure", |bus, _| {
            std::mem::forget(
                bus.subscribe_stream_with(
                    "#",
                    StreamOptions::new(4).overflow(StreamOverflow::Backpressure),
                )
                .unwrap(),
            );
        }),
    ];
    for (name, op) in expiring {
        let rt = runtime(2);
        let bus = reentrant_bus(&rt, 10, Some(Duration::from_millis(20)));
        let dropped = Arc::new(AtomicUsize::new(0));
        bus.publish_retained("a", armed(&bus, &dropped)).unwrap();
        std::thread::sleep(Duration::from_millis(40));
        let b = bus.clone();
        let d = Arc::clone(&dropped);
        within(Duration::from_secs(5), name, move || op(&b, &d));
        assert_eq!(bus.stats().retained_expired, 1, "{name}");
        assert!(
            wait_until(LIMIT, || dropped.load(Ordering::SeqCst) == 1),
            "{name}: the armed value was not dropped"
        );
    }
}

// ---------------------------------------------------------------------------
// Per topic no gap and no duplicate, for the kinds the existing race test
// leaves out, with clears, evictions and expiries racing too.
// ---------------------------------------------------------------------------

type Log = Arc<Mutex<Vec<(String, u64, bool)>>>;

fn record(log: &Log, m: &Message<u64>) {
    log.lock()
        .unwrap()
        .push((m.topic().to_owned(), *m.data(), m.is_retained()));
}

/// Checks one subscription's log: per topic, the values form one run
/// `first..=last` with no gap and no duplicate, only the first retained;
/// `in_order` also asks for them in order.
fn check_log(what: &str, log: &[(String, u64, bool)], last: u64, in_order: bool) -> Vec<String> {
    let mut errors = Vec::new();
    let mut per_topic: std::collections::BTreeMap<&str, Vec<(u64, bool)>> = Default::default();
    for (topic, n, retained) in log {
        per_topic.entry(topic).or_default().push((*n, *retained));
    }
    for (topic, seen) in &per_topic {
        let retained: Vec<_> = seen.iter().filter(|s| s.1).collect();
        if retained.len() > 1 {
            errors.push(format!("{what} {topic}: {} retained", retained.len()));
        }
        if in_order {
            if let Some(r) = retained.first() {
                if seen[0] != **r {
                    errors.push(format!(
                        "{what} {topic}: retained {r:?} not first ({:?})",
                        seen[0]
                    ));
                }
            }
        }
        let mut values: Vec<u64> = seen.iter().map(|s| s.0).collect();
        if !in_order {
            values.sort_unstable();
        }
        let lowest = values[0];
        if let Some(r) = retained.first() {
            if r.0 != values.iter().copied().min().unwrap() {
                errors.push(format!(
                    "{what} {topic}: retained {} older than live {}",
                    r.0, lowest
                ));
            }
        }
        if values != (lowest..=last).collect::<Vec<_>>() {
            let bad = values
                .windows(2)
                .position(|w| w[1] != w[0] + 1)
                .map(|k| values[k.saturating_sub(2)..(k + 3).min(values.len())].to_vec());
            errors.push(format!(
                "{what} {topic}: not one run {lowest}..={last}: {} values, first bad window {bad:?}, last {:?}",
                values.len(),
                values.last()
            ));
        }
    }
    errors
}

fn race_kinds(
    mode: DeliveryMode,
    max: usize,
    expiry: Option<Duration>,
    clear: bool,
) -> Vec<String> {
    const PUBLISHERS: u64 = 2;
    const TOPICS_EACH: u64 = 3;
    const COUNT: u64 = 1_000;
    const JOINERS: usize = 10;
    let rt = runtime(2);
    let mut builder = Bus::<u64>::builder()
        .delivery(mode)
        .workers(2)
        .stream_capacity(1 << 14)
        .max_retained(max)
        .runtime(rt.handle().clone());
    if let Some(expiry) = expiry {
        builder = builder.retained_expiry(expiry);
    }
    let bus = builder.build().unwrap();
    let done = Arc::new(AtomicBool::new(false));
    let publishers: Vec<_> = (0..PUBLISHERS)
        .map(|p| {
            let bus = bus.clone();
            std::thread::spawn(move || {
                for n in 1..=COUNT {
                    for t in 0..TOPICS_EACH {
                        let topic = format!("race/{p}/{t}");
                        loop {
                            match bus.publish_retained(&topic, n) {
                                Ok(_) => break,
                                Err(Error::Full { .. }) => std::thread::yield_now(),
                                Err(e) => panic!("{e}"),
                            }
                        }
                    }
                    if n % 50 == 0 {
                        std::thread::sleep(Duration::from_micros(200));
                    }
                }
            })
        })
        .collect();
    let clearer = clear.then(|| {
        let (bus, done) = (bus.clone(), Arc::clone(&done));
        std::thread::spawn(move || {
            let mut i = 0u64;
            while !done.load(Ordering::Relaxed) {
                bus.clear_retained(&format!(
                    "race/{}/{}",
                    i % PUBLISHERS,
                    (i / 2) % TOPICS_EACH
                ));
                i += 1;
                std::thread::sleep(Duration::from_micros(50));
            }
        })
    });
    let mut logs: Vec<(String, Log, bool)> = Vec::new();
    let mut subs = Vec::new();
    let mut readers = Vec::new();
    for j in 0..JOINERS {
        std::thread::sleep(Duration::from_micros(400 * j as u64 % 2_000));
        let log: Log = Arc::default();
        let writer = Arc::clone(&log);
        match j % 5 {
            0 => {
                let busy = Arc::new(AtomicBool::new(false));
                subs.push(
                    bus.subscribe_ordered_async("race/#", move |m: Arc<Message<u64>>| {
                        let (writer, busy) = (Arc::clone(&writer), Arc::clone(&busy));
                        async move {
                            assert!(!busy.swap(true, Ordering::SeqCst), "calls overlap");
                            record(&writer, &m);
                            tokio::task::yield_now().await;
                            busy.store(false, Ordering::SeqCst);
                        }
                    })
                    .unwrap(),
                );
                logs.push((format!("ordered_async {j}"), log, true));
            }
            1 => {
                subs.push(
                    bus.subscribe_async("race/+/+", move |m: Arc<Message<u64>>| {
                        record(&writer, &m);
                        async {}
                    })
                    .unwrap(),
                );
                logs.push((format!("async {j}"), log, false));
            }
            2 | 3 => {
                let policy = if j % 5 == 2 {
                    StreamOverflow::Backpressure
                } else {
                    StreamOverflow::DropNewest
                };
                let capacity = if policy == StreamOverflow::Backpressure {
                    8
                } else {
                    1 << 14
                };
                let mut rx = bus
                    .subscribe_stream_with("race/#", StreamOptions::new(capacity).overflow(policy))
                    .unwrap();
                let done = Arc::clone(&done);
                readers.push(std::thread::spawn(move || {
                    let lost;
                    loop {
                        match rx.try_recv() {
                            Ok(m) => record(&writer, &m),
                            Err(_) if done.load(Ordering::SeqCst) => {
                                while let Ok(m) = rx.try_recv() {
                                    record(&writer, &m);
                                }
                                lost = rx.lost();
                                break;
                            }
                            Err(_) => std::thread::yield_now(),
                        }
                    }
                    lost
                }));
                logs.push((format!("{policy:?} stream {j}"), log, true));
            }
            _ => {
                subs.push(
                    bus.subscribe_ordered("race/#", move |m: &Message<u64>| record(&writer, m))
                        .unwrap(),
                );
                logs.push((format!("ordered {j}"), log, true));
            }
        }
    }
    for p in publishers {
        p.join().unwrap();
    }
    assert!(wait_until(LIMIT, || bus.inflight_messages() == 0));
    std::thread::sleep(Duration::from_millis(50));
    done.store(true, Ordering::SeqCst);
    if let Some(c) = clearer {
        c.join().unwrap();
    }
    let mut errors = Vec::new();
    for r in readers {
        let lost = r.join().unwrap();
        if lost != 0 {
            errors.push(format!("a stream lost {lost}"));
        }
    }
    assert!(wait_until(LIMIT, || bus.inflight_messages() == 0));
    for (what, log, in_order) in &logs {
        let log = log.lock().unwrap();
        errors.extend(check_log(
            &format!("{mode:?} {what}"),
            &log,
            COUNT,
            *in_order,
        ));
    }
    let stats = bus.stats();
    if stats.handler_panics != 0 || stats.dropped != 0 {
        errors.push(format!(
            "{mode:?}: panics {} dropped {}",
            stats.handler_panics, stats.dropped
        ));
    }
    errors
}

#[test]
fn every_snapshot_kind_races_publishes_clears_evictions_and_expiries_without_gap_or_duplicate() {
    let mut errors = Vec::new();
    for mode in MODES {
        for (max, expiry, clear) in [
            (100, None, false),
            (100, None, true),
            (3, None, false),
            (100, Some(Duration::from_millis(1)), false),
        ] {
            errors.extend(
                within(Duration::from_secs(60), "race", move || {
                    race_kinds(mode, max, expiry, clear)
                })
                .into_iter()
                .map(|e| format!("max {max} expiry {expiry:?} clear {clear}: {e}")),
            );
        }
    }
    assert!(
        errors.is_empty(),
        "{} errors: {:#?}",
        errors.len(),
        &errors[..errors.len().min(20)]
    );
}

// ---------------------------------------------------------------------------
// Counts: every retained message leaves the store once, counted once.
// ---------------------------------------------------------------------------

/// Unique topics (so nothing is replaced), racing publishers, clearers,
/// readers and subscribers, a small store and a short expiry: every message
/// retained is, at the end, either still retained, cleared (clear returned
/// true), evicted or expired, exactly once; and every value is dropped once
/// the bus's references are gone.
#[test]
fn every_retained_message_leaves_the_store_once_and_is_counted_once() {
    struct Counted(Arc<AtomicU64>);
    impl Drop for Counted {
        fn drop(&mut self) {
            self.0.fetch_add(1, Ordering::SeqCst);
        }
    }
    for (max, expiry) in [
        (16, Some(Duration::from_micros(300))),
        (16, None),
        (100_000, Some(Duration::from_micros(200))),
    ] {
        let rt = runtime(2);
        let bus = Bus::<Counted>::builder()
            .delivery(DeliveryMode::WorkerPool)
            .workers(2)
            .max_retained(max)
            .retained_expiry(expiry.unwrap_or(Duration::from_secs(3600)))
            .runtime(rt.handle().clone())
            .build()
            .unwrap();
        let drops = Arc::new(AtomicU64::new(0));
        let published = Arc::new(AtomicU64::new(0));
        let cleared = Arc::new(AtomicU64::new(0));
        let done = Arc::new(AtomicBool::new(false));
        within(Duration::from_secs(30), "counts", {
            let bus = bus.clone();
            let drops = Arc::clone(&drops);
            let (published, cleared, done) = (
                Arc::clone(&published),
                Arc::clone(&cleared),
                Arc::clone(&done),
            );
            move || {
                let publishers: Vec<_> = (0..2u64)
                    .map(|p| {
                        let (bus, drops, published) =
                            (bus.clone(), Arc::clone(&drops), Arc::clone(&published));
                        std::thread::spawn(move || {
                            for n in 0..3_000u64 {
                                bus.publish_retained(
                                    &format!("c/{p}/{}/{}", n % 7, n),
                                    Counted(Arc::clone(&drops)),
                                )
                                .unwrap();
                                published.fetch_add(1, Ordering::SeqCst);
                            }
                        })
                    })
                    .collect();
                let others: Vec<_> = (0..2u64)
                    .map(|k| {
                        let (bus, cleared, done) =
                            (bus.clone(), Arc::clone(&cleared), Arc::clone(&done));
                        std::thread::spawn(move || {
                            let mut n = 0u64;
                            while !done.load(Ordering::SeqCst) {
                                if k == 0 {
                                    for p in 0..2 {
                                        let back = n.saturating_sub(3);
                                        if bus.clear_retained(&format!("c/{p}/{}/{back}", back % 7))
                                        {
                                            cleared.fetch_add(1, Ordering::SeqCst);
                                        }
                                    }
                                } else {
                                    let _ = bus.retained("c/+/3/#");
                                    drop(bus.subscribe_stream("c/#").unwrap());
                                    drop(bus.subscribe("c/0/#", |_| {}).unwrap());
                                }
                                n += 1;
                            }
                        })
                    })
                    .collect();
                for p in publishers {
                    p.join().unwrap();
                }
                done.store(true, Ordering::SeqCst);
                for o in others {
                    o.join().unwrap();
                }
            }
        });
        assert!(wait_until(LIMIT, || bus.inflight_messages() == 0));
        let _ = bus.retained("#"); // lets what expired go
        let stats = bus.stats();
        let (published, cleared) = (
            published.load(Ordering::SeqCst),
            cleared.load(Ordering::SeqCst),
        );
        assert_eq!(
            published,
            stats.retained + stats.retained_evicted + stats.retained_expired + cleared,
            "max {max} expiry {expiry:?}: published {published}, now {}, evicted {}, expired {}, cleared {cleared}",
            stats.retained,
            stats.retained_evicted,
            stats.retained_expired
        );
        if expiry.is_none() {
            // (With a short expiry, more may expire between the two reads.)
            assert_eq!(stats.retained as usize, bus.retained("#").len());
        }
        assert!(stats.retained <= max as u64);
        let left = stats.retained;
        assert!(
            wait_until(LIMIT, || drops.load(Ordering::SeqCst) == published - left),
            "max {max}: {} dropped, expected {}",
            drops.load(Ordering::SeqCst),
            published - left
        );
    }
}

/// An async handler whose snapshot call is slow to hand back its future
/// (the closure's synchronous part, before the future, runs on the
/// subscribing thread); a live publish accepted meanwhile waits in the
/// subscription's backlog. `close()` "waits for every accepted delivery to
/// finish": the accepted live message (and the snapshot's) must be run,
/// not dropped because the bus began closing.
fn close_during_an_async_snapshot(mode: DeliveryMode) -> Result<(), String> {
    let rt = runtime(2);
    let bus = Bus::<u64>::builder()
        .delivery(mode)
        .workers(2)
        .runtime(rt.handle().clone())
        .close_timeout(Duration::from_secs(5))
        .build()
        .unwrap();
    bus.publish_retained("t", 1).unwrap();
    let (entered_tx, entered) = std::sync::mpsc::channel::<()>();
    let entered_tx = Mutex::new(Some(entered_tx));
    let gate = Arc::new(AtomicBool::new(false));
    let polled: Arc<Mutex<Vec<u64>>> = Arc::default();
    let subscriber = {
        let (bus, gate, polled) = (bus.clone(), Arc::clone(&gate), Arc::clone(&polled));
        std::thread::spawn(move || {
            bus.subscribe_async("t", move |m: Arc<Message<u64>>| {
                if m.is_retained() {
                    if let Some(tx) = entered_tx.lock().unwrap().take() {
                        let _ = tx.send(());
                    }
                    let deadline = Instant::now() + LIMIT;
                    while !gate.load(Ordering::SeqCst) && Instant::now() < deadline {
                        std::thread::sleep(Duration::from_millis(1));
                    }
                }
                let polled = Arc::clone(&polled);
                async move {
                    polled.lock().unwrap().push(*m.data());
                }
            })
            .map(|s| s.detach())
        })
    };
    entered
        .recv_timeout(LIMIT)
        .map_err(|_| "snapshot never started".to_string())?;
    assert_eq!(bus.publish("t", 2).unwrap(), 1, "accepted, matched once");
    let closing = {
        let bus = bus.clone();
        rt.spawn(async move { bus.close().await })
    };
    std::thread::sleep(Duration::from_millis(100));
    gate.store(true, Ordering::SeqCst);
    subscriber.join().unwrap().unwrap();
    let closed = rt
        .block_on(async { tokio::time::timeout(LIMIT, closing).await })
        .map_err(|_| "close hung".to_string())?
        .unwrap();
    let mut polled = polled.lock().unwrap().clone();
    polled.sort_unstable();
    let stats = bus.stats();
    if polled != [1, 2] {
        return Err(format!(
            "{mode:?}: close {closed:?}; futures run for {polled:?}; stats delivered {} dropped {} inflight {}",
            stats.delivered, stats.dropped, stats.inflight
        ));
    }
    Ok(())
}

#[test]
fn close_runs_a_live_message_accepted_during_an_async_snapshot() {
    let mut failures = Vec::new();
    for mode in MODES {
        if let Err(e) = within(LIMIT * 2, "close during async snapshot", move || {
            close_during_an_async_snapshot(mode)
        }) {
            failures.push(e);
        }
    }
    assert!(failures.is_empty(), "{failures:#?}");
}

// ---------------------------------------------------------------------------
// Unsubscribing right after a snapshot was queued.
// ---------------------------------------------------------------------------

/// An async ordered handler and streams of each policy, unsubscribed (or
/// dropped) right after subscribing with a 50-message snapshot: nothing
/// stays in flight; a stream's snapshot messages are either read or
/// counted dropped, once; the handler's calls are what `delivered` says.
#[test]
fn unsubscribing_right_after_a_snapshot_settles_every_message_once() {
    for mode in MODES {
        // Async ordered.
        let rt = runtime(2);
        let bus = bus_on(mode, &rt);
        for n in 0..50 {
            bus.publish_retained(&format!("u/{n}"), n).unwrap();
        }
        let calls = Arc::new(AtomicU64::new(0));
        let sub = {
            let calls = Arc::clone(&calls);
            bus.subscribe_ordered_async("u/#", move |_m: Arc<Message<u64>>| {
                let calls = Arc::clone(&calls);
                async move {
                    tokio::time::sleep(Duration::from_micros(200)).await;
                    calls.fetch_add(1, Ordering::SeqCst);
                }
            })
            .unwrap()
        };
        sub.unsubscribe();
        assert!(
            wait_until(LIMIT, || bus.inflight_messages() == 0),
            "{mode:?}: {} in flight",
            bus.inflight_messages()
        );
        std::thread::sleep(Duration::from_millis(20));
        let stats = bus.stats();
        let calls = calls.load(Ordering::SeqCst);
        assert_eq!(
            stats.delivered, calls,
            "{mode:?} ordered_async: delivered vs calls"
        );
        // Queued deliveries an unsubscribe cancels are counted nowhere, by
        // design (docs/reliability.md, "an unsubscribe cancels deliveries
        // still queued"): only check nothing is counted twice.
        assert!(stats.delivered + stats.dropped <= 50, "{mode:?}: {stats:?}");
        // Streams.
        for policy in [
            StreamOverflow::DropOldest,
            StreamOverflow::DropNewest,
            StreamOverflow::Backpressure,
            StreamOverflow::Disconnect,
        ] {
            let before = bus.stats();
            let mut rx = bus
                .subscribe_stream_with("u/#", StreamOptions::new(64).overflow(policy))
                .unwrap();
            for _ in 0..10 {
                rx.try_recv().unwrap();
            }
            drop(rx);
            let after = bus.stats();
            assert_eq!(
                (
                    after.delivered - before.delivered,
                    after.dropped - before.dropped
                ),
                (10, 40),
                "{mode:?} {policy:?}"
            );
            // Room a lossless stream held is gone with it.
            bus.publish_retained("u/0", 0).unwrap();
        }
    }
}

// ---------------------------------------------------------------------------
// Counts of what is retained "now" after an expiry.
// ---------------------------------------------------------------------------

/// `Bus::retained_count` ("how many topics have a retained message now")
/// and `Stats::retained` ("topics retained now") after every retained
/// message expired: no subscription can be handed one any more
/// (`bus.retained("#")` would return nothing), so the count is 0. (The
/// store lets go of expired messages only at its next retained operation,
/// as `Config::retained_expiry` says; the counts should not report them.)
#[test]
fn the_retained_count_does_not_include_expired_messages() {
    let bus = Bus::<u64>::builder()
        .delivery(DeliveryMode::Inline)
        .retained_expiry(Duration::from_millis(20))
        .build()
        .unwrap();
    for n in 0..3 {
        bus.publish_retained(&format!("e/{n}"), n).unwrap();
    }
    assert_eq!(bus.retained_count(), 3);
    std::thread::sleep(Duration::from_millis(60));
    // Plain publishes and stats reads are not retained operations.
    bus.publish("e/0", 9).unwrap();
    let (count, stats) = (bus.retained_count(), bus.stats());
    let handed_out = bus.retained("#").len();
    assert_eq!(
        (count, stats.retained, stats.retained_expired),
        (handed_out, handed_out as u64, 3 - handed_out as u64),
        "retained_count {count}, Stats::retained {}, retained_expired {} while retained(\"#\") hands out {handed_out}",
        stats.retained,
        stats.retained_expired
    );
}

// ---------------------------------------------------------------------------
// close() racing retained publishes and snapshot subscribes.
// ---------------------------------------------------------------------------

/// Publishers retain until the bus refuses them; subscribers with
/// snapshots (ordered, async ordered, streams) join meanwhile; `close()`
/// comes in the middle. Every retained publish is `Ok` or `Closed`; once
/// `close` returns, a stream and an ordered handler subscribed from the
/// start hold or got every accepted publish, and no ordered call starts
/// after it.
#[test]
fn close_racing_retained_publishes_and_snapshot_subscribes() {
    for mode in MODES {
        let rt = runtime(2);
        let bus = Bus::<u64>::builder()
            .delivery(mode)
            .workers(2)
            .stream_capacity(1 << 16)
            .runtime(rt.handle().clone())
            .build()
            .unwrap();
        let ordered_calls = Arc::new(AtomicU64::new(0));
        let late_calls = Arc::new(AtomicU64::new(0));
        let closed = Arc::new(AtomicBool::new(false));
        let _ordered = {
            let (c, late, closed) = (
                Arc::clone(&ordered_calls),
                Arc::clone(&late_calls),
                Arc::clone(&closed),
            );
            bus.subscribe_ordered("k/#", move |_| {
                if closed.load(Ordering::SeqCst) {
                    late.fetch_add(1, Ordering::SeqCst);
                }
                c.fetch_add(1, Ordering::SeqCst);
            })
            .unwrap()
        };
        let mut rx = bus.subscribe_stream("k/#").unwrap();
        let accepted = Arc::new(AtomicU64::new(0));
        let result = within(Duration::from_secs(30), &format!("{mode:?}"), {
            let (bus, accepted, closed, late) = (
                bus.clone(),
                Arc::clone(&accepted),
                Arc::clone(&closed),
                Arc::clone(&late_calls),
            );
            let handle = rt.handle().clone();
            move || {
                let publishers: Vec<_> = (0..2u64)
                    .map(|p| {
                        let (bus, accepted) = (bus.clone(), Arc::clone(&accepted));
                        std::thread::spawn(move || {
                            for n in 0.. {
                                match bus.publish_retained(&format!("k/{p}/{}", n % 5), n) {
                                    Ok(_) => {
                                        accepted.fetch_add(1, Ordering::SeqCst);
                                    }
                                    Err(Error::Closed) => return,
                                    Err(e) => panic!("{e}"),
                                }
                            }
                        })
                    })
                    .collect();
                let joiner = {
                    let (bus, late, closed) = (bus.clone(), Arc::clone(&late), Arc::clone(&closed));
                    std::thread::spawn(move || {
                        let mut kept = Vec::new();
                        for j in 0.. {
                            let r = match j % 3 {
                                0 => {
                                    let (late, closed) = (Arc::clone(&late), Arc::clone(&closed));
                                    bus.subscribe_ordered("k/0/#", move |_| {
                                        if closed.load(Ordering::SeqCst) {
                                            late.fetch_add(1, Ordering::SeqCst);
                                        }
                                    })
                                    .map(|s| kept.push(s))
                                }
                                1 => bus
                                    .subscribe_ordered_async("k/1/#", |_| async {})
                                    .map(|s| kept.push(s)),
                                _ => bus
                                    .subscribe_stream_with(
                                        "k/#",
                                        StreamOptions::new(4).overflow(StreamOverflow::Disconnect),
                                    )
                                    .map(drop),
                            };
                            match r {
                                Ok(()) => {}
                                Err(Error::Closed) => return j,
                                Err(e) => panic!("{e}"),
                            }
                        }
                        unreachable!()
                    })
                };
                std::thread::sleep(Duration::from_millis(30));
                let result = handle.block_on(bus.close());
                closed.store(true, Ordering::SeqCst);
                for p in publishers {
                    p.join().unwrap();
                }
                let joined = joiner.join().unwrap();
                (result, joined)
            }
        });
        let (close_result, joined) = result;
        close_result.unwrap();
        assert!(joined > 0, "{mode:?}: nobody joined");
        let accepted = accepted.load(Ordering::SeqCst);
        let mut read = 0;
        while rx.try_recv().is_ok() {
            read += 1;
        }
        assert_eq!(
            read, accepted,
            "{mode:?}: the stream holds every accepted publish"
        );
        assert_eq!(
            ordered_calls.load(Ordering::SeqCst),
            accepted,
            "{mode:?}: the ordered handler ran every accepted publish"
        );
        assert_eq!(
            late_calls.load(Ordering::SeqCst),
            0,
            "{mode:?}: ordered calls after close"
        );
        assert!(bus.publish_retained("k/0/0", 0).is_err());
        assert_eq!(bus.inflight_messages(), 0);
    }
}

// ---------------------------------------------------------------------------
// Bad input on the retained API: errors or nothing, never a panic.
// ---------------------------------------------------------------------------

#[test]
fn odd_filters_and_topics_on_the_retained_api_never_panic() {
    let bus = Bus::<u64>::builder()
        .delivery(DeliveryMode::Inline)
        .max_retained(1)
        .build()
        .unwrap();
    let deep = vec!["d"; 10_000].join("/");
    let wide = "w".repeat(70_000);
    let topics = [
        "",
        "/",
        "//",
        "a/",
        "/a",
        "+",
        "#",
        "a/+",
        "$SYS/x",
        "$share/g/t",
        "a\0b",
        deep.as_str(),
        wide.as_str(),
        "ü/ß",
    ];
    for topic in topics {
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            let _ = bus.publish_retained(topic, 1);
            let _ = bus.clear_retained(topic);
            let _ = bus.publish_retained(topic, 2);
        }));
        assert!(
            r.is_ok(),
            "topic {:?} panicked",
            &topic[..topic.len().min(20)]
        );
    }
    let filters = [
        "",
        "#",
        "+",
        "/#",
        "+/#",
        "+/+",
        "a/#/b",
        "#/a",
        "a+",
        "$share",
        "$share/",
        "$share/g",
        "$share/g/",
        "$share//#",
        "$share/g/#",
        "$share/g/$share/h/#",
        "$SYS/#",
        deep.as_str(),
        wide.as_str(),
    ];
    for filter in filters {
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            let _ = bus.retained(filter);
            let _ = bus.subscribe_stream(filter).map(drop);
            let _ = bus.subscribe(filter, |_| {}).map(drop);
            let _ = bus.subscribe_ordered(filter, |_| {}).map(drop);
        }));
        assert!(
            r.is_ok(),
            "filter {:?} panicked",
            &filter[..filter.len().min(20)]
        );
    }
    assert!(bus.retained_count() <= 1);
}

// ---------------------------------------------------------------------------
// A handler's backlog overflowing while its snapshot runs.
// ---------------------------------------------------------------------------

/// `stream_capacity` 2: while a handler's snapshot call blocks, 10 live
/// publishes arrive; 2 wait in the backlog, the rest are delivered at once.
/// Each is delivered exactly once, and `delivered` equals the calls.
#[test]
fn a_backlog_overflow_during_a_snapshot_delivers_each_once_and_counts_each_once() {
    for mode in MODES {
        for kind in ["plain", "async"] {
            let rt = runtime(2);
            let bus = Bus::<u64>::builder()
                .delivery(mode)
                .workers(2)
                .stream_capacity(2)
                .runtime(rt.handle().clone())
                .build()
                .unwrap();
            bus.publish_retained("b", 0).unwrap();
            let gate = Arc::new(AtomicBool::new(false));
            let (entered_tx, entered) = std::sync::mpsc::channel::<()>();
            let entered_tx = Mutex::new(Some(entered_tx));
            let seen: Arc<Mutex<Vec<u64>>> = Arc::default();
            let handler = {
                let (gate, seen) = (Arc::clone(&gate), Arc::clone(&seen));
                move |m: &Message<u64>| {
                    if m.is_retained() {
                        if let Some(tx) = entered_tx.lock().unwrap().take() {
                            let _ = tx.send(());
                        }
                        let deadline = Instant::now() + LIMIT;
                        while !gate.load(Ordering::SeqCst) && Instant::now() < deadline {
                            std::thread::sleep(Duration::from_millis(1));
                        }
                    }
                    seen.lock().unwrap().push(*m.data());
                }
            };
            let subscriber = {
                let bus = bus.clone();
                std::thread::spawn(move || match kind {
                    "plain" => bus.subscribe("b", handler),
                    _ => bus.subscribe_async("b", move |m: Arc<Message<u64>>| {
                        handler(&m);
                        async {}
                    }),
                })
            };
            entered.recv_timeout(LIMIT).unwrap();
            for n in 1..=10 {
                assert_eq!(bus.publish_retained("b", n).unwrap(), 1);
            }
            gate.store(true, Ordering::SeqCst);
            let _sub = subscriber.join().unwrap().unwrap();
            assert!(wait_until(LIMIT, || bus.inflight_messages() == 0
                && seen.lock().unwrap().len() >= 11));
            std::thread::sleep(Duration::from_millis(20));
            let mut values = seen.lock().unwrap().clone();
            values.sort_unstable();
            assert_eq!(values, (0..=10).collect::<Vec<_>>(), "{mode:?} {kind}");
            let stats = bus.stats();
            assert_eq!(stats.delivered, 11, "{mode:?} {kind}: {stats:?}");
            assert_eq!(stats.dropped, 0, "{mode:?} {kind}");
        }
    }
}

// ---------------------------------------------------------------------------
// The first retained publishes racing a handler subscribe.
// ---------------------------------------------------------------------------

/// As `retained::the_first_retained_publishes_racing_a_subscribe_leave_no_gap`
/// for handlers (plain and ordered) and streams, checking exactly once (not
/// only "seen"): each of the two first retained publishes reaches the new
/// subscription once, in its snapshot or live.
#[test]
fn the_first_retained_publishes_racing_a_handler_subscribe_reach_it_exactly_once() {
    const ROUNDS: usize = 1_000;
    let mut bad = Vec::new();
    for round in 0..ROUNDS {
        let bus = Bus::<u64>::builder()
            .delivery(DeliveryMode::Inline)
            .build()
            .unwrap();
        let go = Arc::new(std::sync::Barrier::new(3));
        let publishers: Vec<_> = (1..=2u64)
            .map(|n| {
                let (bus, go) = (bus.clone(), Arc::clone(&go));
                std::thread::spawn(move || {
                    go.wait();
                    bus.publish_retained(&format!("t/{n}"), n).unwrap();
                })
            })
            .collect();
        go.wait();
        let counts: Arc<Mutex<[u32; 3]>> = Arc::default();
        let c = Arc::clone(&counts);
        let record = move |m: &Message<u64>| c.lock().unwrap()[*m.data() as usize] += 1;
        let (_sub, mut rx) = match round % 3 {
            0 => (Some(bus.subscribe("t/#", record).unwrap()), None),
            1 => (Some(bus.subscribe_ordered("t/#", record).unwrap()), None),
            _ => (None, Some(bus.subscribe_stream("t/#").unwrap())),
        };
        for publisher in publishers {
            publisher.join().unwrap();
        }
        if let Some(rx) = rx.as_mut() {
            while let Ok(m) = rx.try_recv() {
                counts.lock().unwrap()[*m.data() as usize] += 1;
            }
        }
        let counts = *counts.lock().unwrap();
        if counts[1..] != [1, 1] {
            bad.push((round % 3, counts));
        }
    }
    assert!(
        bad.is_empty(),
        "{} rounds of {ROUNDS} (kind, counts): {:?}",
        bad.len(),
        &bad[..bad.len().min(10)]
    );
}

// ---------------------------------------------------------------------------
// Memory: the store's own structures stay bounded under churn.
// ---------------------------------------------------------------------------

/// 60,000 distinct retained topics through a store of 8 (evicting), with
/// an expiry of 1 ms (expiring), and with clears: the heap after the churn
/// is within 64 KiB of the heap after its first 6,000 (the store's arena
/// and maps reuse what they let go).
#[test]
#[ignore = "measures the heap of the whole test binary: run alone (--ignored --test-threads 1)"]
fn the_store_stays_bounded_under_eviction_expiry_and_clear_churn() {
    for case in ["evict", "expire", "clear"] {
        let mut builder = Bus::<u64>::builder()
            .delivery(DeliveryMode::Inline)
            .route_cache_capacity(0)
            .max_retained(8);
        if case == "expire" {
            builder = builder
                .max_retained(1 << 20)
                .retained_expiry(Duration::from_millis(1));
        }
        let bus = builder.build().unwrap();
        let mut base = 0;
        for i in 0..60_000u64 {
            let topic = format!("m/{}/{}/{}", i % 97, i, i % 13);
            bus.publish_retained(&topic, i).unwrap();
            if case == "clear" {
                assert!(bus.clear_retained(&topic));
            }
            if case == "expire" && i % 1_000 == 0 {
                std::thread::sleep(Duration::from_millis(2));
            }
            if i == 6_000 {
                base = LIVE.load(Ordering::Relaxed);
            }
        }
        let end = LIVE.load(Ordering::Relaxed);
        assert!(
            end - base < 64 * 1024,
            "{case}: heap grew {} bytes from 6,000 to 60,000 topics ({} retained now)",
            end - base,
            bus.retained_count()
        );
    }
}

// ---------------------------------------------------------------------------
// Handlers acting on the store from inside their snapshot calls.
// ---------------------------------------------------------------------------

/// From inside a snapshot call (and a live call) of every handler kind, in
/// every mode: `retained`, `publish_retained` (to its own topic too),
/// `clear_retained` and a subscribe with a snapshot never deadlock.
#[test]
fn handlers_act_on_the_store_from_inside_their_snapshot_calls() {
    for mode in MODES {
        for kind in ["plain", "async", "ordered", "ordered_async"] {
            let rt = runtime(2);
            let bus = bus_on(mode, &rt);
            bus.publish_retained("s/a", 1).unwrap();
            bus.publish_retained("s/b", 2).unwrap();
            let calls = Arc::new(AtomicU64::new(0));
            let act = {
                let (bus, calls) = (bus.clone(), Arc::clone(&calls));
                move |m: &Message<u64>| {
                    calls.fetch_add(1, Ordering::SeqCst);
                    if *m.data() >= 100 {
                        return;
                    }
                    let _ = bus.retained("#");
                    let _ = bus.publish_retained("s/a", *m.data() + 100);
                    let _ = bus.publish_retained(&format!("x/{}", m.data()), 0);
                    let _ = bus.clear_retained("x/1");
                    let _ = bus.subscribe_stream("s/#").map(drop);
                    let _ = bus.subscribe("x/#", |_| {}).map(drop);
                }
            };
            let b = bus.clone();
            let sub = within(
                Duration::from_secs(10),
                &format!("{mode:?} {kind}"),
                move || {
                    match kind {
                        "plain" => b.subscribe("s/#", act),
                        "async" => b.subscribe_async("s/#", move |m: Arc<Message<u64>>| {
                            act(&m);
                            async {}
                        }),
                        "ordered" => b.subscribe_ordered("s/#", act),
                        _ => b.subscribe_ordered_async("s/#", move |m: Arc<Message<u64>>| {
                            act(&m);
                            async {}
                        }),
                    }
                    .unwrap()
                },
            );
            let b = bus.clone();
            within(
                Duration::from_secs(10),
                &format!("{mode:?} {kind} live"),
                move || {
                    b.publish_retained("s/c", 3).unwrap();
                },
            );
            assert!(
                wait_until(LIMIT, || bus.inflight_messages() == 0),
                "{mode:?} {kind}: stuck in flight"
            );
            drop(sub);
            assert!(calls.load(Ordering::SeqCst) >= 3, "{mode:?} {kind}");
        }
    }
}

// ---------------------------------------------------------------------------
// Zero bounds are refused; the smallest ones work.
// ---------------------------------------------------------------------------

#[test]
fn zero_bounds_are_refused_and_the_smallest_ones_work() {
    let err = Bus::<u64>::builder().max_retained(0).build().unwrap_err();
    assert!(
        matches!(
            err,
            Error::InvalidConfig {
                field: "max_retained",
                ..
            }
        ),
        "{err:?}"
    );
    let err = Bus::<u64>::builder()
        .retained_expiry(Duration::ZERO)
        .build()
        .unwrap_err();
    assert!(
        matches!(
            err,
            Error::InvalidConfig {
                field: "retained_expiry",
                ..
            }
        ),
        "{err:?}"
    );
    let err = serde_json::from_str::<blazesub::Config>(r#"{"max_retained": 0}"#)
        .map_err(|e| e.to_string())
        .and_then(|c| c.validate().map_err(|e| e.to_string()));
    assert!(err.is_err());
    // max 1, expiry 1 ns: every retained message is evicted or expired,
    // counted once each, and none is handed out once expired.
    let bus = Bus::<u64>::builder()
        .delivery(DeliveryMode::Inline)
        .max_retained(1)
        .retained_expiry(Duration::from_nanos(1))
        .build()
        .unwrap();
    for n in 0..100 {
        bus.publish_retained(&format!("z/{}", n % 3), n).unwrap();
    }
    std::thread::sleep(Duration::from_millis(1));
    assert!(bus.retained("#").is_empty());
    let mut rx = bus.subscribe_stream("#").unwrap();
    assert!(rx.try_recv().is_err());
    let stats = bus.stats();
    assert_eq!(
        stats.retained_evicted + stats.retained_expired,
        100,
        "{stats:?}"
    );
    assert_eq!(stats.retained, 0);
}

// ---------------------------------------------------------------------------
// A Disconnect stream its snapshot disconnects is like one live traffic did.
// ---------------------------------------------------------------------------

/// A `Disconnect` stream whose snapshot does not fit is disconnected at
/// once; afterwards it counts (in `publish`'s result, `subscribers`,
/// `subscriptions_count`) exactly as a stream live messages disconnected.
#[test]
fn a_stream_its_snapshot_disconnects_counts_like_one_live_traffic_disconnected() {
    let observe = |by_snapshot: bool| {
        let bus = Bus::<u64>::builder()
            .delivery(DeliveryMode::Inline)
            .build()
            .unwrap();
        let disconnect = StreamOptions::new(1).overflow(StreamOverflow::Disconnect);
        let rx = if by_snapshot {
            bus.publish_retained("d/a", 1).unwrap();
            bus.publish_retained("d/b", 2).unwrap();
            bus.subscribe_stream_with("d/#", disconnect).unwrap()
        } else {
            let rx = bus.subscribe_stream_with("d/#", disconnect).unwrap();
            bus.publish_retained("d/a", 1).unwrap();
            bus.publish_retained("d/b", 2).unwrap();
            rx
        };
        let matched = bus.publish_retained("d/c", 3).unwrap();
        let stats = bus.stats();
        let seen = (
            matched,
            bus.subscribers("d/c"),
            bus.subscriptions_count(),
            stats.disconnects,
            stats.dropped,
            rx.lost(),
        );
        drop(rx);
        seen
    };
    assert_eq!(
        observe(true),
        observe(false),
        "(matched, subscribers, subscriptions, disconnects, dropped, lost)"
    );
}
