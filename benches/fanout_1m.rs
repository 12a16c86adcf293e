//! One message to 1,000,000 subscribers in one process (seed `002_…`, Ergo's
//! "1M subscribers" benchmark): how long subscribing them all takes, how
//! long one publish takes until every handler has run, and the peak RSS.
//!
//! Every subscription is a handler on the one topic `bench/fanout_1m` that
//! counts its call (in a per-thread stripe of a counter, so the two cores do
//! not fight over one cache line: the figure is the bus's, not the
//! counter's); the payload is 12 bytes. Targets on 2 cores (issue 3): deliver
//! in under 20 ms, subscribe all in under 0.5 s, RSS under 200 MB. A raw loop
//! over 1,000,000 boxed closures doing the same count is the lower bound.
//!
//! Setups: the bus in each mode at its defaults, keeping every
//! `Subscription` handle in a `Vec` (as a service that unsubscribes later
//! would), and the default mode with every handle detached at once, which
//! separates what the handles cost from what the bus itself holds.
//!
//! Two kinds of measurement:
//! - **One-shot, in fresh processes.** Subscribing a million is not
//!   repeatable in one process, and RSS after one bus has been dropped says
//!   more about the allocator than about the next one (see `common/rss.rs`).
//!   So the bench re-runs its own binary once per setup and size: the child
//!   times subscribing all (with `Instant`), the first (cold) delivery, five
//!   warm ones and unsubscribing all, reads the peak RSS, and prints one JSON
//!   line. At 1,000,000 subscribers this is repeated three times per setup;
//!   the page gives the minimum and median.
//! - **Warm delivery, with criterion**: one publish to all subscribers, timed
//!   until the last handler ran, iterated on an already warm bus.
//!
//! In bench mode it then writes `docs/fanout_1m.md`. In test mode
//! (`cargo test --bench fanout_1m`) the sizes shrink to 10,000.
//!
//! `cargo bench --bench fanout_1m`

mod common;

use std::hint::black_box;
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use blazesub::{DeliveryMode, Message, Subscription};
use criterion::{criterion_group, Criterion, SamplingMode};
use crossbeam_utils::CachePadded;

use common::report::{criterion_results, format_ns, Chart, Report, Series, Table};
use common::{alloc_snapshot, bench_mode, rss, runtime, CountingAllocator, Payload, Setup};

#[global_allocator]
static ALLOCATOR: CountingAllocator = CountingAllocator;

const TOPIC: &str = "bench/fanout_1m";
const PAYLOAD: Payload = *b"twelve bytes";

/// One way of holding a million subscriptions.
#[derive(Clone, Copy, Debug)]
struct Variant {
    setup: Setup,
    /// Whether each `Subscription` is `detach`ed at once instead of kept.
    detach: bool,
}

impl Variant {
    const fn kept(name: &'static str, mode: DeliveryMode) -> Self {
        Self {
            setup: Setup::defaults(name, mode),
            detach: false,
        }
    }

    fn name(&self) -> &'static str {
        self.setup.name
    }
}

/// The bus in every mode at its default settings, handles kept (the default
/// mode first); and the default mode with every handle detached, which shows
/// what the handles themselves cost.
const VARIANTS: [Variant; 4] = [
    Variant::kept("worker_pool", DeliveryMode::WorkerPool),
    Variant::kept("task_per_subscriber", DeliveryMode::TaskPerSubscriber),
    Variant::kept("inline", DeliveryMode::Inline),
    Variant {
        setup: Setup::defaults("worker_pool_detached", DeliveryMode::WorkerPool),
        detach: true,
    },
];
const RAW: &str = "raw_loop";

/// Set in a child process: the setup to measure once (`raw_loop` or a
/// [`SETUPS`] name), and the subscriber count.
const CHILD_SETUP: &str = "BLAZESUB_FANOUT_1M_SETUP";
const CHILD_SUBSCRIBERS: &str = "BLAZESUB_FANOUT_1M_SUBSCRIBERS";
/// Marks the child's result line on its stdout.
const RESULT_PREFIX: &str = "fanout_1m-result ";
/// Warm deliveries a child times after the cold one.
const CHILD_WARM: usize = 5;

