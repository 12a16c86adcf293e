//! Review of the thirty-seventh session's change: the pool's `next` slot
//! and the stand-in a `close` from inside a handler runs. Every wait is
//! under a time limit, so a bug fails instead of hanging.

mod common;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::Receiver;
use std::sync::Arc;
use std::time::{Duration, Instant};

use blazesub::{Bus, BusBuilder, DeliveryMode, Error, Message, Subscription};

type Closed = Receiver<(Result<(), Error>, Duration)>;

const LIMIT: Duration = Duration::from_secs(20);
const PROMPT: Duration = Duration::from_secs(1);

fn builder(workers: usize) -> BusBuilder<u32> {
    Bus::<u32>::builder()
        .delivery(DeliveryMode::WorkerPool)
        .workers(workers)
        .close_timeout(Duration::from_secs(2))
}

/// A handler of `topic` that, on `on`, waits for `go` and then blocks on
/// `close`, sending what it returned and how long it took.
fn gated_closer(
    bus: &Bus<u32>,
    topic: &str,
    on: u32,
    ordered: bool,
) -> (
    Subscription,
    Closed,
    std::sync::mpsc::SyncSender<()>,
    Receiver<()>,
) {
    let (tx, closed) = std::sync::mpsc::channel();
    let (go_tx, go) = std::sync::mpsc::sync_channel::<()>(1);
    let go = std::sync::Mutex::new(go);
    let (started_tx, started) = std::sync::mpsc::sync_channel::<()>(1);
    let inner = bus.clone();
    let close = move |m: &Message<u32>| {
        if *m.data() == on {
            let _ = started_tx.try_send(());
            let _ = go.lock().unwrap().recv_timeout(LIMIT);
            let started = Instant::now();
            let result = common::block_on(inner.close());
            let _ = tx.send((result, started.elapsed()));
        }
    };
    let sub = if ordered {
        bus.subscribe_ordered(topic, close).unwrap()
    } else {
        bus.subscribe(topic, close).unwrap()
    };
    (sub, closed, go_tx, started)
}

fn check_drained(what: &str, bus: &Bus<u32>, reached: u64) {
    assert!(
        common::wait_until(LIMIT, || bus.inflight_messages() == 0),
        "{what}: {:?}",
        bus.stats()
    );
    let stats = bus.stats();
    assert_eq!(
        stats.delivered + stats.dropped + stats.handler_panics,
        reached,
        "{what}: {stats:?}"
    );
}

/// A burst queued behind the closer on a pool of one: the stand-in runs
/// it one ticket per `STALL` (it re-watches the worker after every ticket
/// it takes, and never batches), where a second worker takes half the
/// queue as one batch at a time. `close` then takes ~1 ms per queued
/// publish: with the default 4,096-ticket queue it can pass its timeout.
#[test]
fn stand_in_drains_a_burst_behind_the_closer_promptly() {
    for workers in [2, 1] {
        let what = format!("workers: {workers}");
        let bus = builder(workers).build().unwrap();
        let (_closer, closed, go, _started) = gated_closer(&bus, "t", 0, false);
        let (_others, count) = common::counters(&bus, "u", 1);
        // Routes get homes in turn: "t" first, then fillers, then "u".
        assert!(bus.has_subscribers("t"));
        for filler in 1..workers {
            assert!(!bus.has_subscribers(&format!("filler/{filler}")));
        }
        assert!(bus.has_subscribers("u"));
        let mut reached = bus.publish("t", 0).unwrap() as u64;
        for i in 0..2_000 {
            reached += bus.publish("u", i).unwrap() as u64;
        }
        go.send(()).unwrap();
        let (result, took) = closed.recv_timeout(LIMIT).expect("close never returned");
        assert!(result.is_ok(), "{what}: {result:?} after {took:?}");
        assert!(
            took < PROMPT,
            "{what}: close took {took:?} ({} of 2000 run)",
            count.load(Ordering::SeqCst)
        );
        check_drained(&what, &bus, reached);
    }
}

