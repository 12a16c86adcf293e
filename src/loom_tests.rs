//! Model checks of the concurrent core with loom.
//!
//! Run with `RUSTFLAGS="--cfg loom" cargo test --release --lib`
//! (`.ci/run` does, in a target directory of its own). Under `--cfg loom`,
//! `crate::sync` swaps in loom's atomics, mutexes, condition variables,
//! threads and wakers, and a model version of the mailbox's queue, so
//! these tests run the real trie, route cache, mailbox,
//! pool and counters while loom explores every interleaving of their
//! synchronisation steps (within a preemption bound: `LOOM_MAX_PREEMPTIONS`,
//! default 3 here).
//!
//! What is checked:
//! - the route cache never serves a stale route: a lookup that starts after
//!   `insert` returns sees the new subscriber — whether it was appended to an
//!   existing set, created a new trie node (for a wildcard filter, which
//!   changes every topic's stamp, or an exact one, which changes only its
//!   own topic's), or made its set grow — and one
//!   that starts after `remove` returns never yields the removed one as
//!   active, while another thread is warming the same cache slot;
//! - a stream mailbox under a racing push, overflow and close: the reader
//!   gets messages in order and `received + lost` equals what was pushed; and
//!   a reader waiting for a message is always woken by the push itself (loom
//!   reports a deadlock otherwise); and a push racing the receiver's drop is
//!   counted as dropped exactly once, by the push or by the drop;
//! - the reader's parked mark (`ReaderWaker`), on plain atomics rather than
//!   the model's mutex queue: a reader that parks is woken by one of two
//!   racing publishers, and loom finds it asleep for good without either
//!   side's `SeqCst` fence;
//! - a subscribe racing the bus's first retained publish (which a subscribe
//!   made before it skips the store's lock for) gets the message exactly
//!   once, from its snapshot or live;
//! - a `publish_async` into a full lossless stream, polled once and dropped
//!   while the reader frees room: it delivered all or nothing, and holds no
//!   room afterwards (every slot is back once the stream is drained); and
//!   the room itself (`registry/room.rs`): a waiting publisher is always
//!   woken by the slot freed for it, a publisher that does not wait never
//!   takes it, and a waiter cancelled while a slot is freed loses none;
//! - the worker pool: every delivery runs exactly once whether the queue has
//!   room or the publisher runs the job itself, the close barrier sees
//!   `inflight` reach zero (a missed wake-up would deadlock), and the workers
//!   stop; a handler that blocks strands nothing queued or batched behind it
//!   (the other worker takes it over); and a publisher waiting for room
//!   (`Overflow::Wait`) is always let go once the bus starts closing;
//! - `TaskPerSubscriber`'s lane (`dispatch/lane.rs`), driven as `tasks.rs`
//!   drives it with loom threads in place of tokio tasks: every publish
//!   queued runs exactly once whoever serves it (the lane's task, a task
//!   started by a publisher that served, or the publisher itself when it
//!   finds the lane full), a publisher waiting for room is woken by the
//!   servers' takes and never needs its timeout, also with two publishers
//!   sharing the lane, and the lane ends with nothing queued, no task and
//!   no room held;
//! - the lanes' watcher (`dispatch/lane_watch.rs`): a publish queued while
//!   the watcher finds the lanes empty and disarms never leaves it asleep
//!   with the publish queued, and an arm wakes a watcher asleep (a missed
//!   wake-up would deadlock here);
//! - a handler entry's counted pointers (`registry/counted.rs`): the last
//!   of them to go drops the entry once, after every use of it through the
//!   others (loom's cell reports the drop's read as a race without the
//!   `Acquire` fence), and a flag cleared beside the count survives the
//!   count's changes;
//! - the grace period behind `unsubscribe_and_wait` (`registry/quiesce.rs`):
//!   once the wait that follows a subscription's deactivation returns, no
//!   runner is in its handler and none enters it, whether a runner entered
//!   before the deactivation, after it, or during the epoch flip; and an
//!   async delivery a runner started before the deactivation has finished
//!   once the wait for the subscription's unfinished deliveries returns.

use std::sync::atomic::AtomicUsize as StdAtomicUsize;
use std::sync::Arc;
use std::time::Duration;

use loom::thread;

use crate::config::{Config, DeliveryMode, Overflow};
use crate::dispatch::{
    Dispatcher, Env, Fanout, Lane, LaneWatch, Next, Policy, Pushed, Server, TaskGauge, STALL,
};
use crate::message::Message;
use crate::registry::entry::{HandlerEntry, Subscriber, SyncSink};
use crate::registry::mailbox::Mailbox;
use crate::registry::route::RouteCache;
use crate::registry::trie::{Handlers, Trie};
use crate::stats::{Counters, Tally};

fn model(f: impl Fn() + Sync + Send + 'static) {
    model_bounded(3, f);
}

/// [`model`] with `bound` preemptions unless `LOOM_MAX_PREEMPTIONS` sets
/// another.
fn model_bounded(bound: usize, f: impl Fn() + Sync + Send + 'static) {
    let mut builder = loom::model::Builder::new();
    if builder.preemption_bound.is_none() {
        builder.preemption_bound = Some(bound);
    }
    builder.check(f);
}

/// Subscription `id`: a handler doing nothing.
fn handler(id: u64) -> (u64, HandlerEntry<u32>) {
    (
        id,
        Subscriber::new(SyncSink(|_: &Message<u32>| {})).into_handler(),
    )
}

/// Inserts a prepared entry, subscription `id` (the trie's own filter
/// string is not needed).
fn insert(trie: &Trie<u32>, filter: &str, (id, entry): (u64, HandlerEntry<u32>)) {
    assert!(trie.insert::<Handlers>(filter, id, |_| entry).is_ok());
}

/// A thread looking up `topic` (warming its cache slot) while the model's
/// thread changes the trie.
fn spawn_lookup(
    trie: &Arc<Trie<u32>>,
    cache: &Arc<RouteCache<u32>>,
    topic: &'static str,
) -> thread::JoinHandle<()> {
    let (trie, cache) = (Arc::clone(trie), Arc::clone(cache));
    thread::spawn(move || {
        cache.route(&trie, topic);
    })
}

/// `before` subscribers on "a/b", a warm cache, then a reader thread looking
/// up "a/b" while this thread runs `change` and looks it up afterwards.
fn race_lookup(before: u64, change: impl Fn(&Trie<u32>), check: impl Fn(Vec<u64>)) {
    let trie = Arc::new(Trie::<u32>::new());
    let cache = Arc::new(RouteCache::<u32>::new(2));
    for id in 1..=before {
        insert(&trie, "a/b", handler(id));
    }
    cache.route(&trie, "a/b");
    let reader = spawn_lookup(&trie, &cache, "a/b");
    change(&trie);
    check(cache.route(&trie, "a/b").active_ids());
    reader.join().unwrap();
}

#[test]
fn loom_lookup_after_an_append_sees_it() {
    model(|| {
        race_lookup(
            1,
            |trie| insert(trie, "a/b", handler(9)),
            |ids| assert!(ids.contains(&9), "{ids:?}"),
        );
    });
}

