//! Stream edges through the public API: a receiver dropped while publishers
//! push into it leaves nothing uncounted; loss shows in the stream itself
//! (`recv_lagged`, `try_recv_lagged`); `Receiver` is a `FusedStream`; a zero
//! capacity argument is reported as an argument, not as a config field.

mod common;

use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Barrier};
use std::time::Duration;

use blazesub::{
    Bus, Config, DeliveryMode, Error, Message, Receiver, RecvError, TryRecvError,
    TryRecvLaggedError,
};
use common::MODES;
use futures_core::{FusedStream, Stream};

const LIMIT: Duration = Duration::from_secs(10);

fn bus(mode: DeliveryMode) -> Bus<u32> {
    Bus::<u32>::builder()
        .delivery(mode)
        .workers(2)
        .build()
        .unwrap()
}

/// `recv_lagged()`, failing the test instead of hanging.
async fn lagged_soon(rx: &mut Receiver<u32>) -> Result<u32, RecvError> {
    tokio::time::timeout(LIMIT, rx.recv_lagged())
        .await
        .expect("recv_lagged() did not complete within 10 s")
        .map(|m| *m.data())
}

/// The next item through the `Stream` implementation, failing the test
/// instead of hanging.
async fn next_soon(rx: &mut Receiver<u32>) -> Option<u32> {
    let next = std::future::poll_fn(|cx| Pin::new(&mut *rx).poll_next(cx));
    tokio::time::timeout(LIMIT, next)
        .await
        .expect("poll_next did not complete within 10 s")
        .map(|m| *m.data())
}

// ---------------------------------------------------------------------------
// 1. A receiver dropped while publishers push into it.
// ---------------------------------------------------------------------------

/// Publisher threads publish without pause while other threads subscribe
/// receivers, take a little from them and drop them, over and over. A push
/// that raced a drop must still be counted: once the bus is quiet and every
/// receiver is gone, each stream delivery a `publish` reported (its return
/// value) was either taken (`delivered`) or counted `dropped`, exactly once.
#[test]
fn receivers_dropped_while_publishing_leave_nothing_uncounted() {
    const PUBLISHERS: usize = 2;
    const CHURNERS: usize = 2;
    let per_mode = Duration::from_millis(common::env_number("STREAM_EDGES_RACE_MS", 150));
    for mode in MODES {
        let runtime = common::runtime(1);
        let bus = Bus::<u32>::builder()
            .delivery(mode)
            .workers(2)
            .runtime(runtime.handle().clone())
            .build()
            .unwrap();
        let stop = Arc::new(AtomicBool::new(false));
        let start = Arc::new(Barrier::new(PUBLISHERS + CHURNERS + 1));

        let publishers: Vec<_> = (0..PUBLISHERS)
            .map(|p| {
                let (bus, stop, start) = (bus.clone(), Arc::clone(&stop), Arc::clone(&start));
                std::thread::spawn(move || {
                    start.wait();
                    let (mut matched, mut seq) = (0u64, 0u32);
                    while !stop.load(Ordering::Relaxed) {
                        matched += bus.publish(&format!("race/{p}"), seq).unwrap() as u64;
                        seq = seq.wrapping_add(1);
                    }
                    matched
                })
            })
            .collect();

        let churners: Vec<_> = (0..CHURNERS)
            .map(|c| {
                let (bus, stop, start) = (bus.clone(), Arc::clone(&stop), Arc::clone(&start));
                std::thread::spawn(move || {
                    start.wait();
                    let mut round = 0usize;
                    while !stop.load(Ordering::Relaxed) {
                        let mut receivers: Vec<Receiver<u32>> = (0..8)
                            .map(|i| {
                                let filter = if i % 2 == 0 { "race/+" } else { "race/#" };
                                bus.subscribe_stream_with_capacity(filter, 1 + (i + c) % 3)
                                    .unwrap()
                            })
                            .collect();
                        // Take a little, so `delivered` plays its part too.
                        for rx in receivers.iter_mut().skip(round % 2) {
                            let _ = rx.try_recv();
                        }
                        // Dropped one by one while the publishers push.
                        drop(receivers);
                        round += 1;
                    }
                    round
                })
            })
            .collect();

        let counted = common::within(LIMIT + per_mode, "the drop race", move || {
            start.wait();
            std::thread::sleep(per_mode);
            stop.store(true, Ordering::Relaxed);
            let matched: u64 = publishers.into_iter().map(|p| p.join().unwrap()).sum();
            let rounds: usize = churners.into_iter().map(|c| c.join().unwrap()).sum();
            (matched, rounds)
        });
        let (matched, rounds) = counted;
        assert!(rounds > 0 && matched > 0, "{mode:?}: the race never ran");
        assert_eq!(bus.subscriptions_count(), 0, "{mode:?}");
        let stats = bus.stats();
        assert_eq!(stats.inflight, 0, "{mode:?}");
        assert_eq!(
            stats.delivered + stats.dropped,
            matched,
            "{mode:?}: {matched} stream deliveries reported by publish, but {} delivered + {} \
             dropped ({} rounds of subscribing and dropping)",
            stats.delivered,
            stats.dropped,
            rounds
        );
        drop(bus);
        runtime.shutdown_timeout(LIMIT);
    }
}

