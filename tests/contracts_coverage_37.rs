//! Issue 13 ("Delivery contracts per subscription"), parts an audit found
//! covered only weakly, through the public API in every delivery mode. Every
//! wait is under a time limit, so a bug fails instead of hanging.
//!
//! - Dropping a full lossless receiver releases *several* waiting
//!   publishers at once, and each of them reaches the other lossless stream
//!   (`Stats` exact).
//! - A slow *async* ordered handler holds up only itself: other plain,
//!   ordered and stream subscriptions on the topic get every later publish
//!   while its first call waits; released, it gets everything, in order. If
//!   its mailbox fills, it loses the newest messages, counted.
//! - Async ordered handlers under concurrent publisher threads and
//!   subscription churn: no two calls overlap (a flag held across an
//!   `.await`), each publisher's messages in order, none twice, gaps only as
//!   counted drops (none when the mailbox cannot fill).
//! - `publish_async` in a proptest model of one `Backpressure` stream:
//!   `publish`, `publish_async` awaited with a short timeout, polled once and
//!   dropped, or held across steps (polled, cancelled) while the reader takes
//!   messages; accepted messages are received once and in order, refused or
//!   cancelled ones never, room goes to waiters in arrival order, `lost()`
//!   stays 0, `Stats` exact, no room left held at the end.

mod common;

use std::collections::VecDeque;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll, Waker};
use std::time::{Duration, Instant};

use blazesub::{
    Bus, DeliveryMode, Error, Message, Receiver, StreamOptions, StreamOverflow, Subscription,
    TryRecvError,
};
use common::MODES;
use proptest::prelude::*;

/// The longest any single step may take before the test calls it a hang.
const LIMIT: Duration = Duration::from_secs(20);

fn lossless(capacity: usize) -> StreamOptions {
    StreamOptions::new(capacity).overflow(StreamOverflow::Backpressure)
}

/// Waits (asynchronously) until `cond` holds; false after `limit`.
async fn eventually(limit: Duration, mut cond: impl FnMut() -> bool) -> bool {
    let deadline = Instant::now() + limit;
    loop {
        if cond() {
            return true;
        }
        if Instant::now() >= deadline {
            return false;
        }
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
}

async fn quiet(bus: &Bus<u32>) {
    assert!(
        eventually(LIMIT, || bus.inflight_messages() == 0).await,
        "deliveries stuck in flight: {:?}",
        bus.stats()
    );
}

async fn close(bus: &Bus<u32>, what: &str) {
    let closed = tokio::time::timeout(LIMIT, bus.close()).await;
    assert!(
        matches!(closed, Ok(Ok(()))),
        "{what}: close gave {closed:?}"
    );
}

// ---------------------------------------------------------------------------
// 1. Dropping a full lossless receiver releases every waiting publisher.
// ---------------------------------------------------------------------------

/// Four tasks wait in `publish_async` on one full lossless stream
/// (capacity 1, never read) that also feeds a second lossless stream, read
/// by a task. While they wait, the second stream gets nothing of theirs
/// (all or nothing). Dropping the full receiver releases all four at once
/// (bound 2 s, generous for a busy machine: the release itself takes
/// microseconds), each reaching the second stream only; `Stats` exact: 5
/// published, 5 taken by the reader, 1 dropped (the message the dropped
/// receiver held unread).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn dropping_a_full_lossless_receiver_releases_every_waiting_publisher_at_once() {
    const WAITERS: u32 = 4;
    const RELEASE_BOUND: Duration = Duration::from_secs(2);
    for mode in MODES {
        let bus = Bus::<u32>::builder()
            .delivery(mode)
            .workers(2)
            .build()
            .unwrap();
        let full = bus.subscribe_stream_with("t", lossless(1)).unwrap();
        let mut other = bus.subscribe_stream_with("t", lossless(2)).unwrap();
        assert_eq!(bus.publish("t", 0).unwrap(), 2, "{mode:?}");
        let read: Arc<Mutex<Vec<u32>>> = Arc::default();
        let reader = {
            let read = Arc::clone(&read);
            tokio::spawn(async move {
                while read.lock().unwrap().len() < 1 + WAITERS as usize {
                    match tokio::time::timeout(LIMIT, other.recv()).await {
                        Ok(Some(m)) => read.lock().unwrap().push(*m.data()),
                        _ => break,
                    }
                }
                other
            })
        };
        let waiters: Vec<_> = (1..=WAITERS)
            .map(|value| {
                let bus = bus.clone();
                tokio::spawn(async move {
                    let result = bus.publish_async("t", value).await;
                    (result, Instant::now())
                })
            })
            .collect();
        tokio::time::sleep(Duration::from_millis(100)).await;
        for (i, w) in waiters.iter().enumerate() {
            assert!(
                !w.is_finished(),
                "{mode:?}: waiter {i} should wait for room"
            );
        }
        assert_eq!(
            *read.lock().unwrap(),
            [0],
            "{mode:?}: a waiting publish reached the other stream (not all or nothing)"
        );
        assert_eq!(bus.stats().published, 1, "{mode:?}");

        let dropped_at = Instant::now();
        drop(full);
        let mut slowest = Duration::ZERO;
        for (i, w) in waiters.into_iter().enumerate() {
            let left = RELEASE_BOUND.saturating_sub(dropped_at.elapsed());
            let joined = tokio::time::timeout(left, w).await;
            let Ok(Ok((result, at))) = joined else {
                panic!(
                    "{mode:?}: waiter {i} not released within {RELEASE_BOUND:?} of dropping the \
                     full receiver: {joined:?}; stats {:?}",
                    bus.stats()
                );
            };
            assert!(
                matches!(result, Ok(1)),
                "{mode:?}: waiter {i} should reach only the other stream: {result:?}"
            );
            slowest = slowest.max(at.saturating_duration_since(dropped_at));
        }
        assert!(slowest < RELEASE_BOUND, "{mode:?}: {slowest:?}");

        let other = tokio::time::timeout(LIMIT, reader)
            .await
            .expect("the reader hangs")
            .unwrap();
        let mut got = read.lock().unwrap().clone();
        assert_eq!(got.first(), Some(&0), "{mode:?}: {got:?}");
        got.sort_unstable();
        assert_eq!(
            got,
            (0..=WAITERS).collect::<Vec<_>>(),
            "{mode:?}: every waiter's message reached the other stream once"
        );
        quiet(&bus).await;
        let stats = bus.stats();
        assert_eq!(
            (
                stats.published,
                stats.delivered,
                stats.dropped,
                stats.disconnects
            ),
            (1 + u64::from(WAITERS), 1 + u64::from(WAITERS), 1, 0),
            "{mode:?}: {stats:?}"
        );
        assert_eq!(other.lost(), 0, "{mode:?}");
        drop(other);
        close(&bus, &format!("{mode:?}")).await;
        eprintln!("{mode:?}: {WAITERS} waiters released within {slowest:?}");
    }
}