#[test]
fn loom_lookup_after_a_new_node_sees_it() {
    model(|| {
        race_lookup(
            1,
            |trie| insert(trie, "a/+", handler(9)),
            |ids| assert!(ids.contains(&9), "{ids:?}"),
        );
    });
}

/// An exact filter's new node changes only its own topic's stamp: a
/// lookup racing it may cache the route from before, and the lookup after
/// the insert must still see the new node.
#[test]
fn loom_lookup_after_a_new_exact_node_sees_it() {
    model(|| {
        let trie = Arc::new(Trie::<u32>::new());
        let cache = Arc::new(RouteCache::<u32>::new(2));
        insert(&trie, "a/+", handler(1));
        cache.route(&trie, "a/b");
        let reader = spawn_lookup(&trie, &cache, "a/b");
        insert(&trie, "a/b", handler(9));
        let ids = cache.route(&trie, "a/b").active_ids();
        assert!(ids.contains(&9) && ids.contains(&1), "{ids:?}");
        reader.join().unwrap();
    });
}

#[test]
fn loom_lookup_after_a_set_grows_sees_it() {
    model(|| {
        // Four subscribers fill the first set; the fifth rebuilds it.
        race_lookup(
            4,
            |trie| insert(trie, "a/b", handler(9)),
            |ids| assert_eq!(ids.len(), 5, "{ids:?}"),
        );
    });
}

#[test]
fn loom_lookup_after_a_remove_never_sees_it() {
    model(|| {
        let victim = Subscriber::new(SyncSink(|_: &Message<u32>| {}));
        let trie = Arc::new(Trie::<u32>::new());
        let cache = Arc::new(RouteCache::<u32>::new(2));
        insert(&trie, "a/b", (1, victim.clone().into_handler()));
        insert(&trie, "a/+", handler(2));
        cache.route(&trie, "a/b");
        let reader = spawn_lookup(&trie, &cache, "a/b");
        assert!(trie.remove::<Handlers>("a/b", false, &*victim));
        let ids = cache.route(&trie, "a/b").active_ids();
        assert_eq!(ids, [2]);
        reader.join().unwrap();
    });
}

/// A reader walking a subscriber set while its writer appends
/// (`registry/write_once.rs`): the reader sees a prefix of the entries,
/// each whole, and a walk over more slots than the length it loaded stops
/// at the length. Loom's cell reports any read of a slot that is not
/// ordered after its fill (with the length stored `Relaxed`, this fails).
#[test]
fn loom_a_reader_walking_a_set_sees_only_published_slots() {
    use crate::registry::subset::SubSet;

    model(|| {
        // Room for four: one entry now, two appended during the walk.
        let (id, entry) = handler(1);
        let set = Arc::new(SubSet::empty().grown(id, entry));
        let reader = {
            let set = Arc::clone(&set);
            thread::spawn(move || {
                let len = set.len();
                let ids: Vec<u64> = set.entries_with_ids(len).map(|(id, _)| id).collect();
                assert_eq!(ids, (1..=len as u64).collect::<Vec<_>>());
                let walked = set
                    .runs(0..4)
                    .flatten()
                    .filter(|slot| slot.get().is_some())
                    .count();
                assert!((len..=3).contains(&walked), "{walked} of {len}");
            })
        };
        for id in 2..=3 {
            // SAFETY: this thread is the set's only writer.
            #[allow(unsafe_code)]
            let pushed = unsafe { set.try_push(id, handler(id).1) };
            assert!(pushed.is_ok());
        }
        reader.join().unwrap();
        assert_eq!(set.entries(set.len()).count(), 3);
    });
}

#[test]
fn loom_mailbox_push_overflow_and_close() {
    model(|| {
        let mailbox = Arc::new(Mailbox::<u32>::new(2));
        let producer = {
            let mailbox = Arc::clone(&mailbox);
            thread::spawn(move || {
                for value in 0..3 {
                    mailbox.push(Arc::new(Message::new("s", value)), false);
                }
                mailbox.close();
            })
        };
        let received = loom::future::block_on(async {
            let mut received = Vec::new();
            while let Some(message) = std::future::poll_fn(|cx| mailbox.poll_pop(cx)).await {
                received.push(*message.data());
            }
            received
        });
        producer.join().unwrap();
        assert!(received.windows(2).all(|w| w[0] < w[1]), "{received:?}");
        assert_eq!(received.len() as u64 + mailbox.lost(), 3, "{received:?}");
    });
}

#[test]
fn loom_mailbox_wakes_a_waiting_reader() {
    // The producer waits for the reader to take the first message before it
    // closes, so only the push's own wake-up can get the reader there: a
    // wake-up lost between the reader's empty check and its registration
    // leaves both blocked, which loom reports as a deadlock.
    model(|| {
        let mailbox = Arc::new(Mailbox::<u32>::new(4));
        let (taken, taken_rx) = loom::sync::mpsc::channel::<()>();
        let producer = {
            let mailbox = Arc::clone(&mailbox);
            thread::spawn(move || {
                mailbox.push(Arc::new(Message::new("s", 7)), false);
                taken_rx.recv().unwrap();
                mailbox.close();
            })
        };
        loom::future::block_on(async {
            let first = std::future::poll_fn(|cx| mailbox.poll_pop(cx)).await;
            assert_eq!(first.map(|m| *m.data()), Some(7));
            taken.send(()).unwrap();
            let end = std::future::poll_fn(|cx| mailbox.poll_pop(cx)).await;
            assert!(end.is_none());
        });
        producer.join().unwrap();
        assert_eq!(mailbox.lost(), 0);
    });
}

#[test]
fn loom_a_parked_reader_is_woken_by_a_publish_that_fenced() {
    // `ReaderWaker` on its own, with a plain atomic for the message: the
    // model's mailbox queue is a mutex, whose lock orders a push and a pop
    // by itself, so it cannot show what the two fences do for the real
    // lock-free queue. Here the publish is a relaxed store: either the
    // reader's look after parking sees it, or the publisher sees the mark
    // and wakes the reader; otherwise the reader sleeps for good (loom
    // reports a deadlock). Two publishers race to wake it once.
    use crate::sync::{fence, AtomicUsize, Ordering, ReaderWaker};
    model(|| {
        let waker = Arc::new(ReaderWaker::new());
        let published = Arc::new(AtomicUsize::new(0));
        let publishers: Vec<_> = (0..2)
            .map(|_| {
                let (waker, published) = (Arc::clone(&waker), Arc::clone(&published));
                thread::spawn(move || {
                    published.fetch_add(1, Ordering::Relaxed);
                    fence(Ordering::SeqCst);
                    waker.wake_parked();
                })
            })
            .collect();
        loom::future::block_on(std::future::poll_fn(|cx| {
            if published.load(Ordering::Relaxed) == 2 {
                waker.running();
                return std::task::Poll::Ready(());
            }
            waker.park(cx.waker());
            if published.load(Ordering::Relaxed) == 2 {
                waker.running();
                return std::task::Poll::Ready(());
            }
            std::task::Poll::Pending
        }));
        for publisher in publishers {
            publisher.join().unwrap();
        }
    });
}

