//! Stress: publishers and subscribe/unsubscribe churn at once, for a bounded
//! time, in every delivery mode and both batch policies; and `close` while
//! publishers and subscribers are still running.
//!
//! Each configuration runs for `BLAZESUB_STRESS_SECS` seconds (default 1),
//! in rounds of at most 2 s on a fresh bus. Every publish's sequence number
//! and every subscription's lifetime are recorded with sequentially
//! consistent atomics (read-modify-writes where a later draw must synchronise
//! with them), so the checks are happens-before statements, not timing
//! guesses:
//! - 64 stable subscriptions (on 8 filters; the first publisher reaches all
//!   64, the second 40: fan-outs on both sides of the threshold, and two
//!   chunks under `Batch::Chunked`) receive every message exactly once;
//! - a subscription made mid-run and kept until `close` receives exactly
//!   once every message whose publish began after its `subscribe` returned,
//!   and none whose publish had returned before `subscribe` was called;
//! - a short-lived stream receives, in publish order, every message
//!   published while it was subscribed (pushes happen on the publisher in
//!   every mode); a short-lived handler does too in `Inline` mode, and in the
//!   other modes at most once (an unsubscribe cancels deliveries still
//!   queued for it, as documented);
//! - no handler call starts after its `unsubscribe` (or drop) returned, and
//!   no message from a publish that began after that is received;
//! - 4 ordered handler subscriptions on `#`: no two calls of one overlap
//!   (seen with a flag each call sets and clears), each publisher's messages
//!   arrive in publish order, none twice, and every one arrives unless the
//!   bus counted it dropped (an ordered queue is bounded);
//! - after `close`: nothing in flight, `stats().delivered` equals what the
//!   handlers and receivers counted, nothing dropped but what streams lost.
//!
//! `tests/delivery.rs::churn_while_publishing_*` already checks stable
//! subscriptions and the no-delivery-after-unsubscribe rule with a fixed
//! message count in the default batch policy; this file adds both batch
//! policies, mid-run subscriptions with exact lifetime windows, streams, a
//! time budget, and `close` racing live publishers and subscribers.

mod common;

use std::collections::HashSet;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Barrier, Mutex};
use std::time::{Duration, Instant};

use blazesub::topic::matches;
use blazesub::{Batch, Bus, DeliveryMode, Error, Message, Receiver, Subscription, TryRecvError};
use common::{env_number, runtime, within, BATCHES};

const PUBLISHERS: usize = 2;
const CHURNERS: usize = 2;
/// Publishes per publisher per round at most (bounds a round's memory).
const MAX_PER_ROUND: u32 = 100_000;
/// Stable subscriptions: filter `STABLE_FILTERS[i % 8]` for i in 0..64.
const STABLE: usize = 64;
const STABLE_FILTERS: [&str; 8] = [
    "s/+/x", "s/#", "+/+/x", "#", "s/0/#", "s/0/x", "+/0/+", "s/+/#",
];
/// Between the two publishers' stable fan-outs (64 and 40), so churn moves
/// the second one across it.
const THRESHOLD: usize = 44;
/// Threads that can run deliveries at once: the publishers (inline, or
/// running overflow) and two workers or runtime threads.
const RUNNER_THREADS: u32 = PUBLISHERS as u32 + 2;
/// The longest round.
const ROUND: Duration = Duration::from_secs(2);
/// Ordered handler subscriptions on `#` (both publishers reach them).
const ORDERED: usize = 4;

/// What an ordered handler observed.
struct OrderedProbe {
    /// Set while a call runs: finding it set means two calls overlapped.
    running: AtomicBool,
    overlaps: AtomicU64,
    /// Per publisher: one past the last sequence number received.
    next: Vec<AtomicU32>,
    out_of_order: AtomicU64,
    seen: Seen,
}

impl OrderedProbe {
    fn new(ids: usize) -> Self {
        Self {
            running: AtomicBool::new(false),
            overlaps: AtomicU64::new(0),
            next: (0..PUBLISHERS).map(|_| AtomicU32::new(0)).collect(),
            out_of_order: AtomicU64::new(0),
            seen: Seen::new(ids),
        }
    }

