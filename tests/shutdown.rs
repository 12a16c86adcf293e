//! Accounting at the edges of a process's life (runtime shutdown, the last
//! bus handle dropped without `close`, `close` racing publishes,
//! `close_timeout` expiring). Every step that could hang runs under a time
//! limit and fails instead. (From the thirtieth session's review; the
//! async ordered drain's discard leaving a message without a drain was the
//! one defect it found.)

mod common;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use blazesub::{Bus, DeliveryMode, Error, Message, Receiver, Stats, StreamOptions, StreamOverflow};
use common::{runtime, wait_until, within, Gate, MODES};

const LIMIT: Duration = Duration::from_secs(20);

/// Tests that count this process's threads must not overlap.
static SERIAL: Mutex<()> = Mutex::new(());

fn serial() -> MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|e| e.into_inner())
}

/// Threads of this process whose name starts with `prefix` (Linux keeps
/// 15 bytes of a name).
fn threads(prefix: &str) -> usize {
    let Ok(tasks) = std::fs::read_dir("/proc/self/task") else {
        return 0;
    };
    tasks
        .filter_map(Result::ok)
        .filter_map(|task| std::fs::read_to_string(task.path().join("comm")).ok())
        .filter(|name| name.trim_end().starts_with(prefix))
        .count()
}

/// The count of `prefix` threads to compare against at the end of a test:
/// it first gives threads a previous test's buses left to end time to end,
/// since a thread that ended after this count was taken would hide one of
/// this test's that did not.
fn baseline(prefix: &str) -> usize {
    wait_until(Duration::from_secs(5), || threads(prefix) == 0);
    threads(prefix)
}

/// Whether no more `prefix` threads run than `before`.
fn ended_down_to(prefix: &str, before: usize) -> bool {
    wait_until(LIMIT, || threads(prefix) <= before)
}

/// How many more `prefix` threads run than `before`, for a failure message.
fn left(prefix: &str, before: usize) -> usize {
    threads(prefix).saturating_sub(before)
}

/// `delivered + dropped + handler_panics`.
fn ended(stats: &Stats) -> u64 {
    stats.delivered + stats.dropped + stats.handler_panics
}

fn drain(rx: &mut Receiver<u32>) -> u64 {
    let mut n = 0;
    while rx.try_recv().is_ok() {
        n += 1;
    }
    n
}

#[derive(Clone, Copy)]
enum Shutdown {
    Background,
    Timeout,
    Drop,
}

fn shut(rt: tokio::runtime::Runtime, how: &Shutdown) {
    match how {
        Shutdown::Background => rt.shutdown_background(),
        Shutdown::Timeout => rt.shutdown_timeout(Duration::from_millis(50)),
        Shutdown::Drop => drop(rt),
    }
}