// ---------------------------------------------------------------------------
// 2. A slow async ordered handler holds up only itself.
// ---------------------------------------------------------------------------

/// An async ordered handler whose future for message 0 waits on a
/// semaphore the test releases. Meanwhile two plain sync handlers, a plain
/// async handler, a sync ordered handler, another async ordered handler and
/// a stream on the same topic get all 20 publishes (in order where
/// ordered), and the slow one has started one call only. Released, it gets
/// 0..20 in order; `Stats` exact, nothing dropped.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_slow_async_ordered_handler_holds_up_only_itself() {
    const N: u32 = 20;
    for mode in MODES {
        let what = format!("{mode:?}");
        let bus = Bus::<u32>::builder()
            .delivery(mode)
            .workers(2)
            .stream_capacity(64)
            .build()
            .unwrap();
        let gate = Arc::new(tokio::sync::Semaphore::new(0));
        let slow_started = Arc::new(AtomicU32::new(0));
        let slow_seen: Arc<Mutex<Vec<u32>>> = Arc::default();
        let _slow = {
            let (gate, started, seen) = (
                Arc::clone(&gate),
                Arc::clone(&slow_started),
                Arc::clone(&slow_seen),
            );
            bus.subscribe_ordered_async("t", move |m: Arc<Message<u32>>| {
                let (gate, started, seen) =
                    (Arc::clone(&gate), Arc::clone(&started), Arc::clone(&seen));
                async move {
                    started.fetch_add(1, Ordering::SeqCst);
                    if *m.data() == 0 {
                        tokio::time::timeout(LIMIT, gate.acquire())
                            .await
                            .expect("the slow handler was never released")
                            .unwrap()
                            .forget();
                    }
                    seen.lock().unwrap().push(*m.data());
                }
            })
            .unwrap()
        };
        let (_plain, plain_calls) = common::counters(&bus, "t", 2);
        let async_calls = Arc::new(AtomicU64::new(0));
        let _async_plain = {
            let calls = Arc::clone(&async_calls);
            bus.subscribe_async("t", move |_| {
                let calls = Arc::clone(&calls);
                async move {
                    tokio::task::yield_now().await;
                    calls.fetch_add(1, Ordering::SeqCst);
                }
            })
            .unwrap()
        };
        let ordered_seen: Arc<Mutex<Vec<u32>>> = Arc::default();
        let _ordered = {
            let seen = Arc::clone(&ordered_seen);
            bus.subscribe_ordered("t", move |m| seen.lock().unwrap().push(*m.data()))
                .unwrap()
        };
        let fast_seen: Arc<Mutex<Vec<u32>>> = Arc::default();
        let _fast = {
            let seen = Arc::clone(&fast_seen);
            bus.subscribe_ordered_async("t", move |m: Arc<Message<u32>>| {
                let seen = Arc::clone(&seen);
                async move {
                    tokio::task::yield_now().await;
                    seen.lock().unwrap().push(*m.data());
                }
            })
            .unwrap()
        };
        let mut stream = bus.subscribe_stream("t").unwrap();

        // The slow one enters its call for 0 first, then the rest come.
        bus.publish("t", 0).unwrap();
        assert!(
            eventually(LIMIT, || slow_started.load(Ordering::SeqCst) == 1).await,
            "{what}: the slow handler never started"
        );
        for value in 1..N {
            bus.publish("t", value).unwrap();
        }
        let expected: Vec<u32> = (0..N).collect();
        let others_done = eventually(LIMIT, || {
            plain_calls.load(Ordering::SeqCst) == 2 * u64::from(N)
                && async_calls.load(Ordering::SeqCst) == u64::from(N)
                && ordered_seen.lock().unwrap().len() == N as usize
                && fast_seen.lock().unwrap().len() == N as usize
                && stream.len() == N as usize
        })
        .await;
        assert!(
            others_done,
            "{what}: the other subscriptions were held up by the slow async ordered handler: \
             plain {}, async {}, ordered {:?}, async ordered {:?}, stream {}; stats {:?}",
            plain_calls.load(Ordering::SeqCst),
            async_calls.load(Ordering::SeqCst),
            ordered_seen.lock().unwrap(),
            fast_seen.lock().unwrap(),
            stream.len(),
            bus.stats()
        );
        assert_eq!(
            *ordered_seen.lock().unwrap(),
            expected,
            "{what}: sync ordered"
        );
        assert_eq!(
            *fast_seen.lock().unwrap(),
            expected,
            "{what}: async ordered"
        );
        let mut streamed = Vec::new();
        while let Ok(m) = stream.try_recv() {
            streamed.push(*m.data());
        }
        assert_eq!(streamed, expected, "{what}: stream");
        // Still held: one call started, none finished, and nothing overlapped.
        tokio::time::sleep(Duration::from_millis(20)).await;
        assert_eq!(slow_started.load(Ordering::SeqCst), 1, "{what}");
        assert!(slow_seen.lock().unwrap().is_empty(), "{what}");
        assert!(
            bus.inflight_messages() > 0,
            "{what}: the slow one's are in flight"
        );

        gate.add_permits(1);
        assert!(
            eventually(LIMIT, || slow_seen.lock().unwrap().len() == N as usize).await,
            "{what}: the slow handler, released, got {:?}",
            slow_seen.lock().unwrap()
        );
        assert_eq!(
            *slow_seen.lock().unwrap(),
            expected,
            "{what}: slow, in order"
        );
        quiet(&bus).await;
        let stats = bus.stats();
        // 2 plain + async plain + sync ordered + async ordered + stream + slow.
        assert_eq!(
            (
                stats.published,
                stats.delivered,
                stats.dropped,
                stats.handler_panics
            ),
            (u64::from(N), 7 * u64::from(N), 0, 0),
            "{what}: {stats:?}"
        );
        close(&bus, &what).await;
    }
}

