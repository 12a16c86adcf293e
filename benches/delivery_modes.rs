//! Seed `001` ("Worker Pool vs Direct Goroutines Performance Analysis") on
//! blazesub: its three tables, for every delivery mode, with rumqttd where
//! the seed has MochiMQTT.
//!
//! The seed's figures come from BlazeSub's `mqtt_comparison_test.go`; each
//! table here runs the same workload:
//! - **Base publishing** (`BenchmarkBusVsMQTT`): one thread publishes
//!   round-robin over 100 topics to a bus holding 4,995 exact subscriptions
//!   on 1,000 topics plus 5 wildcard ones: on average 5.02 subscribers per
//!   publish (see `common::rumqttd::BusVsMqtt`). Bursts of 1,000 publishes.
//! - **Concurrent publishing** (`BenchmarkBusVsMQTTConcurrent`): 100 topics
//!   `test/concurrent/{i}`, one subscription each; [`PUBLISHERS`] threads
//!   each publish round-robin over them (each from topic 0, as Go's
//!   `RunParallel` loop does), in rounds of 1,000 publishes in all.
//! - **Subscribe/unsubscribe** (`BenchmarkBusVsMQTTSubscribeUnsubscribe`):
//!   on an empty bus, subscribe a handler to `test/sub/{i}` and unsubscribe
//!   it. The filters cycle over 10,000 names (rumqttd keeps a log for every
//!   filter it has ever seen, so fresh names forever would grow it without
//!   bound; it is measured once every name has its log, blazesub prunes the
//!   trie on every unsubscribe); rumqttd sends its pairs back to back on one
//!   link, in bursts of 1,000, each burst ending when every request is
//!   acknowledged.
//!
//! Every handler (and every rumqttd reader) adds one to a shared
//! `AtomicU64`; "end to end" stops the clock when that count shows every
//! subscriber received every message. The seed's own figures are
//! publish-call only (Go's timer stops when `Publish` returns); the time
//! spent inside the publish calls is summed during the same end-to-end
//! criterion iterations and reported beside them (there are no separate
//! benchmarks for it). B/op and allocs/op are counted
//! end to end on every thread by the counting allocator.
//!
//! Outside criterion, a pass measures concurrent publishing with 1, 2, 4 and
//! 8 publisher threads for the chart. After criterion it writes
//! `docs/delivery_modes.md`.
//!
//! `cargo bench --bench delivery_modes`

mod common;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};

use blazesub::{Bus, DeliveryMode, Message, Subscription};
use bytes::Bytes;
use criterion::{BenchmarkId, Criterion, SamplingMode};

use common::report::{criterion_results, format_ns, Chart, Report, Series, Table};
use common::rumqttd::{BusVsMqtt, Rumqttd, PAYLOAD};
use common::{alloc_snapshot, bench_mode, runtime, wait_for, CountingAllocator, Setup};

#[global_allocator]
static ALLOCATOR: CountingAllocator = CountingAllocator;

/// Every blazesub mode at its defaults (the seed's columns are BlazeSub's
/// two modes at theirs).
const SETUPS: [Setup; 3] = [
    Setup::defaults("worker_pool", DeliveryMode::WorkerPool),
    Setup::defaults("task_per_subscriber", DeliveryMode::TaskPerSubscriber),
    Setup::defaults("inline", DeliveryMode::Inline),
];
const RUMQTTD: &str = "rumqttd";

/// Base publishing: publishes per burst (one criterion iteration).
const PUBLISHES_PER_BURST: usize = 1_000;
/// Concurrent publishing: topics, threads, and publishes per round (one
/// criterion iteration), all threads together.
const CONCURRENT_TOPICS: usize = 100;
const PUBLISHERS: usize = 4;
const PUBLISHES_PER_ROUND: usize = 1_000;
/// Publisher thread counts of the chart.
const THREAD_SWEEP: [usize; 4] = [1, 2, 4, 8];
/// Subscribe/unsubscribe: pairs per criterion iteration.
const PAIRS_PER_BURST: usize = 1_000;

/// The seed's three analyses.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Scenario {
    Base,
    Concurrent,
    Subscribe,
}

