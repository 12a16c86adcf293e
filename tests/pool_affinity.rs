//! Where a subscription's deliveries run in `WorkerPool` mode: above the
//! threshold a publish is cut into one chunk per worker, and chunk `c` runs
//! on worker `c` publish after publish, so whatever a handler keeps of its
//! own stays in one core's cache. (A worker with nothing left of its own
//! takes another's chunks: so "mostly", not "always".) Below the threshold
//! every free worker helps: handlers that block all run at once, even on a
//! pool whose workers have only just started.

mod common;

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Barrier, Mutex};
use std::thread::ThreadId;
use std::time::Duration;

use blazesub::{Batch, Bus, DeliveryMode, Message, Overflow};
use common::wait_until;

const SUBSCRIBERS: usize = 128;
const PUBLISHES: u32 = 200;

#[test]
fn a_subscription_stays_on_one_worker_publish_after_publish() {
    let bus = Bus::<u32>::builder()
        .delivery(DeliveryMode::WorkerPool)
        .workers(2)
        .max_concurrent_subscriptions(10)
        .build()
        .unwrap();
    // Per subscription: the threads its deliveries ran on, and how often.
    let seen: Vec<Arc<Mutex<HashMap<ThreadId, u32>>>> = (0..SUBSCRIBERS)
        .map(|_| Arc::new(Mutex::new(HashMap::new())))
        .collect();
    let _subscriptions: Vec<_> = seen
        .iter()
        .map(|threads| {
            let threads = Arc::clone(threads);
            bus.subscribe("burst", move |_: &Message<u32>| {
                *threads
                    .lock()
                    .unwrap()
                    .entry(std::thread::current().id())
                    .or_default() += 1;
            })
            .unwrap()
        })
        .collect();
    // One publish at a time, both workers waiting for each: where a chunk
    // runs is then the pool's choice alone, not how the kernel happened to
    // schedule a burst (in a burst a worker that ran out of its own work
    // takes the other's, which is what a burst needs).
    for i in 0..PUBLISHES {
        bus.publish("burst", i).unwrap();
        assert!(wait_until(Duration::from_secs(30), || bus
            .inflight_messages()
            == 0));
        std::thread::sleep(Duration::from_millis(1));
    }
    for (index, threads) in seen.iter().enumerate() {
        let threads = threads.lock().unwrap();
        let total: u32 = threads.values().sum();
        let home = threads.values().copied().max().unwrap_or(0);
        assert_eq!(total, PUBLISHES, "subscription {index}");
        // Any worker taking any chunk puts about half on each.
        assert!(
            home * 10 >= total * 9,
            "subscription {index} ran on {} threads, at most {home} of {total} on one",
            threads.len()
        );
    }
}

#[test]
fn below_the_threshold_every_free_worker_joins_in() {
    const WORKERS: usize = 4;
    for round in 0..50 {
        // A fresh pool each round: its workers may not have started yet.
        let bus = Bus::<u32>::builder()
            .delivery(DeliveryMode::WorkerPool)
            .workers(WORKERS)
            .max_concurrent_subscriptions(WORKERS)
            .batch(Batch::Chunked)
            .overflow(Overflow::Drop)
            .build()
            .unwrap();
        let started = Arc::new(AtomicU64::new(0));
        let all_in = Arc::new(Barrier::new(WORKERS + 1));
        let subscriptions: Vec<_> = (0..WORKERS)
            .map(|_| {
                let (started, all_in) = (Arc::clone(&started), Arc::clone(&all_in));
                bus.subscribe("block", move |_: &Message<u32>| {
                    started.fetch_add(1, Ordering::SeqCst);
                    all_in.wait();
                })
                .unwrap()
            })
            .collect();
        bus.publish("block", round).unwrap();
        assert!(
            wait_until(Duration::from_secs(10), || started.load(Ordering::SeqCst)
                == WORKERS as u64),
            "round {round}: {} of {WORKERS} blocking handlers started",
            started.load(Ordering::SeqCst)
        );
        all_in.wait();
        drop(subscriptions);
    }
}
