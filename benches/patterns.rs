//! The service patterns of issue 9, measured:
//!
//! - **Retained snapshot**: subscribing a stream against 1,000,000 retained
//!   topics (`r/{a}/{b}/{d}`: 100 × 1,000 × 10), for filters matching 1, 10,
//!   1,000, 10,000 and all 1,000,000 of them. Each iteration subscribes
//!   (walk, snapshot, mailbox filled) and drops the receiver. The cost should
//!   follow what matches, not what is stored.
//! - **Shared group throughput**: a burst of publishes to a group of 8
//!   handler members against the same burst to one plain subscription (each
//!   message handled once either way), end to end. Target: within 1.5×.
//! - **Request/reply round trip**: `Bus::request` to a responder that
//!   replies with `Bus::reply`, one request at a time, against the floor: a
//!   `tokio::sync::oneshot` sender sent over a `tokio::sync::mpsc` channel to
//!   a responder task. Target: within 3× of the floor.
//!
//! In bench mode it writes `docs/patterns.md` (tables and chart). Under
//! `cargo test --benches` every case runs once on a small store.
//!
//! `cargo bench --bench patterns`

mod common;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use blazesub::{Bus, DeliveryMode, Message, SharePolicy};
use criterion::{criterion_group, BenchmarkId, Criterion};

use common::report::{criterion_results, format_ns, Chart, Report, Series, Table};
use common::{bench_mode, runtime, time_bursts, wait_for, Payload, BURST};

const PAYLOAD: Payload = *b"twelve bytes";

/// (filter, what it matches, in thousands of `a` × `b` × `d` as stored).
fn filters(a_count: u32) -> Vec<(&'static str, &'static str)> {
    let mut out = vec![
        ("r/7/42/3", "1 topic"),
        ("r/7/42/+", "10 topics"),
        ("r/7/+/3", "1,000 topics"),
        ("r/7/#", "10,000 topics"),
        ("#", "every topic"),
    ];
    if a_count < 8 {
        out.retain(|(f, _)| *f == "#" || *f == "r/7/42/+");
    }
    out
}

/// A bus retaining `a × 1,000 × 10` topics.
fn retained_store(a_count: u32) -> Bus<u32> {
    let bus = Bus::<u32>::builder()
        .delivery(DeliveryMode::Inline)
        .max_retained(2_000_000)
        .build()
        .expect("bus");
    let mut n = 0;
    for a in 0..a_count {
        for b in 0..1_000 {
            for d in 0..10 {
                bus.publish_retained(&format!("r/{a}/{b}/{d}"), n).unwrap();
                n += 1;
            }
        }
    }
    bus
}

fn snapshots(c: &mut Criterion) {
    let a_count = if bench_mode() { 100 } else { 2 };
    let started = Instant::now();
    let bus = retained_store(a_count);
    let stored = bus.retained_count();
    eprintln!("retained {stored} topics in {:?}", started.elapsed());
    let mut group = c.benchmark_group("retained_snapshot");
    group.sample_size(10);
    group.measurement_time(Duration::from_secs(3));
    for (filter, _) in filters(a_count) {
        let matched = bus.retained(filter).len();
        group.bench_with_input(
            BenchmarkId::from_parameter(matched),
            &filter,
            |b, filter| {
                b.iter(|| {
                    let rx = bus
                        .subscribe_stream_with_capacity(filter, matched.max(1))
                        .unwrap();
                    assert_eq!(rx.len(), matched);
                    rx
                })
            },
        );
    }
    group.finish();
}

