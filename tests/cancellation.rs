//! Cancellation: every future the API returns is cancel-safe or says what
//! cancelling does, and nothing accepted disappears uncounted. (From the
//! thirtieth session's review; the cancelled `close` leaving its waiting
//! thread behind was the one defect it found.)
//!
//! Futures are cancelled at chosen points by polling them by hand (a noop
//! or counting waker) and dropping them. Each test has a time limit and
//! fails rather than hangs.

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::task::{Context, Poll, Wake, Waker};
use std::time::{Duration, Instant};

use blazesub::{Bus, DeliveryMode, Message, StreamOptions, StreamOverflow};

/// Counts its wakes.
struct Counting(AtomicUsize);

impl Wake for Counting {
    fn wake(self: Arc<Self>) {
        self.0.fetch_add(1, Ordering::SeqCst);
    }
}

fn counting_waker() -> (Arc<Counting>, Waker) {
    let counting = Arc::new(Counting(AtomicUsize::new(0)));
    (Arc::clone(&counting), Waker::from(counting))
}

/// Polls `future` once with a noop waker.
fn poll_once<F: Future + ?Sized>(future: Pin<&mut F>) -> Poll<F::Output> {
    future.poll(&mut Context::from_waker(Waker::noop()))
}

/// A door handlers wait at until the test opens it (or 30 s pass).
#[derive(Default)]
struct Gate {
    open: Mutex<bool>,
    opened: Condvar,
    waiting: AtomicUsize,
}

impl Gate {
    fn wait(&self) {
        self.waiting.fetch_add(1, Ordering::SeqCst);
        let open = self.open.lock().unwrap();
        let _ = self
            .opened
            .wait_timeout_while(open, Duration::from_secs(30), |open| !*open)
            .unwrap();
    }

    fn open(&self) {
        *self.open.lock().unwrap() = true;
        self.opened.notify_all();
    }
}

/// Polls `check` until true, or panics with `what` after 20 s.
fn until(what: &str, check: impl Fn() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(20);
    while !check() {
        assert!(Instant::now() < deadline, "timed out waiting for: {what}");
        std::thread::sleep(Duration::from_millis(2));
    }
}

/// Threads of this process whose name starts with `prefix`.
fn threads_named(prefix: &str) -> usize {
    std::fs::read_dir("/proc/self/task")
        .map(|tasks| {
            tasks
                .filter_map(Result::ok)
                .filter(|task| {
                    std::fs::read_to_string(task.path().join("comm"))
                        .is_ok_and(|name| name.trim_end().starts_with(prefix))
                })
                .count()
        })
        .unwrap_or(0)
}

fn lossless(capacity: usize) -> StreamOptions {
    StreamOptions::new(capacity).overflow(StreamOverflow::Backpressure)
}

/// `Bus::close` says it is cancel-safe: "dropping its future changes
/// nothing but the waiting". Each call that finds deliveries still running
/// spawns a `blazesub-close` thread that blocks until they finish or
/// `close_timeout` (30 s by default) passes; dropping the future does not
/// stop it. A caller that polls `close` in a `select!` loop, or retries it
/// under a short `timeout`, leaves one blocked OS thread per cancelled call.
#[test]
fn cancelled_close_futures_do_not_each_leave_a_thread_behind() {
    const CANCELLED: usize = 200;
    let bus = Bus::<u32>::builder()
        .delivery(DeliveryMode::WorkerPool)
        .workers(1)
        .build()
        .unwrap();
    let gate = Arc::new(Gate::default());
    let held = Arc::clone(&gate);
    bus.subscribe("slow", move |_: &Message<u32>| held.wait())
        .unwrap()
        .detach();
    bus.publish("slow", 1).unwrap();
    until("the handler runs", || {
        gate.waiting.load(Ordering::SeqCst) == 1
    });
    let before = threads_named("blazesub-close");
    for _ in 0..CANCELLED {
        let mut close = Box::pin(bus.close());
        assert!(
            poll_once(close.as_mut()).is_pending(),
            "close finished while a delivery runs"
        );
        drop(close);
    }
    // Threads name themselves when they start: give them a moment.
    let settle = Instant::now() + Duration::from_secs(2);
    let mut after = threads_named("blazesub-close");
    while after < before + CANCELLED && Instant::now() < settle {
        std::thread::sleep(Duration::from_millis(20));
        after = threads_named("blazesub-close");
    }
    gate.open();
    until("the bus drains", || bus.inflight_messages() == 0);
    assert!(
        after.saturating_sub(before) <= 8,
        "{CANCELLED} cancelled close futures left {} `blazesub-close` threads blocked \
         (before: {before}, after: {after})",
        after.saturating_sub(before)
    );
}

