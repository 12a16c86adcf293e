//! Where a subscription's deliveries run in `WorkerPool` mode: every route
//! has a home worker (routes get them in turn), and a topic's publishes run
//! there, publish after publish, so whatever a handler keeps of its own
//! stays in one core's cache and handlers that share state never fight
//! over it between cores; two busy topics run on two workers. (An idle
//! worker helps a lone publish, and takes over from a stalled worker: so
//! "mostly", not "always".) Below the threshold every free worker helps a
//! lone publish: handlers that block all run at once, even on a pool whose
//! workers have only just started.

mod common;

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Barrier, Mutex};
use std::thread::ThreadId;
use std::time::Duration;

use blazesub::{Batch, Bus, DeliveryMode, Message, Overflow};
use common::wait_until;

const SUBSCRIBERS: usize = 16;
const LIMIT: Duration = Duration::from_secs(30);
const BURSTS: u32 = 40;

/// The tests here run one at a time: another test's pool beside this one's
/// preempts its workers, and a worker stalled for over a millisecond is
/// rightly taken over, which is not what the first test measures.
static ONE_AT_A_TIME: Mutex<()> = Mutex::new(());
const BURST: u32 = 100;

/// Per subscription: the threads its deliveries ran on, and how often.
type Seen = Vec<Arc<Mutex<HashMap<ThreadId, u32>>>>;

fn subscribe_all(bus: &Bus<u32>, topic: &str) -> (Seen, Vec<blazesub::Subscription>) {
    let seen: Seen = (0..SUBSCRIBERS)
        .map(|_| Arc::new(Mutex::new(HashMap::new())))
        .collect();
    let subscriptions = seen
        .iter()
        .map(|threads| {
            let threads = Arc::clone(threads);
            bus.subscribe(topic, move |_: &Message<u32>| {
                *threads
                    .lock()
                    .unwrap()
                    .entry(std::thread::current().id())
                    .or_default() += 1;
            })
            .unwrap()
        })
        .collect();
    (seen, subscriptions)
}

/// The thread that ran most of `topic`'s deliveries, checked to have run at
/// least 70% of every subscription's. Not all: a home worker that the
/// machine runs late for over a millisecond (woken late from the hold's
/// gate, preempted) is rightly taken over, half its queue at a time, which
/// costs its subscriptions up to a burst's share (1/40 here) each time. A
/// quiet machine keeps 85-90% home (the 90% of 20 bursts this test first
/// asked for failed once in about thirty full runs); two cores busy with
/// builds and other tests beside it kept 75-83% (80% failed 85% in CI runs
/// of the thirty-second session). Workers taking any publish put about
/// half on each (the shared queue this replaced: 60%).
fn home_of(topic: &str, seen: &Seen) -> Result<ThreadId, String> {
    let mut homes = HashMap::<ThreadId, usize>::new();
    for (index, threads) in seen.iter().enumerate() {
        let threads = threads.lock().unwrap();
        let total: u32 = threads.values().sum();
        let (&home, &most) = threads.iter().max_by_key(|(_, &n)| n).unwrap();
        assert_eq!(total, BURSTS * BURST, "{topic}: subscription {index}");
        if most * 100 < total * 70 {
            return Err(format!(
                "{topic}: subscription {index} ran on {} threads, at most {most} of {total} on one",
                threads.len()
            ));
        }
        *homes.entry(home).or_default() += 1;
    }
    if homes.len() != 1 {
        return Err(format!("{topic}: one home for all: {homes:?}"));
    }
    Ok(homes.into_keys().next().unwrap())
}

/// A machine busy with other work (a build beside the tests) runs a home
/// worker late often enough to have it taken over more than a burst's
/// share: three tries, each on a fresh pool, and the first that keeps
/// every subscription home passes. Without homes every try puts about
/// half on each worker.
#[test]
fn a_topic_stays_on_its_home_worker_and_two_topics_on_two() {
    let _alone = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let mut tries = Vec::new();
    for _ in 0..3 {
        match homes_of_two_busy_topics() {
            Ok(()) => return,
            Err(why) => tries.push(why),
        }
    }
    panic!("no try kept the topics home: {tries:#?}");
}

/// One try: 40 bursts of 100 publishes to each of two topics, queued whole
/// behind a held pool; `Err` if a subscription ran less than 70% on its
/// topic's home worker, or the topics share one.
fn homes_of_two_busy_topics() -> Result<(), String> {
    let bus = Bus::<u32>::builder()
        .delivery(DeliveryMode::WorkerPool)
        .workers(2)
        .build()
        .unwrap();
    let (a, _a) = subscribe_all(&bus, "a");
    let (b, _b) = subscribe_all(&bus, "b");
    // Two handlers that block: a publish to them holds both workers (the
    // idle one helps a lone publish), so each burst is queued whole before
    // any of it runs, as when a busy service outruns its workers. (A
    // publish that finds a worker idle and nothing queued is helped by it.)
    let gate = Arc::new(Mutex::new(Arc::new(common::Gate::new())));
    let entered = Arc::new(common::Countdown::new());
    let _hold: Vec<_> = (0..2)
        .map(|_| {
            let (gate, entered) = (Arc::clone(&gate), Arc::clone(&entered));
            bus.subscribe("hold", move |_: &Message<u32>| {
                let current = Arc::clone(&gate.lock().unwrap());
                entered.arrive();
                current.wait();
            })
            .unwrap()
        })
        .collect();
    for burst in 0..BURSTS {
        let current = Arc::new(common::Gate::new());
        *gate.lock().unwrap() = Arc::clone(&current);
        bus.publish("hold", burst).unwrap();
        assert!(entered.wait_for(2 * (burst as usize + 1), LIMIT));
        for i in 0..BURST {
            bus.publish("a", i).unwrap();
            bus.publish("b", i).unwrap();
        }
        current.open();
        assert!(wait_until(LIMIT, || bus.inflight_messages() == 0));
    }
    let (home_a, home_b) = (home_of("a", &a)?, home_of("b", &b)?);
    if home_a == home_b {
        return Err(format!("two topics, one worker: {home_a:?}"));
    }
    Ok(())
}

#[test]
fn below_the_threshold_every_free_worker_joins_in() {
    let _alone = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
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
