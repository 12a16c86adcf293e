//! Stream subscriptions through the public API: publish order per publisher
//! in every mode, `recv`/`try_recv`/`Stream` and how they end (close, last
//! bus handle dropped), and a mailbox nobody reads (bounded, drop-oldest,
//! every loss counted).

mod common;

use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use blazesub::{Bus, DeliveryMode, Message, Receiver, TryRecvError};
use common::MODES;
use futures_core::Stream;

fn bus(mode: DeliveryMode) -> Bus<u32> {
    Bus::<u32>::builder()
        .delivery(mode)
        .workers(2)
        .build()
        .unwrap()
}

/// The next item of `rx` through its `futures_core::Stream` implementation.
async fn next_item(rx: &mut Receiver<u32>) -> Option<Arc<Message<u32>>> {
    std::future::poll_fn(|cx| Pin::new(&mut *rx).poll_next(cx)).await
}

/// `recv()`, failing the test instead of hanging if nothing comes.
async fn recv_soon(rx: &mut Receiver<u32>) -> Option<Arc<Message<u32>>> {
    tokio::time::timeout(Duration::from_secs(10), rx.recv())
        .await
        .expect("recv() did not complete within 10 s")
}

// ---------------------------------------------------------------------------
// 2. Ordering.
// ---------------------------------------------------------------------------

/// One publisher, 10,000 messages, a mailbox big enough for all: they arrive
/// complete and in publish order, in every mode (with handler subscribers on
/// the same topic, so the mode's dispatch really runs).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_publisher_order_is_kept_in_every_mode() {
    const N: u32 = 10_000;
    for mode in MODES {
        let bus = bus(mode);
        let mut rx = bus.subscribe_stream_with_capacity("s/#", 16_384).unwrap();
        let _handler = bus.subscribe("s/+", |_: &Message<u32>| {}).unwrap();
        for id in 0..N {
            assert_eq!(bus.publish("s/x", id).unwrap(), 2, "{mode:?}");
        }
        assert_eq!(rx.len(), N as usize, "{mode:?}");
        for id in 0..N {
            let m = recv_soon(&mut rx).await.expect("stream ended early");
            assert_eq!(*m.data(), id, "{mode:?}: stream out of publish order");
            assert_eq!(m.topic(), "s/x");
        }
        assert_eq!(rx.lost(), 0, "{mode:?}");
        assert_eq!(rx.try_recv().unwrap_err(), TryRecvError::Empty, "{mode:?}");
        bus.close().await.unwrap();
        assert!(recv_soon(&mut rx).await.is_none(), "{mode:?}");
        let stats = bus.stats();
        assert_eq!(stats.delivered, 2 * u64::from(N), "{mode:?}");
        assert_eq!(stats.dropped, 0, "{mode:?}");
    }
}

const PUBLISHERS: u32 = 3;
const PER_PUBLISHER: u32 = 10_000;

