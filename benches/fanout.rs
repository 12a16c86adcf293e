//! Fan-out, end to end: one topic, 1,000 subscribers whose handler adds one to
//! a shared `AtomicU64` (BlazeSub's own throughput bench), 12-byte payloads.
//!
//! Each iteration publishes a burst of 100 messages and stops the clock only
//! when every handler has run for every message; the figure is per publish.
//! In the same run, a raw loop calling the same 1,000 closures gives the lower
//! bound.
//!
//! Before the criterion groups, the bench measures allocations and bytes per
//! publish for 10, 1,000 and 100,000 subscribers in every mode with a counting
//! global allocator. After them (bench mode only) it measures each setup's
//! ratio to the raw loop a second way, alternating raw and bus bursts so the
//! machine's drift cancels, and writes `docs/fanout.md` (tables and chart, see
//! `common/report.rs`).
//!
//! Then, in the **service setting** (`common/service.rs`): the publisher is
//! a task on a 2-worker tokio runtime, as in a service. Two shapes: 1,000
//! handlers on one shared counter (ns per publish against the raw loop run
//! by a task), and 500 handlers per topic each on a counter of its own, with
//! one and two publisher tasks (deliveries per second against `Inline`, and
//! against the same closures in a raw loop run by one or two tasks: with
//! two, how steadily the machine runs two busy runtime threads, no bus
//! involved).
//! Each setup runs 5 repetitions of bursts of 10,000 publishes, alternating
//! between setups; the tables give the median and the spread.
//!
//! `cargo bench --bench fanout`; with `FANOUT_SERVICE_ONLY=1`, the service
//! setting alone (see `benches/service_processes.sh`, which runs it in ten
//! fresh processes).

mod common;

use std::hint::black_box;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Instant;

use blazesub::{Batch, Bus, DeliveryMode};
use criterion::{criterion_group, Criterion};

use common::report::{criterion_results, format_ns, Chart, Report, Series, Table};
use common::{
    alloc_snapshot, bench_mode, counting_subscribers, runtime, time_bursts, wait_for,
    CountingAllocator, Payload, Setup, BURST,
};
use common::{cores, placement, service};

#[global_allocator]
static ALLOCATOR: CountingAllocator = CountingAllocator;

const TOPIC: &str = "bench/fanout";
const SUBSCRIBERS: usize = 1_000;
const PAYLOAD: Payload = *b"twelve bytes";

/// Every mode at its default settings, plus the variants worth comparing.
const SETUPS: [Setup; 6] = [
    Setup::defaults("worker_pool", DeliveryMode::WorkerPool),
    Setup::defaults("task_per_subscriber", DeliveryMode::TaskPerSubscriber),
    Setup::defaults("inline", DeliveryMode::Inline),
    Setup {
        name: "worker_pool_batch_single",
        batch: Batch::Single,
        ..Setup::defaults("", DeliveryMode::WorkerPool)
    },
    Setup {
        name: "task_per_subscriber_batch_single",
        batch: Batch::Single,
        ..Setup::defaults("", DeliveryMode::TaskPerSubscriber)
    },
    Setup {
        name: "worker_pool_1_worker",
        workers: Some(1),
        ..Setup::defaults("", DeliveryMode::WorkerPool)
    },
];

fn fanout(c: &mut Criterion) {
    let rt = runtime();
    let mut group = c.benchmark_group("fanout_1000");

    let counter = Arc::new(AtomicU64::new(0));
    let closures = raw_closures(&counter);
    group.bench_function("raw_loop", |b| {
        b.iter_custom(|iters| raw_loop(&closures, iters * BURST) / BURST as u32)
    });

    for setup in SETUPS {
        let bus = setup.build::<Payload>(&rt);
        let (counter, _subscriptions) = counting_subscribers(&bus, TOPIC, SUBSCRIBERS);
        group.bench_function(setup.name, |b| {
            b.iter_custom(|iters| {
                time_bursts(&bus, TOPIC, &PAYLOAD, &counter, SUBSCRIBERS as u64, iters)
            })
        });
    }
    group.finish();
}