/// Allocations and bytes per operation, end to end, by scenario and system.
#[derive(Default)]
struct Measured {
    allocations: Vec<(Scenario, String, (f64, f64))>,
    /// ns per publish inside the publish calls, over the same criterion
    /// iterations as the end-to-end figure.
    call_only: Vec<(Scenario, String, f64)>,
    /// Concurrent publishing: (system, [(threads, ns per publish)]).
    threads: Vec<(String, Vec<(usize, f64)>)>,
}

impl Measured {
    fn allocations(&self, scenario: Scenario, system: &str) -> Option<(f64, f64)> {
        self.allocations
            .iter()
            .find(|(s, n, _)| *s == scenario && n == system)
            .map(|(_, _, a)| *a)
    }

    fn call_only(&self, scenario: Scenario, system: &str) -> Option<f64> {
        self.call_only
            .iter()
            .find(|(s, n, _)| *s == scenario && n == system)
            .map(|(_, _, ns)| *ns)
    }
}

/// Sums the publish-call time of every criterion iteration.
#[derive(Default)]
struct CallTime {
    calls: Duration,
    publishes: u64,
}

impl CallTime {
    fn add(&mut self, calls: Duration, publishes: u64) {
        self.calls += calls;
        self.publishes += publishes;
    }

    fn ns_per_publish(&self) -> f64 {
        self.calls.as_nanos() as f64 / self.publishes.max(1) as f64
    }
}

/// Handlers on every filter, each adding one to `delivered`.
fn subscribe_all<S: AsRef<str>>(
    bus: &Bus<Bytes>,
    filters: &[S],
    delivered: &Arc<AtomicU64>,
) -> Vec<Subscription> {
    filters
        .iter()
        .map(|filter| {
            let delivered = Arc::clone(delivered);
            bus.subscribe(filter.as_ref(), move |_: &Message<Bytes>| {
                delivered.fetch_add(1, Ordering::Relaxed);
            })
            .expect("subscribe")
        })
        .collect()
}

// ---------------------------------------------------------------- base

/// Allocations, then the criterion run (end to end, with the time inside the
/// publish calls kept on the side) for one system on the base workload.
fn base_runs(
    group: &mut criterion::BenchmarkGroup<'_, criterion::measurement::WallTime>,
    measured: &mut Measured,
    name: &str,
    workload: &BusVsMqtt,
    publish: &mut impl FnMut(usize),
    delivered: &AtomicU64,
) {
    let mut cursor = 0;
    // Warm up route caches, pools, rumqttd's logs.
    workload.bursts(publish, delivered, &mut cursor, 5, PUBLISHES_PER_BURST);
    let bursts = if bench_mode() { 20 } else { 1 };
    let before = alloc_snapshot();
    workload.bursts(publish, delivered, &mut cursor, bursts, PUBLISHES_PER_BURST);
    let allocations = alloc_snapshot().per_op_since(before, bursts * PUBLISHES_PER_BURST as u64);
    measured
        .allocations
        .push((Scenario::Base, name.to_owned(), allocations));

    let mut call_time = CallTime::default();
    group.bench_function(BenchmarkId::new("base", name), |b| {
        b.iter_custom(|iters| {
            let (end_to_end, calls) =
                workload.bursts(publish, delivered, &mut cursor, iters, PUBLISHES_PER_BURST);
            call_time.add(calls, iters * PUBLISHES_PER_BURST as u64);
            end_to_end / PUBLISHES_PER_BURST as u32
        })
    });
    measured
        .call_only
        .push((Scenario::Base, name.to_owned(), call_time.ns_per_publish()));
}

fn base(
    group: &mut criterion::BenchmarkGroup<'_, criterion::measurement::WallTime>,
    measured: &mut Measured,
    rt: &tokio::runtime::Runtime,
) {
    let workload = BusVsMqtt::for_mode();
    let payload = Bytes::from_static(PAYLOAD);
    for setup in SETUPS {
        let bus = setup.build::<Bytes>(rt);
        let delivered = Arc::new(AtomicU64::new(0));
        let _subscriptions = subscribe_all(&bus, &workload.filters, &delivered);
        let mut publish = |k: usize| {
            bus.publish(&workload.topics[k], payload.clone())
                .expect("publish");
        };
        base_runs(
            group,
            measured,
            setup.name,
            &workload,
            &mut publish,
            &delivered,
        );
    }
    let mut broker = Rumqttd::start(workload.filters.len() + 1);
    let delivered = Arc::new(AtomicU64::new(0));
    broker.subscribe_links(&workload.filters, &delivered);
    let mut publisher = broker.publisher();
    let mut publish = |k: usize| publisher.publish(&workload.topic_bytes[k], &payload);
    base_runs(
        group,
        measured,
        RUMQTTD,
        &workload,
        &mut publish,
        &delivered,
    );
}

