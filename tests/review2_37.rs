//! Second review of the thirty-seventh session's change: the depth limit in
//! every mode, a request made on a pool worker running its job in place,
//! and the close stand-in. Every wait is under a time limit; a case that
//! could abort the process (a stack overflow) runs in a child process.

mod common;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use blazesub::{Bus, DeliveryMode, Message, Subscription};

const LIMIT: Duration = Duration::from_secs(20);
const CHILD_ENV: &str = "REVIEW2_37_CHILD";

fn filtered(text: &str) -> String {
    text.lines()
        .filter(|l| {
            l.contains("RESULT")
                || l.contains("overflow")
                || l.contains("panicked")
                || l.contains("error")
        })
        .collect::<Vec<_>>()
        .join(" | ")
}

// ---------------------------------------------------------------------------
// A handler that requests its own topic (or a ring of handlers requesting
// one another: A -> B -> A) on a pool worker. Before the change the request
// was queued (a pool of one: it timed out; more workers: each level held
// one). Now every level runs in place, nested on the worker's stack, until
// the depth limit (64) refuses it: 64 levels of handler + `block_on` +
// request future + fan-out must fit in a pool worker's stack.
// ---------------------------------------------------------------------------

fn child_request_chain(sync: bool, workers: usize) {
    const DEPTH: u32 = 1_000;
    let rt = common::runtime(2);
    let bus = Bus::<u32>::builder()
        .delivery(DeliveryMode::WorkerPool)
        .workers(workers)
        .close_timeout(Duration::from_secs(2))
        .runtime(rt.handle().clone())
        .build()
        .unwrap();
    let deepest = Arc::new(AtomicU64::new(0));
    let outcomes = Arc::new(Mutex::new(Vec::<String>::new()));
    let _rq = if sync {
        let (inner, deep, outs) = (bus.clone(), deepest.clone(), outcomes.clone());
        bus.subscribe("rq", move |m: &Message<u32>| {
            let d = *m.data();
            deep.fetch_max(u64::from(d), Ordering::SeqCst);
            if d < DEPTH {
                let r = common::block_on(inner.request("rq", d + 1, Duration::from_secs(5)));
                if let Err(e) = &r {
                    outs.lock().unwrap().push(format!("{d}: {e}"));
                }
            }
            let _ = inner.reply(m, d);
        })
        .unwrap()
    } else {
        let (inner, deep, outs) = (bus.clone(), deepest.clone(), outcomes.clone());
        bus.subscribe_async("rq", move |m: Arc<Message<u32>>| {
            let (inner, deep, outs) = (inner.clone(), deep.clone(), outs.clone());
            async move {
                let d = *m.data();
                deep.fetch_max(u64::from(d), Ordering::SeqCst);
                if d < DEPTH {
                    let r = inner.request("rq", d + 1, Duration::from_secs(5)).await;
                    if let Err(e) = &r {
                        outs.lock().unwrap().push(format!("{d}: {e}"));
                    }
                }
                let _ = inner.reply(&m, d);
            }
        })
        .unwrap()
    };
    let first = common::within(LIMIT * 3, "the outer request", {
        let bus = bus.clone();
        move || common::block_on(bus.request("rq", 1, Duration::from_secs(30)))
    });
    assert!(common::wait_until(LIMIT, || bus.inflight_messages() == 0));
    // The deepest request is refused at the depth limit; every requester
    // above it gets its reply (a reply is not refused there), none times
    // out.
    let timed_out: Vec<String> = outcomes
        .lock()
        .unwrap()
        .iter()
        .filter(|e| e.contains("no reply"))
        .cloned()
        .collect();
    assert!(timed_out.is_empty(), "{timed_out:?}");
    println!(
        "RESULT first {:?} deepest {} errors {:?} stats {:?}",
        first.map(|m| *m.data()),
        deepest.load(Ordering::SeqCst),
        outcomes.lock().unwrap().iter().take(3).collect::<Vec<_>>(),
        bus.stats()
    );
}