/// A `publish_async` queued for room in a full lossless mailbox, cancelled
/// 100,000 times: no waiter stays queued (a sync publish fits once the
/// reader frees a slot), nothing is delivered, published or dropped.
#[test]
fn a_publish_async_cancelled_100k_times_leaves_no_waiter_and_counts_nothing() {
    for mode in [DeliveryMode::Inline, DeliveryMode::WorkerPool] {
        let bus = Bus::<u32>::builder().delivery(mode).build().unwrap();
        let mut rx = bus.subscribe_stream_with("t", lossless(1)).unwrap();
        bus.publish("t", 0).unwrap();
        let before = bus.stats();
        for i in 0..100_000u32 {
            let mut publish = Box::pin(bus.publish_async("t", i + 1));
            assert!(poll_once(publish.as_mut()).is_pending(), "{mode:?}: full");
            if i % 2 == 0 {
                // Polled again (still waiting), then dropped.
                assert!(poll_once(publish.as_mut()).is_pending());
            }
        }
        let after = bus.stats();
        assert_eq!(after.published, before.published, "{mode:?}: published");
        assert_eq!(after.dropped, 0, "{mode:?}: dropped");
        assert_eq!(rx.len(), 1, "{mode:?}: a cancelled publish delivered");
        assert_eq!(*rx.try_recv().unwrap().data(), 0);
        // No waiter is owed the freed slot: a sync publish takes it.
        assert_eq!(bus.publish("t", 7).unwrap(), 1, "{mode:?}");
        assert_eq!(*rx.try_recv().unwrap().data(), 7);
        assert!(
            rx.try_recv().is_err(),
            "{mode:?}: a cancelled publish delivered"
        );
    }
}

/// Two publishers wait for one slot; the reader frees it, so it is handed
/// to the first, which is dropped before it collects it: the second is
/// woken and publishes.
#[test]
fn a_granted_then_cancelled_publish_async_passes_the_room_on() {
    let bus = Bus::<u32>::builder()
        .delivery(DeliveryMode::Inline)
        .build()
        .unwrap();
    let mut rx = bus.subscribe_stream_with("t", lossless(1)).unwrap();
    bus.publish("t", 0).unwrap();
    let (first_wakes, first_waker) = counting_waker();
    let (second_wakes, second_waker) = counting_waker();
    let mut first = Box::pin(bus.publish_async("t", 1));
    let mut second = Box::pin(bus.publish_async("t", 2));
    assert!(first
        .as_mut()
        .poll(&mut Context::from_waker(&first_waker))
        .is_pending());
    assert!(second
        .as_mut()
        .poll(&mut Context::from_waker(&second_waker))
        .is_pending());
    assert_eq!(*rx.try_recv().unwrap().data(), 0);
    assert_eq!(first_wakes.0.load(Ordering::SeqCst), 1, "first not woken");
    drop(first);
    assert_eq!(
        second_wakes.0.load(Ordering::SeqCst),
        1,
        "the second waiter was not woken when the first dropped its slot"
    );
    match second
        .as_mut()
        .poll(&mut Context::from_waker(&second_waker))
    {
        Poll::Ready(Ok(1)) => {}
        other => panic!("second publish: {other:?}"),
    }
    assert_eq!(*rx.try_recv().unwrap().data(), 2);
    assert!(rx.try_recv().is_err());
    assert_eq!(bus.stats().dropped, 0);
}

