//! What each delivery contract costs, end to end, against the default one:
//!
//! - `streams`: 100 stream subscriptions read by 100 tokio tasks; a
//!   publisher task on the same runtime sends bursts of 1,000 messages.
//!   `drop_oldest` publishes with `publish` into mailboxes of 1,024 and a burst ends when every reader has
//!   taken or lost all of it; `lossless` uses `publish_async` into
//!   `Backpressure` mailboxes of 64 (publishers wait for readers) and a burst
//!   ends when every reader has taken all of it. Time per publish.
//! - `handlers`: 1,000 handler subscriptions in the default mode (worker
//!   pool), each adding one to a shared counter; bursts of 100 publishes, end
//!   to end; `unordered` (`subscribe`) against `ordered`
//!   (`subscribe_ordered`). Time per publish.
//! - `interest`: `has_subscribers` on a warm topic.
//!
//! In bench mode it then sweeps both comparisons outside criterion (median
//! of 5 repetitions, alternating between the two contracts of a pair) across
//! mailbox capacities and subscription counts, and writes the table and
//! charts of `docs/contracts.md`.
//!
//! Each comparison's two setups are built before either is measured (see
//! [`measure_pair`]); `CONTRACTS_SEQUENCE` shows why ([`sequence_probe`]).
//!
//! `cargo bench --bench contracts`; targets and results in `docs/contracts.md`.
//! With `CONTRACTS_PAIR_ONLY=1`, the lossless target pair alone, three
//! times, each repetition printed.

mod common;

use std::cell::Cell;
use std::hint::black_box;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use blazesub::{Bus, DeliveryMode, Message, StreamOptions, StreamOverflow, Subscription};
use criterion::{criterion_group, Criterion};

use common::report::{criterion_results, format_ns, Chart, Report, Series, Table};
use common::service::{self, Completion};
use common::{bench_mode, runtime};

const STREAMS: usize = 100;
const STREAM_BURST: u64 = 1_000;
const HANDLERS: usize = 1_000;
const HANDLER_BURST: u64 = 100;

/// Spawns one reader task per stream; each adds what it took or lost to
/// `progress`, and the one that brings it to the burst's end completes it.
fn spawn_readers(
    rt: &tokio::runtime::Runtime,
    bus: &Bus<u64>,
    options: StreamOptions,
    progress: &Arc<AtomicU64>,
    completion: &Arc<Completion>,
) {
    for _ in 0..STREAMS {
        let mut rx = bus.subscribe_stream_with("s", options).expect("subscribe");
        let progress = Arc::clone(progress);
        let completion = Arc::clone(completion);
        rt.spawn(async move {
            let mut lost_seen = 0;
            while let Some(message) = rx.recv().await {
                black_box(message.data());
                let lost = rx.lost();
                let took = 1 + (lost - lost_seen);
                let before = progress.fetch_add(took, Ordering::Relaxed);
                completion.moved(before, before + took);
                lost_seen = lost;
            }
        });
    }
}

/// 100 streams of one contract read by 100 tasks, and a publisher task.
struct Streams {
    rt: tokio::runtime::Runtime,
    bus: Bus<u64>,
    progress: Arc<AtomicU64>,
    /// Unparks the bench's thread when `progress` reaches `target`.
    completion: Arc<Completion>,
    /// What `progress` reaches when every burst so far has been read.
    target: Cell<u64>,
    lossless: bool,
}

impl Streams {
    /// Lossless: `Backpressure` mailboxes written with `publish_async`;
    /// else drop-oldest ones written with `publish`.
    fn new(lossless: bool, capacity: usize) -> Self {
        let rt = runtime();
        let bus = Bus::<u64>::builder()
            .runtime(rt.handle().clone())
            .build()
            .expect("bus");
        let options = if lossless {
            StreamOptions::new(capacity).overflow(StreamOverflow::Backpressure)
        } else {
            StreamOptions::new(capacity)
        };
        let progress = Arc::new(AtomicU64::new(0));
        let completion = Completion::new(1);
        spawn_readers(&rt, &bus, options, &progress, &completion);
        Self {
            rt,
            bus,
            progress,
            completion,
            target: Cell::new(0),
            lossless,
        }
    }