// ---------------------------------------------------------------------------
// A handler that re-arms itself: each call subscribes a fresh handler of
// the same kind to a topic with a retained message. The retained snapshot
// is delivered to the new handler inside `subscribe`, on the caller's
// stack (`direct.rs` `deliver_now`), with no depth count: the recursion is
// unbounded, in every mode.
// ---------------------------------------------------------------------------

fn rearm(bus: &Bus<u32>, subs: &Arc<Mutex<Vec<Subscription>>>, calls: &Arc<AtomicU64>) {
    let (inner, keep, count) = (bus.clone(), subs.clone(), calls.clone());
    let sub = bus.subscribe("cfg", move |_| {
        if count.fetch_add(1, Ordering::SeqCst) < 100_000 {
            rearm(&inner, &keep, &count);
        }
    });
    match sub {
        Ok(sub) => subs.lock().unwrap().push(sub),
        Err(e) => println!("RESULT subscribe refused: {e}"),
    }
}

fn child_rearm(mode: DeliveryMode) {
    let rt = common::runtime(2);
    let bus = Bus::<u32>::builder()
        .delivery(mode)
        .runtime(rt.handle().clone())
        .build()
        .unwrap();
    bus.publish_retained("cfg", 1).unwrap();
    let subs = Arc::new(Mutex::new(Vec::new()));
    let calls = Arc::new(AtomicU64::new(0));
    let (b, s, c) = (bus.clone(), subs.clone(), calls.clone());
    common::within(LIMIT, "re-arming", move || rearm(&b, &s, &c));
    println!(
        "RESULT calls {} stats {:?}",
        calls.load(Ordering::SeqCst),
        bus.stats()
    );
}

#[test]
fn child_case() {
    let Ok(case) = std::env::var(CHILD_ENV) else {
        return;
    };
    match case.as_str() {
        "request_sync_1" => child_request_chain(true, 1),
        "request_sync_2" => child_request_chain(true, 2),
        "request_async_1" => child_request_chain(false, 1),
        "rearm_pool" => child_rearm(DeliveryMode::WorkerPool),
        "rearm_inline" => child_rearm(DeliveryMode::Inline),
        other => panic!("unknown child case {other}"),
    }
}

fn run_cases(cases: &[&str]) {
    let mut failures = Vec::new();
    for case in cases {
        let (how, text) = common::run_child(CHILD_ENV, case, Duration::from_secs(120));
        let result = filtered(&text);
        println!("{case}: {how}: {result}");
        if how != "exit 0" {
            failures.push(format!("{case}: {how}: {result}"));
        }
    }
    assert!(failures.is_empty(), "{failures:#?}");
}

#[test]
fn a_handler_requesting_itself_on_a_pool_worker_never_overflows_the_stack() {
    run_cases(&["request_sync_1", "request_sync_2", "request_async_1"]);
}

#[test]
fn a_handler_re_arming_itself_on_a_retained_topic_never_overflows_the_stack() {
    run_cases(&["rearm_inline", "rearm_pool"]);
}

// ---------------------------------------------------------------------------
// A request made on a pool worker runs its responders on the requester's
// stack, inside `send_request`, before the deadline is even armed: a slow
// responder now holds the request past its `timeout` (a responder that
// never returns holds it for ever), even where another worker, or another
// bus's own workers, would have run it while the request timed out.
// ---------------------------------------------------------------------------

/// A responder of `topic` that sleeps until `released` or `hold` has
/// passed, then replies; sends the thread it ran on.
fn slow_responder(
    bus: &Bus<u32>,
    topic: &str,
    hold: Duration,
    released: Arc<std::sync::atomic::AtomicBool>,
    ran_on: std::sync::mpsc::Sender<std::thread::ThreadId>,
) -> Subscription {
    let inner = bus.clone();
    let ran_on = Mutex::new(ran_on);
    bus.subscribe(topic, move |m: &Message<u32>| {
        let _ = ran_on.lock().unwrap().send(std::thread::current().id());
        let until = Instant::now() + hold;
        while !released.load(Ordering::SeqCst) && Instant::now() < until {
            std::thread::sleep(Duration::from_millis(1));
        }
        let _ = inner.reply(m, 0);
    })
    .unwrap()
}

