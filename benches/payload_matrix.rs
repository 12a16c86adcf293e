//! Payload size × subscriber count on a `ByteBus` (the JetStream matrix of
//! seed `003_…`: consumers {1, 10, 40, 100, 150, 200} × message sizes
//! {1, 4, 8, 16, 64} KiB): delivered MB/s end to end, heap growth,
//! allocations, RSS growth.
//!
//! The bus is `Bus<bytes::Bytes>` with `Config::default()` (a `WorkerPool`
//! of one worker per core, threshold 10, `Batch::Chunked`). Every subscriber
//! is a handler on the one topic `bench/payload` that reads the payload (one
//! byte per KiB and the last byte, summed, so every KiB is really fetched)
//! and counts its call in a shared `AtomicU64`. Each publish sends a fresh
//! payload: the publisher copies it from a template into a new `Bytes`, as a
//! service would receive one from the network, so every publish allocates
//! one payload — and the bus must allocate nothing per subscriber.
//!
//! Two passes, per cell of the matrix:
//! - **Memory**, once: after a warm-up, 64 MiB of payloads are published in
//!   bursts of 100, each burst waited for until every handler ran. A counting
//!   global allocator (this file's own, since it must also count frees) gives
//!   allocations and bytes allocated per publish, the peak of live heap above
//!   where the run started, and the live heap left over at the end;
//!   `common/rss.rs` gives the RSS growth (peak above the start, after
//!   trimming the allocator and resetting the peak).
//! - **Throughput**, with criterion: one iteration is a burst of 100
//!   publishes, timed until every handler has run for every message.
//!
//! In bench mode it then writes `docs/payload_matrix.md`. In test mode
//! (`cargo test --bench payload_matrix`) each cell publishes 1 MiB.
//!
//! `cargo bench --bench payload_matrix`

mod common;

use std::alloc::{GlobalAlloc, Layout, System};
use std::hint::black_box;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use blazesub::{ByteBus, Config, Message, Subscription};
use bytes::Bytes;
use criterion::{criterion_group, BenchmarkId, Criterion, Throughput};

use common::report::{criterion_results, format_ns, Chart, Report, Series, Table};
use common::{bench_mode, rss, wait_for, BURST};

const TOPIC: &str = "bench/payload";
const SUBSCRIBERS: [usize; 6] = [1, 10, 40, 100, 150, 200];
const PAYLOAD_KIB: [usize; 5] = [1, 4, 8, 16, 64];
/// Handlers read one byte in every this many.
const STRIDE: usize = 1024;

/// The seed's heap growth from 1 to 200 consumers (JetStream, 8 MB blocks,
/// 4 GB MaxBytes, 75% fill), per message size in [`PAYLOAD_KIB`] order.
const SEED_HEAP_SCALING: [f64; 5] = [4.4, 2.6, 2.5, 3.3, 11.7];

/// Bytes published per cell in the memory pass.
fn published_bytes() -> usize {
    if bench_mode() {
        64 << 20
    } else {
        1 << 20
    }
}

// ---------------------------------------------------------------------------
// A global allocator that also counts frees, for net and peak heap figures.

/// Counts allocations, bytes allocated, and live bytes (allocated minus
/// freed) with their peak. `realloc` counts as one allocation of the new
/// size, as `common::CountingAllocator` does.
struct NetCountingAllocator;

static ALLOCATIONS: AtomicU64 = AtomicU64::new(0);
static ALLOCATED: AtomicU64 = AtomicU64::new(0);
static LIVE: AtomicU64 = AtomicU64::new(0);
static PEAK_LIVE: AtomicU64 = AtomicU64::new(0);

#[global_allocator]
static ALLOCATOR: NetCountingAllocator = NetCountingAllocator;

impl NetCountingAllocator {
    #[inline]
    fn grew(by: u64) {
        let live = LIVE.fetch_add(by, Ordering::Relaxed) + by;
        PEAK_LIVE.fetch_max(live, Ordering::Relaxed);
    }