/// Three publisher threads, each publishing its own increasing sequence,
/// while one receiver (room for everything) and one lossy receiver (room for
/// 64) are read concurrently. Each publisher's messages arrive in its order:
/// all of them for the first, an increasing subsequence for the second, whose
/// gaps are exactly what `lost()` and `stats().dropped` count.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_concurrent_publisher_keeps_its_order() {
    let total = PUBLISHERS * PER_PUBLISHER;
    for mode in MODES {
        let bus = bus(mode);
        let mut full = bus
            .subscribe_stream_with_capacity("o/+", total as usize + 1)
            .unwrap();
        let mut lossy = bus.subscribe_stream_with_capacity("o/#", 64).unwrap();

        let lossy_reader = tokio::spawn(async move {
            let mut next = [0u32; PUBLISHERS as usize];
            let mut received = 0u64;
            while let Some(m) = lossy.recv().await {
                let (p, seq) = (*m.data() / PER_PUBLISHER, *m.data() % PER_PUBLISHER);
                assert!(
                    seq >= next[p as usize],
                    "lossy stream: publisher {p}'s message {seq} came after {}",
                    next[p as usize] - 1
                );
                next[p as usize] = seq + 1;
                received += 1;
            }
            (received, lossy.lost())
        });

        let publishers: Vec<_> = (0..PUBLISHERS)
            .map(|p| {
                let bus = bus.clone();
                std::thread::spawn(move || {
                    let topic = format!("o/{p}");
                    for seq in 0..PER_PUBLISHER {
                        bus.publish(&topic, p * PER_PUBLISHER + seq).unwrap();
                    }
                })
            })
            .collect();

        let mut next = [0u32; PUBLISHERS as usize];
        for _ in 0..total {
            let m = recv_soon(&mut full).await.expect("stream ended early");
            let (p, seq) = (*m.data() / PER_PUBLISHER, *m.data() % PER_PUBLISHER);
            assert_eq!(m.topic(), format!("o/{p}"));
            assert_eq!(
                seq, next[p as usize],
                "{mode:?}: publisher {p}'s messages out of order"
            );
            next[p as usize] += 1;
        }
        for publisher in publishers {
            publisher.join().unwrap();
        }
        assert_eq!(full.lost(), 0, "{mode:?}");
        bus.close().await.unwrap();
        assert!(recv_soon(&mut full).await.is_none(), "{mode:?}");

        let (received, lost) = tokio::time::timeout(Duration::from_secs(10), lossy_reader)
            .await
            .expect("the lossy reader did not end after close")
            .unwrap();
        assert_eq!(
            received + lost,
            u64::from(total),
            "{mode:?}: lossy stream received {received}, lost {lost}, of {total}"
        );
        let stats = bus.stats();
        assert_eq!(stats.dropped, lost, "{mode:?}: stats().dropped vs lost()");
        assert_eq!(stats.delivered, u64::from(total) + received, "{mode:?}");
    }
}

// ---------------------------------------------------------------------------
// recv / try_recv / Stream, and how a stream ends.
// ---------------------------------------------------------------------------

/// `try_recv` says `Empty` while the bus is open and `Closed` once it is
/// closed and drained; messages queued before `close` are still received;
/// `recv` and the `Stream` impl then return `None`, and a `recv` already
/// waiting is woken by `close`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn try_recv_recv_and_stream_end_after_close() {
    for mode in MODES {
        let bus = bus(mode);
        let mut rx = bus.subscribe_stream("t/#").unwrap();
        let mut as_stream = bus.subscribe_stream("t/+").unwrap();
        assert_eq!(rx.try_recv().unwrap_err(), TryRecvError::Empty);
        assert_eq!(rx.filter(), "t/#");
        assert_eq!(rx.capacity(), 1_024);

        for id in 0..3 {
            bus.publish("t/a", id).unwrap();
        }
        assert_eq!(*rx.try_recv().unwrap().data(), 0);
        assert_eq!(*recv_soon(&mut rx).await.unwrap().data(), 1);
        assert_eq!(*next_item(&mut as_stream).await.unwrap().data(), 0);
        assert_eq!(*next_item(&mut as_stream).await.unwrap().data(), 1);

        // A waiting `recv` is woken by a publish from another thread (seen
        // before the bus closes, so close's wake-up cannot stand in for it).
        let mut waiting = bus.subscribe_stream("w/wake").unwrap();
        let (got_first, first_seen) = tokio::sync::oneshot::channel();
        let waiter = tokio::spawn(async move {
            let first = waiting.recv().await.map(|m| *m.data());
            let _ = got_first.send(first);
            let end = waiting.recv().await.map(|m| *m.data());
            (first, end)
        });
        tokio::time::sleep(Duration::from_millis(20)).await;
        let publisher = bus.clone();
        std::thread::spawn(move || publisher.publish("w/wake", 77).unwrap())
            .join()
            .unwrap();
        let first = tokio::time::timeout(Duration::from_secs(10), first_seen)
            .await
            .expect("a recv waiting on an empty mailbox was not woken by a publish")
            .unwrap();
        assert_eq!(first, Some(77), "{mode:?}");

        bus.publish("t/a", 3).unwrap();
        bus.close().await.unwrap();
        // Still queued: 2 and 3; then the end.
        assert_eq!(*rx.try_recv().unwrap().data(), 2, "{mode:?}");
        assert_eq!(*recv_soon(&mut rx).await.unwrap().data(), 3, "{mode:?}");
        assert_eq!(rx.try_recv().unwrap_err(), TryRecvError::Closed, "{mode:?}");
        assert!(recv_soon(&mut rx).await.is_none(), "{mode:?}");
        assert_eq!(*next_item(&mut as_stream).await.unwrap().data(), 2);
        assert_eq!(*next_item(&mut as_stream).await.unwrap().data(), 3);
        assert!(next_item(&mut as_stream).await.is_none(), "{mode:?}");
        // The waiter got 77, then was woken by close with `None`.
        let ended = tokio::time::timeout(Duration::from_secs(10), waiter)
            .await
            .expect("a recv waiting on an empty mailbox was not woken by close")
            .unwrap();
        assert_eq!(ended, (Some(77), None), "{mode:?}");
        assert_eq!(bus.stats().dropped, 0);
    }
}