#[test]
fn loom_a_disconnect_strands_no_push_and_counts_its_loss_first() {
    // A `Disconnect` mailbox of one: a publisher pushes two (the second
    // may not fit and close it) and then closes it as the bus would;
    // another pushes one, racing those closes. The reader reads to the
    // end: nothing may land after it saw the end, and when it sees the
    // end, the message that closed it is counted.
    use crate::stream_options::StreamOverflow;
    model_bounded(2, || {
        let mailbox = Arc::new(Mailbox::<u32>::with_overflow(1, StreamOverflow::Disconnect));
        let first = {
            let mailbox = Arc::clone(&mailbox);
            thread::spawn(move || {
                for value in 0..2 {
                    mailbox.push(Arc::new(Message::new("s", value)), false);
                }
                mailbox.close();
            })
        };
        let second = {
            let mailbox = Arc::clone(&mailbox);
            thread::spawn(move || {
                mailbox.push(Arc::new(Message::new("s", 2)), false);
            })
        };
        let (received, lost_at_end) = loom::future::block_on(async {
            let mut received = 0u64;
            while std::future::poll_fn(|cx| mailbox.poll_pop(cx))
                .await
                .is_some()
            {
                received += 1;
            }
            (received, mailbox.lost())
        });
        first.join().unwrap();
        second.join().unwrap();
        assert_eq!(
            mailbox.len(),
            0,
            "a push landed after the reader saw the end"
        );
        assert_eq!(received + mailbox.lost(), 3, "received {received}");
        if mailbox.disconnected() {
            assert!(
                lost_at_end >= 1,
                "the end came before the loss that caused it"
            );
        }
    });
}

#[test]
fn loom_mailbox_counts_a_push_racing_the_reader_drop() {
    // A push that found the mailbox open may land after the receiver's drop
    // has drained it: the reader-gone flag makes one side count it.
    model(|| {
        let mailbox = Arc::new(Mailbox::<u32>::new(1));
        let producer = {
            let mailbox = Arc::clone(&mailbox);
            thread::spawn(move || {
                (0..2)
                    .map(|value| {
                        mailbox
                            .push(Arc::new(Message::new("s", value)), false)
                            .dropped
                    })
                    .sum::<u64>()
            })
        };
        let unread = mailbox.reader_dropped();
        let dropped_by_pushes = producer.join().unwrap();
        assert_eq!(unread + dropped_by_pushes, 2, "unread {unread}");
    });
}

#[test]
fn loom_pool_delivers_everything_and_stops() {
    model(|| pool_delivers_everything_and_stops(1, 1));
}

#[test]
fn loom_two_workers_deliver_everything_and_stop() {
    // One publish per queue: the second publish finds its lane full or
    // taken by the other worker, and each bell reaches its own worker.
    // Three threads and the help post: two preemptions take seconds, three
    // far longer (`LOOM_MAX_PREEMPTIONS=3` runs that).
    model_bounded(2, || pool_delivers_everything_and_stops(2, 2));
}

/// What the runners of a bus with `config` share, without a runtime.
fn model_env(config: &Config) -> Arc<Env> {
    Arc::new(Env {
        counters: Arc::new(Counters::new()),
        quiescence: Arc::new(crate::registry::quiesce::Quiescence::new()),
        workers: config.workers,
        handle: None,
        tasks: TaskGauge::new(4),
        overflow: config.overflow,
    })
}

/// The pool `config` describes, and what its runners share.
fn start_pool(config: &Config) -> (Arc<Env>, Dispatcher<u32>) {
    let env = model_env(config);
    let dispatcher = Dispatcher::<u32>::start(config, &env).unwrap();
    (env, dispatcher)
}

/// The job of publishing `value` to `topic` of `trie` as the bus makes it:
/// admitted, routed, cut by `config`'s policy.
fn admitted_job(
    trie: &Trie<u32>,
    config: &Config,
    env: &Env,
    topic: &'static str,
    value: u32,
) -> Fanout<u32> {
    let mut admitted = env.counters.begin_publish().unwrap();
    let sets = RouteCache::<u32>::new(2).route(trie, topic).handler_sets();
    let job = Fanout::new(
        Arc::new(Message::new(topic, value)),
        sets,
        Default::default(),
        &Policy::new(config),
    )
    .unwrap();
    admitted.accept(job.total());
    job
}

/// Publishes `value` to topic "t" of `trie` as the bus would: admitted,
/// routed, cut by `config`'s policy, dispatched (nothing dropped).
fn publish_to_pool(
    trie: &Trie<u32>,
    config: &Config,
    env: &Arc<Env>,
    dispatcher: &Dispatcher<u32>,
    value: u32,
) {
    let job = admitted_job(trie, config, env, "t", value);
    assert_eq!(dispatcher.dispatch(job, env), 0);
}

fn pool_delivers_everything_and_stops(workers: usize, queue_capacity: usize) {
    let config = Config {
        delivery: DeliveryMode::WorkerPool,
        workers,
        queue_capacity,
        overflow: Overflow::CallerRuns,
        ..Config::default()
    };
    let (env, dispatcher) = start_pool(&config);
    let calls = Arc::new(StdAtomicUsize::new(0));
    let trie = Trie::<u32>::new();
    for id in 0..2 {
        let calls = Arc::clone(&calls);
        let entry: HandlerEntry<u32> = Subscriber::new(SyncSink(move |_: &Message<u32>| {
            calls.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        }))
        .into_handler();
        insert(&trie, "t", (id, entry));
    }
    for value in 0..2 {
        publish_to_pool(&trie, &config, &env, &dispatcher, value);
    }
    env.counters
        .close_and_wait(Duration::from_secs(60))
        .unwrap();
    assert_eq!(calls.load(std::sync::atomic::Ordering::Relaxed), 4);
    let stats = env.counters.snapshot();
    assert_eq!((stats.delivered, stats.inflight), (4, 0));
    dispatcher.shut_down();
}

/// A slow handler never strands the runners queued behind it on its
/// worker's queue: one publish, `Batch::Single` below the threshold, is
/// four runners, two queued to each worker (in turn: runners 0 and 2 to
/// the first, 1 and 3 to the second), and the handler of subscription
/// `slow` (the unit the runner that claims `slow`-th gets) blocks until the
/// other three have run. Whatever the interleaving, a worker takes what is
/// queued behind the blocked one, even when it passed that lane by while
/// its owner was still waking up (loom reports a deadlock otherwise: one
/// worker waiting for its bell, the other in the handler, a runner left
/// queued).
fn slow_handler_strands_no_runner_queued_behind_it(slow: u64) {
    use crate::config::Batch;
    use loom::sync::{Condvar, Mutex};

    model_bounded(2, move || {
        let config = Config {
            delivery: DeliveryMode::WorkerPool,
            workers: 2,
            queue_capacity: 4,
            batch: Batch::Single,
            max_concurrent_subscriptions: 10,
            overflow: Overflow::CallerRuns,
            ..Config::default()
        };
        let (env, dispatcher) = start_pool(&config);
        let others_ran = Arc::new((Mutex::new(0usize), Condvar::new()));
        let trie = Trie::<u32>::new();
        for id in 0..4 {
            let others_ran = Arc::clone(&others_ran);
            let entry: HandlerEntry<u32> = Subscriber::new(SyncSink(move |_: &Message<u32>| {
                let (count, changed) = &*others_ran;
                let mut count = count.lock().unwrap();
                if id == slow {
                    while *count < 3 {
                        count = changed.wait(count).unwrap();
                    }
                } else {
                    *count += 1;
                    changed.notify_all();
                }
            }))
            .into_handler();
            insert(&trie, "t", (id, entry));
        }
        publish_to_pool(&trie, &config, &env, &dispatcher, 0);
        env.counters
            .close_and_wait(Duration::from_secs(60))
            .unwrap();
        assert_eq!(env.counters.snapshot().delivered, 4);
        dispatcher.shut_down();
    });
}