/// Allocations and bytes per publish, end to end, for one mode and
/// subscriber count.
struct AllocRow {
    setup: &'static str,
    subscribers: usize,
    allocations: f64,
    bytes: f64,
}

fn allocations_per_publish() -> Vec<AllocRow> {
    let rt = runtime();
    let publishes: u64 = if bench_mode() { 2_000 } else { 50 };
    let mut rows = Vec::new();
    for setup in &SETUPS[..3] {
        for subscribers in [10usize, 1_000, 100_000] {
            let bus = setup.build::<Payload>(&rt);
            let (counter, _subscriptions) = counting_subscribers(&bus, TOPIC, subscribers);
            // Warm the route cache and the pool.
            for _ in 0..10 {
                bus.publish(TOPIC, PAYLOAD).expect("publish");
            }
            wait_for(&counter, 10 * subscribers as u64);
            let before = alloc_snapshot();
            for _ in 0..publishes {
                bus.publish(TOPIC, PAYLOAD).expect("publish");
            }
            wait_for(&counter, (10 + publishes) * subscribers as u64);
            let (allocations, bytes) = alloc_snapshot().per_op_since(before, publishes);
            println!(
                "{:>20} {subscribers:>7} subscribers: {allocations:.2} allocations, {bytes:.0} bytes per publish",
                setup.name
            );
            rows.push(AllocRow {
                setup: setup.name,
                subscribers,
                allocations,
                bytes,
            });
        }
    }
    rows
}

/// Closures doing what the bench's handlers do, for the raw loop.
type Closure = Box<dyn Fn(&Payload) + Send + Sync>;

fn raw_closures(counter: &Arc<AtomicU64>) -> Vec<Closure> {
    (0..SUBSCRIBERS)
        .map(|_| {
            let counter = Arc::clone(counter);
            Box::new(move |_: &Payload| {
                counter.fetch_add(1, Ordering::Relaxed);
            }) as Closure
        })
        .collect()
}

fn raw_loop(closures: &[Closure], publishes: u64) -> std::time::Duration {
    let start = Instant::now();
    for _ in 0..publishes {
        let payload = black_box(PAYLOAD);
        for closure in closures {
            closure(&payload);
        }
    }
    start.elapsed()
}

/// The ratio to the raw loop, measured so that the machine's drift cancels
/// out: rounds alternate a raw-loop burst and a bus burst of the same size,
/// and the median of the per-round ratios is kept (with its quartiles).
/// Criterion times each setup seconds apart; on this shared machine their
/// ratio moved by up to 30% between runs, this one by a few percent.
struct Interleaved {
    median: f64,
    low: f64,
    high: f64,
}

fn interleaved_ratios() -> Vec<(&'static str, Interleaved)> {
    const ROUNDS: usize = 41;
    const BURSTS: u64 = 5;
    let rt = runtime();
    let raw_counter = Arc::new(AtomicU64::new(0));
    let closures = raw_closures(&raw_counter);
    SETUPS
        .iter()
        .map(|setup| {
            let bus = setup.build::<Payload>(&rt);
            let (counter, _subscriptions) = counting_subscribers(&bus, TOPIC, SUBSCRIBERS);
            let mut ratios: Vec<f64> = (0..ROUNDS)
                .map(|_| {
                    // Each side first runs once untimed, so neither is timed
                    // with caches the other just filled.
                    raw_loop(&closures, BURST);
                    let raw = raw_loop(&closures, BURSTS * BURST) / (BURSTS * BURST) as u32;
                    time_bursts(&bus, TOPIC, &PAYLOAD, &counter, SUBSCRIBERS as u64, 1);
                    let bus =
                        time_bursts(&bus, TOPIC, &PAYLOAD, &counter, SUBSCRIBERS as u64, BURSTS)
                            / BURSTS as u32;
                    bus.as_secs_f64() / raw.as_secs_f64()
                })
                .collect();
            ratios.sort_by(f64::total_cmp);
            let ratio = Interleaved {
                median: ratios[ROUNDS / 2],
                low: ratios[ROUNDS / 4],
                high: ratios[3 * ROUNDS / 4],
            };
            println!(
                "{:>32}: {:.2}× the raw loop (interleaved median; quartiles {:.2}–{:.2})",
                setup.name, ratio.median, ratio.low, ratio.high
            );
            (setup.name, ratio)
        })
        .collect()
}

