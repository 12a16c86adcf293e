//! What each delivery contract costs, end to end, against the default one:
//!
//! - `streams`: 100 stream subscriptions read by 100 tokio tasks; a publisher
//!   task sends bursts of 1,000 messages. `drop_oldest` publishes with
//!   `publish` into mailboxes of 1,024 and a burst ends when every reader has
//!   taken or lost all of it; `lossless` uses `publish_async` into
//!   `Backpressure` mailboxes of 64 (publishers wait for readers) and a burst
//!   ends when every reader has taken all of it. Time per publish.
//! - `handlers`: 1,000 handler subscriptions in the default mode (worker
//!   pool), each adding one to a shared counter; bursts of 100 publishes, end
//!   to end; `unordered` (`subscribe`) against `ordered`
//!   (`subscribe_ordered`). Time per publish.
//! - `interest`: `has_subscribers` on a warm topic.
//!
//! `cargo bench --bench contracts`; targets and results in `docs/contracts.md`.

mod common;

use std::hint::black_box;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use blazesub::{Bus, DeliveryMode, Message, StreamOptions, StreamOverflow, Subscription};
use criterion::{criterion_group, Criterion};

use common::{bench_mode, runtime, wait_for};

const STREAMS: usize = 100;
const STREAM_BURST: u64 = 1_000;
const HANDLERS: usize = 1_000;
const HANDLER_BURST: u64 = 100;

/// Spawns one reader task per stream; each adds what it took or lost to
/// `progress`.
fn spawn_readers(
    rt: &tokio::runtime::Runtime,
    bus: &Bus<u64>,
    options: StreamOptions,
    progress: &Arc<AtomicU64>,
) {
    for _ in 0..STREAMS {
        let mut rx = bus.subscribe_stream_with("s", options).expect("subscribe");
        let progress = Arc::clone(progress);
        rt.spawn(async move {
            let mut lost_seen = 0;
            while let Some(message) = rx.recv().await {
                black_box(message.data());
                let lost = rx.lost();
                progress.fetch_add(1 + (lost - lost_seen), Ordering::Relaxed);
                lost_seen = lost;
            }
        });
    }
}

fn streams_case(c: &mut Criterion, lossless: bool) {
    let rt = runtime();
    let bus = Bus::<u64>::builder()
        .runtime(rt.handle().clone())
        .build()
        .expect("bus");
    let options = if lossless {
        StreamOptions::new(64).overflow(StreamOverflow::Backpressure)
    } else {
        StreamOptions::new(1_024)
    };
    let progress = Arc::new(AtomicU64::new(0));
    spawn_readers(&rt, &bus, options, &progress);
    let name = if lossless {
        "lossless_publish_async"
    } else {
        "drop_oldest_publish"
    };
    let mut group = c.benchmark_group("contracts_streams");
    group.bench_function(name, |b| {
        b.iter_custom(|iters| {
            let mut target = progress.load(Ordering::Acquire);
            let start = Instant::now();
            for _ in 0..iters {
                let bus = bus.clone();
                rt.block_on(async move {
                    for n in 0..STREAM_BURST {
                        if lossless {
                            bus.publish_async("s", n).await.expect("publish_async");
                        } else {
                            bus.publish("s", n).expect("publish");
                        }
                    }
                });
                target += STREAM_BURST * STREAMS as u64;
                // With drop-oldest a reader may still lose the tail of a
                // burst later; a lost message is counted when the reader
                // next takes one, so the wait ends for both.
                wait_for(&progress, target);
            }
            start.elapsed() / STREAM_BURST as u32
        })
    });
    group.finish();
}

fn handlers_case(c: &mut Criterion, ordered: bool) {
    let rt = runtime();
    let bus = Bus::<u64>::builder()
        .delivery(DeliveryMode::WorkerPool)
        .stream_capacity(4_096)
        .runtime(rt.handle().clone())
        .build()
        .expect("bus");
    let counter = Arc::new(AtomicU64::new(0));
    let _subs: Vec<Subscription> = (0..HANDLERS)
        .map(|_| {
            let counter = Arc::clone(&counter);
            let handler = move |_: &Message<u64>| {
                counter.fetch_add(1, Ordering::Relaxed);
            };
            if ordered {
                bus.subscribe_ordered("h", handler).expect("subscribe")
            } else {
                bus.subscribe("h", handler).expect("subscribe")
            }
        })
        .collect();
    let name = if ordered { "ordered" } else { "unordered" };
    let mut group = c.benchmark_group("contracts_handlers_1000");
    group.bench_function(name, |b| {
        b.iter_custom(|iters| {
            let mut target = counter.load(Ordering::Acquire);
            let start = Instant::now();
            for _ in 0..iters {
                for n in 0..HANDLER_BURST {
                    bus.publish("h", black_box(n)).expect("publish");
                }
                target += HANDLER_BURST * HANDLERS as u64;
                wait_for(&counter, target);
            }
            start.elapsed() / HANDLER_BURST as u32
        })
    });
    group.finish();
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
    streams_case(c, false);
    streams_case(c, true);
    handlers_case(c, false);
    handlers_case(c, true);
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

fn main() {
    benches();
    Criterion::default().configure_from_args().final_summary();
    if bench_mode() {
        println!("contracts: see docs/contracts.md for the targets");
    }
}
