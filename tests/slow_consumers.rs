//! Slow and stuck consumers: what each delivery mode promises when a handler
//! is slow, tested deterministically, and what a consumer that never keeps
//! up costs (bounded memory, every loss counted, `Overflow::Error` reported
//! to the publisher).
//!
//! The promises, from `src/dispatch/*.rs` (see `docs/reliability.md`):
//! - `WorkerPool`/`TaskPerSubscriber`, at or below the threshold: each
//!   subscription is its own unit. Under `Batch::Single` each unit is its own
//!   queued job or spawned task; under `Batch::Chunked` runners claim units
//!   one at a time from a shared cursor while handlers take real time (in
//!   `WorkerPool` a runner enlists an idle worker as helper; in
//!   `TaskPerSubscriber` the publisher spawns a runner per worker). Either
//!   way a slow handler holds only the runner it is on: with a worker free,
//!   the other subscriptions of the same publish run while it sleeps.
//! - Above the threshold: `Batch::Chunked` cuts chunks (no smaller than 32
//!   subscriptions) that run in order on one runner each — a slow handler
//!   delays the rest of its own chunk only; `Batch::Single` makes one unit of
//!   the whole publish — a slow handler delays every later subscription of
//!   that publish, but not other publishes.
//! - `Inline`: every delivery runs on the publisher, in order, before
//!   `publish` returns: a slow handler delays the rest and the publisher.
//! - An async handler that awaits is polled once where its delivery runs
//!   and then continues as a task: it holds up nobody, in every mode.
//!
//! Each test makes the slow handler wait (up to 10 s) until the others it
//! must not hold up have run: were they stuck behind it, it would time out
//! and the test fail, rather than hang.

mod common;

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::ThreadId;
use std::time::Duration;

use blazesub::{Batch, Bus, BusBuilder, DeliveryMode, Error, Message, Overflow, Subscription};
use common::{runtime, wait_until, Countdown, TimedBarrier, MODES, POLICIES};

const WAIT: Duration = Duration::from_secs(10);
/// What the other handlers take: real time, so a runner never claims a
/// slow one together with others (see `fanout.rs`).
const OTHER: Duration = Duration::from_micros(200);

/// A pool or task bus with 2 runners, on `rt`.
fn bus(
    mode: DeliveryMode,
    batch: Batch,
    threshold: usize,
    rt: &tokio::runtime::Runtime,
) -> Bus<u32> {
    let bus = Bus::<u32>::builder()
        .delivery(mode)
        .batch(batch)
        .max_concurrent_subscriptions(threshold)
        .workers(2)
        .runtime(rt.handle().clone())
        .build()
        .unwrap();
    if mode == DeliveryMode::WorkerPool {
        warm_up(&bus);
    }
    bus
}

/// Waits until both pool workers have started and are back at their queue:
/// a runner enlists a helper only when a worker is idle, which is what "a
/// worker is free" means. Publishes to two handlers that must meet (both
/// workers running at once) until they do, then gives the workers a moment
/// to return to the queue. Two topics, so the two handlers are two jobs
/// whatever the batch policy and threshold.
fn warm_up(bus: &Bus<u32>) {
    let barrier = Arc::new(TimedBarrier::new(2));
    let met = Arc::new(AtomicUsize::new(0));
    let subs: Vec<Subscription> = (0..2)
        .map(|i| {
            let (barrier, met) = (Arc::clone(&barrier), Arc::clone(&met));
            bus.subscribe(["warm/a", "warm/b"][i], move |_: &Message<u32>| {
                if barrier.wait(Duration::from_millis(200)) {
                    met.fetch_add(1, Ordering::SeqCst);
                }
            })
            .unwrap()
        })
        .collect();
    for _ in 0..50 {
        met.store(0, Ordering::SeqCst);
        bus.publish("warm/a", 0).unwrap();
        bus.publish("warm/b", 0).unwrap();
        assert!(wait_until(Duration::from_secs(10), || bus
            .inflight_messages()
            == 0));
        if met.load(Ordering::SeqCst) == 2 {
            break;
        }
    }
    assert_eq!(
        met.load(Ordering::SeqCst),
        2,
        "the two pool workers never ran at once"
    );
    drop(subs);
    std::thread::sleep(Duration::from_millis(20));
}