    #[inline]
    fn counted(size: usize) {
        ALLOCATIONS.fetch_add(1, Ordering::Relaxed);
        ALLOCATED.fetch_add(size as u64, Ordering::Relaxed);
    }
}

// SAFETY: delegates every call unchanged to the system allocator; the
// counters are plain atomics and do not allocate.
#[allow(unsafe_code)]
unsafe impl GlobalAlloc for NetCountingAllocator {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        let ptr = unsafe { System.alloc(layout) };
        if !ptr.is_null() {
            Self::counted(layout.size());
            Self::grew(layout.size() as u64);
        }
        ptr
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        let ptr = unsafe { System.alloc_zeroed(layout) };
        if !ptr.is_null() {
            Self::counted(layout.size());
            Self::grew(layout.size() as u64);
        }
        ptr
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        LIVE.fetch_sub(layout.size() as u64, Ordering::Relaxed);
        unsafe { System.dealloc(ptr, layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        let new = unsafe { System.realloc(ptr, layout, new_size) };
        if !new.is_null() {
            Self::counted(new_size);
            let old = layout.size();
            if new_size >= old {
                Self::grew((new_size - old) as u64);
            } else {
                LIVE.fetch_sub((old - new_size) as u64, Ordering::Relaxed);
            }
        }
        new
    }
}

/// The heap counters at one instant.
#[derive(Clone, Copy, Debug)]
struct Heap {
    allocations: u64,
    allocated: u64,
    live: u64,
}

impl Heap {
    fn now() -> Self {
        Self {
            allocations: ALLOCATIONS.load(Ordering::Relaxed),
            allocated: ALLOCATED.load(Ordering::Relaxed),
            live: LIVE.load(Ordering::Relaxed),
        }
    }

    /// Starts a new peak from the current live heap.
    fn reset_peak() {
        PEAK_LIVE.store(LIVE.load(Ordering::Relaxed), Ordering::Relaxed);
    }