/// The second unit blocks: the other worker, done with its own queue,
/// must not wait while work is queued for this one, whatever it found
/// there when it looked: `pool/shared.rs`, `Shared::stranded_work`.
#[test]
fn loom_a_slow_second_unit_strands_no_runner() {
    slow_handler_strands_no_runner_queued_behind_it(1);
}

/// The third unit blocks: it is claimed by a worker that was still waking
/// up when the other, done with its own queue, passed this one by
/// (`pool/shared.rs`, `Shared::share_rest`).
#[test]
fn loom_a_slow_third_unit_strands_no_runner() {
    slow_handler_strands_no_runner_queued_behind_it(2);
}

/// Two publishes to one topic's two subscriptions, both at its home worker
/// (worker 0), below the threshold: worker 0 runs them as a batch or one
/// by one, and subscription 0's handler blocks on the first message until
/// subscription 1 has run both. Whatever the interleaving, worker 1 gets
/// subscription 1's deliveries: it helps a lone publish, or joins the batch
/// of a stalled worker (under loom, one that started nothing between two
/// looks); loom reports a deadlock otherwise.
#[test]
fn loom_a_blocked_handler_strands_nothing_of_its_batch() {
    use loom::sync::{Condvar, Mutex};

    model_bounded(2, || {
        let config = Config {
            delivery: DeliveryMode::WorkerPool,
            workers: 2,
            queue_capacity: 4,
            overflow: Overflow::CallerRuns,
            ..Config::default()
        };
        let (env, dispatcher) = start_pool(&config);
        let second_ran = Arc::new((Mutex::new(0usize), Condvar::new()));
        let trie = Trie::<u32>::new();
        for id in 0..2 {
            let second_ran = Arc::clone(&second_ran);
            let entry: HandlerEntry<u32> =
                Subscriber::new(SyncSink(move |message: &Message<u32>| {
                    let (count, changed) = &*second_ran;
                    let mut count = count.lock().unwrap();
                    if id == 0 {
                        while *message.data() == 0 && *count < 2 {
                            count = changed.wait(count).unwrap();
                        }
                    } else {
                        *count += 1;
                        changed.notify_all();
                    }
                }))
                .into_handler();
            insert(&trie, "t", (id, entry));
        }
        for value in 0..2 {
            publish_to_pool(&trie, &config, &env, &dispatcher, value);
        }
        env.counters
            .close_and_wait(Duration::from_secs(60))
            .unwrap();
        assert_eq!(env.counters.snapshot().delivered, 4);
        dispatcher.shut_down();
    });
}

/// Publishes to two topics with the same home worker (worker 0), one
/// subscription each: the first's handler blocks until the second's has
/// run. The second publish does not fit a batch behind the first, so it
/// stays in worker 0's lane: whatever the interleaving, worker 1 gets it,
/// as a share of that lane, and worker 0 still serves its lane when worker
/// 1 took the first publish instead (a share's taker is no server:
/// `lane.rs`); loom reports a deadlock otherwise.
#[test]
fn loom_a_blocked_handler_strands_no_publish_taken_behind_it() {
    use loom::sync::{Condvar, Mutex};

    model_bounded(2, || {
        let config = Config {
            delivery: DeliveryMode::WorkerPool,
            workers: 2,
            queue_capacity: 4,
            overflow: Overflow::CallerRuns,
            ..Config::default()
        };
        let (env, dispatcher) = start_pool(&config);
        let other_ran = Arc::new((Mutex::new(false), Condvar::new()));
        let trie = Trie::<u32>::new();
        for (id, topic) in [(0, "t"), (1, "u")] {
            let other_ran = Arc::clone(&other_ran);
            let entry: HandlerEntry<u32> = Subscriber::new(SyncSink(move |_: &Message<u32>| {
                let (ran, changed) = &*other_ran;
                let mut ran = ran.lock().unwrap();
                if id == 0 {
                    while !*ran {
                        ran = changed.wait(ran).unwrap();
                    }
                } else {
                    *ran = true;
                    changed.notify_all();
                }
            }))
            .into_handler();
            insert(&trie, topic, (id, entry));
        }
        for (topic, value) in [("t", 0), ("u", 1)] {
            let job = admitted_job(&trie, &config, &env, topic, value);
            assert_eq!(dispatcher.dispatch(job, &env), 0);
        }
        env.counters
            .close_and_wait(Duration::from_secs(60))
            .unwrap();
        assert_eq!(env.counters.snapshot().delivered, 2);
        dispatcher.shut_down();
    });
}

/// One worker, a queue of one ticket, `Overflow::Wait`: the worker blocks
/// in the first message's handler until the publisher has returned from its
/// third publish, which finds the queue full and waits for room. Another
/// thread starts closing the bus meanwhile. Whatever the interleaving, the
/// waiting publisher is let go (it runs its job itself) and everything is
/// delivered once; loom reports a deadlock if the close's wake-up can fall
/// between the publisher's look at the flag and its wait.
#[test]
fn loom_closing_lets_a_publisher_waiting_for_room_go() {
    use loom::sync::atomic::{AtomicBool, Ordering};

    model_bounded(2, || {
        let config = Config {
            delivery: DeliveryMode::WorkerPool,
            workers: 1,
            queue_capacity: 1,
            overflow: Overflow::Wait,
            ..Config::default()
        };
        let (env, dispatcher) = start_pool(&config);
        let dispatcher = Arc::new(dispatcher);
        let published = Arc::new(AtomicBool::new(false));
        let trie = Trie::<u32>::new();
        let entry: HandlerEntry<u32> = {
            let published = Arc::clone(&published);
            Subscriber::new(SyncSink(move |message: &Message<u32>| {
                while *message.data() == 0 && !published.load(Ordering::SeqCst) {
                    thread::yield_now();
                }
            }))
            .into_handler()
        };
        insert(&trie, "t", (0, entry));
        let closer = {
            let dispatcher = Arc::clone(&dispatcher);
            thread::spawn(move || dispatcher.closing())
        };
        for value in 0..3 {
            publish_to_pool(&trie, &config, &env, &dispatcher, value);
        }
        published.store(true, Ordering::SeqCst);
        closer.join().unwrap();
        env.counters
            .close_and_wait(Duration::from_secs(60))
            .unwrap();
        assert_eq!(env.counters.snapshot().delivered, 3);
        dispatcher.shut_down();
    });
}

