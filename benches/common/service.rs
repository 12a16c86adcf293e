//! The service setting (issue 12): the publisher is a task on a
//! multi-thread tokio runtime with one worker per core, as in a service,
//! not a bench thread of its own.
//!
//! A measurement spawns one task per publisher, each publishing a burst on
//! its topic, and stops the clock when every handler has run for every
//! message. The bench's thread does not spin while it waits: it parks, and
//! the handler call that completes the burst unparks it. (A waiter that
//! spins or yields is a third runnable thread on two cores; it moved these
//! figures by up to 2× either way, so it would measure the waiter.)
//!
//! Two handler shapes:
//! - [`shared_counter`]: every handler adds one to one shared `AtomicU64`
//!   (BlazeSub's throughput bench); the call that brings it to the burst's
//!   total completes the burst.
//! - [`own_counters`]: every handler bumps a cache-padded counter of its
//!   own, as handlers that keep per-subscription state do; each handler
//!   reports once when its own count reaches the burst's, and the last
//!   report completes the burst.

use std::hint::black_box;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::Thread;
use std::time::{Duration, Instant};

use blazesub::{Bus, Message, Subscription};
use crossbeam_utils::CachePadded;

/// Wakes the measuring thread when a burst is complete.
pub struct Completion {
    /// What each counter must reach for the current burst to be complete.
    target: CachePadded<AtomicU64>,
    /// Handlers (own counters) or calls (shared counter) that reached it.
    arrived: CachePadded<AtomicUsize>,
    /// How many arrivals complete a burst.
    arrivals: usize,
    waiter: Mutex<Option<Thread>>,
}

impl Completion {
    pub fn new(arrivals: usize) -> Arc<Self> {
        Arc::new(Self {
            target: CachePadded::new(AtomicU64::new(u64::MAX)),
            arrived: CachePadded::new(AtomicUsize::new(0)),
            arrivals,
            waiter: Mutex::new(None),
        })
    }

    /// A handler's counter now reads `count`.
    #[inline]
    pub fn counted(&self, count: u64) {
        if count == self.target.load(Ordering::Relaxed) {
            self.arrive();
        }
    }

    /// A counter that may move by more than one at a time went from
    /// `before` to `after`: it arrives if it passed the target.
    #[inline]
    pub fn moved(&self, before: u64, after: u64) {
        let target = self.target.load(Ordering::Relaxed);
        if before < target && target <= after {
            self.arrive();
        }
    }

    fn arrive(&self) {
        if self.arrived.fetch_add(1, Ordering::AcqRel) + 1 == self.arrivals {
            if let Some(waiter) = self.waiter.lock().expect("waiter").as_ref() {
                waiter.unpark();
            }
        }
    }

    /// Arms the next burst: complete when every counter reads `target`.
    pub fn arm(&self, target: u64) {
        *self.waiter.lock().expect("waiter") = Some(std::thread::current());
        self.arrived.store(0, Ordering::Relaxed);
        self.target.store(target, Ordering::Release);
    }

    /// Parks until the armed burst is complete; panics after a minute, which
    /// only a lost delivery could cause.
    pub fn wait(&self) {
        let started = Instant::now();
        while self.arrived.load(Ordering::Acquire) < self.arrivals {
            std::thread::park_timeout(Duration::from_millis(10));
            assert!(
                started.elapsed() < Duration::from_secs(60),
                "deliveries went missing: {} of {} arrivals after a minute",
                self.arrived.load(Ordering::Acquire),
                self.arrivals
            );
        }
    }
}

/// Handlers on one topic and what completes their bursts.
pub struct Workload {
    pub topic: String,
    completion: Arc<Completion>,
    /// Deliveries per publish.
    pub subscribers: usize,
    /// Publishes each counter has seen so far (counters only grow).
    published: u64,
    _subscriptions: Vec<Subscription>,
}

/// `subscribers` handlers on `topic`, each adding one to one shared counter.
pub fn shared_counter(bus: &Bus<u64>, topic: &str, subscribers: usize) -> Workload {
    shared_counter_of(bus, topic, subscribers, false)
}

