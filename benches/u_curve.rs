//! The spawn cap (the `MaxDescRoutines` seed: "spawn while fewer than Max
//! tasks are running, else run inline"), swept for a U-shaped curve:
//! throughput and publish-to-handler latency under load.
//!
//! The seed's knob is our `max_inflight_tasks` with `Overflow::CallerRuns` in
//! `TaskPerSubscriber` mode: past the cap the publisher runs the unit itself.
//! It is swept over 50 … 5,000 in two shapes of work:
//! - `task_per_subscriber`: the default `Batch::Chunked` (threshold 10), so a
//!   publish to 20 subscribers is one unit, one task;
//! - `task_per_subscriber_batch_single`: `Batch::Single` with the threshold at
//!   20, so every delivery is its own task (the seed's goroutine per item).
//!
//! For `WorkerPool` (default queue of 4,096 jobs, `CallerRuns` when it is
//! full) the worker count is swept over 1, 2, 4, 8.
//!
//! Workload: 10 topics × 20 subscribers; 4 publisher threads publish round
//! robin over the topics as fast as they can; each handler hashes the 256-byte
//! payload with `DefaultHasher` a few rounds (a few hundred ns) and records
//! its latency since the publish (an `Instant` carried in the payload) in the
//! subscriber's own `hdrhistogram`. One criterion iteration is a fixed batch
//! of 20,000 publishes across the 4 threads, timed until every handler ran
//! (throughput; the waiting thread sleeps rather than spins, so it takes no
//! core from the workers). A separate pass per setting, outside criterion,
//! gathers the latency percentiles, how often the publisher ran a unit itself
//! (`stats().caller_runs`) and the process's CPU time per delivery. After the
//! criterion group the bench writes `docs/u_curve.md` (tables, charts; see
//! `common/report.rs`).
//!
//! `cargo bench --bench u_curve`

mod common;

use std::hash::{DefaultHasher, Hasher};
use std::hint::black_box;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::thread;
use std::time::{Duration, Instant};

use blazesub::{Batch, Bus, DeliveryMode, Message, Overflow, Subscription};
use criterion::{criterion_group, BenchmarkId, Criterion, SamplingMode, Throughput};
use hdrhistogram::Histogram;

use common::report::{criterion_results, format_ns, Chart, Report, Series, Table};
use common::{bench_mode, runtime};

const GROUP: &str = "u_curve";
const TOPICS: usize = 10;
const SUBSCRIBERS_PER_TOPIC: usize = 20;
const PUBLISHERS: usize = 4;
/// Hashing rounds over the payload per handler call.
const HASH_ROUNDS: u64 = 4;
const PAYLOAD_BYTES: usize = 256;

/// The seed's knob, `max_inflight_tasks`.
const CAPS: [usize; 7] = [50, 100, 200, 500, 1_000, 2_000, 5_000];
/// Worker counts for the pool.
const WORKERS: [usize; 4] = [1, 2, 4, 8];

/// Publishes per publisher thread in one batch (one criterion iteration):
/// 4 × 5,000 publishes, 400,000 deliveries. Enough for the publishers to
/// run far ahead of the handlers and reach every cap, including 5,000 tasks
/// of one publish each.
fn per_thread() -> usize {
    if bench_mode() {
        5_000
    } else {
        50
    }
}

/// Batches in each latency pass (enough CPU time for `/proc`'s 10 ms ticks
/// to resolve a few percent).
fn latency_batches() -> usize {
    if bench_mode() {
        5
    } else {
        1
    }
}

/// A message: the moment it was published and something to hash.
#[derive(Clone)]
struct Payload {
    sent: Instant,
    bytes: [u8; PAYLOAD_BYTES],
}

/// The handler's work: a few rounds of SipHash over the payload.
fn hash_payload(bytes: &[u8]) -> u64 {
    let mut h = 0u64;
    for round in 0..HASH_ROUNDS {
        let mut hasher = DefaultHasher::new();
        hasher.write_u64(h ^ round);
        hasher.write(bytes);
        h = hasher.finish();
    }
    h
}

