//! The threshold cliff (seed `000`, BlazeSub's `MaxConcurrentSubscriptions`
//! guide), end to end: one topic, 1,000 subscribers whose handler adds one to
//! a shared `AtomicU64`, 12-byte payloads, and the threshold
//! `T = max_concurrent_subscriptions` swept over 1 … 2,000.
//!
//! For `WorkerPool` and `TaskPerSubscriber`, each with `Batch::Single`
//! (BlazeSub's policy: one job per subscriber while `n <= T`, one job for all
//! above) and `Batch::Chunked` (the default: claimed units), every `T` is one
//! criterion benchmark `cliff/<setup>/<T>`. `Inline` ignores the threshold and
//! is measured once (`cliff/inline`) as a reference line. Each iteration
//! publishes a burst of 100 messages and stops the clock only when every
//! handler has run for every message; the figure is per publish.
//!
//! Before the criterion groups, the bench counts allocations and bytes per
//! publish at every point with a counting global allocator (the seed reports
//! B/op and allocs/op), outside the timed loop. After them it writes
//! `docs/cliff.md` (tables, the cliff ratios, charts; see
//! `common/report.rs`).
//!
//! Last, the **service setting** (`common/service.rs`): the default mode at
//! every threshold with the publisher a task on a 2-worker tokio runtime,
//! bursts of 10,000 publishes, 5 repetitions alternating between thresholds;
//! the table gives each threshold's median and spread, and the slowest
//! threshold's median over the fastest's (the cliff a service would see).
//! With `BLAZESUB_PLACEMENT=1` it also prints, per repetition, which threads
//! ran and how long each waited for a core (`common/placement.rs`): a bus
//! slower than its siblings shows whether its pool shared the topic's work
//! between two workers or had a worker kept off a core.
//!
//! `cargo bench --bench cliff`

mod common;

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use blazesub::{Batch, Bus, DeliveryMode};
use criterion::{criterion_group, BenchmarkId, Criterion};

use common::report::{criterion_results, format_ns, Chart, Estimate, Report, Series, Table};
use common::{
    alloc_snapshot, bench_mode, counting_subscribers, runtime, time_bursts, wait_for,
    CountingAllocator, Payload, Setup, BURST,
};
use common::{placement, service};

#[global_allocator]
static ALLOCATOR: CountingAllocator = CountingAllocator;

const GROUP: &str = "cliff";
const TOPIC: &str = "bench/cliff";
const SUBSCRIBERS: usize = 1_000;
const PAYLOAD: Payload = *b"twelve bytes";

/// The seed's thresholds.
const THRESHOLDS: [usize; 11] = [1, 5, 10, 25, 50, 100, 300, 500, 750, 1_000, 2_000];

/// The two threaded modes with both batch policies; `threshold` is set per
/// point.
const SETUPS: [Setup; 4] = [
    Setup {
        name: "worker_pool_chunked",
        ..Setup::defaults("", DeliveryMode::WorkerPool)
    },
    Setup {
        name: "worker_pool_single",
        batch: Batch::Single,
        ..Setup::defaults("", DeliveryMode::WorkerPool)
    },
    Setup {
        name: "task_per_subscriber_chunked",
        ..Setup::defaults("", DeliveryMode::TaskPerSubscriber)
    },
    Setup {
        name: "task_per_subscriber_single",
        batch: Batch::Single,
        ..Setup::defaults("", DeliveryMode::TaskPerSubscriber)
    },
];

/// The reference line: the threshold does not apply to `Inline`.
const INLINE: Setup = Setup::defaults("inline", DeliveryMode::Inline);

/// The target for `Batch::Chunked` (issue 3): worst `T` within this factor of
/// the best.
const CHUNKED_TARGET: f64 = 1.5;

/// The seed's figures (Go `ns/op`, its machine) and BlazeSub measured here
/// end to end (issue 3), for the side-by-side table.
struct SeedRow {
    source: &'static str,
    below: &'static str,
    at_or_above: &'static str,
    ratio: &'static str,
    allocs: &'static str,
    bytes: &'static str,
}