/// [`shared_counter`] with `subscribe_ordered` handlers.
pub fn ordered_shared_counter(bus: &Bus<u64>, topic: &str, subscribers: usize) -> Workload {
    shared_counter_of(bus, topic, subscribers, true)
}

fn shared_counter_of(bus: &Bus<u64>, topic: &str, subscribers: usize, ordered: bool) -> Workload {
    let completion = Completion::new(1);
    let counter = Arc::new(CachePadded::new(AtomicU64::new(0)));
    let subscriptions = (0..subscribers)
        .map(|_| {
            let counter = Arc::clone(&counter);
            let completion = Arc::clone(&completion);
            // One closure per call, as a user writes it: a closure type
            // shared by both calls is compiled once for both, and then
            // called out of line by each.
            if ordered {
                bus.subscribe_ordered(topic, move |_: &Message<u64>| {
                    completion.counted(counter.fetch_add(1, Ordering::Relaxed) + 1);
                })
            } else {
                bus.subscribe(topic, move |_: &Message<u64>| {
                    completion.counted(counter.fetch_add(1, Ordering::Relaxed) + 1);
                })
            }
            .expect("subscribe")
        })
        .collect();
    Workload {
        topic: topic.to_owned(),
        completion,
        subscribers,
        published: 0,
        _subscriptions: subscriptions,
    }
}

/// `subscribers` handlers on `topic`, each bumping a cache-padded counter
/// of its own.
pub fn own_counters(bus: &Bus<u64>, topic: &str, subscribers: usize) -> Workload {
    let completion = Completion::new(subscribers);
    let subscriptions = (0..subscribers)
        .map(|_| {
            let counter = CachePadded::new(AtomicU64::new(0));
            let completion = Arc::clone(&completion);
            bus.subscribe(topic, move |_: &Message<u64>| {
                completion.counted(counter.fetch_add(1, Ordering::Relaxed) + 1);
            })
            .expect("subscribe")
        })
        .collect();
    Workload {
        topic: topic.to_owned(),
        completion,
        subscribers,
        published: 0,
        _subscriptions: subscriptions,
    }
}

/// The handlers of the raw loop, shared with the task that runs it.
pub type RawClosures = Arc<Vec<Box<dyn Fn(&u64) + Send + Sync>>>;

/// One burst of `publishes` on each workload's topic, each published by a
/// task of its own on `runtime`, timed until every handler ran for every
/// message.
pub fn burst(
    runtime: &tokio::runtime::Runtime,
    bus: &Bus<u64>,
    workloads: &mut [Workload],
    publishes: u64,
) -> Duration {
    for workload in workloads.iter_mut() {
        workload.published += publishes;
        let target = if workload.completion.arrivals == 1 {
            workload.published * workload.subscribers as u64
        } else {
            workload.published
        };
        workload.completion.arm(target);
    }
    let start = Instant::now();
    let publishers: Vec<_> = workloads
        .iter()
        .map(|workload| {
            let bus = bus.clone();
            let topic = workload.topic.clone();
            runtime.spawn(async move {
                for i in 0..publishes {
                    bus.publish(&topic, black_box(i)).expect("publish");
                }
            })
        })
        .collect();
    for publisher in publishers {
        runtime.block_on(publisher).expect("publisher task");
    }
    for workload in workloads.iter() {
        workload.completion.wait();
    }
    start.elapsed()
}

/// The raw loop in the service setting: one task calling `closures` for
/// each of `publishes` values, timed until it returns.
pub fn raw_burst(
    runtime: &tokio::runtime::Runtime,
    closures: &RawClosures,
    publishes: u64,
) -> Duration {
    let closures = Arc::clone(closures);
    runtime
        .block_on(runtime.spawn(async move {
            let start = Instant::now();
            for i in 0..publishes {
                let value = black_box(i);
                for closure in closures.iter() {
                    closure(&value);
                }
            }
            start.elapsed()
        }))
        .expect("raw loop task")
}

