//! Issue 13's "What must hold", cases an audit (thirty-seventh session)
//! found no test for: a sync handler's request on a pool's only worker, a
//! handler's publishes nesting on its own stack outside `Inline` mode (a
//! full queue), a sync task-mode handler blocking on `close`, async ordered
//! handlers under several publishers, a retry loop against a waiting
//! `publish_async`, and a refused publish reaching no subscription of any
//! kind. Every wait is under a time limit, so a defect fails instead of
//! hanging; a case that could abort the process (a stack overflow) runs in
//! a child process.

mod common;

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use blazesub::{Bus, DeliveryMode, Error, Message, Overflow, StreamOptions, StreamOverflow};
use common::MODES;

const LIMIT: Duration = Duration::from_secs(20);

fn lossless(capacity: usize) -> StreamOptions {
    StreamOptions::new(capacity).overflow(StreamOverflow::Backpressure)
}

// ---------------------------------------------------------------------------
// Item 6: `request` from inside a *sync* handler (the issue: "sync and
// async, every mode ... request ... never deadlock"). On a pool of one
// worker the request's delivery was queued behind the very worker that
// blocked waiting for its reply, and the request timed out; a request made
// on a pool worker now runs its deliveries there.
// ---------------------------------------------------------------------------

fn sync_request_case(workers: usize, queue: usize, overflow: Overflow) -> Result<u32, String> {
    let rt = common::runtime(2);
    let bus = Bus::<u32>::builder()
        .delivery(DeliveryMode::WorkerPool)
        .workers(workers)
        .queue_capacity(queue)
        .overflow(overflow)
        .close_timeout(Duration::from_secs(2))
        .runtime(rt.handle().clone())
        .build()
        .unwrap();
    let responder = bus.clone();
    let _responder = bus
        .subscribe("rpc", move |m: &Message<u32>| {
            let _ = responder.reply(m, *m.data() + 1);
        })
        .unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    let tx = Mutex::new(tx);
    let requester = bus.clone();
    let _requester = bus
        .subscribe("go", move |_| {
            let reply = common::block_on(requester.request("rpc", 41, Duration::from_secs(3)));
            let _ = tx
                .lock()
                .unwrap()
                .send(reply.map(|m| *m.data()).map_err(|e| e.to_string()));
        })
        .unwrap();
    bus.publish("go", 0).unwrap();
    let reply = rx
        .recv_timeout(LIMIT)
        .map_err(|_| "the requesting handler never finished".to_string())?;
    let stats = bus.stats();
    reply.map_err(|e| format!("{e} ({stats:?})"))
}

#[test]
fn request_from_a_sync_handler_on_the_only_pool_worker_is_answered() {
    let mut failures = Vec::new();
    for (workers, queue, overflow) in [(1, 64, Overflow::Wait), (1, 1, Overflow::CallerRuns)] {
        match sync_request_case(workers, queue, overflow) {
            Ok(42) => {}
            other => failures.push(format!(
                "{workers} worker(s), queue {queue}, {overflow:?}: {other:?}"
            )),
        }
    }
    assert!(failures.is_empty(), "{failures:#?}");
}

/// Control: with a second worker free the same request is answered.
#[test]
fn request_from_a_sync_handler_with_a_free_worker_is_answered() {
    assert_eq!(sync_request_case(2, 64, Overflow::Wait), Ok(42));
}

// ---------------------------------------------------------------------------
// Item 6: `close` from a sync handler that `TaskPerSubscriber` runs as a
// task (the common path, not the publisher-runs-it paths that
// contracts_review_36 covers). Its docs say such a handler should spawn the
// close; here it blocks on it as a pool handler may.
// ---------------------------------------------------------------------------