const SEED: [SeedRow; 3] = [
    SeedRow {
        source: "BlazeSub worker pool (seed `000`, Go ns/op)",
        below: "10,000–11,000 ns",
        at_or_above: "345,000–347,000 ns",
        ratio: "34×",
        allocs: "2 → 1,002",
        bytes: "~115 → ~24,000",
    },
    SeedRow {
        source: "BlazeSub direct goroutines (seed `000`, Go ns/op)",
        below: "9,600–11,200 ns",
        at_or_above: "~164,000 ns",
        ratio: "17×",
        allocs: "2 → 2,001",
        bytes: "112–256 → ~40,000",
    },
    SeedRow {
        source: "BlazeSub on this machine, end to end (issue 3)",
        below: "~16 µs",
        at_or_above: "~1,000–1,600 µs",
        ratio: "~60–100×",
        allocs: "—",
        bytes: "—",
    },
];

fn with_threshold(setup: &Setup, threshold: usize) -> Setup {
    Setup {
        threshold,
        ..*setup
    }
}

fn cliff(c: &mut Criterion) {
    let rt = runtime();
    let mut group = c.benchmark_group(GROUP);

    for setup in &SETUPS {
        for threshold in THRESHOLDS {
            let bus = with_threshold(setup, threshold).build::<Payload>(&rt);
            let (counter, _subscriptions) = counting_subscribers(&bus, TOPIC, SUBSCRIBERS);
            group.bench_function(BenchmarkId::new(setup.name, threshold), |b| {
                b.iter_custom(|iters| {
                    time_bursts(&bus, TOPIC, &PAYLOAD, &counter, SUBSCRIBERS as u64, iters)
                })
            });
        }
    }

    let bus = INLINE.build::<Payload>(&rt);
    let (counter, _subscriptions) = counting_subscribers(&bus, TOPIC, SUBSCRIBERS);
    group.bench_function(INLINE.name, |b| {
        b.iter_custom(|iters| {
            time_bursts(&bus, TOPIC, &PAYLOAD, &counter, SUBSCRIBERS as u64, iters)
        })
    });
    group.finish();
}

/// Allocations and bytes per publish at one point, and how many units of
/// work per publish the publisher ran itself (`Overflow::Wait`, when the
/// task cap was full).
#[derive(Clone, Copy, Debug, Default)]
struct Allocs {
    allocations: f64,
    bytes: f64,
    caller_runs: f64,
}

/// Publishes `publishes` messages in bursts of [`BURST`] (as the timed loop
/// does), waiting after each burst until every handler ran.
fn publish_in_bursts(bus: &Bus<Payload>, counter: &AtomicU64, publishes: u64) {
    let burst = BURST.min(publishes);
    let mut target = counter.load(Ordering::Acquire);
    let mut left = publishes;
    while left > 0 {
        let n = burst.min(left);
        for _ in 0..n {
            bus.publish(TOPIC, PAYLOAD).expect("publish");
        }
        target += n * SUBSCRIBERS as u64;
        wait_for(counter, target);
        left -= n;
    }
}

fn allocations_at(setup: &Setup, publishes: u64) -> Allocs {
    let rt = runtime();
    let bus = setup.build::<Payload>(&rt);
    let (counter, _subscriptions) = counting_subscribers(&bus, TOPIC, SUBSCRIBERS);
    // Warm the route cache, the pool and the runtime.
    publish_in_bursts(&bus, &counter, 10);
    let caller_runs_before = bus.stats().caller_runs;
    let before = alloc_snapshot();
    publish_in_bursts(&bus, &counter, publishes);
    let (allocations, bytes) = alloc_snapshot().per_op_since(before, publishes);
    Allocs {
        allocations,
        bytes,
        caller_runs: (bus.stats().caller_runs - caller_runs_before) as f64 / publishes as f64,
    }
}

