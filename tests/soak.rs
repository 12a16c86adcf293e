//! Soak and leaks: long runs that must leave nothing behind.
//!
//! - Subscribe/unsubscribe cycles over many distinct filters (exact, `+`,
//!   `#`, deep, shared with long-lived subscriptions, sets grown past their
//!   capacity and shrunk, streams) on a bus with long-lived subscriptions and
//!   a warm route cache: afterwards the trie has exactly its starting number
//!   of nodes, the warm topics fill exactly the starting number of cache
//!   slots, the heap (counted by this binary's global allocator, so exact)
//!   is back within 64 KiB of where it was after the first tenth of the run,
//!   and the resident set (`VmRSS`) within 4 MiB.
//! - A handler that panics on every message, for as many messages, on a
//!   worker pool of 4 (a queue never full, so every panic happens on a
//!   worker): every panic is counted, its neighbour gets every message, and
//!   afterwards one publish to 4 handlers that each wait on a barrier of 4
//!   completes — which needs all 4 workers alive at once. The same on a
//!   `TaskPerSubscriber` bus capped at 16 tasks with `Overflow::Drop`: a
//!   task slot lost to a panic would show as a drop and a barrier timeout.
//!
//! The full runs (1,000,000 cycles, 1,000,000 panics per configuration) are
//! `#[ignore]`d: `cargo test --release --test soak -- --ignored --nocapture`.
//! The normal run does 20,000 of each. Tests in this file run one at a time
//! (they measure the whole process).

mod common;

use std::alloc::{GlobalAlloc, Layout, System};
use std::panic::{self, PanicHookInfo};
use std::sync::atomic::{AtomicIsize, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use blazesub::{Batch, Bus, DeliveryMode, Message, Overflow, Receiver, Subscription};
use common::{rss_kib, runtime, wait_until, QuietPanics, TimedBarrier};

// ---------------------------------------------------------------------------
// Measuring the heap
// ---------------------------------------------------------------------------

/// Bytes allocated and not yet freed, by anyone in this process.
static LIVE_BYTES: AtomicIsize = AtomicIsize::new(0);

/// The system allocator, counting live bytes.
struct Counting;

// SAFETY: every call is forwarded unchanged to `System`; the counter is a
// side effect only.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        // SAFETY: forwarded with the caller's guarantees.
        let ptr = unsafe { System.alloc(layout) };
        if !ptr.is_null() {
            LIVE_BYTES.fetch_add(layout.size() as isize, Ordering::Relaxed);
        }
        ptr
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        // SAFETY: forwarded with the caller's guarantees.
        let ptr = unsafe { System.alloc_zeroed(layout) };
        if !ptr.is_null() {
            LIVE_BYTES.fetch_add(layout.size() as isize, Ordering::Relaxed);
        }
        ptr
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: forwarded with the caller's guarantees.
        unsafe { System.dealloc(ptr, layout) };
        LIVE_BYTES.fetch_sub(layout.size() as isize, Ordering::Relaxed);
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        // SAFETY: forwarded with the caller's guarantees.
        let new = unsafe { System.realloc(ptr, layout, new_size) };
        if !new.is_null() {
            LIVE_BYTES.fetch_add(
                new_size as isize - layout.size() as isize,
                Ordering::Relaxed,
            );
        }
        new
    }
}

#[global_allocator]
static ALLOCATOR: Counting = Counting;

fn live_bytes() -> isize {
    LIVE_BYTES.load(Ordering::SeqCst)
}

/// Tests here measure the whole process: one at a time.
fn serial() -> MutexGuard<'static, ()> {
    static SERIAL: Mutex<()> = Mutex::new(());
    SERIAL.lock().unwrap_or_else(|e| e.into_inner())
}

// ---------------------------------------------------------------------------
// Subscribe/unsubscribe cycles
// ---------------------------------------------------------------------------