// ---------------------------------------------------------------------------
// 2. Loss visible in the stream: `recv_lagged` / `try_recv_lagged`.
// ---------------------------------------------------------------------------

/// A mailbox of 4 and 10 messages: `Lagged(6)` first (the six oldest were
/// pushed out), then the four newest in order, then, once the bus is closed,
/// `Closed`, and `Closed` again. The counters agree. In every mode, with a
/// handler on the same topic so the mode's dispatch runs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn recv_lagged_reports_the_gap_before_the_newest_then_closed() {
    for mode in MODES {
        let bus = bus(mode);
        let mut rx = bus.subscribe_stream_with_capacity("lag/#", 4).unwrap();
        let _handler = bus.subscribe("lag/+", |_: &Message<u32>| {}).unwrap();
        for id in 0..10 {
            assert_eq!(bus.publish("lag/a", id).unwrap(), 2, "{mode:?}");
        }
        assert_eq!(
            lagged_soon(&mut rx).await,
            Err(RecvError::Lagged(6)),
            "{mode:?}"
        );
        for id in 6..10 {
            assert_eq!(lagged_soon(&mut rx).await, Ok(id), "{mode:?}");
        }
        assert_eq!(rx.lost(), 6, "{mode:?}");
        tokio::time::timeout(LIMIT, bus.close())
            .await
            .expect("close")
            .unwrap();
        assert_eq!(
            lagged_soon(&mut rx).await,
            Err(RecvError::Closed),
            "{mode:?}"
        );
        assert_eq!(
            lagged_soon(&mut rx).await,
            Err(RecvError::Closed),
            "{mode:?}"
        );
        let stats = bus.stats();
        assert_eq!(stats.dropped, 6, "{mode:?}");
        assert_eq!(
            stats.delivered,
            10 + 4,
            "{mode:?}: 10 handler calls, 4 taken"
        );
    }
}