/// P1 waits for B, whose topic also reaches A, which has room: P1 holds
/// none of it while it waits, so P2, reaching only A, goes through at
/// once; cancelling P1 then delivers nothing anywhere. (Until the
/// thirty-third session a waiting publisher kept the slot it took in A,
/// and P2 waited for P1's cancellation to get it.)
#[test]
fn a_publisher_waiting_for_one_mailbox_holds_no_room_in_another() {
    let bus = Bus::<u32>::builder()
        .delivery(DeliveryMode::Inline)
        .build()
        .unwrap();
    // Ids: A subscribes first, so P1 tries A before B.
    let mut a = bus.subscribe_stream_with("x/#", lossless(1)).unwrap();
    let mut b = bus.subscribe_stream_with("x/b", lossless(1)).unwrap();
    bus.publish("x/b", 0).unwrap(); // both full
    assert_eq!(*a.try_recv().unwrap().data(), 0); // A has room, B is full
    let mut p1 = Box::pin(bus.publish_async("x/b", 1));
    assert!(poll_once(p1.as_mut()).is_pending(), "p1 waits for B");
    let (_, p2_waker) = counting_waker();
    let mut p2 = Box::pin(bus.publish_async("x/a", 2));
    match p2.as_mut().poll(&mut Context::from_waker(&p2_waker)) {
        Poll::Ready(Ok(1)) => {}
        other => panic!("p2, reaching only A, which has room: {other:?}"),
    }
    drop(p1);
    assert_eq!(*a.try_recv().unwrap().data(), 2);
    assert!(a.try_recv().is_err(), "cancelled p1 delivered to A");
    assert_eq!(*b.try_recv().unwrap().data(), 0);
    assert!(b.try_recv().is_err(), "cancelled p1 delivered to B");
    // No room leaked: each takes one more without waiting.
    assert_eq!(bus.publish("x/b", 3).ok(), Some(2));
    assert_eq!(bus.stats().dropped, 0);
}

/// `recv`, `recv_lagged` and the `Stream` impl cancelled 100,000 times
/// while waiting, then a message: it is read, nothing is lost or counted
/// twice, and the lag report survives cancelled polls.
#[test]
fn recv_cancelled_100k_times_loses_nothing() {
    let bus = Bus::<u32>::builder()
        .delivery(DeliveryMode::Inline)
        .build()
        .unwrap();
    let mut rx = bus.subscribe_stream_with_capacity("t", 2).unwrap();
    for _ in 0..100_000 {
        let mut recv = Box::pin(rx.recv());
        assert!(poll_once(recv.as_mut()).is_pending());
        drop(recv);
        let mut lagged = Box::pin(rx.recv_lagged());
        assert!(poll_once(lagged.as_mut()).is_pending());
        drop(lagged);
        assert!(futures_core::Stream::poll_next(
            Pin::new(&mut rx),
            &mut Context::from_waker(Waker::noop())
        )
        .is_pending());
    }
    for n in 0..3 {
        bus.publish("t", n).unwrap();
    }
    let mut recv = Box::pin(rx.recv_lagged());
    match poll_once(recv.as_mut()) {
        Poll::Ready(Err(blazesub::RecvError::Lagged(1))) => {}
        other => panic!("{other:?}"),
    }
    drop(recv);
    let mut recv = Box::pin(rx.recv());
    assert!(matches!(poll_once(recv.as_mut()), Poll::Ready(Some(m)) if *m.data() == 1));
    drop(recv);
    assert_eq!(*rx.try_recv().unwrap().data(), 2);
    let stats = bus.stats();
    assert_eq!((stats.delivered, stats.dropped), (2, 1));
}

