//! Code shared by the bench targets: the counting allocator, workload
//! builders and completion waiting.
//!
//! End to end means until every subscriber's handler has run: every workload
//! here counts handler calls in a shared `AtomicU64`, and a measurement ends
//! only when that count reaches what the publishes must produce.

#![allow(dead_code)] // each bench target uses a different part of this module

pub mod cores;
pub mod placement;
pub mod report;
pub mod rss;
pub mod rumqttd;
pub mod service;

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use blazesub::{Batch, Bus, DeliveryMode, Message, Subscription};

/// A global allocator that counts allocations and allocated bytes.
pub struct CountingAllocator;

static ALLOCATIONS: AtomicU64 = AtomicU64::new(0);
static ALLOCATED_BYTES: AtomicU64 = AtomicU64::new(0);

// SAFETY: delegates every call unchanged to the system allocator; the
// counters are plain atomics and do not allocate.
#[allow(unsafe_code)]
unsafe impl GlobalAlloc for CountingAllocator {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        ALLOCATIONS.fetch_add(1, Ordering::Relaxed);
        ALLOCATED_BYTES.fetch_add(layout.size() as u64, Ordering::Relaxed);
        unsafe { System.alloc(layout) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        unsafe { System.dealloc(ptr, layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        ALLOCATIONS.fetch_add(1, Ordering::Relaxed);
        ALLOCATED_BYTES.fetch_add(new_size as u64, Ordering::Relaxed);
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

/// Allocation counters at one instant.
#[derive(Clone, Copy, Debug)]
pub struct AllocSnapshot {
    pub allocations: u64,
    pub bytes: u64,
}

pub fn alloc_snapshot() -> AllocSnapshot {
    AllocSnapshot {
        allocations: ALLOCATIONS.load(Ordering::Relaxed),
        bytes: ALLOCATED_BYTES.load(Ordering::Relaxed),
    }
}

impl AllocSnapshot {
    /// Allocations and bytes per operation since `earlier`.
    pub fn per_op_since(self, earlier: AllocSnapshot, ops: u64) -> (f64, f64) {
        (
            (self.allocations - earlier.allocations) as f64 / ops as f64,
            (self.bytes - earlier.bytes) as f64 / ops as f64,
        )
    }
}

/// Whether the bench binary runs as a real benchmark (`cargo bench`) rather
/// than once as a test (`cargo test --benches`).
pub fn bench_mode() -> bool {
    std::env::args().any(|a| a == "--bench")
}

/// Spins (yielding the core) until `counter` reaches `target`; panics after a
/// minute, which only a lost delivery could cause.
pub fn wait_for(counter: &AtomicU64, target: u64) {
    let started = Instant::now();
    let mut spins = 0u64;
    while counter.load(Ordering::Acquire) < target {
        spins += 1;
        if spins < 64 {
            std::hint::spin_loop();
        } else {
            std::thread::yield_now();
        }
        if spins % 1_000_000 == 0 && started.elapsed() > Duration::from_secs(60) {
            panic!(
                "deliveries went missing: {} of {target} after a minute",
                counter.load(Ordering::Acquire)
            );
        }
    }
}

/// Publishes per burst in end-to-end measurements: enough to keep every
/// worker busy, few enough that a default queue (4,096) never fills, so the
/// figure is the bus's throughput rather than the publisher's own share of
/// the work under `Overflow::CallerRuns`.
pub const BURST: u64 = 100;

/// Criterion `iter_custom` body for end-to-end fan-out: `iters` bursts of
/// [`BURST`] publishes, each burst waited for until `counter` has grown by
/// `deliveries_per_publish` for each publish. Returns the time *per publish*
/// (total / `BURST`), so criterion's per-iteration figure is per publish.
pub fn time_bursts<T: Clone + Send + Sync + 'static>(
    bus: &Bus<T>,
    topic: &str,
    value: &T,
    counter: &AtomicU64,
    deliveries_per_publish: u64,
    iters: u64,
) -> Duration {
    let mut target = counter.load(Ordering::Acquire);
    let start = Instant::now();
    for _ in 0..iters {
        for _ in 0..BURST {
            bus.publish(topic, std::hint::black_box(value.clone()))
                .expect("publish");
        }
        target += BURST * deliveries_per_publish;
        wait_for(counter, target);
    }
    start.elapsed() / BURST as u32
}

/// A 12-byte payload, as in BlazeSub's throughput bench.
pub type Payload = [u8; 12];

/// A tokio runtime with two workers for `TaskPerSubscriber` buses.
pub fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("tokio runtime")
}

/// One bus configuration of a bench.
#[derive(Clone, Copy, Debug)]
pub struct Setup {
    pub name: &'static str,
    pub mode: DeliveryMode,
    pub batch: Batch,
    pub threshold: usize,
    /// `None`: the default (available parallelism).
    pub workers: Option<usize>,
}

impl Setup {
    pub const fn defaults(name: &'static str, mode: DeliveryMode) -> Self {
        Self {
            name,
            mode,
            batch: Batch::Chunked,
            threshold: 10,
            workers: None,
        }
    }

    pub fn build<T: Send + Sync + 'static>(&self, runtime: &tokio::runtime::Runtime) -> Bus<T> {
        let mut builder = Bus::builder()
            .delivery(self.mode)
            .batch(self.batch)
            .max_concurrent_subscriptions(self.threshold)
            .runtime(runtime.handle().clone());
        if let Some(workers) = self.workers {
            builder = builder.workers(workers);
        }
        builder.build().expect("bus")
    }
}

/// `subscribers` handlers on `topic`, each adding one to the returned counter.
pub fn counting_subscribers<T: Send + Sync + 'static>(
    bus: &Bus<T>,
    topic: &str,
    subscribers: usize,
) -> (Arc<AtomicU64>, Vec<Subscription>) {
    let counter = Arc::new(AtomicU64::new(0));
    let subs = (0..subscribers)
        .map(|_| {
            let counter = Arc::clone(&counter);
            bus.subscribe(topic, move |_: &Message<T>| {
                counter.fetch_add(1, Ordering::Relaxed);
            })
            .expect("subscribe")
        })
        .collect();
    (counter, subs)
}