/// Every handler kind on one topic; the async ones never finish. The
/// runtime is shut down with deliveries queued, running and pending: every
/// accepted delivery must end counted, and `inflight` return to 0.
#[test]
fn runtime_shutdown_balances_every_handler_kind() {
    let _serial = serial();
    for how in [Shutdown::Background, Shutdown::Timeout, Shutdown::Drop] {
        for mode in MODES {
            let what = format!("{mode:?} {}", how as u8);
            let rt = runtime(2);
            let bus = Bus::<u32>::builder()
                .delivery(mode)
                .workers(2)
                .runtime(rt.handle().clone())
                .close_timeout(Duration::from_secs(30))
                .build()
                .unwrap();
            let gate = Arc::new(Gate::new());
            let entered = Arc::new(common::Countdown::new());
            let mut subs = Vec::new();
            {
                let (gate, entered) = (Arc::clone(&gate), Arc::clone(&entered));
                subs.push(
                    bus.subscribe("t", move |m: &Message<u32>| {
                        entered.arrive();
                        if *m.data() == 0 {
                            gate.wait();
                        }
                    })
                    .unwrap(),
                );
            }
            subs.push(
                bus.subscribe_async("t", |_m: Arc<Message<u32>>| async {
                    std::future::pending::<()>().await;
                })
                .unwrap(),
            );
            subs.push(bus.subscribe_ordered("t", |_m: &Message<u32>| {}).unwrap());
            subs.push(
                bus.subscribe_ordered_async("t", |_m: Arc<Message<u32>>| async {
                    std::future::pending::<()>().await;
                })
                .unwrap(),
            );
            subs.push(bus.subscribe("$share/g/t", |_m: &Message<u32>| {}).unwrap());
            subs.push(
                bus.subscribe_async("$share/g/t", |_m: Arc<Message<u32>>| async {
                    std::future::pending::<()>().await;
                })
                .unwrap(),
            );
            let mut streams: Vec<Receiver<u32>> = [
                StreamOverflow::DropOldest,
                StreamOverflow::DropNewest,
                StreamOverflow::Disconnect,
            ]
            .into_iter()
            .map(|o| {
                bus.subscribe_stream_with("t", StreamOptions::new(4).overflow(o))
                    .unwrap()
            })
            .collect();
            streams.push(
                bus.subscribe_stream_with(
                    "t",
                    StreamOptions::new(64).overflow(StreamOverflow::Backpressure),
                )
                .unwrap(),
            );
            let publisher = bus.clone();
            let (done_tx, done_rx) = std::sync::mpsc::channel();
            std::thread::spawn(move || {
                let mut sum = 0;
                for value in 0..10 {
                    sum += publisher.publish("t", value).unwrap() as u64;
                }
                let _ = done_tx.send(sum);
            });
            assert!(entered.wait_for(1, LIMIT), "{what}: the sync handler ran");
            let early = if mode == DeliveryMode::Inline {
                None
            } else {
                Some(done_rx.recv_timeout(LIMIT).expect("publishing hangs"))
            };
            // Dropping a runtime waits for its threads: the gate opens from
            // elsewhere meanwhile.
            let opener = {
                let gate = Arc::clone(&gate);
                std::thread::spawn(move || {
                    std::thread::sleep(Duration::from_millis(100));
                    gate.open();
                })
            };
            shut(rt, &how);
            opener.join().unwrap();
            let accepted =
                early.unwrap_or_else(|| done_rx.recv_timeout(LIMIT).expect("publishing hangs"));
            let mut read = 0;
            for rx in &mut streams {
                read += drain(rx);
            }
            let _ = read;
            assert!(
                wait_until(LIMIT, || bus.inflight_messages() == 0),
                "{what}: deliveries stuck in flight after the runtime shut down: {:?}",
                bus.stats()
            );
            let stats = bus.stats();
            assert_eq!(
                ended(&stats),
                accepted,
                "{what}: accepted {accepted}, ended {}: {stats:?}",
                ended(&stats)
            );
            drop(subs);
            drop(streams);
            drop(bus);
        }
    }
}

/// `max_inflight_tasks` 2: two async deliveries that never finish hold the
/// slots. The runtime shuts down: both are counted, and no task is left.
/// (A publish past the cap would block its publisher, outside any runtime,
/// until the delivery it finishes itself ends: never, here.)
#[test]
fn deliveries_holding_task_slots_are_counted_when_the_runtime_shuts_down() {
    let _serial = serial();
    for how in [Shutdown::Background, Shutdown::Timeout, Shutdown::Drop] {
        for mode in [DeliveryMode::Inline, DeliveryMode::TaskPerSubscriber] {
            let what = format!("{mode:?} {}", how as u8);
            let rt = runtime(2);
            let bus = Bus::<u32>::builder()
                .delivery(mode)
                .workers(1)
                .max_inflight_tasks(2)
                .runtime(rt.handle().clone())
                .build()
                .unwrap();
            let polled = Arc::new(AtomicU64::new(0));
            let sub = {
                let polled = Arc::clone(&polled);
                bus.subscribe_async("t", move |_m: Arc<Message<u32>>| {
                    polled.fetch_add(1, Ordering::SeqCst);
                    async {
                        std::future::pending::<()>().await;
                    }
                })
                .unwrap()
            };
            let publisher = bus.clone();
            let accepted = within(LIMIT, &what, move || {
                (0..2)
                    .map(|v| publisher.publish("t", v).unwrap() as u64)
                    .sum::<u64>()
            });
            // In a lane, the lane's task awaits what the cap keeps from a task of
            // its own, and the publishes queued behind wait for it.
            let expected = if mode == DeliveryMode::Inline { 2 } else { 1 };
            assert!(
                wait_until(LIMIT, || polled.load(Ordering::SeqCst) >= expected),
                "{what}: polled {}",
                polled.load(Ordering::SeqCst)
            );
            std::thread::sleep(Duration::from_millis(20));
            shut(rt, &how);
            assert!(
                wait_until(LIMIT, || bus.inflight_messages() == 0),
                "{what}: deliveries stuck in flight: {:?}",
                bus.stats()
            );
            let stats = bus.stats();
            assert_eq!(ended(&stats), accepted, "{what}: {stats:?}");
            assert_eq!(bus.footprint().live_tasks, 0, "{what}");
            drop(sub);
        }
    }
}