/// Where the test publishes from.
#[derive(Clone, Copy)]
enum Publisher<'a> {
    /// The test's own thread, outside any runtime.
    Thread,
    /// A task on this runtime, which ends right after its publish (as a
    /// service's task would go on to await something else).
    Task(&'a tokio::runtime::Runtime),
}

/// Subscribes `n` handlers to `slow/x`, the one at `slow_at` blocking until
/// the `must_run` others (by index) have all run; publishes once; returns
/// whether the slow one saw them all, and which of the others ran while it
/// was still blocked.
fn slow_among_others(
    bus: &Bus<u32>,
    n: usize,
    slow_at: usize,
    must_run: &[usize],
) -> (bool, Vec<usize>) {
    slow_among_others_from(bus, n, slow_at, must_run, Publisher::Thread)
}

/// [`slow_among_others`], publishing from `publisher`.
fn slow_among_others_from(
    bus: &Bus<u32>,
    n: usize,
    slow_at: usize,
    must_run: &[usize],
    publisher: Publisher<'_>,
) -> (bool, Vec<usize>) {
    let ran: Arc<Vec<AtomicBool>> = Arc::new((0..n).map(|_| AtomicBool::new(false)).collect());
    let done = Arc::new(Countdown::new());
    let verdict = Arc::new(Mutex::new(None));
    let ran_while_blocked = Arc::new(Mutex::new(Vec::new()));
    let must: Arc<Vec<usize>> = Arc::new(must_run.to_vec());
    let subs: Vec<Subscription> = (0..n)
        .map(|i| {
            let (ran, done, verdict, seen, must) = (
                Arc::clone(&ran),
                Arc::clone(&done),
                Arc::clone(&verdict),
                Arc::clone(&ran_while_blocked),
                Arc::clone(&must),
            );
            if i == slow_at {
                bus.subscribe("slow/x", move |_: &Message<u32>| {
                    let ok = done.wait_for(must.len(), WAIT);
                    *seen.lock().unwrap() = (0..ran.len())
                        .filter(|&j| ran[j].load(Ordering::SeqCst))
                        .collect();
                    *verdict.lock().unwrap() = Some(ok);
                })
                .unwrap()
            } else {
                bus.subscribe("slow/x", move |_: &Message<u32>| {
                    std::thread::sleep(OTHER);
                    ran[i].store(true, Ordering::SeqCst);
                    if must.contains(&i) {
                        done.arrive();
                    }
                })
                .unwrap()
            }
        })
        .collect();
    let matched = match publisher {
        Publisher::Thread => bus.publish("slow/x", 0).unwrap(),
        Publisher::Task(rt) => {
            let bus = bus.clone();
            rt.block_on(rt.spawn(async move { bus.publish("slow/x", 0).unwrap() }))
                .unwrap()
        }
    };
    assert_eq!(matched, n);
    assert!(
        wait_until(Duration::from_secs(60), || bus.inflight_messages() == 0),
        "the publish never finished"
    );
    let ok = verdict.lock().unwrap().expect("the slow handler never ran");
    drop(subs);
    let seen = ran_while_blocked.lock().unwrap().clone();
    (ok, seen)
}

/// Below the threshold, in `WorkerPool` and `TaskPerSubscriber` under both
/// batch policies: wherever the slow handler sits among 8 subscriptions,
/// the other 7 run while it blocks.
fn below_threshold(mode: DeliveryMode, batch: Batch) {
    below_threshold_from(mode, batch, false);
}