#[test]
fn loom_subscribe_racing_the_first_retained_publish_gets_it_once() {
    model(|| {
        let bus = crate::Bus::<u32>::builder()
            .delivery(DeliveryMode::Inline)
            .build()
            .unwrap();
        let seen = Arc::new(StdAtomicUsize::new(0));
        let publisher = {
            let bus = bus.clone();
            thread::spawn(move || {
                bus.publish_retained("a", 1).unwrap();
            })
        };
        let counter = Arc::clone(&seen);
        let subscription = bus
            .subscribe("a", move |_: &Message<u32>| {
                counter.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            })
            .unwrap();
        publisher.join().unwrap();
        // Through the snapshot or live, never both, never neither.
        assert_eq!(seen.load(std::sync::atomic::Ordering::Relaxed), 1);
        drop(subscription);
    });
}

#[test]
fn loom_cancelled_publish_async_holds_no_room() {
    use std::future::Future;
    use std::task::{Context, Poll, Waker};

    use crate::{StreamOptions, StreamOverflow};

    model(|| {
        let bus = crate::Bus::<u32>::builder()
            .delivery(DeliveryMode::Inline)
            .build()
            .unwrap();
        let options = StreamOptions::new(1).overflow(StreamOverflow::Backpressure);
        let mut stream = bus.subscribe_stream_with("t", options).unwrap();
        bus.publish("t", 0).unwrap(); // the stream is full
        let reader = thread::spawn(move || {
            let first = stream.try_recv().map(|m| *m.data());
            (stream, first)
        });
        // Polled once (it may find the room the reader just freed), then
        // cancelled.
        let mut publish = Box::pin(bus.publish_async("t", 1));
        let delivered = matches!(
            publish
                .as_mut()
                .poll(&mut Context::from_waker(Waker::noop())),
            Poll::Ready(Ok(1))
        );
        drop(publish);
        let (mut stream, first) = reader.join().unwrap();
        let mut received: Vec<u32> = first.into_iter().collect();
        received.extend(std::iter::from_fn(|| stream.try_recv().ok()).map(|m| *m.data()));
        let expected: Vec<u32> = if delivered { vec![0, 1] } else { vec![0] };
        assert_eq!(received, expected, "all or nothing");
        assert_eq!(stream.unreserved_room(), Some(1), "room left reserved");
    });
}

/// A publisher waiting for room in a lossless mailbox is woken by the
/// reader's give-back whatever the interleaving (loom reports a deadlock if
/// the wake-up can be lost), while a second publisher tries to take room
/// without waiting; no slot is made or lost. (That the one that does not
/// wait never takes a slot a waiter is owed is `room.rs`'s unit test.)
#[test]
fn loom_a_waiting_publisher_gets_the_freed_slot() {
    use crate::registry::room::{Room, Take};

    model(|| {
        let room = Arc::new(Room::new(1));
        assert_eq!(room.try_take(), Take::Taken);
        let waiter = {
            let room = Arc::clone(&room);
            thread::spawn(move || loom::future::block_on(room.take()))
        };
        let other = {
            let room = Arc::clone(&room);
            thread::spawn(move || room.try_take())
        };
        room.give_back();
        if other.join().unwrap() == Take::Taken {
            // It came before the waiter queued; its message is read.
            room.give_back();
        }
        assert!(waiter.join().unwrap(), "the waiter got a slot");
        assert_eq!(room.free(), 0, "one slot, held by the waiter");
    });
}

/// A waiting publisher cancelled while the reader frees room: the slot
/// ends up with nobody or back in the free count, never lost.
#[test]
fn loom_a_cancelled_waiter_loses_no_slot() {
    use std::future::Future;
    use std::task::{Context, Poll, Waker};

    use crate::registry::room::{Room, Take};

    model(|| {
        let room = Arc::new(Room::new(1));
        assert_eq!(room.try_take(), Take::Taken);
        let waiter = {
            let room = Arc::clone(&room);
            thread::spawn(move || {
                let mut take = Box::pin(room.take());
                let got = take.as_mut().poll(&mut Context::from_waker(Waker::noop()));
                drop(take);
                if got == Poll::Ready(true) {
                    room.give_back();
                }
            })
        };
        room.give_back();
        waiter.join().unwrap();
        assert_eq!(room.free(), 1, "the slot was lost");
        assert_eq!(room.try_take(), Take::Taken, "nobody is left waiting");
    });
}

/// An ordered subscription attached to a log of 4, whose handler records
/// what it ran and fails the model if two of its calls overlap.
#[allow(clippy::type_complexity)]
fn watched_ordered_sink() -> (
    Arc<crate::registry::ordered_log::OrderedLog<u32>>,
    Arc<crate::sync::Mutex<Vec<u32>>>,
    Arc<impl crate::registry::entry::Sink<u32>>,
) {
    use crate::dispatch::OrderedSink;
    use crate::registry::ordered_log::OrderedLog;
    use crate::sync::{AtomicBool, Mutex, Ordering};

    let log = Arc::new(OrderedLog::<u32>::new(4));
    let seen = Arc::new(Mutex::new(Vec::new()));
    let inside = Arc::new(AtomicBool::new(false));
    let sink = {
        let (seen, inside) = (Arc::clone(&seen), Arc::clone(&inside));
        Arc::new(OrderedSink::new(
            move |m: &Message<u32>| {
                assert!(!inside.swap(true, Ordering::SeqCst), "calls overlapped");
                seen.lock().unwrap().push(*m.data());
                inside.store(false, Ordering::SeqCst);
            },
            1,
        ))
    };
    sink.attach(
        Arc::clone(&log),
        Arc::new(crate::registry::quiesce::Quiescence::new()),
    );
    (log, seen, sink)
}

/// Two publishers each append a message to an ordered log and deliver it
/// to the same ordered subscription at once: the handler runs each message
/// exactly once, in log order, never two calls at a time, and the two
/// deliveries' outcomes add up to both calls (whichever became the runner).
#[test]
fn loom_ordered_sink_runs_each_message_once_in_order() {
    use crate::registry::entry::{Settled, Sink};
    use crate::registry::ordered_log::OrderedLog;

    model(|| {
        let (log, seen, sink) = watched_ordered_sink();
        fn publish(value: u32, sink: &impl Sink<u32>, log: &OrderedLog<u32>) -> (u64, u32) {
            let message = Arc::new(Message::new("t", value));
            let position = log.append(&message);
            let mut settled = Settled::default();
            assert!(sink.deliver_at(&message, position, &mut settled).is_none());
            // A delivery that did not settle itself ran its one message.
            let ran = if settled.deliveries == 0 {
                1
            } else {
                settled.delivered as u32
            };
            (position, ran)
        }
        let other = {
            let (sink, log) = (Arc::clone(&sink), Arc::clone(&log));
            thread::spawn(move || publish(1, &*sink, &log))
        };
        let (mine, ran_here) = publish(0, &*sink, &log);
        let (theirs, ran_there) = other.join().unwrap();
        assert_eq!(ran_here + ran_there, 2, "each message ran once");
        // In log order: the value published at position 0 first.
        let expected = if mine < theirs {
            vec![0, 1]
        } else {
            vec![1, 0]
        };
        assert_eq!(*seen.lock().unwrap(), expected);
    });
}