/// The last `Bus` handle dropped without `close`, with handles still alive
/// or not, work in flight or not: the pool's workers stop, and receivers
/// end.
#[test]
fn dropping_the_last_bus_stops_the_workers_and_ends_receivers() {
    let _serial = serial();
    let before = baseline("blazesub-worke");
    for keep_handles in [false, true] {
        for in_flight in [false, true] {
            let what = format!("keep_handles {keep_handles}, in_flight {in_flight}");
            let bus = Bus::<u32>::builder()
                .delivery(DeliveryMode::WorkerPool)
                .workers(2)
                .build()
                .unwrap();
            assert!(wait_until(LIMIT, || threads("blazesub-worke") == before + 2));
            let gate = Arc::new(Gate::new());
            let entered = Arc::new(common::Countdown::new());
            let ran = Arc::new(AtomicU64::new(0));
            let sub = {
                let (gate, entered, ran) =
                    (Arc::clone(&gate), Arc::clone(&entered), Arc::clone(&ran));
                bus.subscribe("t", move |m: &Message<u32>| {
                    entered.arrive();
                    if *m.data() == 0 {
                        gate.wait();
                    }
                    ran.fetch_add(1, Ordering::SeqCst);
                })
                .unwrap()
            };
            let ordered = bus.subscribe_ordered("t", |_m: &Message<u32>| {}).unwrap();
            let mut rx = bus.subscribe_stream("t").unwrap();
            let n = if in_flight { 5 } else { 0 };
            for v in 0..n {
                bus.publish("t", v).unwrap();
            }
            if in_flight {
                assert!(entered.wait_for(1, LIMIT), "{what}");
            } else {
                gate.open();
            }
            let kept = if keep_handles {
                Some((sub, ordered))
            } else {
                drop((sub, ordered));
                None
            };
            drop(bus);
            gate.open();
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap();
            let got = rt.block_on(async {
                let mut got = 0;
                while let Ok(Some(_)) = tokio::time::timeout(LIMIT, rx.recv()).await {
                    got += 1;
                }
                got
            });
            assert_eq!(
                got, n,
                "{what}: the receiver did not end after the bus was dropped"
            );
            if in_flight && keep_handles {
                assert!(
                    wait_until(LIMIT, || ran.load(Ordering::SeqCst) == 5),
                    "{what}"
                );
            }
            assert!(
                ended_down_to("blazesub-worke", before),
                "{what}: {} pool workers still running after the last Bus was dropped",
                left("blazesub-worke", before)
            );
            drop(kept);
        }
    }
}