    fn call(&self, id: u32) {
        if self.running.swap(true, Ordering::SeqCst) {
            self.overlaps.fetch_add(1, Ordering::SeqCst);
        }
        let (p, seq) = split(id);
        if self.next[p].swap(seq + 1, Ordering::SeqCst) > seq {
            self.out_of_order.fetch_add(1, Ordering::SeqCst);
        }
        self.seen.hit(id);
        // Long enough for another call to arrive if the bus let it.
        for _ in 0..64 {
            std::hint::spin_loop();
        }
        self.running.store(false, Ordering::SeqCst);
    }
}

fn topic_of(p: usize) -> String {
    format!("s/{p}/x")
}

fn id_of(p: usize, seq: u32) -> u32 {
    p as u32 * MAX_PER_ROUND + seq
}

fn split(id: u32) -> (usize, u32) {
    ((id / MAX_PER_ROUND) as usize, id % MAX_PER_ROUND)
}

/// The publishers' counters. `started[p]` is drawn with `fetch_add` before
/// each publish (the value drawn is the message's sequence number); `done[p]`
/// is stored after the publish returned.
#[derive(Default)]
struct Clock {
    started: [AtomicU32; PUBLISHERS],
    done: [AtomicU32; PUBLISHERS],
}

impl Clock {
    /// Per publisher: every sequence number below it was published, and its
    /// publish returned, before now.
    fn done(&self) -> [u32; PUBLISHERS] {
        std::array::from_fn(|p| self.done[p].load(Ordering::SeqCst))
    }

    /// Per publisher: the first sequence number whose publish begins after
    /// now. A read-modify-write, so the draw of that number synchronises with
    /// this call, and everything before it happens before that publish.
    fn next(&self) -> [u32; PUBLISHERS] {
        std::array::from_fn(|p| self.started[p].fetch_add(0, Ordering::SeqCst))
    }
}

/// Which message ids one stable subscription received: a bit per id, and a
/// count of ids that arrived again.
struct Seen {
    bits: Vec<AtomicU64>,
    again: AtomicU64,
}

impl Seen {
    fn new(ids: usize) -> Self {
        Self {
            bits: (0..ids.div_ceil(64)).map(|_| AtomicU64::new(0)).collect(),
            again: AtomicU64::new(0),
        }
    }

    fn hit(&self, id: u32) {
        let bit = 1u64 << (id % 64);
        if self.bits[id as usize / 64].fetch_or(bit, Ordering::Relaxed) & bit != 0 {
            self.again.fetch_add(1, Ordering::Relaxed);
        }
    }

    fn has(&self, id: u32) -> bool {
        self.bits[id as usize / 64].load(Ordering::Relaxed) & (1u64 << (id % 64)) != 0
    }

    /// The first id in `ids` whose presence differs from `expected`.
    fn first_wrong(&self, ids: std::ops::Range<u32>, expected: bool) -> Option<u32> {
        let whole = if expected { u64::MAX } else { 0 };
        let mut id = ids.start;
        while id < ids.end {
            // Whole words at once where they fit.
            if id % 64 == 0
                && id + 64 <= ids.end
                && self.bits[id as usize / 64].load(Ordering::Relaxed) == whole
            {
                id += 64;
                continue;
            }
            if self.has(id) != expected {
                return Some(id);
            }
            id += 1;
        }
        None
    }
}

/// One subscription a churner made, and when it lived.
struct Record {
    filter: String,
    stream: bool,
    kept: bool,
    received: Mutex<Vec<u32>>,
    /// Set right after its unsubscribe returned.
    gone: AtomicBool,
    /// Handler calls that started after `gone` was set.
    late_calls: AtomicU32,
    /// `Clock::done()` before `subscribe` was called.
    done_before_subscribe: Mutex<[u32; PUBLISHERS]>,
    /// `Clock::next()` after `subscribe` returned.
    next_after_subscribe: Mutex<[u32; PUBLISHERS]>,
    /// `Clock::done()` before unsubscribing (kept ones: after `close`).
    done_before_unsubscribe: Mutex<[u32; PUBLISHERS]>,
    /// `Clock::next()` after unsubscribe returned (kept ones: after `close`).
    next_after_unsubscribe: Mutex<[u32; PUBLISHERS]>,
    /// Streams: what `lost()` said at the end.
    lost: AtomicU64,
}