#[test]
fn close_from_a_sync_handler_run_as_a_task_returns_before_its_timeout() {
    let rt = common::runtime(2);
    let bus = Bus::<u32>::builder()
        .delivery(DeliveryMode::TaskPerSubscriber)
        .close_timeout(Duration::from_secs(2))
        .runtime(rt.handle().clone())
        .build()
        .unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    let tx = Mutex::new(tx);
    let inner = bus.clone();
    let _closer = bus
        .subscribe("close", move |_| {
            let started = Instant::now();
            let result = common::block_on(inner.close());
            let _ = tx.lock().unwrap().send((result, started.elapsed()));
        })
        .unwrap();
    let count = Arc::new(AtomicU64::new(0));
    let counted = Arc::clone(&count);
    let _other = bus
        .subscribe("close", move |_| {
            counted.fetch_add(1, Ordering::SeqCst);
        })
        .unwrap();
    bus.publish("close", 1).unwrap();
    let (result, took) = rx.recv_timeout(LIMIT).expect("close never returned");
    assert!(
        result.is_ok() && took < Duration::from_secs(1),
        "close from a sync task-mode handler: {result:?} after {took:?}"
    );
    assert_eq!(count.load(Ordering::SeqCst), 1);
}

// ---------------------------------------------------------------------------
// Item 4: async ordered handlers with several publishers: no two calls
// overlap (a flag held across an await) and each publisher's order holds.
// contracts.rs checks async ordered with one publisher and no overlap probe.
// ---------------------------------------------------------------------------

#[test]
fn async_ordered_calls_never_overlap_and_keep_each_publishers_order() {
    const PUBLISHERS: u32 = 3;
    const EACH: u32 = 400;
    for mode in MODES {
        let rt = common::runtime(2);
        let bus = Bus::<u32>::builder()
            .delivery(mode)
            .workers(2)
            .stream_capacity(10_000)
            .runtime(rt.handle().clone())
            .build()
            .unwrap();
        let inside = Arc::new(AtomicBool::new(false));
        let overlaps = Arc::new(AtomicU64::new(0));
        let disorder = Arc::new(AtomicU64::new(0));
        let calls = Arc::new(AtomicU64::new(0));
        let last: Arc<Mutex<HashMap<String, u32>>> = Arc::default();
        let _sub = {
            let (inside, overlaps, disorder, calls, last) = (
                Arc::clone(&inside),
                Arc::clone(&overlaps),
                Arc::clone(&disorder),
                Arc::clone(&calls),
                Arc::clone(&last),
            );
            bus.subscribe_ordered_async("o/+", move |m: Arc<Message<u32>>| {
                let (inside, overlaps, disorder, calls, last) = (
                    Arc::clone(&inside),
                    Arc::clone(&overlaps),
                    Arc::clone(&disorder),
                    Arc::clone(&calls),
                    Arc::clone(&last),
                );
                async move {
                    if inside.swap(true, Ordering::SeqCst) {
                        overlaps.fetch_add(1, Ordering::SeqCst);
                    }
                    let previous = last.lock().unwrap().insert(m.topic().to_owned(), *m.data());
                    if previous.map_or(0, |p| p + 1) != *m.data() {
                        disorder.fetch_add(1, Ordering::SeqCst);
                    }
                    if m.data() % 7 == 0 {
                        tokio::task::yield_now().await;
                    }
                    calls.fetch_add(1, Ordering::SeqCst);
                    inside.store(false, Ordering::SeqCst);
                }
            })
            .unwrap()
        };
        let publishers: Vec<_> = (0..PUBLISHERS)
            .map(|p| {
                let bus = bus.clone();
                std::thread::spawn(move || {
                    for seq in 0..EACH {
                        bus.publish(&format!("o/{p}"), seq).unwrap();
                    }
                })
            })
            .collect();
        for publisher in publishers {
            publisher.join().unwrap();
        }
        rt.block_on(async { tokio::time::timeout(LIMIT, bus.close()).await })
            .expect("close hangs")
            .unwrap();
        let what = format!("{mode:?}");
        assert_eq!(
            overlaps.load(Ordering::SeqCst),
            0,
            "{what}: calls overlapped"
        );
        assert_eq!(disorder.load(Ordering::SeqCst), 0, "{what}: out of order");
        assert_eq!(
            calls.load(Ordering::SeqCst),
            u64::from(PUBLISHERS * EACH),
            "{what}: {:?}",
            bus.stats()
        );
    }
}