    fn peak_live() -> u64 {
        PEAK_LIVE.load(Ordering::Relaxed)
    }
}

// ---------------------------------------------------------------------------
// The workload.

/// A payload template of `kib` KiB with varied contents.
fn template(kib: usize) -> Vec<u8> {
    (0..kib * 1024).map(|i| (i % 251) as u8).collect()
}

/// The default bus with `subscribers` handlers that read the payload and
/// count their calls.
fn bus_with(subscribers: usize) -> (ByteBus, Arc<AtomicU64>, Vec<Subscription>) {
    let bus = ByteBus::new(Config::default()).expect("bus");
    let counter = Arc::new(AtomicU64::new(0));
    let subscriptions = (0..subscribers)
        .map(|_| {
            let counter = Arc::clone(&counter);
            bus.subscribe(TOPIC, move |m: &Message<Bytes>| {
                let data = m.data();
                let mut sum = data.last().map_or(0, |&b| u64::from(b));
                for i in (0..data.len()).step_by(STRIDE) {
                    sum += u64::from(data[i]);
                }
                black_box(sum);
                counter.fetch_add(1, Ordering::Relaxed);
            })
            .expect("subscribe")
        })
        .collect();
    (bus, counter, subscriptions)
}

/// Publishes `publishes` fresh copies of `template` in bursts of [`BURST`],
/// waiting after each burst until every handler has run for it. Returns the
/// time taken.
fn publish_bursts(
    bus: &ByteBus,
    counter: &AtomicU64,
    subscribers: usize,
    template: &[u8],
    publishes: u64,
) -> Duration {
    let mut target = counter.load(Ordering::Acquire);
    let mut left = publishes;
    let start = Instant::now();
    while left > 0 {
        let burst = left.min(BURST);
        for _ in 0..burst {
            bus.publish(TOPIC, Bytes::copy_from_slice(template))
                .expect("publish");
        }
        target += burst * subscribers as u64;
        wait_for(counter, target);
        left -= burst;
    }
    start.elapsed()
}

// ---------------------------------------------------------------------------
// Memory pass.

/// One cell's memory figures.
#[derive(Clone, Copy, Debug)]
struct MemoryRow {
    subscribers: usize,
    kib: usize,
    allocations_per_publish: f64,
    /// Bytes allocated (gross) per byte of payload published.
    allocated_per_published: f64,
    /// The peak of live heap above where the run started.
    peak_live_growth: u64,
    /// Live heap at the end minus at the start (negative: freed more).
    net_live: i64,
    rss_growth: Option<u64>,
}

fn memory_pass() -> Vec<MemoryRow> {
    let mut rows = Vec::new();
    // Buses are kept until the pass ends: a dropped bus's workers exit, and
    // free their queue, some time later, which would land in the next
    // cell's figures.
    let mut retired = Vec::new();
    for kib in PAYLOAD_KIB {
        let template = template(kib);
        let publishes = (published_bytes() / template.len()) as u64;
        for subscribers in SUBSCRIBERS {
            let (bus, counter, subscriptions) = bus_with(subscribers);
            // Warm the route cache, the workers and the allocator's caches.
            publish_bursts(&bus, &counter, subscribers, &template, BURST);
            let window = rss::Window::start();
            Heap::reset_peak();
            let before = Heap::now();
            let elapsed = publish_bursts(&bus, &counter, subscribers, &template, publishes);
            let after = Heap::now();
            let peak = Heap::peak_live();
            let row = MemoryRow {
                subscribers,
                kib,
                allocations_per_publish: (after.allocations - before.allocations) as f64
                    / publishes as f64,
                allocated_per_published: (after.allocated - before.allocated) as f64
                    / (publishes as f64 * template.len() as f64),
                peak_live_growth: peak.saturating_sub(before.live),
                net_live: after.live as i64 - before.live as i64,
                rss_growth: window.peak_growth(),
            };
            println!(
                "{kib:>2} KiB {subscribers:>3} subscribers: {:.2} allocations/publish, {:.3} bytes \
                 allocated per byte published, peak live heap +{:.2} MB, net {:+} B, RSS +{}, \
                 {publishes} publishes in {}",
                row.allocations_per_publish,
                row.allocated_per_published,
                row.peak_live_growth as f64 / 1e6,
                row.net_live,
                rss::format_mb(row.rss_growth),
                format_ns(elapsed.as_nanos() as f64),
            );
            rows.push(row);
            retired.push((bus, subscriptions));
        }
    }
    drop(retired);
    rows
}

// ---------------------------------------------------------------------------
// Throughput, with criterion.

fn throughput(c: &mut Criterion) {
    let mut group = c.benchmark_group("payload_matrix");
    for kib in PAYLOAD_KIB {
        let template = template(kib);
        for subscribers in SUBSCRIBERS {
            let (bus, counter, subscriptions) = bus_with(subscribers);
            group.throughput(Throughput::Bytes(
                BURST * (template.len() * subscribers) as u64,
            ));
            group.bench_with_input(
                BenchmarkId::new(format!("{kib}KiB"), subscribers),
                &subscribers,
                |b, &subscribers| {
                    b.iter_custom(|iters| {
                        publish_bursts(&bus, &counter, subscribers, &template, iters * BURST)
                    })
                },
            );
            drop(subscriptions);
        }
    }
    group.finish();
}

// ---------------------------------------------------------------------------
// The report.

/// A matrix table: one row per subscriber count, one column per payload.
fn matrix(title: &str, note: &str, cell: impl Fn(usize, usize) -> String) -> Table {
    let columns: Vec<String> = std::iter::once("subscribers".to_owned())
        .chain(PAYLOAD_KIB.iter().map(|k| format!("{k} KiB")))
        .collect();
    let columns: Vec<&str> = columns.iter().map(String::as_str).collect();
    let mut table = Table::new(title, &columns);
    for subscribers in SUBSCRIBERS {
        table.row(
            std::iter::once(subscribers.to_string())
                .chain(PAYLOAD_KIB.iter().map(|&kib| cell(subscribers, kib)))
                .collect(),
        );
    }
    table.note = note.to_owned();
    table
}

/// A whole number with thousands separators: "392,504".
fn thousands(v: f64) -> String {
    let digits = format!("{:.0}", v.max(0.0));
    let mut out = String::new();
    for (i, c) in digits.chars().enumerate() {
        if i > 0 && (digits.len() - i) % 3 == 0 {
            out.push(',');
        }
        out.push(c);
    }
    out
}

fn series_per_payload(point: impl Fn(usize, usize) -> Option<f64>) -> Vec<Series> {
    PAYLOAD_KIB
        .iter()
        .map(|&kib| Series {
            name: format!("{kib} KiB"),
            points: SUBSCRIBERS
                .iter()
                .filter_map(|&s| point(s, kib).map(|y| (s as f64, y)))
                .collect(),
        })
        .collect()
}

fn write_report(memory: &[MemoryRow]) {
    let results = criterion_results("payload_matrix");
    let row = |subscribers: usize, kib: usize| {
        memory
            .iter()
            .find(|r| r.subscribers == subscribers && r.kib == kib)
    };
    // Delivered MB/s: every subscriber's view of every payload, per second.
    let delivered = |subscribers: usize, kib: usize| {
        results
            .get(&format!("{kib}KiB/{subscribers}"))
            .map(|e| (BURST as usize * kib * 1024 * subscribers) as f64 / e.mean_ns * 1e3)
    };
    let mut report = Report::new(
        "payload_matrix",
        "Payload size × subscribers on a ByteBus",
        &["blazesub", "bytes", "crossbeam-queue", "criterion"],
    );

    let time_table = matrix(
        "Time per publish until every handler ran, µs",
        "Criterion's mean per burst of 100 publishes, divided by 100. Includes the \
         publisher's allocation and copy of the payload.",
        |s, k| {
            results.get(&format!("{k}KiB/{s}")).map_or_else(
                || "n/a".to_owned(),
                |e| format!("{:.2}", e.mean_ns / BURST as f64 / 1e3),
            )
        },
    );
    let throughput_table = matrix(
        "Delivered MB/s, end to end",
        "Payload bytes × subscribers, per second, until every handler ran (criterion's \
         mean per burst of 100 publishes). Each subscriber sees the one shared buffer: \
         nothing is copied per subscriber, so this is the rate at which handlers are \
         handed payloads, not a memory bandwidth. Handlers read one byte per KiB.",
        |s, k| delivered(s, k).map_or_else(|| "n/a".to_owned(), thousands),
    );
    let allocated_table = matrix(
        "Heap allocated per MB published",
        "Bytes allocated (gross) over the run, divided by the payload bytes published \
         (not multiplied by subscribers). 1.00 would be the payloads alone; the rest is \
         the bus's `Arc<Message>` and job per publish. A bus that copied the payload per \
         subscriber would show the subscriber count here.",
        |s, k| {
            row(s, k).map_or_else(
                || "n/a".to_owned(),
                |r| format!("{:.3}", r.allocated_per_published),
            )
        },
    );
    let (net_min, net_max) = memory.iter().fold((i64::MAX, i64::MIN), |(lo, hi), r| {
        (lo.min(r.net_live), hi.max(r.net_live))
    });
    let peak_table = matrix(
        "Peak live heap growth, MB",
        &format!(
            "The most live heap (allocated minus freed) above where the run started. At \
             most a burst of 100 publishes is in flight, so 100 payloads (plus their \
             messages) is the ceiling whatever the subscriber count; below it, the figure \
             says how far the publisher got ahead of the workers. Live heap after each run \
             minus before: {net_min:+} to {net_max:+} bytes."
        ),
        |s, k| {
            row(s, k).map_or_else(
                || "n/a".to_owned(),
                |r| format!("{:.2}", r.peak_live_growth as f64 / 1e6),
            )
        },
    );
    let allocations_table = matrix(
        "Allocations per publish",
        "Counted on every thread over the run, until every handler ran.",
        |s, k| {
            row(s, k).map_or_else(
                || "n/a".to_owned(),
                |r| format!("{:.2}", r.allocations_per_publish),
            )
        },
    );
    let rss_table = matrix(
        "RSS growth, MB",
        "Peak RSS during the run above the RSS at its start, after `malloc_trim` and a \
         reset of the peak (`common/rss.rs`). Includes allocator slack; under about 1 MB \
         it is noise.",
        |s, k| {
            row(s, k).map_or_else(
                || "n/a".to_owned(),
                |r| rss::format_mb(r.rss_growth).replace(" MB", ""),
            )
        },
    );

    let mut scaling = Table::new(
        "From 1 to 200 subscribers",
        &[
            "payload",
            "seed: heap delta 200 / 1 consumers",
            "ours: heap allocated per MB, 200 / 1",
            "ours: peak live heap, 200 / 1",
            "ours: delivered MB/s, 200 / 1",
        ],
    );
    scaling.note = "Seed: JetStream, 8 MB blocks, 4 GB MaxBytes, 75% fill, one dedicated \
                    subject per consumer (seed `003_…`). Ours: one topic, every subscriber \
                    sees every publish."
        .into();
    for (index, kib) in PAYLOAD_KIB.into_iter().enumerate() {
        let ratio = |f: &dyn Fn(&MemoryRow) -> f64| match (row(200, kib), row(1, kib)) {
            (Some(hi), Some(lo)) if f(lo) > 0.0 => format!("{:.2}×", f(hi) / f(lo)),
            _ => "n/a".to_owned(),
        };
        scaling.row(vec![
            format!("{kib} KiB"),
            format!("{:.1}×", SEED_HEAP_SCALING[index]),
            ratio(&|r| r.allocated_per_published),
            ratio(&|r| r.peak_live_growth as f64),
            match (delivered(200, kib), delivered(1, kib)) {
                (Some(hi), Some(lo)) => format!("{:.0}×", hi / lo),
                _ => "n/a".to_owned(),
            },
        ]);
    }

    let allocated_chart = Chart {
        file: "payload_matrix-heap".into(),
        title: "Heap allocated per MB published".into(),
        x_label: "subscribers".into(),
        y_label: "MB allocated per MB published".into(),
        log_x: true,
        series: series_per_payload(|s, k| row(s, k).map(|r| r.allocated_per_published)),
        ..Chart::default()
    };
    let peak_chart = Chart {
        file: "payload_matrix-peak-heap".into(),
        title: "Peak live heap growth during the run".into(),
        x_label: "subscribers".into(),
        y_label: "MB".into(),
        log_x: true,
        series: series_per_payload(|s, k| row(s, k).map(|r| r.peak_live_growth as f64 / 1e6)),
        ..Chart::default()
    };
    let throughput_chart = Chart {
        file: "payload_matrix-throughput".into(),
        title: "Delivered MB/s, end to end".into(),
        x_label: "subscribers".into(),
        y_label: "MB/s".into(),
        log_x: true,
        log_y: true,
        series: series_per_payload(delivered),
    };

    report.tables = vec![
        scaling,
        throughput_table,
        time_table,
        allocated_table,
        peak_table,
        allocations_table,
        rss_table,
    ];
    report.charts = vec![allocated_chart, peak_chart, throughput_chart];
    match report.save() {
        Ok(()) => println!("wrote docs/payload_matrix.md"),
        Err(err) => eprintln!("could not write the report: {err}"),
    }
}

criterion_group! {
    name = benches;
    // Thirty cells: defaults that keep the run short; command-line options
    // still override them.
    config = Criterion::default()
        .sample_size(20)
        .warm_up_time(Duration::from_secs(1))
        .measurement_time(Duration::from_secs(2));
    targets = throughput
}

fn main() {
    let started = Instant::now();
    let memory = memory_pass();
    println!("memory pass took {:.1} s", started.elapsed().as_secs_f64());
    benches();
    Criterion::default().configure_from_args().final_summary();
    if bench_mode() {
        write_report(&memory);
    }
    println!(
        "payload_matrix took {:.1} s",
        started.elapsed().as_secs_f64()
    );
}