/// Heap growth allowed between the first tenth of the run and its end.
const HEAP_MARGIN: isize = 64 * 1024;
/// Resident-set growth allowed over the same span.
const RSS_MARGIN_KIB: u64 = 4 * 1024;
/// Distinct numbers used in filters.
const DISTINCT: usize = 10_007;
/// Route cache slots: small, so topics evict each other all the time.
const CACHE_SLOTS: usize = 256;

/// Long-lived subscriptions and the topics that keep the cache warm.
const PERSISTENT: [&str; 4] = ["soak/+/x", "#", "soak/#", "$SYS/#"];
const WARM: usize = 64;

fn warm_topic(i: usize) -> String {
    if i % 8 == 0 {
        format!("$SYS/warm/{i}")
    } else {
        format!("soak/warm{i}/x")
    }
}

/// A filter for cycle `i`, and a topic it matches.
fn cycle_filter(i: usize) -> (String, String) {
    let k = (i / 8) % DISTINCT;
    let topic = format!("soak/{k}/x");
    match i % 8 {
        0 => (topic.clone(), topic),
        1 => (format!("soak/{k}/+"), topic),
        2 => (format!("soak/{k}/#"), topic),
        3 => (format!("+/{k}/x"), topic),
        4 => (format!("{k}/#"), format!("{k}/y")),
        5 => (
            format!("soak/{k}/x/deep/+/levels/#"),
            format!("soak/{k}/x/deep/a/levels/b/c"),
        ),
        6 => ("soak/+/x".to_string(), topic), // appends to a persistent set
        _ => (format!("$SYS/{k}"), format!("$SYS/{k}")),
    }
}

/// How many persistent subscriptions reach `topic`.
fn persistent_reach(topic: &str) -> usize {
    PERSISTENT
        .iter()
        .filter(|f| blazesub::topic::matches(f, topic))
        .count()
}

struct Figures {
    cycles: usize,
    elapsed: Duration,
    heap_start: isize,
    heap_checkpoint: isize,
    heap_end: isize,
    rss_checkpoint: Option<u64>,
    rss_end: Option<u64>,
    trie_nodes: usize,
    cached_routes: usize,
}