// ---------------------------------------------------------------------------
// Item 2, fairness: a publisher that retries `publish` in a loop (never
// waits) cannot take the room a waiting `publish_async` waits for.
// ---------------------------------------------------------------------------

#[test]
fn a_publish_retry_loop_cannot_starve_a_waiting_publish_async() {
    let mut failures = Vec::new();
    for mode in MODES {
        let rt = common::runtime(2);
        let bus = Bus::<u32>::builder()
            .delivery(mode)
            .workers(2)
            .runtime(rt.handle().clone())
            .build()
            .unwrap();
        let mut rx = bus.subscribe_stream_with("f/+", lossless(1)).unwrap();
        let stop = Arc::new(AtomicBool::new(false));
        let read = Arc::new(AtomicU64::new(0));
        let reader = {
            let (stop, read) = (Arc::clone(&stop), Arc::clone(&read));
            rt.spawn(async move {
                while !stop.load(Ordering::SeqCst) {
                    if let Ok(Some(_)) =
                        tokio::time::timeout(Duration::from_millis(50), rx.recv()).await
                    {
                        read.fetch_add(1, Ordering::SeqCst);
                    }
                    tokio::time::sleep(Duration::from_millis(2)).await;
                }
            })
        };
        let spinner = {
            let (bus, stop) = (bus.clone(), Arc::clone(&stop));
            std::thread::spawn(move || {
                let mut went = 0u64;
                while !stop.load(Ordering::SeqCst) {
                    if bus.publish("f/fast", 0).is_ok() {
                        went += 1;
                    }
                    std::hint::spin_loop();
                }
                went
            })
        };
        std::thread::sleep(Duration::from_millis(50));
        let read0 = read.load(Ordering::SeqCst);
        let victim = rt.block_on(async {
            tokio::time::timeout(Duration::from_secs(3), bus.publish_async("f/slow", 1)).await
        });
        let reads = read.load(Ordering::SeqCst) - read0;
        stop.store(true, Ordering::SeqCst);
        let went = spinner.join().unwrap();
        let _ = rt.block_on(async { tokio::time::timeout(LIMIT, reader).await });
        if !matches!(victim, Ok(Ok(1))) || reads > 3 {
            failures.push(format!(
                "{mode:?}: publish_async = {victim:?} after {reads} reads; the spinning \
                 publish went through {went} times"
            ));
        }
    }
    assert!(failures.is_empty(), "{failures:#?}");
}

// ---------------------------------------------------------------------------
// Item 2, all or nothing: a publish refused with `Error::Full` reaches no
// handler of any kind (ordered, async, async ordered, shared handler and
// stream members), and counts nothing.
// ---------------------------------------------------------------------------