impl Record {
    fn new(filter: String, stream: bool, kept: bool) -> Self {
        Self {
            filter,
            stream,
            kept,
            received: Mutex::new(Vec::new()),
            gone: AtomicBool::new(false),
            late_calls: AtomicU32::new(0),
            done_before_subscribe: Mutex::new([0; PUBLISHERS]),
            next_after_subscribe: Mutex::new([0; PUBLISHERS]),
            done_before_unsubscribe: Mutex::new([0; PUBLISHERS]),
            next_after_unsubscribe: Mutex::new([u32::MAX; PUBLISHERS]),
            lost: AtomicU64::new(0),
        }
    }
}

enum Held {
    Handler(Subscription),
    Stream(Receiver<u32>),
}

/// A subscription kept until after `close`, with its record.
type Kept = (Arc<Record>, Held);

/// What the threads of one round share.
struct Round {
    bus: Bus<u32>,
    clock: Clock,
    /// Per stable subscription: the message ids that arrived.
    stable: Vec<Arc<Seen>>,
    invocations: Arc<AtomicU64>,
    stream_taken: AtomicU64,
    publishing: AtomicBool,
    deadline: Instant,
}

fn churn_filter(shape: usize, p: usize) -> String {
    match shape % 7 {
        0 => "s/+/x".to_string(), // shares a stable set (appends)
        1 => "#".to_string(),     // shares a stable set
        2 => topic_of(p),         // shares the stable set of one publisher
        3 => format!("s/{p}/#"),  // new or shared nodes
        4 => format!("+/{p}/+"),  // new nodes
        5 => "s/+/x/#".to_string(),
        _ => format!("+/{p}/x"),
    }
}

fn subscribe(round: &Round, record: &Arc<Record>) -> Held {
    *record.done_before_subscribe.lock().unwrap() = round.clock.done();
    let held = if record.stream {
        Held::Stream(
            round
                .bus
                .subscribe_stream_with_capacity(&record.filter, 1 << 16)
                .unwrap(),
        )
    } else {
        let mine = Arc::clone(record);
        let invocations = Arc::clone(&round.invocations);
        Held::Handler(
            round
                .bus
                .subscribe(&record.filter, move |m: &Message<u32>| {
                    if mine.gone.load(Ordering::SeqCst) {
                        mine.late_calls.fetch_add(1, Ordering::SeqCst);
                    }
                    invocations.fetch_add(1, Ordering::Relaxed);
                    mine.received.lock().unwrap().push(*m.data());
                })
                .unwrap(),
        )
    };
    *record.next_after_subscribe.lock().unwrap() = round.clock.next();
    held
}

/// Takes everything a receiver holds into its record.
fn drain(round: &Round, record: &Record, rx: &mut Receiver<u32>) {
    let mut received = record.received.lock().unwrap();
    while let Ok(m) = rx.try_recv() {
        received.push(*m.data());
        round.stream_taken.fetch_add(1, Ordering::Relaxed);
    }
    record.lost.store(rx.lost(), Ordering::SeqCst);
}

fn unsubscribe(round: &Round, record: &Record, held: Held, explicit: bool) {
    *record.done_before_unsubscribe.lock().unwrap() = round.clock.done();
    match held {
        Held::Handler(sub) if explicit => sub.unsubscribe(),
        Held::Handler(sub) => drop(sub),
        Held::Stream(mut rx) => {
            drain(round, record, &mut rx);
            drop(rx);
        }
    }
    record.gone.store(true, Ordering::SeqCst);
    *record.next_after_unsubscribe.lock().unwrap() = round.clock.next();
}