/// The same slow async ordered handler with a mailbox smaller than what is
/// published while it waits: it loses the *newest* (documented), so once
/// released it has received exactly a prefix 0..k, in order, and the other
/// N - k are in `Stats::dropped`; a plain handler and a stream get all N.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_slow_async_ordered_handler_loses_only_its_own_newest_messages() {
    const N: u32 = 40;
    const CAPACITY: usize = 8;
    for mode in MODES {
        let what = format!("{mode:?}");
        let bus = Bus::<u32>::builder()
            .delivery(mode)
            .workers(2)
            .stream_capacity(CAPACITY)
            .build()
            .unwrap();
        let gate = Arc::new(tokio::sync::Semaphore::new(0));
        let started = Arc::new(AtomicU32::new(0));
        let seen: Arc<Mutex<Vec<u32>>> = Arc::default();
        let _slow = {
            let (gate, started, seen) =
                (Arc::clone(&gate), Arc::clone(&started), Arc::clone(&seen));
            bus.subscribe_ordered_async("t", move |m: Arc<Message<u32>>| {
                let (gate, started, seen) =
                    (Arc::clone(&gate), Arc::clone(&started), Arc::clone(&seen));
                async move {
                    started.fetch_add(1, Ordering::SeqCst);
                    if *m.data() == 0 {
                        tokio::time::timeout(LIMIT, gate.acquire())
                            .await
                            .expect("the slow handler was never released")
                            .unwrap()
                            .forget();
                    }
                    seen.lock().unwrap().push(*m.data());
                }
            })
            .unwrap()
        };
        let (_plain, plain_calls) = common::counters(&bus, "t", 1);
        let mut stream = bus
            .subscribe_stream_with("t", StreamOptions::new(N as usize))
            .unwrap();
        bus.publish("t", 0).unwrap();
        assert!(
            eventually(LIMIT, || started.load(Ordering::SeqCst) == 1).await,
            "{what}: the slow handler never started"
        );
        for value in 1..N {
            bus.publish("t", value).unwrap();
        }
        assert!(
            eventually(LIMIT, || plain_calls.load(Ordering::SeqCst) == u64::from(N)).await,
            "{what}: the plain handler was held up: {}",
            plain_calls.load(Ordering::SeqCst)
        );
        assert_eq!(stream.len(), N as usize, "{what}: the stream was held up");
        gate.add_permits(1);
        quiet(&bus).await;
        let got = seen.lock().unwrap().clone();
        let k = got.len() as u32;
        assert_eq!(
            got,
            (0..k).collect::<Vec<_>>(),
            "{what}: not a prefix in order"
        );
        assert!(
            (CAPACITY as u32..=CAPACITY as u32 + 2).contains(&k),
            "{what}: a mailbox of {CAPACITY} kept {k} of {N}"
        );
        let mut streamed = 0;
        while stream.try_recv().is_ok() {
            streamed += 1;
        }
        assert_eq!(streamed, N, "{what}");
        let stats = bus.stats();
        assert_eq!(
            (stats.published, stats.delivered, stats.dropped),
            (
                u64::from(N),
                2 * u64::from(N) + u64::from(k),
                u64::from(N - k)
            ),
            "{what}: every message ran or was counted: {stats:?}"
        );
        close(&bus, &what).await;
    }
}