/// [`below_threshold`], publishing from a task on the bus's own runtime
/// if `from_a_task`, else from the test's thread.
fn below_threshold_from(mode: DeliveryMode, batch: Batch, from_a_task: bool) {
    let rt = runtime(2);
    const N: usize = 8;
    let bus = bus(mode, batch, N, &rt);
    let publisher = if from_a_task {
        Publisher::Task(&rt)
    } else {
        Publisher::Thread
    };
    for slow_at in 0..N {
        let others: Vec<usize> = (0..N).filter(|&i| i != slow_at).collect();
        let (ok, _) = slow_among_others_from(&bus, N, slow_at, &others, publisher);
        assert!(
            ok,
            "{mode:?} {batch:?}, below the threshold, publisher a task: {from_a_task}, slow \
             handler at {slow_at} of {N}: the other subscriptions of the publish did not run \
             while it blocked"
        );
    }
}

#[test]
fn worker_pool_single_below_threshold_slow_handler_holds_only_its_runner() {
    below_threshold(DeliveryMode::WorkerPool, Batch::Single);
}

#[test]
fn worker_pool_chunked_below_threshold_slow_handler_holds_only_its_runner() {
    below_threshold(DeliveryMode::WorkerPool, Batch::Chunked);
}

#[test]
fn tasks_single_below_threshold_slow_handler_holds_only_its_runner() {
    below_threshold(DeliveryMode::TaskPerSubscriber, Batch::Single);
}

#[test]
fn tasks_chunked_below_threshold_slow_handler_holds_only_its_runner() {
    below_threshold(DeliveryMode::TaskPerSubscriber, Batch::Chunked);
}

/// As [`below_threshold`], with the publisher a task on the bus's own
/// runtime, as in a service. A runner that spawned a helper from inside its
/// task would put it in that worker thread's LIFO slot, which no other
/// worker steals and which runs only after the runner yields: a runner
/// stuck in the slow handler would hold its helper with it, and this test
/// would fail (see `docs/reliability.md`).
#[test]
fn tasks_chunked_below_threshold_published_from_a_task_slow_handler_holds_only_its_runner() {
    below_threshold_from(DeliveryMode::TaskPerSubscriber, Batch::Chunked, true);
}

#[test]
fn worker_pool_chunked_below_threshold_published_from_a_task_slow_handler_holds_only_its_runner() {
    below_threshold_from(DeliveryMode::WorkerPool, Batch::Chunked, true);
}

/// Above the threshold under `Batch::Chunked`: 64 subscriptions, 2 workers,
/// so 2 chunks of 32. A slow first handler holds its own chunk (none of
/// subscriptions 1–31 runs while it blocks: they are behind it on its
/// runner) and nothing else: all of 32–63 run meanwhile.
fn above_threshold_chunked(mode: DeliveryMode) {
    let rt = runtime(2);
    const N: usize = 64;
    let bus = bus(mode, Batch::Chunked, 1, &rt);
    let other_chunk: Vec<usize> = (N / 2..N).collect();
    let (ok, ran) = slow_among_others(&bus, N, 0, &other_chunk);
    assert!(
        ok,
        "{mode:?} Chunked above the threshold: the other chunk did not run while a handler of the \
         first blocked"
    );
    assert!(
        ran.iter().all(|&i| i >= N / 2),
        "{mode:?}: subscriptions {ran:?} ran while the first of their chunk blocked: chunks run \
         in order on one runner (the documented limit)"
    );
}

#[test]
fn worker_pool_chunked_above_threshold_slow_handler_delays_only_its_chunk() {
    above_threshold_chunked(DeliveryMode::WorkerPool);
}

/// As for `tasks_chunked_below_threshold_…`: the second runner task, which
/// takes the second chunk, must not wait behind the first chunk's slow
/// handler.
#[test]
fn tasks_chunked_above_threshold_slow_handler_delays_only_its_chunk() {
    above_threshold_chunked(DeliveryMode::TaskPerSubscriber);
}