type Outcome = (Result<u32, String>, Duration, std::thread::ThreadId);

/// A sync handler of `topic` on `requester` that requests `to` on
/// `target` with a 200 ms timeout, then releases the responder.
fn sync_requester(
    requester: &Bus<u32>,
    topic: &str,
    target: &Bus<u32>,
    to: &'static str,
    released: Arc<std::sync::atomic::AtomicBool>,
    done: std::sync::mpsc::Sender<Outcome>,
) -> Subscription {
    let target = target.clone();
    let done = Mutex::new(done);
    requester
        .subscribe(topic, move |_| {
            let started = Instant::now();
            let reply = common::block_on(target.request(to, 1, Duration::from_millis(200)));
            let took = started.elapsed();
            released.store(true, Ordering::SeqCst);
            let _ = done.lock().unwrap().send((
                reply.map(|m| *m.data()).map_err(|e| e.to_string()),
                took,
                std::thread::current().id(),
            ));
        })
        .unwrap()
}

fn pool(workers: usize) -> Bus<u32> {
    Bus::<u32>::builder()
        .delivery(DeliveryMode::WorkerPool)
        .workers(workers)
        .close_timeout(Duration::from_secs(2))
        .build()
        .unwrap()
}

/// Two workers: "go" and "slow" have different home workers. A sync
/// handler's request on a pool worker runs its deliveries in place (so it
/// is answered however many workers block in requests, the next test):
/// the slow responder runs on the requester's thread, and the request
/// returns its reply once the responder does, past its 200 ms timeout
/// (`Bus::request`'s docs say so).
#[test]
fn a_sync_handler_s_request_on_a_pool_worker_runs_its_responder_in_place() {
    let bus = pool(2);
    let released = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let (ran_tx, ran_on) = std::sync::mpsc::channel();
    let (done_tx, done) = std::sync::mpsc::channel();
    let _requester = sync_requester(&bus, "go", &bus, "slow", released.clone(), done_tx);
    let _responder = slow_responder(&bus, "slow", Duration::from_millis(400), released, ran_tx);
    // Routes get homes in turn: "go" on worker 0, "slow" on worker 1.
    assert!(bus.has_subscribers("go"));
    assert!(bus.has_subscribers("slow"));
    bus.publish("go", 0).unwrap();
    let (reply, _took, requester) = done
        .recv_timeout(LIMIT)
        .expect("the requester never finished");
    let responder = ran_on.recv_timeout(LIMIT).unwrap();
    assert_eq!(reply, Ok(0));
    assert_eq!(responder, requester, "the responder ran on another thread");
}

/// Two workers, each in a sync handler that requests a topic whose home is
/// the *other* worker, both blocked at once: queued, each request's job
/// would wait behind the other blocked worker, and both timed out (the
/// rule of the first fix ran in place only what would queue behind the
/// requester itself). Both are answered.
#[test]
fn two_sync_requesters_on_two_workers_each_requesting_the_other_s_home_are_answered() {
    let bus = pool(2);
    let responders: Vec<Subscription> = ["ra", "rb"]
        .into_iter()
        .map(|topic| {
            let inner = bus.clone();
            bus.subscribe(topic, move |m: &Message<u32>| {
                inner.reply(m, *m.data() + 1).unwrap();
            })
            .unwrap()
        })
        .collect();
    let both_in = Arc::new(std::sync::Barrier::new(2));
    let (done_tx, done) = std::sync::mpsc::channel();
    let requesters: Vec<Subscription> = [("a", "rb"), ("b", "ra")]
        .into_iter()
        .map(|(topic, to)| {
            let (inner, both_in) = (bus.clone(), Arc::clone(&both_in));
            let done = Mutex::new(done_tx.clone());
            bus.subscribe(topic, move |m: &Message<u32>| {
                // Both workers are inside a requester before either asks.
                both_in.wait();
                let reply = common::block_on(inner.request(to, *m.data(), Duration::from_secs(2)));
                let _ = done
                    .lock()
                    .unwrap()
                    .send(reply.map(|r| *r.data()).map_err(|e| e.to_string()));
            })
            .unwrap()
        })
        .collect();
    // Routes get homes in turn: "a" and "ra" on worker 0, "b" and "rb" on
    // worker 1.
    for topic in ["a", "b", "ra", "rb"] {
        assert!(bus.has_subscribers(topic));
    }
    bus.publish("a", 10).unwrap();
    bus.publish("b", 20).unwrap();
    let mut replies: Vec<Result<u32, String>> = (0..2)
        .map(|_| {
            done.recv_timeout(LIMIT)
                .expect("a requester never finished")
        })
        .collect();
    replies.sort();
    assert_eq!(replies, vec![Ok(11), Ok(21)]);
    drop((requesters, responders));
}