/// Subscribes and unsubscribes until the publishers stop; returns every
/// record, and the subscriptions it keeps until after `close`.
fn churn(round: &Round, churner: usize) -> (Vec<Arc<Record>>, Vec<Kept>) {
    let mut records = Vec::new();
    let mut kept = Vec::new();
    let mut cycle = 0usize;
    while round.publishing.load(Ordering::SeqCst) {
        let p = (cycle + churner) % PUBLISHERS;
        let filter = churn_filter(cycle + 3 * churner, p);
        let batch: Vec<(Arc<Record>, Held)> = (0..1 + cycle % 4)
            .map(|i| {
                let stream = i == 0 && cycle % 3 == 0;
                let keep = i == 0 && cycle % 16 == 5 && kept.len() < 6;
                let record = Arc::new(Record::new(filter.clone(), stream, keep));
                let held = subscribe(round, &record);
                (record, held)
            })
            .collect();
        for _ in 0..cycle % 5 {
            std::thread::yield_now();
        }
        for (i, (record, held)) in batch.into_iter().enumerate() {
            records.push(Arc::clone(&record));
            if record.kept {
                kept.push((record, held));
            } else {
                unsubscribe(round, &record, held, i % 2 == 0);
            }
        }
        cycle += 1;
    }
    (records, kept)
}

fn publish(round: &Round, p: usize) {
    let topic = topic_of(p);
    let stable_fanout = (0..STABLE)
        .filter(|i| matches(STABLE_FILTERS[i % 8], &topic))
        .count();
    while Instant::now() < round.deadline {
        let seq = round.clock.started[p].fetch_add(1, Ordering::SeqCst);
        if seq >= MAX_PER_ROUND {
            break;
        }
        let matched = round.bus.publish(&topic, id_of(p, seq)).unwrap();
        assert!(
            matched >= stable_fanout,
            "publish to {topic} matched {matched} < {stable_fanout} stable subscriptions"
        );
        round.clock.done[p].store(seq + 1, Ordering::SeqCst);
    }
}

/// Figures of one configuration, for the report.
#[derive(Debug, Default)]
struct Figures {
    rounds: u32,
    publishes: u64,
    churned: u64,
    deliveries: u64,
    late_calls: u64,
    closing: Duration,
    checking: Duration,
}

fn close(bus: &Bus<u32>) {
    let bus = bus.clone();
    within(Duration::from_secs(60), "close", move || {
        tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap()
            .block_on(bus.close())
    })
    .expect("close");
}

