//! Allocations a publish makes on the publisher's thread, counted by a
//! global allocator: upper bounds on the hot path, so a change that adds
//! allocations to every publish fails here and not only in a bench.
//!
//! Only the calling thread's allocations are counted (a thread-local
//! count), so worker threads and the test harness do not blur them.

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;

use blazesub::{Bus, DeliveryMode, Receiver, StreamOptions, StreamOverflow};

thread_local! {
    static ALLOCATIONS: Cell<u64> = const { Cell::new(0) };
}

/// The system allocator, counting each thread's allocations.
struct Counting;

fn count() {
    // `try_with`: a thread being torn down has no count left to keep.
    let _ = ALLOCATIONS.try_with(|n| n.set(n.get() + 1));
}

// SAFETY: every call is forwarded unchanged to `System`; counting touches a
// const-initialised thread-local `Cell`, which never allocates.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        count();
        // SAFETY: forwarded with the caller's guarantees.
        unsafe { System.alloc(layout) }
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        count();
        // SAFETY: forwarded with the caller's guarantees.
        unsafe { System.alloc_zeroed(layout) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: forwarded with the caller's guarantees.
        unsafe { System.dealloc(ptr, layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        count();
        // SAFETY: forwarded with the caller's guarantees.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static ALLOCATOR: Counting = Counting;

fn allocations() -> u64 {
    ALLOCATIONS.with(Cell::get)
}

const STREAMS: usize = 100;
const PUBLISHES: u64 = 20;

/// Allocations per publish on this thread, to `STREAMS` streams of one
/// policy, each read empty after every publish (so lossless ones never
/// wait). The first publish warms the route cache and is not counted.
fn per_publish(overflow: StreamOverflow) -> f64 {
    per_publish_beside(overflow, &[])
}

/// As [`per_publish`], with one drop-oldest stream on each of `others`
/// too, filters the topic also matches.
fn per_publish_beside(overflow: StreamOverflow, others: &[&str]) -> f64 {
    let bus = Bus::<u64>::builder()
        .delivery(DeliveryMode::Inline)
        .build()
        .expect("bus");
    let mut receivers: Vec<Receiver<u64>> = (0..STREAMS)
        .map(|_| {
            bus.subscribe_stream_with("alloc/t", StreamOptions::new(64).overflow(overflow))
                .expect("subscribe")
        })
        .collect();
    receivers.extend(others.iter().map(|filter| {
        bus.subscribe_stream_with(filter, StreamOptions::new(64))
            .expect("subscribe")
    }));
    // Every stream gets every publish, read after each.
    let drain = |receivers: &mut Vec<Receiver<u64>>, n: u64| {
        for rx in receivers.iter_mut() {
            assert_eq!(rx.try_recv().map(|m| *m.data()).ok(), Some(n));
            assert!(rx.try_recv().is_err());
        }
    };
    let reached = STREAMS + others.len();
    assert_eq!(bus.publish("alloc/t", 0).ok(), Some(reached));
    drain(&mut receivers, 0);
    let mut counted = 0;
    for n in 1..=PUBLISHES {
        let before = allocations();
        let published = bus.publish("alloc/t", n);
        counted += allocations() - before;
        assert_eq!(published.ok(), Some(reached));
        drain(&mut receivers, n);
    }
    counted as f64 / PUBLISHES as f64
}

/// A drop-oldest publish allocates its message and nothing else.
#[test]
fn a_lossy_publish_to_a_hundred_streams_allocates_its_message_only() {
    let per = per_publish(StreamOverflow::DropOldest);
    assert!(per <= 1.0, "{per} allocations per publish");
}

/// A lossless publish takes room in each mailbox before it pushes, and
/// keeps no list of where: the push walks the very sets the reserve pass
/// walked, so it allocates its message and nothing else either.
#[test]
fn a_lossless_publish_to_a_hundred_streams_allocates_its_message_only() {
    let per = per_publish(StreamOverflow::Backpressure);
    assert!(per <= 1.0, "{per} allocations per publish");
}

/// The same where the topic matches four filters with streams, lossless
/// ones on one of them: the publish holds only the set it took room in,
/// not one per filter (which would outgrow its inline room).
#[test]
fn a_lossless_publish_beside_three_other_filters_allocates_its_message_only() {
    let per = per_publish_beside(StreamOverflow::Backpressure, &["alloc/+", "#", "+/t"]);
    assert!(per <= 1.0, "{per} allocations per publish");
}

/// A burst to one topic of a `TaskPerSubscriber` bus queues its publishes
/// in the topic's lane: each allocates its message and its job, and no
/// task of its own (a task per publish, as before lanes, made it 3 or more).
/// The lane's task and the helpers of a lone publish are spawned only when
/// the lane was empty, so a few publishes of the burst pay for a spawn.
#[test]
fn a_burst_to_a_task_bus_spawns_no_task_per_publish() {
    const HANDLERS: usize = 1_000;
    const BURST: u64 = 2_000;
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .build()
        .expect("a runtime");
    let bus = Bus::<u64>::builder()
        .delivery(DeliveryMode::TaskPerSubscriber)
        .runtime(rt.handle().clone())
        .build()
        .expect("bus");
    let _subs: Vec<_> = (0..HANDLERS)
        .map(|_| bus.subscribe("alloc/burst", |_| {}).expect("subscribe"))
        .collect();
    bus.publish("alloc/burst", 0).expect("publish");
    drain(&bus);
    let before = allocations();
    for n in 1..=BURST {
        bus.publish("alloc/burst", n).expect("publish");
    }
    let per = (allocations() - before) as f64 / BURST as f64;
    drain(&bus);
    assert!(per <= 2.2, "{per} allocations per publish");
}

/// Waits until nothing is in flight; fails after a minute instead of
/// hanging (only a lost delivery could take that long).
fn drain<T: Send + Sync + 'static>(bus: &Bus<T>) {
    let started = std::time::Instant::now();
    while bus.inflight_messages() > 0 {
        assert!(
            started.elapsed() < std::time::Duration::from_secs(60),
            "deliveries still in flight after a minute"
        );
        std::thread::yield_now();
    }
}