/// Above the threshold under `Batch::Single` the whole publish is one unit:
/// a slow handler delays every subscription after it in that publish (none
/// runs while it blocks), but another publish runs on the other runner.
fn above_threshold_single(mode: DeliveryMode) {
    let rt = runtime(2);
    let bus = bus(mode, Batch::Single, 1, &rt);
    let other_done = Arc::new(Countdown::new());
    let verdict = Arc::new(Mutex::new(None));
    let behind_ran = Arc::new(AtomicUsize::new(0));
    let behind_seen_while_blocked = Arc::new(AtomicUsize::new(usize::MAX));
    let mut subs = Vec::new();
    {
        let (done, verdict, behind, seen) = (
            Arc::clone(&other_done),
            Arc::clone(&verdict),
            Arc::clone(&behind_ran),
            Arc::clone(&behind_seen_while_blocked),
        );
        subs.push(
            bus.subscribe("one/x", move |_: &Message<u32>| {
                let ok = done.wait_for(3, WAIT);
                seen.store(behind.load(Ordering::SeqCst), Ordering::SeqCst);
                *verdict.lock().unwrap() = Some(ok);
            })
            .unwrap(),
        );
    }
    for _ in 0..3 {
        let behind = Arc::clone(&behind_ran);
        subs.push(
            bus.subscribe("one/x", move |_: &Message<u32>| {
                behind.fetch_add(1, Ordering::SeqCst);
            })
            .unwrap(),
        );
        let done = Arc::clone(&other_done);
        subs.push(
            bus.subscribe("two/x", move |_: &Message<u32>| done.arrive())
                .unwrap(),
        );
    }
    assert_eq!(bus.publish("one/x", 0).unwrap(), 4);
    assert_eq!(bus.publish("two/x", 0).unwrap(), 3);
    assert!(wait_until(Duration::from_secs(60), || bus
        .inflight_messages()
        == 0));
    assert_eq!(
        *verdict.lock().unwrap(),
        Some(true),
        "{mode:?} Single above the threshold: another publish waited for a slow handler"
    );
    assert_eq!(
        behind_seen_while_blocked.load(Ordering::SeqCst),
        0,
        "{mode:?}: subscriptions behind the slow one in its single unit ran while it blocked"
    );
    assert_eq!(behind_ran.load(Ordering::SeqCst), 3);
    drop(subs);
}

#[test]
fn worker_pool_single_above_threshold_slow_handler_delays_its_publish_only() {
    above_threshold_single(DeliveryMode::WorkerPool);
}

#[test]
fn tasks_single_above_threshold_slow_handler_delays_its_publish_only() {
    above_threshold_single(DeliveryMode::TaskPerSubscriber);
}

/// `WorkerPool`: a publish to another topic with the same home worker,
/// queued right behind a publish whose handler blocks, runs on the other
/// worker while it blocks, wherever it waited: still in the queue, or
/// already taken off it by the blocked worker (it did not fit that
/// worker's batch, so it was to run next there). It used to wait for the
/// handler in the second case.
#[test]
fn worker_pool_slow_handler_holds_up_no_other_topic_behind_it() {
    let rt = runtime(2);
    let bus = bus(DeliveryMode::WorkerPool, Batch::Chunked, 16, &rt);
    let other_ran = Arc::new(Countdown::new());
    let verdicts = Arc::new(Mutex::new(Vec::new()));
    let _slow = {
        let (other_ran, verdicts) = (Arc::clone(&other_ran), Arc::clone(&verdicts));
        bus.subscribe("slow/t", move |m: &Message<u32>| {
            let ok = other_ran.wait_for(*m.data() as usize + 1, WAIT);
            verdicts.lock().unwrap().push(ok);
        })
        .unwrap()
    };
    let _other = {
        let other_ran = Arc::clone(&other_ran);
        bus.subscribe("slow/u", move |_: &Message<u32>| other_ran.arrive())
            .unwrap()
    };
    // Routes get homes in turn: "slow/t" and "slow/u" share worker 0 of 2.
    assert!(bus.has_subscribers("slow/t"));
    assert!(!bus.has_subscribers("slow/filler"));
    assert!(bus.has_subscribers("slow/u"));
    for round in 0..20 {
        // Back to back, mostly queued before the worker wakes up.
        bus.publish("slow/t", round).unwrap();
        bus.publish("slow/u", round).unwrap();
        assert!(wait_until(WAIT * 2, || bus.inflight_messages() == 0));
        assert_eq!(
            verdicts.lock().unwrap().last(),
            Some(&true),
            "round {round}: the other topic's publish waited for the handler"
        );
    }
}