/// The same across two buses: a handler on a pool worker of bus A
/// requests from bus B, whose own (idle) workers are not used: B's
/// responder runs on A's worker, and A's request overshoots its deadline.
/// `worker_mark` says "a pool worker of some bus", not "of this bus".
#[test]
fn a_request_to_another_bus_from_a_pool_handler_keeps_its_deadline() {
    let a = pool(1);
    let b = pool(4);
    let released = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let (ran_tx, ran_on) = std::sync::mpsc::channel();
    let (done_tx, done) = std::sync::mpsc::channel();
    let _requester = sync_requester(&a, "go", &b, "slow", released.clone(), done_tx);
    let _responder = slow_responder(&b, "slow", Duration::from_secs(5), released, ran_tx);
    a.publish("go", 0).unwrap();
    let (reply, took, requester) = done
        .recv_timeout(LIMIT)
        .expect("the requester never finished");
    let responder = ran_on.recv_timeout(LIMIT).unwrap();
    assert!(
        took < Duration::from_secs(2) && responder != requester,
        "a request to bus B with a 200 ms timeout returned {reply:?} after {took:?}; \
         B's responder ran on A's worker (the requester's thread): {}",
        responder == requester
    );
}

/// An async handler awaiting a request under `tokio::time::timeout` on a
/// pool worker: its first poll runs the request's responder in place, so
/// neither the request's deadline nor the outer timeout can fire.
#[test]
fn an_async_handler_s_request_from_a_pool_worker_keeps_its_timeout() {
    let rt = common::runtime(2);
    let bus = Bus::<u32>::builder()
        .delivery(DeliveryMode::WorkerPool)
        .workers(2)
        .runtime(rt.handle().clone())
        .build()
        .unwrap();
    let released = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let (ran_tx, _ran_on) = std::sync::mpsc::channel();
    let (done_tx, done) = std::sync::mpsc::channel();
    let inner = bus.clone();
    let release = released.clone();
    let _requester = bus
        .subscribe_async("go", move |_| {
            let (inner, release, done_tx) = (inner.clone(), release.clone(), done_tx.clone());
            async move {
                let started = Instant::now();
                let reply = tokio::time::timeout(
                    Duration::from_millis(200),
                    inner.request("slow", 1, Duration::from_millis(200)),
                )
                .await;
                release.store(true, Ordering::SeqCst);
                let _ = done_tx.send((format!("{reply:?}"), started.elapsed()));
            }
        })
        .unwrap();
    let _responder = slow_responder(&bus, "slow", Duration::from_secs(5), released, ran_tx);
    assert!(bus.has_subscribers("go"));
    assert!(bus.has_subscribers("slow"));
    bus.publish("go", 0).unwrap();
    let (reply, took) = done
        .recv_timeout(LIMIT)
        .expect("the requester never finished");
    assert!(
        took < Duration::from_secs(2),
        "an async handler's request under a 200 ms timeout returned {reply} after {took:?}"
    );
}