/// Three messages sit in an ordered log; the deliveries of the first and
/// the last run at once with the refusal of the middle one (its job could
/// not be queued). The two delivered messages run exactly once, in order;
/// the refused one runs (its refusal found a runner at work) or is counted
/// dropped, never both; and the outcomes add up to the calls made. The
/// refusal must not take the first message with it, nor count the middle
/// one dropped once a runner has read it from the log (that runner runs
/// it), nor call the handler itself.
#[test]
fn loom_an_ordered_refusal_drops_only_its_own_message() {
    use crate::registry::entry::{Outcome, Settled, Sink};

    model(|| {
        let (log, seen, sink) = watched_ordered_sink();
        let messages: Vec<_> = (0..3).map(|v| Arc::new(Message::new("t", v))).collect();
        for message in &messages {
            log.append(message);
        }
        fn deliver<S: Sink<u32> + 'static>(
            sink: &Arc<S>,
            message: &Arc<Message<u32>>,
            position: u64,
        ) -> thread::JoinHandle<(u64, u64)> {
            let (sink, message) = (Arc::clone(sink), Arc::clone(message));
            thread::spawn(move || {
                let mut settled = Settled::default();
                assert!(sink.deliver_at(&message, position, &mut settled).is_none());
                if settled.deliveries == 0 {
                    (1, 0)
                } else {
                    (settled.delivered, settled.dropped)
                }
            })
        }
        let first = deliver(&sink, &messages[0], 0);
        let last = deliver(&sink, &messages[2], 2);
        let refused: Outcome = sink.discard_at(&messages[1], 1).expect("settled");
        assert_eq!(
            (refused.delivered, refused.panics),
            (0, 0),
            "the refusal made a call"
        );
        let (first, last) = (first.join().unwrap(), last.join().unwrap());
        let delivered = first.0 + last.0 + u64::from(refused.delivered);
        let dropped = first.1 + last.1 + u64::from(refused.dropped);
        let seen = seen.lock().unwrap().clone();
        assert_eq!(
            delivered + dropped,
            3,
            "each message counted once: {seen:?}"
        );
        assert_eq!(delivered, seen.len() as u64, "{seen:?}");
        let expected: &[u32] = if dropped == 1 { &[0, 2] } else { &[0, 1, 2] };
        assert_eq!(seen, expected);
    });
}

/// A worker's batch of two messages and another publisher's single
/// delivery reach the same ordered subscription at once: each message runs
/// exactly once, in log order, never two calls at a time.
#[test]
fn loom_ordered_batch_and_single_delivery_run_each_message_once_in_order() {
    use crate::registry::entry::{Settled, Sink};

    model(|| {
        let (log, seen, sink) = watched_ordered_sink();
        let other = {
            let (sink, log) = (Arc::clone(&sink), Arc::clone(&log));
            thread::spawn(move || {
                let message = Arc::new(Message::new("t", 2));
                let position = log.append(&message);
                let mut settled = Settled::default();
                assert!(sink.deliver_at(&message, position, &mut settled).is_none());
                let ran = if settled.deliveries == 0 {
                    1
                } else {
                    settled.delivered
                };
                (position, ran)
            })
        };
        let messages: Vec<_> = (0..2).map(|v| Arc::new(Message::new("t", v))).collect();
        let positions: Vec<_> = messages.iter().map(|m| log.append(m)).collect();
        let batch: Vec<_> = messages.iter().zip(positions.iter().copied()).collect();
        let mut settled = Settled::default();
        assert!(sink.deliver_batch(&batch, &mut settled));
        assert_eq!(settled.deliveries, 2);
        let (theirs, ran_there) = other.join().unwrap();
        assert_eq!(settled.delivered + ran_there, 3, "each message ran once");
        let mut expected = vec![0, 1];
        expected.insert(theirs as usize, 2);
        assert_eq!(*seen.lock().unwrap(), expected, "in log order");
    });
}

/// The lane models' bus: `TaskPerSubscriber` under `Overflow::Wait`, one
/// runner per publish (whoever serves a publish runs it whole).
fn lane_config() -> Config {
    Config {
        delivery: DeliveryMode::TaskPerSubscriber,
        workers: 1,
        overflow: Overflow::Wait,
        ..Config::default()
    }
}

/// Subscribes a handler per `(id, filter)` to `trie`, each counting its
/// calls in the counter returned.
fn counting_handlers(trie: &Trie<u32>, subscriptions: &[(u64, &str)]) -> Arc<StdAtomicUsize> {
    let calls = Arc::new(StdAtomicUsize::new(0));
    for &(id, filter) in subscriptions {
        let counted = Arc::clone(&calls);
        let entry: HandlerEntry<u32> = Subscriber::new(SyncSink(move |_: &Message<u32>| {
            counted.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        }))
        .into_handler();
        insert(trie, filter, (id, entry));
    }
    calls
}

/// Once every server has gone: nothing queued, no room held, no task.
fn assert_lane_settled(lane: &Lane<u32>) {
    assert!(lane.stuck_look().is_none(), "publishes left queued");
    assert_eq!(lane.room_used(), 0, "room left held");
    assert!(!lane.has_task(), "a task left marked alive");
}

/// A runner for the lane model: sync handlers only, nobody to enlist.
struct LaneModelRunner;

impl crate::dispatch::Runner<u32> for LaneModelRunner {
    fn has_idle_capacity(&self) -> bool {
        false
    }

    fn offer_helper(&mut self, _job: &Fanout<u32>) -> bool {
        false
    }

    fn pending(
        &mut self,
        _delivery: crate::registry::entry::BoxFuture,
        _tally: &mut Tally,
    ) -> bool {
        unreachable!("the lane model's handlers are sync");
    }
}

/// Serves `lane` as `server` while more than `until` publishes are queued
/// (`tasks.rs`: `LaneTask::serve` for the lane's task, `Tasks::serve` for
/// a publisher); returns whether the caller must start the lane's task.
fn serve_lane(lane: &Lane<u32>, server: Server, until: usize, env: &Env) -> bool {
    let mut finished = 0;
    loop {
        match lane.next(server, until, finished) {
            Next::Work(work) => {
                let mut tally = Tally::default();
                work.run(env, &mut LaneModelRunner, &mut tally);
                env.counters.add(&tally);
                finished = work.publishes();
            }
            Next::Left { start_task } => return start_task,
        }
    }
}

/// The lane's task, a loom thread of its own.
fn spawn_lane_task(lane: &Arc<Lane<u32>>, env: &Arc<Env>) -> thread::JoinHandle<()> {
    let (lane, env) = (Arc::clone(lane), Arc::clone(env));
    thread::spawn(move || run_lane_task(&lane, &env))
}

/// Queues `job` in `lane` as `Tasks::queue` does under `Overflow::Wait`
/// (not closing, not inside a handler): a full lane is served by the
/// publisher when nobody serves it or its server has stalled, else waited
/// on. `start_task` starts the lane's task when the lane asks for one.
fn queue_in_lane(
    lane: &Lane<u32>,
    job: &Arc<Fanout<u32>>,
    env: &Env,
    start_task: &mut dyn FnMut(),
) {
    loop {
        match lane.push(job, false) {
            Pushed::Queued {
                start_task: start, ..
            } => {
                if start {
                    start_task();
                }
                return;
            }
            Pushed::Full { serving, started } => {
                if serving == 0 || !lane.wait_for_room(started, STALL) {
                    lane.other_begins();
                    if serve_lane(lane, Server::Other, lane.capacity() / 2, env) {
                        start_task();
                    }
                }
            }
        }
    }
}