/// A lag is reported once, just before the message after the gap; a second
/// gap is reported on its own, with only its own count. `recv()` keeps its
/// plain `Option` shape: it skips lag reports, and a later `recv_lagged`
/// still reports the loss it did not.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_gap_is_reported_once_and_recv_is_unchanged() {
    for mode in MODES {
        let bus = bus(mode);
        let mut rx = bus.subscribe_stream_with_capacity("gap/#", 4).unwrap();
        for id in 0..6 {
            bus.publish("gap/a", id).unwrap();
        }
        assert_eq!(
            lagged_soon(&mut rx).await,
            Err(RecvError::Lagged(2)),
            "{mode:?}"
        );
        assert_eq!(lagged_soon(&mut rx).await, Ok(2), "{mode:?}");
        assert_eq!(lagged_soon(&mut rx).await, Ok(3), "{mode:?}");
        // 4 and 5 are queued; 6..=8 push out 4, 5 and 6.
        for id in 6..11 {
            bus.publish("gap/a", id).unwrap();
        }
        assert_eq!(
            lagged_soon(&mut rx).await,
            Err(RecvError::Lagged(3)),
            "{mode:?}"
        );
        for id in 7..11 {
            assert_eq!(lagged_soon(&mut rx).await, Ok(id), "{mode:?}");
        }
        // Nothing lost since: no report, just the next message.
        bus.publish("gap/a", 11).unwrap();
        assert_eq!(lagged_soon(&mut rx).await, Ok(11), "{mode:?}");

        // `recv` ignores lag; the loss is still reported by the next
        // `recv_lagged`, which is where this receiver first learns of it.
        for id in 12..18 {
            bus.publish("gap/a", id).unwrap();
        }
        let plain = tokio::time::timeout(LIMIT, rx.recv()).await.expect("recv");
        assert_eq!(plain.map(|m| *m.data()), Some(14), "{mode:?}");
        assert_eq!(
            lagged_soon(&mut rx).await,
            Err(RecvError::Lagged(2)),
            "{mode:?}"
        );
        assert_eq!(lagged_soon(&mut rx).await, Ok(15), "{mode:?}");
        assert_eq!(rx.lost(), 2 + 3 + 2, "{mode:?}");

        // `while let Some(m) = rx.recv().await` still drains and ends.
        drop(bus);
        let mut rest = Vec::new();
        let drained = tokio::time::timeout(LIMIT, async {
            while let Some(m) = rx.recv().await {
                rest.push(*m.data());
            }
        });
        drained
            .await
            .expect("recv did not end after the bus was dropped");
        assert_eq!(rest, [16, 17], "{mode:?}");
    }
}

/// `try_recv_lagged` says the same without waiting: `Empty` while nothing
/// is queued, `Lagged(n)` once, the newest messages, and `Closed` at the end.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn try_recv_lagged_reports_empty_lag_messages_and_closed() {
    for mode in MODES {
        let bus = bus(mode);
        let mut rx = bus.subscribe_stream_with_capacity("try/#", 4).unwrap();
        assert_eq!(rx.try_recv_lagged().unwrap_err(), TryRecvLaggedError::Empty);
        for id in 0..10 {
            bus.publish("try/a", id).unwrap();
        }
        assert_eq!(
            rx.try_recv_lagged().unwrap_err(),
            TryRecvLaggedError::Lagged(6),
            "{mode:?}"
        );
        for id in 6..10 {
            assert_eq!(*rx.try_recv_lagged().unwrap().data(), id, "{mode:?}");
        }
        assert_eq!(rx.try_recv_lagged().unwrap_err(), TryRecvLaggedError::Empty);
        bus.publish("try/a", 10).unwrap();
        tokio::time::timeout(LIMIT, bus.close())
            .await
            .expect("close")
            .unwrap();
        // Queued before the close: still received, then the end.
        assert_eq!(*rx.try_recv_lagged().unwrap().data(), 10, "{mode:?}");
        assert_eq!(
            rx.try_recv_lagged().unwrap_err(),
            TryRecvLaggedError::Closed,
            "{mode:?}"
        );
        assert_eq!(bus.stats().dropped, 6, "{mode:?}");
        assert_eq!(bus.stats().delivered, 5, "{mode:?}");
    }
}