    /// One burst, until every reader has taken (or lost) all of it. The
    /// bench's thread parks meanwhile: one that spins or yields is a third
    /// runnable thread beside the runtime's two workers on two cores, and
    /// it moved these figures by up to 3×, more for the contract whose
    /// publisher waits for its readers (see `common/service.rs`).
    fn burst(&self) {
        self.target
            .set(self.target.get() + STREAM_BURST * STREAMS as u64);
        self.completion.arm(self.target.get());
        let bus = self.bus.clone();
        let lossless = self.lossless;
        // The publisher is a task of the runtime, as in a service.
        let publisher = self.rt.spawn(async move {
            for n in 0..STREAM_BURST {
                if lossless {
                    bus.publish_async("s", n).await.expect("publish_async");
                } else {
                    bus.publish("s", n).expect("publish");
                }
            }
        });
        self.rt.block_on(publisher).expect("publisher");
        // With drop-oldest a reader may still lose the tail of a burst
        // later; a lost message is counted when the reader next takes one,
        // so the wait ends for both.
        self.completion.wait();
        debug_assert!(self.progress.load(Ordering::Acquire) >= self.target.get());
    }
}

/// Times each of a pair of setups in `group`, per publish: `burst` runs
/// one burst of `publishes` publishes. Both setups are built before either
/// is measured: a runtime and bus built after another one was dropped in
/// the same process ran 5–60% slower here (`CONTRACTS_SEQUENCE`, below),
/// and the setup measured second would carry that.
fn measure_pair(c: &mut Criterion, group: &str, pair: [(&str, &dyn Fn()); 2], publishes: u64) {
    let mut group = c.benchmark_group(group);
    for (name, burst) in pair {
        group.bench_function(name, |b| {
            b.iter_custom(|iters| {
                let start = Instant::now();
                for _ in 0..iters {
                    burst();
                }
                start.elapsed() / publishes as u32
            })
        });
    }
    group.finish();
}

fn streams_cases(c: &mut Criterion) {
    let drop_oldest = Streams::new(false, 1_024);
    let lossless = Streams::new(true, 64);
    measure_pair(
        c,
        "contracts_streams",
        [
            ("drop_oldest_publish", &|| drop_oldest.burst()),
            ("lossless_publish_async", &|| lossless.burst()),
        ],
        STREAM_BURST,
    );
}

/// Handler subscriptions of one kind in the default mode, each adding one
/// to a shared counter.
struct Handlers {
    bus: Bus<u64>,
    counter: Arc<AtomicU64>,
    /// Unparks the bench's thread when the burst's last handler call ran.
    completion: Arc<Completion>,
    count: usize,
    _subs: Vec<Subscription>,
    _rt: tokio::runtime::Runtime,
}

/// The bus both handler comparisons use: the default mode, with an ordered
/// log long enough that a burst loses nothing.
fn handlers_bus(rt: &tokio::runtime::Runtime) -> Bus<u64> {
    Bus::<u64>::builder()
        .delivery(DeliveryMode::WorkerPool)
        .stream_capacity(4_096)
        .runtime(rt.handle().clone())
        .build()
        .expect("bus")
}

impl Handlers {
    fn new(ordered: bool, count: usize) -> Self {
        let rt = runtime();
        let bus = handlers_bus(&rt);
        let counter = Arc::new(AtomicU64::new(0));
        let completion = Completion::new(1);
        let subs = (0..count)
            .map(|_| {
                let counter = Arc::clone(&counter);
                let completion = Arc::clone(&completion);
                let handler = move |_: &Message<u64>| {
                    completion.counted(counter.fetch_add(1, Ordering::Relaxed) + 1);
                };
                if ordered {
                    bus.subscribe_ordered("h", handler).expect("subscribe")
                } else {
                    bus.subscribe("h", handler).expect("subscribe")
                }
            })
            .collect();
        Self {
            bus,
            counter,
            completion,
            count,
            _subs: subs,
            _rt: rt,
        }
    }

    /// One burst, until every handler has run for all of it; the bench's
    /// thread publishes, then parks (see [`Streams::burst`]).
    fn burst(&self) {
        let target = self.counter.load(Ordering::Acquire) + HANDLER_BURST * self.count as u64;
        self.completion.arm(target);
        for n in 0..HANDLER_BURST {
            self.bus.publish("h", black_box(n)).expect("publish");
        }
        self.completion.wait();
    }
}

fn handlers_cases(c: &mut Criterion) {
    let unordered = Handlers::new(false, HANDLERS);
    let ordered = Handlers::new(true, HANDLERS);
    measure_pair(
        c,
        "contracts_handlers_1000",
        [
            ("unordered", &|| unordered.burst()),
            ("ordered", &|| ordered.burst()),
        ],
        HANDLER_BURST,
    );
}