/// One publisher task per topic in the service setting (see
/// `common/service.rs`): per setup, the median, fastest and slowest of the
/// repetitions, which alternate between setups so drift hits all alike.
struct ServiceRow {
    setup: String,
    /// ns per publish (shape 1) or million deliveries per second (shape 2).
    median: f64,
    fastest: f64,
    slowest: f64,
}

/// Repetitions and burst size of the service-setting measurements.
fn service_sizes() -> (usize, u64) {
    if bench_mode() {
        (5, 10_000)
    } else {
        (1, 100)
    }
}

/// With `BLAZESUB_PLACEMENT=1`, a sampler of where the kernel runs the pool's
/// workers during a `worker_pool` setup's burst (see `common/placement.rs`).
fn pool_placement(setup: &str) -> Option<placement::Sampler> {
    if setup.starts_with("worker_pool") {
        placement::Sampler::start()
    } else {
        None
    }
}

/// Shape 1: one publisher task, 1,000 handlers on one shared counter, each
/// mode at its defaults and the raw loop in a task; ns per publish.
fn service_shared_counter() -> Vec<ServiceRow> {
    let (repetitions, publishes) = service_sizes();
    let rt = runtime();
    let raw = service::raw_shared_counter(SUBSCRIBERS);
    let raw_entry_sized = service::raw_shared_counter_entry_sized(SUBSCRIBERS);
    let mut setups: Vec<_> = SETUPS[..3]
        .iter()
        .map(|setup| {
            let bus = setup.build::<u64>(&rt);
            let workload = service::shared_counter(&bus, TOPIC, SUBSCRIBERS);
            (setup.name, bus, vec![workload], Vec::new())
        })
        .collect();
    let (mut raw_samples, mut raw_entry_sized_samples) = (Vec::new(), Vec::new());
    // A warm-up burst each, untimed.
    service::raw_burst(&rt, &raw, publishes);
    service::raw_burst(&rt, &raw_entry_sized, publishes);
    for (_, bus, workloads, _) in &mut setups {
        service::burst(&rt, bus, workloads, publishes);
    }
    for _ in 0..repetitions {
        let raw_time = service::raw_burst(&rt, &raw, publishes);
        raw_samples.push(raw_time.as_nanos() as f64 / publishes as f64);
        let raw_time = service::raw_burst(&rt, &raw_entry_sized, publishes);
        raw_entry_sized_samples.push(raw_time.as_nanos() as f64 / publishes as f64);
        for (name, bus, workloads, samples) in &mut setups {
            let placement = pool_placement(name);
            let time = service::burst(&rt, bus, workloads, publishes);
            let ns = time.as_nanos() as f64 / publishes as f64;
            samples.push(ns);
            if let Some(sampler) = placement {
                println!(
                    "service, shared counter {name:>20}: repetition {ns:.0} ns/publish; {}",
                    sampler.finish()
                );
            }
        }
    }
    [
        ("raw_loop", raw_samples),
        ("raw_loop_entry_sized", raw_entry_sized_samples),
    ]
    .into_iter()
    .chain(
        setups
            .into_iter()
            .map(|(name, _, _, samples)| (name, samples)),
    )
    .map(|(name, samples)| {
        let (median, fastest, slowest) = service::spread(&samples);
        println!(
            "service, shared counter {name:>20}: median {median:.0} ns/publish, \
                 repetitions {fastest:.0}–{slowest:.0} (in order: {})",
            service::in_order(&samples)
        );
        ServiceRow {
            setup: name.to_owned(),
            median,
            fastest,
            slowest,
        }
    })
    .collect()
}