/// `Inline`: every handler runs on the publisher's thread before `publish`
/// returns, so a slow one delays the publisher and the handlers after it.
#[test]
fn inline_slow_handler_runs_on_the_publisher_before_publish_returns() {
    const N: usize = 5;
    let bus = Bus::<u32>::builder()
        .delivery(DeliveryMode::Inline)
        .build()
        .unwrap();
    let threads: Arc<Mutex<Vec<(usize, ThreadId)>>> = Arc::new(Mutex::new(Vec::new()));
    let subs: Vec<Subscription> = (0..N)
        .map(|i| {
            let threads = Arc::clone(&threads);
            bus.subscribe("inline/x", move |_: &Message<u32>| {
                if i == 0 {
                    std::thread::sleep(Duration::from_millis(20));
                }
                threads
                    .lock()
                    .unwrap()
                    .push((i, std::thread::current().id()));
            })
            .unwrap()
        })
        .collect();
    assert_eq!(bus.publish("inline/x", 0).unwrap(), N);
    let threads = threads.lock().unwrap().clone();
    assert_eq!(
        threads.len(),
        N,
        "publish returned before every handler ran"
    );
    let me = std::thread::current().id();
    assert!(
        threads.iter().all(|&(_, t)| t == me),
        "a handler ran off the publisher's thread"
    );
    drop(subs);
}

/// An async handler that awaits (here: until the other handlers of the same
/// publish have run) holds up nobody, in every mode: its future is polled
/// once, then continues as a task.
#[test]
fn an_awaiting_async_handler_holds_up_nobody_in_any_mode() {
    let rt = runtime(2);
    for mode in MODES {
        for batch in [Batch::Single, Batch::Chunked] {
            let bus = bus(mode, batch, 10, &rt);
            let others_done = Arc::new(tokio::sync::Semaphore::new(0));
            let verdict = Arc::new(Mutex::new(None));
            let mut subs = Vec::new();
            {
                let (sem, verdict) = (Arc::clone(&others_done), Arc::clone(&verdict));
                subs.push(
                    bus.subscribe_async("async/x", move |_: Arc<Message<u32>>| {
                        let (sem, verdict) = (Arc::clone(&sem), Arc::clone(&verdict));
                        async move {
                            let ok = tokio::time::timeout(WAIT, sem.acquire_many(4))
                                .await
                                .is_ok();
                            *verdict.lock().unwrap() = Some(ok);
                        }
                    })
                    .unwrap(),
                );
            }
            for _ in 0..4 {
                let sem = Arc::clone(&others_done);
                subs.push(
                    bus.subscribe("async/x", move |_: &Message<u32>| sem.add_permits(1))
                        .unwrap(),
                );
            }
            assert_eq!(bus.publish("async/x", 0).unwrap(), 5);
            assert!(wait_until(Duration::from_secs(60), || bus
                .inflight_messages()
                == 0));
            assert_eq!(
                *verdict.lock().unwrap(),
                Some(true),
                "{mode:?} {batch:?}: the other handlers waited for an awaiting async handler"
            );
            drop(subs);
        }
    }
}

// ---------------------------------------------------------------------------
// Consumers that never keep up: bounded memory, counted losses
// ---------------------------------------------------------------------------

/// A payload that counts how many of its kind are alive.
struct Payload {
    live: Arc<AtomicU64>,
    id: u32,
}