/// One round: a fresh bus, the stable subscriptions, publishers and churners
/// until `length` has passed; then close and check everything.
fn round(
    mode: DeliveryMode,
    batch: Batch,
    rt: &tokio::runtime::Runtime,
    length: Duration,
) -> Figures {
    let what = format!("{mode:?} {batch:?}");
    let bus = Bus::<u32>::builder()
        .delivery(mode)
        .batch(batch)
        .workers(2)
        .max_concurrent_subscriptions(THRESHOLD)
        .runtime(rt.handle().clone())
        .build()
        .unwrap();
    let ids = PUBLISHERS * MAX_PER_ROUND as usize;
    let round = Arc::new(Round {
        bus: bus.clone(),
        clock: Clock::default(),
        stable: (0..STABLE).map(|_| Arc::new(Seen::new(ids))).collect(),
        invocations: Arc::new(AtomicU64::new(0)),
        stream_taken: AtomicU64::new(0),
        publishing: AtomicBool::new(true),
        deadline: Instant::now() + length,
    });
    let stable_subs: Vec<Subscription> = (0..STABLE)
        .map(|i| {
            let hits = Arc::clone(&round.stable[i]);
            let invocations = Arc::clone(&round.invocations);
            bus.subscribe(STABLE_FILTERS[i % 8], move |m: &Message<u32>| {
                invocations.fetch_add(1, Ordering::Relaxed);
                hits.hit(*m.data());
            })
            .unwrap()
        })
        .collect();

    let ordered: Vec<Arc<OrderedProbe>> = (0..ORDERED)
        .map(|_| Arc::new(OrderedProbe::new(ids)))
        .collect();
    let ordered_subs: Vec<Subscription> = ordered
        .iter()
        .map(|probe| {
            let probe = Arc::clone(probe);
            let invocations = Arc::clone(&round.invocations);
            bus.subscribe_ordered("#", move |m: &Message<u32>| {
                invocations.fetch_add(1, Ordering::Relaxed);
                probe.call(*m.data());
            })
            .unwrap()
        })
        .collect();

    let start = Arc::new(Barrier::new(PUBLISHERS + CHURNERS));
    let churners: Vec<_> = (0..CHURNERS)
        .map(|c| {
            let (round, start) = (Arc::clone(&round), Arc::clone(&start));
            std::thread::spawn(move || {
                start.wait();
                churn(&round, c)
            })
        })
        .collect();
    let publishers: Vec<_> = (0..PUBLISHERS)
        .map(|p| {
            let (round, start) = (Arc::clone(&round), Arc::clone(&start));
            std::thread::spawn(move || {
                start.wait();
                publish(&round, p);
            })
        })
        .collect();
    for publisher in publishers {
        publisher.join().expect("a publisher panicked");
    }
    round.publishing.store(false, Ordering::SeqCst);
    let mut records = Vec::new();
    let mut kept = Vec::new();
    for churner in churners {
        let (r, k) = churner.join().expect("a churner panicked");
        records.extend(r);
        kept.extend(k);
    }
    let closing = Instant::now();
    close(&bus);
    let closing = closing.elapsed();
    let checking = Instant::now();
    for (record, held) in kept {
        *record.done_before_unsubscribe.lock().unwrap() = round.clock.done();
        if let Held::Stream(mut rx) = held {
            drain(&round, &record, &mut rx);
            assert_eq!(rx.try_recv().unwrap_err(), TryRecvError::Closed, "{what}");
        }
    }

    // Everything is quiet now.
    let published = round.clock.done();
    let stats = bus.stats();
    assert_eq!(bus.inflight_messages(), 0, "{what}: in flight after close");
    assert_eq!(
        stats.published,
        published.iter().map(|&n| u64::from(n)).sum::<u64>(),
        "{what}: stats().published"
    );
    assert_eq!(stats.handler_panics, 0, "{what}");
    assert_eq!(
        stats.delivered,
        round.invocations.load(Ordering::SeqCst) + round.stream_taken.load(Ordering::SeqCst),
        "{what}: stats().delivered against handler calls and stream messages taken"
    );
    let lost: u64 = records.iter().map(|r| r.lost.load(Ordering::SeqCst)).sum();
    assert!(
        stats.dropped >= lost,
        "{what}: streams lost {lost}, stats().dropped says {}",
        stats.dropped
    );

    // Stable subscriptions: every message exactly once.
    for (i, seen) in round.stable.iter().enumerate() {
        let filter = STABLE_FILTERS[i % 8];
        assert_eq!(
            seen.again.load(Ordering::Relaxed),
            0,
            "{what}: stable subscription {i} ({filter}) got a message twice"
        );
        for (p, &count) in published.iter().enumerate() {
            let reaches = matches(filter, &topic_of(p));
            let (first, end) = (id_of(p, 0), id_of(p, MAX_PER_ROUND));
            if let Some(id) = seen.first_wrong(first..first + count, reaches) {
                panic!(
                    "{what}: stable subscription {i} ({filter}): message {} of publisher {p} \
                     {}",
                    id - first,
                    if reaches {
                        "never arrived"
                    } else {
                        "arrived, but does not match"
                    }
                );
            }
            if let Some(id) = seen.first_wrong(first + count..end, false) {
                panic!("{what}: stable subscription {i}: message {id} was never published");
            }
        }
    }

    // Ordered subscriptions: one call at a time, publish order, none twice,
    // and what did not arrive was counted dropped.
    let mut ordered_missing = 0u64;
    for (i, probe) in ordered.iter().enumerate() {
        assert_eq!(
            probe.overlaps.load(Ordering::SeqCst),
            0,
            "{what}: ordered subscription {i}: calls overlapped"
        );
        assert_eq!(
            probe.out_of_order.load(Ordering::SeqCst),
            0,
            "{what}: ordered subscription {i}: a publisher's messages out of order"
        );
        assert_eq!(
            probe.seen.again.load(Ordering::Relaxed),
            0,
            "{what}: ordered subscription {i} got a message twice"
        );
        let received: u64 = published
            .iter()
            .enumerate()
            .map(|(p, &count)| {
                let first = id_of(p, 0);
                (first..first + count)
                    .filter(|&id| probe.seen.has(id))
                    .count() as u64
            })
            .sum();
        assert!(received > 0, "{what}: ordered subscription {i} got nothing");
        for (p, &count) in published.iter().enumerate() {
            let first = id_of(p, 0);
            ordered_missing += (first..first + count)
                .filter(|&id| !probe.seen.has(id))
                .count() as u64;
        }
    }
    assert!(
        stats.dropped >= lost + ordered_missing,
        "{what}: {ordered_missing} messages never reached ordered subscriptions and \
         {lost} were lost by streams, but stats().dropped says {}",
        stats.dropped
    );
    drop(ordered_subs);

    // Churned and kept subscriptions: within their lifetimes.
    let mut churned_deliveries = 0u64;
    for record in &records {
        check_record(&what, mode, record);
        churned_deliveries += record.received.lock().unwrap().len() as u64;
    }
    assert!(
        churned_deliveries > 0,
        "{what}: the churn never overlapped the publishing ({} subscriptions)",
        records.len()
    );
    drop(stable_subs);
    Figures {
        rounds: 1,
        publishes: stats.published,
        churned: records.len() as u64,
        deliveries: stats.delivered,
        late_calls: records
            .iter()
            .map(|r| u64::from(r.late_calls.load(Ordering::SeqCst)))
            .sum(),
        closing,
        checking: checking.elapsed(),
    }
}