// ---------------------------------------------------------------- concurrent

/// `rounds` rounds in which every publisher thread publishes `per_thread`
/// messages round-robin over the concurrent topics; each round waits for
/// every delivery (one per publish) before the next. Returns the time until
/// the last delivery of each round (end to end) and until the last publish
/// call of each round returned, summed over the rounds.
fn rounds<P: Send>(
    publishers: &mut [P],
    publish: &(impl Fn(&mut P, usize) + Sync),
    delivered: &AtomicU64,
    rounds: u64,
    per_thread: usize,
) -> (Duration, Duration) {
    let threads = publishers.len();
    let barrier = Barrier::new(threads);
    let first = delivered.load(Ordering::Acquire);
    let per_round = (threads * per_thread) as u64;
    std::thread::scope(|scope| {
        let handles: Vec<_> = publishers
            .iter_mut()
            .enumerate()
            .map(|(thread, publisher)| {
                let barrier = &barrier;
                scope.spawn(move || {
                    let (mut end_to_end, mut calls) = (Duration::ZERO, Duration::ZERO);
                    let mut target = first;
                    let mut counter = 0;
                    for _ in 0..rounds {
                        barrier.wait();
                        let start = Instant::now();
                        for _ in 0..per_thread {
                            publish(publisher, counter % CONCURRENT_TOPICS);
                            counter += 1;
                        }
                        barrier.wait();
                        // Thread 0 keeps the time and holds the others at
                        // the next round's barrier until all is delivered.
                        if thread == 0 {
                            calls += start.elapsed();
                            target += per_round;
                            wait_for(delivered, target);
                            end_to_end += start.elapsed();
                        }
                    }
                    (end_to_end, calls)
                })
            })
            .collect();
        let mut first_thread = (Duration::ZERO, Duration::ZERO);
        for (thread, handle) in handles.into_iter().enumerate() {
            let times = handle.join().expect("publisher thread");
            if thread == 0 {
                first_thread = times;
            }
        }
        first_thread
    })
}

/// The thread sweep, allocations, and criterion runs for one system.
fn concurrent_runs<P: Send>(
    group: &mut criterion::BenchmarkGroup<'_, criterion::measurement::WallTime>,
    measured: &mut Measured,
    name: &str,
    publishers: &mut [P],
    publish: &(impl Fn(&mut P, usize) + Sync),
    delivered: &AtomicU64,
) {
    let per_thread = PUBLISHES_PER_ROUND / PUBLISHERS;
    rounds(
        &mut publishers[..PUBLISHERS],
        publish,
        delivered,
        5,
        per_thread,
    );

    let per_point = if bench_mode() {
        Duration::from_millis(300)
    } else {
        Duration::ZERO
    };
    let mut sweep = Vec::new();
    for threads in THREAD_SWEEP {
        let per_thread = PUBLISHES_PER_ROUND / threads;
        let (mut elapsed, mut count) = (Duration::ZERO, 0u64);
        while count == 0 || elapsed < per_point {
            elapsed += rounds(
                &mut publishers[..threads],
                publish,
                delivered,
                10,
                per_thread,
            )
            .0;
            count += 10 * (threads * per_thread) as u64;
        }
        sweep.push((threads, elapsed.as_nanos() as f64 / count as f64));
    }
    let points: Vec<String> = sweep
        .iter()
        .map(|(t, ns)| format!("{t}: {}", format_ns(*ns)))
        .collect();
    println!(
        "{name:>20}: concurrent, end to end per publish by threads: {}",
        points.join(", ")
    );
    measured.threads.push((name.to_owned(), sweep));

    let round_count = if bench_mode() { 50 } else { 1 };
    let before = alloc_snapshot();
    rounds(
        &mut publishers[..PUBLISHERS],
        publish,
        delivered,
        round_count,
        per_thread,
    );
    let allocations =
        alloc_snapshot().per_op_since(before, round_count * (PUBLISHERS * per_thread) as u64);
    measured
        .allocations
        .push((Scenario::Concurrent, name.to_owned(), allocations));

    let publishers = &mut publishers[..PUBLISHERS];
    let per_round = (PUBLISHERS * per_thread) as u32;
    let mut call_time = CallTime::default();
    group.bench_function(BenchmarkId::new("concurrent", name), |b| {
        b.iter_custom(|iters| {
            let (end_to_end, calls) = rounds(publishers, publish, delivered, iters, per_thread);
            call_time.add(calls, iters * u64::from(per_round));
            end_to_end / per_round
        })
    });
    measured.call_only.push((
        Scenario::Concurrent,
        name.to_owned(),
        call_time.ns_per_publish(),
    ));
}