const TARGET_DELIVERY_NS: f64 = 20e6;
const TARGET_SUBSCRIBE_NS: f64 = 500e6;
const TARGET_RSS_BYTES: u64 = 200_000_000;

/// The subscriber count of the criterion run and of the repeated one-shots.
fn subscribers() -> usize {
    if bench_mode() {
        1_000_000
    } else {
        10_000
    }
}

/// Subscriber counts measured once each for the scaling charts (the largest,
/// [`subscribers`], is measured [`repeats`] times).
fn smaller_sizes() -> Vec<usize> {
    if bench_mode() {
        vec![10_000, 100_000]
    } else {
        vec![1_000]
    }
}

fn repeats() -> usize {
    if bench_mode() {
        3
    } else {
        2
    }
}

/// Counts handler calls in per-thread stripes, each on its own cache line.
struct Tally {
    stripes: [CachePadded<AtomicU64>; STRIPES],
}

const STRIPES: usize = 16;
static NEXT_STRIPE: AtomicUsize = AtomicUsize::new(0);

thread_local! {
    static STRIPE: usize = NEXT_STRIPE.fetch_add(1, Ordering::Relaxed) % STRIPES;
}

impl Tally {
    fn new() -> Self {
        Self {
            stripes: std::array::from_fn(|_| CachePadded::new(AtomicU64::new(0))),
        }
    }

    #[inline]
    fn add(&self) {
        let stripe = STRIPE.with(|s| *s);
        self.stripes[stripe].fetch_add(1, Ordering::Relaxed);
    }

    fn total(&self) -> u64 {
        self.stripes.iter().map(|s| s.load(Ordering::Acquire)).sum()
    }

    /// Waits until the total reaches `target`: spins briefly, then polls
    /// every 20 µs (about 70 µs with the kernel's timer slack), sleeping so
    /// that the waiter does not take a core from the deliveries it waits
    /// for. Panics after a minute, which only a lost delivery could cause.
    fn wait_for(&self, target: u64) {
        for _ in 0..200 {
            if self.total() >= target {
                return;
            }
            std::hint::spin_loop();
        }
        let started = Instant::now();
        while self.total() < target {
            std::thread::sleep(Duration::from_micros(20));
            if started.elapsed() > Duration::from_secs(60) {
                panic!(
                    "deliveries went missing: {} of {target} after a minute",
                    self.total()
                );
            }
        }
    }
}

/// How long one publish took.
#[derive(Clone, Copy, Debug)]
struct Timed {
    /// Until the `publish` call returned (the seed's "time to publish").
    call: Duration,
    /// Until every handler had run (end to end).
    total: Duration,
}

/// Runs `publish` and waits until `tally` has grown by `deliveries`.
fn timed_delivery(tally: &Tally, deliveries: u64, publish: impl FnOnce()) -> Timed {
    let target = tally.total() + deliveries;
    let start = Instant::now();
    publish();
    let call = start.elapsed();
    tally.wait_for(target);
    Timed {
        call,
        total: start.elapsed(),
    }
}

/// The first delivery, then [`CHILD_WARM`] more: (cold, warm totals, warm
/// publish calls), in nanoseconds.
fn cold_and_warm(tally: &Tally, deliveries: u64, publish: impl Fn()) -> (f64, Vec<f64>, Vec<f64>) {
    let cold = timed_delivery(tally, deliveries, &publish);
    let warm: Vec<Timed> = (0..CHILD_WARM)
        .map(|_| timed_delivery(tally, deliveries, &publish))
        .collect();
    (
        cold.total.as_nanos() as f64,
        warm.iter().map(|t| t.total.as_nanos() as f64).collect(),
        warm.iter().map(|t| t.call.as_nanos() as f64).collect(),
    )
}

type Closure = Box<dyn Fn(&Payload) + Send + Sync>;

/// The raw loop's "subscribers": boxed closures counting like the handlers.
fn raw_closures(tally: &Arc<Tally>, n: usize) -> Vec<Closure> {
    (0..n)
        .map(|_| {
            let tally = Arc::clone(tally);
            Box::new(move |_: &Payload| tally.add()) as Closure
        })
        .collect()
}