fn check_record(what: &str, mode: DeliveryMode, record: &Record) {
    let received = record.received.lock().unwrap();
    let before = *record.done_before_subscribe.lock().unwrap();
    let first = *record.next_after_subscribe.lock().unwrap();
    let last_done = *record.done_before_unsubscribe.lock().unwrap();
    let limit = *record.next_after_unsubscribe.lock().unwrap();
    let kind = match (record.stream, record.kept) {
        (true, true) => "kept stream",
        (true, false) => "stream",
        (false, true) => "kept handler",
        (false, false) => "handler",
    };
    let who = format!("{what}: {kind} on {:?}", record.filter);
    // A delivery starts when it checks the subscription's flag, just before
    // the handler is called; a runner preempted between the two may enter
    // the handler after unsubscribe returned. Each thread that runs
    // deliveries can be caught that way once per subscription, no more.
    let late = record.late_calls.load(Ordering::SeqCst);
    assert!(
        late <= RUNNER_THREADS,
        "{who}: {late} handler calls entered after unsubscribe returned; at most one per runner \
         thread ({RUNNER_THREADS}) may have passed the flag check before it"
    );
    let reaches: [bool; PUBLISHERS] =
        std::array::from_fn(|p| matches(&record.filter, &topic_of(p)));
    let mut seen = HashSet::with_capacity(received.len());
    let mut last_seq = [None::<u32>; PUBLISHERS];
    for &id in received.iter() {
        assert!(seen.insert(id), "{who}: message {id} arrived twice");
        let (p, seq) = split(id);
        assert!(reaches[p], "{who}: got a message for {}", topic_of(p));
        assert!(
            seq >= before[p],
            "{who}: got message {seq} of publisher {p}, whose publish returned before subscribe \
             was called ({} had)",
            before[p]
        );
        assert!(
            seq < limit[p],
            "{who}: got message {seq} of publisher {p}, whose publish began after unsubscribe \
             returned (at {})",
            limit[p]
        );
        if record.stream {
            assert!(
                last_seq[p].is_none_or(|last| seq > last),
                "{who}: message {seq} of publisher {p} after {last_seq:?}: out of publish order"
            );
            last_seq[p] = Some(seq);
        }
    }
    // Messages whose publish began after subscribe returned and returned
    // before unsubscribe began: owed exactly, where the mode promises it.
    let exact = record.stream || record.kept || mode == DeliveryMode::Inline;
    if !exact {
        return;
    }
    let mut missing = 0u64;
    let mut example = None;
    for p in 0..PUBLISHERS {
        if !reaches[p] {
            continue;
        }
        for seq in first[p]..last_done[p] {
            if !seen.contains(&id_of(p, seq)) {
                missing += 1;
                example.get_or_insert((p, seq));
            }
        }
    }
    let allowed = record.lost.load(Ordering::SeqCst);
    assert!(
        missing <= allowed,
        "{who}: {missing} messages published during its lifetime never arrived (first: {example:?}; \
         window {first:?}..{last_done:?}; it lost {allowed} to a full mailbox)"
    );
}