/// The lane's task body (`LaneTask::serve` without its yields).
fn run_lane_task(lane: &Lane<u32>, env: &Env) {
    if lane.task_begins() {
        let start_task = serve_lane(lane, Server::Task, 0, env);
        assert!(!start_task, "the lane's task never starts another");
    }
}

/// Three publishes (to two topics in turn) through a lane with room for
/// two, under `Overflow::Wait`, as `Tasks::queue` makes them.
/// Whatever the interleaving: each handler runs once per publish, the
/// publisher waiting for room is woken (loom's `wait_timeout` never times
/// out, so a wait that only the 1 ms stall could end is a deadlock here),
/// and the lane ends empty, with no task and no room held.
#[test]
fn loom_a_lane_runs_every_publish_once_whoever_serves() {
    model(|| {
        let config = lane_config();
        let env = model_env(&config);
        let trie = Trie::<u32>::new();
        // Two subscriptions on "t", one on "u": publishes alternate between
        // them, so no take batches two (each serve leaves work behind).
        let calls = counting_handlers(&trie, &[(0, "t"), (1, "t"), (2, "u")]);
        let lane = Arc::new(Lane::<u32>::new(2));
        let mut tasks = Vec::new();
        for (value, topic) in [(0, "t"), (1, "u"), (2, "t")] {
            let job = Arc::new(admitted_job(&trie, &config, &env, topic, value));
            queue_in_lane(&lane, &job, &env, &mut || {
                tasks.push(spawn_lane_task(&lane, &env));
            });
        }
        for task in tasks {
            task.join().unwrap();
        }
        assert_eq!(calls.load(std::sync::atomic::Ordering::Relaxed), 5);
        assert_lane_settled(&lane);
        let stats = env.counters.snapshot();
        assert_eq!((stats.delivered, stats.inflight), (5, 0));
    });
}

/// Two publishers, two publishes each, through a lane with room for one:
/// a publisher that finds the lane full while its task serves waits, and
/// is woken whatever the interleaving (by the take that leaves room or by
/// the server leaving: either alone suffices here, and without both loom
/// finds the waiter asleep for good); every publish runs once and the lane
/// ends empty. The lane's tasks run one after another on one thread, as on a
/// runtime with one free worker (a thread per task would pass loom's
/// thread limit).
#[test]
fn loom_two_publishers_share_a_lane() {
    model_bounded(2, || {
        let config = lane_config();
        let env = model_env(&config);
        let trie = Arc::new(Trie::<u32>::new());
        let calls = counting_handlers(&trie, &[(0, "t"), (1, "u")]);
        let lane = Arc::new(Lane::<u32>::new(1));
        // The runtime: runs each lane task it is handed; `None` stops it.
        let (spawn, spawned) = loom::sync::mpsc::channel::<Option<()>>();
        let runtime = {
            let (lane, env) = (Arc::clone(&lane), Arc::clone(&env));
            thread::spawn(move || {
                while let Ok(Some(())) = spawned.recv() {
                    run_lane_task(&lane, &env);
                }
            })
        };
        let other = {
            let (lane, env, trie) = (Arc::clone(&lane), Arc::clone(&env), Arc::clone(&trie));
            let (config, spawn) = (config.clone(), spawn.clone());
            thread::spawn(move || {
                for value in 0..2 {
                    let job = Arc::new(admitted_job(&trie, &config, &env, "u", value));
                    queue_in_lane(&lane, &job, &env, &mut || spawn.send(Some(())).unwrap());
                }
            })
        };
        for value in 0..2 {
            let job = Arc::new(admitted_job(&trie, &config, &env, "t", value));
            queue_in_lane(&lane, &job, &env, &mut || spawn.send(Some(())).unwrap());
        }
        other.join().unwrap();
        spawn.send(None).unwrap();
        runtime.join().unwrap();
        assert_eq!(calls.load(std::sync::atomic::Ordering::Relaxed), 4);
        assert_lane_settled(&lane);
    });
}

/// The lanes' watcher finds its lane empty and disarms while a publisher
/// queues a publish and arms it; then it sleeps until armed and looks
/// again. Whatever the interleaving, it is woken (a publisher's arm that
/// found it still armed is covered by the watcher's second look before it
/// sleeps; without that look, or without the arm's notify, loom finds it
/// asleep for good), and it ends armed, with the publish still queued: the
/// lane's task never runs here, so only the watcher can get it served.
#[test]
fn loom_the_lane_watch_never_sleeps_on_queued_work() {
    model(|| {
        let config = lane_config();
        let env = model_env(&config);
        let trie = Trie::<u32>::new();
        let _calls = counting_handlers(&trie, &[(0, "t")]);
        let lane = Arc::new(Lane::<u32>::new(2));
        let watch = Arc::new(LaneWatch::new(vec![Arc::clone(&lane)]));
        // Armed by an earlier publish, since served.
        watch.arm();
        let watcher = {
            let watch = Arc::clone(&watch);
            thread::spawn(move || {
                let mut seen = watch.seen();
                let mut stuck = 0;
                watch.look_and_settle(&mut seen, &mut |_| stuck += 1);
                assert!(watch.wait_armed(), "the watch never stops here");
                watch.look_and_settle(&mut seen, &mut |_| stuck += 1);
                stuck
            })
        };
        let job = Arc::new(admitted_job(&trie, &config, &env, "t", 0));
        // The lane's task is left unstarted: a task stuck in tokio's LIFO
        // slot, or behind a slow handler.
        assert!(matches!(lane.push(&job, false), Pushed::Queued { .. }));
        watch.arm();
        let stuck = watcher.join().unwrap();
        assert!(lane.stuck_look().is_some(), "the publish is still queued");
        assert!(watch.is_armed(), "the watcher sleeps on a queued publish");
        // Seen at two looks in a row with nothing taken: found stuck.
        assert!(stuck <= 1);
    });
}