/// Median time per publish of two setups' bursts: 5 repetitions of `bursts`
/// bursts each, alternating between them after a warm-up.
fn alternating_medians(
    a: &dyn Fn(),
    b: &dyn Fn(),
    bursts: usize,
    publishes_per_burst: u64,
) -> (f64, f64) {
    for _ in 0..2 {
        a();
        b();
    }
    let time = |f: &dyn Fn()| {
        let start = Instant::now();
        for _ in 0..bursts {
            f();
        }
        start.elapsed().as_nanos() as f64 / (bursts as u64 * publishes_per_burst) as f64
    };
    let mut times_a = Vec::new();
    let mut times_b = Vec::new();
    for _ in 0..REPETITIONS {
        times_a.push(time(a));
        times_b.push(time(b));
    }
    if std::env::var_os("CONTRACTS_PAIR_ONLY").is_some() {
        println!("  repetitions: {times_a:.0?} | {times_b:.0?}");
    }
    (median(&mut times_a), median(&mut times_b))
}

const REPETITIONS: usize = 5;

fn median(values: &mut [f64]) -> f64 {
    values.sort_by(f64::total_cmp);
    values[values.len() / 2]
}

/// One point of a sweep: x, the default contract's and the other's median
/// ns per publish.
type Point = (f64, f64, f64);

/// Drop-oldest against lossless across mailbox capacities.
fn sweep_streams() -> Vec<Point> {
    [16usize, 64, 256, 1_024]
        .into_iter()
        .map(|capacity| {
            let lossy = Streams::new(false, capacity);
            let lossless = Streams::new(true, capacity);
            let (a, b) =
                alternating_medians(&|| lossy.burst(), &|| lossless.burst(), 10, STREAM_BURST);
            println!("streams, capacity {capacity}: drop-oldest {a:.0} ns, lossless {b:.0} ns");
            (capacity as f64, a, b)
        })
        .collect()
}

/// The target's pair, as criterion measures it (drop-oldest mailboxes of
/// 1,024 that lose nothing in a burst, lossless ones of 64), alternating.
fn streams_target_pair() -> Point {
    let lossy = Streams::new(false, 1_024);
    let lossless = Streams::new(true, 64);
    let (a, b) = alternating_medians(&|| lossy.burst(), &|| lossless.burst(), 10, STREAM_BURST);
    println!("streams, target pair: drop-oldest (1,024) {a:.0} ns, lossless (64) {b:.0} ns");
    (64.0, a, b)
}

/// Unordered against ordered handlers across subscription counts.
fn sweep_handlers() -> Vec<Point> {
    [10usize, 100, 1_000]
        .into_iter()
        .map(|count| {
            let unordered = Handlers::new(false, count);
            let ordered = Handlers::new(true, count);
            let (a, b) = alternating_medians(
                &|| unordered.burst(),
                &|| ordered.burst(),
                20,
                HANDLER_BURST,
            );
            println!("handlers, {count}: unordered {a:.0} ns, ordered {b:.0} ns");
            (count as f64, a, b)
        })
        .collect()
}

fn interest_case(c: &mut Criterion) {
    let bus = Bus::<u64>::builder()
        .delivery(DeliveryMode::Inline)
        .build()
        .expect("bus");
    let _sub = bus.subscribe("sensors/+/temp", |_| {}).expect("subscribe");
    assert!(bus.has_subscribers("sensors/a/temp"));
    let mut group = c.benchmark_group("contracts_interest");
    group.bench_function("has_subscribers_warm", |b| {
        b.iter(|| bus.has_subscribers(black_box("sensors/a/temp")))
    });
    group.finish();
}

fn contracts(c: &mut Criterion) {
    streams_cases(c);
    handlers_cases(c);
    interest_case(c);
}

criterion_group! {
    name = benches;
    config = Criterion::default()
        .warm_up_time(Duration::from_secs(1))
        .measurement_time(Duration::from_secs(3))
        .sample_size(20);
    targets = contracts
}