/// Shape 2: 500 handlers per topic, each on a counter of its own; one or
/// two publisher tasks (one topic each); million deliveries per second.
/// Also returns the cache-line round trip between the CPUs measured before
/// each round of repetitions (see `common/cores.rs`): two publishers
/// scale with it.
fn service_own_counters() -> (Vec<ServiceRow>, Vec<f64>) {
    const PER_TOPIC: usize = 500;
    let (repetitions, publishes) = service_sizes();
    let rt = runtime();
    // Each mode with one and two publishers, and the threaded modes again
    // with two publishers whose topics got one home (see `one_home`).
    let mut setups: Vec<_> = SETUPS[..3]
        .iter()
        .flat_map(|setup| {
            let shared_home = setup.mode != DeliveryMode::Inline;
            [(setup, 1usize, false), (setup, 2, false)]
                .into_iter()
                .chain(shared_home.then_some((setup, 2, true)))
        })
        .map(|(setup, publishers, shared_home)| {
            let bus = setup.build::<u64>(&rt);
            let topics: Vec<String> = (0..publishers).map(|p| format!("{TOPIC}/{p}")).collect();
            if shared_home {
                one_home(&bus, &topics);
            }
            let workloads: Vec<_> = topics
                .iter()
                .map(|topic| service::own_counters(&bus, topic, PER_TOPIC))
                .collect();
            let name = format!(
                "{} ({publishers} publisher{}{})",
                setup.name,
                if publishers == 1 { "" } else { "s" },
                if shared_home { ", one home" } else { "" }
            );
            (name, bus, workloads, Vec::new())
        })
        .collect();
    for (_, bus, workloads, _) in &mut setups {
        service::burst(&rt, bus, workloads, publishes);
    }
    // The same closures in a raw loop, a task per publisher: what the
    // machine gets done with no bus, and how steadily (its two-publisher
    // repetitions show how the kernel places two busy runtime threads).
    let mut raws: Vec<_> = [1usize, 2]
        .into_iter()
        .map(|publishers| {
            let sets: Vec<_> = (0..publishers)
                .map(|_| service::raw_own_counters(PER_TOPIC))
                .collect();
            let name = format!(
                "raw_loop ({publishers} publisher{})",
                if publishers == 1 { "" } else { "s" }
            );
            (name, sets, Vec::new())
        })
        .collect();
    for (_, sets, _) in &raws {
        service::raw_bursts(&rt, sets, publishes);
    }
    let mut round_trips = Vec::new();
    for _ in 0..repetitions {
        let round_trip = cores::line_round_trip_ns();
        println!("cpus: cache-line round trip {round_trip:.0} ns");
        round_trips.push(round_trip);
        for (name, sets, samples) in &mut raws {
            let deliveries = publishes as f64 * (PER_TOPIC * sets.len()) as f64;
            let before = placement::ThreadTimes::now();
            let time = service::raw_bursts(&rt, sets, publishes);
            let rate = deliveries / time.as_secs_f64() / 1e6;
            samples.push(rate);
            if let Some(threads) = before
                .zip(placement::ThreadTimes::now())
                .map(|(before, after)| after.since(&before))
            {
                println!(
                    "service, own counters {name:>34}: repetition {rate:.0} M deliveries/s in {:.1} ms; {threads}",
                    time.as_secs_f64() * 1e3,
                );
            }
        }
        for (name, bus, workloads, samples) in &mut setups {
            let deliveries = publishes as f64 * (PER_TOPIC * workloads.len()) as f64;
            let placement = pool_placement(name);
            let before = placement::ThreadTimes::now();
            let time = service::burst(&rt, bus, workloads, publishes);
            let rate = deliveries / time.as_secs_f64() / 1e6;
            samples.push(rate);
            // Each thread's time on a core tells a thread that was kept off
            // one (a long wait: stacked with another) from one that ran the
            // whole burst slower (the host's doing: see `cores.rs`). For
            // every setup: `inline`'s two publishers are stacked too.
            if let Some(threads) = before
                .zip(placement::ThreadTimes::now())
                .map(|(before, after)| after.since(&before))
            {
                let sampled = placement
                    .map(|sampler| format!("; {}", sampler.finish()))
                    .unwrap_or_default();
                println!(
                    "service, own counters {name:>34}: repetition {rate:.0} M deliveries/s in {:.1} ms{sampled}; {threads}",
                    time.as_secs_f64() * 1e3,
                );
            }
        }
    }
    let rows = raws
        .into_iter()
        .map(|(name, _, samples)| (name, samples))
        .chain(
            setups
                .into_iter()
                .map(|(name, _, _, samples)| (name, samples)),
        )
        .map(|(name, samples)| {
            let (median, slowest, fastest) = service::spread(&samples);
            println!(
                "service, own counters {name:>34}: median {median:.0} M deliveries/s, \
                 repetitions {slowest:.0}–{fastest:.0} (in order: {})",
                service::in_order(&samples)
            );
            ServiceRow {
                setup: name,
                median,
                fastest,
                slowest,
            }
        })
        .collect();
    (rows, round_trips)
}