// ---------------------------------------------------------------------------
// 3. Async ordered handlers under concurrent publishers and churn.
// ---------------------------------------------------------------------------

const PUBLISHERS: usize = 3;
/// Publishes per publisher per configuration at most (bounds memory, and
/// with a mailbox of `BIG_MAILBOX` none can overflow: 3 × 20,000 < 65,536).
const MAX_PER: u32 = 20_000;
const BIG_MAILBOX: usize = 1 << 16;
const SMALL_MAILBOX: usize = 32;
/// How long the publishers run per configuration.
const PUBLISHING: Duration = Duration::from_millis(400);

fn split(id: u32) -> (usize, u32) {
    ((id / MAX_PER) as usize, id % MAX_PER)
}

/// What an async ordered handler observed.
struct AsyncProbe {
    /// Set from a call's start to its end, across its `.await`s.
    running: AtomicBool,
    overlaps: AtomicU64,
    /// Per publisher: one past the last sequence number received.
    next: Vec<AtomicU32>,
    out_of_order: AtomicU64,
    hits: common::Hits,
    /// Sleeps every `sleep_every` messages (0: only yields).
    sleep_every: u32,
}

impl AsyncProbe {
    fn new(sleep_every: u32) -> Self {
        Self {
            running: AtomicBool::new(false),
            overlaps: AtomicU64::new(0),
            next: (0..PUBLISHERS).map(|_| AtomicU32::new(0)).collect(),
            out_of_order: AtomicU64::new(0),
            hits: common::Hits::new(PUBLISHERS * MAX_PER as usize),
            sleep_every,
        }
    }

    async fn call(&self, id: u32) {
        if self.running.swap(true, Ordering::SeqCst) {
            self.overlaps.fetch_add(1, Ordering::SeqCst);
        }
        let (p, seq) = split(id);
        if self.next[p].swap(seq + 1, Ordering::SeqCst) > seq {
            self.out_of_order.fetch_add(1, Ordering::SeqCst);
        }
        self.hits.hit(id);
        if self.sleep_every > 0 && seq % self.sleep_every == 0 {
            tokio::time::sleep(Duration::from_micros(300)).await;
        } else {
            tokio::task::yield_now().await;
        }
        self.running.store(false, Ordering::SeqCst);
    }