fn concurrent(
    group: &mut criterion::BenchmarkGroup<'_, criterion::measurement::WallTime>,
    measured: &mut Measured,
    rt: &tokio::runtime::Runtime,
) {
    let topics: Vec<String> = (0..CONCURRENT_TOPICS)
        .map(|i| format!("test/concurrent/{i}"))
        .collect();
    let topic_bytes: Vec<Bytes> = topics.iter().map(|t| Bytes::from(t.clone())).collect();
    let payload = Bytes::from_static(PAYLOAD);
    let max_threads = THREAD_SWEEP.into_iter().max().unwrap_or(1).max(PUBLISHERS);
    for setup in SETUPS {
        let bus = setup.build::<Bytes>(rt);
        let delivered = Arc::new(AtomicU64::new(0));
        let _subscriptions = subscribe_all(&bus, &topics, &delivered);
        let mut publishers = vec![&bus; max_threads];
        let publish = |bus: &mut &Bus<Bytes>, k: usize| {
            bus.publish(&topics[k], payload.clone()).expect("publish");
        };
        concurrent_runs(
            group,
            measured,
            setup.name,
            &mut publishers,
            &publish,
            &delivered,
        );
    }
    let mut broker = Rumqttd::start(CONCURRENT_TOPICS + max_threads);
    let delivered = Arc::new(AtomicU64::new(0));
    broker.subscribe_links(&topics, &delivered);
    let mut publishers: Vec<_> = (0..max_threads).map(|_| broker.publisher()).collect();
    let publish = |publisher: &mut common::rumqttd::Publisher, k: usize| {
        publisher.publish(&topic_bytes[k], &payload);
    };
    concurrent_runs(
        group,
        measured,
        RUMQTTD,
        &mut publishers,
        &publish,
        &delivered,
    );
}

// ---------------------------------------------------------------- subscribe

fn subscribe_runs(
    group: &mut criterion::BenchmarkGroup<'_, criterion::measurement::WallTime>,
    measured: &mut Measured,
    name: &str,
    pairs: &mut impl FnMut(usize),
) {
    pairs(PAIRS_PER_BURST); // warm up
    let bursts = if bench_mode() { 20 } else { 1 };
    let before = alloc_snapshot();
    for _ in 0..bursts {
        pairs(PAIRS_PER_BURST);
    }
    let allocations = alloc_snapshot().per_op_since(before, bursts * PAIRS_PER_BURST as u64);
    measured
        .allocations
        .push((Scenario::Subscribe, name.to_owned(), allocations));
    group.bench_function(BenchmarkId::new("subscribe_unsubscribe", name), |b| {
        b.iter_custom(|iters| {
            let start = Instant::now();
            for _ in 0..iters {
                pairs(PAIRS_PER_BURST);
            }
            start.elapsed() / PAIRS_PER_BURST as u32
        })
    });
}