/// One bus configuration of the sweep.
#[derive(Clone, Copy, Debug)]
struct Setting {
    family: Family,
    /// `max_inflight_tasks` for the task families, `workers` for the pool.
    knob: usize,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Family {
    /// `TaskPerSubscriber`, default `Batch::Chunked`: one task per publish.
    Tasks,
    /// `TaskPerSubscriber`, `Batch::Single` at threshold 20: one task per
    /// delivery.
    TasksPerDelivery,
    /// `WorkerPool`, default batching and queue.
    Pool,
}

const FAMILIES: [Family; 3] = [Family::Tasks, Family::TasksPerDelivery, Family::Pool];

impl Family {
    fn name(self) -> &'static str {
        match self {
            Family::Tasks => "task_per_subscriber",
            Family::TasksPerDelivery => "task_per_subscriber_batch_single",
            Family::Pool => "worker_pool",
        }
    }

    fn knobs(self) -> &'static [usize] {
        match self {
            Family::Tasks | Family::TasksPerDelivery => &CAPS,
            Family::Pool => &WORKERS,
        }
    }

    /// Units of work one publish is cut into.
    fn units_per_publish(self) -> usize {
        match self {
            Family::TasksPerDelivery => SUBSCRIBERS_PER_TOPIC,
            Family::Tasks | Family::Pool => 1,
        }
    }
}

impl Setting {
    fn all() -> Vec<Setting> {
        FAMILIES
            .iter()
            .flat_map(|&family| {
                family
                    .knobs()
                    .iter()
                    .map(move |&knob| Setting { family, knob })
            })
            .collect()
    }

    fn id(&self) -> String {
        format!("{}/{}", self.family.name(), self.knob)
    }

    fn build(&self, rt: &tokio::runtime::Runtime) -> Bus<Payload> {
        let builder = Bus::builder()
            .overflow(Overflow::CallerRuns)
            .runtime(rt.handle().clone());
        match self.family {
            Family::Tasks => builder
                .delivery(DeliveryMode::TaskPerSubscriber)
                .max_inflight_tasks(self.knob),
            Family::TasksPerDelivery => builder
                .delivery(DeliveryMode::TaskPerSubscriber)
                .batch(Batch::Single)
                .max_concurrent_subscriptions(SUBSCRIBERS_PER_TOPIC)
                .max_inflight_tasks(self.knob),
            Family::Pool => builder
                .delivery(DeliveryMode::WorkerPool)
                .workers(self.knob),
        }
        .build()
        .expect("bus")
    }
}

/// A bus with the workload's subscribers, their latency histograms and the
/// delivery counter.
struct Workload {
    bus: Bus<Payload>,
    topics: Vec<String>,
    counter: Arc<AtomicU64>,
    histograms: Vec<Arc<Mutex<Histogram<u64>>>>,
    _subscriptions: Vec<Subscription>,
    template: [u8; PAYLOAD_BYTES],
}

fn new_histogram() -> Histogram<u64> {
    // 1 ns to 100 s, two significant digits.
    Histogram::new_with_bounds(1, 100_000_000_000, 2).expect("histogram bounds")
}

/// Waits until `counter` reaches `target`, checking every 50 µs. Unlike
/// `common::wait_for`, which spins (right for bursts of a millisecond), it
/// leaves both cores to the publishers and runners during a batch of hundreds
/// of milliseconds, and adds no CPU time of its own to the measurement.
fn wait_sleeping(counter: &AtomicU64, target: u64) {
    let started = Instant::now();
    while counter.load(Ordering::Acquire) < target {
        thread::sleep(Duration::from_micros(50));
        assert!(
            started.elapsed() < Duration::from_secs(120),
            "deliveries went missing: {} of {target} after two minutes",
            counter.load(Ordering::Acquire)
        );
    }
}