    /// Messages published but never received.
    fn missing(&self, published: &[u32]) -> u64 {
        let mut missing = 0;
        for (p, &count) in published.iter().enumerate() {
            let first = p as u32 * MAX_PER;
            missing += (first..first + count)
                .filter(|&id| self.hits.get(id) == 0)
                .count() as u64;
        }
        missing
    }
}

/// One subscription the churner holds for a while.
enum Churned {
    /// Held only to be dropped (which unsubscribes).
    #[allow(dead_code)]
    Sub(Subscription),
    Stream(Receiver<u32>),
}

fn churn_one(bus: &Bus<u32>, n: usize, calls: &Arc<AtomicU64>) -> Churned {
    let filter = ["s/+", "#", "s/1", "+/+", "s/#"][n % 5];
    let calls = Arc::clone(calls);
    match n % 5 {
        0 => Churned::Sub(
            bus.subscribe(filter, move |_| {
                calls.fetch_add(1, Ordering::Relaxed);
            })
            .unwrap(),
        ),
        1 => Churned::Sub(
            bus.subscribe_async(filter, move |_| {
                let calls = Arc::clone(&calls);
                async move {
                    tokio::task::yield_now().await;
                    calls.fetch_add(1, Ordering::Relaxed);
                }
            })
            .unwrap(),
        ),
        2 => Churned::Sub(
            bus.subscribe_ordered(filter, move |_| {
                calls.fetch_add(1, Ordering::Relaxed);
            })
            .unwrap(),
        ),
        3 => Churned::Sub(
            bus.subscribe_ordered_async(filter, move |_| {
                let calls = Arc::clone(&calls);
                async move {
                    tokio::task::yield_now().await;
                    calls.fetch_add(1, Ordering::Relaxed);
                }
            })
            .unwrap(),
        ),
        _ => Churned::Stream(
            bus.subscribe_stream_with(filter, StreamOptions::new(16))
                .unwrap(),
        ),
    }
}