fn subscribe(
    group: &mut criterion::BenchmarkGroup<'_, criterion::measurement::WallTime>,
    measured: &mut Measured,
    rt: &tokio::runtime::Runtime,
) {
    let names = if bench_mode() { 10_000 } else { 1_000 };
    let filters: Vec<String> = (0..names).map(|i| format!("test/sub/{i}")).collect();
    for setup in SETUPS {
        let bus = setup.build::<Bytes>(rt);
        let mut cursor = 0;
        let mut pairs = |count: usize| {
            for _ in 0..count {
                bus.subscribe(&filters[cursor], |_: &Message<Bytes>| {})
                    .expect("subscribe")
                    .unsubscribe();
                cursor = (cursor + 1) % filters.len();
            }
        };
        subscribe_runs(group, measured, setup.name, &mut pairs);
    }
    let broker = Rumqttd::start(1);
    let mut churn = broker.churn();
    let mut cursor = 0;
    let mut pairs = |count: usize| {
        let end = (cursor + count).min(filters.len());
        churn.pairs(&filters[cursor..end]);
        cursor = end % filters.len();
    };
    // rumqttd creates a log for a filter on its first subscription and keeps
    // it for good; measure the steady state, where every name has one.
    pairs(filters.len());
    subscribe_runs(group, measured, RUMQTTD, &mut pairs);
}

// ---------------------------------------------------------------- report

/// A whole number with thousands separators, as the seed writes them:
/// "1,830".
fn thousands(value: f64) -> String {
    if !value.is_finite() {
        return "–".to_owned();
    }
    let digits = format!("{:.0}", value.abs());
    let mut out = String::new();
    for (i, c) in digits.chars().enumerate() {
        if i > 0 && (digits.len() - i) % 3 == 0 {
            out.push(',');
        }
        out.push(c);
    }
    if value < -0.5 {
        out.insert(0, '-');
    }
    out
}