/// The handlers comparison in the service setting (`common::service`): the
/// publisher a task on a 2-worker runtime, bursts of 10,000 publishes, the
/// bench's thread parked until the last handler call; medians of 5
/// repetitions alternating between the two contracts. ns per publish,
/// (unordered, ordered).
fn service_handlers() -> (f64, f64) {
    const REPETITIONS: usize = 5;
    const PUBLISHES: u64 = 10_000;
    let rt = runtime();
    let mut setups: Vec<_> = [false, true]
        .into_iter()
        .map(|ordered| {
            let bus = handlers_bus(&rt);
            let workload = if ordered {
                service::ordered_shared_counter(&bus, "h", HANDLERS)
            } else {
                service::shared_counter(&bus, "h", HANDLERS)
            };
            (bus, vec![workload], Vec::new())
        })
        .collect();
    for (bus, workloads, _) in &mut setups {
        service::burst(&rt, bus, workloads, PUBLISHES); // warm-up
    }
    for _ in 0..REPETITIONS {
        for (bus, workloads, samples) in &mut setups {
            let time = service::burst(&rt, bus, workloads, PUBLISHES);
            samples.push(time.as_nanos() as f64 / PUBLISHES as f64);
        }
    }
    let median = |samples: &[f64]| service::spread(samples).0;
    let (unordered, ordered) = (median(&setups[0].2), median(&setups[1].2));
    println!(
        "handlers, service setting: unordered {unordered:.0} ns, ordered {ordered:.0} ns \
         ({:.2}×)",
        ordered / unordered
    );
    (unordered, ordered)
}

/// `CONTRACTS_SEQUENCE`, e.g. `D,L`: builds the streams setups named in
/// turn (`D` drop-oldest of 1,024, `L` lossless of 64) and times three
/// 600 ms stretches of bursts of each, dropping each before the next is
/// built unless it is suffixed `k` (kept alive to the end). It shows the
/// order effect the criterion cases avoid: `D,L` against `Dk,L`.
fn sequence_probe(sequence: &str) {
    let mut kept = Vec::new();
    for step in sequence.split(',') {
        let lossless = step.starts_with('L');
        let streams = Streams::new(lossless, if lossless { 64 } else { 1_024 });
        let mut times = Vec::new();
        for _ in 0..3 {
            let start = Instant::now();
            let mut bursts = 0;
            while start.elapsed() < Duration::from_millis(600) {
                streams.burst();
                bursts += 1;
            }
            times.push(start.elapsed().as_nanos() as f64 / (bursts * STREAM_BURST) as f64);
        }
        print!("{step}: {times:.0?}  ");
        if step.ends_with('k') {
            kept.push(streams);
        }
    }
    println!("(ns per publish)");
}

fn main() {
    if let Ok(sequence) = std::env::var("CONTRACTS_SEQUENCE") {
        sequence_probe(&sequence);
        return;
    }
    if std::env::var_os("CONTRACTS_PAIR_ONLY").is_some() {
        // The lossless target pair alone, three times in one process, each
        // with its repetitions: how steady it is, no report written.
        for _ in 0..3 {
            streams_target_pair();
        }
        return;
    }
    benches();
    Criterion::default().configure_from_args().final_summary();
    if bench_mode() {
        write_report(
            &streams_target_pair(),
            &sweep_streams(),
            &sweep_handlers(),
            service_handlers(),
        );
    }
}