/// `TaskPerSubscriber` and request threads end with the bus.
#[test]
fn dropping_the_last_bus_stops_its_other_threads() {
    let _serial = serial();
    let lanes = baseline("blazesub-lanes");
    let deadlines = baseline("blazesub-deadli");
    let rt = runtime(2);
    for close in [false, true] {
        let bus = Bus::<u32>::builder()
            .delivery(DeliveryMode::TaskPerSubscriber)
            .workers(2)
            .runtime(rt.handle().clone())
            .build()
            .unwrap();
        let responder = bus.clone();
        let sub = bus
            .subscribe("rpc", move |m: &Message<u32>| {
                let _ = responder.reply(m, *m.data() + 1);
            })
            .unwrap();
        let answer = rt
            .block_on(bus.request("rpc", 1, Duration::from_secs(5)))
            .unwrap();
        assert_eq!(*answer.data(), 2);
        if close {
            rt.block_on(bus.close()).unwrap();
        }
        drop(sub);
        drop(bus);
        assert!(
            ended_down_to("blazesub-lanes", lanes) && ended_down_to("blazesub-deadli", deadlines),
            "close {close}: threads left: {} lane watchers, {} deadline timers",
            left("blazesub-lanes", lanes),
            left("blazesub-deadli", deadlines)
        );
    }
}

/// `close` racing publishes from other threads: what a publish accepted is
/// finished by the time `close` returns, and every delivery is counted.
#[test]
fn close_racing_publishes_counts_every_accepted_delivery() {
    let _serial = serial();
    let rt = runtime(2);
    for mode in MODES {
        for round in 0..30 {
            let what = format!("{mode:?} round {round}");
            let bus = Bus::<u32>::builder()
                .delivery(mode)
                .workers(2)
                .runtime(rt.handle().clone())
                .build()
                .unwrap();
            let handled = Arc::new(AtomicU64::new(0));
            let mut subs = Vec::new();
            for _ in 0..3 {
                let handled = Arc::clone(&handled);
                subs.push(
                    bus.subscribe("t/+", move |_m: &Message<u32>| {
                        handled.fetch_add(1, Ordering::SeqCst);
                    })
                    .unwrap(),
                );
            }
            {
                let handled = Arc::clone(&handled);
                subs.push(
                    bus.subscribe_async("t/+", move |_m: Arc<Message<u32>>| {
                        let handled = Arc::clone(&handled);
                        async move {
                            tokio::task::yield_now().await;
                            handled.fetch_add(1, Ordering::SeqCst);
                        }
                    })
                    .unwrap(),
                );
            }
            {
                let handled = Arc::clone(&handled);
                subs.push(
                    bus.subscribe_ordered("t/+", move |_m: &Message<u32>| {
                        handled.fetch_add(1, Ordering::SeqCst);
                    })
                    .unwrap(),
                );
            }
            {
                let handled = Arc::clone(&handled);
                subs.push(
                    bus.subscribe_ordered_async("t/+", move |_m: Arc<Message<u32>>| {
                        let handled = Arc::clone(&handled);
                        async move {
                            tokio::task::yield_now().await;
                            handled.fetch_add(1, Ordering::SeqCst);
                        }
                    })
                    .unwrap(),
                );
            }
            {
                let handled = Arc::clone(&handled);
                subs.push(
                    bus.subscribe("$share/g/t/+", move |_m: &Message<u32>| {
                        handled.fetch_add(1, Ordering::SeqCst);
                    })
                    .unwrap(),
                );
            }
            let publishers: Vec<_> = (0..2)
                .map(|p| {
                    let bus = bus.clone();
                    std::thread::spawn(move || {
                        let mut sum = 0u64;
                        for v in 0.. {
                            match bus.publish(&format!("t/{p}"), v) {
                                Ok(n) => sum += n as u64,
                                Err(Error::Closed) => break,
                                Err(e) => panic!("{e:?}"),
                            }
                        }
                        sum
                    })
                })
                .collect();
            std::thread::sleep(Duration::from_millis(2));
            let closed = rt.block_on(async { tokio::time::timeout(LIMIT, bus.close()).await });
            assert!(matches!(closed, Ok(Ok(()))), "{what}: close: {closed:?}");
            let inflight_at_close = bus.inflight_messages();
            let accepted: u64 = publishers.into_iter().map(|p| p.join().unwrap()).sum();
            let done = handled.load(Ordering::SeqCst);
            let stats = bus.stats();
            assert_eq!(
                inflight_at_close, 0,
                "{what}: close returned with deliveries in flight: {stats:?}"
            );
            // Ordered handlers that fall `stream_capacity` behind lose
            // messages, counted: only the sum is promised.
            assert_eq!(done, stats.delivered, "{what}: {stats:?}");
            assert_eq!(ended(&stats), accepted, "{what}: {stats:?}");
            drop(subs);
        }
    }
}