fn raw_delivery(closures: &[Closure]) {
    let payload = black_box(PAYLOAD);
    for closure in closures {
        closure(&payload);
    }
}

/// `n` counting handler subscriptions on [`TOPIC`]: their handles, kept as
/// a service would keep them to unsubscribe later, or none if `detach`.
fn subscribe_all(
    bus: &blazesub::Bus<Payload>,
    tally: &Arc<Tally>,
    n: usize,
    detach: bool,
) -> Vec<Subscription> {
    let mut subscriptions = Vec::with_capacity(if detach { 0 } else { n });
    for _ in 0..n {
        let tally = Arc::clone(tally);
        let subscription = bus
            .subscribe(TOPIC, move |_: &Message<Payload>| tally.add())
            .expect("subscribe");
        if detach {
            subscription.detach();
        } else {
            subscriptions.push(subscription);
        }
    }
    subscriptions
}

fn variant_named(name: &str) -> Option<Variant> {
    VARIANTS.iter().copied().find(|v| v.name() == name)
}

// ---------------------------------------------------------------------------
// One-shot measurements, each in a fresh process.

/// What one child process measured.
#[derive(Clone, Debug)]
struct OneShot {
    setup: String,
    subscribers: usize,
    subscribe_ns: f64,
    cold_ns: f64,
    warm_ns: Vec<f64>,
    /// The warm publishes' calls alone, until `publish` returned.
    publish_call_ns: Vec<f64>,
    /// Dropping every handle; `None` when they were detached.
    unsubscribe_ns: Option<f64>,
    rss_start: Option<u64>,
    rss_subscribed: Option<u64>,
    rss_peak: Option<u64>,
    /// Allocations and bytes allocated while subscribing, per subscriber.
    allocations_per_sub: f64,
    bytes_per_sub: f64,
}

impl OneShot {
    fn warm_median_ns(&self) -> f64 {
        median(&self.warm_ns)
    }

    fn to_json(&self) -> serde_json::Value {
        serde_json::json!({
            "setup": self.setup,
            "subscribers": self.subscribers,
            "subscribe_ns": self.subscribe_ns,
            "cold_ns": self.cold_ns,
            "warm_ns": self.warm_ns,
            "publish_call_ns": self.publish_call_ns,
            "unsubscribe_ns": self.unsubscribe_ns,
            "rss_start": self.rss_start,
            "rss_subscribed": self.rss_subscribed,
            "rss_peak": self.rss_peak,
            "allocations_per_sub": self.allocations_per_sub,
            "bytes_per_sub": self.bytes_per_sub,
        })
    }

    fn from_json(v: &serde_json::Value) -> Option<Self> {
        let f = |key: &str| v[key].as_f64();
        let list = |key: &str| -> Option<Vec<f64>> {
            Some(
                v[key]
                    .as_array()?
                    .iter()
                    .filter_map(|x| x.as_f64())
                    .collect(),
            )
        };
        Some(Self {
            setup: v["setup"].as_str()?.to_owned(),
            subscribers: v["subscribers"].as_u64()? as usize,
            subscribe_ns: f("subscribe_ns")?,
            cold_ns: f("cold_ns")?,
            warm_ns: list("warm_ns")?,
            publish_call_ns: list("publish_call_ns")?,
            unsubscribe_ns: f("unsubscribe_ns"),
            rss_start: v["rss_start"].as_u64(),
            rss_subscribed: v["rss_subscribed"].as_u64(),
            rss_peak: v["rss_peak"].as_u64(),
            allocations_per_sub: f("allocations_per_sub")?,
            bytes_per_sub: f("bytes_per_sub")?,
        })
    }
}

