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
    let drain = |receivers: &mut Vec<Receiver<u64>>| {
        for rx in receivers.iter_mut() {
            while rx.try_recv().is_ok() {}
        }
    };
    bus.publish("alloc/t", 0).expect("publish");
    drain(&mut receivers);
    let mut counted = 0;
    for n in 1..=PUBLISHES {
        let before = allocations();
        bus.publish("alloc/t", n).expect("publish");
        counted += allocations() - before;
        drain(&mut receivers);
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
    while bus.inflight_messages() > 0 {
        std::thread::yield_now();
    }
    let before = allocations();
    for n in 1..=BURST {
        bus.publish("alloc/burst", n).expect("publish");
    }
    let per = (allocations() - before) as f64 / BURST as f64;
    while bus.inflight_messages() > 0 {
        std::thread::yield_now();
    }
    assert!(per <= 2.2, "{per} allocations per publish");
}