/// One configuration: a fresh bus with `mailbox` as its stream capacity,
/// two async ordered probes (one only yields, one also sleeps), stable
/// plain subscriptions, 3 publisher threads for `PUBLISHING`, and a thread
/// churning subscriptions of every kind on matching filters meanwhile.
fn async_ordered_round(mode: DeliveryMode, mailbox: usize, rt: &tokio::runtime::Runtime) {
    let what = format!("{mode:?}, mailbox {mailbox}");
    let bus = Bus::<u32>::builder()
        .delivery(mode)
        .workers(2)
        .stream_capacity(mailbox)
        .runtime(rt.handle().clone())
        .build()
        .unwrap();
    let lossy = mailbox < BIG_MAILBOX;
    let calls = Arc::new(AtomicU64::new(0));
    let probes: Vec<Arc<AsyncProbe>> = [0, if lossy { 8 } else { 0 }]
        .into_iter()
        .map(|every| Arc::new(AsyncProbe::new(every)))
        .collect();
    let _probe_subs: Vec<Subscription> = probes
        .iter()
        .zip(["s/+", "#"])
        .map(|(probe, filter)| {
            let (probe, calls) = (Arc::clone(probe), Arc::clone(&calls));
            bus.subscribe_ordered_async(filter, move |m: Arc<Message<u32>>| {
                let (probe, calls) = (Arc::clone(&probe), Arc::clone(&calls));
                async move {
                    probe.call(*m.data()).await;
                    calls.fetch_add(1, Ordering::Relaxed);
                }
            })
            .unwrap()
        })
        .collect();
    let (_stable, stable_calls) = common::counters(&bus, "s/+", 2);

    let publishing = Arc::new(AtomicBool::new(true));
    let churn_calls = Arc::new(AtomicU64::new(0));
    let churner = {
        let (bus, publishing, churn_calls) = (
            bus.clone(),
            Arc::clone(&publishing),
            Arc::clone(&churn_calls),
        );
        std::thread::spawn(move || {
            let mut held: VecDeque<Churned> = VecDeque::new();
            let mut taken = 0u64;
            let mut n = 0usize;
            while publishing.load(Ordering::SeqCst) {
                held.push_back(churn_one(&bus, n, &churn_calls));
                n += 1;
                if held.len() > 4 {
                    if let Some(Churned::Stream(mut rx)) = held.pop_front() {
                        while rx.try_recv().is_ok() {
                            taken += 1;
                        }
                    }
                }
                for h in held.iter_mut() {
                    if let Churned::Stream(rx) = h {
                        while rx.try_recv().is_ok() {
                            taken += 1;
                        }
                    }
                }
                std::thread::sleep(Duration::from_micros(300));
            }
            // What is still held is dropped here (streams read first).
            for h in held.iter_mut() {
                if let Churned::Stream(rx) = h {
                    while rx.try_recv().is_ok() {
                        taken += 1;
                    }
                }
            }
            (n, taken)
        })
    };
    let start = Arc::new(std::sync::Barrier::new(PUBLISHERS));
    let publishers: Vec<_> = (0..PUBLISHERS)
        .map(|p| {
            let (bus, start) = (bus.clone(), Arc::clone(&start));
            std::thread::spawn(move || {
                start.wait();
                let deadline = Instant::now() + PUBLISHING;
                let topic = format!("s/{p}");
                let mut seq = 0u32;
                while seq < MAX_PER && Instant::now() < deadline {
                    bus.publish(&topic, p as u32 * MAX_PER + seq).unwrap();
                    seq += 1;
                    if seq % 64 == 0 {
                        std::thread::yield_now();
                    }
                }
                seq
            })
        })
        .collect();
    let published: Vec<u32> = publishers
        .into_iter()
        .map(|h| h.join().expect("a publisher panicked"))
        .collect();
    publishing.store(false, Ordering::SeqCst);
    let (churned, churn_taken) = churner.join().expect("the churner panicked");
    {
        let bus = bus.clone();
        common::within(LIMIT, &format!("{what}: close"), move || {
            tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap()
                .block_on(bus.close())
        })
        .expect("close");
    }

    let stats = bus.stats();
    let total: u64 = published.iter().map(|&n| u64::from(n)).sum();
    assert_eq!(stats.inflight, 0, "{what}: {stats:?}");
    assert_eq!(stats.handler_panics, 0, "{what}");
    assert_eq!(stats.published, total, "{what}");
    assert_eq!(
        stable_calls.load(Ordering::SeqCst),
        2 * total,
        "{what}: stable plain handlers"
    );
    assert_eq!(
        stats.delivered,
        calls.load(Ordering::SeqCst)
            + stable_calls.load(Ordering::SeqCst)
            + churn_calls.load(Ordering::SeqCst)
            + churn_taken,
        "{what}: stats().delivered against handler calls and stream messages taken"
    );
    assert!(
        churn_calls.load(Ordering::SeqCst) + churn_taken > 0,
        "{what}: the churn ({churned} subscriptions) never overlapped the publishing"
    );
    let mut missing_total = 0;
    for (i, probe) in probes.iter().enumerate() {
        assert_eq!(
            probe.overlaps.load(Ordering::SeqCst),
            0,
            "{what}: probe {i}: calls overlapped"
        );
        assert_eq!(
            probe.out_of_order.load(Ordering::SeqCst),
            0,
            "{what}: probe {i}: a publisher's messages out of order (or twice)"
        );
        if let Some((id, got)) = probe
            .hits
            .first_mismatch(|id| u32::from(probe.hits.get(id) > 0))
        {
            panic!("{what}: probe {i}: message {id} arrived {got} times");
        }
        let missing = probe.missing(&published);
        assert!(
            missing < total,
            "{what}: probe {i} received nothing of {total}"
        );
        if !lossy {
            assert_eq!(
                missing, 0,
                "{what}: probe {i} missed {missing} of {total} though its mailbox could hold all"
            );
        }
        missing_total += missing;
    }
    assert!(
        stats.dropped >= missing_total,
        "{what}: the probes missed {missing_total} messages, stats().dropped says {}",
        stats.dropped
    );
    if lossy {
        assert!(
            probes[1].missing(&published) > 0,
            "{what}: the sleeping probe never overflowed its mailbox of {mailbox}; the gap \
             accounting went untested"
        );
    }
    eprintln!(
        "{what}: published {published:?}, churned {churned}, probes missed {missing_total}, \
         {stats:?}"
    );
}

fn async_ordered_under_churn(mode: DeliveryMode) {
    let rt = common::runtime(2);
    let started = Instant::now();
    for mailbox in [BIG_MAILBOX, SMALL_MAILBOX] {
        async_ordered_round(mode, mailbox, &rt);
    }
    eprintln!("{mode:?}: {:.1?}", started.elapsed());
}

#[test]
fn async_ordered_handlers_under_publishers_and_churn_task_per_subscriber() {
    async_ordered_under_churn(DeliveryMode::TaskPerSubscriber);
}

#[test]
fn async_ordered_handlers_under_publishers_and_churn_worker_pool() {
    async_ordered_under_churn(DeliveryMode::WorkerPool);
}

#[test]
fn async_ordered_handlers_under_publishers_and_churn_inline() {
    async_ordered_under_churn(DeliveryMode::Inline);
}