impl Payload {
    fn new(live: &Arc<AtomicU64>, id: u32) -> Self {
        live.fetch_add(1, Ordering::SeqCst);
        Self {
            live: Arc::clone(live),
            id,
        }
    }
}

impl Drop for Payload {
    fn drop(&mut self) {
        self.live.fetch_sub(1, Ordering::SeqCst);
    }
}

/// A stream nobody reads, in every mode and under every overflow policy:
/// 10,000 messages into a mailbox of 64 keep at most 64 messages alive (the
/// newest, in order), every publish succeeds (a full mailbox is not an
/// overload: it drops the oldest), and every loss is counted in `lost()` and
/// `stats().dropped`; dropping the receiver frees the rest and counts them.
#[test]
fn an_unread_stream_keeps_memory_bounded_under_every_policy() {
    const N: u32 = 10_000;
    const CAPACITY: usize = 64;
    let rt = runtime(2);
    for mode in MODES {
        for overflow in POLICIES {
            let what = format!("{mode:?} {overflow:?}");
            let live = Arc::new(AtomicU64::new(0));
            let bus = Bus::<Payload>::builder()
                .delivery(mode)
                .overflow(overflow)
                .stream_capacity(CAPACITY)
                .runtime(rt.handle().clone())
                .build()
                .unwrap();
            let mut rx = bus.subscribe_stream("unread/#").unwrap();
            let mut peak = 0;
            for id in 0..N {
                assert_eq!(
                    bus.publish("unread/x", Payload::new(&live, id)).unwrap(),
                    1,
                    "{what}"
                );
                peak = peak.max(live.load(Ordering::SeqCst));
            }
            assert!(
                peak <= CAPACITY as u64,
                "{what}: {peak} messages alive at once for a mailbox of {CAPACITY}"
            );
            let lost = u64::from(N) - CAPACITY as u64;
            assert_eq!(rx.lost(), lost, "{what}: lost()");
            assert_eq!(bus.stats().dropped, lost, "{what}: stats().dropped");
            assert_eq!(rx.len(), CAPACITY, "{what}");
            // The newest, in order.
            let first = rx.try_recv().unwrap();
            assert_eq!(first.data().id, N - CAPACITY as u32, "{what}");
            drop(first);
            drop(rx);
            assert_eq!(
                live.load(Ordering::SeqCst),
                0,
                "{what}: messages outlived the receiver"
            );
            assert_eq!(
                bus.stats().dropped,
                u64::from(N) - 1,
                "{what}: the unread ones count as dropped when the receiver goes"
            );
            assert_eq!(bus.stats().delivered, 1, "{what}");
        }
    }
}