/// Allocations per publish for every setup and threshold, keyed like the
/// criterion results (`<setup>/<T>`, and `inline`).
fn allocations_per_publish() -> BTreeMap<String, Allocs> {
    let publishes: u64 = if bench_mode() { 1_000 } else { 20 };
    let mut out = BTreeMap::new();
    for setup in &SETUPS {
        for threshold in THRESHOLDS {
            let allocs = allocations_at(&with_threshold(setup, threshold), publishes);
            println!(
                "{:>28} T = {threshold:>4}: {:>8.2} allocations, {:>8.0} bytes, {:>6.1} units run by the publisher per publish",
                setup.name, allocs.allocations, allocs.bytes, allocs.caller_runs
            );
            out.insert(format!("{}/{threshold}", setup.name), allocs);
        }
    }
    let allocs = allocations_at(&INLINE, publishes);
    println!(
        "{:>28}         : {:>8.2} allocations, {:>8.0} bytes per publish",
        INLINE.name, allocs.allocations, allocs.bytes
    );
    out.insert(INLINE.name.to_owned(), allocs);
    out
}

/// A table with one row per threshold and one column per setup.
fn grid(title: &str, cell: impl Fn(&Setup, usize) -> String) -> Table {
    let mut columns = vec!["T"];
    columns.extend(SETUPS.iter().map(|s| s.name));
    let mut table = Table::new(title, &columns);
    for threshold in THRESHOLDS {
        let mut row = vec![threshold.to_string()];
        row.extend(SETUPS.iter().map(|setup| cell(setup, threshold)));
        table.row(row);
    }
    table
}

/// One setup's times by threshold, in the order of [`THRESHOLDS`].
fn series_of(results: &BTreeMap<String, Estimate>, setup: &str) -> Vec<(usize, f64)> {
    THRESHOLDS
        .iter()
        .filter_map(|&t| results.get(&format!("{setup}/{t}")).map(|e| (t, e.mean_ns)))
        .collect()
}

fn best(points: &[(usize, f64)]) -> Option<(usize, f64)> {
    points.iter().copied().min_by(|a, b| a.1.total_cmp(&b.1))
}

fn worst(points: &[(usize, f64)]) -> Option<(usize, f64)> {
    points.iter().copied().max_by(|a, b| a.1.total_cmp(&b.1))
}

/// "a–b" over the values, formatted with `f`.
fn range(values: &[f64], f: impl Fn(f64) -> String) -> String {
    let lo = values.iter().copied().fold(f64::MAX, f64::min);
    let hi = values.iter().copied().fold(f64::MIN, f64::max);
    if values.is_empty() {
        "—".into()
    } else if f(lo) == f(hi) {
        f(lo)
    } else {
        format!("{}–{}", f(lo), f(hi))
    }
}

/// A ratio measured by alternating buses, with its quartiles.
#[derive(Clone, Copy, Debug)]
struct Ratio {
    median: f64,
    low: f64,
    high: f64,
}

impl Ratio {
    fn of(mut samples: Vec<f64>) -> Self {
        samples.sort_by(f64::total_cmp);
        let n = samples.len();
        Self {
            median: samples[n / 2],
            low: samples[n / 4],
            high: samples[3 * n / 4],
        }
    }
}

/// For each setup, how much slower a publish is at T = 1,000 and T = 2,000
/// than at T = 10, measured by rotating through three buses (one per T) for
/// many rounds and keeping the median of the per-round ratios. Criterion
/// times the eleven thresholds minutes apart, and on this shared machine
/// identical plans differed by up to 50% between them; the rotation cancels
/// that drift. Each bus runs one untimed burst before its timed ones.
fn across_the_threshold() -> Vec<(&'static str, Ratio, Ratio)> {
    const ROUNDS: usize = 31;
    const BURSTS: u64 = 3;
    let rt = runtime();
    SETUPS
        .iter()
        .map(|setup| {
            let buses: Vec<_> = [10, SUBSCRIBERS, 2 * SUBSCRIBERS]
                .into_iter()
                .map(|threshold| {
                    let bus = with_threshold(setup, threshold).build::<Payload>(&rt);
                    let (counter, subscriptions) = counting_subscribers(&bus, TOPIC, SUBSCRIBERS);
                    (bus, counter, subscriptions)
                })
                .collect();
            let mut at_n = Vec::with_capacity(ROUNDS);
            let mut above_n = Vec::with_capacity(ROUNDS);
            for _ in 0..ROUNDS {
                let times: Vec<f64> = buses
                    .iter()
                    .map(|(bus, counter, _)| {
                        time_bursts(bus, TOPIC, &PAYLOAD, counter, SUBSCRIBERS as u64, 1);
                        time_bursts(bus, TOPIC, &PAYLOAD, counter, SUBSCRIBERS as u64, BURSTS)
                            .as_secs_f64()
                    })
                    .collect();
                at_n.push(times[1] / times[0]);
                above_n.push(times[2] / times[0]);
            }
            let (at_n, above_n) = (Ratio::of(at_n), Ratio::of(above_n));
            println!(
                "{:>28}: T = 1,000 is {:.2}× T = 10, T = 2,000 is {:.2}× (interleaved medians)",
                setup.name, at_n.median, above_n.median
            );
            (setup.name, at_n, above_n)
        })
        .collect()
}