fn subscribe_unsubscribe_cycles(cycles: usize) -> Figures {
    let started = Instant::now();
    let heap_start = live_bytes();
    let bus = Bus::<u64>::builder()
        .delivery(DeliveryMode::Inline)
        .route_cache_capacity(CACHE_SLOTS)
        .build()
        .unwrap();
    let persistent_calls = Arc::new(AtomicU64::new(0));
    let _persistent: Vec<Subscription> = PERSISTENT
        .iter()
        .map(|filter| {
            let calls = Arc::clone(&persistent_calls);
            bus.subscribe(filter, move |_: &Message<u64>| {
                calls.fetch_add(1, Ordering::Relaxed);
            })
            .unwrap()
        })
        .collect();
    let warm = |bus: &Bus<u64>| {
        for i in 0..WARM {
            let topic = warm_topic(i);
            assert_eq!(bus.publish(&topic, 0).unwrap(), persistent_reach(&topic));
        }
    };
    warm(&bus);
    let start = bus.footprint();
    assert!(start.trie_nodes > 0 && start.cached_routes > 0, "{start:?}");
    let calls = Arc::new(AtomicU64::new(0));

    let checkpoint = cycles / 10;
    let mut heap_checkpoint = 0;
    let mut rss_checkpoint = None;
    for i in 0..cycles {
        if i == checkpoint {
            heap_checkpoint = live_bytes();
            rss_checkpoint = rss_kib();
        }
        let (filter, topic) = cycle_filter(i);
        let before = calls.load(Ordering::Relaxed);
        if i % 64 == 7 {
            // A set grown well past its first capacity (4), with a stream,
            // then emptied: the rebuild and prune paths.
            let subs: Vec<Subscription> = (0..12)
                .map(|_| {
                    let calls = Arc::clone(&calls);
                    bus.subscribe(&filter, move |_: &Message<u64>| {
                        calls.fetch_add(1, Ordering::Relaxed);
                    })
                    .unwrap()
                })
                .collect();
            let mut rx: Receiver<u64> = bus.subscribe_stream(&filter).unwrap();
            assert_eq!(
                bus.publish(&topic, i as u64).unwrap(),
                persistent_reach(&topic) + 13,
                "cycle {i}: {filter} / {topic}"
            );
            assert_eq!(*rx.try_recv().unwrap().data(), i as u64);
            assert_eq!(calls.load(Ordering::Relaxed), before + 12, "cycle {i}");
            for (j, sub) in subs.into_iter().enumerate() {
                if j % 2 == 0 {
                    sub.unsubscribe();
                } else {
                    drop(sub);
                }
            }
            drop(rx);
        } else {
            let counter = Arc::clone(&calls);
            let sub = bus
                .subscribe(&filter, move |_: &Message<u64>| {
                    counter.fetch_add(1, Ordering::Relaxed);
                })
                .unwrap();
            assert_eq!(
                bus.publish(&topic, i as u64).unwrap(),
                persistent_reach(&topic) + 1,
                "cycle {i}: {filter} / {topic}"
            );
            assert_eq!(calls.load(Ordering::Relaxed), before + 1, "cycle {i}");
            sub.unsubscribe();
        }
        // Nobody but the persistent subscriptions is left.
        assert_eq!(
            bus.publish(&topic, 0).unwrap(),
            persistent_reach(&topic),
            "cycle {i}: {filter} still matched after unsubscribe"
        );
        if i % 1_000 == 0 {
            let now = bus.footprint();
            assert!(now.cached_routes <= now.route_cache_slots, "{now:?}");
            assert_eq!(
                now.trie_nodes, start.trie_nodes,
                "cycle {i}: trie nodes left over"
            );
        }
    }
    assert_eq!(bus.subscriptions_count(), PERSISTENT.len() as u64);
    // The cycles' topics may hold current routes; a new wildcard node
    // (created and pruned) changes every topic's stamp, so only the warm
    // topics count. (An exact filter's node changes only its own topic's.)
    drop(
        bus.subscribe("generation/+", |_: &Message<u64>| {})
            .unwrap(),
    );
    warm(&bus);
    let end = bus.footprint();
    assert_eq!(
        end.trie_nodes, start.trie_nodes,
        "trie nodes after {cycles} cycles"
    );
    assert_eq!(
        end.cached_routes, start.cached_routes,
        "the warm topics fill the same cache slots as at the start"
    );
    assert_eq!(end.route_cache_slots, CACHE_SLOTS);
    let stats = bus.stats();
    assert_eq!(stats.dropped, 0);
    assert_eq!(stats.inflight, 0);
    let heap_end = live_bytes();
    let rss_end = rss_kib();
    drop(_persistent);
    drop(bus);
    Figures {
        cycles,
        elapsed: started.elapsed(),
        heap_start,
        heap_checkpoint,
        heap_end,
        rss_checkpoint,
        rss_end,
        trie_nodes: end.trie_nodes,
        cached_routes: end.cached_routes,
    }
}

fn check_cycles(cycles: usize) {
    let _serial = serial();
    let f = subscribe_unsubscribe_cycles(cycles);
    let heap_growth = f.heap_end - f.heap_checkpoint;
    eprintln!(
        "soak: {} subscribe/unsubscribe cycles in {:.1?}: trie {} nodes and {} cached routes \
         before and after; heap {} B at start, {} B after 10%, {} B at the end ({:+} B); \
         VmRSS {:?} KiB after 10%, {:?} KiB at the end",
        f.cycles,
        f.elapsed,
        f.trie_nodes,
        f.cached_routes,
        f.heap_start,
        f.heap_checkpoint,
        f.heap_end,
        heap_growth,
        f.rss_checkpoint,
        f.rss_end,
    );
    assert!(
        heap_growth <= HEAP_MARGIN,
        "the heap grew by {heap_growth} B over {} cycles (margin {HEAP_MARGIN} B): a leak",
        cycles - cycles / 10
    );
    if let (Some(before), Some(after)) = (f.rss_checkpoint, f.rss_end) {
        assert!(
            after <= before + RSS_MARGIN_KIB,
            "VmRSS grew from {before} KiB to {after} KiB (margin {RSS_MARGIN_KIB} KiB)"
        );
    }
}