/// Two runners deliver to one subscription while it is deactivated and the
/// deactivating thread waits for a grace period (`registry/quiesce.rs`, as
/// `unsubscribe_and_wait` does). Whatever the interleaving, a runner that
/// finds the subscription active is still inside its handler's bracket
/// until the wait is over: the handler never runs, nor is running, once
/// the wait has returned. Each of these makes loom find a handler running
/// after the wait (all tried): no fence after a runner counts itself in, a
/// drain that does not wait, no drain of the old parity after the epoch
/// flip, no fence in the wait. Without the loom build's fence in
/// `Presence::drop`, the waiter sleeps for good (see there why a real
/// build has none).
#[test]
fn loom_a_grace_period_outlasts_every_runner_that_saw_the_subscription() {
    use crate::registry::quiesce::Quiescence;
    use crate::sync::{AtomicBool, AtomicUsize, Ordering};

    model(|| {
        let quiescence = Arc::new(Quiescence::new());
        let entry = Subscriber::<u32, ()>::new(());
        // Set once the wait has returned; handlers check it as they end.
        let waited = Arc::new(AtomicBool::new(false));
        let ran = Arc::new(AtomicUsize::new(0));
        let runners: Vec<_> = (0..2)
            .map(|_| {
                let (quiescence, entry) = (Arc::clone(&quiescence), entry.clone());
                let (waited, ran) = (Arc::clone(&waited), Arc::clone(&ran));
                thread::spawn(move || {
                    let _present = quiescence.enter();
                    if entry.is_active() {
                        // The handler: it must end before the wait does.
                        ran.fetch_add(1, Ordering::SeqCst);
                        assert!(
                            !waited.load(Ordering::SeqCst),
                            "a handler ran on after the grace period"
                        );
                    }
                })
            })
            .collect();
        assert!(entry.deactivate());
        loom::future::block_on(quiescence.wait_for_readers());
        waited.store(true, Ordering::SeqCst);
        let ran_before = ran.load(Ordering::SeqCst);
        for runner in runners {
            runner.join().unwrap();
        }
        assert_eq!(
            ran.load(Ordering::SeqCst),
            ran_before,
            "a handler started after the grace period"
        );
    });
}

/// A runner renews its presence between calls (as a sync ordered handler's
/// runner does between catch-up rounds, `Quiescence::renew_if_outermost`)
/// while the subscription is deactivated and the deactivating thread waits
/// for a grace period, then waits once more after the runner has left. The
/// runner's first call publishes, and that publish's runner, nested in the
/// call, asks to renew too. Whatever the interleaving, no call runs after
/// the first wait has returned, and the second wait ends (the renewed
/// presence leaves from the parity it was moved to). It fails when a
/// nested presence is renewed as well (the outer call then runs on after
/// the wait), and when a renewed presence leaves from the parity it
/// entered with (the second wait never ends); both tried.
#[test]
fn loom_a_renewed_presence_still_outlasts_the_calls_after_it() {
    use crate::registry::quiesce::Quiescence;
    use crate::sync::{AtomicBool, Ordering};

    model(|| {
        let quiescence = Arc::new(Quiescence::new());
        let entry = Subscriber::<u32, ()>::new(());
        let waited = Arc::new(AtomicBool::new(false));
        let runner = {
            let (quiescence, entry) = (Arc::clone(&quiescence), entry.clone());
            let waited = Arc::clone(&waited);
            thread::spawn(move || {
                let _present = quiescence.enter();
                if entry.is_active() {
                    // The call publishes: a runner nested in it.
                    {
                        let _nested = quiescence.enter();
                        quiescence.renew_if_outermost();
                    }
                    assert!(
                        !waited.load(Ordering::SeqCst),
                        "a call ran on after the grace period"
                    );
                }
                // Between rounds.
                quiescence.renew_if_outermost();
                if entry.is_active() {
                    assert!(
                        !waited.load(Ordering::SeqCst),
                        "a call started after the grace period"
                    );
                }
            })
        };
        assert!(entry.deactivate());
        loom::future::block_on(quiescence.wait_for_readers());
        waited.store(true, Ordering::SeqCst);
        runner.join().unwrap();
        loom::future::block_on(quiescence.wait_for_readers());
    });
}

/// A runner starts an async handler's delivery while the subscription is
/// deactivated and the deactivating thread waits as `unsubscribe_and_wait`
/// does: the grace period, then the subscription's unfinished deliveries
/// (`Running`). The runner starts the delivery inside its bracket and
/// polls it to its end after leaving, as a task continuing it would.
/// Whatever the interleaving, the delivery's body never runs after the
/// wait has returned. It fails when the wait for unfinished deliveries
/// returns at once, and when a delivery is counted at its first poll
/// instead of when it starts (both tried).
#[test]
fn loom_unsubscribe_and_wait_outlasts_an_async_delivery() {
    use crate::registry::quiesce::{Quiescence, Running};
    use crate::sync::{AtomicBool, Ordering};

    model(|| {
        let quiescence = Arc::new(Quiescence::new());
        let running = Arc::new(Running::new(quiescence.id()));
        let entry = Subscriber::<u32, ()>::new(());
        let waited = Arc::new(AtomicBool::new(false));
        let runner = {
            let (quiescence, running) = (Arc::clone(&quiescence), Arc::clone(&running));
            let (entry, waited) = (entry.clone(), Arc::clone(&waited));
            thread::spawn(move || {
                let delivery = {
                    let _present = quiescence.enter();
                    entry.is_active().then(|| {
                        running.track(async move {
                            assert!(
                                !waited.load(Ordering::SeqCst),
                                "an async delivery ran after the wait returned"
                            );
                        })
                    })
                };
                if let Some(delivery) = delivery {
                    loom::future::block_on(delivery);
                }
            })
        };
        assert!(entry.deactivate());
        loom::future::block_on(async {
            quiescence.wait_for_readers().await;
            running.wait_idle().await;
        });
        waited.store(true, Ordering::SeqCst);
        runner.join().unwrap();
    });
}

/// What a handler owned: a value the user thread writes before it lets go
/// of its pointer, read when the entry is dropped; and a count of drops.
struct Owned {
    written: crate::sync::UnsafeCell<u32>,
    drops: Arc<crate::sync::AtomicUsize>,
}

// SAFETY: the one write (the user thread's, before it drops its pointer)
// and the read in `drop` (after the last pointer is gone) are ordered by
// `Counted`'s release and acquire, which is what the model checks; loom's
// cell reports them as a race otherwise.
#[allow(unsafe_code)]
unsafe impl Sync for Owned {}

impl Drop for Owned {
    fn drop(&mut self) {
        // SAFETY: see the `Sync` impl above.
        #[allow(unsafe_code)]
        let value = self.written.with(|value| unsafe { *value });
        assert_eq!(value, 7, "the drop ran before the user's write");
        self.drops.fetch_add(1, crate::sync::Ordering::SeqCst);
    }
}

/// Two threads each let go of their pointers to one handler entry, one of
/// them after writing what the entry owns and clearing its flag, the other
/// after cloning its pointer: the entry is dropped exactly once, after the
/// write, by whichever lets go last, and the flag stays cleared whatever
/// the count does meanwhile.
#[test]
fn loom_the_last_counted_pointer_drops_the_entry_after_every_use() {
    use crate::sync::{AtomicUsize, Ordering, UnsafeCell};

    model(|| {
        let drops = Arc::new(AtomicUsize::new(0));
        let entry = Subscriber::<u32, Owned>::new(Owned {
            written: UnsafeCell::new(0),
            drops: Arc::clone(&drops),
        });
        let users = entry.clone();
        let user = thread::spawn(move || {
            // SAFETY: the only write, before this pointer goes (see `Owned`).
            #[allow(unsafe_code)]
            users.sink.written.with_mut(|value| unsafe { *value = 7 });
            assert!(users.deactivate());
            thread::yield_now();
            assert!(!users.is_active(), "the cleared flag was lost");
            drop(users);
        });
        // Clones and drops racing the user's: whichever pointer goes last
        // drops the entry.
        let kept = entry.clone();
        drop(entry);
        drop(kept);
        user.join().unwrap();
        assert_eq!(drops.load(Ordering::SeqCst), 1);
    });
}
