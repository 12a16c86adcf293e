//! Fan-out, end to end: one topic, 1,000 subscribers whose handler adds one to
//! a shared `AtomicU64` (BlazeSub's own throughput bench), 12-byte payloads.
//!
//! Each sample publishes a burst (criterion picks its length) and stops the
//! clock only when every handler has run for every message. In the same run, a
//! raw loop calling the same 1,000 closures gives the lower bound.
//!
//! Before the criterion groups, the bench prints allocations and bytes per
//! publish for 10, 1,000 and 100,000 subscribers in every mode, measured with
//! a counting global allocator, and writes them to
//! `target/bench-reports/fanout-allocations.md`.
//!
//! `cargo bench --bench fanout`

mod common;

use std::hint::black_box;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Instant;

use blazesub::{Batch, DeliveryMode};
use criterion::{criterion_group, Criterion};

use common::{
    alloc_snapshot, bench_mode, counting_subscribers, runtime, wait_for, CountingAllocator,
    Payload, Setup,
};

#[global_allocator]
static ALLOCATOR: CountingAllocator = CountingAllocator;

const TOPIC: &str = "bench/fanout";
const SUBSCRIBERS: usize = 1_000;
const PAYLOAD: Payload = *b"twelve bytes";

/// Every mode at its default settings, plus the variants worth comparing.
const SETUPS: [Setup; 5] = [
    Setup::defaults("worker_pool", DeliveryMode::WorkerPool),
    Setup::defaults("task_per_subscriber", DeliveryMode::TaskPerSubscriber),
    Setup::defaults("inline", DeliveryMode::Inline),
    Setup {
        name: "worker_pool_batch_single",
        mode: DeliveryMode::WorkerPool,
        batch: Batch::Single,
        threshold: 10,
    },
    Setup {
        name: "task_per_subscriber_batch_single",
        mode: DeliveryMode::TaskPerSubscriber,
        batch: Batch::Single,
        threshold: 10,
    },
];

fn fanout(c: &mut Criterion) {
    let rt = runtime();
    let mut group = c.benchmark_group("fanout_1000");

    let counter = Arc::new(AtomicU64::new(0));
    type Closure = Box<dyn Fn(&Payload) + Send + Sync>;
    let closures: Vec<Closure> = (0..SUBSCRIBERS)
        .map(|_| {
            let counter = Arc::clone(&counter);
            Box::new(move |_: &Payload| {
                counter.fetch_add(1, Ordering::Relaxed);
            }) as Closure
        })
        .collect();
    group.bench_function("raw_loop", |b| {
        b.iter_custom(|iters| {
            let start = Instant::now();
            for _ in 0..iters {
                let payload = black_box(PAYLOAD);
                for closure in &closures {
                    closure(&payload);
                }
            }
            start.elapsed()
        })
    });

    for setup in SETUPS {
        let bus = setup.build::<Payload>(&rt);
        let (counter, _subscriptions) = counting_subscribers(&bus, TOPIC, SUBSCRIBERS);
        group.bench_function(setup.name, |b| {
            b.iter_custom(|iters| {
                let base = counter.load(Ordering::Acquire);
                let start = Instant::now();
                for _ in 0..iters {
                    bus.publish(TOPIC, black_box(PAYLOAD)).expect("publish");
                }
                wait_for(&counter, base + iters * SUBSCRIBERS as u64);
                start.elapsed()
            })
        });
    }
    group.finish();
}

/// Allocations per publish, end to end, for each mode and subscriber count.
fn allocations_per_publish() {
    let rt = runtime();
    let publishes: u64 = if bench_mode() { 2_000 } else { 50 };
    let mut table = String::from(
        "| mode | subscribers | allocations / publish | bytes / publish |\n|---|---:|---:|---:|\n",
    );
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
            let (allocs, bytes) = alloc_snapshot().per_op_since(before, publishes);
            table.push_str(&format!(
                "| {} | {subscribers} | {allocs:.2} | {bytes:.0} |\n",
                setup.name
            ));
        }
    }
    println!("\nAllocations per publish, end to end ({publishes} publishes):\n{table}");
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("target/bench-reports");
    if std::fs::create_dir_all(&dir).is_ok() {
        let _ = std::fs::write(dir.join("fanout-allocations.md"), table);
    }
}

criterion_group!(benches, fanout);

fn main() {
    allocations_per_publish();
    benches();
    Criterion::default().configure_from_args().final_summary();
}