/// `close_timeout` expires while a handler of each kind is stuck; the
/// handler finishes later. Everything accepted then ends counted, the
/// streams end and the workers stop, whether or not the bus is still held.
#[test]
fn a_handler_finishing_after_close_timed_out_completes_the_close() {
    let _serial = serial();
    let before = baseline("blazesub-worke");
    let rt = runtime(2);
    for kind in 0..5 {
        for keep_bus in [true, false] {
            for mode in MODES {
                let what = format!("{mode:?} kind {kind} keep_bus {keep_bus}");
                let bus = Bus::<u32>::builder()
                    .delivery(mode)
                    .workers(2)
                    .runtime(rt.handle().clone())
                    .close_timeout(Duration::from_millis(100))
                    .build()
                    .unwrap();
                let gate = Arc::new(Gate::new());
                let (release, released) = tokio::sync::watch::channel(false);
                let entered = Arc::new(common::Countdown::new());
                let blocking = {
                    let (gate, entered) = (Arc::clone(&gate), Arc::clone(&entered));
                    move |_m: &Message<u32>| {
                        entered.arrive();
                        gate.wait();
                    }
                };
                let awaiting = {
                    let entered = Arc::clone(&entered);
                    move |_m: Arc<Message<u32>>| {
                        entered.arrive();
                        let mut released = released.clone();
                        async move {
                            let _ = released.wait_for(|r| *r).await;
                        }
                    }
                };
                let sub = match kind {
                    0 => bus.subscribe("t", blocking).unwrap(),
                    1 => bus.subscribe_async("t", awaiting).unwrap(),
                    2 => bus.subscribe_ordered("t", blocking).unwrap(),
                    3 => bus.subscribe_ordered_async("t", awaiting).unwrap(),
                    _ => bus.subscribe("$share/g/t", blocking).unwrap(),
                };
                let mut rx = bus.subscribe_stream("t").unwrap();
                let publisher = bus.clone();
                let publishing = std::thread::spawn(move || {
                    let (mut sum, mut oks) = (0u64, 0u64);
                    for v in 0..3 {
                        match publisher.publish("t", v) {
                            Ok(n) => {
                                sum += n as u64;
                                oks += 1;
                            }
                            Err(Error::Closed) => {}
                            Err(e) => panic!("{e:?}"),
                        }
                    }
                    (sum, oks)
                });
                assert!(entered.wait_for(1, LIMIT), "{what}");
                let closed = rt.block_on(async { tokio::time::timeout(LIMIT, bus.close()).await });
                assert!(
                    matches!(closed, Ok(Err(Error::CloseTimeout { .. }))),
                    "{what}: {closed:?}"
                );
                let watcher = bus.clone();
                let kept = keep_bus.then_some(bus);
                gate.open();
                let _ = release.send(true);
                let (accepted, oks) = within(LIMIT, &what, move || publishing.join().unwrap());
                if let Some(bus) = &kept {
                    assert!(
                        wait_until(LIMIT, || bus.inflight_messages() == 0),
                        "{what}: {:?}",
                        bus.stats()
                    );
                }
                let got = rt.block_on(async {
                    let mut got = 0;
                    while let Ok(Some(_)) = tokio::time::timeout(LIMIT, rx.recv()).await {
                        got += 1;
                    }
                    got
                });
                assert_eq!(got, oks, "{what}: the stream did not end");
                assert!(
                    wait_until(LIMIT, || watcher.inflight_messages() == 0),
                    "{what}: {:?}",
                    watcher.stats()
                );
                let stats = watcher.stats();
                assert_eq!(ended(&stats), accepted, "{what}: {stats:?}");
                drop(watcher);
                drop(kept);
                drop(sub);
                drop(rx);
                if mode == DeliveryMode::WorkerPool {
                    assert!(
                        ended_down_to("blazesub-worke", before),
                        "{what}: {} workers still running",
                        left("blazesub-worke", before)
                    );
                }
            }
        }
    }
}