/// A `recv_lagged` future dropped before it completes loses nothing; a
/// waiting one is woken by a publish from another thread, and by `close`
/// (with `Closed`), or by the last bus handle going away.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn recv_lagged_is_cancel_safe_and_woken() {
    for mode in MODES {
        let bus = bus(mode);
        let mut rx = bus.subscribe_stream_with_capacity("c/#", 2).unwrap();

        // Cancelled while waiting: nothing was queued, nothing is lost.
        let cancelled = tokio::time::timeout(Duration::from_millis(20), rx.recv_lagged()).await;
        assert!(cancelled.is_err(), "{mode:?}: nothing was published yet");
        // Polled once (parked on an empty mailbox), then dropped while
        // messages arrive: the lag and the messages are all still there.
        {
            let mut parked = std::pin::pin!(rx.recv_lagged());
            let waker = std::task::Waker::noop();
            let mut cx = std::task::Context::from_waker(waker);
            assert!(
                std::future::Future::poll(parked.as_mut(), &mut cx).is_pending(),
                "{mode:?}: nothing was published yet"
            );
            for id in 0..3 {
                bus.publish("c/a", id).unwrap();
            }
        }
        assert_eq!(
            lagged_soon(&mut rx).await,
            Err(RecvError::Lagged(1)),
            "{mode:?}"
        );
        assert_eq!(lagged_soon(&mut rx).await, Ok(1), "{mode:?}");
        assert_eq!(lagged_soon(&mut rx).await, Ok(2), "{mode:?}");

        // A waiting `recv_lagged` is woken by a publish (seen before the
        // bus closes, so close's own wake-up cannot stand in for it), then
        // by close.
        let (got_first, first_seen) = tokio::sync::oneshot::channel();
        let waiter = tokio::spawn(async move {
            let first = rx.recv_lagged().await.map(|m| *m.data());
            let _ = got_first.send(first);
            let end = rx.recv_lagged().await.map(|m| *m.data());
            (first, end)
        });
        tokio::time::sleep(Duration::from_millis(20)).await;
        let publisher = bus.clone();
        std::thread::spawn(move || publisher.publish("c/a", 77).unwrap())
            .join()
            .unwrap();
        let first = tokio::time::timeout(LIMIT, first_seen)
            .await
            .expect("the publish did not wake the waiting recv_lagged")
            .unwrap();
        assert_eq!(first, Ok(77), "{mode:?}");
        tokio::time::timeout(LIMIT, bus.close())
            .await
            .expect("close")
            .unwrap();
        let ended = tokio::time::timeout(LIMIT, waiter)
            .await
            .expect("a waiting recv_lagged was not woken")
            .unwrap();
        assert_eq!(ended, (Ok(77), Err(RecvError::Closed)), "{mode:?}");

        // Dropping the last bus handle ends a waiting `recv_lagged` too.
        let bus = self::bus(mode);
        let mut idle = bus.subscribe_stream("idle").unwrap();
        let waiter = tokio::spawn(async move { idle.recv_lagged().await.map(|m| *m.data()) });
        tokio::time::sleep(Duration::from_millis(20)).await;
        drop(bus);
        let ended = tokio::time::timeout(LIMIT, waiter)
            .await
            .expect("a waiting recv_lagged was not woken by the bus going away")
            .unwrap();
        assert_eq!(ended, Err(RecvError::Closed), "{mode:?}");
    }
}

/// Loss and errors read well: `Lagged` names the count, and both variants
/// are plain values to match on.
#[test]
fn lag_errors_say_what_happened() {
    assert_eq!(
        RecvError::Lagged(6).to_string(),
        "this receiver fell behind: 6 messages were lost before the next one"
    );
    assert_eq!(
        RecvError::Closed.to_string(),
        "the bus is closed and this receiver has taken every message"
    );
    assert_eq!(
        TryRecvLaggedError::Lagged(6).to_string(),
        RecvError::Lagged(6).to_string()
    );
    // `try_recv` cannot tell a closed bus from a disconnected stream.
    assert_eq!(
        TryRecvError::Closed.to_string(),
        "nothing more will come: the bus is closed, or this stream was disconnected (try_recv_lagged tells which)"
    );
    assert_eq!(
        TryRecvLaggedError::Closed.to_string(),
        RecvError::Closed.to_string()
    );
    assert_eq!(
        TryRecvLaggedError::Empty.to_string(),
        TryRecvError::Empty.to_string()
    );
}

// ---------------------------------------------------------------------------
// 3. `FusedStream`.
// ---------------------------------------------------------------------------

fn is_fused<S: FusedStream>(stream: &S) -> bool {
    stream.is_terminated()
}