fn write_report(measured: &Measured) {
    let results = criterion_results("delivery_modes");
    let systems: Vec<&str> = SETUPS.iter().map(|s| s.name).chain([RUMQTTD]).collect();
    if !systems
        .iter()
        .all(|s| results.contains_key(&format!("base/{s}")))
    {
        eprintln!("criterion results for delivery_modes are missing; report not written");
        return;
    }
    let mut report = Report::new(
        "delivery_modes",
        "Delivery modes and rumqttd: seed 001's three tables, end to end",
        &[
            "blazesub",
            "rumqttd",
            "tokio",
            "crossbeam-queue",
            "criterion",
        ],
    );
    let columns: Vec<String> = std::iter::once("".to_owned())
        .chain(systems.iter().map(|s| format!("`{s}`")))
        .collect();
    let columns: Vec<&str> = columns.iter().map(String::as_str).collect();

    let time_row = |label: &str, id: &str| {
        let mut row = vec![label.to_owned()];
        row.extend(systems.iter().map(|s| {
            results
                .get(&format!("{id}/{s}"))
                .map_or("–".into(), |e| format!("{} ns/op", thousands(e.mean_ns)))
        }));
        row
    };
    let interval_row = |id: &str| {
        let mut row = vec!["95% interval".to_owned()];
        row.extend(systems.iter().map(|s| {
            results.get(&format!("{id}/{s}")).map_or("–".into(), |e| {
                format!("{} – {}", format_ns(e.low_ns), format_ns(e.high_ns))
            })
        }));
        row
    };
    let call_row = |label: &str, scenario: Scenario| {
        let mut row = vec![label.to_owned()];
        row.extend(systems.iter().map(|s| {
            measured
                .call_only(scenario, s)
                .map_or("–".into(), |ns| format!("{} ns/op", thousands(ns)))
        }));
        row
    };
    let alloc_rows = |scenario: Scenario, unit: &str| {
        let mut bytes = vec![format!("Memory, end to end (B/{unit})")];
        let mut allocs = vec![format!("Allocations, end to end (allocs/{unit})")];
        for s in &systems {
            let (a, b) = measured
                .allocations(scenario, s)
                .unwrap_or((f64::NAN, f64::NAN));
            bytes.push(format!("{} B/op", thousands(b)));
            allocs.push(format!("{a:.2} allocs/op"));
        }
        [bytes, allocs]
    };

    let mut base = Table::new("Base publishing (single thread)", &columns);
    base.row(time_row("Publishing, end to end", "base"));
    base.row(interval_row("base"));
    base.row(call_row(
        "Publish call only (the seed's measure)",
        Scenario::Base,
    ));
    base.rows.extend(alloc_rows(Scenario::Base, "op"));
    base.note = "BlazeSub's `BenchmarkBusVsMQTT` workload: 4,995 exact subscriptions on 1,000 \
                 topics plus 5 wildcard ones, one thread publishing round-robin over 100 topics \
                 (5.02 subscribers per publish on average), bursts of 1,000 publishes. End to \
                 end: until every subscriber received every message of the burst. Publish call \
                 only: the time spent inside the publish calls during the same criterion \
                 iterations (warm-up included), each burst's deliveries drained untimed before \
                 the next."
        .into();

    let mut parallel = Table::new(
        &format!("Concurrent publishing ({PUBLISHERS} threads)"),
        &columns,
    );
    parallel.row(time_row("Publishing, end to end", "concurrent"));
    parallel.row(interval_row("concurrent"));
    parallel.row(call_row(
        "Publish calls only (the seed's measure)",
        Scenario::Concurrent,
    ));
    parallel.rows.extend(alloc_rows(Scenario::Concurrent, "op"));
    parallel.note = format!(
        "BlazeSub's `BenchmarkBusVsMQTTConcurrent` workload: 100 topics, one subscriber \
         each; {PUBLISHERS} threads publish round-robin over them, in rounds of \
         1,000 publishes in all. ns/op is wall time per publish: end to end, \
         until every message of the round was delivered; calls only (from the same criterion \
         iterations), until every thread's last publish call of the round returned. rumqttd: \
         each thread its own link."
    );

    let mut churn = Table::new("Subscription operations", &columns);
    churn.row(time_row("Subscribe + unsubscribe", "subscribe_unsubscribe"));
    churn.row(interval_row("subscribe_unsubscribe"));
    churn.rows.extend(alloc_rows(Scenario::Subscribe, "pair"));
    churn.note = "BlazeSub's `BenchmarkBusVsMQTTSubscribeUnsubscribe`: on an empty bus, subscribe \
                  a handler to `test/sub/{i}` and unsubscribe it; `i` cycles over 10,000 names. \
                  blazesub: both calls synchronous; every unsubscribe prunes the name from the \
                  trie. rumqttd keeps a log for every filter it has seen; it is measured once \
                  every name has one. rumqttd: SUBSCRIBE and UNSUBSCRIBE back to \
                  back on one local link, bursts of 1,000 pairs, each ending when the router has \
                  acknowledged every request."
        .into();

    let mut sweep_columns = vec!["system".to_owned()];
    sweep_columns.extend(THREAD_SWEEP.iter().map(|&t| match t {
        1 => "1 thread".to_owned(),
        t => format!("{t} threads"),
    }));
    let sweep_columns: Vec<&str> = sweep_columns.iter().map(String::as_str).collect();
    let mut threads = Table::new(
        "Concurrent publishing by publisher threads, end to end (ns per publish)",
        &sweep_columns,
    );
    threads.note = "Same workload; rounds of 1,000 publishes split over the threads; measured \
                    outside criterion, about 0.3 s per point."
        .into();
    let mut chart = Chart {
        file: "delivery_modes-threads".into(),
        title: "Concurrent publishing, end to end".into(),
        x_label: "publisher threads".into(),
        y_label: "ns per publish (wall time)".into(),
        log_x: true,
        log_y: true,
        ..Chart::default()
    };
    for (name, points) in &measured.threads {
        let mut row = vec![format!("`{name}`")];
        row.extend(points.iter().map(|(_, ns)| thousands(*ns)));
        threads.row(row);
        chart.series.push(Series {
            name: name.clone(),
            points: points.iter().map(|&(t, ns)| (t as f64, ns)).collect(),
        });
    }

    report.tables = vec![base, parallel, churn, threads];
    report.charts = vec![chart];
    match report.save() {
        Ok(()) => println!("wrote docs/delivery_modes.md"),
        Err(err) => eprintln!("could not write the report: {err}"),
    }
}

fn main() {
    let mut criterion = Criterion::default()
        .warm_up_time(Duration::from_secs(1))
        .measurement_time(Duration::from_secs(3))
        .sample_size(30)
        .configure_from_args();
    let rt = runtime();
    let mut measured = Measured::default();
    {
        let mut group = criterion.benchmark_group("delivery_modes");
        group.sampling_mode(SamplingMode::Flat);
        base(&mut group, &mut measured, &rt);
        concurrent(&mut group, &mut measured, &rt);
        subscribe(&mut group, &mut measured, &rt);
        group.finish();
    }
    criterion.final_summary();
    if bench_mode() {
        write_report(&measured);
    }
}