/// Gives the routes of two `topics` one home: routes get homes in turn at
/// their first publish, so publishing to the first, a topic between and
/// the second (before anyone subscribes: nothing is delivered) gives them
/// homes 0 and 2, one worker or lane of two. A service's busy topics meet
/// like this whenever they are not the first ones it publishes to.
fn one_home(bus: &Bus<u64>, topics: &[String]) {
    let [first, second] = topics else {
        panic!("two topics");
    };
    for topic in [first.as_str(), "service/between", second.as_str()] {
        bus.publish(topic, 0).expect("publish");
    }
}

fn write_report(
    allocations: &[AllocRow],
    interleaved: &[(&'static str, Interleaved)],
    shared: &[ServiceRow],
    own: &[ServiceRow],
    round_trips: &[f64],
) {
    let results = criterion_results("fanout_1000");
    let Some(raw) = results.get("raw_loop") else {
        eprintln!("no criterion results for fanout_1000/raw_loop; report not written");
        return;
    };
    let mut report = Report::new(
        "fanout",
        "Fan-out to 1,000 subscribers, end to end",
        &["blazesub", "tokio", "crossbeam-queue", "criterion"],
    );
    let mut times = Table::new(
        "Time per publish until all 1,000 handlers ran",
        &[
            "setup",
            "time (criterion)",
            "95% interval",
            "× raw loop (criterion)",
            "× raw loop (interleaved median)",
            "quartiles",
        ],
    );
    times.note = "Handlers add one to a shared `AtomicU64`; 12-byte payloads; bursts of \
                  100 publishes, each burst timed until every handler ran. `raw_loop` \
                  calls the same 1,000 closures in a plain loop. The interleaved ratio \
                  alternates raw-loop and bus bursts of 500 publishes (each after an \
                  untimed warm-up of its own) for 41 rounds and keeps the median of the \
                  per-round ratios: it cancels the machine's drift, which moved the \
                  criterion ratio by up to 30% between runs, but its bursts start from \
                  idle workers, where criterion's follow each other."
        .into();
    for id in std::iter::once("raw_loop").chain(SETUPS.iter().map(|s| s.name)) {
        if let Some(e) = results.get(id) {
            let (median, quartiles) = match interleaved.iter().find(|(name, _)| *name == id) {
                Some((_, r)) => (
                    format!("{:.2}×", r.median),
                    format!("{:.2}–{:.2}", r.low, r.high),
                ),
                None => ("1.00×".into(), "—".into()),
            };
            times.row(vec![
                format!("`{id}`"),
                format_ns(e.mean_ns),
                format!("{} – {}", format_ns(e.low_ns), format_ns(e.high_ns)),
                format!("{:.2}×", e.mean_ns / raw.mean_ns),
                median,
                quartiles,
            ]);
        }
    }
    let mut allocs = Table::new(
        "Allocations per publish, end to end",
        &[
            "mode",
            "subscribers",
            "allocations / publish",
            "bytes / publish",
        ],
    );
    allocs.note = "Counted by a global allocator over 2,000 publishes after a warm-up, \
                   on every thread, until every handler ran."
        .into();
    let mut chart = Chart {
        file: "fanout-allocations".into(),
        title: "Allocations per publish vs subscribers".into(),
        x_label: "subscribers".into(),
        y_label: "allocations per publish".into(),
        log_x: true,
        ..Chart::default()
    };
    for row in allocations {
        allocs.row(vec![
            format!("`{}`", row.setup),
            row.subscribers.to_string(),
            format!("{:.2}", row.allocations),
            format!("{:.0}", row.bytes),
        ]);
        match chart.series.iter_mut().find(|s| s.name == row.setup) {
            Some(series) => series
                .points
                .push((row.subscribers as f64, row.allocations)),
            None => chart.series.push(Series {
                name: row.setup.into(),
                points: vec![(row.subscribers as f64, row.allocations)],
            }),
        }
    }
    let raw_median = shared
        .iter()
        .find(|row| row.setup == "raw_loop")
        .map_or(f64::NAN, |row| row.median);
    let mut service_times = Table::new(
        "Service setting: one publisher task, 1,000 handlers on one shared counter",
        &[
            "setup",
            "median per publish",
            "× raw loop",
            "repetitions",
            "slowest ÷ fastest",
        ],
    );
    service_times.note = "The publisher is a task on a 2-worker tokio runtime; bursts of 10,000 \
                          publishes, timed until every handler ran (the bench's thread parks \
                          meanwhile); 5 repetitions alternating between setups. `raw_loop` is \
                          the same closures called in a loop by a task; `raw_loop_entry_sized` \
                          pads each closure to a 48-byte heap chunk instead of 32, the size a \
                          subscription's entry took until the forty-first session: what the same \
                          loop costs walking a third more memory a handler (the bus's entries \
                          now take the raw loop's 32)."
        .into();
    for row in shared {
        service_times.row(vec![
            format!("`{}`", row.setup),
            format_ns(row.median),
            format!("{:.2}×", row.median / raw_median),
            format!("{} – {}", format_ns(row.fastest), format_ns(row.slowest)),
            format!("{:.2}", row.slowest / row.fastest),
        ]);
    }
    let inline_one = own
        .iter()
        .find(|row| row.setup.starts_with("inline (1"))
        .map_or(f64::NAN, |row| row.median);
    let inline_two = own
        .iter()
        .find(|row| row.setup.starts_with("inline (2"))
        .map_or(f64::NAN, |row| row.median);
    let mut service_rates = Table::new(
        "Service setting: 500 handlers per topic, each on a counter of its own",
        &[
            "setup",
            "median, M deliveries/s",
            "÷ inline, 1 publisher",
            "÷ inline, 2 publishers",
            "repetitions",
            "fastest ÷ slowest",
        ],
    );
    let round_trips: Vec<String> = round_trips.iter().map(|ns| format!("{ns:.0}")).collect();
    service_rates.note = format!(
        "One publisher task per topic on a 2-worker tokio runtime; bursts of 10,000 publishes \
         per publisher, timed until every handler ran; 5 repetitions alternating between \
         setups. A cache-line round trip between the two CPUs, measured before each round of \
         repetitions: {} ns (about 32 ns: the host runs both virtual CPUs on one core's two \
         hyperthreads, where two publishers get about 1.4× one publisher's work done; about \
         66 ns: on two cores, 2×; `benches/common/cores.rs`). \"one home\": the two topics' \
         routes got the same home (the first and the third topic the bus published to), \
         as two busy topics of a service often do.",
        round_trips.join(", ")
    );
    for row in own {
        service_rates.row(vec![
            format!("`{}`", row.setup),
            format!("{:.0}", row.median),
            format!("{:.2}", row.median / inline_one),
            format!("{:.2}", row.median / inline_two),
            format!("{:.0} – {:.0}", row.slowest, row.fastest),
            format!("{:.2}", row.fastest / row.slowest),
        ]);
    }
    report.tables = vec![times, allocs, service_times, service_rates];
    report.charts = vec![chart];
    match report.save() {
        Ok(()) => println!("wrote docs/fanout.md"),
        Err(err) => eprintln!("could not write the report: {err}"),
    }
}

criterion_group!(benches, fanout);

fn main() {
    if std::env::var_os("FANOUT_SERVICE_ONLY").is_some() {
        // One process of `benches/service_processes.sh`: the service
        // setting alone, no report written.
        service_shared_counter();
        service_own_counters();
        return;
    }
    let allocations = allocations_per_publish();
    let shared = service_shared_counter();
    let (own, round_trips) = service_own_counters();
    benches();
    Criterion::default().configure_from_args().final_summary();
    if bench_mode() {
        let interleaved = interleaved_ratios();
        write_report(&allocations, &interleaved, &shared, &own, &round_trips);
    }
}