fn stress(mode: DeliveryMode) {
    let seconds = env_number("BLAZESUB_STRESS_SECS", 1);
    let rt = runtime(2);
    for batch in BATCHES {
        let budget = Duration::from_secs(seconds);
        let started = Instant::now();
        let mut figures = Figures::default();
        loop {
            let left = budget.saturating_sub(started.elapsed());
            let f = round(
                mode,
                batch,
                &rt,
                left.clamp(Duration::from_millis(200), ROUND),
            );
            figures.rounds += f.rounds;
            figures.publishes += f.publishes;
            figures.churned += f.churned;
            figures.deliveries += f.deliveries;
            figures.late_calls += f.late_calls;
            figures.closing += f.closing;
            figures.checking += f.checking;
            if started.elapsed() >= budget {
                break;
            }
        }
        eprintln!(
            "stress {mode:?} {batch:?}: {} round(s) in {:.1?}: {} publishes, {} churned \
             subscriptions, {} deliveries, {} handler entries just after an unsubscribe \
             (close took {:.1?}, checks {:.1?})",
            figures.rounds,
            started.elapsed(),
            figures.publishes,
            figures.churned,
            figures.deliveries,
            figures.late_calls,
            figures.closing,
            figures.checking,
        );
    }
}

#[test]
fn publish_and_churn_task_per_subscriber() {
    stress(DeliveryMode::TaskPerSubscriber);
}

#[test]
fn publish_and_churn_worker_pool() {
    stress(DeliveryMode::WorkerPool);
}

#[test]
fn publish_and_churn_inline() {
    stress(DeliveryMode::Inline);
}

// ---------------------------------------------------------------------------
// Close while publishers and subscribers are running
// ---------------------------------------------------------------------------

const CLOSE_ROUNDS: u64 = 12;
const CLOSE_PUBLISHERS: usize = 3;
const CLOSE_STABLE: usize = 8;