fn write_report(pair: &Point, streams: &[Point], handlers: &[Point], service: (f64, f64)) {
    let mut report = Report::new(
        "contracts",
        "Delivery contracts: what each costs against the default",
        &["blazesub", "tokio", "criterion"],
    );
    let streams_results = criterion_results("contracts_streams");
    let handlers_results = criterion_results("contracts_handlers_1000");
    let interest_results = criterion_results("contracts_interest");
    let ns = |results: &std::collections::BTreeMap<String, common::report::Estimate>,
              name: &str| results.get(name).map_or(f64::NAN, |e| e.mean_ns);
    let drop_oldest = ns(&streams_results, "drop_oldest_publish");
    let lossless = ns(&streams_results, "lossless_publish_async");
    let unordered = ns(&handlers_results, "unordered");
    let ordered = ns(&handlers_results, "ordered");
    let interest = ns(&interest_results, "has_subscribers_warm");
    let met = |ok: bool| if ok { "yes" } else { "**no**" }.to_owned();
    let mut targets = Table::new(
        "Targets (criterion, time per publish, end to end)",
        &[
            "case",
            "default contract",
            "this contract",
            "ratio",
            "ratio, alternating medians",
            "target",
            "met?",
        ],
    );
    // The same comparisons measured alternately (5 repetitions, switching
    // between the two in one process): steadier than two criterion cases
    // run one after the other.
    let sweep_ratio = |points: &[Point], x: f64| {
        points
            .iter()
            .find(|(at, _, _)| *at == x)
            .map_or(f64::NAN, |(_, a, b)| b / a)
    };
    let lossless_alt = pair.2 / pair.1;
    let ordered_alt = sweep_ratio(handlers, HANDLERS as f64);
    targets.row(vec![
        "100 streams: lossless `publish_async` (64) vs drop-oldest `publish` (1,024)".into(),
        format_ns(drop_oldest),
        format_ns(lossless),
        format!("{:.2}×", lossless / drop_oldest),
        format!("{lossless_alt:.2}×"),
        "≤ 1.5×".into(),
        met(lossless / drop_oldest <= 1.5 && lossless_alt <= 1.5),
    ]);
    targets.row(vec![
        "1,000 handlers, default mode: `subscribe_ordered` vs `subscribe`".into(),
        format_ns(unordered),
        format_ns(ordered),
        format!("{:.2}×", ordered / unordered),
        format!("{ordered_alt:.2}×"),
        "≤ 1.5×".into(),
        met(ordered / unordered <= 1.5 && ordered_alt <= 1.5),
    ]);
    let (service_unordered, service_ordered) = service;
    targets.row(vec![
        "the same, service setting: publisher a runtime task".into(),
        format_ns(service_unordered),
        format_ns(service_ordered),
        "—".into(),
        format!("{:.2}×", service_ordered / service_unordered),
        "≤ 1.5×".into(),
        met(service_ordered / service_unordered <= 1.5),
    ]);
    targets.row(vec![
        "`has_subscribers` on a warm topic".into(),
        "—".into(),
        format_ns(interest),
        "—".into(),
        "—".into(),
        "< 50 ns".into(),
        met(interest < 50.0),
    ]);
    targets.note = "Streams: 100 subscriptions read by 100 tokio tasks on a 2-worker runtime, \
                    bursts of 1,000 publishes from a task of that runtime, timed until every \
                    reader took (or lost) all of it; drop-oldest mailboxes of 1,024 (a burst \
                    loses nothing), lossless ones of 64. The alternating ratio measures the \
                    same pair in turn in one process. Handlers: each adds one to a shared \
                    counter; bursts of 100 publishes from the bench's thread, timed until every \
                    handler ran. Service setting: the publisher a task of a 2-worker runtime, \
                    bursts of 10,000, medians of 5 repetitions alternating between the two \
                    contracts. In every case the bench's thread parks until the call that \
                    completes the burst wakes it (a waiter that spins is a third runnable \
                    thread on two cores)."
        .into();
    let mut sweep = Table::new(
        "Sweeps (median of 5 repetitions, alternating; both contracts at the same capacity)",
        &[
            "comparison",
            "x",
            "default contract",
            "this contract",
            "ratio",
        ],
    );
    sweep.note = "With both at a small capacity, drop-oldest readers skip what they lost, so \
                  they do less work than lossless ones, which wait for every message."
        .into();
    for (x, a, b) in streams {
        sweep.row(vec![
            "lossless vs drop-oldest, mailbox capacity".into(),
            format!("{x:.0}"),
            format_ns(*a),
            format_ns(*b),
            format!("{:.2}×", b / a),
        ]);
    }
    for (x, a, b) in handlers {
        sweep.row(vec![
            "ordered vs unordered, subscriptions".into(),
            format!("{x:.0}"),
            format_ns(*a),
            format_ns(*b),
            format!("{:.2}×", b / a),
        ]);
    }
    let chart =
        |file: &str, title: &str, x_label: &str, names: [&str; 2], points: &[Point]| Chart {
            file: file.into(),
            title: title.into(),
            x_label: x_label.into(),
            y_label: "ns per publish".into(),
            log_x: true,
            log_y: true,
            series: vec![
                Series {
                    name: names[0].into(),
                    points: points.iter().map(|(x, a, _)| (*x, *a)).collect(),
                },
                Series {
                    name: names[1].into(),
                    points: points.iter().map(|(x, _, b)| (*x, *b)).collect(),
                },
            ],
        };
    report.tables = vec![targets, sweep];
    report.charts = vec![
        chart(
            "contracts-streams",
            "100 streams: time per publish vs mailbox capacity",
            "mailbox capacity",
            ["drop-oldest publish", "lossless publish_async"],
            streams,
        ),
        chart(
            "contracts-handlers",
            "Handlers in the default mode: time per publish vs subscriptions",
            "subscriptions",
            ["subscribe", "subscribe_ordered"],
            handlers,
        ),
    ];
    match report.save() {
        Ok(()) => println!("wrote docs/contracts.md"),
        Err(err) => eprintln!("could not write the report: {err}"),
    }
}