/// 20,000 cycles: the normal test run.
#[test]
fn subscribe_unsubscribe_cycles_leave_nothing_behind() {
    check_cycles(20_000);
}

/// The full million (release build recommended).
#[test]
#[ignore = "long soak: cargo test --release --test soak -- --ignored --nocapture"]
fn a_million_subscribe_unsubscribe_cycles_leave_nothing_behind() {
    check_cycles(1_000_000);
}

// ---------------------------------------------------------------------------
// Panicking handlers
// ---------------------------------------------------------------------------

const INTENTIONAL: &str = "intentional soak panic";

fn is_intentional(info: &PanicHookInfo<'_>) -> bool {
    let payload = info.payload();
    payload.downcast_ref::<&str>() == Some(&INTENTIONAL)
        || payload
            .downcast_ref::<String>()
            .is_some_and(|s| s == INTENTIONAL)
}

const WORKERS: usize = 4;

/// Publishes `n` messages to a handler that always panics and a neighbour
/// that counts, waiting before each publish until `ready` (so nothing ever
/// overflows and every delivery runs where the mode puts it, never on the
/// publisher). Returns the time taken.
fn panic_on_every_message(
    bus: &Bus<u32>,
    n: u32,
    what: &str,
    ready: impl Fn(&Bus<u32>) -> bool,
) -> Duration {
    let started = Instant::now();
    let counted = Arc::new(AtomicU64::new(0));
    let neighbour = Arc::clone(&counted);
    let subs = [
        bus.subscribe("boom/x", |_: &Message<u32>| panic::panic_any(INTENTIONAL))
            .unwrap(),
        bus.subscribe("boom/+", move |_: &Message<u32>| {
            neighbour.fetch_add(1, Ordering::Relaxed);
        })
        .unwrap(),
    ];
    for id in 0..n {
        let deadline = Instant::now() + Duration::from_secs(60);
        while !ready(bus) {
            assert!(
                Instant::now() < deadline,
                "{what}: message {id}: the bus never became ready again ({:?})",
                bus.footprint()
            );
            std::thread::yield_now();
        }
        assert_eq!(bus.publish("boom/x", id).unwrap(), 2, "{what}");
    }
    assert!(
        wait_until(Duration::from_secs(120), || bus.inflight_messages() == 0),
        "{what}: deliveries never finished ({} in flight): did a panic kill a runner?",
        bus.inflight_messages()
    );
    let stats = bus.stats();
    assert_eq!(stats.handler_panics, u64::from(n), "{what}: panics counted");
    assert_eq!(
        counted.load(Ordering::Relaxed),
        u64::from(n),
        "{what}: the neighbour"
    );
    assert_eq!(stats.delivered, u64::from(n), "{what}");
    assert_eq!(stats.dropped, 0, "{what}: a delivery found no room");
    assert_eq!(
        stats.caller_runs, 0,
        "{what}: a delivery ran on the publisher"
    );
    drop(subs);
    started.elapsed()
}

/// One publish to `parties` handlers that each wait (up to 20 s) until all
/// `parties` are inside their handler at once. Returns how many saw the
/// whole party.
fn all_at_once(bus: &Bus<u32>, parties: usize, what: &str) -> usize {
    let barrier = Arc::new(TimedBarrier::new(parties));
    let met = Arc::new(AtomicU64::new(0));
    let subs: Vec<Subscription> = (0..parties)
        .map(|_| {
            let (barrier, met) = (Arc::clone(&barrier), Arc::clone(&met));
            bus.subscribe("full/x", move |_: &Message<u32>| {
                if barrier.wait(Duration::from_secs(20)) {
                    met.fetch_add(1, Ordering::SeqCst);
                }
            })
            .unwrap()
        })
        .collect();
    assert_eq!(bus.publish("full/x", 0).unwrap(), parties, "{what}");
    assert!(
        wait_until(Duration::from_secs(60), || bus.inflight_messages() == 0),
        "{what}: the barrier publish never finished"
    );
    drop(subs);
    met.load(Ordering::SeqCst) as usize
}

