//! blazesub against rumqttd on BlazeSub's broker-comparison workload
//! (`BenchmarkBusVsMQTT` in BlazeSub's `mqtt_comparison_test.go`), end to end.
//!
//! Workload (`common::rumqttd::BusVsMqtt`): 1,000 topics
//! `test/topic/{i}/exact`; 4,995 exact subscriptions, subscription `j` on
//! topic `j % 1000`, plus 5 wildcard ones
//! (`test/+/0/level`, `test/topic/+/level`, `test/topic/0/#`, `test/#`,
//! `+/topic/10/level`); publishes go round-robin over 100 topics, 80 of them
//! `test/topic/{i}/exact` and 20 `test/wildcard/{i % 20}/level`, with the
//! payload `"test message payload"`. On average a publish matches 5.02
//! subscriptions.
//!
//! - `publish/<setup>`: bursts of 1,000 publishes from one thread, each burst
//!   timed until every subscriber has received every message; the figure is
//!   per publish. blazesub runs every mode at its defaults and some tuned
//!   pool configurations; rumqttd runs embedded (see `common/rumqttd.rs`),
//!   each subscription its own local link drained by a reader task.
//! - `pairs/<system>`: subscribe + unsubscribe pairs with the 5,000
//!   subscriptions present, cycling over the 1,000 exact filters, in bursts
//!   of 1,000 pairs; rumqttd's pairs go back to back on one link and a burst
//!   ends when the router has acknowledged all of them.
//!
//! Before each system's criterion runs, a pass measures delivered messages
//! per second at other burst sizes (1, 10, 100, 1,000 publishes: from ping-pong
//! to back to back) and allocations per publish and per pair with the
//! counting allocator. After them it writes `docs/vs_rumqttd.md`.
//!
//! `cargo bench --bench vs_rumqttd`

mod common;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use blazesub::{Bus, DeliveryMode, Message, Subscription};
use bytes::Bytes;
use criterion::{BenchmarkId, Criterion, SamplingMode};

use common::report::{criterion_results, format_ns, Chart, Report, Series, Table};
use common::rumqttd::{BusVsMqtt, Rumqttd, PAYLOAD};
use common::{alloc_snapshot, bench_mode, rss, runtime, CountingAllocator, Setup};

#[global_allocator]
static ALLOCATOR: CountingAllocator = CountingAllocator;

/// Publishes per criterion iteration (one burst, waited for).
const PUBLISHES_PER_BURST: usize = 1_000;
/// Subscribe + unsubscribe pairs per criterion iteration.
const PAIRS_PER_BURST: usize = 1_000;
/// Burst sizes of the sweep, from ping-pong to back to back.
const SWEEP: [usize; 4] = [1, 10, 100, 1_000];

/// Every mode at its defaults, then the pool tuned for this workload.
const SETUPS: [Setup; 6] = [
    Setup::defaults("worker_pool", DeliveryMode::WorkerPool),
    Setup::defaults("task_per_subscriber", DeliveryMode::TaskPerSubscriber),
    Setup::defaults("inline", DeliveryMode::Inline),
    Setup {
        name: "worker_pool_1_worker",
        workers: Some(1),
        ..Setup::defaults("", DeliveryMode::WorkerPool)
    },
    Setup {
        name: "worker_pool_threshold_1",
        threshold: 1,
        ..Setup::defaults("", DeliveryMode::WorkerPool)
    },
    Setup {
        name: "worker_pool_1_worker_threshold_1",
        workers: Some(1),
        threshold: 1,
        ..Setup::defaults("", DeliveryMode::WorkerPool)
    },
];
const RUMQTTD: &str = "rumqttd";

/// What the pass outside criterion measured for one system.
#[derive(Default)]
struct Extra {
    /// (publishes per burst, delivered messages per second)
    sweep: Vec<(usize, f64)>,
    allocs_per_publish: (f64, f64),
    allocs_per_pair: Option<(f64, f64)>,
    /// Peak RSS growth from before the system was built to after its runs.
    rss_peak: Option<u64>,
}