/// A raw loop's closures on one shared counter and one completion: `make`
/// turns the two into one closure per subscriber.
fn raw_closures(
    subscribers: usize,
    make: impl Fn(Arc<CachePadded<AtomicU64>>, Arc<Completion>) -> Box<dyn Fn(&u64) + Send + Sync>,
) -> RawClosures {
    let completion = Completion::new(1);
    let counter = Arc::new(CachePadded::new(AtomicU64::new(0)));
    Arc::new(
        (0..subscribers)
            .map(|_| make(Arc::clone(&counter), Arc::clone(&completion)))
            .collect(),
    )
}

/// Closures doing what [`shared_counter`]'s handlers do, for the raw loop
/// (their completion check included; it never fires).
pub fn raw_shared_counter(subscribers: usize) -> RawClosures {
    raw_closures(subscribers, |counter, completion| {
        Box::new(move |_: &u64| {
            completion.counted(counter.fetch_add(1, Ordering::Relaxed) + 1);
        })
    })
}

/// [`raw_shared_counter`]'s closures, each padded to 40 bytes, so each
/// takes a 48-byte heap chunk where the raw loop's 16-byte closures take
/// 32: the size a subscription's entry took (an `Arc`'s two counts, a
/// state word and the closure) until the entry's one header word held
/// both its count and its flag (`registry/counted.rs`, forty-first
/// session). Set beside the raw loop, it shows what that third more
/// memory a handler costs the same loop; the bus now walks the raw loop's
/// 48 bytes a handler (a 16-byte slot and a 32-byte chunk).
pub fn raw_shared_counter_entry_sized(subscribers: usize) -> RawClosures {
    raw_closures(subscribers, |counter, completion| {
        let padding = [0u64; 3];
        Box::new(move |_: &u64| {
            black_box(&padding);
            completion.counted(counter.fetch_add(1, Ordering::Relaxed) + 1);
        })
    })
}

/// Closures doing what [`own_counters`]' handlers do (each bumps a
/// cache-padded counter of its own, completion check included), for the
/// raw loop.
pub fn raw_own_counters(subscribers: usize) -> RawClosures {
    let completion = Completion::new(subscribers);
    Arc::new(
        (0..subscribers)
            .map(|_| {
                let counter = CachePadded::new(AtomicU64::new(0));
                let completion = Arc::clone(&completion);
                Box::new(move |_: &u64| {
                    completion.counted(counter.fetch_add(1, Ordering::Relaxed) + 1);
                }) as Box<dyn Fn(&u64) + Send + Sync>
            })
            .collect(),
    )
}

/// The raw loop with a publisher per closure set: one task each on
/// `runtime`, calling its closures for each of `publishes` values, timed
/// as [`burst`] times the bus (from before the tasks are spawned until the
/// last has returned). The floor of what two publishers can get done on
/// the machine, and of how steadily: no bus is involved.
pub fn raw_bursts(
    runtime: &tokio::runtime::Runtime,
    sets: &[RawClosures],
    publishes: u64,
) -> Duration {
    let start = Instant::now();
    let publishers: Vec<_> = sets
        .iter()
        .map(|closures| {
            let closures = Arc::clone(closures);
            runtime.spawn(async move {
                for i in 0..publishes {
                    let value = black_box(i);
                    for closure in closures.iter() {
                        closure(&value);
                    }
                }
            })
        })
        .collect();
    for publisher in publishers {
        runtime.block_on(publisher).expect("raw loop task");
    }
    start.elapsed()
}

/// `samples` in the order they were taken, for the console: whether the
/// slow repetitions of a setup come first (a transient) or anywhere.
pub fn in_order(samples: &[f64]) -> String {
    let listed: Vec<String> = samples.iter().map(|s| format!("{s:.0}")).collect();
    listed.join(", ")
}

/// Median, fastest and slowest of `samples`.
pub fn spread(samples: &[f64]) -> (f64, f64, f64) {
    let mut sorted = samples.to_vec();
    sorted.sort_by(f64::total_cmp);
    (
        sorted[sorted.len() / 2],
        sorted[0],
        sorted[sorted.len() - 1],
    )
}