impl Workload {
    fn new(setting: &Setting, rt: &tokio::runtime::Runtime) -> Self {
        let bus = setting.build(rt);
        let topics: Vec<String> = (0..TOPICS).map(|i| format!("bench/u/{i}")).collect();
        let counter = Arc::new(AtomicU64::new(0));
        let mut histograms = Vec::new();
        let mut subscriptions = Vec::new();
        for topic in &topics {
            for _ in 0..SUBSCRIBERS_PER_TOPIC {
                let histogram = Arc::new(Mutex::new(new_histogram()));
                histograms.push(Arc::clone(&histogram));
                let counter = Arc::clone(&counter);
                let subscription = bus
                    .subscribe(topic, move |m: &Message<Payload>| {
                        let latency = m.data().sent.elapsed();
                        black_box(hash_payload(&m.data().bytes));
                        histogram
                            .lock()
                            .expect("histogram lock")
                            .saturating_record(latency.as_nanos() as u64);
                        counter.fetch_add(1, Ordering::Relaxed);
                    })
                    .expect("subscribe");
                subscriptions.push(subscription);
            }
        }
        let mut template = [0u8; PAYLOAD_BYTES];
        for (i, byte) in template.iter_mut().enumerate() {
            *byte = (i as u8).wrapping_mul(31).wrapping_add(7);
        }
        Self {
            bus,
            topics,
            counter,
            histograms,
            _subscriptions: subscriptions,
            template,
        }
    }

    /// Publishes `per_thread` messages from each of [`PUBLISHERS`] threads,
    /// round robin over the topics, and returns the time until every handler
    /// ran.
    fn run(&self, per_thread: usize) -> Duration {
        let deliveries = (PUBLISHERS * per_thread * SUBSCRIBERS_PER_TOPIC) as u64;
        let target = self.counter.load(Ordering::Acquire) + deliveries;
        let start = Instant::now();
        thread::scope(|scope| {
            for publisher in 0..PUBLISHERS {
                scope.spawn(move || {
                    for k in 0..per_thread {
                        let topic = &self.topics[(publisher + k) % TOPICS];
                        let payload = Payload {
                            sent: Instant::now(),
                            bytes: self.template,
                        };
                        self.bus.publish(topic, payload).expect("publish");
                    }
                });
            }
        });
        wait_sleeping(&self.counter, target);
        start.elapsed()
    }

    /// Every subscriber's latencies merged; the histograms are reset.
    fn take_latencies(&self) -> Histogram<u64> {
        let mut all = new_histogram();
        for histogram in &self.histograms {
            let mut histogram = histogram.lock().expect("histogram lock");
            all.add(&*histogram).expect("same bounds");
            histogram.reset();
        }
        all
    }
}

/// What the latency pass found for one setting.
#[derive(Clone, Copy, Debug)]
struct Pass {
    /// Deliveries per second over the pass (a cross-check of criterion's).
    throughput: f64,
    p50_ns: f64,
    p99_ns: f64,
    p999_ns: f64,
    max_ns: f64,
    /// Share of units the publishers ran themselves (`CallerRuns`).
    caller_share: f64,
    /// CPU time of the whole process per delivery (user + system), if
    /// `/proc/self/stat` is readable: unlike wall time, it hardly moves when
    /// other processes share the cores.
    cpu_ns_per_delivery: Option<f64>,
}

/// CPU time this process has used (user + system), from `/proc/self/stat`
/// (Linux; in clock ticks of 10 ms, so only long passes resolve it).
fn process_cpu() -> Option<Duration> {
    let stat = std::fs::read_to_string("/proc/self/stat").ok()?;
    // Fields after the command name, which is in parentheses: state is the
    // first, utime the 12th and stime the 13th.
    let rest = &stat[stat.rfind(')')? + 1..];
    let fields: Vec<&str> = rest.split_whitespace().collect();
    let ticks: u64 = fields.get(11)?.parse::<u64>().ok()? + fields.get(12)?.parse::<u64>().ok()?;
    // USER_HZ is 100 on every Linux architecture the bench runs on.
    Some(Duration::from_millis(ticks * 10))
}