// ---------------------------------------------------------------------------
// 4. publish_async in a model of one lossless stream.
// ---------------------------------------------------------------------------

#[derive(Clone, Debug)]
enum Op {
    /// `publish`: accepted, or `Error::Full` and reaches no one.
    Publish,
    /// `publish_async` awaited for at most 1 ms (nobody reads meanwhile, so
    /// it either goes through at once or is cancelled by the timeout).
    AsyncTimeout,
    /// `publish_async` polled once, then dropped.
    AsyncPollOnce,
    /// `publish_async` polled once and, if pending, kept across steps.
    Start,
    /// Polls the kept future at this index (modulo how many are kept).
    Poll(usize),
    /// Drops the kept future at this index: cancelled.
    Cancel(usize),
    /// `try_recv`.
    Read,
}

fn model_ops() -> impl Strategy<Value = Vec<Op>> {
    prop::collection::vec(
        prop_oneof![
            3 => Just(Op::Publish),
            1 => Just(Op::AsyncTimeout),
            2 => Just(Op::AsyncPollOnce),
            2 => Just(Op::Start),
            2 => (0usize..8).prop_map(Op::Poll),
            1 => (0usize..8).prop_map(Op::Cancel),
            4 => Just(Op::Read),
        ],
        1..80,
    )
}

fn model_modes() -> impl Strategy<Value = DeliveryMode> {
    prop_oneof![
        Just(DeliveryMode::Inline),
        Just(DeliveryMode::WorkerPool),
        Just(DeliveryMode::TaskPerSubscriber),
    ]
}

/// One lossless mailbox as the contract describes it: room goes to waiting
/// publishers first, in arrival order; a publisher that does not wait gets
/// room only when nobody waits; a waiter handed room keeps it until it
/// delivers (polled) or is dropped (then the room goes on to the next
/// waiter, or is free again).
struct LosslessModel {
    queue: VecDeque<u32>,
    free: usize,
    /// Kept `publish_async` futures, in arrival order: (value, handed room).
    waiters: Vec<(u32, bool)>,
    published: u64,
    delivered: u64,
}

impl LosslessModel {
    fn someone_waits(&self) -> bool {
        self.waiters.iter().any(|&(_, granted)| !granted)
    }

    /// A publish that does not wait: accepted (delivered now) or refused.
    fn try_publish(&mut self, value: u32) -> bool {
        if self.someone_waits() || self.free == 0 {
            return false;
        }
        self.free -= 1;
        self.queue.push_back(value);
        self.published += 1;
        true
    }

    /// A freed slot: to the first waiter without one, else free.
    fn give_back(&mut self) {
        match self.waiters.iter_mut().find(|(_, granted)| !granted) {
            Some(waiter) => waiter.1 = true,
            None => self.free += 1,
        }
    }

    fn read(&mut self) -> Option<u32> {
        let value = self.queue.pop_front()?;
        self.delivered += 1;
        self.give_back();
        Some(value)
    }

    /// Polling kept waiter `i`: delivers if it was handed room.
    fn poll(&mut self, i: usize) -> bool {
        let (value, granted) = self.waiters[i];
        if granted {
            self.waiters.remove(i);
            self.queue.push_back(value);
            self.published += 1;
        }
        granted
    }

    fn cancel(&mut self, i: usize) {
        let (_, granted) = self.waiters.remove(i);
        if granted {
            self.give_back();
        }
    }
}

type Pending<'a> = Pin<Box<dyn Future<Output = Result<usize, Error>> + 'a>>;