/// One threshold of the default mode in the service setting: median,
/// fastest and slowest ns per publish over the repetitions.
struct ServicePoint {
    threshold: usize,
    median: f64,
    fastest: f64,
    slowest: f64,
}

/// The default mode (and `Inline`, threshold 0 here) in the service setting.
fn service_thresholds() -> (Vec<ServicePoint>, f64) {
    let (repetitions, publishes) = if bench_mode() { (5, 10_000) } else { (1, 100) };
    let rt = runtime();
    let mut points: Vec<_> = THRESHOLDS
        .iter()
        .map(|&threshold| {
            let bus = with_threshold(&SETUPS[0], threshold).build::<u64>(&rt);
            let workload = service::shared_counter(&bus, TOPIC, SUBSCRIBERS);
            (threshold, bus, vec![workload], Vec::new())
        })
        .collect();
    let inline_bus = INLINE.build::<u64>(&rt);
    let mut inline = (
        vec![service::shared_counter(&inline_bus, TOPIC, SUBSCRIBERS)],
        Vec::new(),
    );
    for (_, bus, workloads, _) in &mut points {
        service::burst(&rt, bus, workloads, publishes);
    }
    service::burst(&rt, &inline_bus, &mut inline.0, publishes);
    for _ in 0..repetitions {
        for (threshold, bus, workloads, samples) in &mut points {
            let before = placement::ThreadTimes::now();
            let time = service::burst(&rt, bus, workloads, publishes);
            let ns = time.as_nanos() as f64 / publishes as f64;
            samples.push(ns);
            if let (Some(before), Some(after)) = (before, placement::ThreadTimes::now()) {
                println!(
                    "service, T = {threshold:>5}: {ns:.0} ns/publish; {}",
                    after.since(&before)
                );
            }
        }
        let time = service::burst(&rt, &inline_bus, &mut inline.0, publishes);
        inline.1.push(time.as_nanos() as f64 / publishes as f64);
    }
    let points: Vec<ServicePoint> = points
        .into_iter()
        .map(|(threshold, _, _, samples)| {
            let (median, fastest, slowest) = service::spread(&samples);
            println!(
                "service, default mode, T = {threshold:>5}: median {median:.0} ns/publish, \
                 repetitions {fastest:.0}–{slowest:.0} (in order: {})",
                service::in_order(&samples)
            );
            ServicePoint {
                threshold,
                median,
                fastest,
                slowest,
            }
        })
        .collect();
    let (inline_median, _, _) = service::spread(&inline.1);
    let medians: Vec<f64> = points.iter().map(|p| p.median).collect();
    let worst = medians.iter().copied().fold(f64::MIN, f64::max);
    let best = medians.iter().copied().fold(f64::MAX, f64::min);
    println!(
        "service, default mode: slowest threshold {:.2}× the fastest; inline {inline_median:.0} ns/publish",
        worst / best
    );
    (points, inline_median)
}