/// After the runtime is gone, every publish to an async ordered handler
/// starts a drain the runtime drops at once, which discards the mailbox,
/// counted. Two publishers racing: a message pushed while the other's
/// discarded drain lets go of the subscription must not be left behind.
#[test]
fn async_ordered_messages_are_not_stranded_after_the_runtime_is_gone() {
    let _serial = serial();
    for mode in MODES {
        for round in 0..10 {
            let what = format!("{mode:?} round {round}");
            let rt = runtime(1);
            let bus = Bus::<u32>::builder()
                .delivery(mode)
                .workers(2)
                .runtime(rt.handle().clone())
                .build()
                .unwrap();
            let _sub = bus
                .subscribe_ordered_async("t", |_m: Arc<Message<u32>>| async {})
                .unwrap();
            drop(rt);
            let publishers: Vec<_> = (0..3)
                .map(|_| {
                    let bus = bus.clone();
                    std::thread::spawn(move || {
                        (0..20_000u32)
                            .map(|v| bus.publish("t", v).unwrap() as u64)
                            .sum::<u64>()
                    })
                })
                .collect();
            let accepted: u64 = publishers.into_iter().map(|p| p.join().unwrap()).sum();
            assert!(
                wait_until(Duration::from_secs(5), || bus.inflight_messages() == 0),
                "{what}: a message was left in the mailbox with no drain: {:?}",
                bus.stats()
            );
            assert_eq!(ended(&bus.stats()), accepted, "{what}: {:?}", bus.stats());
        }
    }
}

/// A future that, when dropped, uses the bus: publishes, subscribes and
/// unsubscribes, reads the stats.
struct UsesBusOnDrop {
    bus: Bus<u32>,
    dropped: Arc<AtomicU64>,
}

impl Drop for UsesBusOnDrop {
    fn drop(&mut self) {
        let _ = self.bus.publish("other", 0);
        if let Ok(sub) = self.bus.subscribe("other", |_m: &Message<u32>| {}) {
            drop(sub);
        }
        let _ = self.bus.stats();
        let _ = self.bus.subscriptions_count();
        self.dropped.fetch_add(1, Ordering::SeqCst);
    }
}

/// Async deliveries (running, continued, waiting for a slot, ordered) are
/// dropped by the runtime shutting down: their `Drop` may use the bus, so
/// the bus must hold no lock while it drops them.
#[test]
fn futures_dropped_at_runtime_shutdown_may_use_the_bus() {
    let _serial = serial();
    for mode in MODES {
        let what = format!("{mode:?}");
        let rt = runtime(2);
        let bus = Bus::<u32>::builder()
            .delivery(mode)
            .workers(2)
            .max_inflight_tasks(2)
            .overflow(blazesub::Overflow::Drop)
            .runtime(rt.handle().clone())
            .build()
            .unwrap();
        let dropped = Arc::new(AtomicU64::new(0));
        let make = {
            let (bus, dropped) = (bus.clone(), Arc::clone(&dropped));
            move |_m: Arc<Message<u32>>| {
                let guard = UsesBusOnDrop {
                    bus: bus.clone(),
                    dropped: Arc::clone(&dropped),
                };
                async move {
                    let _guard = guard;
                    std::future::pending::<()>().await;
                }
            }
        };
        let a = bus.subscribe_async("t", make.clone()).unwrap();
        let b = bus.subscribe_ordered_async("t", make.clone()).unwrap();
        let publisher = bus.clone();
        within(LIMIT, &what, move || {
            for v in 0..4 {
                let _ = publisher.publish("t", v);
            }
        });
        std::thread::sleep(Duration::from_millis(20));
        within(LIMIT, &format!("{what}: shutdown"), move || {
            rt.shutdown_timeout(Duration::from_secs(5))
        });
        assert!(
            wait_until(LIMIT, || bus.inflight_messages() == 0),
            "{what}: {:?}",
            bus.stats()
        );
        drop((a, b));
    }
}