/// Three publishers and a subscriber thread run flat out; `close` is called
/// after 0 to 11 ms. `close` returns (within 60 s) and returns `Ok`; when it
/// has, every stable subscription has received every message whose publish
/// returned `Ok` (exactly that many calls, none pending), the stream holds
/// them all and then ends, and every publish and subscribe from then on —
/// and every one after a thread's first `Closed` — is `Error::Closed`.
/// No thread panics.
fn close_while_busy(mode: DeliveryMode, batch: Batch) {
    let rt = runtime(2);
    let (mut total_accepted, mut total_cycles) = (0u64, 0u64);
    for round in 0..CLOSE_ROUNDS {
        let what = format!("{mode:?} {batch:?} round {round}");
        let bus = Bus::<u32>::builder()
            .delivery(mode)
            .batch(batch)
            .workers(2)
            .max_concurrent_subscriptions(4)
            .runtime(rt.handle().clone())
            .build()
            .unwrap();
        let stable_calls = Arc::new(AtomicU64::new(0));
        let churn_calls = Arc::new(AtomicU64::new(0));
        let _stable: Vec<Subscription> = (0..CLOSE_STABLE)
            .map(|i| {
                let calls = Arc::clone(&stable_calls);
                bus.subscribe(
                    ["c/#", "c/+", "+/+", "#"][i % 4],
                    move |_: &Message<u32>| {
                        calls.fetch_add(1, Ordering::SeqCst);
                    },
                )
                .unwrap()
            })
            .collect();
        let mut rx = bus.subscribe_stream_with_capacity("c/#", 1 << 20).unwrap();
        let start = Arc::new(Barrier::new(CLOSE_PUBLISHERS + 2));

        let publishers: Vec<_> = (0..CLOSE_PUBLISHERS)
            .map(|p| {
                let (bus, start) = (bus.clone(), Arc::clone(&start));
                std::thread::spawn(move || {
                    let topic = format!("c/{p}");
                    let mut ok = 0u64;
                    start.wait();
                    loop {
                        match bus.publish(&topic, p as u32) {
                            Ok(matched) => {
                                assert!(matched > CLOSE_STABLE, "matched {matched}");
                                ok += 1;
                            }
                            Err(Error::Closed) => break,
                            Err(e) => panic!("publish during close: {e}"),
                        }
                    }
                    for _ in 0..1_000 {
                        match bus.publish(&topic, 0) {
                            Err(Error::Closed) => {}
                            other => panic!("a publish after Closed returned {other:?}"),
                        }
                    }
                    ok
                })
            })
            .collect();
        let churner = {
            let (bus, start, calls) = (bus.clone(), Arc::clone(&start), Arc::clone(&churn_calls));
            std::thread::spawn(move || {
                start.wait();
                let mut cycles = 0u64;
                loop {
                    let calls = Arc::clone(&calls);
                    match bus.subscribe("c/+", move |_: &Message<u32>| {
                        calls.fetch_add(1, Ordering::SeqCst);
                    }) {
                        Ok(sub) => {
                            std::thread::yield_now();
                            drop(sub);
                        }
                        Err(Error::Closed) => break,
                        Err(e) => panic!("subscribe during close: {e}"),
                    }
                    match bus.subscribe_stream("c/#") {
                        Ok(rx) => drop(rx),
                        Err(Error::Closed) => break,
                        Err(e) => panic!("subscribe_stream during close: {e}"),
                    }
                    cycles += 1;
                }
                for _ in 0..100 {
                    assert!(matches!(
                        bus.subscribe("c/+", |_: &Message<u32>| {}),
                        Err(Error::Closed)
                    ));
                    assert!(matches!(bus.subscribe_stream("c/#"), Err(Error::Closed)));
                }
                cycles
            })
        };

        start.wait();
        std::thread::sleep(Duration::from_millis(round % 12));
        close(&bus);
        // `close` has returned: everything accepted has run.
        let calls_at_close = stable_calls.load(Ordering::SeqCst);
        let churn_at_close = churn_calls.load(Ordering::SeqCst);
        assert!(bus.is_closed(), "{what}");
        assert_eq!(
            bus.inflight_messages(),
            0,
            "{what}: in flight after close returned"
        );
        assert!(
            matches!(bus.publish("c/0", 0), Err(Error::Closed)),
            "{what}"
        );

        let accepted: u64 = publishers
            .into_iter()
            .map(|p| p.join().expect("a publisher panicked"))
            .sum();
        let cycles = churner.join().expect("the subscriber thread panicked");
        assert_eq!(
            calls_at_close,
            accepted * CLOSE_STABLE as u64,
            "{what}: when close returned, the stable subscriptions had not received every \
             accepted message ({accepted} accepted)"
        );
        std::thread::sleep(Duration::from_millis(5));
        assert_eq!(
            stable_calls.load(Ordering::SeqCst),
            calls_at_close,
            "{what}: a delivery ran after close returned"
        );
        assert_eq!(
            churn_calls.load(Ordering::SeqCst),
            churn_at_close,
            "{what}: a delivery ran after close returned"
        );
        let mut streamed = 0u64;
        while let Ok(_m) = rx.try_recv() {
            streamed += 1;
        }
        assert_eq!(
            streamed, accepted,
            "{what}: the stream holds every accepted message"
        );
        assert_eq!(rx.try_recv().unwrap_err(), TryRecvError::Closed, "{what}");
        assert_eq!(rx.lost(), 0, "{what}");
        let stats = bus.stats();
        assert_eq!(stats.published, accepted, "{what}");
        assert_eq!(
            stats.delivered,
            calls_at_close + churn_at_close + streamed,
            "{what}: stats().delivered"
        );
        assert_eq!(stats.inflight, 0, "{what}");
        total_accepted += accepted;
        total_cycles += cycles;
    }
    // Over all rounds some closes came while publishes were under way: the
    // checks above had something to check.
    assert!(
        total_accepted > 0,
        "no publish was accepted before any close"
    );
    eprintln!(
        "stress close {mode:?} {batch:?}: {CLOSE_ROUNDS} closes under load; {total_accepted} \
         publishes accepted before them (all delivered before close returned), \
         {total_cycles} subscribe cycles"
    );
}

#[test]
fn close_while_busy_task_per_subscriber() {
    for batch in BATCHES {
        close_while_busy(DeliveryMode::TaskPerSubscriber, batch);
    }
}

#[test]
fn close_while_busy_worker_pool() {
    for batch in BATCHES {
        close_while_busy(DeliveryMode::WorkerPool, batch);
    }
}

#[test]
fn close_while_busy_inline() {
    close_while_busy(DeliveryMode::Inline, Batch::Chunked);
}