/// `is_terminated` is false while the stream may still yield, including
/// after `close` while messages remain queued, and true once it returned
/// `None`; polling again keeps returning `None`. In every mode.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn receiver_is_a_fused_stream() {
    for mode in MODES {
        let bus = bus(mode);
        let mut rx = bus.subscribe_stream("f/#").unwrap();
        assert!(!is_fused(&rx), "{mode:?}");
        bus.publish("f/a", 1).unwrap();
        bus.publish("f/a", 2).unwrap();
        assert_eq!(next_soon(&mut rx).await, Some(1), "{mode:?}");
        tokio::time::timeout(LIMIT, bus.close())
            .await
            .expect("close")
            .unwrap();
        assert!(!is_fused(&rx), "{mode:?}: a message is still queued");
        assert_eq!(next_soon(&mut rx).await, Some(2), "{mode:?}");
        assert!(!is_fused(&rx), "{mode:?}: `None` not returned yet");
        assert_eq!(next_soon(&mut rx).await, None, "{mode:?}");
        assert!(is_fused(&rx), "{mode:?}");
        assert_eq!(next_soon(&mut rx).await, None, "{mode:?}");
        assert!(is_fused(&rx), "{mode:?}");

        // The end seen through `recv` or the lagged calls counts too.
        let bus = self::bus(mode);
        let mut by_recv = bus.subscribe_stream("g/#").unwrap();
        let mut by_lagged = bus.subscribe_stream("g/#").unwrap();
        drop(bus);
        assert!(!is_fused(&by_recv) && !is_fused(&by_lagged), "{mode:?}");
        let end = tokio::time::timeout(LIMIT, by_recv.recv())
            .await
            .expect("recv");
        assert!(end.is_none(), "{mode:?}");
        assert!(is_fused(&by_recv), "{mode:?}");
        assert_eq!(lagged_soon(&mut by_lagged).await, Err(RecvError::Closed));
        assert!(is_fused(&by_lagged), "{mode:?}");
        assert_eq!(next_soon(&mut by_lagged).await, None, "{mode:?}");
    }
}

/// An open stream with nothing queued is not terminated, however long it
/// waits.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_idle_open_stream_is_not_terminated() {
    let bus = bus(DeliveryMode::Inline);
    let mut rx = bus.subscribe_stream("idle/#").unwrap();
    let waited = tokio::time::timeout(Duration::from_millis(20), next_soon(&mut rx)).await;
    assert!(waited.is_err());
    assert!(!is_fused(&rx));
    assert_eq!(rx.try_recv().unwrap_err(), TryRecvError::Empty);
    assert!(!is_fused(&rx));
}

// ---------------------------------------------------------------------------
// 4. A zero capacity argument.
// ---------------------------------------------------------------------------

/// `subscribe_stream_with_capacity(_, 0)` names the argument
/// (`InvalidArgument { name: "capacity" }`), not a `Config` field, and
/// subscribes nothing; `Config::stream_capacity = 0` is still a config error.
#[test]
fn zero_capacity_argument_is_an_invalid_argument() {
    for mode in [DeliveryMode::WorkerPool, DeliveryMode::Inline] {
        let bus = Bus::<u32>::builder().delivery(mode).build().unwrap();
        let err = bus.subscribe_stream_with_capacity("a/#", 0).unwrap_err();
        assert!(
            matches!(
                &err,
                Error::InvalidArgument {
                    name: "capacity",
                    value,
                    reason: "must be at least 1",
                } if value == "0"
            ),
            "{mode:?}: {err:?}"
        );
        assert_eq!(
            err.to_string(),
            "invalid argument: `capacity` = 0 must be at least 1"
        );
        assert_eq!(bus.subscriptions_count(), 0, "{mode:?}");
        // One is fine.
        assert_eq!(
            bus.subscribe_stream_with_capacity("a/#", 1)
                .unwrap()
                .capacity(),
            1
        );
    }
    let config = Config {
        stream_capacity: 0,
        ..Config::default()
    };
    let err = Bus::<u32>::new(config).unwrap_err();
    assert!(
        matches!(
            err,
            Error::InvalidConfig {
                field: "stream_capacity",
                ..
            }
        ),
        "{err:?}"
    );
}