/// A current-thread runtime nobody drives: its tasks never run. Dropping it
/// must still account for every delivery queued to it.
#[test]
fn an_undriven_current_thread_runtime_dropped_counts_everything() {
    let _serial = serial();
    for mode in MODES {
        for cap in [2usize, 1024] {
            let what = format!("{mode:?} cap {cap}");
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap();
            let bus = Bus::<u32>::builder()
                .delivery(mode)
                .workers(2)
                .max_inflight_tasks(cap)
                .overflow(blazesub::Overflow::Drop)
                .runtime(rt.handle().clone())
                .build()
                .unwrap();
            let mut subs = vec![
                bus.subscribe("t", |_m: &Message<u32>| {}).unwrap(),
                bus.subscribe_async("t", |_m: Arc<Message<u32>>| async {
                    tokio::task::yield_now().await;
                })
                .unwrap(),
                bus.subscribe_ordered("t", |_m: &Message<u32>| {}).unwrap(),
                bus.subscribe_ordered_async("t", |_m: Arc<Message<u32>>| async {
                    tokio::task::yield_now().await;
                })
                .unwrap(),
                bus.subscribe("$share/g/t", |_m: &Message<u32>| {}).unwrap(),
            ];
            subs.push(
                bus.subscribe_async("$share/g/t", |_m: Arc<Message<u32>>| async {
                    tokio::task::yield_now().await;
                })
                .unwrap(),
            );
            let publisher = bus.clone();
            let accepted = within(LIMIT, &what, move || {
                (0..10)
                    .map(|v| publisher.publish("t", v).unwrap_or(0) as u64)
                    .sum::<u64>()
            });
            std::thread::sleep(Duration::from_millis(20));
            drop(rt);
            assert!(
                wait_until(LIMIT, || bus.inflight_messages() == 0),
                "{what}: deliveries stuck in flight: {:?}",
                bus.stats()
            );
            let stats = bus.stats();
            assert_eq!(ended(&stats), accepted, "{what}: {stats:?}");
            drop(subs);
        }
    }
}

/// When `close()` returns `Ok`, every stream has ended: a reader finds it
/// `Closed` at once, not `Empty` for a moment, also when another thread
/// finished the last delivery (and so began ending the streams) just as
/// `close` looked. Found by the thirty-first session's random test of the
/// API: the waiters returned on seeing the work drained, while the thread
/// that drained it was still ending the streams (100–400 of 400 open).
#[test]
fn close_returns_after_every_stream_has_ended() {
    let rt = runtime(2);
    for round in 0..150u64 {
        // The handler finishes at a different moment of `close` each round.
        let spin = Duration::from_micros(round % 150);
        let bus = Bus::<u64>::builder()
            .delivery(DeliveryMode::WorkerPool)
            .workers(1)
            .build()
            .unwrap();
        let mut streams: Vec<_> = (0..300)
            .map(|_| bus.subscribe_stream("s/#").unwrap())
            .collect();
        let _slow = bus
            .subscribe("h", move |_| {
                let start = std::time::Instant::now();
                while start.elapsed() < spin {
                    std::hint::spin_loop();
                }
            })
            .unwrap();
        bus.publish("h", 1).unwrap();
        rt.block_on(async {
            tokio::time::timeout(Duration::from_secs(10), bus.close())
                .await
                .expect("close returns")
                .expect("close is Ok");
        });
        let open = streams
            .iter_mut()
            .map(|rx| matches!(rx.try_recv(), Err(blazesub::TryRecvError::Empty)))
            .filter(|&empty| empty)
            .count();
        assert_eq!(
            open, 0,
            "round {round}: {open} of 300 streams had not ended"
        );
    }
}