/// The child's whole life: measure `setup` once with `n` subscribers and
/// print the result line.
fn child(setup: &str, n: usize) {
    let rt = runtime();
    let tally = Arc::new(Tally::new());
    let rss_start = rss::current();
    let allocs_before = alloc_snapshot();
    let deliveries = n as u64;
    let shot = if setup == RAW {
        let start = Instant::now();
        let closures = raw_closures(&tally, n);
        let subscribe = start.elapsed();
        let (allocations, bytes) = alloc_snapshot().per_op_since(allocs_before, n as u64);
        let rss_subscribed = rss::current();
        let (cold, warm, calls) = cold_and_warm(&tally, deliveries, || raw_delivery(&closures));
        let rss_peak = rss::peak();
        let start = Instant::now();
        drop(closures);
        let unsubscribe = start.elapsed();
        OneShot {
            setup: setup.to_owned(),
            subscribers: n,
            subscribe_ns: subscribe.as_nanos() as f64,
            cold_ns: cold,
            warm_ns: warm,
            publish_call_ns: calls,
            unsubscribe_ns: Some(unsubscribe.as_nanos() as f64),
            rss_start,
            rss_subscribed,
            rss_peak,
            allocations_per_sub: allocations,
            bytes_per_sub: bytes,
        }
    } else {
        let variant = variant_named(setup).unwrap_or_else(|| panic!("unknown setup {setup}"));
        let bus = variant.setup.build::<Payload>(&rt);
        let allocs_before = alloc_snapshot(); // the bus itself is not per subscriber
        let start = Instant::now();
        let subscriptions = subscribe_all(&bus, &tally, n, variant.detach);
        let subscribe = start.elapsed();
        let (allocations, bytes) = alloc_snapshot().per_op_since(allocs_before, n as u64);
        let rss_subscribed = rss::current();
        let publish = || {
            bus.publish(TOPIC, black_box(PAYLOAD)).expect("publish");
        };
        let (cold, warm, calls) = cold_and_warm(&tally, deliveries, publish);
        let rss_peak = rss::peak();
        let unsubscribe = (!variant.detach).then(|| {
            let start = Instant::now();
            drop(subscriptions);
            assert_eq!(bus.subscriptions_count(), 0);
            start.elapsed()
        });
        OneShot {
            setup: setup.to_owned(),
            subscribers: n,
            subscribe_ns: subscribe.as_nanos() as f64,
            cold_ns: cold,
            warm_ns: warm,
            publish_call_ns: calls,
            unsubscribe_ns: unsubscribe.map(|u| u.as_nanos() as f64),
            rss_start,
            rss_subscribed,
            rss_peak,
            allocations_per_sub: allocations,
            bytes_per_sub: bytes,
        }
    };
    println!("{RESULT_PREFIX}{}", shot.to_json());
}

/// Runs one child process of this bench binary and reads its result.
fn run_child(setup: &str, n: usize) -> OneShot {
    let exe = std::env::current_exe().expect("bench binary path");
    let output = Command::new(exe)
        .env(CHILD_SETUP, setup)
        .env(CHILD_SUBSCRIBERS, n.to_string())
        .stdin(Stdio::null())
        .stderr(Stdio::inherit())
        .output()
        .expect("run a child process");
    assert!(
        output.status.success(),
        "child for {setup} with {n} subscribers failed: {}",
        output.status
    );
    let stdout = String::from_utf8_lossy(&output.stdout);
    stdout
        .lines()
        .find_map(|line| line.strip_prefix(RESULT_PREFIX))
        .and_then(|json| serde_json::from_str(json).ok())
        .and_then(|value| OneShot::from_json(&value))
        .unwrap_or_else(|| panic!("no result from the child for {setup}: {stdout}"))
}

fn all_setup_names() -> Vec<&'static str> {
    std::iter::once(RAW)
        .chain(VARIANTS.iter().map(Variant::name))
        .collect()
}