/// Delivered messages per second at each burst size, then allocations per
/// publish at [`PUBLISHES_PER_BURST`].
fn sweep_and_allocations(
    name: &str,
    publish: &mut impl FnMut(usize),
    workload: &BusVsMqtt,
    delivered: &AtomicU64,
) -> Extra {
    let mut extra = Extra::default();
    let mut cursor = 0;
    // Warm up: route caches, pools, rumqttd's logs and buffers.
    workload.bursts(publish, delivered, &mut cursor, 5, PUBLISHES_PER_BURST);
    let per_point = if bench_mode() {
        Duration::from_millis(400)
    } else {
        Duration::ZERO
    };
    for size in SWEEP {
        let before = delivered.load(Ordering::Acquire);
        let mut elapsed = Duration::ZERO;
        let mut count = 0u64;
        while count == 0 || elapsed < per_point {
            let n = (10_000 / size as u64).max(1);
            elapsed += workload.bursts(publish, delivered, &mut cursor, n, size).0;
            count += n;
        }
        let rate = (delivered.load(Ordering::Acquire) - before) as f64 / elapsed.as_secs_f64();
        extra.sweep.push((size, rate));
    }
    let n = if bench_mode() { 20 } else { 1 };
    let before = alloc_snapshot();
    workload.bursts(publish, delivered, &mut cursor, n, PUBLISHES_PER_BURST);
    extra.allocs_per_publish =
        alloc_snapshot().per_op_since(before, n * PUBLISHES_PER_BURST as u64);
    let rates: Vec<String> = extra
        .sweep
        .iter()
        .map(|(size, rate)| format!("{size}: {:.0}k/s", rate / 1e3))
        .collect();
    println!(
        "{name:>24}: delivered by burst size {}; {:.2} allocations, {:.0} bytes per publish",
        rates.join(", "),
        extra.allocs_per_publish.0,
        extra.allocs_per_publish.1
    );
    extra
}

/// A blazesub bus with the workload's subscriptions, each counting into
/// `delivered`.
fn subscribe_all(
    bus: &Bus<Bytes>,
    workload: &BusVsMqtt,
    delivered: &Arc<AtomicU64>,
) -> Vec<Subscription> {
    workload
        .filters
        .iter()
        .map(|filter| {
            let delivered = Arc::clone(delivered);
            bus.subscribe(filter, move |_: &Message<Bytes>| {
                delivered.fetch_add(1, Ordering::Relaxed);
            })
            .expect("subscribe")
        })
        .collect()
}

/// `count` subscribe + unsubscribe pairs on a blazesub bus, continuing from
/// `cursor` over the exact filters.
fn bus_pairs(bus: &Bus<Bytes>, workload: &BusVsMqtt, cursor: &mut usize, count: usize) {
    for _ in 0..count {
        let filter = &workload.exact[*cursor];
        *cursor = (*cursor + 1) % workload.exact.len();
        bus.subscribe(filter, |_: &Message<Bytes>| {})
            .expect("subscribe")
            .unsubscribe();
    }
}

fn allocations_per_pair(pairs: &mut impl FnMut(usize)) -> (f64, f64) {
    let bursts = if bench_mode() { 20 } else { 1 };
    pairs(PAIRS_PER_BURST); // warm up
    let before = alloc_snapshot();
    for _ in 0..bursts {
        pairs(PAIRS_PER_BURST);
    }
    alloc_snapshot().per_op_since(before, bursts * PAIRS_PER_BURST as u64)
}

fn bench(c: &mut Criterion, workload: &BusVsMqtt) -> Vec<(String, Extra)> {
    let rt = runtime();
    let payload = Bytes::from_static(PAYLOAD);
    let mut extras = Vec::new();
    let mut group = c.benchmark_group("vs_rumqttd");
    group.sampling_mode(SamplingMode::Flat);

    for setup in SETUPS {
        let window = rss::Window::start();
        let bus = setup.build::<Bytes>(&rt);
        let delivered = Arc::new(AtomicU64::new(0));
        let _subscriptions = subscribe_all(&bus, workload, &delivered);
        let mut publish = |k: usize| {
            bus.publish(&workload.topics[k], payload.clone())
                .expect("publish");
        };
        let mut extra = sweep_and_allocations(setup.name, &mut publish, workload, &delivered);
        let mut cursor = 0;
        group.bench_function(BenchmarkId::new("publish", setup.name), |b| {
            b.iter_custom(|iters| {
                let (end_to_end, _) = workload.bursts(
                    &mut publish,
                    &delivered,
                    &mut cursor,
                    iters,
                    PUBLISHES_PER_BURST,
                );
                end_to_end / PUBLISHES_PER_BURST as u32
            })
        });
        if setup.name == SETUPS[0].name {
            let mut cursor = 0;
            let mut pairs = |n: usize| bus_pairs(&bus, workload, &mut cursor, n);
            extra.allocs_per_pair = Some(allocations_per_pair(&mut pairs));
            group.bench_function(BenchmarkId::new("pairs", "blazesub"), |b| {
                b.iter_custom(|iters| {
                    let start = Instant::now();
                    for _ in 0..iters {
                        pairs(PAIRS_PER_BURST);
                    }
                    start.elapsed() / PAIRS_PER_BURST as u32
                })
            });
        }
        extra.rss_peak = window.peak_growth();
        extras.push((setup.name.to_owned(), extra));
    }

    let window = rss::Window::start();
    let started = Instant::now();
    let mut broker = Rumqttd::start(workload.filters.len() + 2);
    let delivered = Arc::new(AtomicU64::new(0));
    broker.subscribe_links(&workload.filters, &delivered);
    println!(
        "rumqttd: {} links subscribed in {:.2?}",
        workload.filters.len(),
        started.elapsed()
    );
    let mut publisher = broker.publisher();
    let mut publish = |k: usize| publisher.publish(&workload.topic_bytes[k], &payload);
    let mut extra = sweep_and_allocations(RUMQTTD, &mut publish, workload, &delivered);
    let mut cursor = 0;
    group.bench_function(BenchmarkId::new("publish", RUMQTTD), |b| {
        b.iter_custom(|iters| {
            let (end_to_end, _) = workload.bursts(
                &mut publish,
                &delivered,
                &mut cursor,
                iters,
                PUBLISHES_PER_BURST,
            );
            end_to_end / PUBLISHES_PER_BURST as u32
        })
    });
    let mut churn = broker.churn();
    let mut cursor = 0;
    let mut pairs = |n: usize| {
        let end = (cursor + n).min(workload.exact.len());
        churn.pairs(&workload.exact[cursor..end]);
        cursor = end % workload.exact.len();
    };
    extra.allocs_per_pair = Some(allocations_per_pair(&mut pairs));
    group.bench_function(BenchmarkId::new("pairs", RUMQTTD), |b| {
        b.iter_custom(|iters| {
            let start = Instant::now();
            for _ in 0..iters {
                pairs(PAIRS_PER_BURST);
            }
            start.elapsed() / PAIRS_PER_BURST as u32
        })
    });
    extra.rss_peak = window.peak_growth();
    extras.push((RUMQTTD.to_owned(), extra));
    group.finish();
    extras
}