fn shared(c: &mut Criterion) {
    let rt = runtime();
    let mut group = c.benchmark_group("shared_throughput");
    for (name, members, filter, policy) in [
        ("plain_subscription", 1, "jobs/+", SharePolicy::LeastLoaded),
        (
            "shared_group_8_members",
            8,
            "$share/workers/jobs/+",
            SharePolicy::LeastLoaded,
        ),
        (
            "shared_group_8_members_round_robin",
            8,
            "$share/workers/jobs/+",
            SharePolicy::RoundRobin,
        ),
    ] {
        let bus = Bus::<Payload>::builder()
            .delivery(DeliveryMode::WorkerPool)
            .share_policy(policy)
            .runtime(rt.handle().clone())
            .build()
            .expect("bus");
        let counter = Arc::new(AtomicU64::new(0));
        let _subs: Vec<_> = (0..members)
            .map(|_| {
                let counter = Arc::clone(&counter);
                bus.subscribe(filter, move |_: &Message<Payload>| {
                    counter.fetch_add(1, Ordering::Relaxed);
                })
                .unwrap()
            })
            .collect();
        group.bench_function(name, |b| {
            b.iter_custom(|iters| time_bursts(&bus, "jobs/7", &PAYLOAD, &counter, 1, iters))
        });
    }
    group.finish();
}

fn request_reply(c: &mut Criterion) {
    let rt = runtime();
    let mut group = c.benchmark_group("request_reply");

    // The floor: a oneshot over an mpsc to a responder task.
    let (requests, mut serve) =
        tokio::sync::mpsc::channel::<(u64, tokio::sync::oneshot::Sender<u64>)>(64);
    rt.spawn(async move {
        while let Some((query, answer)) = serve.recv().await {
            let _ = answer.send(query * 2);
        }
    });
    group.bench_function("oneshot_over_mpsc", |b| {
        b.iter_custom(|iters| {
            rt.block_on(async {
                let start = Instant::now();
                for i in 0..iters {
                    let (tx, rx) = tokio::sync::oneshot::channel();
                    requests.send((i, tx)).await.unwrap();
                    assert_eq!(rx.await.unwrap(), i * 2);
                }
                start.elapsed()
            })
        })
    });

    for (name, mode) in [
        ("bus_worker_pool", DeliveryMode::WorkerPool),
        ("bus_task_per_subscriber", DeliveryMode::TaskPerSubscriber),
        ("bus_inline", DeliveryMode::Inline),
    ] {
        let bus = Bus::<u64>::builder()
            .delivery(mode)
            .runtime(rt.handle().clone())
            .build()
            .expect("bus");
        let responder = bus.clone();
        let _service = bus
            .subscribe("rpc/double", move |m: &Message<u64>| {
                responder.reply(m, *m.data() * 2).unwrap();
            })
            .unwrap();
        group.bench_function(name, |b| {
            b.iter_custom(|iters| {
                rt.block_on(async {
                    let start = Instant::now();
                    for i in 0..iters {
                        let reply = bus
                            .request("rpc/double", i, Duration::from_secs(10))
                            .await
                            .unwrap();
                        assert_eq!(*reply.data(), i * 2);
                    }
                    start.elapsed()
                })
            })
        });
        assert_eq!(bus.subscriptions_count(), 1);
    }
    group.finish();
}