/// Every one-shot: the smaller sizes once, the full size [`repeats`] times,
/// setups interleaved so that a noisy moment does not hit one setup only.
fn one_shots() -> Vec<OneShot> {
    let mut shots = Vec::new();
    let mut plan: Vec<usize> = smaller_sizes();
    plan.extend(std::iter::repeat_n(subscribers(), repeats()));
    for n in plan {
        for setup in all_setup_names() {
            let shot = run_child(setup, n);
            println!(
                "{setup:>20} {n:>9} subscribers: subscribe {}, cold {}, warm {} (median of {CHILD_WARM}; publish call {}), \
                 unsubscribe {}, RSS {} → {} (peak {}), {:.1} allocations and {:.0} bytes per subscription",
                format_ns(shot.subscribe_ns),
                format_ns(shot.cold_ns),
                format_ns(shot.warm_median_ns()),
                format_ns(median(&shot.publish_call_ns)),
                shot.unsubscribe_ns.map_or_else(|| "n/a".to_owned(), format_ns),
                rss::format_mb(shot.rss_start),
                rss::format_mb(shot.rss_subscribed),
                rss::format_mb(shot.rss_peak),
                shot.allocations_per_sub,
                shot.bytes_per_sub,
            );
            shots.push(shot);
        }
    }
    shots
}

// ---------------------------------------------------------------------------
// Warm delivery, with criterion.

fn warm_delivery(c: &mut Criterion) {
    let n = subscribers();
    let deliveries = n as u64;
    let rt = runtime();
    let mut group = c.benchmark_group("fanout_1m");
    // Each iteration takes milliseconds: flat sampling keeps the iteration
    // count per sample equal instead of growing it linearly.
    group.sampling_mode(SamplingMode::Flat);

    let tally = Arc::new(Tally::new());
    let closures = raw_closures(&tally, n);
    group.bench_function(RAW, |b| {
        b.iter_custom(|iters| {
            (0..iters)
                .map(|_| timed_delivery(&tally, deliveries, || raw_delivery(&closures)).total)
                .sum()
        })
    });
    drop(closures);
    rss::release_free_memory();

    for variant in VARIANTS {
        let bus = variant.setup.build::<Payload>(&rt);
        let subscriptions = subscribe_all(&bus, &tally, n, variant.detach);
        group.bench_function(variant.name(), |b| {
            b.iter_custom(|iters| {
                (0..iters)
                    .map(|_| {
                        timed_delivery(&tally, deliveries, || {
                            bus.publish(TOPIC, black_box(PAYLOAD)).expect("publish");
                        })
                        .total
                    })
                    .sum()
            })
        });
        drop(subscriptions);
        drop(bus);
        rss::release_free_memory();
    }
    group.finish();
}

// ---------------------------------------------------------------------------
// The report.

fn median(values: &[f64]) -> f64 {
    let mut sorted = values.to_vec();
    sorted.sort_by(f64::total_cmp);
    match sorted.len() {
        0 => f64::NAN,
        n if n % 2 == 1 => sorted[n / 2],
        n => (sorted[n / 2 - 1] + sorted[n / 2]) / 2.0,
    }
}

fn median_u64(values: impl Iterator<Item = Option<u64>>) -> Option<u64> {
    let values: Option<Vec<f64>> = values.map(|v| v.map(|v| v as f64)).collect();
    values.filter(|v| !v.is_empty()).map(|v| median(&v) as u64)
}