fn write_report(
    allocations: &BTreeMap<String, Allocs>,
    interleaved: &[(&'static str, Ratio, Ratio)],
    service_points: &[ServicePoint],
    service_inline: f64,
) {
    let results = criterion_results(GROUP);
    if results.is_empty() {
        eprintln!("no criterion results for {GROUP}; report not written");
        return;
    }
    let mut report = Report::new(
        "cliff",
        "The threshold cliff: 1,000 subscribers, T = 1 … 2,000",
        &["blazesub", "tokio", "crossbeam-queue", "criterion"],
    );
    let inline = results.get(INLINE.name).map(|e| e.mean_ns);
    let inline_allocs = allocations.get(INLINE.name).copied();

    // Time per publish, T × setup.
    let mut times = grid(
        "Time per publish until all 1,000 handlers ran",
        |setup, threshold| {
            results
                .get(&format!("{}/{threshold}", setup.name))
                .map_or("—".into(), |e| format_ns(e.mean_ns))
        },
    );
    times.note = format!(
        "Criterion's estimate per publish (a burst of 100 publishes, timed until every \
         handler ran, divided by 100). Handlers add one to a shared `AtomicU64`; 12-byte \
         payloads; `workers` = available parallelism. `inline` ignores the threshold: {}.",
        inline.map_or("not measured".into(), format_ns)
    );

    // Allocations and bytes per publish, T × setup.
    let alloc_cell = |setup: &Setup, threshold: usize| {
        allocations
            .get(&format!("{}/{threshold}", setup.name))
            .copied()
    };
    let mut allocs = grid(
        "Allocations and bytes per publish, end to end",
        |setup, threshold| {
            alloc_cell(setup, threshold).map_or("—".into(), |a| {
                format!("{:.2} / {:.0} B", a.allocations, a.bytes)
            })
        },
    );
    allocs.note = format!(
        "Each cell: allocations / bytes per publish, counted by a global allocator on every \
         thread over 1,000 publishes (in bursts of 100, each waited for) after a warm-up. \
         `inline`: {}.",
        inline_allocs.map_or("not measured".into(), |a| format!(
            "{:.2} / {:.0} B",
            a.allocations, a.bytes
        ))
    );

    // Where the cap or the queue pushed work back onto the publisher.
    let mut caller = grid(
        "Units of work the publisher ran itself, per publish",
        |setup, threshold| {
            alloc_cell(setup, threshold).map_or("—".into(), |a| format!("{:.1}", a.caller_runs))
        },
    );
    caller.note = "Counted in the allocation pass (`stats().caller_runs` / publishes). \
                   Under `Overflow::Wait` (the default) the publisher waits when the \
                   pool's queue (4,096 jobs) is full, and runs a unit itself when \
                   `max_inflight_tasks` (1,024) tasks are alive. With `Batch::Single` at \
                   T ≥ 1,000 a publish is 1,000 units, so a burst of 100 publishes \
                   overflows both."
        .into();

    // The ratios the issue sets targets for.
    let mut ratios = Table::new(
        "Cliff ratios",
        &[
            "setup",
            "best",
            "worst",
            "worst ÷ best",
            "T ≥ 1,000 ÷ best T < 1,000",
            "target",
        ],
    );
    for setup in &SETUPS {
        let points = series_of(&results, setup.name);
        let (Some(b), Some(w)) = (best(&points), worst(&points)) else {
            continue;
        };
        let below: Vec<(usize, f64)> = points
            .iter()
            .copied()
            .filter(|&(t, _)| t < SUBSCRIBERS)
            .collect();
        let above: Vec<f64> = points
            .iter()
            .filter(|&&(t, _)| t >= SUBSCRIBERS)
            .map(|&(_, ns)| ns)
            .collect();
        let cliff = best(&below).map_or("—".into(), |(_, best_below)| {
            range(
                &above.iter().map(|ns| ns / best_below).collect::<Vec<_>>(),
                |r| format!("{r:.1}×"),
            )
        });
        let ratio = w.1 / b.1;
        let target = if setup.batch == Batch::Chunked {
            let verdict = if ratio <= CHUNKED_TARGET {
                "met"
            } else {
                "**missed**"
            };
            format!("worst ≤ {CHUNKED_TARGET}× best: {verdict}")
        } else {
            "reproduce the cliff (seed: 17–34×)".into()
        };
        ratios.row(vec![
            format!("`{}`", setup.name),
            format!("{} (T = {})", format_ns(b.1), b.0),
            format!("{} (T = {})", format_ns(w.1), w.0),
            format!("{ratio:.2}×"),
            cliff,
            target,
        ]);
    }
    ratios.note = "Best and worst over every T of criterion's results. The last ratio \
                   column divides each result at T ≥ 1,000 (at or above the subscriber \
                   count) by the best result below it. Below 1,000 every T gives the same \
                   plan (the publish is above the threshold), so differences among \
                   T < 1,000 are run-to-run noise, which the best/worst ratio picks up as \
                   well; the next table measures the step across the threshold without it."
        .into();

    // The same step, measured with the drift cancelled.
    let mut rotated = Table::new(
        "Across the threshold, buses measured in rotation",
        &[
            "setup",
            "T = 1,000 ÷ T = 10 (median, quartiles)",
            "T = 2,000 ÷ T = 10 (median, quartiles)",
            "target",
        ],
    );
    for (name, at_n, above_n) in interleaved {
        let chunked = name.ends_with("chunked");
        let worst = at_n.median.max(above_n.median);
        let target = if chunked {
            let verdict = if worst <= CHUNKED_TARGET {
                "met"
            } else {
                "**missed**"
            };
            format!("≤ {CHUNKED_TARGET}×: {verdict}")
        } else {
            "reproduce the cliff".into()
        };
        let cell = |r: &Ratio| format!("{:.2}× ({:.2}–{:.2})", r.median, r.low, r.high);
        rotated.row(vec![format!("`{name}`"), cell(at_n), cell(above_n), target]);
    }
    rotated.note = "Three buses per setup (T = 10, 1,000, 2,000; 1,000 subscribers), timed \
                    in rotation for 31 rounds of 300 publishes each (after an untimed burst \
                    per bus per round); each cell is the median of the per-round ratios, \
                    with its quartiles. T = 10 stands for every T < 1,000: the plan is the \
                    same for all of them."
        .into();

    // Beside the seed.
    let mut seed = Table::new(
        "Beside the seed",
        &[
            "source",
            "T < 1,000",
            "T ≥ 1,000",
            "T ≥ 1,000 ÷ best below",
            "allocations / op (below → at or above)",
            "B / op (below → at or above)",
        ],
    );
    for row in &SEED {
        seed.row(vec![
            row.source.into(),
            row.below.into(),
            row.at_or_above.into(),
            row.ratio.into(),
            row.allocs.into(),
            row.bytes.into(),
        ]);
    }
    for setup in &SETUPS {
        let points = series_of(&results, setup.name);
        let below: Vec<f64> = points
            .iter()
            .filter(|&&(t, _)| t < SUBSCRIBERS)
            .map(|&(_, ns)| ns)
            .collect();
        let above: Vec<f64> = points
            .iter()
            .filter(|&&(t, _)| t >= SUBSCRIBERS)
            .map(|&(_, ns)| ns)
            .collect();
        let best_below = below.iter().copied().fold(f64::MAX, f64::min);
        let mean_above = above.iter().sum::<f64>() / above.len().max(1) as f64;
        let alloc_values = |above: bool, f: fn(&Allocs) -> f64| -> Vec<f64> {
            THRESHOLDS
                .iter()
                .filter(|&&t| (t >= SUBSCRIBERS) == above)
                .filter_map(|t| allocations.get(&format!("{}/{t}", setup.name)).map(f))
                .collect()
        };
        let count = |v: f64| format!("{v:.1}");
        let bytes = |v: f64| format!("{v:.0}");
        seed.row(vec![
            format!("`{}` (this run, end to end)", setup.name),
            range(&below, format_ns),
            range(&above, format_ns),
            if below.is_empty() || above.is_empty() {
                "—".into()
            } else {
                format!("{:.1}×", mean_above / best_below)
            },
            format!(
                "{} → {}",
                range(&alloc_values(false, |a| a.allocations), count),
                range(&alloc_values(true, |a| a.allocations), count)
            ),
            format!(
                "{} → {}",
                range(&alloc_values(false, |a| a.bytes), bytes),
                range(&alloc_values(true, |a| a.bytes), bytes)
            ),
        ]);
    }
    seed.note = "The seed's rows are its own figures (Go benchmark ns/op on its machine) \
                 and the figures issue 3 gives for BlazeSub measured on this machine end \
                 to end. Ratios: the mean at T ≥ 1,000 over the best below."
        .into();

    // Charts: time and allocations against T, inline as a flat line.
    let mut time_chart = Chart {
        file: "cliff".into(),
        title: "Time per publish to 1,000 subscribers vs threshold T".into(),
        x_label: "T = max_concurrent_subscriptions".into(),
        y_label: "µs per publish (end to end)".into(),
        log_x: true,
        log_y: true,
        ..Chart::default()
    };
    let mut alloc_chart = Chart {
        file: "cliff-allocations".into(),
        title: "Allocations per publish vs threshold T".into(),
        x_label: "T = max_concurrent_subscriptions".into(),
        y_label: "allocations per publish".into(),
        log_x: true,
        log_y: true,
        ..Chart::default()
    };
    for setup in &SETUPS {
        time_chart.series.push(Series {
            name: setup.name.into(),
            points: series_of(&results, setup.name)
                .into_iter()
                .map(|(t, ns)| (t as f64, ns / 1e3))
                .collect(),
        });
        alloc_chart.series.push(Series {
            name: setup.name.into(),
            points: THRESHOLDS
                .iter()
                .filter_map(|&t| {
                    allocations
                        .get(&format!("{}/{t}", setup.name))
                        .map(|a| (t as f64, a.allocations.max(0.01)))
                })
                .collect(),
        });
    }
    let ends = [
        THRESHOLDS[0] as f64,
        THRESHOLDS[THRESHOLDS.len() - 1] as f64,
    ];
    if let Some(ns) = inline {
        time_chart.series.push(Series {
            name: "inline (no threshold)".into(),
            points: ends.iter().map(|&t| (t, ns / 1e3)).collect(),
        });
    }
    if let Some(a) = inline_allocs {
        alloc_chart.series.push(Series {
            name: "inline (no threshold)".into(),
            points: ends.iter().map(|&t| (t, a.allocations.max(0.01))).collect(),
        });
    }

    let mut service_table = Table::new(
        "Service setting: the default mode at every threshold, publisher a task",
        &[
            "T",
            "median per publish",
            "× inline",
            "repetitions",
            "slowest ÷ fastest",
        ],
    );
    let best = service_points
        .iter()
        .map(|p| p.median)
        .fold(f64::MAX, f64::min);
    let worst = service_points
        .iter()
        .map(|p| p.median)
        .fold(f64::MIN, f64::max);
    service_table.note = format!(
        "`worker_pool` (chunked) with the publisher a task on a 2-worker tokio runtime; \
         1,000 handlers on one shared counter; bursts of 10,000 publishes timed until every \
         handler ran; 5 repetitions alternating between thresholds. Slowest threshold's \
         median ÷ fastest's: **{:.2}×**. `Inline` in the same run: {}.",
        worst / best,
        format_ns(service_inline)
    );
    for point in service_points {
        service_table.row(vec![
            point.threshold.to_string(),
            format_ns(point.median),
            format!("{:.2}×", point.median / service_inline),
            format!(
                "{} – {}",
                format_ns(point.fastest),
                format_ns(point.slowest)
            ),
            format!("{:.2}", point.slowest / point.fastest),
        ]);
    }

    report.tables = vec![times, ratios, rotated, seed, allocs, caller, service_table];
    report.charts = vec![time_chart, alloc_chart];
    match report.save() {
        Ok(()) => println!("wrote docs/cliff.md"),
        Err(err) => eprintln!("could not write the report: {err}"),
    }
}

criterion_group! {
    name = benches;
    // 45 points: short warm-up and measurement keep a full run near three
    // minutes. The slow points (the cliff, ~100 µs–1 ms per publish) fall back
    // to flat sampling, so they too take about the measurement time.
    // Command-line flags still override these.
    config = Criterion::default()
        .warm_up_time(Duration::from_secs(1))
        .measurement_time(Duration::from_secs(3))
        .sample_size(30);
    targets = cliff
}

fn main() {
    let allocations = allocations_per_publish();
    let (service_points, service_inline) = service_thresholds();
    benches();
    Criterion::default().configure_from_args().final_summary();
    if bench_mode() {
        let interleaved = across_the_threshold();
        write_report(&allocations, &interleaved, &service_points, service_inline);
    }
}