fn write_report(workload: &BusVsMqtt, extras: &[(String, Extra)]) {
    let results = criterion_results("vs_rumqttd");
    let per_publish = workload.deliveries_per_publish();
    let publish = |name: &str| results.get(&format!("publish/{name}")).copied();
    let pairs = |name: &str| results.get(&format!("pairs/{name}")).copied();
    let extra = |name: &str| extras.iter().find(|(n, _)| n == name).map(|(_, e)| e);
    let (Some(rumqttd), Some(rumqttd_pairs)) = (publish(RUMQTTD), pairs(RUMQTTD)) else {
        eprintln!("no criterion results for vs_rumqttd/*/rumqttd; report not written");
        return;
    };
    let delivered_per_s = |ns: f64| per_publish * 1e9 / ns;
    let rumqttd_rate = delivered_per_s(rumqttd.mean_ns);

    let mut report = Report::new(
        "vs_rumqttd",
        "blazesub vs rumqttd: BlazeSub's broker-comparison workload, end to end",
        &["blazesub", "rumqttd", "tokio", "criterion"],
    );

    let mut throughput = Table::new(
        "Delivered messages per second, end to end",
        &[
            "setup",
            "time per publish",
            "95% interval",
            "publishes/s",
            "delivered/s",
            "× rumqttd",
            "allocations / publish",
            "bytes / publish",
            "peak RSS growth",
        ],
    );
    throughput.note = format!(
        "One thread publishes bursts of 1,000 messages round-robin over the 100 \
         topics; each burst is timed until every subscriber received every message \
         ({per_publish:.2} deliveries per publish on average). Allocations are counted on every \
         thread, end to end, over 20 bursts. Peak RSS growth: from just before the system was \
         built (bus or broker, subscriptions, links) to the end of its runs."
    );
    let mut best: Option<(&str, f64)> = None;
    for name in SETUPS.iter().map(|s| s.name).chain([RUMQTTD]) {
        let Some(e) = publish(name) else { continue };
        let rate = delivered_per_s(e.mean_ns);
        if name != RUMQTTD && best.is_none_or(|(_, r)| rate > r) {
            best = Some((name, rate));
        }
        let (allocs, bytes) = extra(name).map_or((f64::NAN, f64::NAN), |x| x.allocs_per_publish);
        throughput.row(vec![
            format!("`{name}`"),
            format_ns(e.mean_ns),
            format!("{} – {}", format_ns(e.low_ns), format_ns(e.high_ns)),
            format!("{:.0}k", 1e6 / e.mean_ns),
            format!("{:.2}M", rate / 1e6),
            format!("{:.1}×", rate / rumqttd_rate),
            format!("{allocs:.2}"),
            format!("{bytes:.0}"),
            rss::format_mb(extra(name).and_then(|x| x.rss_peak)),
        ]);
    }

    let mut churn = Table::new(
        "Subscribe + unsubscribe pairs with 5,000 subscriptions present",
        &[
            "system",
            "time per pair",
            "95% interval",
            "pairs/s",
            "× rumqttd",
            "allocations / pair",
            "bytes / pair",
        ],
    );
    churn.note = "Pairs cycle over the 1,000 exact filters, in bursts of 1,000. blazesub: \
         `subscribe` then `unsubscribe` on the default bus (`worker_pool`); both calls are \
         synchronous. rumqttd: SUBSCRIBE and UNSUBSCRIBE sent back to back on one local link; a \
         burst ends when the router has acknowledged all of them."
        .into();
    let pair_rows = [("blazesub", SETUPS[0].name), (RUMQTTD, RUMQTTD)];
    for (system, extra_name) in pair_rows {
        let Some(e) = pairs(system) else { continue };
        let (allocs, bytes) = extra(extra_name)
            .and_then(|x| x.allocs_per_pair)
            .unwrap_or((f64::NAN, f64::NAN));
        churn.row(vec![
            format!("`{system}`"),
            format_ns(e.mean_ns),
            format!("{} – {}", format_ns(e.low_ns), format_ns(e.high_ns)),
            format!("{:.0}k", 1e6 / e.mean_ns),
            format!("{:.1}×", rumqttd_pairs.mean_ns / e.mean_ns),
            format!("{allocs:.1}"),
            format!("{bytes:.0}"),
        ]);
    }

    let mut targets = Table::new(
        "Targets (issue 3), ratios from this run",
        &["target", "measured", "met"],
    );
    let met = |ok: bool| if ok { "yes" } else { "**no**" }.to_owned();
    if let Some((name, rate)) = best {
        let ratio = rate / rumqttd_rate;
        targets.row(vec![
            "delivered/s, best mode ≥ 15× rumqttd".into(),
            format!("{ratio:.1}× (`{name}`)"),
            met(ratio >= 15.0),
        ]);
    }
    if let Some(e) = publish(SETUPS[0].name) {
        let ratio = delivered_per_s(e.mean_ns) / rumqttd_rate;
        targets.row(vec![
            "delivered/s, default settings ≥ 4× rumqttd".into(),
            format!("{ratio:.1}× (`{}`)", SETUPS[0].name),
            met(ratio >= 4.0),
        ]);
    }
    if let Some(e) = pairs("blazesub") {
        let ratio = rumqttd_pairs.mean_ns / e.mean_ns;
        targets.row(vec![
            "subscribe + unsubscribe ≥ 3× rumqttd".into(),
            format!("{ratio:.1}×"),
            met(ratio >= 3.0),
        ]);
        let rate = 1e9 / e.mean_ns;
        targets.row(vec![
            "subscribe + unsubscribe ≥ 2,000,000 pairs/s".into(),
            format!("{:.2}M pairs/s", rate / 1e6),
            met(rate >= 2e6),
        ]);
    }

    let mut sweep = Table::new(
        "Delivered messages per second by burst size",
        &std::iter::once("setup")
            .chain(SWEEP.iter().map(|s| match s {
                1 => "1 (ping-pong)",
                10 => "10",
                100 => "100",
                _ => "1,000",
            }))
            .collect::<Vec<_>>(),
    );
    sweep.note = "Publishes per burst, each burst waited for before the next; measured outside \
                  criterion (about 0.4 s per point) just before the system's criterion run."
        .into();
    let mut chart = Chart {
        file: "vs_rumqttd-bursts".into(),
        title: "Delivered messages per second vs publishes per burst".into(),
        x_label: "publishes per burst (each waited for)".into(),
        y_label: "delivered messages per second".into(),
        log_x: true,
        log_y: true,
        ..Chart::default()
    };
    for (name, extra) in extras {
        let mut row = vec![format!("`{name}`")];
        row.extend(
            extra
                .sweep
                .iter()
                .map(|(_, rate)| format!("{:.2}M", rate / 1e6)),
        );
        sweep.row(row);
        chart.series.push(Series {
            name: name.clone(),
            points: extra
                .sweep
                .iter()
                .map(|&(size, rate)| (size as f64, rate))
                .collect(),
        });
    }

    report.tables = vec![targets, throughput, churn, sweep];
    report.charts = vec![chart];
    match report.save() {
        Ok(()) => println!("wrote docs/vs_rumqttd.md"),
        Err(err) => eprintln!("could not write the report: {err}"),
    }
}

fn main() {
    // Test mode (`cargo test --benches`, a debug build) runs every path once
    // on a tenth of the workload.
    let workload = BusVsMqtt::for_mode();
    let mut criterion = Criterion::default()
        .warm_up_time(Duration::from_secs(1))
        .measurement_time(Duration::from_secs(3))
        .sample_size(30)
        .configure_from_args();
    let extras = bench(&mut criterion, &workload);
    criterion.final_summary();
    if bench_mode() {
        write_report(&workload, &extras);
    }
}