#[test]
fn a_full_publish_reaches_no_handler_of_any_kind() {
    for mode in MODES {
        let rt = common::runtime(2);
        let bus = Bus::<u32>::builder()
            .delivery(mode)
            .workers(2)
            .runtime(rt.handle().clone())
            .build()
            .unwrap();
        let got = Arc::new(AtomicU64::new(0));
        let mut subs = Vec::new();
        let g = Arc::clone(&got);
        subs.push(
            bus.subscribe_ordered("t", move |_| {
                g.fetch_add(1, Ordering::SeqCst);
            })
            .unwrap(),
        );
        let g = Arc::clone(&got);
        subs.push(
            bus.subscribe_async("t", move |_| {
                let g = Arc::clone(&g);
                async move {
                    g.fetch_add(1, Ordering::SeqCst);
                }
            })
            .unwrap(),
        );
        let g = Arc::clone(&got);
        subs.push(
            bus.subscribe_ordered_async("t", move |_| {
                let g = Arc::clone(&g);
                async move {
                    g.fetch_add(1, Ordering::SeqCst);
                }
            })
            .unwrap(),
        );
        let g = Arc::clone(&got);
        subs.push(
            bus.subscribe("$share/g/t", move |_| {
                g.fetch_add(1, Ordering::SeqCst);
            })
            .unwrap(),
        );
        let shared_stream = bus.subscribe_stream("$share/h/t").unwrap();
        let mut full = bus.subscribe_stream_with("t", lossless(1)).unwrap();
        assert_eq!(bus.publish("t", 0).unwrap(), 6, "{mode:?}");
        assert!(common::wait_until(LIMIT, || bus.inflight_messages() == 0));
        let before = (got.load(Ordering::SeqCst), bus.stats());
        assert_eq!(before.0, 4, "{mode:?}");
        for _ in 0..5 {
            assert!(
                matches!(bus.publish("t", 1), Err(Error::Full { .. })),
                "{mode:?}"
            );
            assert!(
                matches!(bus.publish_retained("t", 1), Err(Error::Full { .. })),
                "{mode:?}"
            );
        }
        std::thread::sleep(Duration::from_millis(50));
        assert!(common::wait_until(LIMIT, || bus.inflight_messages() == 0));
        let after = (got.load(Ordering::SeqCst), bus.stats());
        assert_eq!(after.0, 4, "{mode:?}: a refused publish reached a handler");
        assert_eq!(shared_stream.len(), 1, "{mode:?}");
        assert_eq!(
            (
                after.1.published,
                after.1.dropped,
                after.1.delivered,
                after.1.retained
            ),
            (before.1.published, before.1.dropped, before.1.delivered, 0),
            "{mode:?}: a refused publish was counted or retained"
        );
        assert_eq!(*full.try_recv().unwrap().data(), 0);
        drop(subs);
    }
}

// ---------------------------------------------------------------------------
// Item 6 beside the Inline limit: a handler whose publishes reach itself
// again *under a full pool queue* runs them on its own stack (a worker's
// publish into a full queue runs the job itself, under `Wait` and
// `CallerRuns`; the task cap under `CallerRuns` likewise). That nesting
// was unbounded outside `Inline` mode, and the process aborted; it now
// stops at the same depth. Run in a child process: a stack overflow
// aborts it.
// ---------------------------------------------------------------------------

const CHILD_ENV: &str = "AUDIT_37_CHILD";

/// A chain of `DEPTH` self-publishes; each call first fills the one-ticket
/// queue with a no-op publish, so its publish to itself finds the queue full.
fn child_self_publishing_chain(mode: DeliveryMode, overflow: Overflow) {
    const DEPTH: u32 = 1_000_000;
    let rt = common::runtime(2);
    let bus = Bus::<u32>::builder()
        .delivery(mode)
        .workers(1)
        .queue_capacity(1)
        .max_inflight_tasks(1)
        .overflow(overflow)
        .runtime(rt.handle().clone())
        .build()
        .unwrap();
    let _noop = bus.subscribe("noop", |_| {}).unwrap();
    let deepest = Arc::new(AtomicU64::new(0));
    let refused = Arc::new(AtomicU64::new(0));
    let inner = bus.clone();
    let (deep, refusals) = (Arc::clone(&deepest), Arc::clone(&refused));
    let _echo = bus
        .subscribe("echo", move |m| {
            deep.fetch_max(u64::from(*m.data()), Ordering::SeqCst);
            let _ = inner.publish("noop", 0);
            if *m.data() < DEPTH && inner.publish("echo", m.data() + 1).is_err() {
                refusals.fetch_add(1, Ordering::SeqCst);
            }
        })
        .unwrap();
    bus.publish("echo", 1).unwrap();
    assert!(common::wait_until(Duration::from_secs(60), || {
        bus.inflight_messages() == 0
    }));
    let stats = bus.stats();
    assert!(stats.recursion_refused >= 1, "{stats:?}");
    assert_eq!(refused.load(Ordering::SeqCst), 1, "{stats:?}");
    assert!(deepest.load(Ordering::SeqCst) <= 66, "{stats:?}");
    println!(
        "RESULT deepest {} refused {} stats {:?}",
        deepest.load(Ordering::SeqCst),
        refused.load(Ordering::SeqCst),
        bus.stats()
    );
}