fn poll_once(future: &mut Pending<'_>) -> Poll<Result<usize, Error>> {
    future
        .as_mut()
        .poll(&mut Context::from_waker(Waker::noop()))
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 96, ..ProptestConfig::default() })]

    #[test]
    fn publish_async_on_a_lossless_stream_follows_the_model(
        mode in model_modes(),
        capacity in 1usize..4,
        ops in model_ops(),
    ) {
        let rt = common::runtime(1);
        let _entered = rt.enter();
        let bus = Bus::<u32>::builder()
            .delivery(mode)
            .workers(1)
            .runtime(rt.handle().clone())
            .build()
            .unwrap();
        let mut rx = bus.subscribe_stream_with("m", lossless(capacity)).unwrap();
        let mut model = LosslessModel {
            queue: VecDeque::new(),
            free: capacity,
            waiters: Vec::new(),
            published: 0,
            delivered: 0,
        };
        let mut kept: Vec<Pending<'_>> = Vec::new();
        let mut next = 0u32;
        let started = Instant::now();
        for (step, op) in ops.iter().enumerate() {
            let at = format!("step {step} {op:?} ({mode:?}, capacity {capacity})");
            match op {
                Op::Publish => {
                    let got = bus.publish("m", next);
                    let want = model.try_publish(next);
                    match got {
                        Ok(reached) => prop_assert!(want && reached == 1, "{}: {:?}", at, got),
                        Err(Error::Full { capacity: c, .. }) => {
                            prop_assert!(!want && c == capacity, "{}: {:?}", at, got)
                        }
                        Err(e) => prop_assert!(false, "{}: {:?}", at, e),
                    }
                    next += 1;
                }
                Op::AsyncTimeout => {
                    let got = rt.block_on(tokio::time::timeout(
                        Duration::from_millis(1),
                        bus.publish_async("m", next),
                    ));
                    let want = model.try_publish(next);
                    match got {
                        Ok(Ok(reached)) => prop_assert!(want && reached == 1, "{}: {:?}", at, reached),
                        Err(_) => prop_assert!(!want, "{}: cancelled, the model says it had room", at),
                        Ok(Err(e)) => prop_assert!(false, "{}: {:?}", at, e),
                    }
                    next += 1;
                }
                Op::AsyncPollOnce | Op::Start => {
                    let mut future: Pending<'_> = Box::pin(bus.publish_async("m", next));
                    let want = model.try_publish(next);
                    match poll_once(&mut future) {
                        Poll::Ready(Ok(reached)) => prop_assert!(want && reached == 1, "{}: {}", at, reached),
                        Poll::Ready(Err(e)) => prop_assert!(false, "{}: {:?}", at, e),
                        Poll::Pending => {
                            prop_assert!(!want, "{}: pending, the model says it had room", at);
                            if matches!(op, Op::Start) {
                                kept.push(future);
                                model.waiters.push((next, false));
                            }
                        }
                    }
                    next += 1;
                }
                Op::Poll(i) => {
                    if kept.is_empty() {
                        continue;
                    }
                    let i = i % kept.len();
                    let value = model.waiters[i].0;
                    let want = model.poll(i);
                    match poll_once(&mut kept[i]) {
                        Poll::Ready(Ok(reached)) => {
                            prop_assert!(want && reached == 1, "{}: waiter of {} gave {}", at, value, reached);
                            drop(kept.remove(i));
                        }
                        Poll::Ready(Err(e)) => prop_assert!(false, "{}: {:?}", at, e),
                        Poll::Pending => prop_assert!(!want, "{}: waiter of {} still pending, the model handed it room", at, value),
                    }
                }
                Op::Cancel(i) => {
                    if kept.is_empty() {
                        continue;
                    }
                    let i = i % kept.len();
                    drop(kept.remove(i));
                    model.cancel(i);
                }
                Op::Read => {
                    let got = rx.try_recv().map(|m| *m.data());
                    let want = model.read();
                    match want {
                        Some(value) => prop_assert_eq!(got, Ok(value), "{}", at),
                        None => prop_assert_eq!(got, Err(TryRecvError::Empty), "{}", at),
                    }
                }
            }
            prop_assert_eq!(rx.lost(), 0, "{}", at);
            prop_assert_eq!(rx.len(), model.queue.len(), "{}", at);
            let stats = bus.stats();
            prop_assert_eq!(
                (stats.published, stats.delivered, stats.dropped),
                (model.published, model.delivered, 0),
                "{}: {:?}", at, stats
            );
            prop_assert!(started.elapsed() < LIMIT, "{}: the case is taking too long", at);
        }
        // Cancel what is still kept, read everything: the reader gets the
        // model's queue exactly, and no room is left held: `capacity`
        // publishes fit and the next is refused.
        while !kept.is_empty() {
            drop(kept.pop());
            model.cancel(model.waiters.len() - 1);
        }
        while let Some(value) = model.read() {
            prop_assert_eq!(rx.try_recv().map(|m| *m.data()), Ok(value));
        }
        prop_assert_eq!(rx.try_recv().map(|m| *m.data()), Err(TryRecvError::Empty));
        for value in 0..capacity as u32 {
            prop_assert_eq!(bus.publish("m", 1_000_000 + value).map_err(|e| e.to_string()), Ok(1), "room held after the run");
        }
        let refused = matches!(bus.publish("m", 2_000_000), Err(Error::Full { .. }));
        prop_assert!(refused, "more room than the capacity");
        let stats = bus.stats();
        prop_assert_eq!(
            (stats.published, stats.delivered, stats.dropped, stats.inflight),
            (model.published + capacity as u64, model.delivered, 0, 0)
        );
        drop(rx);
    }
}