/// Requests cancelled at each point (before the first poll, after it, after
/// a reply came but before the next poll), 100,000 times over: no reply
/// subscription, trie node or in-flight delivery is left; later replies
/// are late replies; a request made afterwards is answered.
#[test]
fn requests_cancelled_100k_times_leave_nothing_behind() {
    let bus = Bus::<u32>::builder()
        .delivery(DeliveryMode::Inline)
        .build()
        .unwrap();
    let seen: Arc<Mutex<Vec<String>>> = Arc::default();
    let keep = Arc::clone(&seen);
    // Keeps the requests and answers none: each waits for its deadline.
    let _silent = bus
        .subscribe("rpc/silent", move |m: &Message<u32>| {
            let mut kept = keep.lock().unwrap();
            if kept.len() < 1_000 {
                kept.push(m.reply_to().unwrap().to_owned());
            }
        })
        .unwrap();
    let responder = bus.clone();
    let _echo = bus
        .subscribe("rpc/echo", move |m: &Message<u32>| {
            responder.reply(m, *m.data()).unwrap();
        })
        .unwrap();
    let subscriptions = bus.subscriptions_count();
    let nodes = bus.footprint().trie_nodes;
    for i in 0..100_000u32 {
        match i % 3 {
            0 => drop(bus.request("rpc/silent", i, Duration::from_secs(3600))),
            1 => {
                let mut request = Box::pin(bus.request("rpc/silent", i, Duration::from_secs(3600)));
                assert!(poll_once(request.as_mut()).is_pending());
            }
            _ => {
                let mut request =
                    Box::pin(bus.request_many("rpc/silent", i, Duration::from_secs(3600), 3));
                assert!(poll_once(request.as_mut()).is_pending());
            }
        }
    }
    assert_eq!(
        bus.subscriptions_count(),
        subscriptions,
        "reply subscriptions left"
    );
    assert_eq!(
        bus.footprint().trie_nodes,
        nodes,
        "reply topics' trie nodes left"
    );
    assert_eq!(bus.inflight_messages(), 0);
    let kept = std::mem::take(&mut *seen.lock().unwrap());
    assert_eq!(kept.len(), 1_000);
    for reply_to in &kept {
        assert!(
            !bus.has_subscribers(reply_to),
            "{reply_to} still subscribed"
        );
        assert_eq!(bus.subscribers(reply_to), 0, "{reply_to}");
        assert_eq!(bus.publish(reply_to, 1).unwrap(), 0, "{reply_to}");
    }
    let answer = common_block_on(bus.request("rpc/echo", 42, Duration::from_secs(10))).unwrap();
    assert_eq!(*answer.data(), 42);
    assert_eq!(bus.inflight_messages(), 0);
}

/// `unsubscribe_and_wait` cancelled while a runner is inside the handler,
/// many times: the next waiter still finishes once the runner leaves, and
/// is not held up by the cancelled ones.
#[test]
fn unsubscribe_and_wait_cancelled_does_not_strand_the_next_waiter() {
    let bus = Bus::<u32>::builder()
        .delivery(DeliveryMode::WorkerPool)
        .workers(2)
        .build()
        .unwrap();
    let gate = Arc::new(Gate::default());
    let held = Arc::clone(&gate);
    bus.subscribe("slow", move |_: &Message<u32>| held.wait())
        .unwrap()
        .detach();
    bus.publish("slow", 1).unwrap();
    until("the handler runs", || {
        gate.waiting.load(Ordering::SeqCst) == 1
    });
    for _ in 0..1_000 {
        let sub = bus.subscribe("other", |_: &Message<u32>| {}).unwrap();
        let mut wait = Box::pin(sub.unsubscribe_and_wait());
        assert!(poll_once(wait.as_mut()).is_pending(), "a runner is inside");
        // Polled a second time (past the turn lock), then dropped.
        assert!(poll_once(wait.as_mut()).is_pending());
    }
    let sub = bus.subscribe("other", |_: &Message<u32>| {}).unwrap();
    let (wakes, waker) = counting_waker();
    let mut wait = Box::pin(sub.unsubscribe_and_wait());
    assert!(wait
        .as_mut()
        .poll(&mut Context::from_waker(&waker))
        .is_pending());
    gate.open();
    until("the waiter is woken", || wakes.0.load(Ordering::SeqCst) > 0);
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        if wait
            .as_mut()
            .poll(&mut Context::from_waker(&waker))
            .is_ready()
        {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "unsubscribe_and_wait never finished"
        );
        std::thread::sleep(Duration::from_millis(2));
    }
    assert_eq!(bus.subscriptions_count(), 1);
}

/// Runs `future` to completion on a fresh current-thread runtime, with a
/// 20 s limit.
fn common_block_on<F: Future>(future: F) -> F::Output {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
        .block_on(async {
            tokio::time::timeout(Duration::from_secs(20), future)
                .await
                .expect("timed out")
        })
}