/// The same at the bus's defaults as a one-core host gets them
/// (`WorkerPool`, one worker, queue 4,096, `Overflow::Wait`; set
/// `AUDIT_37_WORKERS=2` for two workers, which passes here): the first call fills its worker's queue with
/// 5,000 no-op publishes (`0`) to its own topic; each later call publishes
/// one more no-op and then the next link of the chain.
fn child_chain_at_defaults() {
    let depth_limit: u32 = std::env::var("AUDIT_37_DEPTH")
        .ok()
        .and_then(|d| d.parse().ok())
        .unwrap_or(1_000_000);
    let rt = common::runtime(2);
    // `workers` is the machine's cores by default: 1 on a one-core host.
    let workers: usize = std::env::var("AUDIT_37_WORKERS")
        .ok()
        .and_then(|w| w.parse().ok())
        .unwrap_or(1);
    let bus = Bus::<u32>::builder()
        .workers(workers)
        .runtime(rt.handle().clone())
        .build()
        .unwrap();
    let deepest = Arc::new(AtomicU64::new(0));
    let inner = bus.clone();
    let deep = Arc::clone(&deepest);
    let _echo = bus
        .subscribe("echo", move |m| {
            let d = *m.data();
            if d == 0 {
                return;
            }
            deep.fetch_max(u64::from(d), Ordering::SeqCst);
            let noops = if d == 1 { 5_000 } else { 1 };
            for _ in 0..noops {
                let _ = inner.publish("echo", 0);
            }
            if d < depth_limit {
                let _ = inner.publish("echo", d + 1);
            }
        })
        .unwrap();
    bus.publish("echo", 1).unwrap();
    assert!(common::wait_until(Duration::from_secs(60), || {
        bus.inflight_messages() == 0
    }));
    let stats = bus.stats();
    if workers == 1 {
        assert!(stats.recursion_refused >= 1, "{stats:?}");
    }
    println!(
        "RESULT deepest {} stats {:?}",
        deepest.load(Ordering::SeqCst),
        bus.stats()
    );
}

#[test]
fn a_handler_chain_at_the_bus_defaults_never_overflows_the_stack() {
    let (how, text) = common::run_child(CHILD_ENV, "pool_defaults", Duration::from_secs(120));
    let result: String = text
        .lines()
        .filter(|l| l.contains("RESULT") || l.contains("overflow") || l.contains("panicked"))
        .collect::<Vec<_>>()
        .join(" | ");
    println!("pool_defaults: {how}: {result}");
    assert_eq!(how, "exit 0", "{result}");
}

#[test]
fn child_case() {
    let Ok(case) = std::env::var(CHILD_ENV) else {
        return;
    };
    match case.as_str() {
        "pool_wait" => child_self_publishing_chain(DeliveryMode::WorkerPool, Overflow::Wait),
        "pool_caller_runs" => {
            child_self_publishing_chain(DeliveryMode::WorkerPool, Overflow::CallerRuns)
        }
        "tasks_caller_runs" => {
            child_self_publishing_chain(DeliveryMode::TaskPerSubscriber, Overflow::CallerRuns)
        }
        "inline" => child_self_publishing_chain(DeliveryMode::Inline, Overflow::Wait),
        "pool_defaults" => child_chain_at_defaults(),
        other => panic!("unknown child case {other}"),
    }
}

#[test]
fn a_handler_publishing_to_itself_into_a_full_queue_never_overflows_the_stack() {
    let mut failures = Vec::new();
    for case in [
        "inline",
        "pool_wait",
        "pool_caller_runs",
        "tasks_caller_runs",
    ] {
        let (how, text) = common::run_child(CHILD_ENV, case, Duration::from_secs(90));
        let result: String = text
            .lines()
            .filter(|l| l.contains("RESULT") || l.contains("overflow") || l.contains("panicked"))
            .collect::<Vec<_>>()
            .join(" | ");
        println!("{case}: {how}: {result}");
        if how != "exit 0" {
            failures.push(format!("{case}: {how}: {result}"));
        }
    }
    assert!(failures.is_empty(), "{failures:#?}");
}