fn check_pool_after_panics(n: u32, batch: Batch) {
    let what = format!("WorkerPool {batch:?}, {n} panics");
    let bus = Bus::<u32>::builder()
        .delivery(DeliveryMode::WorkerPool)
        .workers(WORKERS)
        .max_concurrent_subscriptions(WORKERS)
        .batch(batch)
        .overflow(Overflow::Drop)
        .build()
        .unwrap();
    // Each worker has a queue of its own, 1,024 of the 4,096 jobs, and a
    // worker the kernel leaves off a core for a while keeps its share of
    // every publish queued meanwhile: with up to 1,024 deliveries waiting,
    // one such worker's queue held them all and refused the next
    // (`Overflow::Drop`), a delivery counted dropped instead of run. At
    // most 512 waiting can never fill one.
    let took = panic_on_every_message(&bus, n, &what, |bus| bus.inflight_messages() <= 512);
    let met = all_at_once(&bus, WORKERS, &what);
    assert_eq!(
        met, WORKERS,
        "{what}: only {met} of {WORKERS} handlers met at the barrier: the pool lost workers"
    );
    let stats = bus.stats();
    assert_eq!((stats.dropped, stats.caller_runs), (0, 0), "{what}");
    eprintln!(
        "soak: {what}: {n} messages in {took:.1?}, all {} panics caught, the neighbour got \
         every message; then {WORKERS} of {WORKERS} workers ran at once",
        stats.handler_panics
    );
}

fn check_tasks_after_panics(n: u32) {
    /// Task slots, and runtime threads so all of them can block at once.
    const CAP: usize = 16;
    let what = format!("TaskPerSubscriber Single (cap {CAP}, Drop), {n} panics");
    let rt = runtime(CAP);
    let bus = Bus::<u32>::builder()
        .delivery(DeliveryMode::TaskPerSubscriber)
        .runtime(rt.handle().clone())
        .workers(CAP)
        .max_inflight_tasks(CAP)
        .max_concurrent_subscriptions(CAP)
        // One task per subscription, spawned by the publisher; a task slot
        // lost to a panic would make a later publish drop a delivery.
        .batch(Batch::Single)
        .overflow(Overflow::Drop)
        // `footprint()` reads every cache slot; it is asked before each
        // publish here, so keep the cache small.
        .route_cache_capacity(8)
        .build()
        .unwrap();
    // Room for both units before each publish.
    let took = panic_on_every_message(&bus, n, &what, |bus| bus.footprint().live_tasks <= CAP - 2);
    assert!(
        wait_until(Duration::from_secs(10), || bus.footprint().live_tasks == 0),
        "{what}: task slots still held after every delivery finished"
    );
    let met = all_at_once(&bus, CAP, &what);
    assert_eq!(met, CAP, "{what}: the tasks did not all run at once");
    let stats = bus.stats();
    assert_eq!((stats.dropped, stats.caller_runs), (0, 0), "{what}");
    eprintln!(
        "soak: {what}: {n} messages in {took:.1?}, all {} panics caught, the neighbour got \
         every message; then {CAP} of {CAP} task slots ran at once",
        stats.handler_panics
    );
}

fn check_panics(n: u32) {
    let _serial = serial();
    let _quiet = QuietPanics::install(is_intentional);
    for batch in [Batch::Single, Batch::Chunked] {
        check_pool_after_panics(n, batch);
    }
    check_tasks_after_panics(n);
}

/// 20,000 panics per configuration: the normal test run.
#[test]
fn a_handler_that_always_panics_leaves_every_runner_alive() {
    check_panics(20_000);
}

/// The full million per configuration (release build recommended).
#[test]
#[ignore = "long soak: cargo test --release --test soak -- --ignored --nocapture"]
fn a_million_panics_leave_every_runner_alive() {
    check_panics(1_000_000);
}