fn latency_pass(setting: &Setting, rt: &tokio::runtime::Runtime) -> Pass {
    let workload = Workload::new(setting, rt);
    workload.run(per_thread()); // warm-up
    workload.take_latencies();
    let before = workload.bus.stats();
    let cpu_before = process_cpu();
    let mut elapsed = Duration::ZERO;
    for _ in 0..latency_batches() {
        elapsed += workload.run(per_thread());
    }
    let cpu_after = process_cpu();
    let after = workload.bus.stats();
    let latencies = workload.take_latencies();
    let publishes = after.published - before.published;
    let units = publishes * setting.family.units_per_publish() as u64;
    let deliveries = latencies.len();
    assert_eq!(
        deliveries,
        publishes * SUBSCRIBERS_PER_TOPIC as u64,
        "every delivery records its latency"
    );
    let pass = Pass {
        throughput: deliveries as f64 / elapsed.as_secs_f64(),
        p50_ns: latencies.value_at_quantile(0.50) as f64,
        p99_ns: latencies.value_at_quantile(0.99) as f64,
        p999_ns: latencies.value_at_quantile(0.999) as f64,
        max_ns: latencies.max() as f64,
        caller_share: (after.caller_runs - before.caller_runs) as f64 / units as f64,
        cpu_ns_per_delivery: cpu_before
            .zip(cpu_after)
            .map(|(b, a)| (a - b).as_nanos() as f64 / deliveries as f64),
    };
    println!(
        "{:>40}: {:>6.2} M deliveries/s, p50 {:>9}, p99 {:>9}, p99.9 {:>9}, publisher ran {:>5.1}% of units, CPU {:>7} per delivery",
        setting.id(),
        pass.throughput / 1e6,
        format_ns(pass.p50_ns),
        format_ns(pass.p99_ns),
        format_ns(pass.p999_ns),
        pass.caller_share * 100.0,
        pass.cpu_ns_per_delivery.map_or("?".into(), format_ns),
    );
    pass
}

fn latency_passes() -> Vec<(Setting, Pass)> {
    let rt = runtime();
    Setting::all()
        .into_iter()
        .map(|setting| (setting, latency_pass(&setting, &rt)))
        .collect()
}

/// Nanoseconds per call of the handler's hashing alone, on this thread (the
/// best of five runs, as other processes may share the core).
fn handler_work_ns() -> f64 {
    let bytes = [7u8; PAYLOAD_BYTES];
    let calls = if bench_mode() { 100_000 } else { 1_000 };
    (0..5)
        .map(|_| {
            let start = Instant::now();
            for _ in 0..calls {
                black_box(hash_payload(black_box(&bytes)));
            }
            start.elapsed().as_nanos() as f64 / calls as f64
        })
        .fold(f64::MAX, f64::min)
}

/// 400000 → "400,000".
fn thousands(n: usize) -> String {
    let digits = n.to_string();
    let mut out = String::new();
    for (i, c) in digits.chars().enumerate() {
        if i > 0 && (digits.len() - i) % 3 == 0 {
            out.push(',');
        }
        out.push(c);
    }
    out
}

fn u_curve(c: &mut Criterion) {
    let rt = runtime();
    let mut group = c.benchmark_group(GROUP);
    // An iteration takes 100 ms or more: the same number of them per sample.
    group.sampling_mode(SamplingMode::Flat);
    let per_thread = per_thread();
    group.throughput(Throughput::Elements(
        (PUBLISHERS * per_thread * SUBSCRIBERS_PER_TOPIC) as u64,
    ));
    for setting in Setting::all() {
        let workload = Workload::new(&setting, &rt);
        group.bench_function(BenchmarkId::new(setting.family.name(), setting.knob), |b| {
            b.iter_custom(|iters| (0..iters).map(|_| workload.run(per_thread)).sum())
        });
    }
    group.finish();
}