/// A handler stuck until the test releases it, on a pool of 1 worker with a
/// queue of 4 jobs (or a task cap of 4), under `Drop` and `Error`: 1,000
/// publishes keep at most queue + running messages alive; `Drop` never fails
/// a publish, `Error` fails each one that dropped, with `Error::Overloaded`;
/// the drops reported equal `stats().dropped`; after the release every
/// message is delivered or counted.
#[test]
fn a_stuck_handler_costs_bounded_memory_and_counted_drops() {
    const N: u32 = 1_000;
    const ROOM: usize = 4;
    let rt = runtime(2);
    for mode in [DeliveryMode::WorkerPool, DeliveryMode::TaskPerSubscriber] {
        for overflow in [Overflow::Drop, Overflow::Error] {
            let what = format!("{mode:?} {overflow:?}");
            let live = Arc::new(AtomicU64::new(0));
            let bus = Bus::<Payload>::builder()
                .delivery(mode)
                .overflow(overflow)
                .workers(1)
                .queue_capacity(ROOM)
                .max_inflight_tasks(ROOM)
                .runtime(rt.handle().clone())
                .build()
                .unwrap();
            let gate = Arc::new(Countdown::new());
            let calls = Arc::new(AtomicU64::new(0));
            let (g, c) = (Arc::clone(&gate), Arc::clone(&calls));
            let sub = bus
                .subscribe("stuck/x", move |_: &Message<Payload>| {
                    assert!(g.wait_for(1, Duration::from_secs(60)), "never released");
                    c.fetch_add(1, Ordering::SeqCst);
                })
                .unwrap();
            let mut reported = 0u64;
            let mut peak = 0;
            for id in 0..N {
                match bus.publish("stuck/x", Payload::new(&live, id)) {
                    Ok(1) => {}
                    Err(Error::Overloaded {
                        dropped: 1,
                        matched: 1,
                        ..
                    }) if overflow == Overflow::Error => reported += 1,
                    other => panic!("{what}: publish {id} returned {other:?}"),
                }
                peak = peak.max(live.load(Ordering::SeqCst));
            }
            // Queued jobs plus the ones running (1 worker; or the task cap).
            let bound = 2 * ROOM as u64 + 1;
            assert!(
                peak <= bound,
                "{what}: {peak} messages alive at once behind a stuck handler (bound {bound})"
            );
            let dropped = bus.stats().dropped;
            assert!(
                dropped >= u64::from(N) - bound,
                "{what}: only {dropped} dropped"
            );
            match overflow {
                Overflow::Error => assert_eq!(reported, dropped, "{what}: drops reported"),
                _ => assert_eq!(reported, 0),
            }
            gate.arrive();
            assert!(wait_until(Duration::from_secs(60), || bus
                .inflight_messages()
                == 0));
            let stats = bus.stats();
            assert_eq!(stats.delivered, calls.load(Ordering::SeqCst), "{what}");
            assert_eq!(stats.delivered + stats.dropped, u64::from(N), "{what}");
            drop(sub);
            assert_eq!(
                live.load(Ordering::SeqCst),
                0,
                "{what}: messages left alive"
            );
        }
    }
}

/// The default, `CallerRuns`, with a handler that is merely slow (1 ms) and
/// a queue of 4: nothing is dropped, the publisher runs what does not fit
/// (so it is slowed to the handler's pace), and memory stays bounded.
#[test]
fn caller_runs_slows_the_publisher_instead_of_dropping() {
    const N: u32 = 200;
    const ROOM: usize = 4;
    let rt = runtime(2);
    for mode in [DeliveryMode::WorkerPool, DeliveryMode::TaskPerSubscriber] {
        let what = format!("{mode:?}");
        let live = Arc::new(AtomicU64::new(0));
        let bus = builder_with_room(mode, ROOM, &rt).build().unwrap();
        let calls = Arc::new(AtomicU64::new(0));
        let c = Arc::clone(&calls);
        let sub = bus
            .subscribe("slowish/x", move |_: &Message<Payload>| {
                std::thread::sleep(Duration::from_millis(1));
                c.fetch_add(1, Ordering::SeqCst);
            })
            .unwrap();
        let mut peak = 0;
        for id in 0..N {
            assert_eq!(
                bus.publish("slowish/x", Payload::new(&live, id)).unwrap(),
                1
            );
            peak = peak.max(live.load(Ordering::SeqCst));
        }
        let bound = 2 * ROOM as u64 + 2;
        assert!(
            peak <= bound,
            "{what}: {peak} messages alive (bound {bound})"
        );
        assert!(wait_until(Duration::from_secs(60), || bus
            .inflight_messages()
            == 0));
        let stats = bus.stats();
        assert_eq!(
            (stats.delivered, stats.dropped),
            (u64::from(N), 0),
            "{what}"
        );
        assert!(
            stats.caller_runs > 0,
            "{what}: the publisher never ran a delivery"
        );
        drop(sub);
    }
}

fn builder_with_room(
    mode: DeliveryMode,
    room: usize,
    rt: &tokio::runtime::Runtime,
) -> BusBuilder<Payload> {
    Bus::<Payload>::builder()
        .delivery(mode)
        .overflow(Overflow::CallerRuns)
        .workers(1)
        .queue_capacity(room)
        .max_inflight_tasks(room)
        .runtime(rt.handle().clone())
}