/// Dropping the last `Bus` handle (no `close`) also ends the stream, once
/// drained; dropping one of several clones does not. A `recv` already
/// waiting is woken by the drop.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn recv_ends_when_the_last_bus_handle_is_dropped() {
    for mode in MODES {
        let bus = bus(mode);
        let clone = bus.clone();
        let mut rx = bus.subscribe_stream("d/#").unwrap();
        let mut idle = bus.subscribe_stream("idle").unwrap();
        let idle_waiter = tokio::spawn(async move { idle.recv().await.is_none() });

        bus.publish("d/1", 1).unwrap();
        drop(bus);
        assert_eq!(*recv_soon(&mut rx).await.unwrap().data(), 1);
        assert_eq!(
            rx.try_recv().unwrap_err(),
            TryRecvError::Empty,
            "{mode:?}: a clone of the bus is still alive"
        );
        clone.publish("d/2", 2).unwrap();
        clone.publish("d/3", 3).unwrap();
        drop(clone);

        assert_eq!(*recv_soon(&mut rx).await.unwrap().data(), 2, "{mode:?}");
        assert_eq!(*rx.try_recv().unwrap().data(), 3, "{mode:?}");
        assert_eq!(rx.try_recv().unwrap_err(), TryRecvError::Closed, "{mode:?}");
        assert!(recv_soon(&mut rx).await.is_none(), "{mode:?}");
        let woken = tokio::time::timeout(Duration::from_secs(10), idle_waiter)
            .await
            .expect("a waiting recv was not woken when the last bus handle was dropped")
            .unwrap();
        assert!(woken, "{mode:?}");
        // Dropping the receiver after its bus is gone is fine.
        drop(rx);
    }
}

// ---------------------------------------------------------------------------
// 8. A stalled stream.
// ---------------------------------------------------------------------------

/// A receiver nobody reads while 1,000,000 messages are published holds the
/// newest 1,024 (the default capacity) in order, and counts the rest lost,
/// in `lost()` and in `stats().dropped`. The publisher never waited.
#[test]
fn a_stalled_stream_keeps_the_newest_and_counts_the_rest() {
    const N: u32 = 1_000_000;
    let bus = Bus::<u32>::builder()
        .delivery(DeliveryMode::Inline)
        .build()
        .unwrap();
    let mut rx = bus.subscribe_stream("stall/#").unwrap();
    let capacity = rx.capacity();
    assert_eq!(capacity, 1_024, "the documented default");
    for id in 0..N {
        bus.publish("stall/x", id).unwrap();
    }
    let expected_lost = u64::from(N) - capacity as u64;
    assert_eq!(rx.len(), capacity);
    assert_eq!(rx.lost(), expected_lost);
    let stats = bus.stats();
    assert_eq!(stats.dropped, expected_lost);
    assert_eq!(stats.delivered, 0, "nothing was taken yet");
    assert_eq!(stats.published, u64::from(N));
    for id in N - capacity as u32..N {
        assert_eq!(
            *rx.try_recv().unwrap().data(),
            id,
            "not the newest, in order"
        );
    }
    assert_eq!(rx.try_recv().unwrap_err(), TryRecvError::Empty);
    assert_eq!(bus.stats().delivered, capacity as u64);
    assert_eq!(rx.lost(), expected_lost);
}