fn format_rate(per_second: f64) -> String {
    if per_second >= 1e6 {
        format!("{:.2} M/s", per_second / 1e6)
    } else {
        format!("{:.0} k/s", per_second / 1e3)
    }
}

fn write_report(passes: &[(Setting, Pass)], work_ns: f64) {
    let results = criterion_results(GROUP);
    if results.is_empty() {
        eprintln!("no criterion results for {GROUP}; report not written");
        return;
    }
    let deliveries_per_iter = (PUBLISHERS * per_thread() * SUBSCRIBERS_PER_TOPIC) as f64;
    let throughput = |setting: &Setting| {
        results
            .get(&setting.id())
            .map(|e| deliveries_per_iter / e.mean_ns * 1e9)
    };
    let mut report = Report::new(
        "u_curve",
        "The spawn cap: looking for a U",
        &[
            "blazesub",
            "tokio",
            "crossbeam-queue",
            "hdrhistogram",
            "criterion",
        ],
    );

    let mut tables = Vec::new();
    for family in FAMILIES {
        let (title, knob) = match family {
            Family::Tasks => (
                "`TaskPerSubscriber`, one task per publish (`Batch::Chunked`, the default)",
                "max_inflight_tasks",
            ),
            Family::TasksPerDelivery => (
                "`TaskPerSubscriber`, one task per delivery (`Batch::Single`, T = 20)",
                "max_inflight_tasks",
            ),
            Family::Pool => (
                "`WorkerPool` (`Batch::Chunked`, queue of 4,096 jobs)",
                "workers",
            ),
        };
        let mut table = Table::new(
            title,
            &[
                knob,
                "deliveries / s",
                "publishes / s",
                "deliveries / s (latency pass)",
                "p50",
                "p99",
                "p99.9",
                "max",
                "units run by the publisher",
                "CPU per delivery",
            ],
        );
        for (setting, pass) in passes.iter().filter(|(s, _)| s.family == family) {
            let rate = throughput(setting);
            table.row(vec![
                setting.knob.to_string(),
                rate.map_or("—".into(), format_rate),
                rate.map_or("—".into(), |r| {
                    format_rate(r / SUBSCRIBERS_PER_TOPIC as f64)
                }),
                format_rate(pass.throughput),
                format_ns(pass.p50_ns),
                format_ns(pass.p99_ns),
                format_ns(pass.p999_ns),
                format_ns(pass.max_ns),
                format!("{:.1}%", pass.caller_share * 100.0),
                pass.cpu_ns_per_delivery.map_or("—".into(), format_ns),
            ]);
        }
        tables.push(table);
    }
    tables[0].note = format!(
        "{PUBLISHERS} publisher threads, {TOPICS} topics × {SUBSCRIBERS_PER_TOPIC} \
         subscribers, `Overflow::CallerRuns`, 2 tokio worker threads. Throughput: \
         criterion's estimate for a batch of {} publishes ({} deliveries), timed until \
         every handler ran; the latency pass's own rate beside it shows how much the \
         machine moved between the two. Latency: publish to handler start, from {} more \
         batches outside criterion (hdrhistogram, 2 significant digits). The handler's own \
         hashing takes {work_ns:.0} ns per call. Units run by the publisher: the share \
         of units of work `CallerRuns` handed back to a publisher because the cap was \
         reached (> 0 means the cap was reached). CPU per delivery: the process's user + \
         system time over the latency batches (`/proc/self/stat`) divided by the \
         deliveries, everything included (publishing, dispatch, handlers, waiting).",
        thousands(PUBLISHERS * per_thread()),
        thousands(PUBLISHERS * per_thread() * SUBSCRIBERS_PER_TOPIC),
        latency_batches(),
    );
    tables[2].note = "Here the knob is the worker count; `CallerRuns` applies when the \
                      queue of 4,096 jobs (one per publish) is full."
        .into();

    let task_families = [Family::Tasks, Family::TasksPerDelivery];
    let mut throughput_chart = Chart {
        file: "u_curve-throughput".into(),
        title: "Throughput vs the spawn cap".into(),
        x_label: "max_inflight_tasks".into(),
        y_label: "deliveries per second (millions)".into(),
        log_x: true,
        ..Chart::default()
    };
    let mut latency_chart = Chart {
        file: "u_curve-latency".into(),
        title: "Publish-to-handler latency vs the spawn cap".into(),
        x_label: "max_inflight_tasks".into(),
        y_label: "latency (µs)".into(),
        log_x: true,
        log_y: true,
        ..Chart::default()
    };
    let mut cpu_chart = Chart {
        file: "u_curve-cpu".into(),
        title: "CPU time per delivery vs the spawn cap".into(),
        x_label: "max_inflight_tasks".into(),
        y_label: "ns of CPU per delivery (whole process)".into(),
        log_x: true,
        ..Chart::default()
    };
    for family in task_families {
        let of_family = || passes.iter().filter(move |(s, _)| s.family == family);
        cpu_chart.series.push(Series {
            name: family.name().into(),
            points: of_family()
                .filter_map(|(s, p)| p.cpu_ns_per_delivery.map(|ns| (s.knob as f64, ns)))
                .collect(),
        });
        throughput_chart.series.push(Series {
            name: family.name().into(),
            points: of_family()
                .filter_map(|(s, _)| throughput(s).map(|r| (s.knob as f64, r / 1e6)))
                .collect(),
        });
        latency_chart.series.push(Series {
            name: format!("{} p99", family.name()),
            points: of_family()
                .map(|(s, p)| (s.knob as f64, p.p99_ns / 1e3))
                .collect(),
        });
        latency_chart.series.push(Series {
            name: format!("{} p50", family.name()),
            points: of_family()
                .map(|(s, p)| (s.knob as f64, (p.p50_ns / 1e3).max(0.01)))
                .collect(),
        });
    }
    let workers_chart = Chart {
        file: "u_curve-workers".into(),
        title: "WorkerPool throughput vs workers".into(),
        x_label: "workers".into(),
        y_label: "deliveries per second (millions)".into(),
        log_x: true,
        series: vec![Series {
            name: Family::Pool.name().into(),
            points: passes
                .iter()
                .filter(|(s, _)| s.family == Family::Pool)
                .filter_map(|(s, _)| throughput(s).map(|r| (s.knob as f64, r / 1e6)))
                .collect(),
        }],
        ..Chart::default()
    };

    report.tables = tables;
    report.charts = vec![throughput_chart, latency_chart, cpu_chart, workers_chart];
    match report.save() {
        Ok(()) => println!("wrote docs/u_curve.md"),
        Err(err) => eprintln!("could not write the report: {err}"),
    }
}

criterion_group! {
    name = benches;
    // 18 settings; an iteration is a batch of 400,000 deliveries (100 ms or
    // more), sampled flat: 10 samples in about 5 s per setting, plus the
    // latency pass. Command-line flags still override these.
    config = Criterion::default()
        .warm_up_time(Duration::from_secs(1))
        .measurement_time(Duration::from_secs(5))
        .sample_size(10);
    targets = u_curve
}

fn main() {
    let work_ns = handler_work_ns();
    println!("handler work: {work_ns:.0} ns per call");
    let passes = latency_passes();
    benches();
    Criterion::default().configure_from_args().final_summary();
    if bench_mode() {
        write_report(&passes, work_ns);
    }
}