fn write_report(shots: &[OneShot]) {
    let n = subscribers();
    let results = criterion_results("fanout_1m");
    let mut report = Report::new(
        "fanout_1m",
        "One message to 1,000,000 subscribers",
        &["blazesub", "tokio", "crossbeam-queue", "criterion"],
    );

    let mut main = Table::new(
        "1,000,000 subscribers on one topic",
        &[
            "setup",
            "subscribe all: min / median",
            "first delivery: median",
            "warm delivery",
            "peak RSS: median",
            "targets (< 0.5 s, < 20 ms, < 200 MB)",
        ],
    );
    main.note = format!(
        "Subscribe all, first delivery and peak RSS: one fresh process per run, {} runs per \
         setup, timed with `Instant`. First delivery is the first publish after subscribing \
         (route-cache miss, idle workers), timed from the `publish` call until every handler \
         ran. Warm delivery: criterion's mean over repeated publishes on a warm bus, same \
         end point. `raw_loop` builds and calls 1,000,000 boxed closures doing the same \
         count; it is the lower bound, not held to the targets. Peak RSS is the whole \
         process's `VmHWM`, including the `Subscription` handles the bench keeps in a \
         `Vec` (`worker_pool_detached`: the default bus with every handle detached at \
         once, so none is kept).",
        repeats()
    );
    let mut detail = Table::new(
        "Memory and the other one-shot figures (1,000,000 subscribers, medians)",
        &[
            "setup",
            "RSS at start",
            "RSS after subscribing",
            "peak RSS",
            "allocations / subscription",
            "bytes allocated / subscription",
            "warm delivery (5 in each process)",
            "`publish` call alone (warm)",
            "unsubscribe all",
        ],
    );
    detail.note = "Allocations and bytes counted by the global allocator while subscribing \
                   (gross: a buffer that is regrown counts every time); the bus's own \
                   construction is not included. `publish` call alone: until `publish` \
                   returned, the figure the seed calls \"time to publish\" (in `inline` \
                   mode the whole delivery). Unsubscribe all: dropping every handle."
        .into();

    let mut delivery_chart = Chart {
        file: "fanout_1m-delivery".into(),
        title: "Warm delivery of one message until every handler ran".into(),
        x_label: "subscribers".into(),
        y_label: "milliseconds".into(),
        log_x: true,
        log_y: true,
        ..Chart::default()
    };
    let mut rss_chart = Chart {
        file: "fanout_1m-rss".into(),
        title: "Peak RSS of the process".into(),
        x_label: "subscribers".into(),
        y_label: "MB".into(),
        log_x: true,
        log_y: true,
        ..Chart::default()
    };

    for setup in all_setup_names() {
        let full: Vec<&OneShot> = shots
            .iter()
            .filter(|s| s.setup == setup && s.subscribers == n)
            .collect();
        if full.is_empty() {
            continue;
        }
        let subscribe: Vec<f64> = full.iter().map(|s| s.subscribe_ns).collect();
        let subscribe_min = subscribe.iter().copied().fold(f64::MAX, f64::min);
        let subscribe_median = median(&subscribe);
        let cold = median(&full.iter().map(|s| s.cold_ns).collect::<Vec<_>>());
        let peak = median_u64(full.iter().map(|s| s.rss_peak));
        let warm = results.get(setup).map(|e| e.mean_ns);
        let targets = if setup == RAW {
            "lower bound".to_owned()
        } else {
            let mut missed = Vec::new();
            if subscribe_median >= TARGET_SUBSCRIBE_NS {
                missed.push("subscribe");
            }
            if warm.is_none_or(|w| w >= TARGET_DELIVERY_NS) {
                missed.push("delivery");
            }
            if peak.is_none_or(|p| p >= TARGET_RSS_BYTES) {
                missed.push("RSS");
            }
            if missed.is_empty() {
                "all met".to_owned()
            } else {
                format!("missed: {}", missed.join(", "))
            }
        };
        main.row(vec![
            format!("`{setup}`"),
            format!(
                "{} / {}",
                format_ns(subscribe_min),
                format_ns(subscribe_median)
            ),
            format_ns(cold),
            warm.map_or_else(|| "n/a".to_owned(), format_ns),
            rss::format_mb(peak),
            targets,
        ]);
        let med = |f: fn(&OneShot) -> f64| median(&full.iter().map(|s| f(s)).collect::<Vec<_>>());
        detail.row(vec![
            format!("`{setup}`"),
            rss::format_mb(median_u64(full.iter().map(|s| s.rss_start))),
            rss::format_mb(median_u64(full.iter().map(|s| s.rss_subscribed))),
            rss::format_mb(peak),
            format!("{:.2}", med(|s| s.allocations_per_sub)),
            format!("{:.0}", med(|s| s.bytes_per_sub)),
            format_ns(med(|s| s.warm_median_ns())),
            format_ns(med(|s| median(&s.publish_call_ns))),
            {
                let unsubscribe: Vec<f64> = full.iter().filter_map(|s| s.unsubscribe_ns).collect();
                if unsubscribe.is_empty() {
                    "n/a (detached)".to_owned()
                } else {
                    format_ns(median(&unsubscribe))
                }
            },
        ]);

        // Scaling: one point per size, the median over the runs at that size.
        let mut sizes: Vec<usize> = shots
            .iter()
            .filter(|s| s.setup == setup)
            .map(|s| s.subscribers)
            .collect();
        sizes.sort_unstable();
        sizes.dedup();
        let mut delivery_points = Vec::new();
        let mut rss_points = Vec::new();
        for size in sizes {
            let at: Vec<&OneShot> = shots
                .iter()
                .filter(|s| s.setup == setup && s.subscribers == size)
                .collect();
            let warm = median(&at.iter().map(|s| s.warm_median_ns()).collect::<Vec<_>>());
            delivery_points.push((size as f64, warm / 1e6));
            if let Some(peak) = median_u64(at.iter().map(|s| s.rss_peak)) {
                rss_points.push((size as f64, peak as f64 / 1e6));
            }
        }
        delivery_chart.series.push(Series {
            name: setup.into(),
            points: delivery_points,
        });
        rss_chart.series.push(Series {
            name: setup.into(),
            points: rss_points,
        });
    }
    let sizes = {
        let mut all: Vec<usize> = shots.iter().map(|s| s.subscribers).collect();
        all.sort_unstable();
        all.dedup();
        all
    };
    if let (Some(&lo), Some(&hi)) = (sizes.first(), sizes.last()) {
        delivery_chart.series.push(Series {
            name: "target (20 ms)".into(),
            points: vec![
                (lo as f64, TARGET_DELIVERY_NS / 1e6),
                (hi as f64, TARGET_DELIVERY_NS / 1e6),
            ],
        });
        rss_chart.series.push(Series {
            name: "target (200 MB)".into(),
            points: vec![
                (lo as f64, TARGET_RSS_BYTES as f64 / 1e6),
                (hi as f64, TARGET_RSS_BYTES as f64 / 1e6),
            ],
        });
    }

    let mut scaling = Table::new(
        "Scaling (one process per point; medians)",
        &[
            "setup",
            "subscribers",
            "subscribe all",
            "first delivery",
            "warm delivery",
            "peak RSS",
        ],
    );
    scaling.note = "The charts plot these points; warm delivery here is the median of 5 \
                    publishes in the measuring process, not criterion's figure."
        .into();
    for setup in all_setup_names() {
        for &size in &sizes {
            let at: Vec<&OneShot> = shots
                .iter()
                .filter(|s| s.setup == setup && s.subscribers == size)
                .collect();
            if at.is_empty() {
                continue;
            }
            let med = |f: fn(&OneShot) -> f64| median(&at.iter().map(|s| f(s)).collect::<Vec<_>>());
            scaling.row(vec![
                format!("`{setup}`"),
                size.to_string(),
                format_ns(med(|s| s.subscribe_ns)),
                format_ns(med(|s| s.cold_ns)),
                format_ns(med(|s| s.warm_median_ns())),
                rss::format_mb(median_u64(at.iter().map(|s| s.rss_peak))),
            ]);
        }
    }

    report.tables = vec![main, detail, scaling];
    report.charts = vec![delivery_chart, rss_chart];
    match report.save() {
        Ok(()) => println!("wrote docs/fanout_1m.md"),
        Err(err) => eprintln!("could not write the report: {err}"),
    }
}

criterion_group! {
    name = benches;
    // Defaults that keep the run short (each iteration takes milliseconds);
    // command-line options still override them.
    config = Criterion::default()
        .sample_size(20)
        .warm_up_time(Duration::from_secs(2))
        .measurement_time(Duration::from_secs(5));
    targets = warm_delivery
}

fn main() {
    if let Ok(setup) = std::env::var(CHILD_SETUP) {
        let n = std::env::var(CHILD_SUBSCRIBERS)
            .ok()
            .and_then(|n| n.parse().ok())
            .expect("subscriber count for the child");
        child(&setup, n);
        return;
    }
    let started = Instant::now();
    let shots = one_shots();
    println!(
        "one-shot runs took {:.1} s",
        started.elapsed().as_secs_f64()
    );
    benches();
    Criterion::default().configure_from_args().final_summary();
    if bench_mode() {
        write_report(&shots);
    }
    println!("fanout_1m took {:.1} s", started.elapsed().as_secs_f64());
}