/// An ordered closer on a pool of one, with a later message to the same
/// topic queued behind it (not batched with it: published once the
/// closer runs). The stand-in runs that publish; the closer's ordered
/// subscription leaves its message to the runner that holds its turn (the
/// closer, blocked), which `close` then counts as the caller's: it
/// returns at once. (Passes: a check, not a finding.)
#[test]
fn ordered_closer_with_its_own_topic_queued_behind_on_one_worker() {
    for workers in [1, 2] {
        let what = format!("workers: {workers}");
        let bus = builder(workers).build().unwrap();
        let (_closer, closed, go, started) = gated_closer(&bus, "t", 0, true);
        let (_others, _count) = common::counters(&bus, "t", 2);
        let mut reached = bus.publish("t", 0).unwrap() as u64;
        started.recv_timeout(LIMIT).unwrap();
        reached += bus.publish("t", 1).unwrap() as u64;
        go.send(()).unwrap();
        let (result, took) = closed.recv_timeout(LIMIT).expect("close never returned");
        check_drained(&what, &bus, reached);
        assert!(
            result.is_ok() && took < PROMPT,
            "{what}: {result:?} after {took:?}"
        );
    }
}

/// Threads of this process whose name starts with `prefix` (Linux).
fn threads_named(prefix: &str) -> usize {
    std::fs::read_dir("/proc/self/task")
        .map(|tasks| {
            tasks
                .filter_map(|task| std::fs::read_to_string(task.ok()?.path().join("comm")).ok())
                .filter(|name| name.starts_with(prefix))
                .count()
        })
        .unwrap_or(0)
}

/// An async handler retries `close` under a short timeout (what
/// `Abandoned`'s docs say leaves no thread behind) while a worker is held
/// up by a handler that blocks with more of it queued. Each attempt starts
/// a stand-in that takes one of those publishes and blocks in it: when the
/// attempts are over, their threads are still there, and the blocking
/// handler runs on more threads at once than the pool has workers.
#[test]
fn close_retried_under_a_timeout_from_a_handler_leaves_no_threads_behind() {
    let runtime = common::runtime(2);
    let bus = builder(2)
        .runtime(runtime.handle().clone())
        .build()
        .unwrap();
    let released = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let running = Arc::new(AtomicU64::new(0));
    let most = Arc::new(AtomicU64::new(0));
    let _blocker = {
        let (released, running, most) = (released.clone(), running.clone(), most.clone());
        bus.subscribe("s", move |_| {
            let now = running.fetch_add(1, Ordering::SeqCst) + 1;
            most.fetch_max(now, Ordering::SeqCst);
            let limit = Instant::now() + LIMIT;
            while !released.load(Ordering::SeqCst) && Instant::now() < limit {
                std::thread::sleep(Duration::from_millis(1));
            }
            running.fetch_sub(1, Ordering::SeqCst);
        })
        .unwrap()
    };
    let go = Arc::new(tokio::sync::Notify::new());
    let (done_tx, done) = std::sync::mpsc::channel();
    let _retrier = {
        let (bus, go) = (bus.clone(), go.clone());
        bus.clone()
            .subscribe_async("c", move |_| {
                let (bus, go, done_tx) = (bus.clone(), go.clone(), done_tx.clone());
                async move {
                    go.notified().await;
                    for _ in 0..8 {
                        let _ = tokio::time::timeout(Duration::from_millis(20), bus.close()).await;
                    }
                    let _ = done_tx.send(());
                }
            })
            .unwrap()
    };
    // Routes get homes in turn: "s" on worker 0, "c" on worker 1.
    assert!(bus.has_subscribers("s"));
    assert!(bus.has_subscribers("c"));
    let mut reached = bus.publish("c", 0).unwrap() as u64;
    reached += bus.publish("s", 0).unwrap() as u64;
    // Not batched with the first: published once it runs.
    assert!(common::wait_until(LIMIT, || running.load(Ordering::SeqCst) == 1));
    for i in 1..20 {
        reached += bus.publish("s", i).unwrap() as u64;
    }
    // Both workers end up in the blocking handler.
    assert!(
        common::wait_until(Duration::from_secs(3), || running.load(Ordering::SeqCst)
            == 2),
        "running: {}, inflight {}",
        running.load(Ordering::SeqCst),
        bus.inflight_messages()
    );
    go.notify_one();
    done.recv_timeout(LIMIT).expect("the retries never ended");
    // Waiters with nothing to wait for end within a millisecond or two.
    std::thread::sleep(Duration::from_millis(100));
    let left = threads_named("blazesub-close");
    let most_at_once = most.load(Ordering::SeqCst);
    released.store(true, Ordering::SeqCst);
    check_drained("after the release", &bus, reached);
    assert!(
        common::wait_until(LIMIT, || threads_named("blazesub-close") == 0),
        "threads left even after the release"
    );
    // One stand-in may stay in a handler that blocks (its waiter with it),
    // by design; one per abandoned `close` may not.
    assert!(
        left <= 2 && most_at_once <= 3,
        "{left} close threads left after every close future was dropped, and \
         {most_at_once} blocking handlers running at once on a pool of 2"
    );
}