fn write_report(stored: usize) {
    let mut report = Report::new(
        "patterns",
        "Service patterns: retained snapshots, shared groups, request/reply",
        &["tokio", "criterion"],
    );
    let snap = criterion_results("retained_snapshot");
    let mut snapshot_table = Table::new(
        "Subscribe with snapshot, 1,000,000 retained topics",
        &[
            "filter",
            "topics matched",
            "time per subscribe",
            "95% CI",
            "per matched topic",
        ],
    );
    snapshot_table.note = format!(
        "{stored} topics retained (`r/{{a}}/{{b}}/{{d}}`, 100 × 1,000 × 10). One iteration \
         subscribes a stream whose mailbox holds the whole snapshot (so every matched \
         message is copied in) and drops it."
    );
    let mut chart = Chart {
        file: "patterns-snapshot".into(),
        title: "Subscribe-with-snapshot time vs topics matched (1M stored)".into(),
        x_label: "retained topics the filter matches".into(),
        y_label: "time per subscribe (µs)".into(),
        log_x: true,
        log_y: true,
        ..Chart::default()
    };
    let mut points = Vec::new();
    let mut rows: Vec<(usize, &str, &str)> = Vec::new();
    for (filter, what) in filters(100) {
        let matched = match what {
            "1 topic" => 1,
            "10 topics" => 10,
            "1,000 topics" => 1_000,
            "10,000 topics" => 10_000,
            _ => stored,
        };
        rows.push((matched, filter, what));
    }
    for (matched, filter, what) in rows {
        if let Some(e) = snap.get(&matched.to_string()) {
            snapshot_table.row(vec![
                format!("`{filter}`"),
                what.into(),
                format_ns(e.mean_ns),
                format!("{} – {}", format_ns(e.low_ns), format_ns(e.high_ns)),
                format_ns(e.mean_ns / matched as f64),
            ]);
            points.push((matched as f64, e.mean_ns / 1e3));
        }
    }
    chart.series.push(Series {
        name: "subscribe_stream with snapshot".into(),
        points,
    });

    let shared = criterion_results("shared_throughput");
    let mut shared_table = Table::new(
        "Shared group of 8 handler members vs one plain subscription (WorkerPool, end to end; \
         least loaded is the default policy)",
        &["case", "time per publish", "deliveries / s", "vs plain"],
    );
    shared_table.note = format!(
        "Bursts of {BURST} publishes, each waited for until every handler ran. Target: the \
         group within 1.5× of the plain subscription."
    );
    let plain = shared.get("plain_subscription").map(|e| e.mean_ns);
    for id in [
        "plain_subscription",
        "shared_group_8_members",
        "shared_group_8_members_round_robin",
    ] {
        if let Some(e) = shared.get(id) {
            shared_table.row(vec![
                format!("`{id}`"),
                format_ns(e.mean_ns),
                format!("{:.2} M", 1e3 / e.mean_ns),
                plain.map_or("—".into(), |p| format!("{:.2}×", e.mean_ns / p)),
            ]);
        }
    }

    let rr = criterion_results("request_reply");
    let mut rr_table = Table::new(
        "Request/reply round trip, one at a time",
        &[
            "case",
            "round trip",
            "95% CI",
            "round trips / s",
            "vs floor",
        ],
    );
    rr_table.note = "Floor: a `tokio::sync::oneshot` sent over a `tokio::sync::mpsc` to a \
                     responder task. The bus cases subscribe a fresh `$reply` stream, publish \
                     the request, run the responder's `Bus::reply`, take the reply and remove \
                     the subscription. Target: within 3× of the floor."
        .into();
    let floor = rr.get("oneshot_over_mpsc").map(|e| e.mean_ns);
    for id in [
        "oneshot_over_mpsc",
        "bus_inline",
        "bus_worker_pool",
        "bus_task_per_subscriber",
    ] {
        if let Some(e) = rr.get(id) {
            rr_table.row(vec![
                format!("`{id}`"),
                format_ns(e.mean_ns),
                format!("{} – {}", format_ns(e.low_ns), format_ns(e.high_ns)),
                format!("{:.0} k", 1e6 / e.mean_ns),
                floor.map_or("—".into(), |f| format!("{:.2}×", e.mean_ns / f)),
            ]);
        }
    }
    report.tables = vec![snapshot_table, shared_table, rr_table];
    report.charts = vec![chart];
    match report.save() {
        Ok(()) => println!("wrote docs/patterns.md"),
        Err(err) => eprintln!("could not write the report: {err}"),
    }
}

criterion_group!(benches, snapshots, shared, request_reply);

fn main() {
    benches();
    Criterion::default().configure_from_args().final_summary();
    if bench_mode() {
        write_report(1_000_000);
    }
    // Keep the helper linked in test mode too.
    let _ = wait_for;
}
